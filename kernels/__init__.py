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
float32 (one scale per token and KV head); every path dequantizes as value * scale, inside its
kernel. Every path also reads a layer-stacked pool ([L, N, ...] with `layer=`) in place.

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


def gpu_converts_fp8():
  """Whether the default GPU's Triton can convert float8_e4m3fn (compute capability >= 8.9)."""
  capability = getattr(jax.devices()[0], 'compute_capability', None)  # e.g. '9.0'; GPUs only
  if capability is None:
    return False
  return tuple(int(x) for x in str(capability).split('.')[:2]) >= (8, 9)


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


def as_layer_stacked(q, k_pages, v_pages, block_tables, context_lens, q_positions, k_scales,
                     v_scales, layer):
  """What every kernel wrapper starts with: -> (k_pages, v_pages, k_scales, v_scales, layer)
  layer-stacked, after checking the shape contract. Given `layer`, the pages already are
  stacked; without, one layer's pages are viewed as a stack of one (None scales stay None)."""
  if layer is None:
    stack = lambda x: None if x is None else x[None]
    k_pages, v_pages, k_scales, v_scales = map(stack, (k_pages, v_pages, k_scales, v_scales))
    layer = 0
  check_inputs(q, _layer_view(k_pages), _layer_view(v_pages), block_tables, context_lens,
               q_positions, _layer_view(k_scales), _layer_view(v_scales))
  return k_pages, v_pages, k_scales, v_scales, layer


def merge_split_states(acc, m, l):
  """Online-softmax states of disjoint key ranges (flash-decoding splits) -> the normalised
  output. acc [..., S, R, D] unnormalised, m (running max) and l (sum) [..., S, R], float32;
  returns [..., R, D]. A split that saw nothing (m = -inf) weighs exp(-inf) = 0; a row that saw
  nothing anywhere gets 0. Every path with a context split merges through this."""
  m_max = jnp.max(m, axis=-2, keepdims=True)
  weight = jnp.exp(m - jnp.where(m_max == -jnp.inf, 0.0, m_max))  # [..., S, R]
  total = jnp.sum(weight * l, axis=-2)
  out = jnp.sum(weight[..., None] * acc, axis=-3)
  return out / jnp.where(total > 0, total, 1.0)[..., None]


def _layer_view(x):
  """Shape/dtype of one layer of a layer-stacked array (for validation only, no data)."""
  return None if x is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)


@functools.partial(jax.jit, static_argnames=('scale',))
def _reference(q, k_pages, v_pages, block_tables, context_lens, q_positions, k_scales, v_scales,
               layer, *, scale):
  from kernels.reference import paged_attention_ref  # pylint: disable=import-outside-toplevel
  return paged_attention_ref(q, k_pages, v_pages, block_tables, context_lens, q_positions,
                             scale=scale, k_scales=k_scales, v_scales=v_scales, layer=layer)


def paged_attention(q, k_pages, v_pages, block_tables, context_lens, q_positions, *,
                    impl='reference', scale=None, k_scales=None, v_scales=None, layer=None):
  """Attention of queries over a paged KV cache; see kernels/reference.py for shapes.

  With `layer` (a traced int is fine), k_pages/v_pages (and scales) carry a leading layers axis
  and attention reads that layer in place: inside the model's layer scan, slicing the layer out
  first would copy it, every layer, every step.
  """
  k_pages, v_pages, k_scales, v_scales, layer = as_layer_stacked(
      q, k_pages, v_pages, block_tables, context_lens, q_positions, k_scales, v_scales, layer)
  if impl == 'auto':
    impl = best_impl()
    block_size, head_dim = k_pages.shape[-2:]
    pow2 = lambda n: n & (n - 1) == 0
    if impl == 'pallas_gpu' and not (pow2(block_size) and pow2(head_dim)):
      impl = 'xla'  # Triton block shapes are powers of two (the tiny test models' are not)
    if (impl == 'pallas_gpu' and jnp.dtype(k_pages.dtype) == jnp.float8_e4m3fn
        and not gpu_converts_fp8()):
      impl = 'xla'  # Triton converts float8_e4m3fn only from sm_89 (Ada, Hopper) on
  if impl == 'reference':
    return _reference(q, k_pages, v_pages, block_tables, context_lens, q_positions, k_scales,
                      v_scales, layer, scale=scale)
  if impl not in _MODULES:
    raise ValueError(f'attention impl {impl!r} is not one of {IMPLS + ("auto",)}')
  module, name = _MODULES[impl]
  fn = getattr(importlib.import_module(module), name)
  return fn(q, k_pages, v_pages, block_tables, context_lens, q_positions, scale=scale,
            k_scales=k_scales, v_scales=v_scales, layer=layer)
