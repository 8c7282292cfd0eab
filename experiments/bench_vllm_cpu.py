"""pagedjax against vLLM's CPU build: decode tokens/s on the same prompts, greedy tokens checked.

  bash experiments/bench_vllm_cpu.sh runs/bench_vllm_cpu         # all three steps (below)
  python -m experiments.bench_vllm_cpu --step=pagedjax --workdir=runs/bench_vllm_cpu
  python -m experiments.bench_vllm_cpu --step=compare --workdir=runs/bench_vllm_cpu

Optional, and not part of the test suite: vLLM (package `vllm-cpu`) pins its own torch and
transformers, so it runs in a venv of its own (experiments/bench_vllm_cpu.sh makes it) and the
two sides meet only through files in the workdir:
  --step=pagedjax  (this venv) loads SmolLM2-135M-Instruct float32, writes it as an HF folder
                   (WORKDIR/hf_model: config.json + safetensors, the weights the engine runs,
                   built as experiments/bench_decode.py builds its HF model), writes the prompts
                   (WORKDIR/prompts.json: `prompt_len`-token ids of real text, as bench_decode
                   makes them) and times the engine on them -> WORKDIR/pagedjax.json;
  experiments/bench_vllm_cpu_vllm.py (the vLLM venv) runs vLLM's offline LLM on the same ids
                   from the HF folder -> WORKDIR/vllm.json;
  --step=compare   (this venv) checks the greedy tokens of both sides against each other per
                   batch and writes WORKDIR/summary.json, results.csv and a markdown table.
Both sides: float32, greedy, EOS ignored (`output_len` new tokens for every prompt), prefix
caching off (the warm-up runs the same prompts), all of a batch's prompts submitted at once,
one warm-up round (compiles; vLLM also captures nothing on CPU), then `rounds` timed rounds,
medians. tokens/s counts generated tokens over the wall time of the whole generate call
(prefill included), batch * output_len / seconds.

The config is configs/bench_decode.py (the engine's sizes: max_batch_size 64, 1100 blocks of
16, decode_min_rows 1); this module replaces its bench section's batches / lengths with its own
flags. The engine's attention path is config.attention.impl ('auto': the native `cpu` kernel on
CPU where it builds; --config.attention.impl=xla for the plain-JAX one).
"""
import json
import os
import statistics
import time

from absl import flags
import numpy as np

from experiments import cli

_STEP = flags.DEFINE_enum('step', None, ['pagedjax', 'compare'],
                          'pagedjax: export + time the engine; compare: read both sides.')
_BATCHES = flags.DEFINE_list('batches', ['1', '8', '32'], 'Batch sizes (prompts at once).')
_PROMPT_LEN = flags.DEFINE_integer('prompt_len', 128, 'Prompt tokens per sequence.')
_OUTPUT_LEN = flags.DEFINE_integer('output_len', 128, 'Greedy new tokens per sequence.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Timed rounds after the warm-up.')
_SEED = flags.DEFINE_integer('seed', 0, 'Which text passages the prompts are cut from.')

COLUMNS = ('batch', 'prompt_len', 'output_len', 'pagedjax_tokens_per_s', 'vllm_tokens_per_s',
           'pagedjax_over_vllm', 'token_agreement', 'identical_sequences', 'first_mismatch')


# ------------------------------------------------------------------------------------------------
# Step 1: the pagedjax side
# ------------------------------------------------------------------------------------------------
def export_and_time(config, workdir, batches, prompt_len, output_len, rounds, seed):
  """Writes hf_model/, prompts.json and pagedjax.json (see the module docstring)."""
  from experiments import bench_decode  # pylint: disable=import-outside-toplevel
  from pagedjax import factory  # pylint: disable=import-outside-toplevel
  from pagedjax.studies import run_info
  from pagedjax import kernels  # pylint: disable=import-outside-toplevel

  model_cfg, params, tokenizer = factory.load_model_and_tokenizer(config)
  engine = factory.make_engine(config, model_cfg, params, tokenizer)
  prompts = bench_decode.make_prompts(tokenizer, max(batches), [prompt_len] * max(batches),
                                      model_cfg.vocab_size, seed)
  hf = bench_decode.hf_model_from_params(model_cfg, params)
  hf.save_pretrained(os.path.join(workdir, 'hf_model'), safe_serialization=True)
  run_info.write_json(os.path.join(workdir, 'prompts.json'), dict(
      prompts=prompts, batches=batches, prompt_len=prompt_len, output_len=output_len,
      rounds=rounds, max_model_len=prompt_len + output_len,
      model=config.model.source, dtype=model_cfg.dtype))

  results = {}
  for b in batches:
    bench_decode.engine_run(engine, prompts[:b], output_len)  # warm-up: compiles every shape
    compiled = engine.num_compilations
    walls, outputs = [], None
    for _ in range(rounds):
      wall, outputs, _ = bench_decode.engine_run(engine, prompts[:b], output_len)
      walls.append(wall)
    results[str(b)] = dict(walls_s=walls, wall_s=statistics.median(walls),
                           tokens_per_s=b * output_len / statistics.median(walls),
                           output_ids=outputs,
                           compilations_in_timed_rounds=engine.num_compilations - compiled)
    print(f'pagedjax B={b}: {results[str(b)]["tokens_per_s"]:.1f} tokens/s', flush=True)
  impl = config.attention.impl
  run_info.write_json(os.path.join(workdir, 'pagedjax.json'), dict(
      batches=results, attention_impl=kernels.best_impl() if impl == 'auto' else impl,
      load_average_1m=os.getloadavg()[0], **run_info.summary_fields(config)))


