"""Config validation: reject bad experiment configs at load time, naming field, value and what
is allowed, before any weights are loaded or memory is reserved."""
from kernels import IMPLS
from pagedjax.model import DTYPES, ModelConfig
from pagedjax.sampling import SamplingParams

MODEL_SOURCES = ('smollm2', 'gguf', 'safetensors', 'random')
KV_DTYPES = ('auto',) + tuple(DTYPES)
ATTENTION_IMPLS = ('auto',) + tuple(IMPLS)


class ConfigError(ValueError):
  pass


def _fail(field, value, allowed):
  raise ConfigError(f'config.{field}={value!r} is not allowed: {allowed}')


def _is_power_of_two(n) -> bool:
  return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def validate_model_shape(cfg: ModelConfig, field='model.random'):
  """Architecture checks shared by random configs and loaded checkpoints."""
  for name in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim',
               'ffn_dim', 'max_seq_len'):
    value = getattr(cfg, name)
    if not isinstance(value, int) or value < 1:
      _fail(f'{field}.{name}', value, 'a positive integer')
  if cfg.num_heads % cfg.num_kv_heads:
    divisors = [d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]
    _fail(f'{field}.num_kv_heads', cfg.num_kv_heads,
          f'a divisor of num_heads={cfg.num_heads}: one of {divisors}')
  if cfg.head_dim % 2:
    _fail(f'{field}.head_dim', cfg.head_dim, 'an even number (RoPE rotates pairs)')
  if cfg.dtype not in DTYPES:
    _fail('model.dtype', cfg.dtype, f'one of {tuple(DTYPES)}')


def validate_config(config):
  """Checks every field the decode experiments read; raises ConfigError on the first bad one."""
  m, pool, eng = config.model, config.pool, config.engine
  if m.source not in MODEL_SOURCES:
    _fail('model.source', m.source, f'one of {MODEL_SOURCES}')
  if m.source in ('gguf', 'safetensors') and not m.path:
    _fail('model.path', m.path, f'a file or directory path when model.source={m.source!r}')
  if m.dtype not in DTYPES:
    _fail('model.dtype', m.dtype, f'one of {tuple(DTYPES)}')
  if m.source == 'random':
    validate_model_shape(random_model_config(config))

  if not _is_power_of_two(pool.block_size) or pool.block_size > 1024:
    _fail('pool.block_size', pool.block_size, 'a power of two from 1 to 1024')
  if pool.kv_dtype not in KV_DTYPES:
    _fail('pool.kv_dtype', pool.kv_dtype, f'one of {KV_DTYPES}')
  if config.attention.impl not in ATTENTION_IMPLS:
    _fail('attention.impl', config.attention.impl, f'one of {ATTENTION_IMPLS}')

  if not isinstance(eng.max_batch_size, int) or eng.max_batch_size < 1:
    _fail('engine.max_batch_size', eng.max_batch_size, 'an integer >= 1')
  if not _is_power_of_two(eng.prefill_chunk):
    _fail('engine.prefill_chunk', eng.prefill_chunk, 'a power of two')
  if not isinstance(eng.max_seq_len, int) or eng.max_seq_len < 2:
    _fail('engine.max_seq_len', eng.max_seq_len, 'an integer >= 2')
  # Every running sequence holds at least one block, and block 0 is the null block.
  if not isinstance(pool.num_blocks, int) or pool.num_blocks < eng.max_batch_size + 1:
    _fail('pool.num_blocks', pool.num_blocks,
          f'at least engine.max_batch_size + 1 = {eng.max_batch_size + 1} '
          '(one block per sequence, plus the null block)')

  try:
    sampling_params(config).validate()
  except ValueError as e:
    raise ConfigError(f'config.sampling.{e}') from None
  return config


def random_model_config(config) -> ModelConfig:
  r = config.model.random
  return ModelConfig(vocab_size=r.vocab_size, d_model=r.d_model, num_layers=r.num_layers,
                     num_heads=r.num_heads, num_kv_heads=r.num_kv_heads, head_dim=r.head_dim,
                     ffn_dim=r.ffn_dim, max_seq_len=r.max_seq_len, rope_theta=r.rope_theta,
                     tie_embeddings=r.tie_embeddings, dtype=config.model.dtype)


def sampling_params(config) -> SamplingParams:
  s = config.sampling
  return SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                        top_k=s.top_k, top_p=s.top_p, seed=s.seed)
