"""The typed config: one frozen dataclass per section, each default written once, here.

An experiment config file (configs/*.py) returns an ml_collections ConfigDict, which absl's
`config_flags` lets the command line override field by field. `Config.from_configdict` turns the
sections the engine reads into these dataclasses and validates them, before any weights load or
memory is reserved; each section checks its own fields and raises ConfigError naming field, value
and what is allowed. `Config().to_configdict()` is how configs/default.py starts, so the ConfigDict
and the dataclasses cannot disagree on a default. Library users build `Config(...)` directly:

  Config(pool=PoolConfig(block_size=32), prefix_cache=PrefixCacheConfig(enabled=True))

Sections other than these (trace, sweep, prompts, ...) belong to the experiments that read them.
"""
import dataclasses
import math
from typing import Any, Dict

import ml_collections

from pagedjax.kernels import IMPLS
from pagedjax.device import kv_schemes
from pagedjax.host.scheduling.block_manager import KINDS as POOL_KINDS
from pagedjax.host.capacity import ConfigError  # defined without jax: host code raises it too
from pagedjax.host.tiers.disk_store import MAX_SLOTS as DISK_MAX_SLOTS
from pagedjax.host import policies
from pagedjax.host.cache.prefix_cache import DESIGNS as PREFIX_DESIGNS
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.scheduling.scheduler import PREEMPTION_POLICIES
from pagedjax.host.tiers.tier_cost import PROMOTION_RULES
from pagedjax.model import sharding
from pagedjax.model.llama import DTYPES, LINEAR_IMPLS, ModelConfig

MODEL_SOURCES = ('smollm2', 'gguf', 'safetensors', 'random')
KV_DTYPES = ('auto',) + kv_schemes.KV_DTYPES
ATTENTION_IMPLS = ('auto',) + tuple(IMPLS)
# SamplingParams fields an experiment config sets; the others (n, beams, salts) are per request.
SAMPLING_FIELDS = ('max_new_tokens', 'temperature', 'top_k', 'top_p', 'seed')


def _fail(field, value, allowed):
  raise ConfigError(f'config.{field}={value!r} is not allowed: {allowed}')


def _check_policy(field, value, registry: policies.Registry):
  """A policy field (host/policies.py): a registered name, or 'package.module:attr' imported and
  checked now, so a missing module or attribute fails at config load, not mid-run."""
  try:
    policy = registry.get(value)
  except policies.PolicyError as e:
    raise ConfigError(f'config.{field}={value!r} is not allowed: {e}') from None
  if getattr(policy, 'offline', False):
    raise ConfigError(f'config.{field}={value!r} is not allowed: an offline policy (it needs '
                      "the trace's future; experiments/policy_lab.py runs it), not one a "
                      'serving engine can use')


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_power_of_two(n) -> bool:
  return _is_int(n) and n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class RandomModelConfig:
  """The shape of a random Llama (model.source='random'): tests and quick runs."""
  vocab_size: int = 49152
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  ffn_dim: int = 128
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  tie_embeddings: bool = True
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class ModelSection:
  source: str = 'smollm2'  # smollm2 (shipped GGUF) | gguf | safetensors | random
  path: str = ''  # file (gguf) or directory (safetensors)
  dtype: str = 'float32'  # compute dtype; params stay float32
  cache_dir: str = '~/.cache/pagedjax'  # Orbax copy of converted params; '' disables it
  random: RandomModelConfig = RandomModelConfig()

  def validate(self):
    if self.source not in MODEL_SOURCES:
      _fail('model.source', self.source, f'one of {MODEL_SOURCES}')
    if self.source in ('gguf', 'safetensors') and not self.path:
      _fail('model.path', self.path,
            f'a file or directory path when model.source={self.source!r}')
    if self.dtype not in DTYPES:
      _fail('model.dtype', self.dtype, f'one of {tuple(DTYPES)}')
    if self.source == 'random':
      validate_model_shape(self.random_model_config())

  def random_model_config(self) -> ModelConfig:
    r = dataclasses.asdict(self.random)
    del r['seed']
    return ModelConfig(**r, dtype=self.dtype)


