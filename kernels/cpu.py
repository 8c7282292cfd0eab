"""Paged attention as a native C++ kernel for XLA:CPU, called through JAX's typed FFI.

The kernel (kernels/csrc/paged_attention_cpu.cc, body in paged_attention_cpu_body.inc) reads
the layer-stacked pool [L, N, Hkv, bs, D] in place: per (sequence, KV head, context split) one
task walks that sequence's visible blocks through its block table, reads each K/V row once for
all R = T*G query rows of the group (GQA; decode and prefill chunks, causal within the chunk
through q_positions), converts it to float32 in registers (bfloat16 / float16 by bit shifts,
int8 and fp8_e4m3 codes with their per-(token, KV head) scales: the K scale on the score, the V
scale on the probability, as kernels/xla.py does) and folds it into an online softmax. Slots a
query may not see are never read, so NaN / inf there cannot reach the output. Tasks run on
XLA's own intra-op thread pool (the FFI ThreadPool context: the thread count XLA takes from the
machine), the calling thread included. With fewer (sequence, KV head) pairs than two per thread
the context is split (flash-decoding) into splits of at least 256 tokens, merged in C++ as
contract.merge_split_states does; `context_splits` forces a count. The layer index is a 1-element
int32 operand, so the model's layer scan can pass a traced one.

Vectorization without -march=native: the body is compiled twice in one library, for the
baseline ISA and (x86-64, GCC) under `#pragma GCC target("avx2,fma")`; the copy is picked at load
time from the CPU's flags (`uses_avx2()` reports which), so a library built on one machine runs
on any x86-64 and AVX2 machines get 8-wide FMA loops. head_dim 64 and 128 (compile-time
constants) run on explicit GCC/Clang vectors, 8 floats in the AVX2 copy and 4 in the baseline
one, per block in tiles of up to 4 query rows that see the same tokens (a decode step's GQA
group): scores for kLanes (token, row) pairs at a time, each K vector loaded once for every row
of the tile and one transposing reduction per kLanes scores; the online-softmax step on whole
vectors of those scores; p @ V with the tile's accumulators in registers across the block's
tokens, each V vector loaded once for every row (acc is loaded, scaled by the block's alpha, and
stored once per block, not per token). float32 blocks are read in place, bfloat16 and int8 ones
widened in registers as they are loaded (float16 and fp8 into a float32 copy of the block
first); the next block's K and V are prefetched through the block table, spread over the
block's loops. Other head dims run plain loops GCC vectorizes at -O3, the reductions marked
`#pragma omp simd reduction`, which -fopenmp-simd honours with no OpenMP runtime. No
-ffast-math: it would license reassociation everywhere, let the compiler assume no NaN/inf (the
masking's premise), and linking with it sets flush-to-zero for the whole process. exp is a
vectorizable Cephes polynomial (about 1 ulp); float16 / fp8 widening builds subnormals from an
exact int->float conversion, so XLA threads running with denormals-are-zero still get them
right. Building with -DPAGEDJAX_BASELINE_ONLY leaves the AVX2 copy out (to test the baseline
copy on an AVX2 machine).

Build: compiled with the C++ compiler (`$CXX`, default g++) at first use into
`~/.cache/pagedjax/kernels/` (`$PAGEDJAX_KERNEL_CACHE` overrides the directory), named by a hash
of the sources, the flags, the compiler's version, jax/jaxlib's versions and the FFI headers'
contents (a library built against one jaxlib is never loaded by another), written to a temporary
file and renamed (two processes building at once both end with a whole library). Not a setuptools
extension: the FFI headers come from the installed jaxlib (`jax.ffi.include_dir()`), which pip's
isolated build environment for `pip install -e .` does not have, and the library must match the
jaxlib it runs against (the GPU machine brings another jax); a cache keyed by versions rebuilds
exactly when one changes, and needs no build step in the README's install command. Without a
compiler (or if the build or loading fails) `available()` is False, `unavailable_reason()` says
why, `impl='auto'` stays on `xla` and the conformance tests for `cpu` skip with that reason.

CPU only: the FFI target is registered for platform 'cpu'; `auto` picks it only when JAX's
default backend is the CPU. Contract: kernels/contract.py.
"""
import ctypes
import functools
import hashlib
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import native_build

