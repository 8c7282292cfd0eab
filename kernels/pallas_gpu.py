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

Grid (B, Hkv): one program per sequence and KV head walks that sequence's visible blocks with a
`fori_loop` whose trip count is its own block count, so blocks past the length (padding entries,
the null block 0) are never read. Each step loads one physical [bs, D] block of K and V by its
block-table entry and folds it into a running softmax of the group's query rows, padded to at
least 16 rows so the two products run as dots (tensor cores) on GPU; float32 dots ask for
HIGHEST precision so the GPU does not silently use TF32. Masking uses `where`: past-length
slots may hold NaN or inf.

The pool is read layer-stacked, [L, N, Hkv, bs, D]: the model's `layer` (a traced int) arrives
as a 1-element int32 array and the kernel indexes the stacked refs with it, so no layer is ever
sliced out (that would copy it, every layer, every step). Single-layer pages are viewed as a
stack of one.

Quantized pages (int8 / float8_e4m3fn) come with per-(token, KV head) float32 scales
[L, N, Hkv, bs]. Each step loads the block's [bs] scale rows next to it and converts the block to
float32 in registers; the K scale multiplies the [Rp, bs] scores and the V scale the
probabilities (as kernels/xla.py does): the block is only converted, and no dequantized copy
of the pool is ever written. float8_e4m3fn conversion needs sm_89 or newer (the Triton lowering refuses it
below); int8 runs on any GPU.
"""
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

from kernels import check_inputs, stack_one_layer

_MIN_DOT = 16  # Triton's dot needs every dimension >= 16


def _pow2(n):
  return n > 0 and n & (n - 1) == 0


# ------------------------------------------------------------------------------------------------
# Wrapper
# ------------------------------------------------------------------------------------------------
def paged_attention_pallas_gpu(q, k_pages, v_pages, block_tables, context_lens, q_positions, *,
                               scale=None, k_scales=None, v_scales=None, layer=None,
                               interpret=None, num_warps=4, num_stages=2):
  """Same contract as kernels/reference.py; optional int8/fp8 scales [N, Hkv, bs]. block_size
  and head_dim must be powers of two.

  layer: index into layer-stacked pages [L, N, ...] (and scales [L, N, Hkv, bs]), read in place.
  interpret: None interprets (on CPU) whenever the default backend is not a GPU.
  """
  if layer is None:  # one layer's pages: check them, then view them as a stack of one
    check_inputs(q, k_pages, v_pages, block_tables, context_lens, q_positions, k_scales,
                 v_scales)
    layer, (k_pages, v_pages, k_scales, v_scales) = 0, stack_one_layer(
        k_pages, v_pages, k_scales, v_scales)
  block_size, head_dim = k_pages.shape[-2], k_pages.shape[-1]
  if not (_pow2(block_size) and _pow2(head_dim)):
    raise ValueError(f'pallas_gpu needs power-of-two block_size and head_dim (Triton block '
                     f'shapes), got block_size={block_size}, head_dim={head_dim}')
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  if interpret is None:
    interpret = jax.default_backend() != 'gpu'
  return _paged_attention(q, k_pages, v_pages, block_tables, context_lens, q_positions,
                          k_scales, v_scales, jnp.asarray(layer, jnp.int32).reshape(1),
                          scale=scale, interpret=bool(interpret), num_warps=num_warps,
                          num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=('scale', 'interpret', 'num_warps', 'num_stages'))
def _paged_attention(q, k_pages, v_pages, block_tables, context_lens, q_positions, k_scales,
                     v_scales, layer, *, scale, interpret, num_warps, num_stages):
  batch, num_q, num_heads, head_dim = q.shape
  _, _, num_kv_heads, block_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  rows = num_q * group
  padded_rows = max(_MIN_DOT, pl.next_power_of_2(rows))
  quantized = k_scales is not None

  # [B, T, Hkv, G, D] -> [B, Hkv, Rp, D]: a KV group's rows ordered (t, g), zero-padded.
  qg = q.reshape(batch, num_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
  qg = qg.reshape(batch, num_kv_heads, rows, head_dim)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
  # Tokens each row sees; padded rows and padded queries see none.
  seen = jnp.clip(jnp.minimum(q_positions + 1, context_lens[:, None]), 0, None)  # [B, T]
  row_seen = jnp.pad(jnp.repeat(seen, group, axis=1), ((0, 0), (0, padded_rows - rows)))
  num_blocks = jnp.minimum(block_tables.shape[1],
                           (jnp.max(seen, axis=1) + block_size - 1) // block_size)

  # The whole array: pages (and scales) are picked inside the kernel by layer and block-table
  # entry; left in HBM, only the blocks a program loads are read.
  whole = pl.BlockSpec()
  operands = [qg, row_seen, block_tables, context_lens, num_blocks.astype(jnp.int32), layer,
              k_pages, v_pages] + ([k_scales, v_scales] if quantized else [])
  kernel = functools.partial(_kernel, scale=scale, block_size=block_size, quantized=quantized)
  out = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads),
      in_specs=[
          pl.BlockSpec((None, None, padded_rows, head_dim), lambda b, h: (b, h, 0, 0)),
          pl.BlockSpec((None, padded_rows), lambda b, h: (b, 0)),
      ] + [whole] * (len(operands) - 2),
      out_specs=pl.BlockSpec((None, None, padded_rows, head_dim), lambda b, h: (b, h, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, padded_rows, head_dim), q.dtype),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
  )(*operands)
  out = out[:, :, :rows].reshape(batch, num_kv_heads, num_q, group, head_dim)
  return out.transpose(0, 2, 1, 3, 4).reshape(batch, num_q, num_heads, head_dim)


# ------------------------------------------------------------------------------------------------
# Kernel body
# ------------------------------------------------------------------------------------------------
def _kernel(q_ref, seen_ref, tables_ref, lens_ref, counts_ref, layer_ref, k_ref, v_ref, *rest,
            scale, block_size, quantized):
  """q_ref [Rp, D]; seen_ref [Rp]; tables_ref [B, MB]; lens_ref, counts_ref [B]; layer_ref [1];
  k_ref, v_ref the whole stacked pool [L, N, Hkv, bs, D]; (ks_ref, vs_ref [L, N, Hkv, bs]);
  o_ref [Rp, D]."""
  if quantized:
    ks_ref, vs_ref, o_ref = rest
  else:
    (o_ref,) = rest
  b, h = pl.program_id(0), pl.program_id(1)
  f32 = jnp.float32
  q = q_ref[...].astype(f32) * scale
  row_seen = seen_ref[...]
  length = lens_ref[b]
  layer = layer_ref[0]
  rows, head_dim = q.shape
  use_dot = block_size >= _MIN_DOT
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
    if quantized:  # k = stored * scale per token: scale the score columns, not the block
      s = s * ks_ref[layer, block, h, :].astype(f32)[None, :]
    pos = j * block_size + jax.lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)
    visible = pos < row_seen[:, None]
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no token seen yet by this row
    p = jnp.where(visible, jnp.exp(s - m_shift[:, None]), 0.0)
    alpha = jnp.exp(m - m_shift)
    l = l * alpha + jnp.sum(p, axis=1)  # the softmax denominator takes unscaled probabilities
    if quantized:  # v = stored * scale: fold the scale into p; `where` again, a scale may be NaN
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
  _, l, acc = jax.lax.fori_loop(0, counts_ref[b], step, init)
  o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
