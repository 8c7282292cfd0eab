"""Paged attention as a Pallas GPU kernel, lowered through Triton (decode and chunked prefill).

Why the Triton lowering and not Mosaic GPU, although JAX deprecated Pallas-Triton in 0.11 in
favour of Mosaic GPU (a deliberate choice, revisit when Triton support is removed):
- Decode is a batched matrix-vector product: 1-8 query rows per KV group, bound by reading K/V.
  Mosaic GPU's strengths (warpgroup wgmma on 64-row tiles, TMA pipelines, Hopper/Blackwell
  only) buy nothing here, while the Triton lowering compiles the same kernel for any CUDA GPU
  from sm_80 on, the H200 included, and gathers a block by a plain pointer offset.
- The same kernel body runs on CPU under `interpret=True`, which is how CI checks it; Mosaic GPU's
  interpreter needs the Mosaic-GPU programming model (warpgroups, barriers, SMEM refs) that a
  portable body does not use.
- The lowering is chosen explicitly by passing `pltriton.CompilerParams` (the default for a
  bare `pallas_call` on GPU became Mosaic GPU). On a JAX without the Triton lowering this path
  fails at lowering time; `triton` (jax_triton) and `xla` remain.

Grid (B, Hkv, S): one program per sequence, KV head and context split walks its split's share of
the sequence's visible blocks with a `fori_loop` whose bounds come from the sequence's own block
count, so blocks past the length (padding entries, the null block 0) are never read. Each step
loads one physical [bs, D] block of K and V by its block-table entry and folds it into a running
softmax of the group's query rows, padded to at least 16 rows so the two products run as dots
(tensor cores) on GPU; float32 dots ask for HIGHEST precision so the GPU does not silently use
TF32. Masking uses `where`: past-length slots may hold NaN or inf.

Context splits (flash-decoding). A program is a whole sequence's walk; decode of a few long
sequences gives too few programs to fill the GPU (an H100/H200 has 132 SMs; B * Hkv = 8 leaves
most of them idle while 8 of them read the whole cache). With S > 1, program c walks logical
blocks [c * per, min((c + 1) * per, count)), per = ceil(MB / S), and writes its unnormalised
float32 state (acc [Rp, D], m [Rp], l [Rp]); `contract.merge_split_states` (plain XLA, after
the kernel) rescales each split by exp(m - max m) and normalises once; a split that saw nothing
has m = -inf and weighs 0. With S == 1 the kernel writes the normalised output directly (no
extra traffic). S is static (it sets the grid); by default `contract.default_gpu_splits` picks
it from shapes (about two programs per SM, at least ~256 tokens a split; its docstring says
why), shared with kernels/triton.py.

The pool is read layer-stacked, [L, N, Hkv, bs, D]: the model's `layer` (a traced int) arrives
as a 1-element int32 array and the kernel indexes the stacked refs with it, so no layer is ever
sliced out (that would copy it, every layer, every step). Single-layer blocks are viewed as a
stack of one.

Quantized blocks (int8 / float8_e4m3fn) come with per-(token, KV head) scales [L, N, Hkv, bs]
(float16 from the engine's pool). Each step loads the block's [bs] scale rows next to it,
widens them and converts the block to float32 in registers; the K scale multiplies the [Rp, bs]
scores and the V scale the probabilities (as kernels/xla.py does): the block is only converted,
and no dequantized copy of the pool is ever written. float8_e4m3fn conversion needs sm_89 or
newer (the Triton lowering refuses it below); int8 runs on any GPU. Contract:
kernels/contract.py.
"""
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

from . import contract


# ------------------------------------------------------------------------------------------------
# Wrapper
# ------------------------------------------------------------------------------------------------
def paged_attention_pallas_gpu(q, k_blocks, v_blocks, block_tables, context_lens, q_positions,
                               *, scale=None, k_scales=None, v_scales=None, layer=None,
                               interpret=None, num_warps=4, num_stages=2, context_splits=None):
  """The contract's paged attention (kernels/contract.py); block_size and head_dim must be
  powers of two.

  layer: index into a layer-stacked pool [L, N, ...] (and scales), read in place.
  interpret: None interprets (on CPU) whenever the default backend is not a GPU.
  context_splits: split each sequence's blocks over that many programs (flash-decoding);
  default: contract.default_gpu_splits.
  """
  k_blocks, v_blocks, k_scales, v_scales, layer = contract.as_layer_stacked(
      q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales, v_scales, layer)
  block_size, head_dim = k_blocks.shape[-2:]
  contract.require_pow2('pallas_gpu', block_size, head_dim)
  if interpret is None:
    interpret = jax.default_backend() != 'gpu'
  splits = contract.split_count(context_splits, q.shape[0], k_blocks.shape[2],
                                block_tables.shape[1], block_size)
  return _paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, q_positions,
                          k_scales, v_scales, contract.layer_index(layer),
                          scale=contract.softmax_scale(scale, q.shape[-1]),
                          interpret=bool(interpret), num_warps=num_warps,
                          num_stages=num_stages, splits=splits)


@functools.partial(jax.jit, static_argnames=('scale', 'interpret', 'num_warps', 'num_stages',
                                             'splits'))