def validate_model_shape(cfg: ModelConfig, field='model.random'):
  """Architecture checks shared by random configs and loaded checkpoints."""
  for name in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim',
               'ffn_dim', 'max_seq_len'):
    value = getattr(cfg, name)
    if not _is_int(value) or value < 1:
      _fail(f'{field}.{name}', value, 'a positive integer')
  if cfg.num_heads % cfg.num_kv_heads:
    divisors = [d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]
    _fail(f'{field}.num_kv_heads', cfg.num_kv_heads,
          f'a divisor of num_heads={cfg.num_heads}: one of {divisors}')
  if cfg.head_dim % 2:
    _fail(f'{field}.head_dim', cfg.head_dim, 'an even number (RoPE rotates pairs)')
  if cfg.dtype not in DTYPES:
    _fail('model.dtype', cfg.dtype, f'one of {tuple(DTYPES)}')


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """The KV pool: blocks of block_size tokens, num_blocks of them (block 0 is the null block)."""
  block_size: int = 16
  num_blocks: int = 256
  kv_dtype: str = 'auto'  # auto = model.dtype; int8 | fp8_e4m3 | fp8_e5m2 | int4 quantize
  kv_group_size: int = 32  # int4: channels per scale
  kv_key_per_channel: bool = False  # int4: KIVI keys, one range per channel per block
  kv_recent_window: int = 0  # newest tokens per sequence also kept in bfloat16
  kind: str = 'paged'  # paged | contiguous (reserves engine.max_seq_len per request)

  def validate(self, head_dim=None):
    """head_dim None (a checkpoint not loaded yet) skips the checks that need it."""
    if not _is_power_of_two(self.block_size) or self.block_size > 1024:
      _fail('pool.block_size', self.block_size, 'a power of two from 1 to 1024')
    if self.kv_dtype not in KV_DTYPES:
      _fail('pool.kv_dtype', self.kv_dtype, f'one of {KV_DTYPES}')
    if self.kind not in POOL_KINDS:
      _fail('pool.kind', self.kind, f'one of {POOL_KINDS}')
    try:
      self.kv_quant('float32').validate(head_dim)
    except ValueError as e:
      field = str(e).split('=')[0]
      names = {'kv_dtype': 'kv_dtype', 'group_size': 'kv_group_size',
               'key_per_channel': 'kv_key_per_channel', 'recent_window': 'kv_recent_window'}
      raise ConfigError(f'config.pool.{names.get(field, field)}: {e}') from None

  def kv_quant(self, model_dtype: str) -> kv_schemes.KVQuantConfig:
    """The pool's storage scheme ('auto' = the model's dtype)."""
    return kv_schemes.KVQuantConfig(
        kv_dtype=model_dtype if self.kv_dtype == 'auto' else self.kv_dtype,
        group_size=self.kv_group_size, key_per_channel=self.kv_key_per_channel,
        recent_window=self.kv_recent_window)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  # auto picks per backend: cpu (the native kernel, where it builds; else xla) on CPU, pallas_tpu
  # on TPU, pallas_gpu on GPU (kernels/__init__.py)
  impl: str = 'auto'

  def validate(self):
    if self.impl not in ATTENTION_IMPLS:
      _fail('attention.impl', self.impl, f'one of {ATTENTION_IMPLS}')


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  max_batch_size: int = 8  # running sequences per iteration
  prefill_chunk: int = 64  # prompt tokens per row per prefill call
  max_seq_len: int = 1024  # prompt + output; capped by the model's own limit
  # The smallest decode call (a power of two): fewer decode rows are padded up to it. 8 keeps
  # compilations few (fewer rows only happen at a run's start and tail); 1 gives a lone
  # sequence (single-stream, latency-bound decoding) its own programs of 1, 2 and 4 rows, which
  # cost what one row costs rather than eight, at up to three more compilations.
  decode_min_rows: int = 8
  # How the model's linear layers and output head multiply (kernels/linear_cpu.py): auto
  # (cpu_packed on a CPU backend where the native kernel builds; else XLA's dots), xla, cpu (the
  # native kernel reading the weights in place), cpu_fused (cpu with q/k/v and gate/up one
  # kernel call each), cpu_packed (cpu, and decode calls read a packed copy of every Dense
  # kernel and the head, made once: the weights' size again in host memory,
  # docs/decode_speed.md).
  linear_impl: str = 'auto'

  def validate(self):
    if not _is_int(self.max_batch_size) or self.max_batch_size < 1:
      _fail('engine.max_batch_size', self.max_batch_size, 'an integer >= 1')
    if not _is_power_of_two(self.prefill_chunk):
      _fail('engine.prefill_chunk', self.prefill_chunk, 'a power of two')
    if not _is_power_of_two(self.decode_min_rows):
      _fail('engine.decode_min_rows', self.decode_min_rows, 'a power of two')
    if self.linear_impl not in LINEAR_IMPLS:
      _fail('engine.linear_impl', self.linear_impl, f'one of {LINEAR_IMPLS}')
    if not _is_int(self.max_seq_len) or self.max_seq_len < 2:
      _fail('engine.max_seq_len', self.max_seq_len, 'an integer >= 2')
    # A chunk is a static [rows, chunk] shape of every prefill call: longer than any prompt can
    # be, it only pads (and a huge one exhausts memory in the first compile).
    longest_chunk = 1 << (self.max_seq_len - 1).bit_length()
    if self.prefill_chunk > longest_chunk:
      _fail('engine.prefill_chunk', self.prefill_chunk,
            f'a power of two at most {longest_chunk} (engine.max_seq_len={self.max_seq_len} '
            'rounded up to a power of two)')


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  # recompute | swap (to a host-RAM tier) | auto (the cheaper by the cost model, per victim)
  preemption: str = 'recompute'
  # which running sequence is preempted: newest | least_progress | priority | cost
  # (victim, admission and queue_order also take 'package.module:function': host/policies.py)
  victim: str = 'newest'
  # watermark (admit while blocks allow) | projected (also fit what running sequences will
  # hold admission_horizon tokens from now)
  admission: str = 'watermark'
  # order of the waiting queue: fcfs | sjf (fewest tokens left first) | priority
  queue_order: str = 'fcfs'
  admission_horizon: int = 0  # tokens ahead for 'projected'; 0 = to each one's max_new_tokens
  watermark: float = 0.01  # share of pool blocks paged admission keeps free
  max_num_batched_tokens: int = 0  # query tokens per iteration; 0 = max_batch_size * chunk
  swap_blocks: int = 0  # host-tier blocks for swap; 0 = as many as the pool

  def validate(self, max_batch_size: int):
    if self.preemption not in PREEMPTION_POLICIES:
      _fail('scheduler.preemption', self.preemption, f'one of {PREEMPTION_POLICIES}')
    for name, registry in (('victim', policies.VICTIM), ('admission', policies.ADMISSION),
                           ('queue_order', policies.QUEUE_ORDER)):
      _check_policy(f'scheduler.{name}', getattr(self, name), registry)
    if not _is_int(self.admission_horizon) or self.admission_horizon < 0:
      _fail('scheduler.admission_horizon', self.admission_horizon,
            'an integer >= 0 (tokens; 0 = each sequence\'s max_new_tokens)')
    w = self.watermark
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < 1:
      _fail('scheduler.watermark', w,
            'a number in [0, 1): the share of pool blocks admission keeps free')
    budget = self.max_num_batched_tokens
    if not _is_int(budget) or (budget != 0 and budget < max_batch_size):
      _fail('scheduler.max_num_batched_tokens', budget,
            f'0 (engine.max_batch_size * engine.prefill_chunk) or an integer >= '
            f'engine.max_batch_size={max_batch_size}, so every decode fits an iteration')
    if not _is_int(self.swap_blocks) or self.swap_blocks < 0:
      _fail('scheduler.swap_blocks', self.swap_blocks,
            'an integer >= 0 (host-tier blocks; 0 = as many as the pool)')