# ------------------------------------------------------------------------------------------------
# Step 3: both sides side by side
# ------------------------------------------------------------------------------------------------
def compare_outputs(a, b):
  """[n][len] token ids of both sides -> (share of positions that agree, sequences identical,
  first mismatch as 'prompt i, token t' or None)."""
  total = same = identical = 0
  first = None
  for i, (x, y) in enumerate(zip(a, b)):
    x, y = [int(t) for t in x], [int(t) for t in y]
    total += max(len(x), len(y))
    same += sum(p == q for p, q in zip(x, y))
    identical += x == y
    if x != y and first is None:
      t = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
      first = f'prompt {i}, token {t}'
  return (same / total if total else 1.0), identical, first


def compare(workdir):
  from pagedjax.studies import run_info  # pylint: disable=import-outside-toplevel
  read = lambda name: json.load(open(os.path.join(workdir, name)))
  setup, ours, theirs = read('prompts.json'), read('pagedjax.json'), read('vllm.json')
  rows = []
  for b in setup['batches']:
    p, v = ours['batches'][str(b)], theirs['batches'][str(b)]
    share, identical, first = compare_outputs(p['output_ids'], v['output_ids'])
    rows.append(dict(batch=b, prompt_len=setup['prompt_len'], output_len=setup['output_len'],
                     pagedjax_tokens_per_s=p['tokens_per_s'], vllm_tokens_per_s=v['tokens_per_s'],
                     pagedjax_over_vllm=p['tokens_per_s'] / v['tokens_per_s'],
                     token_agreement=share, identical_sequences=f'{identical}/{b}',
                     first_mismatch=first))
  table = run_info.markdown_table(rows, COLUMNS)
  summary = dict(rows=rows, markdown_table=table, pagedjax_attention_impl=ours['attention_impl'],
                 vllm_version=theirs.get('vllm_version'), vllm_env=theirs.get('env'),
                 load_average_1m={'pagedjax': ours['load_average_1m'],
                                  'vllm': theirs.get('load_average_1m')},
                 pagedjax_versions=ours.get('versions'), git_revision=ours.get('git_revision'))
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  run_info.write_csv(os.path.join(workdir, 'results.csv'), rows, COLUMNS)
  print(table)
  if any(r['token_agreement'] < 1.0 for r in rows):
    print('greedy tokens differ (float32 near-ties can flip an argmax; see first_mismatch)')


def main(argv):
  del argv
  workdir = cli.prepare_workdir(flags.FLAGS.workdir)
  if _STEP.value == 'compare':
    compare(workdir)
    return
  if _STEP.value is None:
    raise cli.WorkdirError('--step is required: pagedjax (this venv) or compare; the vLLM side '
                           'is experiments/bench_vllm_cpu_vllm.py (see bench_vllm_cpu.sh)')
  # pylint: disable-next=import-outside-toplevel
  from pagedjax.config import ConfigError
  from pagedjax.studies.workloads import validate_config
  config = validate_config(flags.FLAGS.config)
  batches = sorted({int(b) for b in _BATCHES.value})
  limit = config.engine.max_batch_size
  if not batches or batches[0] < 1 or batches[-1] > limit:
    raise ConfigError(f'--batches={_BATCHES.value} is not allowed: sizes in [1, '
                      f'engine.max_batch_size={limit}]')
  if _PROMPT_LEN.value + _OUTPUT_LEN.value > config.engine.max_seq_len:
    raise ConfigError(f'--prompt_len + --output_len = {_PROMPT_LEN.value + _OUTPUT_LEN.value} '
                      f'is not allowed: at most engine.max_seq_len={config.engine.max_seq_len}')
  t0 = time.perf_counter()
  export_and_time(config, workdir, batches, _PROMPT_LEN.value, _OUTPUT_LEN.value,
                  _ROUNDS.value, _SEED.value)
  print(f'wrote {workdir}/hf_model, prompts.json, pagedjax.json '
        f'({time.perf_counter() - t0:.0f} s; load average {np.round(os.getloadavg()[0], 1)})')


if __name__ == '__main__':
  cli.define_flags('configs/bench_decode.py', 'Engine config (its bench section is not read).',
                   lock_config=False)
  cli.run(main)
