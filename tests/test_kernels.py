"""Conformance suite of the paged-attention paths (kernels/): the same cases for every path.

Paths (PATHS): reference; xla; cpu (the native C++ kernel; skips with the build's reason where
it does not build); pallas_tpu (TPU interpret mode off TPU); pallas_gpu (interpret=True off
GPU); triton: its @triton.jit kernel under Triton's CPU interpreter on torch
tensors when TRITON_INTERPRET=1 (set here, before kernels.triton is first imported), or real
jax_triton launches on a GPU run with TRITON_INTERPRET=0 (experiments/gpu_check.sh).

Every case (CASES) holds random K/V that are never zero (a dropped term always shows), block
tables drawn from a shuffled pool with spare blocks no sequence owns, padding entries pointing at
the null block 0, and (but for the single-sequence case) one batch with the lengths 0, 1, bs-1,
bs, bs+1 and the maximum. The
expected output comes from a float64 NumPy oracle that shares no code (and no compiler) with the
paths; the oracle itself is checked on a hand-computed case. Quantized cases carry int8 /
float8_e4m3fn codes with float16 scales [L, N, Hkv, bs], made the way the engine's pool makes
them (pagedjax/device/kv_quant.py: absmax / qmax rounded to float16, codes from that scale), and
pass them the way the engine does (the whole stacked pool with `layer=`). The isolation test
refills the null block, unowned blocks, past-length slots (and their scales) and the pool's
other layers with NaN, inf or 1e30, and requires the same output.

Tolerances (absolute, outputs of magnitude ~1), by output dtype (q's): float32 2e-5 (float32
accumulation in a different order; the oracle dequantizes the very codes and float16 scales the
kernels read, so quantized cases are held to it too); bfloat16 2e-2 (the output is rounded to
bfloat16: one ulp at 2-4 is 1.6e-2).

Speed: an interpret-mode call costs about a second to compile per shape signature but a fraction
of that to run again, and the kernels' jit caches live as long as the process. So the cases are
few and small, each case's arrays are built once (`case()` caches them), and the isolation and
layer tests reuse a case's shapes: they only run, never compile.
"""
import dataclasses
import functools
import importlib
import math
import os
import shutil
import subprocess
import sys
import textwrap
import zlib

# Before kernels.triton can be imported: Triton decides when the kernel is decorated.
os.environ.setdefault('TRITON_INTERPRET', '1')

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

from pagedjax import kernels  # pylint: disable=wrong-import-position
from pagedjax.kernels import contract  # pylint: disable=wrong-import-position
from pagedjax.kernels import paged_attention  # pylint: disable=wrong-import-position

PATHS = kernels.IMPLS  # reference, xla, cpu, pallas_tpu, pallas_gpu, triton
TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARG_NAMES = ('q', 'k_blocks', 'v_blocks', 'block_tables', 'context_lens', 'q_positions')


# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Spec:
  """One conformance case. kv_dtype: the blocks' (int8 / float8_e4m3fn with float16 scales);
  layers: None for single-layer blocks, else a stacked pool of that many layers (all random)
  read at layer `layers - 1` (the isolation variant fills the others with poison); splits: the
  context_splits passed to every path that has them (None: each path's default)."""
  name: str
  block_size: int = 16
  group: int = 4
  head_dim: int = 64
  num_q: int = 1
  num_kv_heads: int = 2
  max_blocks: int = 3
  q_dtype: str = 'float32'
  kv_dtype: str = 'float32'
  layers: int = None
  splits: int = None
  lengths: tuple = None  # default: 0, 1, bs-1, bs, bs+1, bs * max_blocks
  scale: float = None  # the softmax scale passed (None: the paths' default, 1/sqrt(head_dim))
  poison: float = np.nan  # what test_isolation fills the unreadable slots with


CASES = [
    # float32 queries over a bfloat16 pool; GQA 8 over large blocks.
    Spec('decode_bf16kv_bs128_g8', block_size=128, group=8, kv_dtype='bfloat16'),
    # Blocks of 8: the GPU kernels' multiply-and-reduce branch (a dot needs 16); GQA 3; a prefill
    # chunk with a padded query; a 3-layer pool.
    Spec('prefill_f32_bs8_g3_stacked', block_size=8, group=3, num_q=3, layers=3, poison=np.inf),
    # bfloat16 throughout; 16 rows (T*G): xla's dot branch; one KV head; head_dim 128.
    Spec('prefill_bf16_d128_g8_stacked', block_size=32, group=8, head_dim=128, num_q=2,
         num_kv_heads=1, q_dtype='bfloat16', kv_dtype='bfloat16', layers=2, poison=1e30),
    # The engine's int8 call: the stacked pool, float16 scales, `layer=`.
    Spec('decode_int8_stacked', kv_dtype='int8', layers=2),
    Spec('prefill_fp8_bs8_g2', block_size=8, group=2, num_q=8, kv_dtype='float8_e4m3fn',
         poison=np.inf),
    # Context splits: 7 blocks in 3 splits of 3, 3 and 1, so the last split of the longest
    # sequence runs short and the later splits of the short sequences see nothing.
    # One KV head: interpreting the TPU kernel costs per grid point (B x Hkv x S x blocks).
    Spec('split3_prefill_int8_stacked', max_blocks=7, num_q=3, splits=3, num_kv_heads=1,
         kv_dtype='int8', layers=2),
    # One long sequence, one head (MHA, G = 1), a given softmax scale: every path's default
    # split cuts this context in 2 (xla: fewer sequences than loops; pallas_tpu: fewer programs
    # than TensorCores; GPU paths: 7 blocks of 64 are 2 splits of at least 256 tokens), the
    # second split runs short.
    Spec('one_sequence_mha_default_splits', block_size=64, group=1, num_kv_heads=1,
         max_blocks=7, lengths=(427,), scale=0.3, poison=1e30),
]
SPECS = {spec.name: spec for spec in CASES}
QUANT = ('int8', 'float8_e4m3fn')


def f32(x):
  """Any array (bfloat16 / float8 included, via ml_dtypes) as float32 NumPy, without a trip
  through XLA: eager jnp conversions compile one small program per shape and dtype."""
  return np.asarray(x).astype(np.float32)


def nonzero(rng, shape):
  """Uniform on +-[0.5, 1.5]: never zero, so a dropped term always shows."""
  return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 1.5, shape)


def quantize(x, dtype):
  """x [..., D] float32 -> (codes, float16 scales [...]) as pagedjax/device/kv_quant.py makes
  them: scale = absmax / qmax rounded to float16, codes = x / that scale."""
  qmax = 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
  scale = np.maximum(np.abs(x).max(axis=-1) / qmax, 1e-8).astype(np.float16)
  scaled = x / scale.astype(np.float32)[..., None]
  codes = np.clip(np.round(scaled), -127, 127) if dtype == jnp.int8 else scaled
  return jnp.asarray(codes.astype(dtype)), jnp.asarray(scale)


