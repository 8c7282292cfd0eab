"""The paged KV pool: device state carried through every jitted step.

Layout (chosen by measurement on CPU):
  k, v: [num_layers, num_blocks, num_kv_heads, block_size, head_dim]
One block holds `block_size` consecutive tokens of one sequence for every layer and KV head.
A token's *slot* is `block * block_size + offset`.

Block 0 is the null block. It is never handed out by the allocator: padding entries of block
tables point at it and the K/V of padded tokens are written into it, so its contents are garbage
by design and attention must never read it for a real token (the isolation tests fill it with NaN).

How K/V are stored is the pool's storage scheme (kv_schemes.py), picked by its spec
(`KVPool.spec`, a KVQuantConfig): float32/bfloat16 as is, or quantized codes in k/v with float16
scales (and zero points) next to them, optionally with bfloat16 rings of each sequence's newest
tokens. The scheme says which of the optional arrays exist and their shapes, quantizes as K/V are
written (so attention always reads what the cache really holds) and dequantizes on read. This
module holds the layout, allocation, byte counts, the paging geometry schemes write through, and
the dispatch of attention to the kernels.
"""
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.kernels import contract as kernel_contract
from pagedjax.kernels import paged_attention
from pagedjax.device import kv_schemes
from pagedjax.device.kv_schemes import KVQuantConfig
from pagedjax.device import pool_sharding

# Block 0 is the null block (above). The host side names it too (pagedjax.host.scheduling.allocator, which
# must not import device code); tests/test_layers.py checks that the two agree.
NULL_BLOCK = kv_schemes.NULL_BLOCK


BLOCK_FIELDS = ('k', 'v', 'k_scale', 'v_scale', 'k_zero', 'v_zero')


