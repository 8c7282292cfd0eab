"""Linear layers as a native C++ kernel for XLA:CPU, called through JAX's typed FFI.

`linear(x, w)` is x [..., K] @ w [K, N] (a Dense kernel, [in, out]); `linear(x, e,
transposed=True)` is x @ e.T for e [N, K] (a tied embedding as the output head), read in place
with no transposed copy. The kernel (kernels/csrc/linear_cpu.cc, body in linear_cpu_body.inc)
is for the few rows of a decode step, where XLA:CPU's dots (YNNPACK from 2 rows) leave memory
bandwidth unused: y's columns are cut into blocks over XLA's intra-op thread pool (the attention
kernel's FFI ThreadPool route), each block running register tiles of rows x columns (up to 12
vector accumulators; AVX2 + FMA where the CPU has it, picked at load time, else 4-float
vectors), in L2-sized panels with W prefetched ahead when more than 4 rows reuse them; with 1-2
rows W's rows are instead streamed whole in fixed ranges of 32 rows whose sums are added in order.
Float32 only; numerics: one sum per output in a fixed order (w [K, N]: k = 0, 1, ... with fused
multiply-adds, per range of 32 rows at 1-2 rows; w [N, K]: 8 interleaved partial sums, then their
sum), so results differ from XLA's dots by float32 rounding (about 1e-6 relative) and do not
depend on the thread count.

Built like kernels/cpu.py's attention kernel (cpu.build: the C++ compiler at first use, cached
under ~/.cache/pagedjax/kernels by a hash of sources, flags, compiler, jax versions and FFI
headers); without
a compiler `available()` is False and `linear_impl='auto'` stays on XLA's dots.

`linear_many(x, [w_q, w_k, w_v])` runs several Dense kernels of one x in one call (a second FFI
target of the same library): one dispatch of the thread pool for all their column blocks
instead of one per matmul, each result bit-identical to its own call. It is opt-in
('cpu_fused'): on SmolLM2-135M the decode step fused / unfused measured 0.98 at batch 8 and
0.99 at batch 32, within the noise of a machine under load (docs/decode_speed.md), as the
profile predicts (experiments/profile_decode.py: the pool's dispatch is a few microseconds of
each call, the kernel's time is its reading of W).

`pack(w)` repacks a Dense kernel [K, N] once into strips of S = strip() columns ([ceil(N / S),
K, S]: each strip's columns row after row, the last strip zero-padded), a `Packed` that
`linear` / `kernel` take in w's place at any row count: every register tile then reads W as one
sequential run per vector of columns instead of pieces N floats apart, which the hardware
prefetchers follow (experiments/bench_linear.py; docs/decode_speed.md). S is 16 where the CPU
has AVX-512 (the kernel then reads packed W with 16-float vectors, 16 x 1 register tiles), 8
otherwise. Same sums as the in-place kernel from 3 rows (k = 0, 1, ... with fused multiply-adds,
whatever the vector width), so bit for bit its results there. The copy is as large as W: the
caller packs once per params object and keeps it.

LINEAR_IMPLS: 'xla' (jnp / lax dots), 'cpu' (this kernel for calls of MIN_ROWS to MAX_ROWS rows,
XLA's dots otherwise), 'cpu_fused' ('cpu' with q/k/v and gate/up each as one linear_many call:
llama.py), 'cpu_packed' ('cpu', and decode calls, which run the layers unrolled, read every
Dense kernel from a packed copy made once per params object: model/step.py packs the per-layer
params, llama.per_layer_params(pack=True); the copies add the kernels' size in memory),
'auto' ('cpu_packed' on a CPU backend where the kernel builds, else 'xla': in one interleaved
run against vLLM, packed decode took tokens/s 1.54x the in-place kernel's at batch 8,
docs/decode_speed.md).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import cpu

TARGET = 'pagedjax_linear_cpu'
MULTI_TARGET = 'pagedjax_linear_multi_cpu'  # several Dense kernels of one x: linear_many
SOURCES = ('linear_cpu.cc', 'linear_cpu_body.inc', 'cpu_parallel.inc')
LINEAR_IMPLS = ('auto', 'xla', 'cpu', 'cpu_fused', 'cpu_packed')
KERNEL_IMPLS = ('cpu', 'cpu_fused', 'cpu_packed')  # the impls that run the kernel
# The rows (x's leading axes together) for which the model's linear layers run the kernel. Above
# MAX_ROWS (prefill chunks: rows x chunk tokens) XLA's packed GEMMs are compute-bound and the
# kernel is not faster; at one row XLA's own matrix-vector loop measured faster than the
# kernel's (docs/decode_speed.md), so a lone decode row keeps it too.
MIN_ROWS, MAX_ROWS = 2, 64
ISAS = ('baseline', 'avx2', 'avx512')  # the kernel body's copies (csrc/linear_cpu.cc), in order


def strip() -> int:
  """Columns per strip of the packed layout for the kernel copy in use (kStrip in
  csrc/linear_cpu_body.inc): 16 with AVX-512, else 8."""
  lib = _load()[0]
  return int(lib.LinearCpuPackedStrip()) if lib is not None else 8


def isa() -> str:
  """The kernel copy this process runs (ISAS): the best the CPU has unless use_isa lowered it."""
  lib = _load()[0]
  return ISAS[lib.LinearCpuIsa()] if lib is not None else 'baseline'


def use_isa(name: str) -> str:
  """Runs the kernel copy `name` (ISAS; at most the CPU's best) from now on and returns the copy
  then in use. Packed copies made before for another strip width are refused by the kernel
  (a shape error), never misread: pack again after a change. For tests and benchmarks."""
  if name not in ISAS:
    raise ValueError(f'use_isa: {name!r} is not allowed: one of {ISAS}')
  lib = _load()[0]
  if lib is None:
    raise RuntimeError(f'the native linear kernel is unavailable: {unavailable_reason()}')
  return ISAS[lib.LinearCpuUseIsa(ISAS.index(name))]


@jax.tree_util.register_pytree_node_class
class Packed:
  """A Dense kernel [K, N] as `pack` lays it out: strips [ceil(N / S), K, S] float32 (S the
  strip width it was packed for, strip()), held as `data`, an array of shape [K, ceil(N / S) * S]
  whose memory is those strips (so that where N is a multiple of S, a flax nn.Dense takes it in
  its kernel's place: flax checks the shape of a param's leaves; llama.dense lets it through),
  and N and S (static: jit sees only `data`). A pytree, so it passes through jit and params
  trees."""

  def __init__(self, data, n: int, strip_width: int = 8):
    self.data, self.n, self.strip = data, int(n), int(strip_width)

  @property
  def strips(self):
    """[ceil(N / S), K, S]: `data` reshaped (in a jitted program, no copy)."""
    k = self.data.shape[0]
    return self.data.reshape(-1, k, self.strip)

  @property
  def shape(self):
    """The kernel's [K, N]."""
    return (self.data.shape[0], self.n)

  @property
  def ndim(self):
    return 2

  @property
  def dtype(self):
    return self.data.dtype

  def unpack(self):
    """The kernel [K, N] again (a copy)."""
    k = self.data.shape[0]
    return jnp.transpose(self.strips, (1, 0, 2)).reshape(k, -1)[:, :self.n]

  def tree_flatten(self):
    return (self.data,), (self.n, self.strip)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)


