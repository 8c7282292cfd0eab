"""KV storage schemes: how the paged pool (pool.py) stores K and V, one class per format.

`KVQuantConfig` is the plain, frozen spec that configs and experiments build
(config.PoolConfig.kv_quant); `scheme_for(spec)` returns the scheme object that implements it.
A scheme owns everything that depends on the format:
  shapes(...)     the pool arrays it stores: field name -> (shape, dtype)
  write(...)      quantize one layer's new K/V and scatter them at the step's slot mapping
  read_blocks(..) the blocks of a block table, dequantized to float32
  read(...)       what attention sees for a batch: its blocks, plus anything kept elsewhere
  kernel_native   whether the attention kernels read its arrays directly (pool.attend), instead
                  of a dequantized copy of the blocks the batch references
  scale_dtype     the dtype of its scales and zero points (None: it has none)
Everything is pure jnp and runs inside the jitted step. A new format is one subclass listed in
FORMATS (plus one entry in tests/test_quant.py's table of schemes): the spec's allowed kv_dtypes,
its validation and the pool all follow from the classes.

Formats (pool layout [layers, blocks, kv_heads, block_size, head_dim], written L, N, H, bs, D):
  FloatScheme      float32, bfloat16: stored as is.
  SymmetricScheme  int8, fp8_e4m3, fp8_e5m2: codes x / s, one float16 scale s = amax / code max
                   per (token, KV head).
  Int4Groups       int4: asymmetric 4-bit codes, two channels per byte, with a float16 scale and
                   zero point per group of `group_size` channels of a token (keys and values).
  Int4KiviKeys     int4 with key_per_channel: values as Int4Groups; keys (KIVI) with one scale
                   and zero point per channel over the tokens of a block. Keys have outlier
                   channels, so sharing a range across channels wastes most of the 16 levels.
  RecentWindow     wraps any quantized format (`recent_window` N, KIVI's full-precision
                   residual): the newest N tokens of every running sequence are also kept in
                   bfloat16 in a small ring per sequence *lane*, and attention reads them from
                   there instead of from the quantized blocks. Older tokens are read quantized.
Scales and zero points are counted in every memory figure (pool.pool_bytes, KVPool.nbytes).

Schemes reach the pool's arrays through the `pool` they are given (a pool.KVPool) and return it
with fields replaced; paging geometry (which slot or block a token lands in, the null block)
comes from the pool's own helpers, `KVPool.at_slots` and `KVPool.blocks_touched`.
"""
import abc
import dataclasses
import math
from typing import Dict, Optional, Tuple

import jax.numpy as jnp

from pagedjax.device import kv_quant as codecs


@dataclasses.dataclass(frozen=True)
class KVQuantConfig:
  """The spec of a pool's storage; `scheme_for` picks the scheme that implements it."""
  kv_dtype: str = 'float32'
  group_size: int = 32           # int4: channels per scale group (per-token groups)
  key_per_channel: bool = False  # int4: KIVI-style keys, one scale per channel per block
  recent_window: int = 0         # newest tokens of each sequence also kept unquantized (0: off)

  def validate(self, head_dim: Optional[int] = None):
    """ValueError naming the bad field first (config.py maps it to its own field name).
    head_dim None (not known yet, e.g. before a checkpoint loads) skips the shape checks."""
    if self.kv_dtype not in KV_DTYPES:
      raise ValueError(f'kv_dtype={self.kv_dtype!r} is not allowed: one of {KV_DTYPES}')
    if not isinstance(self.recent_window, int) or self.recent_window < 0:
      raise ValueError(f'recent_window={self.recent_window!r} is not allowed: an integer >= 0')
    if self.recent_window and not self.is_quantized:
      raise ValueError(f'recent_window={self.recent_window} needs a quantized kv_dtype, not '
                       f'{self.kv_dtype!r}')
    fmt = _format_of(self)
    if fmt is None:  # the only other way no format matches: key_per_channel where undefined
      defined = ', '.join(d for c in FORMATS if c.key_per_channel for d in c.kv_dtypes)
      raise ValueError(f'key_per_channel={self.key_per_channel!r} is only defined for kv_dtype '
                       f'{defined}, not {self.kv_dtype!r}')
    fmt.check(self, head_dim)

  @property
  def is_quantized(self) -> bool:
    return any(c.is_quantized for c in FORMATS if self.kv_dtype in c.kv_dtypes)


