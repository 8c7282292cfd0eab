"""Paged attention as a Pallas/Mosaic TPU kernel (decode and chunked prefill).

Grid (B, Hkv, MB): one program per (sequence, KV head, logical block). The block table and the
per-sequence block counts are scalar-prefetched into SMEM, so the K/V BlockSpecs' index maps can
name the *physical* block: Pallas' pipeline then DMAs exactly that [bs, D] block from HBM into
VMEM, double-buffered, while the previous one is being used. Logical blocks past a sequence's
visible context map to its last visible block again: an unchanged block index makes the pipeline
skip the copy, and `pl.when` skips the compute, so the null block and unowned blocks are never
read for a real token.

All T*G query rows of a KV group form one [R, D] tile (the group shares each K/V block); the
running max, sum and accumulator live in VMEM scratch across the MB axis ("arbitrary"), and the
output tile is written once, at the last block. Masking uses `where` so NaN/inf in slots past
the length cannot reach the output.

Quantized pages (int8 / float8_e4m3fn) come with per-(token, KV head) scales; each block's
scales arrive as a [1, bs] row next to it and are applied to the scores (K) and the
probabilities (V), so the [bs, D] block is only converted.

Off TPU the kernel runs in TPU interpret mode (`pltpu.InterpretParams`), which simulates the
DMAs and SMEM/VMEM on CPU: slow (seconds a call), for tests only.
"""
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from kernels import check_inputs, stack_one_layer


# ------------------------------------------------------------------------------------------------
# Wrapper
# ------------------------------------------------------------------------------------------------
def paged_attention_pallas_tpu(q, k_pages, v_pages, block_tables, context_lens, q_positions, *,
                               scale=None, k_scales=None, v_scales=None, interpret=None,
                               layer=None):
  """Same contract as kernels/reference.py; optional int8/fp8 scales [N, Hkv, bs].

  interpret: None runs TPU interpret mode whenever the default backend is not a TPU.
  layer: index into layer-stacked pages [L, N, ...] (and scales); the K/V index maps DMA that
  layer's blocks straight from the stacked pool, so no layer is sliced out.
  """
  if layer is None:  # one layer's pages: check them, then view them as a stack of one
    check_inputs(q, k_pages, v_pages, block_tables, context_lens, q_positions, k_scales,
                 v_scales)
    layer, (k_pages, v_pages, k_scales, v_scales) = 0, stack_one_layer(
        k_pages, v_pages, k_scales, v_scales)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  if interpret is None:
    interpret = jax.default_backend() != 'tpu'
  return _paged_attention(q, k_pages, v_pages, block_tables, context_lens, q_positions,
                          k_scales, v_scales, jnp.asarray(layer, jnp.int32).reshape(1),
                          scale=scale, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=('scale', 'interpret'))
def _paged_attention(q, k_pages, v_pages, block_tables, context_lens, q_positions, k_scales,
                     v_scales, layer, *, scale, interpret):
  batch, num_q, num_heads, head_dim = q.shape
  _, _, num_kv_heads, block_size, _ = k_pages.shape
  max_blocks = block_tables.shape[1]
  group = num_heads // num_kv_heads
  rows = num_q * group
  quantized = k_scales is not None

  # [B, T, Hkv, G, D] -> [B, Hkv, R, D]: the rows of a KV group, ordered (t, g).
  qg = q.reshape(batch, num_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
  qg = qg.reshape(batch, num_kv_heads, rows, head_dim)
  # Tokens each query sees (0 for a padded query), per row as a [R, 1] column.
  seen = jnp.clip(jnp.minimum(q_positions + 1, context_lens[:, None]), 0, None)  # [B, T]
  row_seen = jnp.repeat(seen, group, axis=1)[:, :, None]  # [B, R, 1]
  num_blocks = jnp.minimum(max_blocks, (jnp.max(seen, axis=1) + block_size - 1) // block_size)

  def block_index(b, j, tables, counts):
    # Past the visible blocks, repeat the last one: same index, so no new DMA.
    return tables[b, jnp.minimum(j, jnp.maximum(counts[b] - 1, 0))]

  def kv_index(b, h, j, tables, counts, lens, layer):
    del lens
    return layer[0], block_index(b, j, tables, counts), h, 0, 0

  kv_spec = pl.BlockSpec((None, None, None, block_size, head_dim), kv_index)
  in_specs = [
      pl.BlockSpec((None, None, rows, head_dim), lambda b, h, j, *_: (b, h, 0, 0)),
      pl.BlockSpec((None, rows, 1), lambda b, h, j, *_: (b, 0, 0)),
      kv_spec, kv_spec,
  ]
  operands = [qg, row_seen, k_pages, v_pages]
  if quantized:
    # [L, N, Hkv, bs] -> [L, N, Hkv, 1, bs] so a block's scales are a full-width [1, bs] row
    # (a free reshape; the kernel widens them to float32 itself).
    scale_spec = pl.BlockSpec((None, None, None, 1, block_size), kv_index)
    in_specs += [scale_spec, scale_spec]
    operands += [k_scales[:, :, :, None, :], v_scales[:, :, :, None, :]]

  kernel = functools.partial(_kernel, scale=scale, block_size=block_size, quantized=quantized)
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(batch, num_kv_heads, max_blocks),
          in_specs=in_specs,
          out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda b, h, j, *_: (b, h, 0, 0)),
          scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32),
                          pltpu.VMEM((rows, 1), jnp.float32),
                          pltpu.VMEM((rows, head_dim), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, rows, head_dim), q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'arbitrary')),
      interpret=pltpu.InterpretParams() if interpret else False,
  )(block_tables, num_blocks.astype(jnp.int32), context_lens, layer, *operands)
  out = out.reshape(batch, num_kv_heads, num_q, group, head_dim).transpose(0, 2, 1, 3, 4)
  return out.reshape(batch, num_q, num_heads, head_dim)


# ------------------------------------------------------------------------------------------------
# Kernel body
# ------------------------------------------------------------------------------------------------
def _kernel(tables_ref, counts_ref, lens_ref, layer_ref,  # scalar prefetch (SMEM)
            q_ref, seen_ref, k_ref, v_ref, *rest, scale, block_size, quantized):
  """q_ref [R, D]; seen_ref [R, 1]; k_ref, v_ref [bs, D]; (ks_ref, vs_ref [1, bs]);
  o_ref [R, D]; scratch m_ref, l_ref [R, 1], acc_ref [R, D]."""
  del tables_ref, layer_ref  # used by the index maps only
  if quantized:
    ks_ref, vs_ref, o_ref, m_ref, l_ref, acc_ref = rest
  else:
    o_ref, m_ref, l_ref, acc_ref = rest
  b, j = pl.program_id(0), pl.program_id(2)
  f32 = jnp.float32

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, f32)
    l_ref[...] = jnp.zeros(l_ref.shape, f32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, f32)

  @pl.when(j < counts_ref[b])
  def _step():
    q = q_ref[...].astype(f32) * scale
    k = k_ref[...].astype(f32)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=f32)
    if quantized:
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
    if quantized:
      p = jnp.where(visible, p * vs_ref[...].astype(f32), 0.0)
    slot = j * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)
    v = jnp.where(slot < lens_ref[b], v_ref[...].astype(f32), 0.0)  # past-length slots: garbage
    pv = jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())), preferred_element_type=f32)
    acc_ref[...] = acc_ref[...] * alpha + pv
    m_ref[...] = m_new

  @pl.when(j == pl.num_programs(2) - 1)
  def _finish():
    l = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)