def pack(w, *, transposed=False) -> Packed:
  """A Dense kernel w [K, N] float32 (a jax or numpy array; transposed: w [N, K], e.g. a tied
  embedding used as the head, packed as w.T) in the packed layout (see the module docstring):
  one copy of w, made once, for `linear` / `kernel` to read instead."""
  if w.ndim != 2 or w.dtype != jnp.float32:
    raise ValueError(f'pack: w must be a 2-D float32 kernel, got shape {w.shape} {w.dtype}')
  w = jnp.asarray(w).T if transposed else jnp.asarray(w)
  k, n = w.shape
  width = strip()
  strips = -(-n // width)
  padded = jnp.pad(w, ((0, 0), (0, strips * width - n)))
  data = jnp.transpose(padded.reshape(k, strips, width), (1, 0, 2)).reshape(k, strips * width)
  return Packed(data, n, width)


def packs(impl: str) -> bool:
  """Whether linear_impl reads decode calls' Dense kernels from packed copies ('cpu_packed')."""
  return resolve(impl) == 'cpu_packed'


def pack_kernels(tree):
  """`tree` (a params tree, e.g. one layer's) with every Dense kernel (a float32 2-D leaf named
  'kernel' whose N is a multiple of strip(), so nn.Dense takes its Packed) replaced by pack's
  copy; every other leaf the same object. The copies add the kernels' size in memory."""
  width = strip()

  def one(path, leaf):
    last = path[-1] if path else None
    named_kernel = getattr(last, 'key', None) == 'kernel'
    if (named_kernel and getattr(leaf, 'ndim', 0) == 2 and leaf.dtype == jnp.float32
        and leaf.shape[1] % width == 0):
      return pack(leaf)
    return leaf
  return jax.tree_util.tree_map_with_path(one, tree)


def promote_dtype(*args, dtype=None, inexact=True):
  """flax's promote_dtype (nn.Dense(promote_dtype=...)), letting a Packed kernel through as it
  is (float32; `linear` reads it)."""
  from flax.linen import dtypes  # pylint: disable=import-outside-toplevel
  if not any(isinstance(a, Packed) for a in args):
    return dtypes.promote_dtype(*args, dtype=dtype, inexact=inexact)
  plain = dtypes.promote_dtype(*[None if isinstance(a, Packed) else a for a in args],
                               dtype=dtype or jnp.float32, inexact=inexact)
  return [a if isinstance(a, Packed) else b for a, b in zip(args, plain)]


@functools.lru_cache(maxsize=None)
def _load():
  """(ctypes library, None) once built, loaded and both its handlers registered; (None,
  reason) otherwise."""
  lib, reason = cpu.load_library('linear_cpu', SOURCES, TARGET, 'LinearCpu')
  if lib is not None:
    try:
      jax.ffi.register_ffi_target(MULTI_TARGET, jax.ffi.pycapsule(lib.LinearMultiCpu),
                                  platform='cpu')
    except (AttributeError, RuntimeError) as e:
      return None, str(e)
  return lib, reason


def available():
  """Whether the native linear kernel is built (or could be, now) and registered."""
  return _load()[0] is not None


def unavailable_reason():
  return _load()[1]


def uses_avx2():
  lib = _load()[0]
  return bool(lib is not None and lib.LinearCpuUsesAvx2())


def resolve(impl: str) -> str:
  """'auto' -> 'cpu_packed' on a CPU backend where the kernel builds, else 'xla'; checks the
  name."""
  if impl not in LINEAR_IMPLS:
    raise ValueError(f'linear_impl={impl!r} is not allowed: one of {LINEAR_IMPLS}')
  if impl == 'auto':
    return 'cpu_packed' if jax.default_backend() == 'cpu' and available() else 'xla'
  if impl in KERNEL_IMPLS and not available():
    raise RuntimeError(f'linear_impl="{impl}" needs the native kernel, which is unavailable: '
                       f'{unavailable_reason()}; use linear_impl="xla"')
  return impl


def fuses(impl: str) -> bool:
  """Whether linear_impl runs q/k/v and gate/up as one kernel call each (linear_many)."""
  return resolve(impl) == 'cpu_fused'


def runs_kernel(x, w) -> bool:
  """Whether linear_impl='cpu' runs the kernel for these operands (else XLA's dot); a Packed w
  always runs it (XLA has no dot for the layout), x float32."""
  if isinstance(w, Packed):
    return x.dtype == jnp.float32
  rows = int(np.prod(x.shape[:-1]))
  return (x.dtype == jnp.float32 and w.dtype == jnp.float32 and w.ndim == 2
          and MIN_ROWS <= rows <= MAX_ROWS)


def linear(x, w, *, transposed=False, impl='cpu'):
  """x [..., K] @ w [K, N] (transposed: @ w.T for w [N, K]) -> [..., N] in x's dtype.
  impl 'cpu' runs the kernel where runs_kernel says so, XLA's dot elsewhere. A Packed w
  (pack) runs the kernel at any row count whatever impl, or XLA's dot of it unpacked for non-float32
  x."""
  if isinstance(w, Packed):
    if transposed:  # a Packed kernel is [K, N]: pack(w, transposed=True) packs the transpose
      raise ValueError(f'linear: a Packed w {w.shape} is [K, N] already; transposed=True is '
                       'not allowed with it')
    return kernel(x, w) if runs_kernel(x, w) else jnp.dot(x, w.unpack().astype(x.dtype))
  impl = resolve(impl)
  if impl == 'xla' or not runs_kernel(x, w):
    return jnp.dot(x, w.T if transposed else w)
  return kernel(x, w, transposed=transposed)


def kernel(x, w, *, transposed=False):
  """The native kernel itself, for any row count: x [..., K] float32 @ w [K, N] float32 (transposed:
  @ w.T for w [N, K]; or w a Packed [K, N]) -> [..., N] float32. `linear` is what the model
  calls."""
  if not available():
    raise RuntimeError(f'the native linear kernel is unavailable: {unavailable_reason()}')
  k = x.shape[-1]
  if isinstance(w, Packed):
    if transposed or w.shape[0] != k:
      raise ValueError(f'linear: x {x.shape} and packed w {w.shape} (transposed={transposed}) '
                       'do not contract: a Packed kernel is [K, N], transposed=False')
    n, operand = w.n, w.strips  # the FFI handler tells the layout by w's rank (3-D: packed)
  else:
    n = w.shape[0] if transposed else w.shape[1]
    if (w.shape[1] if transposed else w.shape[0]) != k:
      raise ValueError(f'linear: x {x.shape} and w {w.shape} (transposed={transposed}) do not '
                       'contract')
    operand = w
  rows = int(np.prod(x.shape[:-1]))
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32),
                          vmap_method='sequential')
  y = call(x.reshape(rows, k), operand, transposed=np.int64(bool(transposed)))
  return y.reshape(*x.shape[:-1], n)


