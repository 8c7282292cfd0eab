"""From a validated experiment config to a ready engine: model, params, tokenizer, pool.

With config.mesh.model > 1 the engine runs tensor-parallel (pagedjax/sharding.py): the params are
placed on a ('model',) mesh here and the engine creates its pool in shards on it, so the engine
and its host logic are the same code for one device or many.
"""
import dataclasses
import os

import jax

from pagedjax import quant, sharding, weights
from pagedjax.config import (prefix_cache_options, random_model_config, scheduler_options,
                             validate_model_shape)
from pagedjax.engine import Engine
from pagedjax.model import init_params
from pagedjax.steps import CompiledStep
from pagedjax.tokenizer import Tokenizer


def load_model_and_tokenizer(config):
  """-> (ModelConfig, params, Tokenizer). Random models borrow SmolLM2's tokenizer.

  The mesh is checked against the model's head counts and the devices before params are made
  (random models) or right after the checkpoint's shape is known (loaded ones).
  """
  m = config.model
  tp = sharding.mesh_model(config)
  cache_dir = os.path.expanduser(m.cache_dir) if m.cache_dir else None
  if m.source == 'random':
    model_cfg = random_model_config(config)
    sharding.validate_mesh(model_cfg, tp, jax.device_count())
    params = init_params(model_cfg, seed=m.random.seed)
    tokenizer = Tokenizer.from_gguf(weights.smollm2_gguf_path())
  else:
    model_cfg, params = weights.load_model(m.source, m.path or None, cache_dir)
    model_cfg = dataclasses.replace(model_cfg, dtype=m.dtype)
    if m.source == 'safetensors':
      tokenizer = Tokenizer.from_file(os.path.join(m.path, 'tokenizer.json'))
    else:
      tokenizer = Tokenizer.from_gguf(m.path or weights.smollm2_gguf_path())
    sharding.validate_mesh(model_cfg, tp, jax.device_count())
  validate_model_shape(model_cfg, field='model')
  return model_cfg, params, tokenizer


def make_engine(config, model_cfg, params, tokenizer, **overrides) -> Engine:
  """An engine for the config; overrides replace Engine keyword arguments.

  Tensor-parallel engines (mesh.model > 1) get a CompiledStep built for the mesh unless
  `step_fn` is given, in which case it must have been built for an equal mesh.
  """
  kwargs = dict(block_size=config.pool.block_size, num_blocks=config.pool.num_blocks,
                max_batch_size=config.engine.max_batch_size,
                prefill_chunk=config.engine.prefill_chunk, max_seq_len=config.engine.max_seq_len,
                attention_impl=config.attention.impl,
                kv_quant=quant.from_config(config.pool, model_cfg.dtype),
                eos_id=tokenizer.eos_id if tokenizer is not None else None, tokenizer=tokenizer,
                **scheduler_options(config), **prefix_cache_options(config))
  kwargs.update(overrides)
  tp = sharding.validate_mesh(model_cfg, sharding.mesh_model(config), jax.device_count())
  if tp == 1:
    return Engine(model_cfg, params, **kwargs)

  mesh = sharding.make_mesh(tp)
  # The engine sees the equivalent model with num_kv_heads >= tp (KV heads replicated if needed),
  # so its pool has one or more whole KV heads per device.
  sharded_cfg, params = sharding.shard_model(model_cfg, params, mesh)
  step_fn = kwargs.get('step_fn')
  if step_fn is None:
    kwargs['step_fn'] = CompiledStep(sharded_cfg, kwargs['attention_impl'],
                                     kwargs.get('record_logits', False), mesh=mesh)
  elif getattr(step_fn, 'mesh', None) != mesh:
    raise ValueError(f'step_fn was built for mesh {getattr(step_fn, "mesh", None)}, but '
                     f'config.mesh.model={tp} needs {mesh}: build it with '
                     'CompiledStep(..., mesh=sharding.make_mesh(tp))')
  # The pool is created in shards; every step donates it and returns it with the same sharding
  # (steps.py): it stays split, in place.
  return Engine(sharded_cfg, params, mesh=mesh, **kwargs)