@dataclasses.dataclass(frozen=True)
class PrefixCacheConfig:
  enabled: bool = False  # reuse cached full blocks of earlier prompts
  design: str = 'hash'  # hash (chain over full blocks) | radix (tree)
  # which evictable cached block (or session) goes first: a policies.EVICTION name (lru, lfu,
  # leaves_first, gdsf, session_recency, s3fifo) or 'package.module:Class'
  eviction: str = 'lru'
  # Demote a session's idle blocks as a unit once it has been idle this long (engine-clock
  # seconds; host/cache/sessions.py); 0 = only when the pool needs the room.
  session_idle_s: float = 0.0

  def validate(self):
    if not isinstance(self.enabled, bool):
      _fail('prefix_cache.enabled', self.enabled, 'True or False')
    if self.design not in PREFIX_DESIGNS:
      _fail('prefix_cache.design', self.design,
            f'one of {PREFIX_DESIGNS} (hash chain over full blocks, or radix tree)')
    _check_policy('prefix_cache.eviction', self.eviction, policies.EVICTION)
    t = self.session_idle_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
      _fail('prefix_cache.session_idle_s', t, 'a finite number of seconds >= 0 (0 = off)')


@dataclasses.dataclass(frozen=True)
class TiersConfig:
  """KV tiers under the prefix cache (pagedjax/host/tiers/kv_tiers.py): host RAM (tier 2) and a
  tensorstore kvstore (tier 3) keep blocks the device evicts, and promote them back on a hit."""
  host_blocks: int = 0  # tier-2 capacity in blocks; 0 = no host tier
  disk_blocks: int = 0  # tier-3 capacity in blocks; 0 = no disk tier
  # tier 3's tensorstore kvstore: a directory, 'file:///dir/', 'memory://name/', 'gs://...'
  disk_kvstore: str = ''
  write_through: bool = False  # copy blocks down as they fill (else only on eviction)
  promotion: str = 'auto'  # auto (cost model) | load | recompute: what a lower-tier hit does
  eviction: str = 'lru'  # within tiers 2 and 3: a policies.EVICTION name or 'module:Class'
  # Most device blocks prefix_cache.pin() may keep (pinned prefixes are never evicted).
  pinned_blocks: int = 0
  # Cost-model figures (host/tiers/tier_cost.py); 0 = measured at engine start when a rule needs
  # them (tiers.promotion 'auto', scheduler.preemption 'auto', scheduler.victim 'cost').
  prefill_s_per_token: float = 0.0
  host_bytes_per_s: float = 0.0
  host_latency_s: float = 0.0
  disk_bytes_per_s: float = 0.0
  disk_latency_s: float = 0.0

  def validate(self, pool: PoolConfig, max_seq_len: int, prefix_caching: bool):
    # Sizes are checked against host RAM and free disk space once the block size in bytes is
    # known, before anything is allocated (host/capacity.py, at engine build).
    for name in ('host_blocks', 'disk_blocks', 'pinned_blocks'):
      value = getattr(self, name)
      if not _is_int(value) or value < 0:
        _fail(f'tiers.{name}', value, 'an integer >= 0 (blocks; 0 = none)')
    if self.disk_blocks > DISK_MAX_SLOTS:
      _fail('tiers.disk_blocks', self.disk_blocks,
            f'at most {DISK_MAX_SLOTS:,} (the disk arrays\' slots, host/tiers/disk_store.py)')
    if (self.enabled or self.pinned_blocks) and not prefix_caching:
      name = next(n for n in ('host_blocks', 'disk_blocks', 'pinned_blocks') if getattr(self, n))
      _fail(f'tiers.{name}', getattr(self, name),
            "0 unless prefix_cache.enabled=True (the tiers hold the cache's blocks)")
    # Pinned blocks leave the pool for good: the rest must still hold the longest request.
    room = pool.num_blocks - 1 - math.ceil(max_seq_len / pool.block_size)
    if self.pinned_blocks > max(room, 0):
      _fail('tiers.pinned_blocks', self.pinned_blocks,
            f'at most {max(room, 0)}: pool.num_blocks - 1 minus the blocks of one '
            f'engine.max_seq_len={max_seq_len} request')
    if self.disk_blocks and (not isinstance(self.disk_kvstore, str) or not self.disk_kvstore):
      _fail('tiers.disk_kvstore', self.disk_kvstore,
            "a directory or tensorstore kvstore URL ('file:///dir/', 'memory://name/') when "
            'tiers.disk_blocks > 0')
    if not isinstance(self.write_through, bool):
      _fail('tiers.write_through', self.write_through, 'True or False')
    if self.promotion not in PROMOTION_RULES:
      _fail('tiers.promotion', self.promotion, f'one of {PROMOTION_RULES}')
    _check_policy('tiers.eviction', self.eviction, policies.EVICTION)
    for name in ('prefill_s_per_token', 'host_bytes_per_s', 'host_latency_s',
                 'disk_bytes_per_s', 'disk_latency_s'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
          0 <= value < math.inf):
        _fail(f'tiers.{name}', value, 'a finite number >= 0 (0 = measured at engine start)')

  @property
  def enabled(self) -> bool:
    return bool(self.host_blocks or self.disk_blocks)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
  """KV offload for contexts longer than the device (pagedjax/host/scheduling/offload.py): a long
  sequence keeps its newest `device_blocks` blocks in the pool, its older ones live in host RAM
  or on the disk tier (host/scheduling/offload_store.py) and stream through attention
  `chunk_blocks` at a time, every step, inside the engine's own iterations
  (model/streamed_attention.py)."""
  # Host-RAM blocks for offloaded K/V (checked against host RAM at engine build); with
  # disk_blocks 0 as well, offload is off: a request that can never fit the pool is refused.
  host_blocks: int = 0
  device_blocks: int = 16  # device blocks an offloaded sequence may hold (its newest tokens)
  # Host blocks per fold step of streamed attention (the last chunk padded): the unit its
  # online softmax merges, inside one program per layer group.
  chunk_blocks: int = 8
  # Layers per streamed program: a program takes its layers' host blocks of the whole batch in
  # one transfer and runs them (q/k/v, every fold step, o_proj, MLP). Device memory holds that
  # many layers' host K/V at once (two groups while the next is transferred): 1 keeps offload's
  # point on an accelerator; a value >= the model's layers streams every layer's host K/V in
  # one program per step (fewest calls; as much device memory as the offloaded blocks, so only
  # where calls cost more than memory, as on a CPU).
  layers_per_call: int = 1
  # When a decode finds the pool out of blocks, first shrink the running sequence holding the
  # most blocks beyond device_blocks to that many (its older blocks offloaded), and preempt
  # only when none can be shrunk.
  instead_of_preempting: bool = False
  # Disk-tier blocks for offloaded K/V, in the tensorstore kvstore disk_kvstore (a directory or
  # URL; checked against its free space at engine build); 0 = host RAM only.
  disk_blocks: int = 0
  disk_kvstore: str = ''
  # Where a block leaving a window goes first, 'host' or 'disk' (the other tier when it is
  # full): a request may hold up to host_blocks + disk_blocks beyond its window.
  placement: str = 'host'
  # An offloaded sequence decodes on one iteration in decode_every while other sequences run
  # (1 = every iteration): its streamed call's time is spread over that many of its neighbours'
  # steps, at the price of its own tokens. Alone, it decodes every iteration.
  decode_every: int = 1
  # With prefix_cache.enabled: offloaded blocks join the prefix cache (host/scheduling/
  # offload_index.py). A block moving out of a window is indexed by its chain key, a finished
  # sequence's window is copied out beside them, and a later offloaded prompt with the same
  # prefix (a follow-up turn over a long document, a recomputed sequence) takes them from the
  # store instead of prefilling them; blocks no sequence holds stay until the store needs the
  # room, in prefix_cache.eviction's order.
  cache_blocks: bool = True
  # When an offloaded sequence decodes, the ordinary decode rows whose blocks fit device_blocks
  # decode in the same streamed programs (one pass over each layer's weights for both, not the
  # batched step's and then the streamed one's); their attention is then the streamed path's
  # window read. False: they always run in the batched decode step.
  join_decodes: bool = True

  def validate(self, pool: PoolConfig, tiers: TiersConfig):
    for name, least in (('host_blocks', 0), ('device_blocks', 1), ('chunk_blocks', 1),
                        ('layers_per_call', 1), ('disk_blocks', 0), ('decode_every', 1)):
      value = getattr(self, name)
      if not _is_int(value) or value < least:
        _fail(f'offload.{name}', value, f'an integer >= {least}')
    for name in ('instead_of_preempting', 'cache_blocks', 'join_decodes'):
      if not isinstance(getattr(self, name), bool):
        _fail(f'offload.{name}', getattr(self, name), 'True or False')
    if self.placement not in ('host', 'disk'):
      _fail('offload.placement', self.placement, "'host' or 'disk'")
    if not self.enabled:
      return
    if self.disk_blocks and (not isinstance(self.disk_kvstore, str) or not self.disk_kvstore):
      _fail('offload.disk_kvstore', self.disk_kvstore,
            "a directory or tensorstore kvstore URL ('file:///dir/', 'memory://name/') when "
            'offload.disk_blocks > 0')
    placed = {'host': self.host_blocks, 'disk': self.disk_blocks}[self.placement]
    if not placed:
      other = 'disk' if self.placement == 'host' else 'host'
      _fail('offload.placement', self.placement,
            f"'{other}' when offload.{self.placement}_blocks is 0 (blocks go to a tier that "
            'has some)')
    field = 'offload.host_blocks' if self.host_blocks else 'offload.disk_blocks'
    value = self.host_blocks or self.disk_blocks
    # (A window smaller than a prompt chunk's blocks only shortens that sequence's chunks.)
    if self.device_blocks > pool.num_blocks - 1:
      _fail('offload.device_blocks', self.device_blocks,
            f'at most pool.num_blocks - 1 = {pool.num_blocks - 1} (the window lives in the pool)')
    if pool.kind != 'paged':
      _fail(field, value, "0 unless pool.kind='paged'")
    if tiers.enabled:
      _fail(field, value,
            '0 with lower KV tiers (tiers.host_blocks / disk_blocks): not combined yet')

  @property
  def enabled(self) -> bool:
    return bool(self.host_blocks or self.disk_blocks)