def linear_many(x, ws, *, impl='cpu') -> list:
  """[x @ w for w in ws] for Dense kernels w [K, N_j] of one x [..., K] (q/k/v, gate/up): one
  kernel call for all of them where the kernel runs for every one (runs_kernel), each result
  equal bit for bit to its own `linear` call; XLA's dots otherwise."""
  impl = resolve(impl)
  if impl == 'xla' or not all(runs_kernel(x, w) for w in ws):
    return [jnp.dot(x, w) for w in ws]
  return kernel_many(x, ws)


def kernel_many(x, ws) -> list:
  """The native kernel for several Dense kernels at once, any row count: x [..., K] float32,
  ws [K, N_j] float32 -> [[..., N_j]] float32; the pool's threads are handed every output's
  work in one dispatch."""
  if not available():
    raise RuntimeError(f'the native linear kernel is unavailable: {unavailable_reason()}')
  k = x.shape[-1]
  for w in ws:
    if w.ndim != 2 or w.shape[0] != k:
      raise ValueError(f'linear_many: x {x.shape} and w {w.shape} do not contract')
  rows = int(np.prod(x.shape[:-1]))
  call = jax.ffi.ffi_call(MULTI_TARGET, [jax.ShapeDtypeStruct((rows, w.shape[1]), jnp.float32)
                                         for w in ws], vmap_method='sequential')
  ys = call(x.reshape(rows, k), *ws)
  return [y.reshape(*x.shape[:-1], w.shape[1]) for y, w in zip(ys, ws)]


def dot_general(impl: str):
  """A `dot_general` for flax.linen.Dense(dot_general=...): Dense's contraction (x's last axis
  with the kernel's first) through `linear`; any other contraction is lax.dot_general."""
  impl = resolve(impl)
  if impl == 'xla':
    return jax.lax.dot_general

  def fn(x, w, dimension_numbers, precision=None, preferred_element_type=None):
    (lhs_c, rhs_c), batch = dimension_numbers
    dense = (tuple(lhs_c) == (x.ndim - 1,) and tuple(rhs_c) == (0,) and not batch[0]
             and w.ndim == 2 and preferred_element_type in (None, x.dtype))
    if dense and runs_kernel(x, w):
      return linear(x, w, impl='cpu')
    if isinstance(w, Packed):  # a contraction the kernel does not do: XLA's, of a copy
      w = w.unpack()
    return jax.lax.dot_general(x, w, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
  return fn
