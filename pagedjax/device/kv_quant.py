"""KV-cache quantization schemes: what is stored per element, per scale, and how to round-trip.

Quantization happens when K/V are written into the pool (pool.py); dequantization happens where
attention reads them. Every scheme here is pure jnp, so it runs inside the jitted step.

Schemes (`pool.kv_dtype`):
  float32, bfloat16   stored as is
  int8                symmetric, one scale per (token, KV head): q = round(x / s), s = amax / 127
  fp8_e4m3, fp8_e5m2  x / s cast to float8, one scale per (token, KV head), s = amax / fp8 max
  int4                asymmetric (scale and zero point), 4 bits packed two per byte.
                      Values: groups of `group_size` channels per token.
                      Keys: the same per-token groups, or with `key_per_channel` (KIVI) one
                      scale/zero per channel over the tokens of a block: keys have outlier
                      channels, so sharing a range across channels wastes most of the 16 levels.
Scales and zero points are stored as float16 and counted in every memory figure.

`recent_window` N (KIVI's full-precision residual): the newest N tokens of every running
sequence are also kept in bfloat16 in a small ring per sequence *lane* (pool.py), and attention
reads them from there instead of from the quantized blocks. Older tokens are read quantized.
"""
import dataclasses
from typing import Optional

import jax.numpy as jnp

FLOAT_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
FP8_DTYPES = {'fp8_e4m3': jnp.float8_e4m3fn, 'fp8_e5m2': jnp.float8_e5m2}
KV_DTYPES = tuple(FLOAT_DTYPES) + ('int8',) + tuple(FP8_DTYPES) + ('int4',)
SCALE_DTYPE = jnp.float16
RECENT_DTYPE = jnp.bfloat16  # the unquantized baseline's storage
_TINY = 1e-8  # floor for scales, so an all-zero group does not divide by zero


@dataclasses.dataclass(frozen=True)
class KVQuantConfig:
  kv_dtype: str = 'float32'
  group_size: int = 32           # int4: channels per scale group (per-token groups)
  key_per_channel: bool = False  # int4: KIVI-style keys, one scale per channel per block
  recent_window: int = 0         # newest tokens of each sequence also kept unquantized (0: off)

  def validate(self, head_dim: Optional[int] = None):
    """head_dim None (not known yet, e.g. before a checkpoint loads) skips the shape checks."""
    if self.kv_dtype not in KV_DTYPES:
      raise ValueError(f'kv_dtype={self.kv_dtype!r} is not allowed: one of {KV_DTYPES}')
    if not isinstance(self.recent_window, int) or self.recent_window < 0:
      raise ValueError(f'recent_window={self.recent_window!r} is not allowed: an integer >= 0')
    if self.recent_window and not self.is_quantized:
      raise ValueError(f'recent_window={self.recent_window} needs a quantized kv_dtype, not '
                       f'{self.kv_dtype!r}')
    if self.kv_dtype == 'int4':
      if not isinstance(self.group_size, int) or self.group_size < 1:
        raise ValueError(f'group_size={self.group_size!r} is not allowed: a positive integer')
      if head_dim is not None and head_dim % self.group_size:
        divisors = [d for d in range(1, head_dim + 1) if head_dim % d == 0]
        raise ValueError(f'group_size={self.group_size} is not allowed: it must divide '
                         f'head_dim={head_dim}, one of {divisors}')
      if head_dim is not None and head_dim % 2:
        raise ValueError(f'head_dim={head_dim}: int4 packs two channels per byte, so it must '
                         'be even')
    elif self.key_per_channel:
      raise ValueError(f'key_per_channel=True is only defined for kv_dtype int4, not '
                       f'{self.kv_dtype!r}')

  @property
  def is_quantized(self) -> bool:
    return self.kv_dtype not in FLOAT_DTYPES


# ---- symmetric per-token (int8, fp8) --------------------------------------------------------


def _qmax(kv_dtype):
  if kv_dtype == 'int8':
    return 127.0
  return float(jnp.finfo(FP8_DTYPES[kv_dtype]).max)


def quantize_symmetric(x, kv_dtype):
  """x [..., D] -> (q [..., D] int8/fp8, scale [...] float16), one scale per vector."""
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=-1)
  scale = jnp.maximum(amax / _qmax(kv_dtype), _TINY).astype(SCALE_DTYPE)
  scaled = x / scale.astype(jnp.float32)[..., None]
  if kv_dtype == 'int8':
    q = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
  else:
    q = scaled.astype(FP8_DTYPES[kv_dtype])
  return q, scale


def dequantize_symmetric(q, scale):
  return q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


# ---- int4: packing and asymmetric groups -----------------------------------------------------


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


def quantize_int4_channels(x, valid):
  """KIVI keys. x [..., S, D] (S tokens of a block), valid [..., S] bool: one scale and zero
  per channel over the valid tokens -> (packed [..., S, D/2], scale [..., D], zero [..., D]).
  Invalid slots (past the sequence's length) do not widen the range and are stored as code 0."""
  x = x.astype(jnp.float32)
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
