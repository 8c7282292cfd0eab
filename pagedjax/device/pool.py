"""The paged KV pool: device state carried through every jitted step.

Layout (chosen by measurement on CPU, see the README):
  k, v: [num_layers, num_blocks, num_kv_heads, block_size, head_dim]
One block holds `block_size` consecutive tokens of one sequence for every layer and KV head.
A token's *slot* is `block * block_size + offset`.

Block 0 is the null block. It is never handed out by the allocator: padding entries of block
tables point at it and the K/V of padded tokens are written into it, so its contents are garbage
by design and attention must never read it for a real token (the isolation tests fill it with NaN).

Quantized pools (`KVQuantConfig`, pagedjax/quant.py) store codes in k/v and float16 scales
(and, for int4, zero points) next to them:
  int8, fp8_*          k, v [L, N, H, bs, D] int8/float8; k_scale, v_scale [L, N, H, bs]
  int4                 k, v [L, N, H, bs, D/2] uint8, two channels per byte;
                       v_scale, v_zero [L, N, H, bs, D/g]; keys the same, or with
                       key_per_channel k_scale, k_zero [L, N, H, D] (one range per block channel)
K/V are quantized as they are written, so attention always reads what the cache really holds.
"""
import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kernels import paged_attention
from pagedjax.device import kv_quant as quant
from pagedjax.model import sharding

# Block 0 is the null block (above). The host side names it too (pagedjax.host.allocator, which
# must not import device code); tests/test_layers.py checks that the two agree.
NULL_BLOCK = 0
# Quantized layouts the attention kernels dequantize themselves (kernels/__init__.py).
KERNEL_NATIVE = ('int8', 'fp8_e4m3')


BLOCK_FIELDS = ('k', 'v', 'k_scale', 'v_scale', 'k_zero', 'v_zero')


@flax.struct.dataclass
class KVPool:
  k: jnp.ndarray  # [layers, blocks, kv_heads, block_size, head_dim (int4: head_dim / 2)]
  v: jnp.ndarray  # same as k
  k_scale: Optional[jnp.ndarray] = None  # quantized pools only, shapes in the module docstring
  v_scale: Optional[jnp.ndarray] = None
  k_zero: Optional[jnp.ndarray] = None  # int4 only
  v_zero: Optional[jnp.ndarray] = None
  recent_k: Optional[jnp.ndarray] = None  # [layers, lanes, kv_heads, recent_window, head_dim]
  recent_v: Optional[jnp.ndarray] = None  # bfloat16 rings; only with a recent window
  scheme: quant.KVQuantConfig = flax.struct.field(pytree_node=False,
                                                  default=quant.KVQuantConfig())

  def block_arrays(self) -> dict:
    """Field name -> array for every per-block array (block axis 1): what block copies and
    tier transfers move. The recent-window rings are per lane, not per block."""
    return {name: getattr(self, name) for name in BLOCK_FIELDS if getattr(self, name) is not None}

  def block_array_shapes(self) -> dict:
    """Field name -> (shape, numpy dtype) of block_arrays(), for host-side stores."""
    return {name: (tuple(x.shape), np.dtype(x.dtype)) for name, x in self.block_arrays().items()}

  @property
  def num_blocks(self) -> int:
    return self.k.shape[1]

  @property
  def block_size(self) -> int:
    return self.k.shape[3]

  @property
  def nbytes(self) -> int:
    """True bytes held, scales and zero points included."""
    arrays = (self.k, self.v, self.k_scale, self.v_scale, self.k_zero, self.v_zero,
              self.recent_k, self.recent_v)
    return sum(a.nbytes for a in arrays if a is not None)

  @property
  def bytes_per_token(self) -> float:
    """K and V bytes one block slot takes, over all layers (scales included; the fixed-size
    recent-window rings are not per token and are excluded here, but counted in nbytes)."""
    rings = sum(a.nbytes for a in (self.recent_k, self.recent_v) if a is not None)
    return (self.nbytes - rings) / (self.num_blocks * self.block_size)


