"""Paged-attention kernels behind one function, `paged_attention(..., impl=...)`.

The contract every path implements (shapes, masking, quantized blocks, layer-stacked pools) and
the helpers the wrappers share are in kernels/contract.py. Each path is one module holding its
kernel and its wrapper `paged_attention_<impl>`:
  reference   gather to dense + masked softmax (the oracle)              kernels/reference.py
  xla         blockwise online softmax in plain JAX, any backend         kernels/xla.py
  cpu         native C++ kernel through XLA's FFI: the fast CPU path     kernels/cpu.py
  pallas_tpu  Pallas/Mosaic TPU kernel; TPU, or TPU interpret mode       kernels/pallas_tpu.py
  pallas_gpu  Pallas GPU kernel, Triton lowering; GPU, or interpret=True kernels/pallas_gpu.py
  triton      @triton.jit kernel via jax_triton.triton_call; GPU only    kernels/triton.py
  auto        the best of the above for jax.default_backend()
              (on CPU: `cpu` where its kernel builds, else `xla`)

Modules are imported on first use, so importing `kernels` (the model does) does not pay for
importing Pallas or Triton; `cpu` compiles its C++ kernel (once per machine, cached) the first
time `auto` or `impl='cpu'` asks for it on a CPU backend.
"""
import importlib
import importlib.util

import jax
import jax.numpy as jnp

from . import contract

# Concrete paths; `impl='auto'` (not listed) resolves to one of them, see best_impl().
IMPLS = ('reference', 'xla', 'cpu', 'pallas_tpu', 'pallas_gpu', 'triton')


def best_impl(backend=None):
  """The fastest path for a backend ('cpu', 'gpu', 'tpu'; default: jax.default_backend()).
  On CPU that is the native kernel when it builds here (kernels/cpu.py), else `xla`."""
  backend = jax.default_backend() if backend is None else backend
  if backend == 'tpu':
    return 'pallas_tpu'
  if backend in ('gpu', 'cuda', 'rocm'):
    # The Pallas kernel needs no extra package; `triton` needs jax_triton installed.
    return 'pallas_gpu'
  if backend == 'cpu' and cpu_kernel_available():
    return 'cpu'
  return 'xla'


def cpu_kernel_available():
  """Whether the native CPU kernel builds (or is built) and loads here (kernels/cpu.py; the first
  call may compile it)."""
  return importlib.import_module(f'{__name__}.cpu').available()


def runs_on(impl, backend=None):
  """Whether the engine can run `impl` un-interpreted on a backend (default: JAX's default):
  the Pallas kernels need their own hardware, `triton` also the jax_triton package, and `cpu`
  the CPU backend and a kernel that builds."""
  backend = jax.default_backend() if backend is None else backend
  gpu = backend in ('gpu', 'cuda', 'rocm')
  if impl in ('auto', 'reference', 'xla'):
    return True
  if impl == 'cpu':
    return backend == 'cpu' and cpu_kernel_available()
  if impl == 'pallas_tpu':
    return backend == 'tpu'
  if impl == 'triton':
    return gpu and importlib.util.find_spec('jax_triton') is not None
  return impl == 'pallas_gpu' and gpu


def gpu_converts_fp8():
  """Whether the default GPU's Triton can convert float8_e4m3fn (compute capability >= 8.9)."""
  capability = getattr(jax.devices()[0], 'compute_capability', None)  # e.g. '9.0'; GPUs only
  if capability is None:
    return False
  return tuple(int(x) for x in str(capability).split('.')[:2]) >= (8, 9)


def _resolve_auto(k_blocks):
  impl = best_impl()
  if impl != 'pallas_gpu':
    return impl
  block_size, head_dim = k_blocks.shape[-2:]
  if not (contract.pow2(block_size) and contract.pow2(head_dim)):
    return 'xla'  # Triton block shapes are powers of two (the tiny test models' are not)
  if jnp.dtype(k_blocks.dtype) == jnp.float8_e4m3fn and not gpu_converts_fp8():
    return 'xla'  # Triton converts float8_e4m3fn only from sm_89 (Ada, Hopper) on
  return impl


def paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, *,
                    impl='reference', scale=None, k_scales=None, v_scales=None, layer=None):
  """Attention of queries over a paged KV cache (the contract: kernels/contract.py).

  With `layer` (a traced int is fine), k_blocks/v_blocks (and scales) are the whole
  layer-stacked pool [L, N, ...] and attention reads that layer in place: inside the model's
  layer scan, slicing the layer out first would copy it, every layer, every step. int8 /
  float8_e4m3fn blocks come with k_scales/v_scales (float16 in the engine's pool).
  """
  if impl == 'auto':
    impl = _resolve_auto(k_blocks)
  if impl not in IMPLS:
    raise ValueError(f'attention impl {impl!r} is not one of {IMPLS + ("auto",)}')
  fn = getattr(importlib.import_module(f'{__name__}.{impl}'), f'paged_attention_{impl}')
  return fn(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, scale=scale,
            k_scales=k_scales, v_scales=v_scales, layer=layer)