from . import contract

TARGET = 'pagedjax_paged_attention_cpu'
_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'csrc')
SOURCES = ('paged_attention_cpu.cc', 'paged_attention_cpu_body.inc', 'cpu_parallel.inc')
# Portable flags only (see the module docstring): -O3 vectorizes, -fopenmp-simd honours the simd
# pragmas, -fno-math-errno lets std::exp skip errno (the kernel never reads it).
CXXFLAGS = ('-O3', '-std=c++17', '-fPIC', '-shared', '-fopenmp-simd', '-fno-math-errno')
_BUILD_TIMEOUT_S = 300


def cache_dir():
  """Where built libraries go: $PAGEDJAX_KERNEL_CACHE, else ~/.cache/pagedjax/kernels."""
  return os.path.expanduser(os.environ.get('PAGEDJAX_KERNEL_CACHE',
                                           '~/.cache/pagedjax/kernels'))


def _compiler():
  return os.environ.get('CXX', 'g++')


def _compiler_version(cxx):
  done = subprocess.run([cxx, '--version'], capture_output=True, text=True, timeout=60,
                        check=True)
  return done.stdout.splitlines()[0] if done.stdout else ''


def _ffi_headers_digest(include_dir):
  """A hash of every file under jaxlib's FFI include directory (names and contents): the
  headers the library is compiled against, so a jaxlib whose headers differ under the same
  version string (a source or nightly build) still gets its own library."""
  key = hashlib.sha256()
  for root, dirs, files in os.walk(include_dir):
    dirs.sort()
    for name in sorted(files):
      path = os.path.join(root, name)
      key.update(os.path.relpath(path, include_dir).encode() + b'\0')
      with open(path, 'rb') as f:
        key.update(f.read())
  return key.hexdigest()


def library_path(cxx=None, stem='paged_attention_cpu', sources=SOURCES):
  """The cached library's path for these sources, flags, compiler, jax/jaxlib versions and FFI
  headers (raises OSError / CalledProcessError when the compiler does not run): a library built
  against one jaxlib is never loaded by another. stem and sources name the library (the
  linear-layer kernel, kernels/linear_cpu.py, is built the same way)."""
  cxx = cxx or _compiler()
  key = hashlib.sha256()
  for name in sources:
    with open(os.path.join(_CSRC, name), 'rb') as f:
      key.update(f.read())
  import jaxlib  # pylint: disable=import-outside-toplevel
  for part in (*CXXFLAGS, cxx, _compiler_version(cxx), jax.__version__, jaxlib.__version__,
               _ffi_headers_digest(jax.ffi.include_dir())):
    key.update(part.encode() + b'\0')
  return os.path.join(cache_dir(), f'{stem}-{key.hexdigest()[:16]}.so')


def build(cxx=None, stem='paged_attention_cpu', sources=SOURCES):
  """Compiles a kernel library (sources[0] is its one translation unit, the rest what it
  includes) into the cache unless it is there; returns the library's path. Raises RuntimeError
  naming the compiler and its last error lines when it cannot."""
  cxx = cxx or _compiler()
  try:
    path = library_path(cxx, stem, sources)
  except (OSError, subprocess.SubprocessError) as e:
    raise RuntimeError(f'no working C++ compiler {cxx!r} ($CXX): {e}') from None
  command = [cxx, *CXXFLAGS, '-isystem', jax.ffi.include_dir(), os.path.join(_CSRC, sources[0])]
  return native_build.compile_once(command, path, f'the CPU kernel with {cxx!r}',
                                   _BUILD_TIMEOUT_S)


def load_library(stem: str, sources, target: str, symbol: str):
  """(ctypes library, None) once `stem`'s library is built from `sources`, loaded, and its FFI
  handler `symbol` registered with XLA as `target`; (None, reason) when any step fails. The
  attention kernel here and the linear kernel (linear_cpu.py) load this way."""
  try:
    path = build(stem=stem, sources=sources)
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform='cpu')
  except (RuntimeError, OSError, AttributeError) as e:
    return None, str(e)
  return lib, None


