"""Paged-attention kernels behind one function, `paged_attention(..., impl=...)`.

Each implementation lives in its own module; see kernels/reference.py for the shared
shape contract. `impl` names:
  reference   gather to dense + masked softmax (the oracle)
  xla         blockwise online softmax in plain JAX (kernels/xla.py): the fast CPU path
  pallas_tpu  Pallas/Mosaic TPU kernel (kernels/pallas_tpu.py); TPU, or TPU interpret mode
  pallas_gpu  Pallas GPU kernel, Triton lowering (kernels/pallas_gpu.py); GPU, or interpret=True
  triton      @triton.jit kernel through jax_triton.triton_call (kernels/triton.py); GPU only
  auto        the best of the above for jax.default_backend()

Quantized pools pass int8 or float8_e4m3fn pages with `k_scales`/`v_scales` [N, Hkv, bs]
float32 (one scale per token and KV head); every path dequantizes as value * scale.

Implementation modules are imported on first use, so importing `kernels` (the model does) does
not pay for importing Pallas or Triton.
"""
import functools
import importlib

import jax
import jax.numpy as jnp

# Concrete paths; `impl='auto'` (not listed) resolves to one of them, see best_impl().
IMPLS = ('reference', 'xla', 'pallas_tpu', 'pallas_gpu', 'triton')

# impl name -> (module, function); the wrappers all take the reference signature plus
# k_scales/v_scales.
_MODULES = {
    'xla': ('kernels.xla', 'paged_attention_xla'),
    'pallas_tpu': ('kernels.pallas_tpu', 'paged_attention_pallas_tpu'),
    'pallas_gpu': ('kernels.pallas_gpu', 'paged_attention_pallas_gpu'),
    'triton': ('kernels.triton', 'paged_attention_triton'),
}

QUANT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def best_impl(backend=None):
  """The fastest path for a backend ('cpu', 'gpu', 'tpu'; default: jax.default_backend())."""
  backend = jax.default_backend() if backend is None else backend
  if backend == 'tpu':
    return 'pallas_tpu'
  if backend in ('gpu', 'cuda', 'rocm'):
    # The Pallas kernel needs no extra package; `triton` needs jax_triton installed.
    return 'pallas_gpu'
  return 'xla'


def check_inputs(q, k_pages, v_pages, block_tables, context_lens, q_positions,
                 k_scales=None, v_scales=None):
  """Validates the shape contract shared by every path; raises ValueError naming the values."""
  if q.ndim != 4:
    raise ValueError(f'q must be [B, T, Hq, D], got shape {q.shape}')
  if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
    raise ValueError(f'k_pages and v_pages must both be [N, Hkv, bs, D], got {k_pages.shape} '
                     f'and {v_pages.shape}')
  batch, num_q, num_heads, head_dim = q.shape
  _, num_kv_heads, _, page_dim = k_pages.shape
  if page_dim != head_dim:
    raise ValueError(f'q head_dim {head_dim} != page head_dim {page_dim}')
  if num_heads % num_kv_heads:
    raise ValueError(f'{num_heads} query heads are not a multiple of {num_kv_heads} KV heads')
  if block_tables.ndim != 2 or block_tables.shape[0] != batch:
    raise ValueError(f'block_tables must be [B={batch}, MB], got {block_tables.shape}')
  if context_lens.shape != (batch,):
    raise ValueError(f'context_lens must be [B={batch}], got {context_lens.shape}')
  if q_positions.shape != (batch, num_q):
    raise ValueError(f'q_positions must be [B={batch}, T={num_q}], got {q_positions.shape}')
  for name, x in (('block_tables', block_tables), ('context_lens', context_lens),
                  ('q_positions', q_positions)):
    if x.dtype != jnp.int32:
      raise ValueError(f'{name} must be int32, got {x.dtype}')
  if (k_scales is None) != (v_scales is None):
    raise ValueError('pass both k_scales and v_scales or neither')
  quantized = jnp.dtype(k_pages.dtype) in QUANT_DTYPES
  if k_scales is not None:
    if not quantized:
      raise ValueError(f'scales given but pages are {k_pages.dtype}, not one of {QUANT_DTYPES}')
    want = k_pages.shape[:3]
    if k_scales.shape != want or v_scales.shape != want:
      raise ValueError(f'k_scales/v_scales must be [N, Hkv, bs] = {want}, got {k_scales.shape} '
                       f'and {v_scales.shape}')
  elif quantized:
    raise ValueError(f'{k_pages.dtype} pages need k_scales and v_scales')


def dequantize_pages(pages, scales):
  """int8/fp8 pages [N, Hkv, bs, D] * scales [N, Hkv, bs] -> float32 pages."""
  return pages.astype(jnp.float32) * scales[..., None]


@functools.partial(jax.jit, static_argnames=('scale',))
def _reference(q, k_pages, v_pages, block_tables, context_lens, q_positions, k_scales, v_scales,
               *, scale):
  from kernels.reference import paged_attention_ref  # pylint: disable=import-outside-toplevel
  if k_scales is not None:
    # Elementwise, so dequantizing before the gather equals dequantizing after it.
    k_pages, v_pages = dequantize_pages(k_pages, k_scales), dequantize_pages(v_pages, v_scales)
  return paged_attention_ref(q, k_pages, v_pages, block_tables, context_lens, q_positions,
                             scale=scale)


def paged_attention(q, k_pages, v_pages, block_tables, context_lens, q_positions, *,
                    impl='reference', scale=None, k_scales=None, v_scales=None):
  """Attention of queries over a paged KV cache; see kernels/reference.py for shapes."""
  if impl == 'auto':
    impl = best_impl()
    _, _, block_size, head_dim = k_pages.shape
    pow2 = lambda n: n & (n - 1) == 0
    if impl == 'pallas_gpu' and (k_scales is not None or not pow2(block_size) or
                                 not pow2(head_dim)):
      impl = 'xla'  # what the GPU kernel does not cover (quantized pages, odd shapes)
  if impl == 'reference':
    check_inputs(q, k_pages, v_pages, block_tables, context_lens, q_positions, k_scales, v_scales)
    return _reference(q, k_pages, v_pages, block_tables, context_lens, q_positions, k_scales,
                      v_scales, scale=scale)
  if impl not in _MODULES:
    raise ValueError(f'attention impl {impl!r} is not one of {IMPLS + ("auto",)}')
  module, name = _MODULES[impl]
  fn = getattr(importlib.import_module(module), name)
  return fn(q, k_pages, v_pages, block_tables, context_lens, q_positions, scale=scale,
            k_scales=k_scales, v_scales=v_scales)
