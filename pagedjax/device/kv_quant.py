"""KV quantization arithmetic: codes, scales and zero points for arrays of K or V vectors.

Pure jnp functions over plain arrays, with no knowledge of the pool: the storage schemes
(kv_schemes.py) call them when they write K/V into the pool and when attention reads it back.

  symmetric           one scale per vector (the last axis): s = amax / code max rounded to
                      float16, codes x / s rounded and clipped (integer codes) or cast (float8)
  int4 groups         asymmetric: scale and zero point per group of `group_size` channels of a
                      vector, 4-bit codes packed two per byte
  int4 channels       asymmetric per channel over the vectors of a full block (KIVI keys)
Scales and zero points are float16.
"""
import jax.numpy as jnp

SCALE_DTYPE = jnp.float16
_TINY = 1e-8  # floor for scales, so an all-zero group does not divide by zero


# ---- symmetric per vector (int8, fp8) --------------------------------------------------------


def code_max(code_dtype) -> float:
  """Largest code magnitude: 127 for int8, the largest finite value for a float8 type."""
  code_dtype = jnp.dtype(code_dtype)
  if jnp.issubdtype(code_dtype, jnp.integer):
    return float(jnp.iinfo(code_dtype).max)
  return float(jnp.finfo(code_dtype).max)


def quantize_symmetric(x, code_dtype):
  """x [..., D] -> (codes [..., D] of code_dtype, scale [...] float16), one scale per vector.
  Integer codes are rounded to nearest and clipped to +-code max; float8 codes are a cast."""
  code_dtype = jnp.dtype(code_dtype)
  qmax = code_max(code_dtype)
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=-1)
  scale = jnp.maximum(amax / qmax, _TINY).astype(SCALE_DTYPE)
  scaled = x / scale.astype(jnp.float32)[..., None]
  if jnp.issubdtype(code_dtype, jnp.integer):
    q = jnp.clip(jnp.round(scaled), -qmax, qmax).astype(code_dtype)
  else:
    q = scaled.astype(code_dtype)
  return q, scale


def dequantize_symmetric(q, scale):
  return q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


# ---- int4: packing and asymmetric ranges ----------------------------------------------------


def pack_int4(q):
  """q [..., D] integers in [0, 15] -> uint8 [..., D/2]; channel 2i in the low nibble."""
  q = q.astype(jnp.uint8)
  return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed):
  """uint8 [..., D/2] -> uint8 [..., D] in [0, 15]."""
  low, high = packed & 0xF, packed >> 4
  return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _asymmetric_codes(x, lo, hi):
  scale = jnp.maximum((hi - lo) / 15.0, _TINY).astype(SCALE_DTYPE)
  zero = lo.astype(SCALE_DTYPE)
  codes = jnp.round((x - zero.astype(jnp.float32)) / scale.astype(jnp.float32))
  return jnp.clip(codes, 0, 15), scale, zero


def quantize_int4_groups(x, group_size):
  """Per-vector groups along the last axis: x [..., D] -> (packed [..., D/2],
  scale [..., D/g], zero [..., D/g])."""
  x = x.astype(jnp.float32)
  grouped = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
  codes, scale, zero = _asymmetric_codes(grouped, grouped.min(-1, keepdims=True),
                                         grouped.max(-1, keepdims=True))
  return pack_int4(codes.reshape(x.shape)), scale[..., 0], zero[..., 0]


def dequantize_int4_groups(packed, scale, zero):
  codes = unpack_int4(packed).astype(jnp.float32)
  group_size = codes.shape[-1] // scale.shape[-1]
  grouped = codes.reshape(*codes.shape[:-1], scale.shape[-1], group_size)
  out = grouped * scale.astype(jnp.float32)[..., None] + zero.astype(jnp.float32)[..., None]
  return out.reshape(codes.shape)


def quantize_int4_channels(x, valid=None):
  """KIVI keys. x [..., S, D] (S tokens of a block), valid [..., S] bool (None: all): one scale
  and zero per channel over the valid tokens -> (packed [..., S, D/2], scale [..., D],
  zero [..., D]). Invalid slots do not widen the range and are stored as code 0."""
  x = x.astype(jnp.float32)
  if valid is None:
    valid = jnp.ones(x.shape[:-1], bool)
  mask = valid[..., None]
  lo = jnp.min(jnp.where(mask, x, jnp.inf), axis=-2, keepdims=True)
  hi = jnp.max(jnp.where(mask, x, -jnp.inf), axis=-2, keepdims=True)
  any_valid = jnp.any(mask, axis=-2, keepdims=True)
  lo, hi = jnp.where(any_valid, lo, 0.0), jnp.where(any_valid, hi, 0.0)
  codes, scale, zero = _asymmetric_codes(jnp.where(mask, x, lo), lo, hi)
  return pack_int4(codes), scale[..., 0, :], zero[..., 0, :]


def dequantize_int4_channels(packed, scale, zero):
  codes = unpack_int4(packed).astype(jnp.float32)
  return codes * scale.astype(jnp.float32)[..., None, :] + zero.astype(jnp.float32)[..., None, :]
