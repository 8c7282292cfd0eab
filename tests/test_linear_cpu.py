"""The native CPU linear-layer kernel (kernels/linear_cpu.py): against a float64 oracle for both
weight layouts, row counts around its register tiles and column / depth tails; the dispatch
rules (XLA's dot for prefill-sized calls, non-float32 operands and other contractions); several
outputs in one call (linear_many) against one call each, and the model with q/k/v and gate/up
fused against unfused; and the engine on a tiny model with the kernel against XLA's dots: the
same greedy tokens, logits within float32 rounding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.kernels import linear_cpu
from pagedjax.model.llama import Llama, ModelConfig, init_params, per_layer_params
from pagedjax.model.step import CompiledStep
from pagedjax.host.requests.sampling_params import SamplingParams
from tiny_models import make_engine, prompts, tiny

needs_kernel = pytest.mark.skipif(
    jax.default_backend() != 'cpu' or not linear_cpu.available(),
    reason=f'the native linear kernel runs on a CPU backend where it builds: '
           f'{linear_cpu.unavailable_reason()}')


def _oracle(x, w, transposed):
  x64, w64 = x.astype(np.float64), w.astype(np.float64)
  return x64 @ (w64.T if transposed else w64)


@needs_kernel
@pytest.mark.parametrize('transposed', [False, True])
def test_kernel_matches_the_float64_oracle(transposed):
  """Rows 1-13 cover every tile height (1-6 and chunks of 6 / 3) and the 1-2 row streaming path
  (K 576 and 300: several row ranges, summed in order); columns 200 and K 37 leave vector and
  column tails; error bounded by float32 rounding of the sum of |x| |w|."""
  rng = np.random.default_rng(0)
  fn = jax.jit(lambda x, w: linear_cpu.kernel(x, w, transposed=transposed))
  for rows, k, n in ((1, 576, 200), (2, 300, 67), (2, 37, 64), (5, 64, 19), (7, 300, 136),
                      (13, 37, 200)):
    x = rng.standard_normal((rows, k), np.float32)
    w = rng.standard_normal((n, k) if transposed else (k, n), np.float32)
    got = np.asarray(fn(x, w))
    bound = np.abs(x).astype(np.float64) @ np.abs(w.T if transposed else w).astype(np.float64)
    assert got.shape == (rows, n) and got.dtype == np.float32
    assert np.all(np.abs(got - _oracle(x, w, transposed)) <= 1e-6 * bound + 1e-30), (rows, k, n)


@needs_kernel
def test_many_outputs_in_one_call_equal_their_own_calls_bit_for_bit():
  """linear_many (q/k/v, gate/up shapes and tails; 2 rows: the streaming path, 1 row: the kernel
  itself) against one kernel call per weight: identical floats; one custom call in the
  program; below MIN_ROWS, XLA's dots."""
  rng = np.random.default_rng(1)
  many = jax.jit(lambda x, *ws: linear_cpu.kernel_many(x, list(ws)))
  one = jax.jit(linear_cpu.kernel)
  for rows, k, ns in ((2, 300, (48, 24, 24)), (7, 64, (96, 96)), (5, 37, (19, 200, 8)),
                      (1, 300, (67,))):
    x = rng.standard_normal((rows, k), np.float32)
    ws = [rng.standard_normal((k, n), np.float32) for n in ns]
    for got, w in zip(many(x, *ws), ws):
      assert np.array_equal(np.asarray(got), np.asarray(one(x, w))), (rows, k, ns)
  x = jnp.ones((2, 3, 8), jnp.float32)
  ws = [jnp.ones((8, 4)), jnp.ones((8, 6))]
  text = jax.jit(lambda x, *ws: linear_cpu.linear_many(x, list(ws))).lower(x, *ws).as_text()
  assert text.count(linear_cpu.MULTI_TARGET) == 1 and linear_cpu.TARGET + '"' not in text
  assert [y.shape for y in linear_cpu.linear_many(x, ws)] == [(2, 3, 4), (2, 3, 6)]
  text = jax.jit(lambda x, *ws: linear_cpu.linear_many(x, list(ws))).lower(x[:1, :1], *ws)
  assert linear_cpu.MULTI_TARGET not in text.as_text()