@flax.struct.dataclass
class KVPool:
  """The pool's arrays (a pytree; the storage spec is static). Which optional arrays exist and
  their shapes are the scheme's (`KVScheme.shapes`, kv_schemes.py)."""
  k: jnp.ndarray  # [layers, blocks, kv_heads, block_size, head_dim]: values or codes
  v: jnp.ndarray  # same as k                                  (int4: head_dim / 2 bytes)
  k_scale: Optional[jnp.ndarray] = None  # quantized schemes: float16 scales, block axis 1
  v_scale: Optional[jnp.ndarray] = None
  k_zero: Optional[jnp.ndarray] = None  # int4 only: float16 zero points
  v_zero: Optional[jnp.ndarray] = None
  recent_k: Optional[jnp.ndarray] = None  # [layers, lanes, kv_heads, recent_window, head_dim]
  recent_v: Optional[jnp.ndarray] = None  # bfloat16 rings; only with a recent window
  k_tail: Optional[jnp.ndarray] = None  # KIVI keys: [layers, lanes, kv_heads, block_size,
  # head_dim] bfloat16 keys of each lane's partial last block, not yet quantized
  k_tail_block: Optional[jnp.ndarray] = None  # [layers, lanes, kv_heads] int32: its block
  k_tail_src: Optional[jnp.ndarray] = None  # [1, blocks, kv_heads] int32: copy-on-write source
  spec: KVQuantConfig = flax.struct.field(pytree_node=False, default=KVQuantConfig())

  @property
  def scheme(self) -> kv_schemes.KVScheme:
    """The storage scheme object for `spec` (kv_schemes.py)."""
    return kv_schemes.scheme_for(self.spec)

  def block_arrays(self) -> dict:
    """Field name -> array for every per-block array of K/V contents (block axis 1): what
    block copies and tier transfers move. Per-lane arrays (rings, KIVI tails) are not per block,
    and KIVI's copy-on-write sources (k_tail_src) are bookkeeping its copy_blocks keeps."""
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
    """True bytes held: scales, zero points, rings, tails and bookkeeping included."""
    return sum(a.nbytes for a in jax.tree_util.tree_leaves(self))

  @property
  def bytes_per_token(self) -> float:
    """Bytes one block slot takes, over all layers (scales included; the fixed-size per-lane
    arrays, `KVScheme.lane_fields`, are not per token and are excluded here, but counted in
    nbytes)."""
    lanes = sum(getattr(self, name).nbytes for name in self.scheme.lane_fields)
    return (self.nbytes - lanes) / (self.num_blocks * self.block_size)

  # ---- paging geometry, for the schemes' writes ----

  def at_slots(self, array, layer, batch):
    """`array.at[...]` for per-token updates [B, T, H, ...] at the step's slots
    (batch.slot_mapping) of `layer`; `array` is a per-slot pool array [L, N, H, bs, ...]."""
    slots = batch.slot_mapping
    return array.at[layer, slots // self.block_size, :, slots % self.block_size]

  def blocks_touched(self, batch):
    """The blocks each row's new tokens land in, for schemes that rewrite whole blocks:
    (start [B], count [B], logical [B, span], physical [B, span]). start is the position of the
    row's first new token (0 for a row with none), count its real new tokens, logical the span
    consecutive logical blocks from start's, physical their block-table entries, or the null
    block where the row's new tokens do not reach (so a rewrite there is harmless). A row of T
    new tokens touches at most (T - 1) // bs + 2 consecutive blocks; rows never share a block
    they write."""
    bs = self.block_size
    num_new = batch.positions.shape[1]
    span = (num_new + bs - 2) // bs + 1
    count = (batch.positions >= 0).sum(axis=1)
    start = jnp.where(count > 0, batch.positions[:, 0], 0)
    logical = start[:, None] // bs + jnp.arange(span)  # [B, span]
    max_logical = batch.block_tables.shape[1]
    touched = (logical * bs < (start + count)[:, None]) & (logical < max_logical)
    physical = jnp.take_along_axis(batch.block_tables, jnp.minimum(logical, max_logical - 1), 1)
    return start, count, logical, jnp.where(touched, physical, NULL_BLOCK)


def _shapes(num_layers, num_blocks, num_kv_heads, block_size, head_dim, spec: KVQuantConfig,
            max_sequences: int):
  """Field name -> (shape, dtype) for a pool of this configuration (lane 0 is the null lane)."""
  return kv_schemes.scheme_for(spec).shapes((num_layers, num_blocks, num_kv_heads, block_size),
                                            head_dim, max_sequences + 1)


def init_pool(num_layers, num_blocks, num_kv_heads, block_size, head_dim, dtype=jnp.float32,
              kv_quant: Optional[KVQuantConfig] = None, max_sequences: int = 0) -> KVPool:
  """An all-zero pool. `kv_quant` picks the storage; without it, plain `dtype` storage.

  Schemes with per-lane state (a recent window's rings, KIVI key tails) get `max_sequences`
  lanes (1..max_sequences; lane 0 is the null lane that padded rows write into, like the null
  block).
  """
  if kv_quant is None:
    kv_quant = KVQuantConfig(jnp.dtype(dtype).name)
  kv_quant.validate(head_dim)
  scheme = kv_schemes.scheme_for(kv_quant)
  if scheme.lane_fields and max_sequences < 1:
    raise ValueError(f'max_sequences={max_sequences} is not allowed: this storage keeps '
                     f'per-sequence lanes ({", ".join(scheme.lane_fields)}), so at least 1')
  shapes = _shapes(num_layers, num_blocks, num_kv_heads, block_size, head_dim, kv_quant,
                   max_sequences)
  return KVPool(**{name: jnp.zeros(shape, dt) for name, (shape, dt) in shapes.items()},
                spec=kv_quant)


def init_model_pool(model_cfg, num_blocks: int, block_size: int, kv_quant: KVQuantConfig,
                    max_sequences: int, mesh=None) -> KVPool:
  """An all-zero pool for a model (ModelConfig). With a mesh it is created already split over KV
  heads: each device allocates only its shard (a pool sized for the whole mesh need not fit on
  one device first)."""
  make = lambda: init_pool(model_cfg.num_layers, num_blocks, model_cfg.num_kv_heads, block_size,
                           model_cfg.head_dim, kv_quant=kv_quant, max_sequences=max_sequences)
  if mesh is None:
    return make()
  return pool_sharding.empty_pool_like(jax.eval_shape(make), mesh, model_cfg.num_kv_heads)


def pool_bytes(num_layers, num_blocks, num_kv_heads, block_size, head_dim,
               kv_quant: KVQuantConfig, max_sequences: int = 0) -> int:
  """Bytes of such a pool, computed without allocating it (sizing, capacity planning)."""
  shapes = _shapes(num_layers, num_blocks, num_kv_heads, block_size, head_dim, kv_quant,
                   max_sequences)
  return sum(int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in shapes.values())


def write_kv(pool: KVPool, layer, k, v, batch) -> KVPool:
  """Store one layer's new K/V [B, T, Hkv, Dh] at `batch.slot_mapping`, in the pool's scheme.

  In place when the pool is donated. `batch` is the step's StepInputs
  (pagedjax/host/scheduling/step_inputs.py).
  """
  return pool.scheme.write(pool, layer, k, v, batch)


def write_and_attend(pool: KVPool, layer, q, k, v, positions, batch, impl: str):
  """write_kv, then attend: (attention output, pool). What a query reads must not depend on
  what else its step holds (a decode vs one prefill chunk after a recompute), so schemes that
  keep some of a query's newest tokens unquantized (`KVScheme.per_query_view`: KIVI keys keep
  the query's own block, a recent window its newest tokens) are read per query: view_attention
  over the stored blocks and their unquantized copies. Other schemes read one view per row and
  go to the kernels (attend)."""
  scheme = pool.scheme
  if not scheme.per_query_view:
    pool = write_kv(pool, layer, k, v, batch)
    return attend(pool, layer, q, positions, batch, impl), pool
  pool, (k_lo, v_lo, k_hi, v_hi) = scheme.write_view(pool, layer, k, v, batch)
  key_hi, value_hi = scheme.recent_masks(positions, k_lo.shape[1], pool.block_size)
  return view_attention(q, k_lo, v_lo, k_hi, v_hi, key_hi, value_hi, positions,
                        batch.context_lens), pool


def view_attention(q, k_lo, v_lo, k_hi, v_hi, key_hi, value_hi, positions, context_lens):
  """Causal attention of q [B, T, Hq, D] where query t reads slot s [0, S) from k_hi where
  key_hi[b, t, s], else from k_lo (v_hi, v_lo likewise); K/V [B, S, H, D] float32, masks
  [B, T, S]. Masking as the reference kernel's (kernels/reference.py): nothing past a query's
  position or its row's context reaches it, NaN included."""
  batch, num_q, num_heads, head_dim = q.shape
  num_kv_heads, num_slots = k_lo.shape[2], k_lo.shape[1]
  qg = q.astype(jnp.float32).reshape(batch, num_q, num_kv_heads, num_heads // num_kv_heads,
                                     head_dim)
  scale = kernel_contract.softmax_scale(None, head_dim)
  score = lambda keys: jnp.einsum('btkgd,bskd->bkgts', qg, keys) * scale
  seen = kernel_contract.tokens_seen(positions, context_lens)  # [B, T]
  visible = (jnp.arange(num_slots)[None, None, :] < seen[:, :, None])[:, None, None]
  scores = jnp.where(key_hi[:, None, None], score(k_hi), score(k_lo))
  probs = kernel_contract.masked_softmax(scores, visible)
  in_context = (jnp.arange(num_slots)[None, :] < context_lens[:, None])[:, :, None, None]
  v_lo, v_hi = (jnp.where(in_context, x, 0.0) for x in (v_lo, v_hi))
  out = (jnp.einsum('bkgts,bskd->btkgd', probs, v_lo) +
         jnp.einsum('bkgts,bskd->btkgd', probs * value_hi[:, None, None], v_hi - v_lo))
  return out.reshape(batch, num_q, num_heads, head_dim).astype(q.dtype)


def dequantize_blocks(pool: KVPool, layer, tables):
  """K and V of the blocks in `tables` [B, MB], dequantized: two [B, MB, H, bs, D] float32."""
  return pool.scheme.read_blocks(pool, layer, tables)


def attend(pool: KVPool, layer, q, positions, batch, impl: str):
  """Paged attention of q [B, T, Hq, Dh] over this layer's blocks in `batch.block_tables`.

  Schemes the kernels read natively (float pools; int8 / fp8_e4m3 codes with one scale per
  token and head, without a recent window) go straight to the kernels, which dequantize inside:
  no dequantized copy of the pool. Other schemes gather and dequantize only the blocks this
  batch references (`KVScheme.read`), then hand them to the same kernels as a small pool whose
  block table is the identity.
  """
  scheme = pool.scheme
  args = (batch.block_tables, batch.context_lens, positions)
  if scheme.kernel_native:
    # The whole layer-stacked pool goes in with `layer`: slicing pool.k[layer] out here would
    # copy that layer (every layer, every step) before a kernel loop could read it.
    return paged_attention(q, pool.k, pool.v, *args, impl=impl, layer=layer,
                           k_scales=pool.k_scale, v_scales=pool.v_scale)
  tables = batch.block_tables
  k, v = scheme.read(pool, layer, batch)
  num_rows, width = tables.shape
  flat = lambda x: x.reshape(num_rows * width, *x.shape[2:])
  identity = jnp.arange(num_rows * width, dtype=tables.dtype).reshape(num_rows, width)
  return paged_attention(q, flat(k), flat(v), identity, batch.context_lens, positions, impl=impl)