@functools.lru_cache(maxsize=None)
def _load():
  """load_library for the attention kernel, cached for the process: a failed build is not
  retried on every call."""
  return load_library('paged_attention_cpu', SOURCES, TARGET, 'PagedAttentionCpu')


def available():
  """Whether the native kernel is built (or could be, now) and registered."""
  return _load()[0] is not None


def unavailable_reason():
  """Why available() is False (None when it is True)."""
  return _load()[1]


def uses_avx2():
  """Whether this CPU runs the kernel's AVX2 + FMA copy (False: the baseline copy)."""
  lib = _load()[0]
  return bool(lib is not None and lib.PagedAttentionCpuUsesAvx2())


# ------------------------------------------------------------------------------------------------
# Wrapper
# ------------------------------------------------------------------------------------------------
def paged_attention_cpu(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, *,
                        scale=None, k_scales=None, v_scales=None, layer=None,
                        context_splits=None):
  """The contract's paged attention (kernels/contract.py) on XLA:CPU. layer: index into a
  layer-stacked pool [L, N, ...] (and scales), read in place. context_splits: split every
  sequence's visible blocks into that many ranges (default: the kernel picks from the thread
  count and the lengths, see choose_splits in the C++ source)."""
  out, _ = paged_attention_cpu_lse(q, k_blocks, v_blocks, block_tables, context_lens,
                                   q_positions, scale=scale, k_scales=k_scales,
                                   v_scales=v_scales, layer=layer, context_splits=context_splits)
  return out.astype(q.dtype)


def paged_attention_cpu_lse(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, *,
                            scale=None, k_scales=None, v_scales=None, layer=None,
                            context_splits=None):
  """paged_attention_cpu's output as float32, and each query row's log-sum-exp of its scaled
  scores, lse [B, T, Hq] float32 (-inf for a row that sees nothing): what merging this span's
  output with another's needs (model/streamed_attention.py folds host blocks this way)."""
  k_blocks, v_blocks, k_scales, v_scales, layer = contract.as_layer_stacked(
      q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales, v_scales, layer)
  splits = contract.check_context_splits(context_splits)
  if not available():
    raise RuntimeError(f'impl="cpu" needs the native kernel, which is unavailable: '
                       f'{unavailable_reason()}; use impl="xla"')
  return _paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, q_positions,
                          k_scales, v_scales, contract.layer_index(layer),
                          scale=contract.softmax_scale(scale, q.shape[-1]), splits=splits or 0)


@functools.partial(jax.jit, static_argnames=('scale', 'splits'))
def _paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales,
                     v_scales, layer, *, scale, splits):
  """Blocks (and scales) layer-stacked; layer a [1] int32 array; splits 0: the kernel's choice.
  Float blocks pass 1-element float32 placeholders for the scales (never read).
  -> (out [B, T, Hq, D], lse [B, T, Hq]), float32."""
  if k_scales is None:
    k_scales = v_scales = jnp.zeros((1,), jnp.float32)
  # Under vmap (nothing in pagedjax vmaps attention) the call runs once per batch element.
  call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                   jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32)),
                          vmap_method='sequential')
  return call(q.astype(jnp.float32), k_blocks, v_blocks, k_scales, v_scales, block_tables,
              context_lens, q_positions, layer, scale=np.float32(scale), splits=np.int64(splits))


def main():
  """`python -m pagedjax.kernels.cpu`: builds both native CPU libraries into the cache now
  (attention here, the linear layers' kernels/linear_cpu.py), as their first use would; prints
  each library's path, or why it cannot be built (exit 1)."""
  from pagedjax.kernels import linear_cpu  # pylint: disable=import-outside-toplevel
  failed = False
  for stem, sources in (('paged_attention_cpu', SOURCES), ('linear_cpu', linear_cpu.SOURCES)):
    try:
      print(f'{stem}: {build(stem=stem, sources=sources)}')
    except RuntimeError as e:
      print(f'{stem}: not built: {e}')
      failed = True
  return 1 if failed else 0


if __name__ == '__main__':
  raise SystemExit(main())