def build(spec, seed, lengths=None):
  """A case's arguments (by contract name) plus its `layer` and `splits`."""
  rng = np.random.default_rng(seed)
  bs, mb = spec.block_size, spec.max_blocks
  lengths = lengths or spec.lengths or (0, 1, bs - 1, bs, bs + 1, bs * mb)
  batch = len(lengths)
  num_blocks = 1 + batch * mb + 3  # the null block, every sequence's, and 3 nobody owns
  perm = rng.permutation(np.arange(1, num_blocks))
  block_tables = np.zeros((batch, mb), np.int32)
  for b, length in enumerate(lengths):
    used = -(-length // bs)
    block_tables[b, :used] = perm[b * mb: b * mb + used]
  context_lens = np.array(lengths, np.int32)
  # The chunk's queries are the last num_q positions; earlier-than-0 ones are padding (-1), and
  # in a prefill chunk the last query of sequence 1 is padding too (a short chunk in a bucket).
  q_positions = context_lens[:, None] - spec.num_q + np.arange(spec.num_q)[None, :]
  q_positions = np.where(q_positions < 0, -1, q_positions).astype(np.int32)
  if spec.num_q > 1:
    q_positions[1, -1] = -1
  layers = spec.layers or 1
  shape = (layers, num_blocks, spec.num_kv_heads, bs, spec.head_dim)
  q = nonzero(rng, (batch, spec.num_q, spec.num_kv_heads * spec.group, spec.head_dim))
  out = dict(q=jnp.asarray(q.astype(jnp.dtype(spec.q_dtype))),
             block_tables=jnp.asarray(block_tables), context_lens=jnp.asarray(context_lens),
             q_positions=jnp.asarray(q_positions))
  for side in ('k', 'v'):
    x = nonzero(rng, shape).astype(np.float32)
    if spec.kv_dtype in QUANT:
      out[f'{side}_blocks'], out[f'{side}_scales'] = quantize(x, jnp.dtype(spec.kv_dtype))
    else:
      out[f'{side}_blocks'] = jnp.asarray(x.astype(jnp.dtype(spec.kv_dtype)))
  if spec.layers is None:  # single-layer blocks: drop the stack of one
    out.update({n: out[n][0] for n in ('k_blocks', 'v_blocks', 'k_scales', 'v_scales')
                if n in out})
  out['layer'] = None if spec.layers is None else spec.layers - 1
  out['splits'] = spec.splits
  out['scale'] = spec.scale
  return out


@functools.lru_cache(maxsize=None)
def case(name):
  """CASES[name]'s arguments and the oracle's output, built once per session."""
  args = build(SPECS[name], zlib.crc32(name.encode()))
  return args, oracle(args)


def at_layer(args, layer):
  """The same case read at another layer of its stacked pool."""
  return dict(args, layer=layer)


def poison(args, value):
  """The case with `value` wherever no query may look: the null block, blocks no sequence owns,
  slots past each length, every layer but the one read, and the scales of all those slots.
  int8 codes hold no NaN/inf (they get -128), float8_e4m3fn has no inf (NaN); float16 scales
  turn 1e30 into inf."""
  layer = args['layer']
  stacked = layer is not None
  tables, lens = np.asarray(args['block_tables']), np.asarray(args['context_lens'])
  out = dict(args)
  for name in ('k_blocks', 'v_blocks', 'k_scales', 'v_scales'):
    if name not in args:
      continue
    x = f32(args[name])
    x = x if stacked else x[None]
    read = x[0 if layer is None else layer]  # a view: poisoned in place below
    bs = read.shape[2]
    owned = np.zeros(read.shape[0], bool)
    for b, length in enumerate(lens):
      used = -(-int(length) // bs)
      owned[tables[b, :used]] = True
      if length % bs:
        read[tables[b, used - 1], :, length % bs:] = np.nan  # marker, replaced below
    read[~owned] = np.nan
    others = np.ones(x.shape[0], bool)
    others[0 if layer is None else layer] = False
    x[others] = np.nan
    dtype = args[name].dtype
    bad = value if 'scales' in name else (
        -128.0 if dtype == jnp.int8 else np.nan if dtype == jnp.float8_e4m3fn else value)
    x = np.where(np.isnan(x), bad, x)
    out[name] = jnp.asarray((x if stacked else x[0]).astype(dtype))
  return out


def oracle(args):
  """float64 NumPy attention over the layer read, from the contract alone (kernels/contract.py):
  query t of sequence b sees positions < min(q_positions + 1, context_lens)."""
  f64 = lambda name: f32(args[name]).astype(np.float64)
  layer = args['layer']
  pick = (lambda x: x) if layer is None else (lambda x: x[layer])
  k, v = pick(f64('k_blocks')), pick(f64('v_blocks'))
  if 'k_scales' in args:
    k, v = k * pick(f64('k_scales'))[..., None], v * pick(f64('v_scales'))[..., None]
  q = f64('q')
  tables, lens = np.asarray(args['block_tables']), np.asarray(args['context_lens'])
  positions = np.asarray(args['q_positions'])
  batch, num_q, num_heads, head_dim = q.shape
  num_kv_heads, bs = k.shape[1], k.shape[2]
  out = np.zeros_like(q)
  for b in range(batch):
    for t in range(num_q):
      slots = np.arange(min(positions[b, t] + 1, lens[b]))
      if not slots.size:
        continue  # sees nothing: zeros
      for h in range(num_heads):
        kv_head = h // (num_heads // num_kv_heads)
        kk = k[tables[b, slots // bs], kv_head, slots % bs]
        vv = v[tables[b, slots // bs], kv_head, slots % bs]
        s = kk @ q[b, t, h] * (head_dim ** -0.5 if args['scale'] is None else args['scale'])
        p = np.exp(s - s.max())
        out[b, t, h] = p @ vv / p.sum()
  return out


# ------------------------------------------------------------------------------------------------
# Running a path
# ------------------------------------------------------------------------------------------------
def triton_interpreted():
  from pagedjax.kernels import triton as kt  # pylint: disable=import-outside-toplevel
  from triton.runtime.interpreter import InterpretedFunction  # pylint: disable=import-outside-toplevel
  return isinstance(kt._kernel, InterpretedFunction)  # pylint: disable=protected-access


def triton_launcher():
  """kernels.triton's launcher for this process: the interpreter on torch CPU tensors
  (launch_torch) where the kernel is interpreted, else jax_triton (a GPU); skips with the reason
  when neither can run."""
  pytest.importorskip('triton', reason='triton not installed (requirements-kernels.txt)')
  from pagedjax.kernels import triton as kt  # pylint: disable=import-outside-toplevel
  if triton_interpreted():
    pytest.importorskip('torch', reason='the Triton interpreter runs on torch CPU tensors')
    return kt.launch_torch
  if jax.default_backend() != 'gpu':
    pytest.skip('kernels.triton was imported without TRITON_INTERPRET=1 and there is no GPU')
  pytest.importorskip('jax_triton', reason='jax_triton launches need jax_triton and a GPU')
  return kt.paged_attention_triton


def require_cpu_kernel():
  """Skips with the build's reason where the native CPU kernel does not build or load."""
  from pagedjax.kernels import cpu  # pylint: disable=import-outside-toplevel
  if jax.default_backend() != 'cpu':
    pytest.skip(f'the cpu path runs on the CPU backend, not {jax.default_backend()}')
  if not cpu.available():
    pytest.skip(f'the native CPU kernel is unavailable: {cpu.unavailable_reason()}')


def wrapper(path):
  """The path's own wrapper, which takes context_splits (the dispatcher does not)."""
  if path == 'triton':
    return triton_launcher()
  return getattr(importlib.import_module(f'pagedjax.kernels.{path}'), f'paged_attention_{path}')


def run(path, args, **kwargs):
  """The path on a case's arguments -> float32 numpy [B, T, Hq, D]. Through the dispatcher
  (how the engine calls) unless the case sets context_splits or the path is triton (the
  interpreter's launcher is not a dispatcher target)."""
  if path == 'cpu':
    require_cpu_kernel()
  call_args = [args[n] for n in ARG_NAMES]
  kwargs.update({n: args[n] for n in ('k_scales', 'v_scales') if n in args})
  if args['layer'] is not None:
    kwargs['layer'] = jnp.int32(args['layer'])  # traced inside the kernels' jit, as in the model
  if args['scale'] is not None:
    kwargs['scale'] = args['scale']
  if path == 'triton' or (args['splits'] is not None and path != 'reference'):
    out = wrapper(path)(*call_args, context_splits=args['splits'], **kwargs)
  else:
    out = paged_attention(*call_args, impl=path, **kwargs)
  return f32(out)


def assert_close(got, want, q_dtype):
  got = f32(got)
  assert np.all(np.isfinite(got)), 'non-finite output'
  np.testing.assert_allclose(got, want, atol=TOL[jnp.dtype(q_dtype)], rtol=0)


# ------------------------------------------------------------------------------------------------
# The oracle, and the reference, by hand
# ------------------------------------------------------------------------------------------------
def hand_case():
  """One query over 3 tokens split across two shuffled blocks; NaN everywhere else."""
  k_tokens = [[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]]
  v_tokens = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
  k = np.full((3, 1, 2, 2), np.nan, np.float32)  # block 0 (null) stays NaN
  v = np.full((3, 1, 2, 2), np.nan, np.float32)
  # Logical block 0 lives in physical block 2, logical block 1 in physical block 1.
  k[2, 0], v[2, 0] = k_tokens[:2], v_tokens[:2]
  k[1, 0, 0], v[1, 0, 0] = k_tokens[2], v_tokens[2]  # slot 1 of it stays NaN
  # q = (sqrt 2, 0): with the default scale 1/sqrt(D = 2), the scores q.k are 1, 0, 2.
  args = dict(q=jnp.asarray([[[[math.sqrt(2.0), 0.0]]]], jnp.float32), k_blocks=jnp.asarray(k),
              v_blocks=jnp.asarray(v), block_tables=jnp.asarray([[2, 1]], jnp.int32),
              context_lens=jnp.asarray([3], jnp.int32), q_positions=jnp.asarray([[2]], jnp.int32),
              layer=None, splits=None, scale=None)
  e = [math.e ** 1, math.e ** 0, math.e ** 2]
  want = [sum(w * v[i] for w, v in zip(e, v_tokens)) / sum(e) for i in range(2)]
  return args, np.array(want).reshape(1, 1, 1, 2)


def test_oracle_and_reference_hand_computed():
  args, want = hand_case()
  np.testing.assert_allclose(oracle(args), want, rtol=1e-7)  # sqrt(2) rounded to float32
  np.testing.assert_allclose(run('reference', args), want, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# Conformance: every path, every case
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name', SPECS)
@pytest.mark.parametrize('path', PATHS)
def test_matches_oracle(path, name):
  args, want = case(name)
  assert_close(run(path, args), want, SPECS[name].q_dtype)


# Triton's interpreter runs the kernel in NumPy, which warns when the poison meets arithmetic
# whose result the kernel then masks out.
@pytest.mark.filterwarnings('ignore:invalid value:RuntimeWarning')
@pytest.mark.parametrize('name', SPECS)
@pytest.mark.parametrize('path', PATHS)
def test_isolation(path, name):
  """NaN / inf / 1e30 where no query may look must not change the output (same compile)."""
  args, want = case(name)
  poisoned = poison(args, SPECS[name].poison)
  for n in ('k_blocks', 'v_scales'):  # the poison took (NaN compares unequal, as it should)
    if n in args:
      assert not np.array_equal(f32(poisoned[n]), f32(args[n]))
  assert_close(run(path, poisoned), want, SPECS[name].q_dtype)


@pytest.mark.parametrize('name', ['prefill_f32_bs8_g3_stacked', 'decode_int8_stacked'])
@pytest.mark.parametrize('path', PATHS)
def test_reads_each_layer(path, name):
  """Every layer of a stacked pool (first, middle, last: a wrong layer stride shows), each
  against the oracle of that layer; the conformance test reads only the last."""
  args, _ = case(name)
  for layer in range(SPECS[name].layers - 1):
    assert_close(run(path, at_layer(args, layer)), oracle(at_layer(args, layer)),
                 SPECS[name].q_dtype)


# ------------------------------------------------------------------------------------------------
# Contract helpers
# ------------------------------------------------------------------------------------------------
def test_merge_split_states_hand_computed():
  """merge_split_states on states computed here in NumPy: three key ranges of very different
  score scales (so each split's weight exp(m - max m) matters; dropping it is off by far more
  than the tolerance) and a fourth that saw nothing (m = -inf); a row that saw nothing gets 0."""
  rng = np.random.default_rng(26)
  s = rng.normal(size=(2, 12)) * np.array([1.0] * 4 + [8.0] * 4 + [0.1] * 4)  # [R, keys]
  v = rng.normal(size=(12, 3))
  acc, m, l = [], [], []
  for lo, hi in [(0, 4), (4, 8), (8, 12), (12, 12)]:
    part = s[:, lo:hi]
    mx = part.max(axis=1) if hi > lo else np.full(2, -np.inf)
    p = np.exp(part - mx[:, None]) if hi > lo else np.zeros((2, 0))
    acc.append(p @ v[lo:hi]), m.append(mx), l.append(p.sum(axis=1))
  stack = lambda x: np.stack(x).astype(np.float32)
  merge = jax.jit(contract.merge_split_states)
  got = merge(stack(acc), stack(m), stack(l))
  p = np.exp(s - s.max(axis=1, keepdims=True))
  np.testing.assert_allclose(np.asarray(got), (p @ v) / p.sum(axis=1, keepdims=True),
                             atol=1e-5, rtol=0)
  # The same shapes (one compile): every split saw nothing.
  nothing = merge(np.zeros((4, 2, 3), np.float32), np.full((4, 2), -np.inf, np.float32),
                  np.zeros((4, 2), np.float32))
  np.testing.assert_array_equal(np.asarray(nothing), np.zeros((2, 3)))


def test_row_grouping_by_hand():
  """Rows of a KV group are ordered (t, g), padded rows trail and see nothing; ungroup_rows
  inverts group_rows. (One jit: eager, every small op would compile on its own.)"""
  @jax.jit
  def helpers(q, positions, lens):
    rows = contract.group_rows(q, 2, rows_to=16)  # Hkv 2, G 2: R = 6, padded to 16
    seen = contract.tokens_seen(positions, lens)
    return (rows, contract.ungroup_rows(rows, 3, 4), seen,
            contract.rows_seen(seen, 2, rows_to=8), contract.visible_blocks(seen, 4, 3))

  q = np.arange(2 * 3 * 4 * 1, dtype=np.float32).reshape(2, 3, 4, 1)  # B2 T3 Hq4 D1
  rows, back, seen, per_row, counts = helpers(q, np.array([[4, 5, -1]], np.int32),
                                              np.array([5], np.int32))
  assert rows.shape == (2, 2, 16, 1)
  # KV head 1 of sequence 0: heads 2, 3 of tokens 0, 1, 2.
  np.testing.assert_array_equal(rows[0, 1, :6, 0], [2, 3, 6, 7, 10, 11])
  np.testing.assert_array_equal(rows[:, :, 6:], 0)
  np.testing.assert_array_equal(back, q)
  np.testing.assert_array_equal(seen, [[5, 5, 0]])  # position 4 of 5 tokens, 5 (clipped), pad
  np.testing.assert_array_equal(per_row, [[5, 5, 5, 5, 0, 0, 0, 0]])
  np.testing.assert_array_equal(counts, [2])  # 5 tokens in blocks of 4
  assert [contract.gpu_rows(r) for r in (1, 16, 17, 24)] == [16, 16, 32, 32]


def test_gpu_default_splits(monkeypatch):
  """About two programs per SM (132 when the device reports none), at least 256 tokens a split,
  never more splits than blocks; explicit counts are trimmed so that no split is empty."""
  default = contract.default_gpu_splits
  assert default(1, 8, 64, 16) == 4  # 33 wanted for 264 programs; 64 blocks of 16 = 4 x 256
  assert default(1, 8, 1024, 16) == 33
  assert default(4, 2, 1024, 16) == 33
  assert default(64, 8, 1024, 16) == 1  # 512 programs already fill the GPU
  assert default(1, 8, 8, 16) == 1  # 128 tokens: too short to split
  assert default(1, 1, 4, 256) == 4  # one block is already 256 tokens
  gpu = type('FakeGpu', (), dict(platform='gpu', core_count=16))()
  monkeypatch.setattr(contract.jax, 'devices', lambda: [gpu])
  assert default(1, 8, 1024, 16) == 4  # a GPU device's core_count replaces the 132
  monkeypatch.undo()
  assert contract.split_count(5, 1, 1, 7, 16) == 4  # 7 blocks in 5 splits: 4 of 2, 2, 2, 1
  assert contract.split_count(9, 1, 1, 7, 16) == 7
  assert contract.split_count(None, 1, 8, 64, 16) == 4
  assert contract.split_count(3, 1, 1, 1, 16) == 1
  assert contract.split_count(None, 1, 1, 7, 64) == 2  # one_sequence_mha_default_splits


# ------------------------------------------------------------------------------------------------
# Validation: ValueError naming the bad value and what is allowed, from every path
# ------------------------------------------------------------------------------------------------
def bad_inputs():
  """(what to change, the message it must raise), on a quantized stacked case."""
  args, _ = case('decode_int8_stacked')
  float_args = dict(args, k_blocks=jnp.asarray(f32(args['k_blocks'])),
                    v_blocks=jnp.asarray(f32(args['v_blocks'])))
  del float_args['k_scales'], float_args['v_scales']
  no_scales = {n: v for n, v in args.items() if 'scales' not in n}
  return [
      (dict(args, q=args['q'][..., :32]), "head_dim 32 != the blocks' head_dim 64"),
      (dict(args, context_lens=args['context_lens'][:-1]), r'context_lens must be \[B=6\]'),
      (dict(args, q_positions=jnp.asarray(np.asarray(args['q_positions'], np.int16))),
       'q_positions must be int32, got int16'),
      (no_scales, 'int8 blocks need k_scales and v_scales'),
      (dict(float_args, k_scales=args['k_scales'], v_scales=args['v_scales']),
       'scales given but the blocks are float32'),
      (dict(args, k_scales=jnp.asarray(np.asarray(args['k_scales'], np.int32))),
       r"scales must be one of \['float16', 'bfloat16', 'float32'\], got int32"),
      (dict(args, v_scales=args['v_scales'][..., :8]), r'one per \(token, KV head\)'),
      (dict(args, k_blocks=args['k_blocks'][0], v_blocks=args['v_blocks'][0],
            k_scales=args['k_scales'][0], v_scales=args['v_scales'][0]),
       r'with layer=, k_blocks must be a layer-stacked pool \[L, N, Hkv, bs, D\]'),
  ]


@pytest.mark.parametrize('path', PATHS)
def test_bad_inputs_raise_value_error(path):
  for args, message in bad_inputs():
    with pytest.raises(ValueError, match=message):
      run(path, args)


@pytest.mark.parametrize('path', ['xla', 'cpu', 'pallas_tpu', 'pallas_gpu', 'triton'])
def test_bad_context_splits_raise_value_error(path):
  args, _ = case('split3_prefill_int8_stacked')
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match=f'context_splits must be None or an int >= 1, got '
                                         f'{bad!r}'):
      run(path, dict(args, splits=bad))


@pytest.mark.parametrize('path', ['pallas_gpu', 'triton'])
def test_gpu_paths_refuse_block_shapes_that_are_no_power_of_two(path):
  spec = dataclasses.replace(SPECS['decode_bf16kv_bs128_g8'], block_size=12, max_blocks=2)
  with pytest.raises(ValueError, match=f'{path} needs block_size and head_dim to be powers of '
                                       'two .* got block_size=12, head_dim=64'):
    run(path, build(spec, 0))


def test_unknown_impl_raises():
  args, _ = case('decode_bf16kv_bs128_g8')
  with pytest.raises(ValueError, match="'cuda_magic' is not one of .*'xla'.*'auto'"):
    run('cuda_magic', args)


# ------------------------------------------------------------------------------------------------
# Dispatcher: impl='auto'
# ------------------------------------------------------------------------------------------------
def test_auto_picks_a_native_path(monkeypatch):
  """On CPU, auto is the native kernel where it builds (here it must: g++ is installed; a
  machine without a compiler skips) and xla where it does not."""
  from pagedjax.kernels import cpu  # pylint: disable=import-outside-toplevel
  assert kernels.best_impl('tpu') == 'pallas_tpu'
  assert kernels.best_impl('gpu') == 'pallas_gpu'
  assert not kernels.runs_on('cpu', 'gpu')
  args, want = case('decode_bf16kv_bs128_g8')
  if jax.default_backend() == 'cpu':
    require_cpu_kernel()
    assert kernels.best_impl('cpu') == 'cpu' and kernels.runs_on('cpu')
    called = spy_on(monkeypatch, 'cpu', 'xla')
    assert_close(run('auto', args), want, jnp.float32)
    assert called == ['cpu']
    monkeypatch.setattr(cpu, 'available', lambda: False)  # as when the build fails
    assert kernels.best_impl('cpu') == 'xla' and not kernels.runs_on('cpu')
    assert_close(run('auto', args), want, jnp.float32)
    assert called == ['cpu', 'xla']
  else:
    assert_close(run('auto', args), want, jnp.float32)


def spy_on(monkeypatch, *paths):
  """Records which wrappers the dispatcher calls (it looks them up at call time)."""
  called = []
  for path in paths:
    module = importlib.import_module(f'pagedjax.kernels.{path}')
    fn = getattr(module, f'paged_attention_{path}')
    def wrapped(*a, _fn=fn, _path=path, **kw):
      called.append(_path)
      return _fn(*a, **kw)
    monkeypatch.setattr(module, f'paged_attention_{path}', wrapped)
  return called


def test_auto_on_gpu_falls_back_where_the_gpu_kernel_does_not_reach(monkeypatch):
  """head_dim 12 (the tiny test models) is no power of two: 'auto' must not pick pallas_gpu."""
  monkeypatch.setattr(kernels, 'best_impl', lambda backend=None: 'pallas_gpu')
  called = spy_on(monkeypatch, 'pallas_gpu', 'xla')
  spec = dataclasses.replace(SPECS['decode_bf16kv_bs128_g8'], head_dim=12, block_size=8)
  args = build(spec, 44)
  assert_close(run('auto', args), oracle(args), jnp.float32)
  assert called == ['xla']


@pytest.mark.parametrize('name,fp8_ok,want', [('decode_int8_stacked', False, 'pallas_gpu'),
                                              ('prefill_fp8_bs8_g2', True, 'pallas_gpu'),
                                              ('prefill_fp8_bs8_g2', False, 'xla')])
def test_auto_on_gpu_takes_quantized_pools(monkeypatch, name, fp8_ok, want):
  """pallas_gpu dequantizes in-kernel, so 'auto' keeps quantized pools on it, except fp8 on a GPU
  older than sm_89, where Triton cannot convert float8_e4m3fn."""
  monkeypatch.setattr(kernels, 'best_impl', lambda backend=None: 'pallas_gpu')
  monkeypatch.setattr(kernels, 'gpu_converts_fp8', lambda: fp8_ok)
  called = spy_on(monkeypatch, 'pallas_gpu', 'xla')
  args, expected = case(name)
  assert_close(run('auto', args), expected, jnp.float32)
  assert called == [want]


# ------------------------------------------------------------------------------------------------
# The CPU paths (xla, cpu), at the shapes and the way the engine runs them
# ------------------------------------------------------------------------------------------------
CPU_PATHS = ('xla', 'cpu')
# (block_size, group, head_dim, num_q, dtype) beyond CASES: block sizes 64-256, T*G of 4-32 rows
# on both sides of xla's dot threshold (16); a float16 pool (no case has one).
XLA_SHAPES = [(64, 4, 64, 8, 'float32'), (128, 8, 128, 3, 'float32'), (256, 4, 64, 1, 'bfloat16'),
              (32, 2, 64, 2, 'float16')]


@pytest.mark.parametrize('path', CPU_PATHS)
@pytest.mark.parametrize('block_size,group,head_dim,num_q,dtype', XLA_SHAPES)
def test_xla_block_sizes(path, block_size, group, head_dim, num_q, dtype):
  q_dtype = 'float32' if dtype == 'float16' else dtype
  spec = Spec('xla', block_size=block_size, group=group, head_dim=head_dim, num_q=num_q,
              q_dtype=q_dtype, kv_dtype=dtype)
  args = build(spec, block_size + group)
  assert_close(run(path, args), oracle(args), q_dtype)


@pytest.mark.parametrize('path', CPU_PATHS)
def test_xla_at_benchmark_scale(path):
  """Near the benchmark's shape (where XLA CPU picks its fusions): XLA's YNNPACK fusions once
  miscompiled a scan formulation to a max error of 4. For cpu: 16 (sequence, KV head) tasks
  over every thread, lengths from 0 to the table's end."""
  spec = Spec('bench', block_size=64, num_kv_heads=8, max_blocks=16)
  args = build(spec, 7, lengths=(1024, 1000, 64, 0, 513, 1024, 7, 960))
  assert_close(run(path, args), oracle(args), jnp.float32)


@pytest.mark.parametrize('path', CPU_PATHS)
def test_xla_inside_layer_scan_under_jit(path):
  """How the model calls it: a lax.scan over layer indices inside a jitted step, the whole
  quantized pool (float16 scales) passed with the traced layer."""
  if path == 'cpu':
    require_cpu_kernel()
  args, _ = case('decode_int8_stacked')
  layers = SPECS['decode_int8_stacked'].layers

  @jax.jit
  def step(q):
    def one_layer(x, layer):
      out = paged_attention(x, args['k_blocks'], args['v_blocks'], args['block_tables'],
                            args['context_lens'], args['q_positions'], impl=path, layer=layer,
                            k_scales=args['k_scales'], v_scales=args['v_scales'])
      return x + out, None
    return jax.lax.scan(one_layer, q, jnp.arange(layers))[0]

  want = np.asarray(args['q'], np.float64)
  for layer in range(layers):
    want = want + oracle(dict(at_layer(args, layer), q=jnp.asarray(want, jnp.float32)))
  np.testing.assert_allclose(np.asarray(step(args['q'])), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize('batch', [31, 64])
def test_xla_decode_batch_loops(batch):
  """Decode batches below 2 * MIN_LOOP_ROWS sequences run as one loop, larger ones as two
  batch slices (each stopping at its own longest context): both against the oracle, lengths
  mixed so the two slices' trip counts differ, small blocks and heads to stay quick."""
  from pagedjax.kernels import xla_loops  # pylint: disable=g-import-not-at-top
  assert len(xla_loops.batch_bounds(batch, 1)) - 1 == (1 if batch < 64 else 2)
  rng = np.random.default_rng(batch)
  lengths = tuple(int(n) for n in rng.integers(0, 4 * 8 + 1, batch))
  spec = Spec('loops', block_size=8, group=2, head_dim=16, num_kv_heads=1, max_blocks=4)
  args = build(spec, batch, lengths=lengths)
  assert_close(run('xla', args), oracle(args), jnp.float32)


def test_xla_gathers_blocks_straight_into_token_order():
  """The loop's gather (one row per (layer, block, KV head)) gives what gathering whole blocks
  and moving the KV-head axis in front gives, for values [L, N, Hkv, bs, D] and per-token scales
  [L, N, Hkv, bs], at a traced layer, with repeated and null-block entries."""
  from pagedjax.kernels import xla  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  values = rng.standard_normal((3, 7, 2, 4, 5)).astype(np.float32)
  scales = rng.standard_normal((3, 7, 2, 4)).astype(np.float16)
  block = np.array([[4, 0, 6], [1, 1, 3]], np.int32)  # [B, C]
  gather = jax.jit(xla._gather_tokens)  # pylint: disable=protected-access
  for x in (values, scales):
    got = gather(jnp.asarray(x), jnp.int32(2), jnp.asarray(block))
    want = np.moveaxis(x[2][block], 2, 1)  # [B, Hkv, C, bs, ...]
    want = want.reshape(2, 2, 3 * 4, *x.shape[4:])
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(got), want)


def test_cpu_splits_its_own_context():
  """One sequence of 2 KV heads (2 tasks for the machine's threads): the kernel's default
  splits the 2048-token context (at least 256 tokens a split); explicit counts from 1 to more
  splits than blocks (the surplus splits see nothing and weigh 0) all give the oracle's output."""
  require_cpu_kernel()
  from pagedjax.kernels import cpu  # pylint: disable=import-outside-toplevel
  spec = Spec('cpu_splits', block_size=64, group=3, max_blocks=33, lengths=(2048,))
  args = build(spec, 5)
  want = oracle(args)
  for splits in (None, 1, 5, 40):
    assert_close(run('cpu', dict(args, splits=splits)), want, jnp.float32)
  assert cpu.uses_avx2() in (True, False)


@pytest.mark.parametrize('kv_dtype', ['bfloat16', 'int8'])
def test_cpu_register_widening_in_tiles_of_one_and_two_rows(kv_dtype):
  """bfloat16 and int8 blocks are widened in registers as they are loaded (bfloat16: the head
  dim in the even/odd order the kernel keeps q and acc in): groups of 1, 2 and 3 rows (score
  tiles of one and two rows, 3 = 2 + 1) at head_dim 128 and 64, decode and a prefill chunk,
  against the oracle and with NaN (int8: -128 codes) wherever no query may look."""
  require_cpu_kernel()
  for group, head_dim, num_q in ((1, 128, 1), (2, 64, 1), (3, 64, 2)):
    spec = Spec('cpu_register_widening', group=group, head_dim=head_dim, num_q=num_q,
                kv_dtype=kv_dtype)
    args = build(spec, group)
    want = oracle(args)
    assert_close(run('cpu', args), want, jnp.float32)
    assert_close(run('cpu', poison(args, np.nan)), want, jnp.float32)


def oracle_lse(args):
  """float64 log-sum-exp of each query row's scaled scores over what it sees (-inf: nothing)."""
  f64 = lambda name: f32(args[name]).astype(np.float64)
  layer = args['layer']
  k = f64('k_blocks') if layer is None else f64('k_blocks')[layer]
  if 'k_scales' in args:
    k = k * (f64('k_scales') if layer is None else f64('k_scales')[layer])[..., None]
  q, tables = f64('q'), np.asarray(args['block_tables'])
  lens, positions = np.asarray(args['context_lens']), np.asarray(args['q_positions'])
  batch, num_q, num_heads, head_dim = q.shape
  scale = head_dim ** -0.5 if args['scale'] is None else args['scale']
  group, bs = num_heads // k.shape[1], k.shape[2]
  lse = np.full((batch, num_q, num_heads), -np.inf)
  for b in range(batch):
    for t in range(num_q):
      slots = np.arange(min(positions[b, t] + 1, lens[b]))
      for h in range(num_heads if slots.size else 0):
        s = k[tables[b, slots // bs], h // group, slots % bs] @ q[b, t, h] * scale
        lse[b, t, h] = s.max() + np.log(np.exp(s - s.max()).sum())
  return lse


@pytest.mark.parametrize('name', ['prefill_f32_bs8_g3_stacked', 'split3_prefill_int8_stacked',
                                  'one_sequence_mha_default_splits'])
def test_cpu_log_sum_exp_matches_the_oracle(name):
  """The kernel's second result, each query row's log-sum-exp (the streamed path merges spans
  with it), at one split, at the case's own and at more splits than blocks; a padded query
  (seeing nothing) gets -inf. Its output is the oracle's as in every other call."""
  require_cpu_kernel()
  from pagedjax.kernels import cpu  # pylint: disable=import-outside-toplevel
  args, want = case(name)
  want_lse = oracle_lse(args)
  kwargs = {n: args[n] for n in ('k_scales', 'v_scales') if n in args}
  if args['layer'] is not None:
    kwargs['layer'] = jnp.int32(args['layer'])
  for splits in (1, args['splits'], 9):
    out, lse = cpu.paged_attention_cpu_lse(*[args[n] for n in ARG_NAMES], scale=args['scale'],
                                           context_splits=splits, **kwargs)
    assert_close(out, want, jnp.float32)
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
    np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], atol=2e-5, rtol=1e-6)


def test_cpu_refuses_block_ids_and_layers_outside_the_pool():
  """The kernel checks every block id it would read, and the (traced) layer, against the pool,
  and fails the call naming them, rather than reading outside the pool."""
  require_cpu_kernel()
  args, _ = case('decode_int8_stacked')
  tables = np.asarray(args['block_tables']).copy()
  tables[5, 2] = 10_000  # sequence 5 has the longest context: it reads all 3 of its blocks
  with pytest.raises(Exception, match=r'block_tables\[5, 2\] = 10000 is outside the pool'):
    run('cpu', dict(args, block_tables=jnp.asarray(tables)))
  with pytest.raises(Exception, match='layer 7 is outside the pool\'s 2 layers'):
    run('cpu', at_layer(args, 7))


def fake_compiler(tmp_path, compile_status):
  """A `$CXX` that reports a version and then fails (or passes) every compile."""
  script = tmp_path / 'fake-cxx'
  script.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo fake-cxx 1.0; exit 0; fi\n'
                    f'echo "fake-cxx: error: no such luck" >&2\nexit {compile_status}\n')
  script.chmod(0o755)
  return str(script)


def test_cpu_build_failures_name_the_compiler_and_its_error(tmp_path, monkeypatch):
  """No compiler, or one that fails: build() raises naming it (available() turns that into
  False and the reason; `auto` then stays on xla, see test_auto_picks_a_native_path), and no
  half-written library is left in the cache."""
  from pagedjax.kernels import cpu  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv('PAGEDJAX_KERNEL_CACHE', str(tmp_path / 'cache'))
  with pytest.raises(RuntimeError, match="no working C\\+\\+ compiler '/nonexistent/g\\+\\+'"):
    cpu.build('/nonexistent/g++')
  cxx = fake_compiler(tmp_path, 1)
  with pytest.raises(RuntimeError, match='failed \\(1\\): fake-cxx: error: no such luck'):
    cpu.build(cxx)
  assert not os.listdir(tmp_path / 'cache')


def test_build_command_builds_both_libraries_or_names_why_not(tmp_path, monkeypatch, capsys):
  """`python -m pagedjax.kernels.cpu` (.ci/run's install step) prints each library's path,
  the ones the kernels then load; with a failing compiler it names the error and exits 1."""
  from pagedjax.kernels import cpu, linear_cpu  # pylint: disable=import-outside-toplevel
  assert cpu.main() == 0
  lines = capsys.readouterr().out.splitlines()
  assert [line.split(': ')[0] for line in lines] == ['paged_attention_cpu', 'linear_cpu']
  paths = [line.split(': ', 1)[1] for line in lines]
  assert paths == [cpu.build(), cpu.build(stem='linear_cpu', sources=linear_cpu.SOURCES)]
  assert all(os.path.exists(p) for p in paths)
  monkeypatch.setenv('PAGEDJAX_KERNEL_CACHE', str(tmp_path / 'cache'))
  monkeypatch.setenv('CXX', fake_compiler(tmp_path, 1))
  assert cpu.main() == 1
  assert capsys.readouterr().out.count('not built: ') == 2


def test_cpu_library_is_cached_by_sources_compiler_and_jax(tmp_path, monkeypatch):
  """The library's name is a hash of the sources, flags, compiler, jax/jaxlib versions and the
  FFI headers it compiles against: another compiler, jax, jaxlib, or a jaxlib whose headers
  differ under the same version, is another file (never the library built for this one); a
  built one is reused (not rebuilt)."""
  require_cpu_kernel()
  import jaxlib  # pylint: disable=import-outside-toplevel
  from pagedjax.kernels import cpu  # pylint: disable=import-outside-toplevel
  path = cpu.library_path()
  assert os.path.exists(path) and path.startswith(cpu.cache_dir())
  mtime = os.path.getmtime(path)
  assert cpu.build() == path and os.path.getmtime(path) == mtime
  assert cpu.library_path(fake_compiler(tmp_path, 0)) != path
  headers = tmp_path / 'include'
  shutil.copytree(cpu.jax.ffi.include_dir(), headers)
  monkeypatch.setattr(cpu.jax.ffi, 'include_dir', lambda: str(headers))
  assert cpu.library_path() == path  # the same headers elsewhere: the same library
  ffi_h = headers / 'xla' / 'ffi' / 'api' / 'ffi.h'
  ffi_h.write_text(ffi_h.read_text() + '\n// another build\n')
  assert cpu.library_path() != path
  monkeypatch.undo()
  for module in (cpu.jax, jaxlib):
    with monkeypatch.context() as m:
      m.setattr(module, '__version__', '0.0.0')
      assert cpu.library_path() != path


# ------------------------------------------------------------------------------------------------
# pallas_tpu against JAX's own TPU paged-attention kernel
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_pallas_tpu_matches_jax_tpu_paged_attention_op():
  """Cross-check with jax.experimental.pallas.ops.tpu.paged_attention, whose API says "pages"
  ([kv_heads, pages, page_size, head_dim]); it takes no softmax scale and rounds K/V to
  bfloat16, so it gets pre-scaled q and bfloat16-exact K/V."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_tpu_op  # pylint: disable=import-outside-toplevel
  spec = Spec('jax_op', head_dim=128, max_blocks=4)
  args = build(spec, 14, lengths=(1, 17, 64))
  bf16_exact = lambda x: jnp.asarray(f32(f32(x).astype(jnp.bfloat16)))
  args = dict(args, k_blocks=bf16_exact(args['k_blocks']), v_blocks=bf16_exact(args['v_blocks']))
  k_pages = args['k_blocks'].transpose(1, 0, 2, 3)
  v_pages = args['v_blocks'].transpose(1, 0, 2, 3)
  with pltpu.force_tpu_interpret_mode():
    theirs = jax_tpu_op(args['q'][:, 0] * spec.head_dim ** -0.5, k_pages, v_pages,
                        args['context_lens'], args['block_tables'], pages_per_compute_block=2)
  np.testing.assert_allclose(run('pallas_tpu', args)[:, 0], np.asarray(theirs), atol=2e-5,
                             rtol=0)


# ------------------------------------------------------------------------------------------------
# Real-hardware lowerings, checked from CPU with the dtypes the engine sends
# ------------------------------------------------------------------------------------------------
def abstract(spec, layers=None):
  """ShapeDtypeStructs of a spec's arguments: (args, kwargs); layers: a stacked pool with a
  traced layer (as the model passes it); quantized specs get float16 scales."""
  batch, bs = 6, spec.block_size
  num_blocks = 1 + batch * spec.max_blocks
  lead = () if layers is None else (layers,)
  s = jax.ShapeDtypeStruct
  blocks = s(lead + (num_blocks, spec.num_kv_heads, bs, spec.head_dim), jnp.dtype(spec.kv_dtype))
  args = [s((batch, spec.num_q, spec.num_kv_heads * spec.group, spec.head_dim),
            jnp.dtype(spec.q_dtype)),
          blocks, blocks, s((batch, spec.max_blocks), jnp.int32), s((batch,), jnp.int32),
          s((batch, spec.num_q), jnp.int32)]
  kwargs = {}
  if spec.kv_dtype in QUANT:
    scales = s(lead + (num_blocks, spec.num_kv_heads, bs), jnp.float16)
    kwargs.update(k_scales=scales, v_scales=scales)
  if layers is not None:
    kwargs['layer'] = s((), jnp.int32)
  return args, kwargs


# (kv dtype, q dtype, block_size, num_q, splits, stacked)
TPU_LOWERINGS = [('float32', 'float32', 16, 1, 1, False), ('bfloat16', 'bfloat16', 16, 4, 2, True),
                 ('int8', 'bfloat16', 16, 1, 1, True), ('float8_e4m3fn', 'float32', 16, 3, 2, True)]


@pytest.mark.parametrize('kv_dtype,q_dtype,block_size,num_q,splits,stacked', TPU_LOWERINGS)
def test_pallas_tpu_lowers_for_tpu(kv_dtype, q_dtype, block_size, num_q, splits, stacked):
  from pagedjax.kernels import pallas_tpu  # pylint: disable=import-outside-toplevel
  spec = Spec('tpu', block_size=block_size, head_dim=128, num_q=num_q, kv_dtype=kv_dtype,
              q_dtype=q_dtype)
  args, kwargs = abstract(spec, layers=3 if stacked else None)
  fn = functools.partial(pallas_tpu.paged_attention_pallas_tpu, interpret=False,
                         context_splits=splits)
  text = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=('tpu',)).as_text()
  assert 'tpu_custom_call' in text


def lower_for_cuda(fn, args, kwargs):
  """StableHLO text of fn lowered for CUDA from this CPU. From jax 0.11 the Triton lowering asks
  for the target GPU (its compute capability) and, with no GPU present, takes it from an abstract
  mesh's device: name the H200 the GPU checks run on."""
  lower = lambda: jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=('cuda',))
  if not hasattr(jax.sharding, 'AbstractDevice'):
    return lower().as_text()
  device = jax.sharding.AbstractDevice(device_kind='NVIDIA H200', num_cores=132, platform='gpu')
  mesh = jax.sharding.AbstractMesh((1,), ('x',), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    return lower().as_text()


# (kv dtype, block_size, num_q, splits, stacked): both branches (bs 8 / 16+), decode and
# prefill, split and not; quantized ones as the model passes them.
CUDA_LOWERINGS = [('bfloat16', 16, 1, 1, False), ('bfloat16', 8, 1, 1, False),
                  ('bfloat16', 32, 8, 1, False), ('bfloat16', 16, 1, 2, False),
                  ('bfloat16', 8, 3, 3, False), ('int8', 16, 1, 1, True), ('int8', 8, 1, 1, True),
                  ('float8_e4m3fn', 16, 1, 1, True), ('int8', 16, 3, 2, True)]


@pytest.mark.parametrize('kv_dtype,block_size,num_q,splits,stacked', CUDA_LOWERINGS)
def test_pallas_gpu_lowers_for_cuda(kv_dtype, block_size, num_q, splits, stacked):
  from pagedjax.kernels import pallas_gpu  # pylint: disable=import-outside-toplevel
  spec = Spec('cuda', block_size=block_size, num_q=num_q, kv_dtype=kv_dtype, q_dtype='bfloat16')
  args, kwargs = abstract(spec, layers=3 if stacked else None)
  fn = functools.partial(pallas_gpu.paged_attention_pallas_gpu, interpret=False,
                         context_splits=splits)
  assert 'triton' in lower_for_cuda(fn, args, kwargs)


@pytest.mark.slow
def test_triton_kernel_compiles_for_sm90():
  """Triton's own compiler (it ships ptxas) builds the kernel down to a cubin for the H200's
  sm_90 without a GPU: catches what the interpreter forgives (shapes, dot operands, types).
  Quantized variants take float16 scales, as the engine's pool passes them. In a subprocess:
  triton imported under TRITON_INTERPRET=1 cannot compile."""
  pytest.importorskip('triton', reason='triton not installed (requirements-kernels.txt)')
  script = textwrap.dedent("""
      from pagedjax.kernels.triton import compile_ahead
      for block_size, rows, dtype, blocks, splits in [
          (64, 16, 'fp32', None, 1), (16, 32, 'bf16', None, 1), (8, 16, 'fp32', None, 1),
          (16, 16, 'bf16', 'i8', 1), (8, 16, 'fp32', 'i8', 1), (64, 16, 'bf16', 'fp8e4nv', 1),
          (16, 16, 'bf16', None, 2), (8, 16, 'fp32', 'i8', 3), (64, 16, 'bf16', 'fp8e4nv', 4)]:
        kernel = compile_ahead(90, rows=rows, block_size=block_size, dtype=dtype,
                               block_dtype=blocks, scale_dtype='fp16', splits=splits)
        assert kernel.asm['cubin'], (block_size, rows, dtype, blocks, splits)
      print('compiled')
  """)
  env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
  env['PYTHONPATH'] = os.pathsep.join([ROOT] + env.get('PYTHONPATH', '').split(os.pathsep))
  result = subprocess.run([sys.executable, '-c', script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0 and 'compiled' in result.stdout, result.stderr[-3000:]


# ------------------------------------------------------------------------------------------------
# GPU only: jax_triton launches the way the model makes them
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != 'gpu', reason='jax_triton launches need a GPU')
@pytest.mark.parametrize('name', ['prefill_bf16_d128_g8_stacked', 'decode_int8_stacked',
                                  'split3_prefill_int8_stacked'])
def test_jax_triton_launch_under_jit_with_traced_layer(name):
  """impl='triton' through the dispatcher inside jit, the stacked pool and a traced layer."""
  pytest.importorskip('jax_triton', reason='jax_triton launches need jax_triton and a GPU')
  if triton_interpreted():
    pytest.skip('TRITON_INTERPRET=1 in this process; run with TRITON_INTERPRET=0')
  args, want = case(name)
  scales = {n: args[n] for n in ('k_scales', 'v_scales') if n in args}
  got = jax.jit(lambda layer: paged_attention(
      *[args[n] for n in ARG_NAMES], impl='triton', layer=layer, **scales))(
          jnp.int32(args['layer']))
  assert_close(got, want, SPECS[name].q_dtype)
