"""Paged attention as a `@triton.jit` kernel, launched from JAX by `jax_triton.triton_call`.

GPU only from JAX: jax_triton does not import on a CPU-only jaxlib, so it is imported when the
wrapper runs. The kernel itself is plain Triton: on CPU, the tests run the very same function
under Triton's interpreter (`TRITON_INTERPRET=1` set before this module is imported) with torch
CPU tensors through `launch_torch` (tests/test_kernels.py), and `compile_ahead` compiles it for a
CUDA compute capability without a GPU.

Grid (B, Hkv, S): one program per sequence, KV head and context split. It loops over its
split's share of that sequence's visible blocks only (a runtime bound), loads each physical
[bs, D] block of K and V at its block-table entry by pointer offset, and folds it into a
running softmax over the group's query rows (T*G rows, zero-padded to `contract.gpu_rows`, a
power of two >= 16, so both products are `tl.dot`s; float32 dots use IEEE precision, not TF32).
Masking uses `tl.where`: past-length slots may hold NaN or inf.

Context splits (flash-decoding), as in kernels/pallas_gpu.py and with the same heuristic
(`contract.split_count`): with S > 1 program c walks logical blocks
[c * per, min((c + 1) * per, count)), per = ceil(MB / S), and stores its unnormalised float32
state (acc, m, l); `contract.merge_split_states` (JAX, after the launch; launch_torch uses it
too) combines them, a split that saw nothing weighing 0. With S == 1 the kernel stores the
normalised output.

The pool is read layer-stacked, [L, N, Hkv, bs, D]: the model's `layer` (a traced int) arrives
as a 1-element int32 array that the kernel loads and turns into a pointer offset,
layer * layer_stride, so no layer is ever sliced out (that would copy it, every layer, every
step). Single-layer blocks are viewed as a stack of one.

Quantized blocks (int8 / float8_e4m3fn) come with per-(token, KV head) scales [L, N, Hkv, bs]
(float16 from the engine's pool). Each step loads the block's [bs] scale rows next to it,
widens them and converts the block to float32 in registers; the K scale multiplies the [Rp, bs]
scores and the V scale the probabilities (as kernels/xla.py does): the block is only converted,
and no dequantized copy of the pool is ever written. Both run under Triton's interpreter on
torch CPU tensors (torch has both dtypes on CPU); on GPU, float8_e4m3fn (Triton's fp8e4nv) needs
sm_89 or newer.

Layouts the kernel reads (all contiguous): q [B, Hkv, Rp, D]; row_seen [B, Rp] (tokens each
row sees); blocks [L, N, Hkv, bs, D]; scales [L, N, Hkv, bs] (a 1-element placeholder when the
blocks are float); layer [1]; block_tables [B, MB]; context_lens, block_counts [B];
out [B, Hkv, S, Rp, D] (q's dtype when S == 1, else float32), m and l [B, Hkv, S, Rp] float32
(1-element placeholders when S == 1); layer_stride = N * Hkv * bs (token rows per layer, a
runtime integer: the scales' layer stride, the blocks' is D times that). Contract:
kernels/contract.py.
"""
# Annotations stay strings ('tl.constexpr'): this module imports without triton, and Triton's
# interpreter re-compiles the kernel source with postponed annotations anyway.
from __future__ import annotations
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import contract

try:
  import triton
  import triton.language as tl
except ImportError:  # the `triton` path is then unavailable; everything else still imports
  triton = tl = None


# ------------------------------------------------------------------------------------------------
# Wrapper (JAX on GPU)
# ------------------------------------------------------------------------------------------------
def paged_attention_triton(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, *,
                           scale=None, k_scales=None, v_scales=None, layer=None, num_warps=4,
                           num_stages=2, context_splits=None):
  """The contract's paged attention (kernels/contract.py); needs a GPU, triton and jax_triton;
  block_size and head_dim must be powers of two. layer: index into a layer-stacked pool
  [L, N, ...] (and scales), read in place. context_splits: split each sequence's blocks over
  that many programs (flash-decoding); default: contract.default_gpu_splits."""
  k_blocks, v_blocks, k_scales, v_scales, layer = contract.as_layer_stacked(
      q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales, v_scales, layer)
  splits = _check_supported(q, k_blocks, block_tables, context_splits)
  try:
    import jax_triton  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # on CPU jaxlib jax_triton refuses to import
    raise RuntimeError(f'impl="triton" needs jax_triton and a GPU jaxlib ({e}); on CPU use '
                       'impl="xla"') from e
  return _paged_attention(jax_triton, q, k_blocks, v_blocks, block_tables, context_lens,
                          q_positions, k_scales, v_scales, contract.layer_index(layer),
                          contract.softmax_scale(scale, q.shape[-1]), num_warps, num_stages,
                          splits)


