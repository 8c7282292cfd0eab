"""pagedjax against vLLM's CPU build: decode tokens/s on the same prompts, greedy tokens checked.

  bash experiments/bench_vllm_cpu.sh runs/bench_vllm_cpu         # makes the vLLM venv, then:
  python -m experiments.bench_vllm_cpu --step=interleaved --workdir=runs/bench_vllm_cpu \
      [--linear_impls=auto,cpu_packed] [--vllm_python=VENV/bin/python]
  python -m experiments.bench_vllm_cpu --step=pagedjax --workdir=runs/bench_vllm_cpu  # or in turn
  python -m experiments.bench_vllm_cpu --step=compare --workdir=runs/bench_vllm_cpu

--step=interleaved (what the script runs) times both sides in one run: it starts
experiments/bench_vllm_cpu_vllm.py --serve in the vLLM venv (tuned as vLLM's CPU installation
guide asks unless --vllm_tuned=false: every core bound, none reserved, tcmalloc and libiomp5
preloaded) and, per batch, after a warm-up of each side, runs `rounds` rounds in which every
pagedjax engine (one per --linear_impls entry) and vLLM each run the batch once, in alternating
order, vLLM's processes stopped (SIGSTOP) while the engine runs (idle, they poll and took ~30%
of a core from it). This machine's speed drifts by 20-35% within minutes (other tenants of the
host: the same command gave 43.8 and 31.8 tokens/s at batch 1 ten minutes apart), so only
ratios of rounds taken side by side compare; the figure is the median of the per-round ratios,
with their range. Writes WORKDIR/summary.json, results.csv, table.md, bench_vllm_cpu.png and
vllm.log (vLLM's own output).

The older two-step way, each side alone in turn:

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
import copy
import json
import os
import statistics
import time

from absl import flags
import numpy as np

from experiments import cli
from experiments import cpu_time

_STEP = flags.DEFINE_enum('step', None, ['pagedjax', 'compare', 'interleaved'],
                          'pagedjax: export + time the engine; compare: read both sides; '
                          'interleaved: both sides in one run, rounds alternating.')
_BATCHES = flags.DEFINE_list('batches', ['1', '8', '32'], 'Batch sizes (prompts at once).')
_PROMPT_LEN = flags.DEFINE_integer('prompt_len', 128, 'Prompt tokens per sequence.')
_OUTPUT_LEN = flags.DEFINE_integer('output_len', 128, 'Greedy new tokens per sequence.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Timed rounds after the warm-up.')
_SEED = flags.DEFINE_integer('seed', 0, 'Which text passages the prompts are cut from.')
_VLLM_PYTHON = flags.DEFINE_string(
    'vllm_python', os.path.join(os.environ.get('VLLM_VENV', '/tmp/venv-vllm-cpu'), 'bin',
                                'python'),
    "interleaved: the vLLM venv's python (experiments/bench_vllm_cpu.sh makes the venv).")
_VLLM_TUNED = flags.DEFINE_bool(
    'vllm_tuned', True, "interleaved: vLLM's process as its CPU installation guide asks (every "
    'core bound, none reserved, tcmalloc and the libiomp5 of its venv preloaded where found); '
    'False: as installed.')
_PAUSE_VLLM = flags.DEFINE_bool(
    'pause_vllm', True, "interleaved: stop vLLM's processes (SIGSTOP) while the engine runs, so "
    'that its idle polling takes no CPU from it; False leaves them running (the CPU they take '
    'then is in the results either way).')
_LINEAR_IMPLS = flags.DEFINE_list(
    'linear_impls', [], "interleaved: one engine per engine.linear_impl (default: the config's "
    'alone), each timed against vLLM in the same rounds.')

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
  prompts = export(config, model_cfg, params, tokenizer, workdir, batches, prompt_len, output_len,
                   rounds, seed)

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


def export(config, model_cfg, params, tokenizer, workdir, batches, prompt_len, output_len, rounds,
           seed):
  """Writes WORKDIR/hf_model (the engine's weights as an HF folder) and prompts.json -> the
  prompts (token id lists, max(batches) of them)."""
  from experiments import bench_decode  # pylint: disable=import-outside-toplevel
  from pagedjax.studies import run_info  # pylint: disable=import-outside-toplevel
  prompts = bench_decode.make_prompts(tokenizer, max(batches), [prompt_len] * max(batches),
                                      model_cfg.vocab_size, seed)
  hf = bench_decode.hf_model_from_params(model_cfg, params)
  hf.save_pretrained(os.path.join(workdir, 'hf_model'), safe_serialization=True)
  run_info.write_json(os.path.join(workdir, 'prompts.json'), dict(
      prompts=prompts, batches=batches, prompt_len=prompt_len, output_len=output_len,
      rounds=rounds, max_model_len=prompt_len + output_len,
      model=config.model.source, dtype=model_cfg.dtype))
  return prompts


# ------------------------------------------------------------------------------------------------
# Both sides in one run, their rounds alternating
# ------------------------------------------------------------------------------------------------
INTERLEAVED_COLUMNS = (
    'batch', 'linear_impl', 'pagedjax_tokens_per_s', 'vllm_tokens_per_s', 'pagedjax_over_vllm',
    'round_ratio_min', 'round_ratio_max', 'rounds', 'vllm_cpu_s_while_engine_ran',
    'token_agreement', 'identical_sequences', 'first_mismatch')


def tuned_vllm_env(python: str) -> dict:
  """What vLLM's CPU installation guide asks of its process, for this machine: OpenMP threads
  bound to every core, none reserved for the engine process, tcmalloc and Intel's OpenMP
  runtime (the libiomp5 the vLLM wheel installs in the venv of `python`) preloaded, each where
  found."""
  env = {'VLLM_CPU_OMP_THREADS_BIND': f'0-{os.cpu_count() - 1}',
         'VLLM_CPU_NUM_OF_RESERVED_CPU': '0'}
  venv = os.path.dirname(os.path.dirname(python))
  preload = [path for path in ('/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4',
                               os.path.join(venv, 'lib', 'libiomp5.so')) if os.path.exists(path)]
  if preload:
    env['LD_PRELOAD'] = ':'.join(preload)
  return env


class VllmProcess:
  """experiments/bench_vllm_cpu_vllm.py --serve in the vLLM venv: one generate call per run()."""

  def __init__(self, python: str, workdir: str, env: dict):
    import subprocess  # pylint: disable=import-outside-toplevel
    if not os.path.exists(python):
      raise cli.WorkdirError(f'--vllm_python={python} does not exist: make the vLLM venv first '
                             '(bash experiments/bench_vllm_cpu.sh does) or pass its python')
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'bench_vllm_cpu_vllm.py')
    self.log = open(os.path.join(workdir, 'vllm.log'), 'w')
    self.proc = subprocess.Popen([python, script, workdir, '--serve'], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=self.log, text=True,
                                 env={**os.environ, **env})
    self.info = self._reply('@@READY')

  def _reply(self, tag: str):
    for line in self.proc.stdout:
      if line.startswith(tag + ' '):
        return json.loads(line[len(tag) + 1:])
      if line.startswith('@@ERROR '):
        raise RuntimeError(f'the vLLM process: {json.loads(line[8:])}')
      self.log.write(line)
    self.log.flush()
    raise RuntimeError(f'the vLLM process exited (code {self.proc.wait()}) before {tag}; see '
                       f'{self.log.name}')

  def run(self, batch: int):
    """-> (wall s, output ids) of one generate call of the first `batch` prompts."""
    self.proc.stdin.write(f'run {batch}\n')
    self.proc.stdin.flush()
    out = self._reply('@@ROUND')
    return out['wall_s'], out['output_ids']

  def cpu_s(self) -> float:
    return cpu_time.tree_cpu_s(self.proc.pid)

  def pause(self, stop: bool) -> None:
    """SIGSTOP (stop) or SIGCONT the vLLM processes: stopped, an idle vLLM takes no CPU while
    the engine runs (its processes otherwise wake up and poll: measured as
    vllm_cpu_s_while_engine_ran)."""
    import signal  # pylint: disable=import-outside-toplevel
    for pid in cpu_time.tree_ticks(self.proc.pid):
      try:
        os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)
      except ProcessLookupError:
        pass

  def close(self):
    try:
      self.proc.stdin.write('quit\n')
      self.proc.stdin.close()
      self.proc.wait(timeout=120)
    except Exception:  # pylint: disable=broad-except
      self.proc.kill()
    self.log.close()


def interleaved(config, workdir, batches, prompt_len, output_len, rounds, seed, impls):
  """Both sides in one run: per batch, a warm-up of each, then `rounds` rounds in which every
  pagedjax engine (one per linear_impl) and vLLM each run the batch once, in alternating order
  (forwards, then backwards), so that the machine's drift over minutes falls on both alike. The
  figures: median tokens/s per side, the median and range of the per-round ratios, vLLM's CPU
  seconds while the engine ran (its idle cost), greedy tokens of both sides compared."""
  from experiments import bench_decode  # pylint: disable=import-outside-toplevel
  from pagedjax import factory  # pylint: disable=import-outside-toplevel
  from pagedjax import kernels  # pylint: disable=import-outside-toplevel
  from pagedjax.studies import run_info  # pylint: disable=import-outside-toplevel
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel

  model_cfg, params, tokenizer = factory.load_model_and_tokenizer(config)
  engines = {}
  for impl in impls:
    c = copy.deepcopy(config)
    c.engine.linear_impl = impl
    engines[impl] = factory.make_engine(c, model_cfg, params, tokenizer)
  prompts = export(config, model_cfg, params, tokenizer, workdir, batches, prompt_len,
                   output_len, rounds, seed)
  env = tuned_vllm_env(_VLLM_PYTHON.value) if _VLLM_TUNED.value else {}
  vllm = VllmProcess(_VLLM_PYTHON.value, workdir, env)
  walls = {b: {side: [] for side in [*impls, 'vllm']} for b in batches}
  ids, idle_cpu = {}, {b: 0.0 for b in batches}
  loads = []
  bar = tqdm(total=len(batches) * (rounds + 1) * (len(impls) + 1), desc='bench_vllm_cpu',
             leave=False)
  try:
    for b in batches:
      order = [*impls, 'vllm']
      for r in range(-1, rounds):  # -1: the warm-up (compiles every shape on both sides)
        for side in (order if r % 2 == 0 else order[::-1]):
          bar.set_postfix_str(f'{"warm-up" if r < 0 else f"round {r + 1}"}: {side} B={b}')
          if side == 'vllm':
            wall, out = vllm.run(b)
          else:
            before = vllm.cpu_s()
            if _PAUSE_VLLM.value:
              vllm.pause(True)
            try:
              wall, out, _ = bench_decode.engine_run(engines[side], prompts[:b], output_len)
            finally:
              if _PAUSE_VLLM.value:
                vllm.pause(False)
            if r >= 0:
              idle_cpu[b] += vllm.cpu_s() - before
          if r >= 0:
            walls[b][side].append(wall)
            ids[b, side] = out
          bar.update()
        loads.append(os.getloadavg()[0])
  finally:
    bar.close()
    vllm.close()
  rows = []
  for b in batches:
    v = walls[b]['vllm']
    for impl in impls:
      p = walls[b][impl]
      ratios = [vw / pw for pw, vw in zip(p, v)]  # tokens/s ratio of the round
      share, identical, first = compare_outputs(ids[b, impl], ids[b, 'vllm'])
      rows.append(dict(
          batch=b, linear_impl=impl,
          pagedjax_tokens_per_s=b * output_len / statistics.median(p),
          vllm_tokens_per_s=b * output_len / statistics.median(v),
          pagedjax_over_vllm=statistics.median(ratios), round_ratio_min=min(ratios),
          round_ratio_max=max(ratios), rounds=len(ratios),
          vllm_cpu_s_while_engine_ran=idle_cpu[b], token_agreement=share,
          identical_sequences=f'{identical}/{b}', first_mismatch=first,
          pagedjax_walls_s=p, vllm_walls_s=v))
  table = run_info.markdown_table(rows, INTERLEAVED_COLUMNS)
  impl = config.attention.impl
  summary = dict(rows=rows, markdown_table=table, mode='interleaved',
                 pagedjax_attention_impl=kernels.best_impl() if impl == 'auto' else impl,
                 linear_kernel_isa=_linear_isa(), vllm=vllm.info, vllm_tuned=_VLLM_TUNED.value,
                 vllm_paused_while_engine_ran=_PAUSE_VLLM.value,
                 load_average_1m=dict(min=min(loads), max=max(loads)),
                 **run_info.summary_fields(config))
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  run_info.write_csv(os.path.join(workdir, 'results.csv'), rows, INTERLEAVED_COLUMNS)
  with open(os.path.join(workdir, 'table.md'), 'w') as f:
    f.write(table + '\n')
  plot_interleaved(rows, os.path.join(workdir, 'bench_vllm_cpu.png'))
  print(table)
  print(f'load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores')


def _linear_isa():
  from pagedjax.kernels import linear_cpu  # pylint: disable=import-outside-toplevel
  return linear_cpu.isa() if linear_cpu.available() else None


def plot_interleaved(rows, path):
  """pagedjax / vLLM tokens/s per batch, one series per linear_impl: each round's ratio as a
  point, the median as a line."""
  from experiments import plots  # pylint: disable=import-outside-toplevel
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4), layout='constrained')
  for impl in dict.fromkeys(r['linear_impl'] for r in rows):
    mine = [r for r in rows if r['linear_impl'] == impl]
    xs = [r['batch'] for r in mine]
    line, = ax.plot(xs, [r['pagedjax_over_vllm'] for r in mine], marker='o',
                    label=f'linear_impl={impl} (median of rounds)')
    for r in mine:
      per_round = [v / p for p, v in zip(r['pagedjax_walls_s'], r['vllm_walls_s'])]
      ax.scatter([r['batch']] * len(per_round), per_round, color=line.get_color(), s=12,
                 alpha=0.5)
  ax.axhline(1.0, color='gray', lw=0.8, ls='--')
  ax.set_xscale('log', base=2)
  plots.plain_ticks(ax, sorted({r['batch'] for r in rows}))
  ax.set_xlabel('batch (prompts at once)')
  ax.set_ylabel('pagedjax tokens/s / vLLM tokens/s')
  ax.set_title("pagedjax against vLLM's CPU build, rounds interleaved")
  ax.legend(fontsize=8)
  plots.save(fig, path)


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
    raise cli.WorkdirError('--step is required: interleaved (both sides, one run), or pagedjax '
                           '(this venv) then compare, the vLLM side being '
                           'experiments/bench_vllm_cpu_vllm.py (see bench_vllm_cpu.sh)')
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
  if _STEP.value == 'interleaved':
    impls = _LINEAR_IMPLS.value or [config.engine.linear_impl]
    from pagedjax.model import llama  # pylint: disable=import-outside-toplevel
    bad = [i for i in impls if i not in llama.LINEAR_IMPLS]
    if bad or len(set(impls)) != len(impls):
      raise ConfigError(f'--linear_impls={_LINEAR_IMPLS.value} is not allowed: distinct names '
                        f'among {llama.LINEAR_IMPLS}')
    interleaved(config, workdir, batches, _PROMPT_LEN.value, _OUTPUT_LEN.value, _ROUNDS.value,
                _SEED.value, impls)
    print(f'wrote {workdir}/summary.json, results.csv, table.md, bench_vllm_cpu.png '
          f'({time.perf_counter() - t0:.0f} s)')
    return
  export_and_time(config, workdir, batches, _PROMPT_LEN.value, _OUTPUT_LEN.value,
                  _ROUNDS.value, _SEED.value)
  print(f'wrote {workdir}/hf_model, prompts.json, pagedjax.json '
        f'({time.perf_counter() - t0:.0f} s; load average {np.round(os.getloadavg()[0], 1)})')


if __name__ == '__main__':
  cli.define_flags('configs/bench_decode.py', 'Engine config (its bench section is not read).',
                   lock_config=False)
  cli.run(main)