@dataclasses.dataclass(frozen=True)
class AlertsConfig:
  """The windowed prefix hit rate, its alert and the throttle the alert drives
  (pagedjax/host/alerts.py): a recomputation storm seen and damped."""
  hit_rate_window: int = 32  # iterations the windowed prefix hit rate covers
  # The alert fires when the windowed rate falls more than this fraction below the window
  # before; 0 = no alert.
  hit_rate_drop: float = 0.0
  # Prompt tokens per iteration at most while the alert is active; 0 = no throttle.
  throttle_prefill_tokens: int = 0

  def validate(self, prefix_caching: bool):
    if not _is_int(self.hit_rate_window) or self.hit_rate_window < 1:
      _fail('alerts.hit_rate_window', self.hit_rate_window, 'an integer >= 1 (iterations)')
    d = self.hit_rate_drop
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1:
      _fail('alerts.hit_rate_drop', d, 'a fraction in [0, 1): how far the windowed hit rate '
            'must fall below the window before to fire the alert (0 = no alert)')
    if d and not prefix_caching:
      _fail('alerts.hit_rate_drop', d,
            '0 unless prefix_cache.enabled=True (the alert watches the prefix hit rate)')
    n = self.throttle_prefill_tokens
    if not _is_int(n) or n < 0:
      _fail('alerts.throttle_prefill_tokens', n,
            'an integer >= 0 (prompt tokens per iteration while the alert is active; 0 = none)')
    if n and not d:
      _fail('alerts.throttle_prefill_tokens', n,
            '0 unless alerts.hit_rate_drop > 0 (the alert turns the throttle on and off)')


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  model: int = 1  # tensor-parallel degree: KV pool over KV heads, weights over heads / MLP

  def validate(self, model_cfg=None):
    try:  # a checkpoint's shape is checked again once it is loaded (factory.py)
      sharding.validate_mesh(model_cfg, self.model)
    except ValueError as e:
      raise ConfigError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelSection = ModelSection()
  pool: PoolConfig = PoolConfig()
  attention: AttentionConfig = AttentionConfig()
  engine: EngineConfig = EngineConfig()
  scheduler: SchedulerConfig = SchedulerConfig()
  prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
  tiers: TiersConfig = TiersConfig()
  alerts: AlertsConfig = AlertsConfig()
  offload: OffloadConfig = OffloadConfig()
  sampling: SamplingParams = SamplingParams()
  mesh: MeshConfig = MeshConfig()

  def validate(self) -> 'Config':
    """Every section, then the checks that span sections; returns self."""
    self.model.validate()
    random_cfg = self.model.random_model_config() if self.model.source == 'random' else None
    self.mesh.validate(random_cfg)
    self.pool.validate(random_cfg.head_dim if random_cfg else None)
    self.attention.validate()
    self.engine.validate()
    self.scheduler.validate(self.engine.max_batch_size)
    self.prefix_cache.validate()
    self.tiers.validate(self.pool, self.engine.max_seq_len, self.prefix_cache.enabled)
    self.alerts.validate(self.prefix_cache.enabled)
    self.offload.validate(self.pool, self.tiers)
    try:
      self.sampling.validate()
    except ValueError as e:
      raise ConfigError(f'config.sampling.{e}') from None
    pool, eng = self.pool, self.engine
    # Every running sequence holds at least one block, and block 0 is the null block.
    if not _is_int(pool.num_blocks) or pool.num_blocks < eng.max_batch_size + 1:
      _fail('pool.num_blocks', pool.num_blocks,
            f'at least engine.max_batch_size + 1 = {eng.max_batch_size + 1} '
            '(one block per sequence, plus the null block)')
    reserve = math.ceil(eng.max_seq_len / pool.block_size)
    if pool.kind == 'contiguous' and pool.num_blocks < reserve + 1:
      _fail('pool.num_blocks', pool.num_blocks,
            f'at least {reserve + 1} with pool.kind=\'contiguous\': one reservation of '
            f'engine.max_seq_len={eng.max_seq_len} tokens in blocks of {pool.block_size}, '
            'plus the null block')
    if self.prefix_cache.enabled and pool.kv_recent_window:
      _fail('prefix_cache.enabled', True,
            'False with pool.kv_recent_window > 0 (shared blocks cannot carry per-sequence rings)')
    if self.scheduler.preemption != 'recompute' and pool.kv_recent_window:
      _fail('scheduler.preemption', self.scheduler.preemption, "'recompute' with "
            'pool.kv_recent_window > 0 (swap does not carry the per-sequence rings; recompute '
            'rebuilds them)')
    if self.prefix_cache.session_idle_s and not self.prefix_cache.enabled:
      _fail('prefix_cache.session_idle_s', self.prefix_cache.session_idle_s,
            '0 unless prefix_cache.enabled=True (sessions are cached blocks)')
    return self

  # ---- ConfigDict <-> dataclasses ----------------------------------------------------------

  @classmethod
  def from_configdict(cls, config) -> 'Config':
    """The engine's sections of an experiment ConfigDict, typed and validated."""
    sections = {}
    for field in dataclasses.fields(cls):
      section = config.get(field.name)
      values = {} if section is None else _plain(section)
      if field.name == 'sampling':
        sections['sampling'] = _build(SamplingParams, values, 'sampling', SAMPLING_FIELDS)
      elif field.name == 'model':
        random = _build(RandomModelConfig, values.pop('random', {}), 'model.random')
        sections['model'] = _build(ModelSection, {**values, 'random': random}, 'model')
      else:
        sections[field.name] = _build(field.type, values, field.name)
    return cls(**sections).validate()

  def to_configdict(self) -> ml_collections.ConfigDict:
    """These values as a ConfigDict that config files extend and absl flags override."""
    out = dataclasses.asdict(self)
    out['sampling'] = {k: out['sampling'][k] for k in SAMPLING_FIELDS}
    return ml_collections.ConfigDict(out)


def _plain(section) -> Dict[str, Any]:
  return section.to_dict() if hasattr(section, 'to_dict') else dict(section)


def _build(cls, values: Dict[str, Any], name: str, allowed=None):
  allowed = allowed or [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(values) - set(allowed))
  if unknown:
    raise ConfigError(f'config.{name}.{unknown[0]} is not a field: {name} has '
                      f'{", ".join(allowed)}')
  return cls(**values)


def validate_config(config):
  """Checks every field of the typed sections; raises ConfigError on the first bad one, else
  returns the ConfigDict. (A study's own sections, such as the trace a trace job replays, are
  checked by the study: pagedjax/studies/workloads.py validate_config.)"""
  Config.from_configdict(config)
  return config
