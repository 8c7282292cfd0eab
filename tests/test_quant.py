"""KV quantization schemes: round-trip bounds on random data, exact int4 packing, and the pool's
quantize-on-write (including KIVI per-channel keys written a few tokens at a time)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.device import pool as pool_lib
from pagedjax.device import kv_quant as quant
from pagedjax.host.step_inputs import RowSpec, build_step_inputs

X = jax.random.normal(jax.random.PRNGKey(0), (64, 3, 16, 64)) * 2.0
X = X.at[..., 5].multiply(20.0)  # an outlier channel, as real keys have


def rel_err(got, want):
  return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


@pytest.mark.parametrize('kv_dtype,bound', [
    # Max error per vector, relative to that vector's amax: half a step of the grid.
    ('int8', 0.5 / 127), ('fp8_e4m3', 2.0 ** -4), ('fp8_e5m2', 2.0 ** -3)])
def test_symmetric_round_trip_bounds(kv_dtype, bound):
  q, scale = quant.quantize_symmetric(X, kv_dtype)
  assert scale.dtype == jnp.float16 and scale.shape == X.shape[:-1]
  back = quant.dequantize_symmetric(q, scale)
  amax = jnp.max(jnp.abs(X), axis=-1, keepdims=True)
  assert float(jnp.max(jnp.abs(back - X) / amax)) <= bound * 1.01 + 1e-3  # + f16 scale rounding


def test_int4_packing_is_exact():
  codes = jax.random.randint(jax.random.PRNGKey(1), (5, 7, 64), 0, 16).astype(jnp.uint8)
  packed = quant.pack_int4(codes)
  assert packed.shape == (5, 7, 32) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(quant.unpack_int4(packed), codes)
  # Channel 2i is the low nibble of byte i.
  np.testing.assert_array_equal(packed[..., 0] & 0xF, codes[..., 0])
  np.testing.assert_array_equal(packed[..., 0] >> 4, codes[..., 1])


@pytest.mark.parametrize('group_size', [16, 32, 64])
def test_int4_group_round_trip_bound(group_size):
  packed, scale, zero = quant.quantize_int4_groups(X, group_size)
  back = quant.dequantize_int4_groups(packed, scale, zero)
  grouped = X.reshape(*X.shape[:-1], -1, group_size)
  step = (grouped.max(-1) - grouped.min(-1)) / 15
  err = jnp.abs(back - X).reshape(grouped.shape).max(-1)
  assert bool(jnp.all(err <= step * 0.5 * 1.01 + 2e-3))


def rms_err(got, want):
  return float(jnp.sqrt(jnp.mean((got - want) ** 2) / jnp.mean(want ** 2)))


def test_kivi_keys_beat_per_token_keys_on_outlier_channels():
  per_token = quant.dequantize_int4_groups(*quant.quantize_int4_groups(X, 64))
  valid = jnp.ones(X.shape[:-1], bool)
  per_channel = quant.dequantize_int4_channels(*quant.quantize_int4_channels(X, valid))
  assert rms_err(per_channel, X) < rms_err(per_token, X) / 2


def test_per_channel_ignores_invalid_slots():
  poisoned = X.at[:, :, 10:].set(jnp.nan)
  valid = jnp.broadcast_to(jnp.arange(16) < 10, X.shape[:-1])
  packed, scale, zero = quant.quantize_int4_channels(poisoned, valid)
  assert bool(jnp.all(jnp.isfinite(scale))) and bool(jnp.all(jnp.isfinite(zero)))
  back = quant.dequantize_int4_channels(packed, scale, zero)[:, :, :10]
  clean = quant.dequantize_int4_channels(*quant.quantize_int4_channels(X[:, :, :10],
                                                                       valid[:, :, :10]))
  np.testing.assert_allclose(back, clean, atol=1e-6)


@pytest.mark.parametrize('kv_quant,message', [
    (quant.KVQuantConfig('int3'), r"kv_dtype='int3' is not allowed: one of \('float32'"),
    (quant.KVQuantConfig('int4', group_size=24), r'group_size=24 is not allowed: it must '
                                                 r'divide head_dim=64, one of \[1, 2, 4, 8'),
    (quant.KVQuantConfig('int8', key_per_channel=True), 'only defined for kv_dtype int4'),
])
def test_bad_combinations_rejected(kv_quant, message):
  with pytest.raises(ValueError, match=message):
    kv_quant.validate(64)


def _pool_round_trip(kv_quant, chunks, block_size=8, seed=0):
  """Write `sum(chunks)` tokens of one sequence chunk by chunk; return (written keys/values,
  what the pool holds for them dequantized)."""
  layers, heads, dim = 1, 2, 32
  pool = pool_lib.init_pool(layers, 9, heads, block_size, dim, kv_quant=kv_quant)
  total = sum(chunks)
  keys = jax.random.normal(jax.random.PRNGKey(seed), (total, heads, dim))
  keys = keys.at[..., 3].multiply(10.0)
  values = jax.random.normal(jax.random.PRNGKey(seed + 1), (total, heads, dim))
  table = [5, 2, 7, 1, 8]
  start = 0
  write = jax.jit(pool_lib.write_kv)
  for n in chunks:
    inputs = build_step_inputs([RowSpec(list(range(n)), start, table)], block_size, [1, 2],
                               [1, 4, 8, 16], [8])
    pad = inputs.tokens.shape[1] - n
    k = jnp.pad(keys[start:start + n], ((0, pad), (0, 0), (0, 0)))[None]
    v = jnp.pad(values[start:start + n], ((0, pad), (0, 0), (0, 0)))[None]
    pool = write(pool, 0, k, v, inputs)
    start += n
  dense = lambda x: jnp.swapaxes(x, 1, 2).reshape(-1, heads, dim)[:total]  # [tokens, H, D]
  got_k, got_v = pool_lib.dequantize_blocks(pool, 0, jnp.asarray(table))
  return keys, values, dense(got_k), dense(got_v)


@pytest.mark.parametrize('kv_quant,tol', [
    (quant.KVQuantConfig('float32'), 0.0),
    (quant.KVQuantConfig('int8'), 0.01),
    (quant.KVQuantConfig('fp8_e4m3'), 0.07),
    (quant.KVQuantConfig('int4', group_size=16), 0.2),
    (quant.KVQuantConfig('int4', group_size=16, key_per_channel=True), 0.2),
])
def test_pool_holds_quantized_writes(kv_quant, tol):
  # Prefill 11 tokens, then decode 6 one at a time: blocks of 8 are filled across steps.
  keys, values, got_k, got_v = _pool_round_trip(kv_quant, [11, 1, 1, 1, 1, 1, 1])
  assert rel_err(got_k, keys) <= tol
  assert rel_err(got_v, values) <= tol


def test_kivi_incremental_writes_match_one_shot_quantization():
  """Requantizing a block as tokens arrive stays within a small factor of quantizing the
  finished block once (each growth of a channel's range rounds the older codes again)."""
  kv_quant = quant.KVQuantConfig('int4', group_size=16, key_per_channel=True)
  keys, _, incremental, _ = _pool_round_trip(kv_quant, [3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
  _, _, one_shot, _ = _pool_round_trip(kv_quant, [15])
  assert rms_err(incremental, keys) <= 2.0 * rms_err(one_shot, keys)


def test_pool_bytes_count_scales():
  dims = (30, 100, 3, 16, 64)
  f32 = pool_lib.pool_bytes(*dims, quant.KVQuantConfig('float32'))
  bf16 = pool_lib.pool_bytes(*dims, quant.KVQuantConfig('bfloat16'))
  int8 = pool_lib.pool_bytes(*dims, quant.KVQuantConfig('int8'))
  int4 = pool_lib.pool_bytes(*dims, quant.KVQuantConfig('int4', group_size=32))
  assert bf16 * 2 == f32
  assert int8 == bf16 // 2 + 2 * 30 * 100 * 3 * 16 * 2  # + one float16 scale per token-head
  assert int4 == bf16 // 4 + 2 * 2 * 30 * 100 * 3 * 16 * 2 * 2  # + scale, zero per 32 channels
  small = pool_lib.init_pool(2, 5, 3, 16, 64, kv_quant=quant.KVQuantConfig('int4'))
  assert small.nbytes == pool_lib.pool_bytes(2, 5, 3, 16, 64, quant.KVQuantConfig('int4'))
