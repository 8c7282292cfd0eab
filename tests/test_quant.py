"""KV storage schemes (pagedjax/device/kv_schemes.py) and their arithmetic (kv_quant.py).

One table, SCHEMES, drives the per-scheme checks: the pool's arrays and bytes, a chunked
write/read round trip through the pool (what attention reads, and that attention really reads
it), and an engine run against the dense no-cache forward pass. A new format adds one entry.
Around it: exact bounds of the codecs on random data, exact int4 packing, KIVI's per-channel keys
(better on outlier channels, quantized once per full block), and spec validation. That what a
pool stores and reads does not depend on the path that wrote it is checked here per scheme;
tests/test_scheme_identity.py checks the engine's greedy tokens over schemes and policies."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.device import kv_quant as codecs
from pagedjax.device import pool as pool_lib
from pagedjax.device.kv_schemes import KVQuantConfig, SymmetricScheme
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.scheduling.step_inputs import RowSpec, build_step_inputs
from tiny_models import dense_logits, make_engine, prompts

HEAD_DIM = 12  # the tiny test model's (tiny_models.py): one group size serves every check
WINDOW = 4  # recent window of the windowed entries: contexts grow past it, so rings and blocks
            # are both read


@dataclasses.dataclass(frozen=True)
class Scheme:
  spec: KVQuantConfig
  kernel_native: bool  # attention hands the pool straight to the kernels
  read_tol: float      # round trip: max |read - written| / max |written|, keys and values
  logits_atol: float   # engine logits against the dense forward (tiny model, logits ~0.6)


SCHEMES = {
    'float32': Scheme(KVQuantConfig('float32'), True, 0.0, 1e-4),
    'bfloat16': Scheme(KVQuantConfig('bfloat16'), True, 2.0 ** -8, 5e-3),
    'int8': Scheme(KVQuantConfig('int8'), True, 0.01, 0.015),
    'fp8_e4m3': Scheme(KVQuantConfig('fp8_e4m3'), True, 0.07, 0.05),
    'fp8_e5m2': Scheme(KVQuantConfig('fp8_e5m2'), False, 0.13, 0.15),
    'int4': Scheme(KVQuantConfig('int4', group_size=6), False, 0.2, 0.1),
    'int4_kivi': Scheme(KVQuantConfig('int4', group_size=6, key_per_channel=True), False, 0.2,
                        0.1),
    'int8_window': Scheme(KVQuantConfig('int8', recent_window=WINDOW), False, 0.01, 0.015),
    'int4_kivi_window': Scheme(KVQuantConfig('int4', group_size=6, key_per_channel=True,
                                             recent_window=WINDOW), False, 0.2, 0.1),
}
each_scheme = pytest.mark.parametrize('name', list(SCHEMES))

X = np.random.default_rng(0).normal(size=(64, 3, 16, 64)).astype(np.float32) * 2.0
X[..., 5] *= 20.0  # an outlier channel, as real keys have


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def rms_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


# ---- the table: arrays and bytes ----------------------------------------------------------


@each_scheme
def test_pool_arrays_follow_the_scheme(name):
  case = SCHEMES[name]
  dims = (2, 5, 3, 8, HEAD_DIM)
  pool = pool_lib.init_pool(*dims, kv_quant=case.spec, max_sequences=2)
  scheme = pool.scheme
  assert scheme.kernel_native == case.kernel_native
  assert scheme.is_quantized == case.spec.is_quantized
  assert scheme.recent_window == case.spec.recent_window
  assert pool.nbytes == pool_lib.pool_bytes(*dims, case.spec, max_sequences=2)
  assert pool.k.shape[:4] == (2, 5, 3, 8)  # [layers, blocks, kv_heads, block_size, ...]
  for field, x in pool.block_arrays().items():
    assert x.shape[:3] == (2, 5, 3), field  # block axis 1, KV heads axis 2
    if field.endswith(('_scale', '_zero')):
      assert x.dtype == scheme.scale_dtype == jnp.float16, field
  assert (scheme.scale_dtype is None) == (not case.spec.is_quantized)
  assert (pool.recent_k is not None) == bool(case.spec.recent_window)


def test_pool_bytes_count_scales():
  dims = (30, 100, 3, 16, 64)
  f32 = pool_lib.pool_bytes(*dims, KVQuantConfig('float32'))
  bf16 = pool_lib.pool_bytes(*dims, KVQuantConfig('bfloat16'))
  int8 = pool_lib.pool_bytes(*dims, KVQuantConfig('int8'))
  int4 = pool_lib.pool_bytes(*dims, KVQuantConfig('int4', group_size=32))
  kivi = pool_lib.pool_bytes(*dims, KVQuantConfig('int4', group_size=32, key_per_channel=True))
  window = pool_lib.pool_bytes(*dims, KVQuantConfig('int8', recent_window=8), max_sequences=4)
  assert bf16 * 2 == f32
  assert int8 == bf16 // 2 + 2 * 30 * 100 * 3 * 16 * 2  # + one float16 scale per token-head
  assert int4 == bf16 // 4 + 2 * 2 * 30 * 100 * 3 * 16 * 2 * 2  # + scale, zero per 32 channels
  # KIVI keys: a scale and zero point per channel per block instead of per token and group,
  # an int32 copy-on-write source per block and KV head, and per lane (only the null lane here)
  # a bfloat16 tail of one block's keys and its int32 block tag, per layer and KV head.
  per_block = 2 * 30 * 100 * 3 * 64 * 2 + 100 * 3 * 4
  per_lane = 30 * 3 * (16 * 64 * 2 + 4)
  assert kivi == int4 - 2 * 30 * 100 * 3 * 16 * 2 * 2 + per_block + per_lane
  assert pool_lib.pool_bytes(*dims, KVQuantConfig('int4', group_size=32, key_per_channel=True),
                             max_sequences=4) == kivi + 4 * per_lane
  assert window == int8 + 2 * 30 * 5 * 3 * 8 * 64 * 2  # bfloat16 rings, lanes 0..4
  small = pool_lib.init_pool(2, 5, 3, 16, 64, kv_quant=KVQuantConfig('int4'))
  assert small.nbytes == pool_lib.pool_bytes(2, 5, 3, 16, 64, KVQuantConfig('int4'))


@each_scheme
def test_bytes_per_token_and_per_lane_add_up_to_the_pool(name):
  """KVScheme.bytes_per_token (every per-block array over block_size) and bytes_per_lane (the
  fixed per-sequence arrays) account for every byte of the pool, and KVPool agrees."""
  spec = SCHEMES[name].spec
  dims = (2, 5, 3, 8, HEAD_DIM)
  scheme = pool_lib.init_pool(*dims, kv_quant=spec, max_sequences=2).scheme
  per_token = scheme.bytes_per_token(2, 3, 8, HEAD_DIM)
  per_lane = scheme.bytes_per_lane(2, 3, 8, HEAD_DIM)
  assert pool_lib.pool_bytes(*dims, spec, max_sequences=2) == 5 * 8 * per_token + 3 * per_lane
  pool = pool_lib.init_pool(*dims, kv_quant=spec, max_sequences=2)
  assert pool.bytes_per_token == per_token
  assert (per_lane > 0) == bool(spec.recent_window or spec.key_per_channel)


# ---- the table: chunked writes, reads, and attention over what is read ----------------------

HEADS, Q_HEADS, BLOCK = 2, 4, 8
TABLE = [5, 2, 7, 1, 8]  # physical blocks out of order


@jax.jit
def _write_attend_read(pool, k, v, q, inputs):
  """One step on layer 0: attention's output (pool.write_and_attend), the pool after the write,
  and what each query reads: keys and values [B, T, S, H, D] over the row's slots (a scheme
  with a per-query view reads some slots unquantized; jitted once per scheme and shape for
  the whole file)."""
  out, written = pool_lib.write_and_attend(pool, 0, q, k, v, inputs.positions, inputs,
                                           'reference')
  scheme = pool.scheme
  if scheme.per_query_view:
    _, (k_lo, v_lo, k_hi, v_hi) = scheme.write_view(pool, 0, k, v, inputs)
    key_hi, value_hi = scheme.recent_masks(inputs.positions, k_lo.shape[1], BLOCK)
  else:
    flat = lambda x: jnp.swapaxes(x, 2, 3).reshape(x.shape[0], -1, HEADS, HEAD_DIM)
    k_lo, v_lo = (flat(x) for x in scheme.read(written, 0, inputs))
    k_hi, v_hi = k_lo, v_lo
    key_hi = value_hi = jnp.zeros(inputs.positions.shape + k_lo.shape[1:2], bool)
  pick = lambda mask, hi, lo: jnp.where(mask[..., None, None], hi[:, None], lo[:, None])
  return written, out, pick(key_hi, k_hi, k_lo), pick(value_hi, v_hi, v_lo)


@jax.jit
def _dequantize_blocks(pool, tables):
  """Layer 0's blocks in `tables`, dequantized (pool.dequantize_blocks in one program per
  scheme, not op by op)."""
  return pool_lib.dequantize_blocks(pool, 0, tables)


def _attention(q, k, v, positions):
  """float64 causal attention of q [T, Hq, D] at `positions`, query t over its own k[t], v[t]
  [S, H, D]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  k, v = (np.repeat(x, Q_HEADS // HEADS, axis=2) for x in (k, v))
  scores = np.einsum('thd,tshd->hts', q, k) / np.sqrt(q.shape[-1])
  scores = np.where(np.arange(k.shape[1]) <= positions[:, None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  return np.einsum('hts,tshd->thd', probs / probs.sum(-1, keepdims=True), v)


def _pool_round_trip(spec, chunks, seed=0):
  """Write `sum(chunks)` tokens of one sequence chunk by chunk, checking after every chunk that
  attention equals attention over what the scheme reads. Every chunk is padded to 16 tokens (one
  program per scheme; the engine test below runs single-token steps). Returns a dict: the
  written keys and values, what the newest query reads for them (seen_k, seen_v), what the
  blocks hold for the tokens of the full blocks (held_k, held_v), each [tokens, H, D]; the
  attention output of every query (out [tokens, Hq, D]), and the pool."""
  pool = pool_lib.init_pool(1, 9, HEADS, BLOCK, HEAD_DIM, kv_quant=spec, max_sequences=1)
  total = sum(chunks)
  rng = np.random.default_rng(seed)
  keys = rng.normal(size=(total, HEADS, HEAD_DIM)).astype(np.float32)
  keys[..., 3] *= 10.0  # an outlier channel
  values = rng.normal(size=(total, HEADS, HEAD_DIM)).astype(np.float32)
  queries = rng.normal(size=(total, Q_HEADS, HEAD_DIM)).astype(np.float32)
  dense = lambda x: np.swapaxes(np.asarray(x)[0], 1, 2).reshape(-1, HEADS, HEAD_DIM)
  start, outs = 0, []
  for n in chunks:
    inputs = build_step_inputs([RowSpec(list(range(n)), start, TABLE, lane=1)], BLOCK, [1],
                               [16], [8])
    pad = lambda x: np.pad(x[start:start + n], ((0, 16 - n), (0, 0), (0, 0)))[None]
    pool, out, seen_k, seen_v = _write_attend_read(pool, pad(keys), pad(values), pad(queries),
                                                   inputs)
    # Sliced as numpy: a device array's slice of each new (n, start) would compile its own op.
    out, seen_k, seen_v = (np.asarray(x)[0, :n] for x in (out, seen_k, seen_v))
    seen_k, seen_v = seen_k[:, :start + n], seen_v[:, :start + n]
    want = _attention(queries[start:start + n], seen_k, seen_v, np.arange(start, start + n))
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    outs.append(out)
    start += n
  held_k, held_v = _dequantize_blocks(pool, np.asarray(TABLE)[None])
  full = total // BLOCK * BLOCK
  return dict(keys=keys, values=values, seen_k=seen_k[-1], seen_v=seen_v[-1],
              held_k=dense(held_k)[:full], held_v=dense(held_v)[:full],
              out=np.concatenate(outs), pool=pool)


@each_scheme
def test_pool_round_trip(name):
  case = SCHEMES[name]
  # Prefill 11 tokens, then decode 6 one at a time: blocks of 8 are filled across steps.
  r = _pool_round_trip(case.spec, [11, 1, 1, 1, 1, 1, 1])
  keys, values, seen_k, seen_v, held_k, held_v = (
      r[name] for name in ('keys', 'values', 'seen_k', 'seen_v', 'held_k', 'held_v'))
  full = len(held_k)
  for got, want in ((seen_k, keys), (held_k, keys[:full]), (seen_v, values),
                    (held_v, values[:full])):
    assert rel_err(got, want) <= case.read_tol
  window = case.spec.recent_window
  bf16 = lambda x: x.astype(jnp.bfloat16).astype(np.float32)
  if window:  # the newest tokens are read from the bfloat16 rings, the rest from the blocks
    np.testing.assert_array_equal(seen_k[-window:], bf16(keys[-window:]))
    np.testing.assert_array_equal(seen_v[-window:], bf16(values[-window:]))
    np.testing.assert_array_equal(seen_k[:-window], held_k[:len(keys) - window])
  else:
    np.testing.assert_array_equal(seen_k[:full], held_k)
    np.testing.assert_array_equal(seen_v[:full], held_v)
  if case.spec.key_per_channel and not window:  # its own (partial) block's keys: bfloat16
    np.testing.assert_array_equal(seen_k[full:], bf16(keys[full:]))


# The same 17 tokens written by different paths: a prefill chunk and a decode, chunks ending
# mid-block, a prefill followed by single-token decodes.
WRITE_PATHS = ([16, 1], [3, 6, 8], [11, 1, 1, 1, 1, 1, 1])


@each_scheme
def test_what_is_stored_and_read_does_not_depend_on_the_write_path(name):
  """A full block's arrays are a function of its tokens alone, and so is what attention reads
  for every token, the partial last block's included: greedy tokens cannot change under
  preemption (recompute writes a prefix as one chunk), prefix caching or forks because of how
  the pool was written. (KIVI keys used to be requantized as a block filled, so its codes
  depended on the path.)"""
  runs = [_pool_round_trip(SCHEMES[name].spec, chunks) for chunks in WRITE_PATHS]
  first = runs[0]
  full_blocks = TABLE[:len(first['held_k']) // BLOCK]
  for run, chunks in zip(runs[1:], WRITE_PATHS[1:]):
    for field, x in first['pool'].block_arrays().items():
      np.testing.assert_array_equal(np.asarray(getattr(run['pool'], field))[:, full_blocks],
                                    np.asarray(x)[:, full_blocks], err_msg=f'{field} {chunks}')
    for what in ('seen_k', 'seen_v'):
      np.testing.assert_array_equal(run[what], first[what], err_msg=f'{what} {chunks}')
    # Every query's attention output, whichever step held it (float noise only: the same
    # query sits at another row of the padded chunk).
    np.testing.assert_allclose(run['out'], first['out'], atol=1e-6, rtol=0, err_msg=str(chunks))


def test_kivi_keys_are_quantized_once_per_full_block():
  """A full block's KIVI keys are exactly the per-channel quantization of its tokens' bfloat16
  keys (the tail keeps them unquantized until the block is full)."""
  r = _pool_round_trip(SCHEMES['int4_kivi'].spec, [3, 1, 1, 1, 1, 1, 1, 1, 1, 1])
  bf16 = r['keys'][:BLOCK].astype(jnp.bfloat16).astype(np.float32)  # [bs, H, D]
  once = _int4_channels(np.swapaxes(bf16, 0, 1), np.ones((HEADS, BLOCK), bool))
  np.testing.assert_array_equal(r['held_k'][:BLOCK], np.swapaxes(np.asarray(once), 0, 1))


# ---- the table: the engine against the dense forward ----------------------------------------


@each_scheme
def test_engine_logits_match_dense(name):
  """Prompts fed one token per step and decoded together: every step is one [2 rows, 1 token]
  program, so each scheme compiles once. Blocks of 4 spread the contexts (up to 9 tokens) over
  three blocks, and past the recent window."""
  case = SCHEMES[name]
  engine = make_engine(kv_quant=case.spec, block_size=4, num_blocks=16, max_batch_size=2,
                       prefill_chunk=1)
  done = engine.generate(prompts([6, 3], seed=21), SamplingParams(max_new_tokens=4))
  for c in done:
    assert len(c.output_ids) == 4
    np.testing.assert_allclose(np.stack(c.logits), dense_logits('gqa', c),
                               atol=case.logits_atol, rtol=0)


# ---- codecs (each check one jitted call: op-by-op dispatch costs seconds here) --------------


@functools.partial(jax.jit, static_argnums=1)
def _symmetric(x, code_dtype):
  codes, scale = codecs.quantize_symmetric(x, code_dtype)
  return scale, codecs.dequantize_symmetric(codes, scale)


@pytest.mark.parametrize('kv_dtype,bound', [
    # Max error per vector, relative to that vector's amax: half a step of the grid.
    ('int8', 0.5 / 127), ('fp8_e4m3', 2.0 ** -4), ('fp8_e5m2', 2.0 ** -3)])
def test_symmetric_round_trip_bounds(kv_dtype, bound):
  scale, back = _symmetric(X, SymmetricScheme(kv_dtype).code_dtype)
  assert scale.dtype == jnp.float16 and scale.shape == X.shape[:-1]
  amax = np.max(np.abs(X), axis=-1, keepdims=True)
  assert np.max(np.abs(back - X) / amax) <= bound * 1.01 + 1e-3  # + f16 scale rounding


def test_int4_packing_is_exact():
  codes = np.random.default_rng(1).integers(0, 16, (5, 7, 64)).astype(np.uint8)
  packed, unpacked = jax.jit(lambda c: (lambda p: (p, codecs.unpack_int4(p)))(
      codecs.pack_int4(c)))(codes)
  assert packed.shape == (5, 7, 32) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(unpacked, codes)
  # Channel 2i is the low nibble of byte i.
  np.testing.assert_array_equal(packed[..., 0] & 0xF, codes[..., 0])
  np.testing.assert_array_equal(packed[..., 0] >> 4, codes[..., 1])


@functools.partial(jax.jit, static_argnums=1)
def _int4_groups(x, group_size):
  return codecs.dequantize_int4_groups(*codecs.quantize_int4_groups(x, group_size))


@jax.jit
def _int4_channels(x, valid):
  return codecs.dequantize_int4_channels(*codecs.quantize_int4_channels(x, valid))


@pytest.mark.parametrize('group_size', [16, 32, 64])
def test_int4_group_round_trip_bound(group_size):
  back = np.asarray(_int4_groups(X, group_size))
  grouped = X.reshape(*X.shape[:-1], -1, group_size)
  step = (grouped.max(-1) - grouped.min(-1)) / 15
  err = np.abs(back - X).reshape(grouped.shape).max(-1)
  assert np.all(err <= step * 0.5 * 1.01 + 2e-3)


def test_kivi_keys_beat_per_token_keys_on_outlier_channels():
  per_token = _int4_groups(X, 64)
  per_channel = _int4_channels(X, np.ones(X.shape[:-1], bool))
  assert rms_err(per_channel, X) < rms_err(per_token, X) / 2


def test_per_channel_ignores_invalid_slots():
  poisoned = X.copy()
  poisoned[:, :, 10:] = np.nan
  valid = np.broadcast_to(np.arange(16) < 10, X.shape[:-1])
  scale, zero = jax.jit(lambda x, m: codecs.quantize_int4_channels(x, m)[1:])(poisoned, valid)
  assert np.all(np.isfinite(scale)) and np.all(np.isfinite(zero))
  back = _int4_channels(poisoned, valid)[:, :, :10]
  clean = _int4_channels(X[:, :, :10], valid[:, :, :10])
  np.testing.assert_allclose(back, clean, atol=1e-6)


# ---- specs -----------------------------------------------------------------------------------


@pytest.mark.parametrize('spec,message', [
    (KVQuantConfig('int3'), r"kv_dtype='int3' is not allowed: one of \('float32'"),
    (KVQuantConfig('int4', group_size=24), r'group_size=24 is not allowed: it must '
                                           r'divide head_dim=64, one of \[1, 2, 4, 8'),
    (KVQuantConfig('int8', key_per_channel=True), 'only defined for kv_dtype int4'),
    (KVQuantConfig('bfloat16', recent_window=8), 'recent_window=8 needs a quantized kv_dtype'),
    (KVQuantConfig('int8', recent_window=-1), 'recent_window=-1 is not allowed'),
])
def test_bad_combinations_rejected(spec, message):
  with pytest.raises(ValueError, match=message):
    spec.validate(64)