def scheme_for(spec: KVQuantConfig) -> 'KVScheme':
  """The scheme that stores a pool as `spec` says (ValueError for a bad spec)."""
  spec.validate()
  if spec.recent_window:
    return RecentWindow.from_spec(spec)
  return _format_of(spec).from_spec(spec)


def _format_of(spec: KVQuantConfig):
  """The FORMATS class storing spec.kv_dtype with spec.key_per_channel, or None."""
  return next((c for c in FORMATS if spec.kv_dtype in c.kv_dtypes
               and c.key_per_channel == bool(spec.key_per_channel)), None)


Shapes = Dict[str, Tuple[Tuple[int, ...], object]]  # pool field name -> (shape, dtype)


class KVScheme(abc.ABC):
  """One storage format of the pool. Concrete formats are frozen dataclasses (hashable, equal by
  value) built from a spec by `from_spec`.

  Arrays are KVPool fields: k and v always; k_scale, v_scale, k_zero, v_zero, recent_k, recent_v
  as the format needs them (`shapes`). Per-block arrays have the block axis at 1 and, like every
  pool array, KV heads at axis 2 (block copies, host transfers and sharding rely on both).
  """
  kv_dtypes: Tuple[str, ...] = ()  # the spec kv_dtype values this format stores
  key_per_channel = False          # the spec key_per_channel value it stores
  is_quantized = True              # stores codes and scales rather than the values
  scale_dtype = codecs.SCALE_DTYPE  # dtype of its scales and zero points; None: it has none
  kernel_native = False            # the kernels read k, v (and k_scale, v_scale) directly
  recent_window = 0                # newest tokens per sequence also kept in per-lane rings

  @classmethod
  @abc.abstractmethod
  def from_spec(cls, spec: KVQuantConfig) -> 'KVScheme':
    """The scheme for a spec this class stores (spec already validated)."""

  @classmethod
  def check(cls, spec: KVQuantConfig, head_dim: Optional[int]) -> None:
    """Format-specific checks of a spec (ValueError naming the field). Most formats have none."""
    del spec, head_dim

  @abc.abstractmethod
  def shapes(self, lead: Tuple[int, int, int, int], head_dim: int, num_lanes: int) -> Shapes:
    """The pool arrays, for lead = (layers, blocks, kv_heads, block_size) and `num_lanes`
    sequence lanes (the null lane 0 included)."""

  @abc.abstractmethod
  def write(self, pool, layer, k, v, batch):
    """The pool with one layer's new K/V [B, T, Hkv, D] stored at batch.slot_mapping."""

  @abc.abstractmethod
  def read_blocks(self, pool, layer, tables):
    """K and V of the blocks in `tables` [B, MB], dequantized: two [B, MB, H, bs, D] float32."""

  def read(self, pool, layer, batch):
    """What attention reads for `batch`: its blocks, dequantized (same shapes as read_blocks)."""
    return self.read_blocks(pool, layer, batch.block_tables)

  def bytes_per_token(self, num_layers: int, num_kv_heads: int, block_size: int,
                      head_dim: int) -> float:
    """Stored bytes per token slot over all layers: every per-block array (codes, scales, zero
    points) of one block, over block_size. Per-lane arrays (recent-window rings) are fixed in
    size and not counted: with no lanes they hold nothing. The one count the pool, sizing.py and
    the simulator share."""
    shapes = self.shapes((num_layers, 1, num_kv_heads, block_size), head_dim, num_lanes=0)
    return sum(math.prod(s) * jnp.dtype(d).itemsize for s, d in shapes.values()) / block_size