@needs_kernel
def test_fused_projections_give_the_unfused_logits():
  """Llama(linear_impl='cpu_fused'): q/k/v and gate/up as one kernel call each (two in the
  scanned layer body, the params tree unchanged), with and without q/k/v biases: the same logits
  as 'cpu', bit for bit, and the same greedy tokens, over a 2 x 5 chunk (10 rows: the kernel runs)."""
  cfg, params, _ = tiny('gqa')
  biased = ModelConfig(vocab_size=97, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=16, ffn_dim=64, max_seq_len=64, qkv_bias=True)
  tokens = jnp.asarray([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
  positions = jnp.broadcast_to(jnp.arange(5), tokens.shape)
  for model_cfg, p in ((cfg, params), (biased, init_params(biased, seed=4))):
    if model_cfg.qkv_bias:  # nonzero biases, so that adding them is tested
      p = jax.tree_util.tree_map_with_path(
          lambda path, x: x + 0.1 if 'bias' in jax.tree_util.keystr(path) else x, p)
    run = {impl: jax.jit(lambda p, t, impl=impl: Llama(model_cfg, linear_impl=impl).apply(
        p, t, positions)[0]) for impl in ('cpu_fused', 'cpu')}
    assert run['cpu_fused'].lower(p, tokens).as_text().count(linear_cpu.MULTI_TARGET) == 2
    fused, separate = (np.asarray(run[i](p, tokens)) for i in ('cpu_fused', 'cpu'))
    np.testing.assert_array_equal(fused, separate)  # each fused matmul is its own call, bit for bit
    assert (fused.argmax(-1) == separate.argmax(-1)).all()


@needs_kernel
def test_dispatch_keeps_xla_where_the_kernel_does_not_apply():
  """Leading axes fold into rows; below MIN_ROWS (a lone row) and above MAX_ROWS rows, for
  bfloat16 operands and for other contractions the dot is XLA's (no custom call in the
  program)."""
  x = jnp.ones((2, 3, 8), jnp.float32)
  w = jnp.arange(8 * 5, dtype=jnp.float32).reshape(8, 5) / 40
  assert linear_cpu.linear(x, w).shape == (2, 3, 5)
  lowered = lambda f, *a: jax.jit(f).lower(*a).as_text()
  assert 'pagedjax_linear_cpu' in lowered(linear_cpu.linear, x, w)
  big = jnp.ones((linear_cpu.MAX_ROWS + 1, 8), jnp.float32)
  assert 'pagedjax_linear_cpu' not in lowered(linear_cpu.linear, big, w)
  assert 'pagedjax_linear_cpu' not in lowered(linear_cpu.linear, x[:1, :1], w)
  assert 'pagedjax_linear_cpu' not in lowered(linear_cpu.linear, x.astype(jnp.bfloat16),
                                              w.astype(jnp.bfloat16))
  dot = linear_cpu.dot_general('cpu')
  batched = lambda a, b: dot(a, b, (((2,), (1,)), ((0,), (0,))))
  assert 'pagedjax_linear_cpu' not in lowered(batched, x, jnp.ones((2, 8, 4)))
  np.testing.assert_allclose(np.asarray(dot(x, w, (((2,), (0,)), ((), ())))),
                             np.asarray(x) @ np.asarray(w), rtol=1e-6)
  assert linear_cpu.resolve('auto') == 'cpu_packed' and linear_cpu.resolve('xla') == 'xla'
  assert linear_cpu.fuses('cpu_fused') and not linear_cpu.fuses('auto')
  with pytest.raises(ValueError, match=r"linear_impl='blas' is not allowed: one of"):
    linear_cpu.resolve('blas')


@needs_kernel
def test_engine_with_the_kernel_gives_xlas_greedy_tokens():
  """The tiny GQA model decoding two prompts (prefill chunks of 16 tokens x 2 rows: 32 rows, so
  prefill runs the kernel too) through the tests' shared step (linear_impl 'auto': the kernel)
  and through XLA's dots: the same greedy tokens, logits within float32 summation-order
  tolerance."""
  cfg, _, shared = tiny('gqa')
  assert shared.linear_impl == 'auto' and linear_cpu.resolve(shared.linear_impl) == 'cpu_packed'
  ps, sampling = prompts([5, 17], seed=3), SamplingParams(max_new_tokens=4)
  out = {'cpu': make_engine('gqa').generate(ps, sampling),  # the session's shared step
         'xla': make_engine('gqa', step_fn=CompiledStep(cfg, return_logits=True,
                                                        linear_impl='xla')).generate(ps, sampling)}
  for a, b in zip(out['cpu'], out['xla']):
    assert a.output_ids == b.output_ids
    np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), atol=2e-5, rtol=0)
  # An untied head runs through the kernel as a Dense kernel [D, V].
  untied = ModelConfig(vocab_size=97, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=16, ffn_dim=64, max_seq_len=64, tie_embeddings=False)
  params = init_params(untied, seed=2)
  tokens = jnp.asarray([[3, 1, 4, 1, 5]])
  logits = {impl: Llama(untied, linear_impl=impl).apply(params, tokens, jnp.arange(5)[None])[0]
            for impl in ('cpu', 'xla')}
  np.testing.assert_allclose(np.asarray(logits['cpu']), np.asarray(logits['xla']), atol=2e-5)


