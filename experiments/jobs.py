"""Per-point jobs for experiments.sweep and the paper reproductions: a config in, one row out.

A job is `fn(config, workdir) -> dict` of JSON scalars, one row of results.jsonl; it may write
bigger outputs (timelines) into workdir, the point's own directory. Sweep configs name theirs
with `config.job`: a key of JOBS, or 'package.module:function' for jobs kept elsewhere.

  trace   replay a synthetic trace (config.trace, pagedjax.workloads) through one engine built
          from the config; the engine's serving metrics (pagedjax.host.metrics) plus trace figures.
"""
import importlib
import json
import os

from pagedjax import factory, run_info, workloads
from pagedjax.config import Config, ConfigError
from pagedjax.engine import RequestError
from pagedjax.model.llama import init_params
from pagedjax.host.sampling_params import SamplingParams
from pagedjax.device.step import CompiledStep


_MODELS = {}  # (model config, attention impl) -> (ModelConfig, params, encode, CompiledStep)


def _model(config):
  """Shared by every point of one model in a process, so points that differ only in pool or
  scheduler settings reuse its params and compiled steps."""
  key = (json.dumps(config.model.to_dict(), sort_keys=True), config.attention.impl)
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
    _MODELS[key] = cfg, params, encode, CompiledStep(cfg, config.attention.impl)
  return _MODELS[key]


def make_engine(config) -> tuple:
  """(engine, encode) for a validated config, built by the factory like every other run (pool
  kind, scheduler, KV storage, mesh), sharing the model's compiled step on one device."""
  cfg, params, encode, step = _model(config)
  shared = {'step_fn': step} if config.mesh.model == 1 else {}
  return factory.make_engine(config, cfg, params, None, **shared), encode


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
             trace_mean_output_len=trace_figures['mean_output_len'])
  with run_info.atomic_write(os.path.join(workdir, 'timeline.json')) as f:
    json.dump({'timeline': engine.metrics.timeline(), 'rejected': rejected}, f)
  return row


JOBS = {'trace': trace}


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
