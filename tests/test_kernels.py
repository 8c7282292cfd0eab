"""Paged-attention paths against the reference, and the reference against hand and numpy.

Every case uses random (never zero) K/V, a shuffled block table, and one batch holding the
lengths 0, 1, bs-1, bs, bs+1 and the maximum, so each compiled call covers all of them. The
isolation tests refill the null block, every block no sequence owns and every slot past a length
with NaN / inf / 1e30 and require identical outputs.

Tolerances (absolute, on outputs of magnitude ~1): float32 2e-5 (accumulation order only);
bfloat16 2e-2 (the output is rounded to bfloat16: one ulp at 2-4 is 1.6e-2); quantized pages
2e-5 (the reference dequantizes the same values in float32).

Pallas paths run in interpret mode on CPU (TPU interpret mode costs about a second per call),
so they get a few small cases; their real-hardware lowerings are checked from CPU too.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels import paged_attention

TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2}


# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------
def lengths_for(block_size, max_blocks):
  return [0, 1, block_size - 1, block_size, block_size + 1, block_size * max_blocks]


def make_case(seed, *, num_kv_heads, group, head_dim, block_size, max_blocks, num_q=1,
              dtype=jnp.float32, lengths=None, spare_blocks=3):
  """Inputs with shuffled, disjoint block tables; padding entries point at the null block 0."""
  rng = np.random.default_rng(seed)
  lengths = lengths_for(block_size, max_blocks) if lengths is None else lengths
  batch = len(lengths)
  num_blocks = 1 + batch * max_blocks + spare_blocks
  shape = (num_blocks, num_kv_heads, block_size, head_dim)
  # Uniform on +-[0.5, 1.5]: never zero, so a dropped term always shows.
  def nonzero(size):
    return rng.choice([-1.0, 1.0], size) * rng.uniform(0.5, 1.5, size)
  k_pages, v_pages = nonzero(shape), nonzero(shape)
  perm = rng.permutation(np.arange(1, num_blocks))
  block_tables = np.zeros((batch, max_blocks), np.int32)
  for b, length in enumerate(lengths):
    used = -(-length // block_size)
    block_tables[b, :used] = perm[b * max_blocks: b * max_blocks + used]
  context_lens = np.array(lengths, np.int32)
  # The chunk's queries are the last num_q positions; earlier-than-0 ones are padding (-1), and
  # with num_q > 1 the last query of sequence 1 is padding too (a short chunk in a bucket).
  q_positions = context_lens[:, None] - num_q + np.arange(num_q)[None, :]
  q_positions = np.where(q_positions < 0, -1, q_positions).astype(np.int32)
  if num_q > 1:
    q_positions[1, -1] = -1
  q = nonzero((batch, num_q, num_kv_heads * group, head_dim))
  cast = lambda x: jnp.asarray(x, dtype)
  return dict(q=cast(q), k_pages=cast(k_pages), v_pages=cast(v_pages),
              block_tables=jnp.asarray(block_tables), context_lens=jnp.asarray(context_lens),
              q_positions=jnp.asarray(q_positions))


def poison(case, value):
  """The same case with `value` in the null block, unowned blocks and past-length slots."""
  k, v = np.array(case['k_pages'], np.float32), np.array(case['v_pages'], np.float32)
  tables, lens = np.asarray(case['block_tables']), np.asarray(case['context_lens'])
  block_size = k.shape[2]
  owned = np.zeros(k.shape[0], bool)
  for b, length in enumerate(lens):
    used = -(-int(length) // block_size)
    owned[tables[b, :used]] = True
    if length % block_size:
      last = tables[b, used - 1]
      k[last, :, length % block_size:] = value
      v[last, :, length % block_size:] = value
  k[~owned], v[~owned] = value, value
  dtype = case['k_pages'].dtype
  return dict(case, k_pages=jnp.asarray(k, dtype), v_pages=jnp.asarray(v, dtype))


def run(case, impl, **kwargs):
  return paged_attention(case['q'], case['k_pages'], case['v_pages'], case['block_tables'],
                         case['context_lens'], case['q_positions'], impl=impl, **kwargs)


def numpy_attention(case, k_scales=None, v_scales=None):
  """A float64 oracle that shares no code (and no XLA compiler) with the paths under test."""
  q = np.asarray(case['q'], np.float64)
  k = np.asarray(case['k_pages'].astype(jnp.float32), np.float64)
  v = np.asarray(case['v_pages'].astype(jnp.float32), np.float64)
  if k_scales is not None:
    k, v = k * np.asarray(k_scales)[..., None], v * np.asarray(v_scales)[..., None]
  tables, lens = np.asarray(case['block_tables']), np.asarray(case['context_lens'])
  positions = np.asarray(case['q_positions'])
  batch, num_q, num_heads, head_dim = q.shape
  num_kv_heads, block_size = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  out = np.zeros_like(q)
  for b in range(batch):
    for t in range(num_q):
      seen = min(positions[b, t] + 1, lens[b])
      for h in range(num_heads):
        kv_head = h // group
        if seen <= 0:
          continue
        slots = np.arange(seen)
        kk = k[tables[b, slots // block_size], kv_head, slots % block_size]
        vv = v[tables[b, slots // block_size], kv_head, slots % block_size]
        s = kk @ q[b, t, h] * head_dim ** -0.5
        p = np.exp(s - s.max())
        out[b, t, h] = p @ vv / p.sum()
  return out


def assert_close(got, want, dtype):
  got = np.asarray(jnp.asarray(got).astype(jnp.float32))
  want = np.asarray(jnp.asarray(want).astype(jnp.float32))
  assert np.all(np.isfinite(got)), 'non-finite output'
  np.testing.assert_allclose(got, want, atol=TOL[jnp.dtype(dtype)], rtol=0)


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------
def test_reference_hand_computed():
  """One query over 3 tokens split across two shuffled blocks, checked against exp by hand."""
  k_tokens = [[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]]
  v_tokens = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
  k_pages = np.full((3, 1, 2, 2), np.nan, np.float32)  # block 0 (null) stays NaN
  v_pages = np.full((3, 1, 2, 2), np.nan, np.float32)
  # Logical block 0 lives in physical block 2, logical block 1 in physical block 1.
  k_pages[2, 0], v_pages[2, 0] = k_tokens[:2], v_tokens[:2]
  k_pages[1, 0, 0], v_pages[1, 0, 0] = k_tokens[2], v_tokens[2]  # slot 1 of it stays NaN
  q = np.array([[[[1.0, 0.0]]]], np.float32)  # [B=1, T=1, Hq=1, D=2]
  out = paged_attention(q, k_pages, v_pages, np.array([[2, 1]], np.int32),
                        np.array([3], np.int32), np.array([[2]], np.int32), scale=1.0)
  # Scores q.k = 1, 0, 2.
  e = [math.e ** 1, math.e ** 0, math.e ** 2]
  want = [sum(w * v[i] for w, v in zip(e, v_tokens)) / sum(e) for i in range(2)]
  np.testing.assert_allclose(np.asarray(out)[0, 0, 0], want, rtol=1e-6)


def test_reference_matches_numpy_oracle():
  case = make_case(0, num_kv_heads=2, group=3, head_dim=16, block_size=8, max_blocks=4,
                   num_q=3)
  np.testing.assert_allclose(np.asarray(run(case, 'reference')), numpy_attention(case),
                             atol=2e-6, rtol=0)


def test_reference_isolation():
  case = make_case(1, num_kv_heads=2, group=2, head_dim=16, block_size=8, max_blocks=3, num_q=2)
  np.testing.assert_allclose(np.asarray(run(poison(case, np.nan), 'reference')),
                             np.asarray(run(case, 'reference')), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------------
# xla
# ------------------------------------------------------------------------------------------------
# (block_size, group, head_dim, num_q, dtype): every block size 8..256, GQA ratio 1/3/4/8, head
# dim 64/128, decode and prefill chunks (the dot branch at T*G >= 16), float32 and bfloat16.
XLA_CASES = [
    (8, 1, 64, 1, jnp.float32),
    (16, 4, 128, 1, jnp.float32),
    (32, 3, 64, 4, jnp.float32),
    (64, 8, 64, 1, jnp.float32),
    (64, 4, 64, 8, jnp.float32),
    (128, 8, 128, 3, jnp.float32),
    (256, 4, 64, 1, jnp.float32),
    (16, 8, 64, 1, jnp.bfloat16),
    (64, 3, 128, 8, jnp.bfloat16),
]


@pytest.mark.parametrize('block_size,group,head_dim,num_q,dtype', XLA_CASES)
def test_xla_matches_reference(block_size, group, head_dim, num_q, dtype):
  case = make_case(block_size + group, num_kv_heads=2, group=group, head_dim=head_dim,
                   block_size=block_size, max_blocks=3, num_q=num_q, dtype=dtype)
  assert_close(run(case, 'xla'), run(case, 'reference'), dtype)


def test_xla_matches_numpy_at_benchmark_scale():
  """Near the benchmark's shape (where XLA CPU picks its fusions), against an XLA-free oracle:
  XLA's YNNPACK fusions once miscompiled a scan formulation to a max error of 4."""
  case = make_case(7, num_kv_heads=8, group=4, head_dim=64, block_size=64, max_blocks=16,
                   lengths=[1024, 1000, 64, 0, 513, 1024, 7, 960])
  np.testing.assert_allclose(np.asarray(run(case, 'xla')), numpy_attention(case), atol=2e-5,
                             rtol=0)