@needs_kernel
@pytest.mark.parametrize('isa', linear_cpu.ISAS)
def test_packed_weights_match_the_oracle_and_the_in_place_kernel(isa):
  """pack(w) (strips of strip() columns, the last one zero-padded: N 67, 203, 5, 24) read by the
  kernel at 1-64 rows (every tile height: 8-row tiles, the last 1-7 rows, 1-4 rows as r x 3) and
  odd K, in every copy of the kernel this CPU runs (baseline, AVX2: strips of 8; AVX-512: strips
  of 16, 16 x 1 tiles): within float32 rounding of the float64 oracle, and from 3 rows bit for bit
  the in-place kernel's result (the same sums); a Packed runs the kernel through `linear` at any
  row count, unpacks to w, the transposed head packs as its transpose, and a Packed made for
  another copy's strip width is refused."""
  best = linear_cpu.isa()
  if linear_cpu.ISAS.index(isa) > linear_cpu.ISAS.index(best):
    pytest.skip(f'this CPU runs the {best} copy at best, not {isa}')
  other = None if isa == best else linear_cpu.pack(np.ones((4, 48), np.float32))
  try:
    assert linear_cpu.use_isa(isa) == isa
    assert linear_cpu.strip() == (16 if isa == 'avx512' else 8)
    _check_packed(other)
  finally:
    linear_cpu.use_isa(best)