def _paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales,
                     v_scales, layer, *, scale, interpret, num_warps, num_stages, splits):
  batch, num_q, num_heads, head_dim = q.shape
  _, _, num_kv_heads, block_size, _ = k_blocks.shape
  group = num_heads // num_kv_heads
  rows = contract.gpu_rows(num_q * group)
  max_blocks = block_tables.shape[1]
  per_split = -(-max_blocks // splits)  # logical blocks per split; the last may be short
  quantized = k_scales is not None

  qg = contract.group_rows(q, num_kv_heads, rows_to=rows)  # [B, Hkv, Rp, D], zero-padded
  seen = contract.tokens_seen(q_positions, context_lens)
  row_seen = contract.rows_seen(seen, group, rows_to=rows)  # padded rows see nothing
  block_counts = contract.visible_blocks(seen, block_size, max_blocks)

  # The whole array: blocks (and scales) are picked inside the kernel by layer and block-table
  # entry; left in HBM, only the blocks a program loads are read.
  whole = pl.BlockSpec()
  operands = [qg, row_seen, block_tables, context_lens, block_counts, layer,
              k_blocks, v_blocks] + ([k_scales, v_scales] if quantized else [])
  # One split writes the normalised output; several write their unnormalised float32 state
  # (acc, m, l) for `merge_split_states` (float32 so the merge loses nothing).
  part = lambda shape: pl.BlockSpec((None, None, None) + shape,
                                    lambda b, h, c: (b, h, c) + (0,) * len(shape))
  part_shape = lambda shape, dtype: jax.ShapeDtypeStruct((batch, num_kv_heads, splits) + shape,
                                                         dtype)
  if splits == 1:
    out_specs = part((rows, head_dim))
    out_shape = part_shape((rows, head_dim), q.dtype)
  else:
    out_specs = [part((rows, head_dim)), part((rows,)), part((rows,))]
    out_shape = [part_shape((rows, head_dim), jnp.float32),
                 part_shape((rows,), jnp.float32), part_shape((rows,), jnp.float32)]
  kernel = functools.partial(_kernel, scale=scale, block_size=block_size, quantized=quantized,
                             per_split=per_split, partial_out=splits > 1)
  out = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, splits),
      in_specs=[
          pl.BlockSpec((None, None, rows, head_dim), lambda b, h, c: (b, h, 0, 0)),
          pl.BlockSpec((None, rows), lambda b, h, c: (b, 0)),
      ] + [whole] * (len(operands) - 2),
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
  )(*operands)
  out = out[:, :, 0] if splits == 1 else contract.merge_split_states(*out).astype(q.dtype)
  return contract.ungroup_rows(out, num_q, num_heads)


# ------------------------------------------------------------------------------------------------
# Kernel body
# ------------------------------------------------------------------------------------------------
def _kernel(q_ref, seen_ref, tables_ref, lens_ref, counts_ref, layer_ref, k_ref, v_ref, *rest,
            scale, block_size, quantized, per_split, partial_out):
  """q_ref [Rp, D]; seen_ref [Rp]; tables_ref [B, MB]; lens_ref, counts_ref [B]; layer_ref [1];
  k_ref, v_ref the whole stacked pool [L, N, Hkv, bs, D]; (ks_ref, vs_ref [L, N, Hkv, bs], any
  float dtype: widened here);
  o_ref [Rp, D] (partial_out: float32 acc, then om_ref, ol_ref [Rp]). Grid (b, h, split c)."""
  rest = list(rest)
  ks_ref, vs_ref = (rest.pop(0), rest.pop(0)) if quantized else (None, None)
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  f32 = jnp.float32
  q = q_ref[...].astype(f32) * scale
  row_seen = seen_ref[...]
  length = lens_ref[b]
  layer = layer_ref[0]
  rows, head_dim = q.shape
  use_dot = block_size >= contract.MIN_DOT  # else multiply-and-reduce: a dot needs 16
  hi = jax.lax.Precision.HIGHEST

  def step(j, carry):
    m, l, acc = carry  # [Rp], [Rp], [Rp, D]
    block = tables_ref[b, j]
    k = k_ref[layer, block, h, :, :].astype(f32)  # [bs, D]; int8/fp8 converted in registers
    v = v_ref[layer, block, h, :, :].astype(f32)
    if use_dot:
      s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=hi,
                              preferred_element_type=f32)
    else:
      s = jnp.sum(q[:, None, :] * k[None, :, :], axis=2)
    if quantized:  # k = code * scale per token: scale the score columns, not the block
      s = s * ks_ref[layer, block, h, :].astype(f32)[None, :]
    pos = j * block_size + jax.lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)
    visible = pos < row_seen[:, None]
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no token seen yet by this row
    p = jnp.where(visible, jnp.exp(s - m_shift[:, None]), 0.0)
    alpha = jnp.exp(m - m_shift)
    l = l * alpha + jnp.sum(p, axis=1)  # the softmax denominator takes unscaled probabilities
    if quantized:  # v = code * scale: fold it into p; `where` again, a scale may be NaN
      p = jnp.where(visible, p * vs_ref[layer, block, h, :].astype(f32)[None, :], 0.0)
    slot = j * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_size, head_dim), 0)
    v = jnp.where(slot < length, v, 0.0)  # past-length slots hold garbage
    if use_dot:
      pv = jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())), precision=hi,
                               preferred_element_type=f32)
    else:
      pv = jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l, acc * alpha[:, None] + pv

  init = (jnp.full((rows,), -jnp.inf, f32), jnp.zeros((rows,), f32),
          jnp.zeros((rows, head_dim), f32))
  # This split's blocks: [c * per, min((c + 1) * per, count)); empty (start >= stop) for a split
  # past a short sequence's last block, which then reports m = -inf, l = 0, acc = 0.
  start = c * per_split
  stop = jnp.maximum(start, jnp.minimum(start + per_split, counts_ref[b]))
  m, l, acc = jax.lax.fori_loop(start, stop, step, init)
  if partial_out:
    o_ref, om_ref, ol_ref = rest
    o_ref[...], om_ref[...], ol_ref[...] = acc, m, l
  else:
    (o_ref,) = rest
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
