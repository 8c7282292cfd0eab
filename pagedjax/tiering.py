"""An engine's KV tiers (host/tiers/kv_tiers.py) built from config.tiers: the fingerprint that names its
disk blocks, and the cost model's figures, measured on this machine at engine start. Like
executor.py, this file joins host bookkeeping and device code.

Fingerprint (16 bytes, names the disk tier's directory and is checked in every entry's header):
BLAKE2b over everything the K/V a block holds depend on, given its tokens:
  the disk format version;
  the model's config, every field (layers, heads, head_dim, rope_theta, norm_eps, qkv_bias,
    the compute dtype, ...);
  the weights: every byte of every parameter, with its path, shape and dtype
    (model/weights.py:params_digest, hashed once per params tree, or a verified weight cache
    entry's checksums);
  the pool's KV storage: its spec (every field: kv_dtype, group_size, key_per_channel,
    recent_window) and scheme, the block size, and each per-block array's shape and dtype;
  the code that turns weights and tokens into stored K/V (KV_CODE: the model's layers, the
    pool's paging, the storage schemes and their quantizers), byte for byte, so a store written
    by an edited model or quantizer is not read.
Any change is another fingerprint, so another directory: a miss, never another model's K/V (a
fingerprint may also change where the K/V would not, which costs only misses). The attention
implementation, the XLA version and the mesh are left out: they change K/V only to float
tolerance, as prefix caching already assumes across batch shapes.

Calibration (only for a rule that weighs costs: tiers.promotion='auto',
scheduler.preemption='auto' or scheduler.victim='cost'; only the figures config.tiers leaves at 0):
  prefill_s_per_token  one prefill call of max_batch_size rows x prefill_chunk tokens, whose
                       tokens all write into the null block (garbage by design, pool.py), timed
                       after a warm-up call; seconds / (rows x tokens).
  host bytes/s, latency  bandwidth: copying 16 MiB host -> device; latency: a one-block scatter
                       into the null block (a promotion call's fixed cost).
  disk bytes/s, latency  DiskStore.measure_read: reads of up to 8 of the store's own records
                       (latency: one record; bandwidth: the rest), or, in a store holding none,
                       of scratch records in a temporary store, removed after: calibration
                       never writes into the store (which may be read-only).
Each is the best of 3 timings after a warm-up.
The warm-up compiles the same programs the run uses (they are cached per shape), so the few
seconds are mostly paid once; they are not charged to the engine's compilation count.

On a simulated device (pagedjax/sim/simulated_device.py: SimulatedBackend.tier_layout and
tier_costs) the same KVTiers run over a ContentFreeLayout: the same demotions, lookups,
promotions, evictions and KV events, no bytes moved, each gather and scatter charged by the cost
model; the figures are the model's (tier_costs), not measured; a disk tier is refused.

Tier sizes are checked against host RAM and free disk space (host/capacity.py) before anything
is allocated: a size that does not fit is a ConfigError naming the field, value and limit.
"""
import functools
import hashlib
import math
import time
from typing import Optional, Tuple

import jax
import numpy as np

from pagedjax.device import block_transfer, kv_quant, kv_schemes, pool as pool_lib
from pagedjax.host.scheduling.allocator import NULL_BLOCK
from pagedjax.host.tiers.disk_store import FORMAT_VERSION, DiskStore
from pagedjax.host.tiers.kv_tiers import BlockLayout, KVTiers
from pagedjax.host.scheduling.step_inputs import RowSpec, build_step_inputs, padded_ids
from pagedjax.host.tiers.tier_cost import TierCosts
from pagedjax.model import llama, weights

CALIBRATION_BLOCKS = 8
CALIBRATION_BYTES = 16 << 20
CALIBRATION_REPEATS = 3
# The modules whose code turns weights and token ids into the K/V a block stores.
KV_CODE = (llama, pool_lib, kv_schemes, kv_quant)


@functools.lru_cache(maxsize=None)
def kv_code_digest() -> bytes:
  """A digest of KV_CODE's source files, as this process loaded them."""
  h = hashlib.blake2b(digest_size=16)
  for module in KV_CODE:
    with open(module.__file__, 'rb') as f:
      h.update(f'|{module.__name__}|'.encode() + f.read())
  return h.digest()


def fingerprint(model_cfg, params, pool, block_size: int) -> bytes:
  """16 bytes naming what a disk block's K/V depend on (see the module docstring); params None
  (a model-free test engine) hashes as no weights."""
  h = hashlib.blake2b(digest_size=16)
  h.update(f'pagedjax-kv-v{FORMAT_VERSION}|{model_cfg!r}|{pool.spec!r}|{pool.scheme!r}|'
           f'{block_size}'.encode())
  for name, (shape, dtype) in sorted(pool.block_array_shapes().items()):
    h.update(f'|{name}{(shape[0],) + tuple(shape[2:])}{np.dtype(dtype).str}'.encode())
  h.update(kv_code_digest())
  h.update(b'|no weights' if params is None else b'|weights' + weights.params_digest(params))
  return h.digest()


