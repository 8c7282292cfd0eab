"""From a validated experiment config to a ready engine: model, params, tokenizer, pool."""
import os

from pagedjax import weights
from pagedjax.config import random_model_config, validate_model_shape
from pagedjax.engine import Engine
from pagedjax.model import init_params
from pagedjax.tokenizer import Tokenizer


def load_model_and_tokenizer(config):
  """-> (ModelConfig, params, Tokenizer). Random models borrow SmolLM2's tokenizer."""
  m = config.model
  cache_dir = os.path.expanduser(m.cache_dir) if m.cache_dir else None
  if m.source == 'random':
    model_cfg = random_model_config(config)
    params = init_params(model_cfg, seed=m.random.seed)
    tokenizer = Tokenizer.from_gguf(weights.smollm2_gguf_path())
  else:
    model_cfg, params = weights.load_model(m.source, m.path or None, cache_dir)
    model_cfg = model_cfg.__class__(**{**model_cfg.__dict__, 'dtype': m.dtype})
    if m.source == 'safetensors':
      tokenizer = Tokenizer.from_file(os.path.join(m.path, 'tokenizer.json'))
    else:
      tokenizer = Tokenizer.from_gguf(m.path or weights.smollm2_gguf_path())
  validate_model_shape(model_cfg, field='model')
  return model_cfg, params, tokenizer


def make_engine(config, model_cfg, params, tokenizer, **overrides) -> Engine:
  kv_dtype = None if config.pool.kv_dtype == 'auto' else config.pool.kv_dtype
  kwargs = dict(block_size=config.pool.block_size, num_blocks=config.pool.num_blocks,
                max_batch_size=config.engine.max_batch_size,
                prefill_chunk=config.engine.prefill_chunk, max_seq_len=config.engine.max_seq_len,
                attention_impl=config.attention.impl, kv_dtype=kv_dtype,
                eos_id=tokenizer.eos_id, tokenizer=tokenizer)
  kwargs.update(overrides)
  return Engine(model_cfg, params, **kwargs)
