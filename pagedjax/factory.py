"""From a config to a ready engine: model, params, tokenizer, pool.

`config` is the typed Config (pagedjax/config.py) or an experiment ConfigDict, which is typed and
validated here. With config.mesh.model > 1 the engine runs tensor-parallel
(pagedjax/model/sharding.py): the params are placed on a ('model',) mesh here and the engine
creates its pool in shards on it, so the engine and its host logic are the same code for one
device or many.
"""
import dataclasses
import os

import jax

from pagedjax import kernels
from pagedjax.config import Config, ConfigError, validate_model_shape
from pagedjax.device import pool as pool_lib
from pagedjax.model.step import CompiledStep
from pagedjax.engine import Engine
from pagedjax.model import sharding, weights
from pagedjax.model.llama import init_params
from pagedjax.model.tokenizer import Tokenizer


def typed(config) -> Config:
  """The typed, validated Config of a Config or an experiment ConfigDict."""
  return config.validate() if isinstance(config, Config) else Config.from_configdict(config)


def build_engine(config=Config(), tokenizer=None, **engine_kwargs) -> Engine:
  """Loads the config's model and tokenizer and returns an engine for it: the one call a
  library user needs (`pagedjax.build_engine(Config(...))`). A `tokenizer` given is used
  instead of loading the config's (a served replica gets the one its driver loaded)."""
  model_cfg, params, tokenizer = load_model_and_tokenizer(config, tokenizer)
  return make_engine(config, model_cfg, params, tokenizer, **engine_kwargs)


def available_memory_bytes(device=None) -> int:
  """Memory the pool can take on `device` (default: the first): an accelerator's own limit, or on
  a CPU the physical memory not in use now."""
  device = device or jax.devices()[0]
  stats = device.memory_stats() if device.platform != 'cpu' else None
  if stats and 'bytes_limit' in stats:
    return int(stats['bytes_limit'] - stats.get('bytes_in_use', 0))
  return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_AVPHYS_PAGES')


def check_pool_fits(model_cfg, config: Config, available: int = None) -> int:
  """Refuses, before anything is allocated, a pool larger than the memory a device has (with a
  mesh, each device holds 1/tp of it); returns the bytes per device. The message gives the
  largest pool.num_blocks that would fit."""
  tp = config.mesh.model
  kv_quant = config.pool.kv_quant(model_cfg.dtype)
  shape = (model_cfg.num_layers, config.pool.num_blocks, model_cfg.num_kv_heads,
           config.pool.block_size, model_cfg.head_dim)
  need = pool_lib.pool_bytes(*shape, kv_quant, config.engine.max_batch_size) // tp
  available = available_memory_bytes() if available is None else available
  if need > available:
    per_block = pool_lib.pool_bytes(*shape[:1], 1, *shape[2:], kv_quant) / tp
    raise ConfigError(
        f'config.pool.num_blocks={config.pool.num_blocks} is not allowed: the pool would take '
        f'{need / 2**30:.2f} GiB per device and {available / 2**30:.2f} GiB are available; '
        f'at most {max(int(available // per_block), 0)} blocks fit')
  return need


def load_model_and_tokenizer(config, tokenizer=None):
  """-> (ModelConfig, params, Tokenizer). Random models borrow SmolLM2's tokenizer; a
  `tokenizer` given is returned instead of loading one (parsing a GGUF takes seconds).

  The mesh is checked against the model's head counts and the devices before params are made
  (random models) or right after the checkpoint's shape is known (loaded ones).
  """
  config = typed(config)
  if not kernels.runs_on(config.attention.impl):
    raise ConfigError(f'config.attention.impl={config.attention.impl!r} is not allowed on this '
                      f'{jax.default_backend()} machine: one of '
                      f'{[i for i in ("auto",) + kernels.IMPLS if kernels.runs_on(i)]}')
  m = config.model
  tp = config.mesh.model
  cache_dir = os.path.expanduser(m.cache_dir) if m.cache_dir else None
  if m.source == 'random':
    model_cfg = m.random_model_config()
    sharding.validate_mesh(model_cfg, tp, jax.device_count())
    check_pool_fits(model_cfg, config)  # before the params are made
    params = init_params(model_cfg, seed=m.random.seed)
    if tokenizer is None:
      tokenizer = Tokenizer.from_gguf(weights.smollm2_gguf_path())
  else:
    model_cfg, params = weights.load_model(m.source, m.path or None, cache_dir)
    model_cfg = dataclasses.replace(model_cfg, dtype=m.dtype)
    if tokenizer is None and m.source == 'safetensors':
      tokenizer = Tokenizer.from_file(os.path.join(m.path, 'tokenizer.json'))
    elif tokenizer is None:
      tokenizer = Tokenizer.from_gguf(m.path or weights.smollm2_gguf_path())
    sharding.validate_mesh(model_cfg, tp, jax.device_count())
    check_pool_fits(model_cfg, config)
  validate_model_shape(model_cfg, field='model')
  return model_cfg, params, tokenizer


def make_engine(config, model_cfg, params, tokenizer, **engine_kwargs) -> Engine:
  """An engine for the config; engine_kwargs are Engine's keyword arguments (step_fn,
  record_logits, ...).

  Tensor-parallel engines (mesh.model > 1) get a CompiledStep built for the mesh unless
  `step_fn` is given, in which case it must have been built for an equal mesh.
  """
  config = typed(config)
  kwargs = dict(eos_id=tokenizer.eos_id if tokenizer is not None else None, tokenizer=tokenizer)
  kwargs.update(engine_kwargs)
  tp = sharding.validate_mesh(model_cfg, config.mesh.model, jax.device_count())
  if tp == 1:
    return Engine(model_cfg, params, config, **kwargs)

  mesh = sharding.make_mesh(tp)
  # The engine sees the equivalent model with num_kv_heads >= tp (KV heads replicated if needed),
  # so its pool has one or more whole KV heads per device.
  sharded_cfg, params = sharding.shard_model(model_cfg, params, mesh)
  step_fn = kwargs.get('step_fn')
  if step_fn is None:
    kwargs['step_fn'] = CompiledStep(sharded_cfg, config.attention.impl,
                                     kwargs.get('record_logits', False), mesh=mesh,
                                     linear_impl=config.engine.linear_impl)
  elif getattr(step_fn, 'mesh', None) != mesh:
    raise ValueError(f'step_fn was built for mesh {getattr(step_fn, "mesh", None)}, but '
                     f'config.mesh.model={tp} needs {mesh}: build it with '
                     'CompiledStep(..., mesh=sharding.make_mesh(tp))')
  # The pool is created in shards; every step donates it and returns it with the same sharding
  # (model/step.py): it stays split, in place.
  return Engine(sharded_cfg, params, config, mesh=mesh, **kwargs)