def build_tiers(config, model_cfg, executor) -> Optional[KVTiers]:
  """The tiers config.tiers asks for, under the executor's prefix cache, or None (off); sets
  the cache's pinned budget either way."""
  t = config.tiers
  cache = executor.blocks.cache
  if cache is not None:
    cache.pin_budget = t.pinned_blocks
  if not t.enabled:
    return None
  if cache is None:
    raise ValueError('KV tiers need prefix caching on (prefix_cache.enabled=True)')
  # What built the device gives the block layout and the promotion figures: on a real device
  # the pool's arrays and measured figures (pool_layout, calibrated_cost), on pagedjax/sim's a
  # layout without contents and its cost model's figures.
  layout = executor.backend.tier_layout(t, executor)
  block_size = config.pool.block_size
  disk = None
  if t.disk_blocks:
    disk = DiskStore(t.disk_kvstore, t.disk_blocks, layout.nbytes,
                     fingerprint(model_cfg, executor.params, executor.pool, block_size),
                     t.eviction)
  cost = None
  if t.promotion == 'auto':
    cost = executor.backend.tier_costs(t, executor, layout, disk)
  tiers = KVTiers(layout, block_size, host_blocks=t.host_blocks, disk=disk, eviction=t.eviction,
                  write_through=t.write_through, promotion=t.promotion, cost=cost)
  return tiers.attach(cache)


def pool_layout(t, executor) -> BlockLayout:
  """The KV tiers' block layout on a real device (JaxBackend.tier_layout): the pool's arrays."""
  del t
  shapes = executor.pool.block_array_shapes()
  if not shapes:
    raise ValueError('KV tiers need a pool that holds block arrays, or a backend that models '
                     'them (tier_layout, as pagedjax/sim\'s)')
  return BlockLayout(shapes)


def preemption_cost(t, executor) -> TierCosts:
  """The cost model preemption weighs when no KV tiers were built (no disk figures)."""
  return calibrated_cost(t, executor, BlockLayout(executor.pool.block_array_shapes()), None)


def calibrated_cost(t, executor, layout: BlockLayout, disk: Optional[DiskStore]) -> TierCosts:
  """The cost model with config.tiers' figures, measuring each one left at 0."""
  prefill = t.prefill_s_per_token or measure_prefill_s_per_token(executor)
  host = (t.host_bytes_per_s, t.host_latency_s)
  if not all(host):
    measured = measure_host_copy(executor, layout)
    host = tuple(v or m for v, m in zip(host, measured))
  disk_figures = (t.disk_bytes_per_s, t.disk_latency_s)
  if not all(disk_figures):
    measured = (disk.measure_read(CALIBRATION_BLOCKS) if disk is not None and disk.enabled
                else (math.inf, math.inf))  # no disk tier: never a tier-3 load
    disk_figures = tuple(v or m for v, m in zip(disk_figures, measured))
  return TierCosts.for_tiers(executor.block_size, layout.nbytes, prefill, host, disk_figures)


def _best_time(fn, repeats: int = CALIBRATION_REPEATS) -> float:
  fn()  # warm-up: compiles
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def measure_prefill_s_per_token(executor) -> float:
  """Seconds per token of a full prefill call (max_batch_size rows x prefill_chunk tokens)."""
  rows, tokens = executor.batch_buckets[-1], executor.token_buckets[-1]
  table = [NULL_BLOCK] * math.ceil(tokens / executor.block_size)
  inputs = build_step_inputs([RowSpec([0] * tokens, 0, table) for _ in range(rows)],
                             executor.block_size, executor.batch_buckets,
                             executor.token_buckets, executor.table_width_buckets)

  def call():
    out = executor.step_fn(executor.params, executor.pool, inputs)
    executor.pool = out[0]
    np.asarray(out[1])

  return max(_best_time(call) / (rows * tokens), 1e-12)


def measure_host_copy(executor, layout: BlockLayout) -> Tuple[float, float]:
  """(bytes/s, latency s) of moving blocks host -> device: the latency is a one-block scatter
  into the null block (the fixed cost of a promotion call), the bandwidth that of copying
  CALIBRATION_BYTES to the device (blocks of a tiny model are too small to time it)."""
  ids = padded_ids([NULL_BLOCK], executor.transfer_buckets)
  data = {name: np.zeros((shape[0], len(ids)) + shape[1:], dtype)
          for name, shape, dtype in layout.fields}

  def scatter():
    executor.pool = jax.block_until_ready(block_transfer.scatter_blocks(executor.pool, ids, data))

  payload = np.ones(CALIBRATION_BYTES, np.uint8)
  copy_s = _best_time(lambda: jax.block_until_ready(jax.device_put(payload)))
  return CALIBRATION_BYTES / max(copy_s, 1e-9), _best_time(scatter)