@dataclasses.dataclass(frozen=True)
class FloatScheme(KVScheme):
  """K and V stored as is: k, v [L, N, H, bs, D] in float32 or bfloat16. The kernels read them."""
  kv_dtype: str
  DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
  kv_dtypes = tuple(DTYPES)
  is_quantized = False
  scale_dtype = None
  kernel_native = True

  @classmethod
  def from_spec(cls, spec):
    return cls(spec.kv_dtype)

  def shapes(self, lead, head_dim, num_lanes):
    stored = (lead + (head_dim,), self.DTYPES[self.kv_dtype])
    return {'k': stored, 'v': stored}

  def write(self, pool, layer, k, v, batch):
    at = lambda a: pool.at_slots(a, layer, batch)
    return pool.replace(k=at(pool.k).set(k.astype(pool.k.dtype)),
                        v=at(pool.v).set(v.astype(pool.v.dtype)))

  def read_blocks(self, pool, layer, tables):
    return pool.k[layer, tables].astype(jnp.float32), pool.v[layer, tables].astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class SymmetricScheme(KVScheme):
  """Codes k, v [L, N, H, bs, D] with one float16 scale per (token, KV head) in k_scale, v_scale
  [L, N, H, bs]: value = code * scale, scale = amax / code max. int8 codes are rounded and
  clipped; float8 codes are a cast."""
  kv_dtype: str
  # kv_dtype -> (code dtype, whether the attention kernels dequantize such codes themselves:
  # the kernel contract's quantized block dtypes, kernels/contract.py).
  CODES = {'int8': (jnp.int8, True), 'fp8_e4m3': (jnp.float8_e4m3fn, True),
           'fp8_e5m2': (jnp.float8_e5m2, False)}
  kv_dtypes = tuple(CODES)

  @classmethod
  def from_spec(cls, spec):
    return cls(spec.kv_dtype)

  @property
  def code_dtype(self):
    return self.CODES[self.kv_dtype][0]

  @property
  def kernel_native(self) -> bool:
    return self.CODES[self.kv_dtype][1]

  def shapes(self, lead, head_dim, num_lanes):
    codes, scales = (lead + (head_dim,), self.code_dtype), (lead, self.scale_dtype)
    return {'k': codes, 'v': codes, 'k_scale': scales, 'v_scale': scales}

  def write(self, pool, layer, k, v, batch):
    at = lambda a: pool.at_slots(a, layer, batch)
    kq, ks = codecs.quantize_symmetric(k, self.code_dtype)
    vq, vs = codecs.quantize_symmetric(v, self.code_dtype)
    return pool.replace(k=at(pool.k).set(kq), v=at(pool.v).set(vq),
                        k_scale=at(pool.k_scale).set(ks), v_scale=at(pool.v_scale).set(vs))

  def read_blocks(self, pool, layer, tables):
    pick = lambda a: a[layer, tables]
    return (codecs.dequantize_symmetric(pick(pool.k), pick(pool.k_scale)),
            codecs.dequantize_symmetric(pick(pool.v), pick(pool.v_scale)))


