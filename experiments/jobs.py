"""Per-point jobs for experiments.sweep and the paper reproductions: a config in, one row out.

A job is `fn(config, workdir) -> dict` of JSON scalars, one row of results.jsonl; it may write
bigger outputs (timelines) into workdir, the point's own directory. Sweep configs name theirs
with `config.job`: a key of JOBS, or 'package.module:function' for jobs kept elsewhere.

  trace   replay a synthetic trace (config.trace, pagedjax.studies.workloads) through one engine built
          from the config; the engine's serving metrics (pagedjax.host.metrics), trace figures,
          and what block tables cost the host (host_costs).
  trace_with_block_overhead
          trace, plus the attention kernel's time and the host's time to build one call's
          inputs at config.block_overhead's context, with their fitted per-block costs
          (experiments/block_overhead.py): the block-size sweep's job.
"""
import importlib
import json
import os

from experiments import block_overhead
from pagedjax import factory
from pagedjax.studies import run_info
from pagedjax.studies import workloads
from pagedjax.config import Config, ConfigError
from pagedjax.engine import RequestError
from pagedjax.model.llama import init_params
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.model.step import CompiledStep


_MODELS = {}  # (model config, attention impl, linear impl) -> (ModelConfig, params, encode, step)


def _model(config):
  """Shared by every point of one model in a process, so points that differ only in pool or
  scheduler settings reuse its params and compiled steps."""
  key = (json.dumps(config.model.to_dict(), sort_keys=True), config.attention.impl,
         config.engine.linear_impl)
  if key not in _MODELS:
    if config.model.source == 'random':
      # No tokenizer needed: prompts are the UTF-8 bytes of the real text.
      cfg = Config.from_configdict(config).model.random_model_config()
      if cfg.vocab_size < 256:
        raise ValueError(f'config.model.random.vocab_size={cfg.vocab_size} is not allowed for '
                         'trace jobs: at least 256 (prompts are UTF-8 bytes)')
      params, encode = init_params(cfg, seed=config.model.random.seed), workloads.byte_encode
    else:
      cfg, params, tokenizer = factory.load_model_and_tokenizer(config)
      encode = tokenizer.encode
    _MODELS.clear()  # one model at a time: a sweep's points share it
    _MODELS[key] = cfg, params, encode, CompiledStep(cfg, config.attention.impl,
                                                    linear_impl=config.engine.linear_impl)
  return _MODELS[key]


def make_engine(config, **engine_kwargs) -> tuple:
  """(engine, encode) for a validated config, built by the factory like every other run (pool
  kind, scheduler, KV storage, mesh), sharing the model's compiled step on one device.
  engine_kwargs go to the Engine (e.g. timer, the clock a study replays on)."""
  cfg, params, encode, step = _model(config)
  shared = {'step_fn': step} if config.mesh.model == 1 else {}
  return factory.make_engine(config, cfg, params, None, **shared, **engine_kwargs), encode


def trace(config, workdir: str) -> dict:
  """Replays config.trace; requests arrive at their trace times and ignore EOS, so every one
  generates exactly its trace length (as serving benchmarks do)."""
  t = config.trace
  engine, encode = make_engine(config)
  requests = workloads.synthetic_trace(
      t.num_requests, t.dataset, encode=encode, rate=t.rate, seed=t.seed,
      max_input_len=t.max_input_len, max_output_len=t.max_output_len,
      calibrate=t.get('calibrate', True))
  rejected = []
  for r in requests:
    params = SamplingParams(max_new_tokens=r.max_new_tokens, stop_on_eos=False)
    try:
      engine.submit(r.prompt_ids, params, arrival_time=r.arrival_time)
    except RequestError as e:
      rejected.append({'request_id': r.request_id, 'error': str(e)})
  engine.run()
  row = engine.summary()
  trace_figures = workloads.summarize(requests)
  row.update(rejected_requests=len(rejected), trace_requests=len(requests),
             trace_mean_input_len=trace_figures['mean_input_len'],
             trace_mean_output_len=trace_figures['mean_output_len'],
             trace_max_tokens=max(len(r.prompt_ids) + r.max_new_tokens for r in requests),
             **host_costs(engine.stats, row['iterations']))
  with run_info.atomic_write(os.path.join(workdir, 'timeline.json')) as f:
    json.dump({'timeline': engine.metrics.timeline(), 'rejected': rejected}, f)
  return row


def host_costs(stats, iterations: int) -> dict:
  """What block tables cost the host, from the executor's counters (pagedjax/executor.py):
  table entries of a row of a step call (mean and max over every real row of every call: a
  sequence's blocks up to the tokens that call feeds), the padded int32 tables the steps
  receive (bytes per iteration, and the share of them that is padding), and the host seconds
  per iteration spent building the steps' inputs."""
  rows, entries = stats['block_table_rows'], stats['block_table_entries']
  table_bytes = stats['block_table_bytes']
  per_iteration = lambda x: x / iterations if iterations else None
  return dict(
      block_table_entries_mean=entries / rows if rows else None,
      block_table_entries_max=stats['block_table_entries_max'],
      block_table_bytes_per_iteration=per_iteration(table_bytes),
      block_table_padding_fraction=1 - 4 * entries / table_bytes if table_bytes else None,
      step_input_s_per_iteration=per_iteration(stats['step_input_seconds']))


def trace_with_block_overhead(config, workdir: str) -> dict:
  """trace's row plus block_overhead's figures at this point's block size. Those are timed
  first (all of config.block_overhead.block_sizes, once per process), before any trace runs."""
  overhead = block_overhead.figures(config, _model(config)[0])
  return {**trace(config, workdir), **overhead}


JOBS = {'trace': trace, 'trace_with_block_overhead': trace_with_block_overhead}


def get_job(name: str):
  """A JOBS key, or 'package.module:function'; ConfigError for anything else."""
  allowed = f"one of {tuple(JOBS)} or 'package.module:function'"
  if name in JOBS:
    return JOBS[name]
  module, sep, fn = name.partition(':') if isinstance(name, str) else ('', '', '')
  if not sep:
    raise ConfigError(f'config.job={name!r} is not allowed: {allowed}')
  try:
    job = getattr(importlib.import_module(module), fn)
  except (ImportError, AttributeError) as e:
    raise ConfigError(f'config.job={name!r} is not allowed: {allowed} that imports ({e})') from None
  if not callable(job):
    raise ConfigError(f'config.job={name!r} is not allowed: {module}.{fn} is not a function')
  return job
