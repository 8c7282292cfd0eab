"""Config validation: reject bad experiment configs at load time, naming field, value and what
is allowed, before any weights are loaded or memory is reserved."""
import math

from kernels import IMPLS
from pagedjax.block_manager import KINDS as POOL_KINDS
from pagedjax import prefix_cache, quant, sharding
from pagedjax.model import DTYPES, ModelConfig
from pagedjax.sampling import SamplingParams
from pagedjax.scheduler import PREEMPTION_POLICIES
from pagedjax.workloads import DATASETS

MODEL_SOURCES = ('smollm2', 'gguf', 'safetensors', 'random')
KV_DTYPES = ('auto',) + quant.KV_DTYPES
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
  try:  # a checkpoint's shape is checked again against the mesh once it is loaded (factory.py)
    sharding.validate_mesh(random_model_config(config) if m.source == 'random' else None,
                           sharding.mesh_model(config))
  except ValueError as e:
    raise ConfigError(str(e)) from None

  if not _is_power_of_two(pool.block_size) or pool.block_size > 1024:
    _fail('pool.block_size', pool.block_size, 'a power of two from 1 to 1024')
  if pool.kv_dtype not in KV_DTYPES:
    _fail('pool.kv_dtype', pool.kv_dtype, f'one of {KV_DTYPES}')
  validate_kv_quant(config)
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
  validate_scheduler(config)
  validate_prefix_cache(config)
  if 'trace' in config:
    validate_trace(config)
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


# ---- pool kind and scheduler ---------------------------------------------------------------
# Configs written before these fields existed get the defaults below, so they keep working.
SCHEDULER_DEFAULTS = dict(preemption='recompute', watermark=0.01, max_num_batched_tokens=0,
                          swap_blocks=0)


def _scheduler_field(config, name):
  section = config.get('scheduler') or {}
  return section.get(name, SCHEDULER_DEFAULTS[name])


def scheduler_options(config) -> dict:
  """Engine keyword arguments for config.pool.kind and config.scheduler (0 = engine default)."""
  return dict(pool_kind=config.pool.get('kind', 'paged'),
              preemption=_scheduler_field(config, 'preemption'),
              watermark=_scheduler_field(config, 'watermark'),
              max_num_batched_tokens=_scheduler_field(config, 'max_num_batched_tokens') or None,
              swap_blocks=_scheduler_field(config, 'swap_blocks') or None)


def validate_scheduler(config):
  pool, eng = config.pool, config.engine
  kind = pool.get('kind', 'paged')
  if kind not in POOL_KINDS:
    _fail('pool.kind', kind, f'one of {POOL_KINDS}')
  preemption = _scheduler_field(config, 'preemption')
  if preemption not in PREEMPTION_POLICIES:
    _fail('scheduler.preemption', preemption, f'one of {PREEMPTION_POLICIES}')
  watermark = _scheduler_field(config, 'watermark')
  if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not (
      0 <= watermark < 1):
    _fail('scheduler.watermark', watermark,
          'a number in [0, 1): the share of pool blocks admission keeps free')
  budget = _scheduler_field(config, 'max_num_batched_tokens')
  if not isinstance(budget, int) or (budget != 0 and budget < eng.max_batch_size):
    _fail('scheduler.max_num_batched_tokens', budget,
          f'0 (engine.max_batch_size * engine.prefill_chunk) or an integer >= '
          f'engine.max_batch_size={eng.max_batch_size}, so every decode fits an iteration')
  swap_blocks = _scheduler_field(config, 'swap_blocks')
  if not isinstance(swap_blocks, int) or swap_blocks < 0:
    _fail('scheduler.swap_blocks', swap_blocks,
          'an integer >= 0 (host-tier blocks; 0 = as many as the pool)')
  reserve = math.ceil(eng.max_seq_len / pool.block_size)
  if kind == 'contiguous' and pool.num_blocks < reserve + 1:
    _fail('pool.num_blocks', pool.num_blocks,
          f'at least {reserve + 1} with pool.kind=\'contiguous\': one reservation of '
          f'engine.max_seq_len={eng.max_seq_len} tokens in blocks of {pool.block_size}, plus '
          'the null block')


def validate_trace(config):
  """config.trace: the synthetic workload a trace job replays (pagedjax.workloads)."""
  t = config.trace
  if t.dataset not in DATASETS:
    _fail('trace.dataset', t.dataset, f'one of {tuple(DATASETS)}')
  for name in ('num_requests', 'max_input_len', 'max_output_len'):
    value = t[name]
    if not isinstance(value, int) or value < 1:
      _fail(f'trace.{name}', value, 'an integer >= 1')
  if not isinstance(t.seed, int):
    _fail('trace.seed', t.seed, 'an integer')
  if isinstance(t.rate, bool) or not isinstance(t.rate, (int, float)) or not t.rate > 0:
    _fail('trace.rate', t.rate, "requests/s > 0, or float('inf') for all at t=0")
  if not isinstance(t.get('calibrate', True), bool):
    _fail('trace.calibrate', t.calibrate, 'True (keep the dataset means under the length limits) '
          'or False (clip the plain laws)')
  if t.max_input_len >= config.engine.max_seq_len:
    _fail('trace.max_input_len', t.max_input_len,
          f'less than engine.max_seq_len={config.engine.max_seq_len}')


def validate_kv_quant(config):
  """pool.kv_* combinations: group size dividing head_dim, options only where defined."""
  m = config.model
  head_dim = m.random.head_dim if m.source == 'random' else None
  kv_quant = quant.from_config(config.pool, m.dtype)
  try:
    kv_quant.validate(head_dim)  # a checkpoint's head_dim is checked by init_pool at load
  except ValueError as e:
    field = str(e).split('=')[0]
    names = {'kv_dtype': 'kv_dtype', 'group_size': 'kv_group_size',
             'key_per_channel': 'kv_key_per_channel', 'recent_window': 'kv_recent_window'}
    raise ConfigError(f'config.pool.{names.get(field, field)}: {e}') from None


# ---- prefix cache --------------------------------------------------------------------------
# Configs written before this section existed run without prefix caching.
PREFIX_CACHE_DEFAULTS = dict(enabled=False, design='hash', eviction='lru')


def _prefix_field(config, name):
  section = config.get('prefix_cache') or {}
  return section.get(name, PREFIX_CACHE_DEFAULTS[name])


def prefix_cache_options(config) -> dict:
  """Engine keyword arguments for config.prefix_cache."""
  return dict(prefix_caching=_prefix_field(config, 'enabled'),
              prefix_cache_design=_prefix_field(config, 'design'),
              prefix_cache_eviction=_prefix_field(config, 'eviction'))


def validate_prefix_cache(config):
  enabled = _prefix_field(config, 'enabled')
  if not isinstance(enabled, bool):
    _fail('prefix_cache.enabled', enabled, 'True or False')
  design = _prefix_field(config, 'design')
  if design not in prefix_cache.DESIGNS:
    _fail('prefix_cache.design', design,
          f'one of {prefix_cache.DESIGNS} (hash chain over full blocks, or radix tree)')
  eviction = _prefix_field(config, 'eviction')
  if eviction not in prefix_cache.EVICTION_POLICIES:
    _fail('prefix_cache.eviction', eviction, f'one of {prefix_cache.EVICTION_POLICIES}')
  if enabled and config.pool.get('kv_recent_window', 0):
    _fail('prefix_cache.enabled', enabled,
          'False with pool.kv_recent_window > 0 (shared blocks cannot carry per-sequence rings)')
