"""Paged attention as a Pallas/Mosaic TPU kernel (decode and chunked prefill).

Grid (B, Hkv, S, MB/S): one program per (sequence, KV head, context split, logical block). The
block table and the per-sequence block counts are scalar-prefetched into SMEM, so the K/V
BlockSpecs' index maps can name the *physical* block: Pallas' pipeline then DMAs exactly that
[bs, D] block from HBM into VMEM, double-buffered, while the previous one is being used. Logical
blocks past a sequence's visible context map to its last visible block again: an unchanged
block index makes the pipeline skip the copy, and `pl.when` skips the compute, so the null block
and unowned blocks are never read for a real token.

All T*G query rows of a KV group form one [R, D] tile (the group shares each K/V block); the
running max, sum and accumulator live in VMEM scratch across the block axis ("arbitrary"), and
the output tile is written once, at the split's last block. With S > 1 (flash-decoding: long
contexts of too few sequences to occupy both TensorCores of a megacore chip) each split writes
its unnormalised state and a small XLA merge combines them. Masking uses `where` so NaN/inf in
slots past the length cannot reach the output.

The pool is read layer-stacked [L, N, Hkv, bs, D]: the layer is scalar-prefetched too and the
K/V index maps name it, so each block is DMAed straight from the stacked pool.

Quantized blocks (int8 / float8_e4m3fn) come with per-(token, KV head) scales (float16 from the
engine's pool); each block's scales arrive as a [1, bs] row next to it, are widened to float32
in the kernel and applied to the scores (K) and the probabilities (V), so the [bs, D] block is
only converted.

Off TPU the kernel runs in TPU interpret mode (`pltpu.InterpretParams`), which simulates the
DMAs and SMEM/VMEM on CPU: slow (seconds a call), for tests only. Contract: kernels/contract.py.
"""
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from . import contract


# ------------------------------------------------------------------------------------------------
# Wrapper
# ------------------------------------------------------------------------------------------------
def paged_attention_pallas_tpu(q, k_blocks, v_blocks, block_tables, context_lens, q_positions,
                               *, scale=None, k_scales=None, v_scales=None, layer=None,
                               interpret=None, context_splits=None):
  """The contract's paged attention (kernels/contract.py).

  layer: index into a layer-stacked pool [L, N, ...] (and scales); the K/V index maps DMA that
  layer's blocks straight from the stacked pool, so no layer is sliced out.
  interpret: None runs TPU interpret mode whenever the default backend is not a TPU.
  context_splits: split each sequence's blocks over that many parallel programs
  (flash-decoding); default: 2 when there are fewer (sequence, KV head) programs than the two
  TensorCores of a megacore chip, else 1. Trimmed to at most one split per block.
  """
  k_blocks, v_blocks, k_scales, v_scales, layer = contract.as_layer_stacked(
      q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales, v_scales, layer)
  if interpret is None:
    interpret = jax.default_backend() != 'tpu'
  splits = contract.check_context_splits(context_splits)
  if splits is None:
    splits = 2 if q.shape[0] * k_blocks.shape[2] < _CORES else 1
  splits = min(splits, block_tables.shape[1])  # at least one block per split
  return _paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, q_positions,
                          k_scales, v_scales, contract.layer_index(layer),
                          scale=contract.softmax_scale(scale, q.shape[-1]),
                          interpret=bool(interpret), splits=splits)


# TensorCores sharing a "parallel" grid axis on one chip (megacore: v4, v5p).
_CORES = 2