def _check_supported(q, k_blocks, block_tables, context_splits):
  """k_blocks layer-stacked [L, N, Hkv, bs, D] -> the launch's split count."""
  if triton is None:
    raise RuntimeError('impl="triton" needs the triton package (requirements-kernels.txt)')
  block_size, head_dim = k_blocks.shape[-2:]
  contract.require_pow2('triton', block_size, head_dim)
  return contract.split_count(context_splits, q.shape[0], k_blocks.shape[2],
                              block_tables.shape[1], block_size)


def _prepare(q, block_tables, context_lens, q_positions, num_kv_heads, block_size):
  """JAX-side layout shared by both launchers: (q rows [B, Hkv, Rp, D], row_seen [B, Rp],
  block_counts [B])."""
  group = q.shape[2] // num_kv_heads
  rows = contract.gpu_rows(q.shape[1] * group)
  seen = contract.tokens_seen(q_positions, context_lens)
  return (contract.group_rows(q, num_kv_heads, rows_to=rows),
          contract.rows_seen(seen, group, rows_to=rows),
          contract.visible_blocks(seen, block_size, block_tables.shape[1]))


def _out_shapes(qg_shape, splits):
  """The launch's (out, m, l) shapes. With splits == 1, out is the normalised output in q's
  dtype and m, l are 1-element placeholders the kernel never writes; else all three are the
  float32 partial states."""
  batch, num_kv_heads, rows, head_dim = qg_shape
  if splits == 1:
    return [(batch, num_kv_heads, 1, rows, head_dim), (1,), (1,)]
  return [(batch, num_kv_heads, splits, rows, head_dim), (batch, num_kv_heads, splits, rows),
          (batch, num_kv_heads, splits, rows)]


def _finish(out, m, l, splits, dtype, num_q, num_heads):
  """Kernel outputs (see _out_shapes) -> [B, T, Hq, D] in `dtype`."""
  out = out[:, :, 0] if splits == 1 else contract.merge_split_states(out, m, l).astype(dtype)
  return contract.ungroup_rows(out, num_q, num_heads)


@functools.partial(jax.jit, static_argnums=(0, 10, 11, 12, 13))
def _paged_attention(jax_triton, q, k_blocks, v_blocks, block_tables, context_lens, q_positions,
                     k_scales, v_scales, layer, scale, num_warps, num_stages, splits):
  batch, num_q, num_heads, _ = q.shape
  _, num_blocks, num_kv_heads, block_size, head_dim = k_blocks.shape
  qg, row_seen, block_counts = _prepare(q, block_tables, context_lens, q_positions,
                                        num_kv_heads, block_size)
  quantized = k_scales is not None
  if not quantized:  # the kernel takes scale pointers either way; QUANTIZED=False never reads them
    k_scales = v_scales = jnp.zeros((1,), jnp.float16)
  out, m, l = jax_triton.triton_call(
      qg, k_blocks, v_blocks, k_scales, v_scales, layer, block_tables, context_lens, row_seen,
      block_counts, num_blocks * num_kv_heads * block_size,
      kernel=_kernel,
      out_shape=[jax.ShapeDtypeStruct(shape, q.dtype if i == 0 and splits == 1 else jnp.float32)
                 for i, shape in enumerate(_out_shapes(qg.shape, splits))],
      grid=(batch, num_kv_heads, splits),
      num_warps=num_warps, num_stages=num_stages,
      **_meta(qg.shape[2], num_kv_heads, block_tables.shape[1], block_size, head_dim, scale,
              quantized, splits))
  return _finish(out, m, l, splits, q.dtype, num_q, num_heads)


