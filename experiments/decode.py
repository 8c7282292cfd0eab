"""Main job: decode the config's prompts through the paged KV pool and report.

  python -m experiments.decode --config=configs/default.py --workdir=runs/default
  python -m experiments.decode --config=configs/default.py:tiny --workdir=runs/tiny

Runs the prompts twice on the same engine: the first pass compiles every bucketed step shape,
the second is timed for tokens_per_second (and must not compile again). Writes
WORKDIR/summary.json.
"""
import os
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from pagedjax import factory, run_info
from pagedjax.config import sampling_params, validate_config

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Experiment config.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for summary.json.', required=True)


def run_pass(engine, prompts, params):
  """Submit everything, step to completion; returns (completions, seconds, generated tokens)."""
  before = engine.stats['generated_tokens']
  start = time.perf_counter()
  completions = engine.generate(prompts, params)
  return completions, time.perf_counter() - start, engine.stats['generated_tokens'] - before


def main(argv):
  del argv
  config = validate_config(_CONFIG.value)
  t0 = time.perf_counter()
  model_cfg, params, tokenizer = factory.load_model_and_tokenizer(config)
  load_seconds = time.perf_counter() - t0
  engine = factory.make_engine(config, model_cfg, params, tokenizer)
  sampling = sampling_params(config)

  _, first_seconds, _ = run_pass(engine, config.prompts, sampling)
  compilations_first = engine.num_compilations
  completions, seconds, generated = run_pass(engine, config.prompts, sampling)

  print()
  for c in completions:
    prompt = tokenizer.decode(c.prompt_ids)
    print(f'[{c.request_id}] {prompt!r} -> {c.text!r}  ({c.finish_reason})')
  util = engine.utilization_at_peak
  rows = [('model', config.model.source), ('requests', len(completions)),
          ('generated tokens', generated), ('tokens/s (warm)', f'{generated / seconds:.1f}'),
          ('first pass s (compiles)', f'{first_seconds:.1f}'),
          ('KV blocks total', config.pool.num_blocks), ('KV blocks peak', engine.peak_blocks_used),
          ('KV utilization', f'{util:.1%}'), ('compilations', engine.num_compilations)]
  print()
  for name, value in rows:
    print(f'  {name:<26} {value}')

  summary = {
      'model': config.model.source if config.model.source != 'random' else 'random-tiny',
      'model_config': model_cfg.__dict__,
      'num_requests': len(completions),
      'generated_tokens': generated,
      'tokens_per_second': generated / seconds,
      'decode_seconds': seconds,
      'first_pass_seconds': first_seconds,
      'load_seconds': load_seconds,
      'kv_blocks_total': config.pool.num_blocks,
      'kv_blocks_peak_used': engine.peak_blocks_used,
      'kv_utilization': util,
      'kv_utilization_mean': engine.mean_utilization,
      'kv_bytes_per_token': engine.kv_bytes_per_token,
      'kv_pool_bytes': engine.pool.nbytes,
      'num_compilations': engine.num_compilations,
      'num_compilations_first_pass': compilations_first,
      'preemptions': engine.stats['preemptions'],
      'outputs': [{'prompt': tokenizer.decode(c.prompt_ids), 'completion': c.text,
                   'finish_reason': c.finish_reason} for c in completions],
      'config': config.to_dict(),
      **run_info.environment(),
  }
  path = os.path.join(_WORKDIR.value, 'summary.json')
  run_info.write_json(path, summary)
  print(f'\nwrote {path}')


if __name__ == '__main__':
  app.run(main)