def _check_packed(other):
  rng = np.random.default_rng(5)
  packed, in_place = jax.jit(linear_cpu.kernel), jax.jit(linear_cpu.kernel)
  for rows, k, n in ((1, 37, 67), (2, 64, 203), (3, 300, 24), (4, 37, 67), (5, 64, 5),
                     (8, 300, 203), (9, 37, 24), (13, 64, 67), (17, 576, 192), (32, 37, 203),
                     (64, 64, 24)):
    x = rng.standard_normal((rows, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    p = linear_cpu.pack(w)
    s = linear_cpu.strip()
    assert p.strips.shape == (-(-n // s), k, s) and p.shape == (k, n) and p.strip == s
    got = np.asarray(packed(x, p))
    bound = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert got.shape == (rows, n)
    assert np.all(np.abs(got - _oracle(x, w, False)) <= 1e-6 * bound + 1e-30), (rows, k, n)
    if rows >= 3:
      assert np.array_equal(got, np.asarray(in_place(x, w))), (rows, k, n)
  assert np.array_equal(np.asarray(p.unpack()), w)
  lowered = lambda f, *a: jax.jit(f).lower(*a).as_text()
  for rows in (1, linear_cpu.MAX_ROWS + 1):
    assert linear_cpu.TARGET in lowered(linear_cpu.linear, jnp.ones((rows, 64)), p)
  e = rng.standard_normal((203, 37), np.float32)  # a tied embedding [V, D] as the head
  x = rng.standard_normal((8, 37), np.float32)
  np.testing.assert_array_equal(np.asarray(packed(x, linear_cpu.pack(e, transposed=True))),
                                np.asarray(in_place(x, np.ascontiguousarray(e.T))))
  with pytest.raises(ValueError, match='packed w'):
    linear_cpu.kernel(jnp.ones((2, 36)), p)
  with pytest.raises(ValueError, match='transposed=True is not allowed'):
    linear_cpu.linear(jnp.ones((2, 64)), p, transposed=True)
  with pytest.raises(ValueError, match='2-D float32'):
    linear_cpu.pack(jnp.ones((4, 8), jnp.bfloat16))
  if other is not None and other.strip != linear_cpu.strip():  # packed for the best copy
    with pytest.raises(Exception, match='packed w'):
      np.asarray(linear_cpu.kernel(jnp.ones((2, 4)), other))


@needs_kernel
def test_packed_per_layer_params_give_the_in_place_logits():
  """linear_impl='cpu_packed': the step's per-layer params (what decode calls, which run the
  layers unrolled, take) hold every Dense kernel as a Packed copy (llama.per_layer_params(
  pack=True)), made once per params object, and the tied head as the embedding's packed
  transpose (the embedding the same object, for the lookup); nn.Dense takes them, and the
  unrolled model's logits and greedy tokens over 3 x 4 tokens (12 rows) equal the
  stacked in-place model's within float32 rounding."""
  cfg, params, _ = tiny('gqa')
  step = CompiledStep(cfg, linear_impl='cpu_packed')
  split = step._per_layer(params)  # pylint: disable=protected-access
  assert split is step._per_layer(params)  # pylint: disable=protected-access
  is_packed = lambda x: isinstance(x, linear_cpu.Packed)
  leaves = jax.tree_util.tree_leaves(split['params']['layer_0'], is_leaf=is_packed)
  # every Dense kernel whose N is a multiple of the strip width (the tiny model's k / v, N = 24,
  # stay in place with strips of 16)
  kernels = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(
      params['params']['layers']) if path[-1].key == 'kernel']
  packable = sum(leaf.shape[-1] % linear_cpu.strip() == 0 for leaf in kernels)
  assert len(kernels) == 7 and sum(map(is_packed, leaves)) == packable > 0
  assert split['params']['embed'] is params['params']['embed']
  assert split['params']['packed_head'].shape == params['params']['embed']['embedding'].shape[::-1]
  unpacked = CompiledStep(cfg, linear_impl='cpu')
  assert not unpacked._per_layer.pack  # pylint: disable=protected-access
  tokens = jnp.asarray([[3, 1, 4, 1], [5, 9, 2, 6], [5, 3, 5, 8]])
  positions = jnp.broadcast_to(jnp.arange(4), tokens.shape)
  packed = jax.jit(lambda p: Llama(cfg, layer_loop='unrolled', linear_impl='cpu_packed').apply(
      p, tokens, positions)[0])(split)
  in_place = jax.jit(lambda p: Llama(cfg, linear_impl='cpu').apply(p, tokens, positions)[0])(
      params)
  np.testing.assert_allclose(np.asarray(packed), np.asarray(in_place), atol=2e-5, rtol=0)
  assert (np.asarray(packed).argmax(-1) == np.asarray(in_place).argmax(-1)).all()