def _meta(rows, num_kv_heads, max_blocks, block_size, head_dim, scale, quantized, splits):
  return dict(SCALE=scale, NUM_KV_HEADS=num_kv_heads, MAX_BLOCKS=max_blocks, ROWS=rows,
              BLOCK_SIZE=block_size, HEAD_DIM=head_dim, USE_DOT=block_size >= contract.MIN_DOT,
              QUANTIZED=quantized, SPLITS=splits, PER_SPLIT=-(-max_blocks // splits))


# ------------------------------------------------------------------------------------------------
# Wrapper (torch: Triton's CPU interpreter in tests, or a torch caller on GPU)
# ------------------------------------------------------------------------------------------------
def launch_torch(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, *, scale=None,
                 k_scales=None, v_scales=None, layer=None, context_splits=None):
  """The same contract and kernel on torch tensors on the inputs' device (JAX/numpy inputs are
  converted; scales keep their dtype, float16 as the engine stores them). The split states are
  merged in JAX. Returns a numpy float32 array [B, T, Hq, D] (q's dtype widened)."""
  import torch  # pylint: disable=import-outside-toplevel
  k_blocks, v_blocks, k_scales, v_scales, layer = contract.as_layer_stacked(
      q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales, v_scales, layer)
  splits = _check_supported(q, k_blocks, block_tables, context_splits)
  batch, num_q, num_heads, head_dim = q.shape
  _, num_blocks, num_kv_heads, block_size, _ = k_blocks.shape
  qg, row_seen, block_counts = _prepare(jnp.asarray(q), jnp.asarray(block_tables),
                                        jnp.asarray(context_lens), jnp.asarray(q_positions),
                                        num_kv_heads, block_size)
  quantized = k_scales is not None
  if not quantized:
    k_scales = v_scales = np.zeros((1,), np.float16)
  layer = np.full((1,), int(layer), np.int32)

  def to_torch(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.bfloat16:  # no numpy bfloat16 in torch: cross through dlpack
      return torch.from_dlpack(x).clone()
    if x.dtype == jnp.float8_e4m3fn:  # nor float8: cross as bytes, reinterpret in torch
      return torch.from_numpy(np.array(x).view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.array(x))

  args = [to_torch(x) for x in (qg, k_blocks, v_blocks, k_scales, v_scales, layer, block_tables,
                                context_lens, row_seen, block_counts)]
  # NaN-filled, not empty: a slot the kernel failed to write shows in the result.
  outs = [torch.full(shape, float('nan'),
                     dtype=args[0].dtype if i == 0 and splits == 1 else torch.float32)
          for i, shape in enumerate(_out_shapes(tuple(qg.shape), splits))]
  _kernel[(batch, num_kv_heads, splits)](
      *args, num_blocks * num_kv_heads * block_size, *outs,
      **_meta(qg.shape[2], num_kv_heads, block_tables.shape[1], block_size, head_dim,
              contract.softmax_scale(scale, head_dim), quantized, splits))
  out, m, l = (jnp.asarray(x.float().numpy()) for x in outs)
  return np.asarray(_finish(out, m, l, splits, jnp.float32, num_q, num_heads))


def compile_ahead(capability=90, *, rows=16, num_kv_heads=8, max_blocks=16, block_size=64,
                  head_dim=64, dtype='fp32', block_dtype=None, scale_dtype='fp16', num_warps=4,
                  num_stages=2, splits=1):
  """Compiles the kernel for a CUDA compute capability without a GPU (Triton ships ptxas);
  returns Triton's compiled kernel, whose .asm holds ttir/ttgir/llir/ptx/cubin. dtype: q and
  output ('fp32', 'bf16'); block_dtype: the blocks' (default dtype; 'i8' or 'fp8e4nv' compile
  the quantized kernel, with scales of scale_dtype: 'fp16' as the engine's pool stores them);
  splits > 1 compiles the split kernel (float32 partial outputs). Needs a process in which
  TRITON_INTERPRET was not set when triton was imported."""
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  from triton.runtime.jit import JITFunction  # pylint: disable=import-outside-toplevel
  fn = JITFunction(_paged_attention_kernel)
  block_dtype = dtype if block_dtype is None else block_dtype
  quantized = block_dtype in ('i8', 'fp8e4nv')
  meta = _meta(rows, num_kv_heads, max_blocks, block_size, head_dim, 0.125, quantized, splits)
  types = dict(q_ptr=f'*{dtype}', o_ptr=f'*{dtype}' if splits == 1 else '*fp32',
               k_ptr=f'*{block_dtype}', v_ptr=f'*{block_dtype}', ks_ptr=f'*{scale_dtype}',
               vs_ptr=f'*{scale_dtype}', m_ptr='*fp32', l_ptr='*fp32',
               layer_stride='i32')  # what jax_triton passes for a Python int below 2**31
  signature = {name: types.get(name, '*i32') for name in fn.arg_names if name not in meta}
  signature.update({name: 'constexpr' for name in meta})
  source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=meta)
  return triton.compile(source, target=GPUTarget('cuda', capability, 32),
                        options=dict(num_warps=num_warps, num_stages=num_stages))


# ------------------------------------------------------------------------------------------------
# Kernel body
# ------------------------------------------------------------------------------------------------
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, layer_ptr, tables_ptr, lens_ptr,
                            seen_ptr, counts_ptr, layer_stride, o_ptr, m_ptr, l_ptr,
                            SCALE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                            MAX_BLOCKS: tl.constexpr, ROWS: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                            USE_DOT: tl.constexpr, QUANTIZED: tl.constexpr,
                            SPLITS: tl.constexpr, PER_SPLIT: tl.constexpr):
  b = tl.program_id(0)
  h = tl.program_id(1)
  c = tl.program_id(2)
  r = tl.arange(0, ROWS)
  d = tl.arange(0, HEAD_DIM)
  t = tl.arange(0, BLOCK_SIZE)
  tile = (b * NUM_KV_HEADS + h).to(tl.int64) * ROWS * HEAD_DIM
  q = tl.load(q_ptr + tile + r[:, None] * HEAD_DIM + d[None, :]).to(tl.float32) * SCALE
  row_seen = tl.load(seen_ptr + b * ROWS + r)
  length = tl.load(lens_ptr + b)
  block_count = tl.load(counts_ptr + b)
  # Index of the layer's first token row (one token of one KV head, D elements); int64: a whole
  # stacked pool can exceed 2**31 elements.
  layer_base = tl.load(layer_ptr).to(tl.int64) * layer_stride

  m = tl.full((ROWS,), float('-inf'), tl.float32)
  l = tl.zeros((ROWS,), tl.float32)
  acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
  # A constant trip count with a uniform branch, not range(block_count): Triton's interpreter
  # cannot take a loaded scalar as a loop bound under NumPy >= 2.4. This split's blocks are
  # [c * PER_SPLIT, min((c + 1) * PER_SPLIT, block_count)) (block_count <= MAX_BLOCKS); none
  # for a split past a short sequence's end, which then stores m = -inf, l = 0, acc = 0.
  for i in range(0, PER_SPLIT):
    j = c * PER_SPLIT + i
    if j < block_count:
      block = tl.load(tables_ptr + b * MAX_BLOCKS + j).to(tl.int64)
      # The block's first token row: scales [L, N, Hkv, bs] are indexed by row, blocks by row * D.
      row = layer_base + (block * NUM_KV_HEADS + h) * BLOCK_SIZE
      offsets = row * HEAD_DIM + t[:, None] * HEAD_DIM + d[None, :]
      k = tl.load(k_ptr + offsets).to(tl.float32)  # [bs, D]; int8/fp8 converted in registers
      if USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision='ieee')
      else:
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
      if QUANTIZED:  # k = code * scale per token: scale the score columns, not the block
        s = s * tl.load(ks_ptr + row + t).to(tl.float32)[None, :]
      pos = j * BLOCK_SIZE + t
      visible = pos[None, :] < row_seen[:, None]
      s = tl.where(visible, s, float('-inf'))
      m_new = tl.maximum(m, tl.max(s, axis=1))
      m_shift = tl.where(m_new == float('-inf'), 0.0, m_new)  # row has seen no token yet
      p = tl.where(visible, tl.exp(s - m_shift[:, None]), 0.0)
      alpha = tl.exp(m - m_shift)
      l = l * alpha + tl.sum(p, axis=1)  # the softmax denominator takes unscaled probabilities
      if QUANTIZED:  # v = code * scale: fold it into p; `where` again, a scale may be NaN
        p = tl.where(visible, p * tl.load(vs_ptr + row + t).to(tl.float32)[None, :], 0.0)
      v = tl.load(v_ptr + offsets).to(tl.float32)
      v = tl.where((pos < length)[:, None], v, 0.0)  # past-length slots hold garbage
      if USE_DOT:
        pv = tl.dot(p, v, input_precision='ieee')
      else:
        pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
      acc = acc * alpha[:, None] + pv
      m = m_new
  part = (b * NUM_KV_HEADS + h).to(tl.int64) * SPLITS + c  # this program's [B, Hkv, S] index
  if SPLITS == 1:
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(o_ptr + part * ROWS * HEAD_DIM + r[:, None] * HEAD_DIM + d[None, :],
             out.to(o_ptr.dtype.element_ty))
  else:  # the unnormalised float32 state, for merge_split_states
    tl.store(o_ptr + part * ROWS * HEAD_DIM + r[:, None] * HEAD_DIM + d[None, :], acc)
    tl.store(m_ptr + part * ROWS + r, m)
    tl.store(l_ptr + part * ROWS + r, l)


# Decorated at import: under TRITON_INTERPRET=1 this is Triton's interpreted function.
_kernel = triton.jit(_paged_attention_kernel) if triton is not None else None