def _shapes(num_layers, num_blocks, num_kv_heads, block_size, head_dim, q: quant.KVQuantConfig,
            num_lanes: int = 0):
  """Field name -> (shape, dtype) for a pool of this configuration."""
  lead = (num_layers, num_blocks, num_kv_heads, block_size)
  if q.recent_window:
    ring = ((num_layers, num_lanes, num_kv_heads, q.recent_window, head_dim), quant.RECENT_DTYPE)
    return {**_shapes(num_layers, num_blocks, num_kv_heads, block_size, head_dim,
                      dataclasses.replace(q, recent_window=0)),
            'recent_k': ring, 'recent_v': ring}
  if not q.is_quantized:
    dtype = quant.FLOAT_DTYPES[q.kv_dtype]
    return {'k': (lead + (head_dim,), dtype), 'v': (lead + (head_dim,), dtype)}
  if q.kv_dtype != 'int4':
    dtype = jnp.int8 if q.kv_dtype == 'int8' else quant.FP8_DTYPES[q.kv_dtype]
    return {'k': (lead + (head_dim,), dtype), 'v': (lead + (head_dim,), dtype),
            'k_scale': (lead, quant.SCALE_DTYPE), 'v_scale': (lead, quant.SCALE_DTYPE)}
  groups = lead + (head_dim // q.group_size,)
  key_scales = lead[:3] + (head_dim,) if q.key_per_channel else groups
  return {'k': (lead + (head_dim // 2,), jnp.uint8), 'v': (lead + (head_dim // 2,), jnp.uint8),
          'k_scale': (key_scales, quant.SCALE_DTYPE), 'k_zero': (key_scales, quant.SCALE_DTYPE),
          'v_scale': (groups, quant.SCALE_DTYPE), 'v_zero': (groups, quant.SCALE_DTYPE)}


def init_pool(num_layers, num_blocks, num_kv_heads, block_size, head_dim, dtype=jnp.float32,
              kv_quant: Optional[quant.KVQuantConfig] = None, max_sequences: int = 0) -> KVPool:
  """An all-zero pool. `kv_quant` picks the storage; without it, plain `dtype` storage.

  With a recent window, `max_sequences` rings are made (lanes 1..max_sequences; lane 0 is the
  null lane that padded rows write into, like the null block).
  """
  if kv_quant is None:
    kv_quant = quant.KVQuantConfig(jnp.dtype(dtype).name)
  kv_quant.validate(head_dim)
  if kv_quant.recent_window and max_sequences < 1:
    raise ValueError(f'a recent window needs max_sequences >= 1 lanes, got {max_sequences}')
  shapes = _shapes(num_layers, num_blocks, num_kv_heads, block_size, head_dim, kv_quant,
                   max_sequences + 1)
  return KVPool(**{name: jnp.zeros(shape, dt) for name, (shape, dt) in shapes.items()},
                scheme=kv_quant)


def init_model_pool(model_cfg, num_blocks: int, block_size: int, kv_quant: quant.KVQuantConfig,
                    max_sequences: int, mesh=None) -> KVPool:
  """An all-zero pool for a model (ModelConfig). With a mesh it is created already split over KV
  heads: each device allocates only its shard (a pool sized for the whole mesh need not fit on
  one device first)."""
  make = lambda: init_pool(model_cfg.num_layers, num_blocks, model_cfg.num_kv_heads, block_size,
                           model_cfg.head_dim, kv_quant=kv_quant, max_sequences=max_sequences)
  if mesh is None:
    return make()
  return sharding.empty_pool_like(jax.eval_shape(make), mesh, model_cfg.num_kv_heads)


def pool_bytes(num_layers, num_blocks, num_kv_heads, block_size, head_dim,
               kv_quant: quant.KVQuantConfig, max_sequences: int = 0) -> int:
  """Bytes of such a pool, computed without allocating it (sizing, capacity planning)."""
  shapes = _shapes(num_layers, num_blocks, num_kv_heads, block_size, head_dim, kv_quant,
                   max_sequences + 1)
  return sum(int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in shapes.values())


# ---- writing ---------------------------------------------------------------------------------


def write_kv(pool: KVPool, layer, k, v, batch) -> KVPool:
  """Quantize (if needed) and store one layer's new K/V [B, T, Hkv, Dh] at `batch.slot_mapping`.

  In place when the pool is donated. `batch` is the step's StepInputs (pagedjax/step_inputs.py).
  """
  if pool.scheme.recent_window:
    pool = _write_recent(pool, layer, k, v, batch)
  slots = batch.slot_mapping
  blocks, offsets = slots // pool.block_size, slots % pool.block_size
  q = pool.scheme
  at = lambda a: a.at[layer, blocks, :, offsets]  # [B, T] slots -> [B, T, H, ...] updates
  if not q.is_quantized:
    return pool.replace(k=at(pool.k).set(k.astype(pool.k.dtype)),
                        v=at(pool.v).set(v.astype(pool.v.dtype)))
  if q.kv_dtype != 'int4':
    kq, ks = quant.quantize_symmetric(k, q.kv_dtype)
    vq, vs = quant.quantize_symmetric(v, q.kv_dtype)
    return pool.replace(k=at(pool.k).set(kq), v=at(pool.v).set(vq),
                        k_scale=at(pool.k_scale).set(ks), v_scale=at(pool.v_scale).set(vs))
  vq, vs, vz = quant.quantize_int4_groups(v, q.group_size)
  pool = pool.replace(v=at(pool.v).set(vq), v_scale=at(pool.v_scale).set(vs),
                      v_zero=at(pool.v_zero).set(vz))
  if q.key_per_channel:
    return _write_keys_per_channel(pool, layer, k, batch)
  kq, ks, kz = quant.quantize_int4_groups(k, q.group_size)
  return pool.replace(k=at(pool.k).set(kq), k_scale=at(pool.k_scale).set(ks),
                      k_zero=at(pool.k_zero).set(kz))


def _write_recent(pool: KVPool, layer, k, v, batch) -> KVPool:
  """Ring write: position p of lane l lands in slot p % W. Only positions that are still among
  the newest W after this step are written, so a chunk longer than W cannot collide with
  itself; everything else (and padding) goes to the null lane 0."""
  window = pool.scheme.recent_window
  pos = batch.positions
  keep = (pos >= 0) & (pos >= batch.context_lens[:, None] - window)
  lanes = jnp.where(keep, batch.lanes[:, None], 0)
  at = lambda a: a.at[layer, lanes, :, jnp.maximum(pos, 0) % window]
  return pool.replace(recent_k=at(pool.recent_k).set(k.astype(quant.RECENT_DTYPE)),
                      recent_v=at(pool.recent_v).set(v.astype(quant.RECENT_DTYPE)))


def _write_keys_per_channel(pool: KVPool, layer, k, batch) -> KVPool:
  """KIVI keys: a block's per-channel range covers all its tokens, so every block the chunk
  touches is dequantized, merged with the new keys, and requantized over its valid tokens.
  Codes of unchanged tokens survive exactly while the range does not grow. A row touches at most
  (T - 1) // bs + 2 consecutive logical blocks; rows never share a block they write."""
  bs = pool.block_size
  num_rows, num_new = batch.positions.shape
  span = (num_new + bs - 2) // bs + 1
  real = batch.positions >= 0
  count = real.sum(axis=1)  # real tokens of each row this step
  start = jnp.where(count > 0, batch.positions[:, 0], 0)
  logical = start[:, None] // bs + jnp.arange(span)  # [B, span]
  max_logical = batch.block_tables.shape[1]
  touched = (logical * bs < (start + count)[:, None]) & (logical < max_logical)
  physical = jnp.take_along_axis(batch.block_tables, jnp.minimum(logical, max_logical - 1), 1)
  physical = jnp.where(touched, physical, NULL_BLOCK)

  old = quant.dequantize_int4_channels(pool.k[layer, physical], pool.k_scale[layer, physical],
                                       pool.k_zero[layer, physical])  # [B, span, H, bs, D]
  pos = logical[:, :, None] * bs + jnp.arange(bs)  # [B, span, bs]
  rel = pos - start[:, None, None]
  is_new = (rel >= 0) & (rel < count[:, None, None])
  rows = jnp.arange(num_rows)[:, None, None]
  new = k[rows, jnp.clip(rel, 0, num_new - 1)]  # [B, span, bs, H, D]
  merged = jnp.where(is_new[:, :, None, :, None], jnp.swapaxes(new, 2, 3), old)
  valid = pos < batch.context_lens[:, None, None]
  packed, scale, zero = quant.quantize_int4_channels(merged, valid[:, :, None, :])
  return pool.replace(k=pool.k.at[layer, physical].set(packed),
                      k_scale=pool.k_scale.at[layer, physical].set(scale),
                      k_zero=pool.k_zero.at[layer, physical].set(zero))


# ---- reading ---------------------------------------------------------------------------------


def dequantize_blocks(pool: KVPool, layer, tables):
  """K and V of the blocks in `tables` [B, MB], dequantized: two [B, MB, H, bs, D] float32."""
  q_cfg = pool.scheme
  pick = lambda a: None if a is None else a[layer, tables]
  k, v = pick(pool.k), pick(pool.v)
  if not q_cfg.is_quantized:
    return k.astype(jnp.float32), v.astype(jnp.float32)
  if q_cfg.kv_dtype != 'int4':
    return (quant.dequantize_symmetric(k, pick(pool.k_scale)),
            quant.dequantize_symmetric(v, pick(pool.v_scale)))
  dequantize_keys = (quant.dequantize_int4_channels if q_cfg.key_per_channel
                     else quant.dequantize_int4_groups)
  return (dequantize_keys(k, pick(pool.k_scale), pick(pool.k_zero)),
          quant.dequantize_int4_groups(v, pick(pool.v_scale), pick(pool.v_zero)))


def _overlay_recent(pool: KVPool, layer, k, v, batch):
  """Replace the newest W tokens of each row's dequantized blocks [B, MB, H, bs, D] by their
  unquantized copies from the row's ring."""
  window, bs = pool.scheme.recent_window, pool.block_size
  width = k.shape[1]
  pos = (jnp.arange(width)[:, None] * bs + jnp.arange(bs))  # [MB, bs]
  ctx = batch.context_lens[:, None, None]
  recent = (pos >= ctx - window) & (pos < ctx)  # [B, MB, bs]
  ring = lambda a: a[layer, batch.lanes][:, :, pos % window]  # [B, H, MB, bs, D]
  pick = lambda ring_vals, dense: jnp.where(recent[:, :, None, :, None],
                                            jnp.moveaxis(ring_vals, 1, 2).astype(jnp.float32),
                                            dense)
  return pick(ring(pool.recent_k), k), pick(ring(pool.recent_v), v)


def attend(pool: KVPool, layer, q, positions, batch, impl: str):
  """Paged attention of q [B, T, Hq, Dh] over this layer's blocks in `batch.block_tables`.

  Float pools and the layouts the kernels read natively (int8 / fp8_e4m3 codes with one scale per
  token and head) go straight to the kernels, which dequantize inside: no dequantized copy of the
  pool. Other layouts (int4, fp8_e5m2) gather and dequantize only the blocks this batch
  references, then hand them to the same kernels as a small pool whose block table is the
  identity.
  """
  args = (batch.block_tables, batch.context_lens, positions)
  # The whole layer-stacked pool goes in with `layer`: slicing pool.k[layer] out here would copy
  # that layer (every layer, every step) before a kernel loop could read it.
  if not pool.scheme.is_quantized:
    return paged_attention(q, pool.k, pool.v, *args, impl=impl, layer=layer)
  if pool.scheme.kv_dtype in KERNEL_NATIVE and not pool.scheme.recent_window:
    return paged_attention(q, pool.k, pool.v, *args, impl=impl, layer=layer,
                           k_scales=pool.k_scale, v_scales=pool.v_scale)
  tables = batch.block_tables
  k, v = dequantize_blocks(pool, layer, tables)
  if pool.scheme.recent_window:
    k, v = _overlay_recent(pool, layer, k, v, batch)
  num_rows, width = tables.shape
  flat = lambda x: x.reshape(num_rows * width, *x.shape[2:])
  identity = jnp.arange(num_rows * width, dtype=tables.dtype).reshape(num_rows, width)
  return paged_attention(q, flat(k), flat(v), identity, batch.context_lens, positions, impl=impl)