@dataclasses.dataclass(frozen=True)
class Int4Groups(KVScheme):
  """Asymmetric 4-bit codes packed two channels per byte, k, v [L, N, H, bs, D/2] uint8 (channel
  2i in the low nibble), with a float16 scale and zero point per group of `group_size` channels
  of a token: v_scale, v_zero [L, N, H, bs, D/g], and k_scale, k_zero the same."""
  group_size: int
  kv_dtypes = ('int4',)

  @classmethod
  def from_spec(cls, spec):
    return cls(spec.group_size)

  @classmethod
  def check(cls, spec, head_dim):
    if not isinstance(spec.group_size, int) or spec.group_size < 1:
      raise ValueError(f'group_size={spec.group_size!r} is not allowed: a positive integer')
    if head_dim is not None and head_dim % spec.group_size:
      divisors = [d for d in range(1, head_dim + 1) if head_dim % d == 0]
      raise ValueError(f'group_size={spec.group_size} is not allowed: it must divide '
                       f'head_dim={head_dim}, one of {divisors}')
    if head_dim is not None and head_dim % 2:
      raise ValueError(f'head_dim={head_dim}: int4 packs two channels per byte, so it must be '
                       'even')

  def _key_range_shape(self, lead, head_dim):
    return lead + (head_dim // self.group_size,)

  def shapes(self, lead, head_dim, num_lanes):
    codes = (lead + (head_dim // 2,), jnp.uint8)
    values = (lead + (head_dim // self.group_size,), self.scale_dtype)
    keys = (self._key_range_shape(lead, head_dim), self.scale_dtype)
    return {'k': codes, 'v': codes, 'k_scale': keys, 'k_zero': keys,
            'v_scale': values, 'v_zero': values}

  def write(self, pool, layer, k, v, batch):
    at = lambda a: pool.at_slots(a, layer, batch)
    vq, vs, vz = codecs.quantize_int4_groups(v, self.group_size)
    pool = pool.replace(v=at(pool.v).set(vq), v_scale=at(pool.v_scale).set(vs),
                        v_zero=at(pool.v_zero).set(vz))
    return self._write_keys(pool, layer, k, batch)

  def _write_keys(self, pool, layer, k, batch):
    at = lambda a: pool.at_slots(a, layer, batch)
    kq, ks, kz = codecs.quantize_int4_groups(k, self.group_size)
    return pool.replace(k=at(pool.k).set(kq), k_scale=at(pool.k_scale).set(ks),
                        k_zero=at(pool.k_zero).set(kz))

  def _dequantize_keys(self, codes, scale, zero):
    return codecs.dequantize_int4_groups(codes, scale, zero)

  def read_blocks(self, pool, layer, tables):
    pick = lambda a: a[layer, tables]
    return (self._dequantize_keys(pick(pool.k), pick(pool.k_scale), pick(pool.k_zero)),
            codecs.dequantize_int4_groups(pick(pool.v), pick(pool.v_scale), pick(pool.v_zero)))


@dataclasses.dataclass(frozen=True)
class Int4KiviKeys(Int4Groups):
  """Values as Int4Groups. Keys (KIVI): one float16 scale and zero point per channel over all the
  tokens of a block, k_scale, k_zero [L, N, H, D]. Since a block's range covers all its tokens,
  every block a step writes into is dequantized, merged with the new keys and requantized over
  its valid tokens; codes of unchanged tokens survive exactly while the range does not grow."""
  key_per_channel = True

  def _key_range_shape(self, lead, head_dim):
    return lead[:3] + (head_dim,)

  def _dequantize_keys(self, codes, scale, zero):
    return codecs.dequantize_int4_channels(codes, scale, zero)

  def _write_keys(self, pool, layer, k, batch):
    bs = pool.block_size
    num_rows, num_new = batch.positions.shape
    start, count, logical, physical = pool.blocks_touched(batch)
    old = codecs.dequantize_int4_channels(pool.k[layer, physical], pool.k_scale[layer, physical],
                                          pool.k_zero[layer, physical])  # [B, span, H, bs, D]
    pos = logical[:, :, None] * bs + jnp.arange(bs)  # [B, span, bs]
    rel = pos - start[:, None, None]
    is_new = (rel >= 0) & (rel < count[:, None, None])
    rows = jnp.arange(num_rows)[:, None, None]
    new = k[rows, jnp.clip(rel, 0, num_new - 1)]  # [B, span, bs, H, D]
    merged = jnp.where(is_new[:, :, None, :, None], jnp.swapaxes(new, 2, 3), old)
    valid = pos < batch.context_lens[:, None, None]
    packed, scale, zero = codecs.quantize_int4_channels(merged, valid[:, :, None, :])
    return pool.replace(k=pool.k.at[layer, physical].set(packed),
                        k_scale=pool.k_scale.at[layer, physical].set(scale),
                        k_zero=pool.k_zero.at[layer, physical].set(zero))


@dataclasses.dataclass(frozen=True)
class RecentWindow(KVScheme):
  """A quantized format plus bfloat16 copies of each sequence's newest `window` tokens, in rings
  recent_k, recent_v [L, lanes, H, window, D]: position p of lane l lives in slot p % window.
  Lane 0 is the null lane (like the null block): padded rows and tokens that will not be among
  the newest `window` write there. The blocks still receive every token in `inner`'s format, so
  a token leaving the window is read quantized with nothing moved. Attention reads a gathered,
  dequantized copy of the batch's blocks with the ring overlaid, so it is never kernel-native."""
  inner: KVScheme
  window: int
  RING_DTYPE = jnp.bfloat16  # the unquantized baseline's storage
  NULL_LANE = 0
  kernel_native = False

  @classmethod
  def from_spec(cls, spec):
    return cls(scheme_for(dataclasses.replace(spec, recent_window=0)), spec.recent_window)

  @property
  def scale_dtype(self):
    return self.inner.scale_dtype

  @property
  def recent_window(self) -> int:
    return self.window

  def shapes(self, lead, head_dim, num_lanes):
    ring = ((lead[0], num_lanes, lead[2], self.window, head_dim), self.RING_DTYPE)
    return {**self.inner.shapes(lead, head_dim, num_lanes), 'recent_k': ring, 'recent_v': ring}

  def write(self, pool, layer, k, v, batch):
    """Ring write, then the inner format's. Only positions still among the newest `window` after
    this step are written to the row's lane, so a chunk longer than the window cannot collide
    with itself; everything else (and padding) goes to the null lane."""
    pos = batch.positions
    keep = (pos >= 0) & (pos >= batch.context_lens[:, None] - self.window)
    lanes = jnp.where(keep, batch.lanes[:, None], self.NULL_LANE)
    at = lambda a: a.at[layer, lanes, :, jnp.maximum(pos, 0) % self.window]
    pool = pool.replace(recent_k=at(pool.recent_k).set(k.astype(self.RING_DTYPE)),
                        recent_v=at(pool.recent_v).set(v.astype(self.RING_DTYPE)))
    return self.inner.write(pool, layer, k, v, batch)

  def read_blocks(self, pool, layer, tables):
    return self.inner.read_blocks(pool, layer, tables)

  def read(self, pool, layer, batch):
    """The blocks, with each row's newest `window` tokens replaced by their ring copies."""
    k, v = self.read_blocks(pool, layer, batch.block_tables)
    bs = pool.block_size
    pos = jnp.arange(k.shape[1])[:, None] * bs + jnp.arange(bs)  # [MB, bs]
    ctx = batch.context_lens[:, None, None]
    recent = (pos >= ctx - self.window) & (pos < ctx)  # [B, MB, bs]
    ring = lambda a: a[layer, batch.lanes][:, :, pos % self.window]  # [B, H, MB, bs, D]
    pick = lambda ring_vals, dense: jnp.where(recent[:, :, None, :, None],
                                              jnp.moveaxis(ring_vals, 1, 2).astype(jnp.float32),
                                              dense)
    return pick(ring(pool.recent_k), k), pick(ring(pool.recent_v), v)


# Every storage format, in the order KV_DTYPES lists them. RecentWindow wraps these.
FORMATS = (FloatScheme, SymmetricScheme, Int4Groups, Int4KiviKeys)
KV_DTYPES = tuple(dict.fromkeys(d for c in FORMATS for d in c.kv_dtypes))