@pytest.mark.parametrize('value', [np.nan, np.inf, 1e30])
def test_xla_isolation(value):
  case = make_case(3, num_kv_heads=2, group=4, head_dim=64, block_size=16, max_blocks=3,
                   num_q=2)
  clean = np.asarray(run(case, 'xla'))
  np.testing.assert_allclose(np.asarray(run(poison(case, value), 'xla')), clean, atol=1e-6,
                             rtol=0)


def test_xla_inside_layer_scan_under_jit():
  """How the model calls it: a lax.scan over layers inside a jitted step."""
  case = make_case(4, num_kv_heads=2, group=2, head_dim=64, block_size=16, max_blocks=3)
  layers = 3
  k_stack = jnp.stack([case['k_pages'] * (i + 1) for i in range(layers)])
  v_stack = jnp.stack([case['v_pages'] - i for i in range(layers)])

  @jax.jit
  def step(q, k_stack, v_stack):
    def layer(x, kv):
      out = paged_attention(x, kv[0], kv[1], case['block_tables'], case['context_lens'],
                            case['q_positions'], impl='xla')
      return x + out, None
    return jax.lax.scan(layer, q, (k_stack, v_stack))[0]

  want = case['q']
  for i in range(layers):
    want = want + run(dict(case, q=want, k_pages=k_stack[i], v_pages=v_stack[i]), 'reference')
  np.testing.assert_allclose(np.asarray(step(case['q'], k_stack, v_stack)), np.asarray(want),
                             atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------
# Quantized pages
# ------------------------------------------------------------------------------------------------
def quantize(case, dtype):
  """Per-(token, KV head) absmax quantization of a case's pages."""
  out = dict(case)
  qmax = 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
  for name, scale_name in (('k_pages', 'k_scales'), ('v_pages', 'v_scales')):
    x = np.asarray(case[name], np.float32)
    scale = np.abs(x).max(axis=-1) / qmax  # [N, Hkv, bs]
    y = x / scale[..., None]
    y = np.round(y) if dtype == jnp.int8 else y
    out[name] = jnp.asarray(y).astype(dtype)
    out[scale_name] = jnp.asarray(scale, jnp.float32)
  return out


def run_quant(case, impl):
  return paged_attention(case['q'], case['k_pages'], case['v_pages'], case['block_tables'],
                         case['context_lens'], case['q_positions'], impl=impl,
                         k_scales=case['k_scales'], v_scales=case['v_scales'])


@pytest.mark.parametrize('qdtype', [jnp.int8, jnp.float8_e4m3fn])
def test_quantized_reference_matches_numpy(qdtype):
  case = quantize(make_case(5, num_kv_heads=2, group=3, head_dim=16, block_size=8,
                            max_blocks=3, num_q=2), qdtype)
  np.testing.assert_allclose(np.asarray(run_quant(case, 'reference')),
                             numpy_attention(case, case['k_scales'], case['v_scales']),
                             atol=2e-6, rtol=0)


@pytest.mark.parametrize('qdtype', [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize('num_q', [1, 8])
def test_xla_quantized_matches_reference(qdtype, num_q):
  case = quantize(make_case(6, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                            max_blocks=3, num_q=num_q), qdtype)
  assert_close(run_quant(case, 'xla'), run_quant(case, 'reference'), jnp.float32)


def test_xla_quantized_isolation():
  case = quantize(make_case(8, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                            max_blocks=3), jnp.float8_e4m3fn)
  clean = np.asarray(run_quant(case, 'xla'))
  poisoned = poison(dict(case, k_pages=case['k_pages'].astype(jnp.float32),
                         v_pages=case['v_pages'].astype(jnp.float32)), np.nan)
  poisoned['k_pages'] = poisoned['k_pages'].astype(jnp.float8_e4m3fn)
  poisoned['v_pages'] = poisoned['v_pages'].astype(jnp.float8_e4m3fn)
  # NaN scales for unowned blocks too.
  owned = np.isin(np.arange(case['k_scales'].shape[0]), np.asarray(case['block_tables'])[
      np.asarray(case['block_tables']) > 0])
  for name in ('k_scales', 'v_scales'):
    s = np.array(case[name])
    s[~owned] = np.nan
    poisoned[name] = jnp.asarray(s)
  np.testing.assert_allclose(np.asarray(run_quant(poisoned, 'xla')), clean, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------------
# pallas_tpu (TPU interpret mode on CPU)
# ------------------------------------------------------------------------------------------------
PALLAS_CASES = [  # (block_size, group, head_dim, num_q, dtype); small: interpreting is slow
    (16, 4, 128, 1, jnp.float32),
    (128, 8, 64, 1, jnp.float32),
    (8, 3, 64, 3, jnp.float32),
    (16, 1, 64, 1, jnp.bfloat16),
]


def small_case(seed, block_size, group, head_dim, num_q, dtype):
  lengths = lengths_for(block_size, 3) if num_q == 1 else [block_size - 1, 1, 3 * block_size]
  return make_case(seed, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
                   max_blocks=3, num_q=num_q, dtype=dtype, lengths=lengths)


@pytest.mark.parametrize('impl,seed', [('pallas_tpu', 11), ('pallas_gpu', 21)])
@pytest.mark.parametrize('block_size,group,head_dim,num_q,dtype', PALLAS_CASES)
def test_pallas_matches_reference(impl, seed, block_size, group, head_dim, num_q, dtype):
  case = small_case(seed, block_size, group, head_dim, num_q, dtype)
  assert_close(run(case, impl), run(case, 'reference'), dtype)


# (impl, seed, block_size, num_q, poison): a decode case and a prefill chunk, NaN and inf.
@pytest.mark.parametrize('impl,seed,block_size,num_q,value', [
    ('pallas_tpu', 12, 8, 1, np.nan), ('pallas_gpu', 22, 16, 2, np.inf)])
def test_pallas_isolation(impl, seed, block_size, num_q, value):
  case = small_case(seed, block_size, 4, 64, num_q, jnp.float32)
  np.testing.assert_allclose(np.asarray(run(poison(case, value), impl)),
                             np.asarray(run(case, 'reference')), atol=2e-5, rtol=0)


def test_pallas_tpu_quantized_matches_reference():
  case = quantize(small_case(13, 16, 4, 64, 1, jnp.float32), jnp.int8)
  assert_close(run_quant(case, 'pallas_tpu'), run_quant(case, 'reference'), jnp.float32)


@pytest.mark.parametrize('splits,num_q,quantized', [(3, 1, False), (2, 3, True)])
def test_pallas_tpu_context_split_matches_reference(splits, num_q, quantized):
  """Flash-decoding split (7 blocks over 2 or 3 programs, so one split runs short and the split
  of a short sequence sees nothing); lengths include 0; prefill chunks too."""
  from kernels.pallas_tpu import paged_attention_pallas_tpu  # pylint: disable=import-outside-toplevel
  case = make_case(14, num_kv_heads=1, group=4, head_dim=64, block_size=16, max_blocks=7,
                   num_q=num_q)
  extra, want = {}, None
  if quantized:
    case = quantize(case, jnp.int8)
    extra = dict(k_scales=case['k_scales'], v_scales=case['v_scales'])
    want = run_quant(case, 'reference')
  got = paged_attention_pallas_tpu(case['q'], case['k_pages'], case['v_pages'],
                                   case['block_tables'], case['context_lens'],
                                   case['q_positions'], context_splits=splits, **extra)
  assert_close(got, run(case, 'reference') if want is None else want, jnp.float32)


@pytest.mark.slow
def test_pallas_tpu_matches_jax_tpu_paged_attention_op():
  """Cross-check with JAX's own TPU kernel ([kv_heads, pages, page_size, head_dim] layout; it
  takes no softmax scale and rounds K/V to bfloat16, so feed it pre-scaled q and bf16-exact K/V)."""
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_tpu_op
  case = make_case(14, num_kv_heads=2, group=4, head_dim=128, block_size=16, max_blocks=4,
                   lengths=[1, 17, 64])
  as_bf16_exact = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  case = dict(case, k_pages=as_bf16_exact(case['k_pages']),
              v_pages=as_bf16_exact(case['v_pages']))
  head_dim = case['q'].shape[-1]
  with pltpu.force_tpu_interpret_mode():
    theirs = jax_tpu_op(case['q'][:, 0] * head_dim ** -0.5,
                        case['k_pages'].transpose(1, 0, 2, 3),
                        case['v_pages'].transpose(1, 0, 2, 3),
                        case['context_lens'], case['block_tables'], pages_per_compute_block=2)
  ours = run(case, 'pallas_tpu')[:, 0]
  np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=2e-5, rtol=0)


# ------------------------------------------------------------------------------------------------
# pallas_gpu (interpret=True on CPU)
# ------------------------------------------------------------------------------------------------
def poison_quantized(case, value):
  """`poison` for a quantized case: `value` in the scales of the null block, unowned blocks and
  past-length slots, and the pages there as bad as their dtype allows (int8 holds no NaN/inf:
  its extreme -128; float8_e4m3fn has no inf: NaN)."""
  out = dict(case)
  for pages, scales in (('k_pages', 'k_scales'), ('v_pages', 'v_scales')):
    # Scales are pages without the trailing D: give them a D of 1 to reuse `poison`.
    as_pages = dict(case, k_pages=case[scales][..., None], v_pages=case[scales][..., None])
    out[scales] = poison(as_pages, value)['k_pages'][..., 0]
    dtype = case[pages].dtype
    bad = -128.0 if dtype == jnp.int8 else np.nan
    wide = dict(case, k_pages=case[pages].astype(jnp.float32),
                v_pages=case[pages].astype(jnp.float32))
    out[pages] = poison(wide, bad)['k_pages'].astype(dtype)
  return out


@pytest.mark.parametrize('qdtype', [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize('block_size,group,num_q', [(16, 4, 1), (8, 3, 3)])
def test_pallas_gpu_quantized_matches_reference(qdtype, block_size, group, num_q):
  """The dot branch (bs 16) and the multiply-reduce branch (bs 8), decode and a prefill chunk."""
  case = quantize(small_case(23, block_size, group, 64, num_q, jnp.float32), qdtype)
  assert_close(run_quant(case, 'pallas_gpu'), run_quant(case, 'reference'), jnp.float32)


@pytest.mark.parametrize('qdtype,value', [(jnp.int8, np.nan), (jnp.float8_e4m3fn, np.inf)])
def test_pallas_gpu_quantized_isolation(qdtype, value):
  case = quantize(small_case(24, 16, 4, 64, 2, jnp.float32), qdtype)
  poisoned = poison_quantized(case, value)
  assert not np.all(np.isfinite(np.asarray(poisoned['k_scales'])))  # the poison took
  np.testing.assert_allclose(np.asarray(run_quant(poisoned, 'pallas_gpu')),
                             np.asarray(run_quant(case, 'reference')), atol=2e-5, rtol=0)


def split_case(seed, num_q, qdtype):
  """A flash-decoding case: 7 blocks of 16 (lengths 0, 1, 15, 16, 17, 112), so with 2 or 3
  splits the last split of the 112-token sequence runs short and the later splits of the short
  sequences see nothing; poisoned (NaN/inf in the null block, unowned blocks and past-length
  slots, and their scales), with the clean case's reference output."""
  case = make_case(seed, num_kv_heads=2, group=4, head_dim=64, block_size=16, max_blocks=7,
                   num_q=num_q)
  if qdtype is None:
    return poison(case, np.inf), run(case, 'reference')
  case = quantize(case, qdtype)
  return poison_quantized(case, np.nan), run_quant(case, 'reference')


def split_args(case, layered):
  """(args, kwargs) for a kernel wrapper; layered: the case's pages as layer 2 of a 3-layer
  pool whose other layers hold NaN, read with `layer=2`."""
  names = [n for n in ('k_pages', 'v_pages', 'k_scales', 'v_scales') if n in case]
  pool = {n: case[n] for n in names}
  kwargs = {}
  if layered:
    nan = lambda x: jnp.full(x.shape, np.nan, jnp.float32).astype(x.dtype)
    pool = {n: jnp.stack([nan(case[n]), nan(case[n]), case[n]]) for n in names}
    kwargs['layer'] = jnp.int32(2)
  kwargs.update({n: pool[n] for n in ('k_scales', 'v_scales') if n in pool})
  args = (case['q'], pool['k_pages'], pool['v_pages'], case['block_tables'],
          case['context_lens'], case['q_positions'])
  return args, kwargs


# (splits, num_q, page dtype, layer-stacked): decode and a prefill chunk with a padded query,
# float and int8/fp8 pages, one and a stacked layer.
SPLIT_CASES = [(3, 1, None, False), (2, 3, jnp.int8, True), (3, 2, jnp.float8_e4m3fn, False)]


@pytest.mark.filterwarnings('ignore:invalid value:RuntimeWarning')  # NumPy meeting the poison
@pytest.mark.parametrize('splits,num_q,qdtype,layered', SPLIT_CASES)
def test_pallas_gpu_context_split_matches_reference(splits, num_q, qdtype, layered):
  from kernels.pallas_gpu import paged_attention_pallas_gpu  # pylint: disable=import-outside-toplevel
  case, want = split_case(25, num_q, qdtype)
  args, kwargs = split_args(case, layered)
  got = paged_attention_pallas_gpu(*args, context_splits=splits, **kwargs)
  assert_close(got, want, jnp.float32)


def test_merge_split_states_hand_computed():
  """merge_split_states on states computed here in numpy: three key ranges of very different score
  scales (so each split's weight exp(m - max m) matters; dropping it is off by far more than
  the tolerance) and a fourth that saw nothing (m = -inf); a row that saw nothing gets 0."""
  rng = np.random.default_rng(26)
  s = rng.normal(size=(2, 12)) * np.array([1.0] * 4 + [8.0] * 4 + [0.1] * 4)  # [R, keys]
  v = rng.normal(size=(12, 3))
  ranges = [(0, 4), (4, 8), (8, 12), (12, 12)]
  acc, m, l = [], [], []
  for lo, hi in ranges:
    part = s[:, lo:hi]
    mx = part.max(axis=1) if hi > lo else np.full(2, -np.inf)
    p = np.exp(part - mx[:, None]) if hi > lo else np.zeros((2, 0))
    acc.append(p @ v[lo:hi]), m.append(mx), l.append(p.sum(axis=1))
  f32 = lambda x: jnp.asarray(np.stack(x), jnp.float32)
  got = kernels.merge_split_states(f32(acc), f32(m), f32(l))
  p = np.exp(s - s.max(axis=1, keepdims=True))
  np.testing.assert_allclose(np.asarray(got), (p @ v) / p.sum(axis=1, keepdims=True),
                             atol=1e-5, rtol=0)
  nothing = kernels.merge_split_states(jnp.zeros((2, 1, 3)), jnp.full((2, 1), -jnp.inf), jnp.zeros((2, 1)))
  np.testing.assert_array_equal(np.asarray(nothing), np.zeros((1, 3)))


def test_pallas_gpu_default_context_splits(monkeypatch):
  """The heuristic: about two programs per SM (132 when the device reports none), at least
  256 tokens a split, never more splits than blocks; explicit values < 1 raise."""
  from kernels import pallas_gpu  # pylint: disable=import-outside-toplevel
  default = pallas_gpu.default_context_splits
  assert default(1, 8, 64, 16) == 4  # 33 wanted for 264 programs; 64 blocks of 16 = 4 x 256
  assert default(1, 8, 1024, 16) == 33
  assert default(4, 2, 1024, 16) == 33
  assert default(64, 8, 1024, 16) == 1  # 512 programs already fill the GPU
  assert default(1, 8, 8, 16) == 1  # 128 tokens: too short to split
  assert default(1, 1, 4, 256) == 4  # one block is already 256 tokens
  # A GPU device's core_count replaces the 132.
  gpu = type('FakeGpu', (), dict(platform='gpu', core_count=16))()
  monkeypatch.setattr(pallas_gpu.jax, 'devices', lambda: [gpu])
  assert default(1, 8, 1024, 16) == 4
  monkeypatch.undo()
  # Explicit counts are trimmed so that no split is empty: 7 blocks in 5 splits are 4 of 2.
  assert pallas_gpu.split_count(5, 1, 1, 7, 16) == 4
  assert pallas_gpu.split_count(9, 1, 1, 7, 16) == 7
  case = small_case(27, 16, 4, 64, 1, jnp.float32)
  for bad in (0, -1):
    with pytest.raises(ValueError, match=f'got {bad}'):
      pallas_gpu.paged_attention_pallas_gpu(*split_args(case, False)[0], context_splits=bad)


# ------------------------------------------------------------------------------------------------
# Real-hardware lowerings, checked from CPU
# ------------------------------------------------------------------------------------------------
def _abstract(case, **extra):
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  names = ('q', 'k_pages', 'v_pages', 'block_tables', 'context_lens', 'q_positions')
  return [spec(case[n]) for n in names], {k: spec(v) for k, v in extra.items()}


@pytest.mark.parametrize('quantized,splits', [(False, 1), (True, 1), (False, 2)])
def test_pallas_tpu_lowers_for_tpu(quantized, splits):
  from kernels import pallas_tpu
  case = small_case(31, 16, 4, 128, 1, jnp.float32)
  extra = {}
  if quantized:
    case = quantize(case, jnp.int8)
    extra = dict(k_scales=case.pop('k_scales'), v_scales=case.pop('v_scales'))
  args, kwargs = _abstract(case, **extra)
  fn = functools.partial(pallas_tpu.paged_attention_pallas_tpu, interpret=False,
                         context_splits=splits)
  text = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=('tpu',)).as_text()
  assert 'tpu_custom_call' in text


def _lower_for_cuda(fn, args, kwargs=None):
  """StableHLO text of fn lowered for CUDA from this CPU. From jax 0.11 the Triton lowering asks
  for the target GPU (its compute capability) and, with no GPU present, takes it from an abstract
  mesh's device: name the H200 the GPU checks run on."""
  lower = lambda: jax.jit(fn).trace(*args, **(kwargs or {})).lower(lowering_platforms=('cuda',))
  if not hasattr(jax.sharding, 'AbstractDevice'):
    return lower().as_text()
  device = jax.sharding.AbstractDevice(device_kind='NVIDIA H200', num_cores=132, platform='gpu')
  mesh = jax.sharding.AbstractMesh((1,), ('x',), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    return lower().as_text()


@pytest.mark.parametrize('block_size,num_q,splits', [(16, 1, 1), (8, 1, 1), (32, 8, 1),
                                                     (16, 1, 2), (8, 3, 3)])
def test_pallas_gpu_lowers_for_cuda(block_size, num_q, splits):
  from kernels import pallas_gpu
  case = small_case(32, block_size, 4, 64, num_q, jnp.bfloat16)
  args, _ = _abstract(case)
  fn = functools.partial(pallas_gpu.paged_attention_pallas_gpu, interpret=False,
                         context_splits=splits)
  text = _lower_for_cuda(fn, args)
  assert 'triton' in text


@pytest.mark.parametrize('qdtype,block_size', [(jnp.int8, 16), (jnp.int8, 8),
                                               (jnp.float8_e4m3fn, 16)])
def test_pallas_gpu_lowers_for_cuda_quantized_layer_stacked(qdtype, block_size):
  """How the model calls it on GPU: quantized pages of a [L, N, ...] pool and a traced layer."""
  from kernels import pallas_gpu
  case = quantize(small_case(33, block_size, 4, 64, 1, jnp.bfloat16), qdtype)
  stack = lambda x: jax.ShapeDtypeStruct((3,) + x.shape, x.dtype)
  args, _ = _abstract(case)
  args[1:3] = [stack(case['k_pages']), stack(case['v_pages'])]
  kwargs = dict(k_scales=stack(case['k_scales']), v_scales=stack(case['v_scales']),
                layer=jax.ShapeDtypeStruct((), jnp.int32))
  fn = functools.partial(pallas_gpu.paged_attention_pallas_gpu, interpret=False)
  text = _lower_for_cuda(fn, args, kwargs)
  assert 'triton' in text


# ------------------------------------------------------------------------------------------------
# Dispatcher and validation
# ------------------------------------------------------------------------------------------------
def test_auto_picks_a_native_path():
  assert kernels.best_impl('cpu') == 'xla'
  assert kernels.best_impl('tpu') == 'pallas_tpu'
  assert kernels.best_impl('gpu') == 'pallas_gpu'
  case = make_case(41, num_kv_heads=2, group=2, head_dim=64, block_size=16, max_blocks=2)
  assert_close(run(case, 'auto'), run(case, 'reference'), jnp.float32)


def test_auto_on_gpu_falls_back_where_the_gpu_kernel_does_not_reach(monkeypatch):
  """head_dim 12 (the tiny test models) is no power of two: 'auto' must not pick pallas_gpu."""
  monkeypatch.setattr(kernels, 'best_impl', lambda backend=None: 'pallas_gpu')
  case = make_case(44, num_kv_heads=2, group=2, head_dim=12, block_size=16, max_blocks=2)
  assert_close(run(case, 'auto'), run(case, 'reference'), jnp.float32)


@pytest.mark.parametrize('qdtype,fp8_ok,want', [(jnp.int8, False, 'pallas_gpu'),
                                                (jnp.float8_e4m3fn, True, 'pallas_gpu'),
                                                (jnp.float8_e4m3fn, False, 'xla')])
def test_auto_on_gpu_takes_quantized_pools(monkeypatch, qdtype, fp8_ok, want):
  """pallas_gpu dequantizes in-kernel, so 'auto' keeps quantized pools on it, except fp8 on a GPU
  older than sm_89, where Triton cannot convert float8_e4m3fn."""
  from kernels import pallas_gpu, xla  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(kernels, 'best_impl', lambda backend=None: 'pallas_gpu')
  monkeypatch.setattr(kernels, 'gpu_converts_fp8', lambda: fp8_ok)
  called = []

  def spy(module, name, tag):  # the dispatcher looks the function up at call time
    fn = getattr(module, name)
    def wrapped(*args, **kwargs):
      called.append(tag)
      return fn(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapped)

  spy(pallas_gpu, 'paged_attention_pallas_gpu', 'pallas_gpu')
  spy(xla, 'paged_attention_xla', 'xla')
  case = quantize(make_case(45, num_kv_heads=2, group=2, head_dim=32, block_size=8,
                            max_blocks=2), qdtype)
  assert_close(run_quant(case, 'auto'), run_quant(case, 'reference'), jnp.float32)
  assert called == [want]


def test_unknown_impl_raises():
  case = make_case(42, num_kv_heads=1, group=1, head_dim=64, block_size=8, max_blocks=2)
  with pytest.raises(ValueError, match='not one of'):
    run(case, 'cuda_magic')


@pytest.mark.parametrize('impl', ['reference', 'xla', 'pallas_tpu', 'pallas_gpu'])
def test_bad_shapes_raise_value_error(impl):
  case = make_case(43, num_kv_heads=2, group=2, head_dim=64, block_size=8, max_blocks=2)
  with pytest.raises(ValueError, match='head_dim'):
    run(dict(case, q=case['q'][..., :32]), impl)
  with pytest.raises(ValueError, match='context_lens'):
    run(dict(case, context_lens=case['context_lens'][:-1]), impl)
  with pytest.raises(ValueError, match='int8 pages need'):
    run(dict(case, k_pages=case['k_pages'].astype(jnp.int8),
             v_pages=case['v_pages'].astype(jnp.int8)), impl)


@pytest.mark.parametrize('splits,num_q', [(2, 1), (3, 1), (4, 5)])
def test_xla_context_split_matches_reference(splits, num_q):
  """Flash-decoding split over the context (few sequences, long contexts), decode and prefill;
  lengths include 0 and a context shorter than one split's share."""
  from kernels.xla import paged_attention_xla  # pylint: disable=import-outside-toplevel
  case = make_case(11, num_kv_heads=2, group=4, head_dim=64, block_size=16, max_blocks=12,
                   num_q=num_q)
  got = paged_attention_xla(case['q'], case['k_pages'], case['v_pages'], case['block_tables'],
                            case['context_lens'], case['q_positions'], context_splits=splits)
  assert_close(got, run(case, 'reference'), jnp.float32)
  one = {k: v[:1] if k not in ('k_pages', 'v_pages') else v for k, v in case.items()}
  assert_close(run(one, 'xla'), run(one, 'reference'), jnp.float32)  # batch 1: split by default


@pytest.mark.parametrize('impl', ['reference', 'xla', 'pallas_tpu', 'pallas_gpu'])
@pytest.mark.parametrize('quantized', [False, True])
def test_layer_stacked_pool_reads_the_right_layer(impl, quantized):
  """The model passes the whole [L, N, ...] pool with `layer=`: every path must read that layer
  in place and match the same case given one layer. (triton: tests/test_triton_kernel.py.)"""
  case = make_case(21, num_kv_heads=2, group=2, head_dim=32, block_size=8, max_blocks=3)
  other = make_case(22, num_kv_heads=2, group=2, head_dim=32, block_size=8, max_blocks=3)
  if quantized:
    case, other = quantize(case, jnp.int8), quantize(other, jnp.int8)
  names = ('k_pages', 'v_pages') + (('k_scales', 'v_scales') if quantized else ())
  stacked = {n: jnp.stack([other[n], case[n], other[n]]) for n in names}
  kwargs = {n: stacked[n] for n in ('k_scales', 'v_scales') if n in stacked}
  got = paged_attention(case['q'], stacked['k_pages'], stacked['v_pages'], case['block_tables'],
                        case['context_lens'], case['q_positions'], impl=impl,
                        layer=jnp.int32(1), **kwargs)
  want = run_quant(case, 'reference') if quantized else run(case, 'reference')
  assert_close(got, want, jnp.float32)