@functools.partial(jax.jit, static_argnames=('scale', 'interpret', 'splits'))
def _paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales,
                     v_scales, layer, *, scale, interpret, splits):
  batch, num_q, num_heads, head_dim = q.shape
  _, _, num_kv_heads, block_size, _ = k_blocks.shape
  max_blocks = block_tables.shape[1]
  per_split = -(-max_blocks // splits)  # logical blocks per split; the last may run short
  group = num_heads // num_kv_heads
  rows = num_q * group
  quantized = k_scales is not None

  qg = contract.group_rows(q, num_kv_heads)  # [B, Hkv, R, D]
  seen = contract.tokens_seen(q_positions, context_lens)  # [B, T]
  row_seen = contract.rows_seen(seen, group)[:, :, None]  # [B, R, 1]: a column per program
  block_counts = contract.visible_blocks(seen, block_size, max_blocks)

  def block_index(b, c, j, tables, counts):
    # Past the visible blocks, repeat the last one: same index, so no new DMA.
    return tables[b, jnp.minimum(c * per_split + j, jnp.maximum(counts[b] - 1, 0))]

  def kv_index(b, h, c, j, tables, counts, lens, layer):
    del lens
    return layer[0], block_index(b, c, j, tables, counts), h, 0, 0

  kv_spec = pl.BlockSpec((None, None, None, block_size, head_dim), kv_index)
  in_specs = [
      pl.BlockSpec((None, None, rows, head_dim), lambda b, h, c, j, *_: (b, h, 0, 0)),
      pl.BlockSpec((None, rows, 1), lambda b, h, c, j, *_: (b, 0, 0)),
      kv_spec, kv_spec,
  ]
  operands = [qg, row_seen, k_blocks, v_blocks]
  if quantized:
    # [L, N, Hkv, bs] -> [L, N, Hkv, 1, bs] so a block's scales are a full-width [1, bs] row
    # (a free reshape; they stay float16 in HBM, the kernel widens them to float32).
    scale_spec = pl.BlockSpec((None, None, None, 1, block_size), kv_index)
    in_specs += [scale_spec, scale_spec]
    operands += [k_scales[:, :, :, None, :], v_scales[:, :, :, None, :]]

  # One split writes the normalised output; several write their unnormalised (acc, m, l) for
  # the merge below (float32, so the merge loses nothing).
  part = lambda shape: pl.BlockSpec((None, None, None) + shape,
                                    lambda b, h, c, j, *_: (b, h, c, 0, 0))
  part_shape = lambda shape, dtype: jax.ShapeDtypeStruct(
      (batch, num_kv_heads, splits) + shape, dtype)
  if splits == 1:
    out_specs = part((rows, head_dim))
    out_shape = part_shape((rows, head_dim), q.dtype)
  else:
    out_specs = [part((rows, head_dim)), part((rows, 1)), part((rows, 1))]
    out_shape = [part_shape((rows, head_dim), jnp.float32),
                 part_shape((rows, 1), jnp.float32), part_shape((rows, 1), jnp.float32)]

  kernel = functools.partial(_kernel, scale=scale, block_size=block_size, quantized=quantized,
                             per_split=per_split, partial_out=splits > 1)
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(batch, num_kv_heads, splits, per_split),
          in_specs=in_specs,
          out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32),
                          pltpu.VMEM((rows, 1), jnp.float32),
                          pltpu.VMEM((rows, head_dim), jnp.float32)]),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'parallel', 'arbitrary')),
      interpret=pltpu.InterpretParams() if interpret else False,
  )(block_tables, block_counts, context_lens, layer, *operands)
  if splits == 1:
    out = out[:, :, 0]
  else:
    acc, m, l = out
    out = contract.merge_split_states(acc, m[..., 0], l[..., 0]).astype(q.dtype)
  return contract.ungroup_rows(out, num_q, num_heads)


# ------------------------------------------------------------------------------------------------
# Kernel body
# ------------------------------------------------------------------------------------------------
def _kernel(tables_ref, counts_ref, lens_ref, layer_ref,  # scalar prefetch (SMEM)
            q_ref, seen_ref, k_ref, v_ref, *rest, scale, block_size, quantized, per_split,
            partial_out):
  """q_ref [R, D]; seen_ref [R, 1]; k_ref, v_ref [bs, D]; (ks_ref, vs_ref [1, bs]);
  outputs o_ref [R, D] (partial_out: and om_ref, ol_ref [R, 1]); scratch m_ref, l_ref [R, 1],
  acc_ref [R, D]. Grid (b, h, split c, block j of the split)."""
  del tables_ref, layer_ref  # used by the index maps only
  rest = list(rest)
  ks_ref, vs_ref = (rest.pop(0), rest.pop(0)) if quantized else (None, None)
  outs, (m_ref, l_ref, acc_ref) = rest[:-3], rest[-3:]
  b, local_j = pl.program_id(0), pl.program_id(3)
  j = pl.program_id(2) * per_split + local_j  # logical block in the sequence
  f32 = jnp.float32

  @pl.when(local_j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, f32)
    l_ref[...] = jnp.zeros(l_ref.shape, f32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, f32)

  @pl.when(j < counts_ref[b])
  def _step():
    q = q_ref[...].astype(f32) * scale
    k = k_ref[...].astype(f32)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=f32)
    if quantized:  # k = code * scale per token: scale the score columns, not the block
      s = s * ks_ref[...].astype(f32)
    rows = s.shape[0]
    pos = j * block_size + jax.lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)
    visible = pos < seen_ref[...]  # [R, bs]
    s = jnp.where(visible, s, -jnp.inf)
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no row has seen a token yet
    p = jnp.where(visible, jnp.exp(s - m_shift), 0.0)
    alpha = jnp.exp(m_prev - m_shift)
    l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
    if quantized:  # v = code * scale: fold it into p; `where` again, a scale may be NaN
      p = jnp.where(visible, p * vs_ref[...].astype(f32), 0.0)
    slot = j * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)
    v = jnp.where(slot < lens_ref[b], v_ref[...].astype(f32), 0.0)  # past-length slots: garbage
    pv = jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())), preferred_element_type=f32)
    acc_ref[...] = acc_ref[...] * alpha + pv
    m_ref[...] = m_new

  @pl.when(local_j == pl.num_programs(3) - 1)
  def _finish():
    if partial_out:
      o_ref, om_ref, ol_ref = outs
      o_ref[...], om_ref[...], ol_ref[...] = acc_ref[...], m_ref[...], l_ref[...]
    else:
      l = l_ref[...]
      outs[0][...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(outs[0].dtype)
