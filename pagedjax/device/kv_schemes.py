"""KV storage schemes: how the paged pool (pool.py) stores K and V, one class per format.

`KVQuantConfig` is the plain, frozen spec that configs and experiments build
(config.PoolConfig.kv_quant); `scheme_for(spec)` returns the scheme object that implements it.
A scheme owns everything that depends on the format:
  shapes(...)     the pool arrays it stores: field name -> (shape, dtype)
  write(...)      quantize one layer's new K/V and scatter them at the step's slot mapping
  read_blocks(..) the blocks of a block table, dequantized to float32
  read(...)       what attention sees for a batch: its blocks, plus anything kept elsewhere
  copy_blocks(..) copy-on-write copies of whole blocks (per-block arrays, and any bookkeeping)
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
                   and zero point per channel over the tokens of a full block. Keys have outlier
                   channels, so sharing a range across channels wastes most of the 16 levels.
                   A block is quantized once, when full; until then its keys are kept in
                   bfloat16 in a per-lane tail (KIVI's full-precision residual), so the codes
                   do not depend on how the tokens arrived.
  RecentWindow     wraps any quantized format (`recent_window` N): the newest N tokens of every
                   running sequence are also kept in bfloat16 in a small ring per sequence
                   *lane*, and attention reads them from there instead of from the quantized
                   blocks. Older tokens are read quantized.
Scales and zero points are counted in every memory figure (pool.pool_bytes, KVPool.nbytes);
`bytes_per_token` is a scheme's stored bytes per token slot (every per-block array), and
`bytes_per_lane` its fixed per-sequence state (rings, tails: `lane_fields`).

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

# The pool's null block and null lane (pool.py): padding reads and writes them, no sequence owns
# them.
NULL_BLOCK = 0
NULL_LANE = 0


class KVScheme(abc.ABC):
  """One storage format of the pool. Concrete formats are frozen dataclasses (hashable, equal by
  value) built from a spec by `from_spec`.

  Arrays are KVPool fields: k and v always; k_scale, v_scale, k_zero, v_zero, recent_k,
  recent_v, k_tail, k_tail_block, k_tail_src as the format needs them (`shapes`). Per-block
  arrays have the block axis at 1 and, like every pool array, KV heads at axis 2 (block
  copies, host transfers and sharding rely on both).
  """
  kv_dtypes: Tuple[str, ...] = ()  # the spec kv_dtype values this format stores
  key_per_channel = False          # the spec key_per_channel value it stores
  is_quantized = True              # stores codes and scales rather than the values
  scale_dtype = codecs.SCALE_DTYPE  # dtype of its scales and zero points; None: it has none
  kernel_native = False            # the kernels read k, v (and k_scale, v_scale) directly
  recent_window = 0                # newest tokens per sequence also kept in per-lane rings
  lane_fields: Tuple[str, ...] = ()  # its per-lane arrays (axis 1 is the lane, not the block):
  # fixed in size, never moved by block copies or transfers
  keeps_tails = False              # keeps a per-lane tail of unquantized keys (Int4KiviKeys)
  per_query_view = False           # a query reads some of its newest tokens unquantized, so
  # attention goes through write_view and recent_masks (pool.write_and_attend), not read

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

  def copy_blocks(self, pool, src, dst):
    """The pool with block dst[i] holding block src[i]'s contents (copy-on-write; every source
    is read before any destination is written)."""
    return pool.replace(**{name: x.at[:, dst].set(x[:, src])
                           for name, x in pool.block_arrays().items()})

  # ---- stored bytes (pool.pool_bytes, sizing) ----

  def bytes_per_token(self, num_layers: int, num_kv_heads: int, block_size: int,
                      head_dim: int) -> float:
    """Stored bytes per token slot over all layers: every per-block array (codes, scales, zero
    points, per-block bookkeeping) of one block, over block_size. Per-lane arrays are fixed in
    size and not counted here (bytes_per_lane)."""
    lead = (num_layers, 1, num_kv_heads, block_size)
    shapes = self.shapes(lead, head_dim, num_lanes=1)
    return sum(_nbytes(s) for name, s in shapes.items()
               if name not in self.lane_fields) / block_size

  def bytes_per_lane(self, num_layers: int, num_kv_heads: int, block_size: int,
                     head_dim: int) -> int:
    """Fixed bytes per sequence lane over all layers (recent-window rings, KIVI key tails); a
    pool holds max_sequences + 1 lanes (lane 0 is the null lane)."""
    lead = (num_layers, 1, num_kv_heads, block_size)
    shapes = self.shapes(lead, head_dim, num_lanes=1)
    return sum(_nbytes(shapes[name]) for name in self.lane_fields)


def flat_slots(blocks):
  """[B, MB, H, bs, D] -> [B, MB * bs, H, D]: a row's slots in position order."""
  b, mb, h, bs, d = blocks.shape
  return jnp.swapaxes(blocks, 2, 3).reshape(b, mb * bs, h, d)


def scatter_slots(flat, positions, values):
  """flat [B, S, H, D] with values [B, n, H, D] at positions [B, n] (>= S: dropped)."""
  rows = jnp.arange(flat.shape[0])[:, None]
  return flat.at[rows, positions].set(values.astype(flat.dtype), mode='drop')


def _nbytes(shape_dtype) -> int:
  shape, dtype = shape_dtype
  return math.prod(shape) * jnp.dtype(dtype).itemsize


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
    return self._write_keys(self._write_values(pool, layer, v, batch), layer, k, batch)

  def _write_values(self, pool, layer, v, batch):
    at = lambda a: pool.at_slots(a, layer, batch)
    vq, vs, vz = codecs.quantize_int4_groups(v, self.group_size)
    return pool.replace(v=at(pool.v).set(vq), v_scale=at(pool.v_scale).set(vs),
                        v_zero=at(pool.v_zero).set(vz))

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
  """Values as Int4Groups. Keys as KIVI stores them: a block's keys are quantized once, when the
  block is full, with one float16 scale and zero point per channel over its tokens (k_scale,
  k_zero [L, N, H, D]); until then they are kept unquantized, in bfloat16, in the *tail* of the
  sequence lane that writes them (k_tail [L, lanes, H, bs, D], KIVI's full-precision residual),
  and attention reads a partial block's keys from there. So a full block's codes are a function
  of its tokens alone (the per-channel quantization of their bfloat16 keys), and what attention
  reads for a partial block is its tokens' bfloat16 keys, whichever path wrote them: token by
  token, one prefill chunk after a recompute, or a copy made for a fork.

  A partial block can be shared (parallel samples and beams fork it, copy-on-write splits it)
  and swapped out, so a tail is looked up by the block it belongs to, not by lane:
  k_tail_block [L, lanes, H] int32 names the block each lane's tail holds (NO_TAIL: none; per
  layer, since a step writes the layers one after another and each must see its tags as they
  were before the step). A block copied for copy-on-write records its source in k_tail_src
  [1, N, H] (one entry per block, KV heads on axis 2 like every pool array): until a lane holds
  its tail, its older tokens are read from the source's. Swap preemption carries a swapped
  sequence's tail to the host and back (gather_tails, restore_tails; executor.py).

  What this relies on, all of it the scheduler's behaviour today: only a sequence's last block
  is ever partial; prefix caches and KV tiers hold full blocks only; the holders of a shared
  partial block (a fork's parent and samples, beams kept more than once) all write it, or are
  preempted, in the next step, before the lane of its last writer can go to another sequence
  (a beam that forks is kept, lane and all). tests/test_scheme_identity.py checks the outcome:
  greedy tokens unchanged under preemption, prefix caching and forks.
  """
  key_per_channel = True
  TAIL_DTYPE = jnp.bfloat16  # the unquantized baseline's storage (as RecentWindow's rings)
  NO_TAIL = NULL_BLOCK  # tag of a lane without a tail: no sequence writes the null block
  lane_fields = ('k_tail', 'k_tail_block')
  keeps_tails = True

  def _key_range_shape(self, lead, head_dim):
    return lead[:3] + (head_dim,)

  def shapes(self, lead, head_dim, num_lanes):
    layers, blocks, heads, block_size = lead
    return {**super().shapes(lead, head_dim, num_lanes),
            'k_tail': ((layers, num_lanes, heads, block_size, head_dim), self.TAIL_DTYPE),
            'k_tail_block': ((layers, num_lanes, heads), jnp.int32),
            'k_tail_src': ((1, blocks, heads), jnp.int32)}

  def _dequantize_keys(self, codes, scale, zero):
    return codecs.dequantize_int4_channels(codes, scale, zero)

  # ---- tails: found by block, stored by lane ----

  def _tail_lanes(self, pool, layer, blocks):
    """The lane holding the tail of each of `blocks` [n] in `layer`: the lane tagged with the
    block, else the lane tagged with the block it was copied from, else the null lane."""
    tags = pool.k_tail_block[layer, :, 0]  # [lanes]

    def lane_of(want):
      hit = (tags[None, :] == want[:, None]) & (want[:, None] != self.NO_TAIL)
      return hit.any(axis=1), jnp.argmax(hit, axis=1)

    own, own_lane = lane_of(blocks)
    copied, copied_lane = lane_of(pool.k_tail_src[0, blocks, 0])
    return jnp.where(own, own_lane, jnp.where(copied, copied_lane, NULL_LANE))

  def _store_tails(self, pool, layer, lanes, blocks, keys):
    """Lane lanes[i] now holds the tail of block blocks[i] (NO_TAIL: none), keys[i]
    [H, bs, D]; another lane still tagged with one of these blocks is stale and loses its tag.
    Padded rows pass the null lane."""
    tags = pool.k_tail_block[layer, :, 0]
    stale = jnp.any((tags[:, None] == blocks[None, :]) & (blocks[None, :] != self.NO_TAIL), 1)
    tags = jnp.where(stale, self.NO_TAIL, tags).at[lanes].set(blocks)
    tags = jnp.where(jnp.arange(tags.shape[0]) == NULL_LANE, self.NO_TAIL, tags)
    return pool.replace(
        k_tail=pool.k_tail.at[layer, lanes].set(keys.astype(self.TAIL_DTYPE)),
        k_tail_block=pool.k_tail_block.at[layer].set(
            jnp.broadcast_to(tags[:, None], pool.k_tail_block.shape[1:])))

  def gather_tails(self, pool, blocks):
    """The tails of `blocks` [n] (partial last blocks of sequences being swapped out), every
    layer: [L, n, H, bs, D] bfloat16."""
    return jnp.stack([pool.k_tail[layer, self._tail_lanes(pool, layer, blocks)]
                      for layer in range(pool.k_tail.shape[0])])

  def restore_tails(self, pool, lanes, blocks, tails):
    """The pool with lane lanes[i] holding the tail tails[:, i] of block blocks[i] (swap-in)."""
    for layer in range(pool.k_tail.shape[0]):
      pool = self._store_tails(pool, layer, lanes, blocks, tails[layer])
    return pool

  # ---- the scheme's operations ----

  def _assemble(self, pool, layer, k, batch):
    """The blocks the rows' new keys touch, in bfloat16: their older tokens from the tail of the
    first one (read before this step writes), then the new keys. -> (keys [B, span, H, bs, D],
    start, count, logical, physical) as KVPool.blocks_touched."""
    bs = pool.block_size
    num_rows, num_new = batch.positions.shape
    start, count, logical, physical = pool.blocks_touched(batch)  # [B], [B], [B, span] x2
    older = pool.k_tail[layer, self._tail_lanes(pool, layer, physical[:, 0])]  # [B, H, bs, D]
    rel = logical[:, :, None] * bs + jnp.arange(bs) - start[:, None, None]  # [B, span, bs]
    is_new = (rel >= 0) & (rel < count[:, None, None])
    is_older = (rel < 0) & (jnp.arange(logical.shape[1]) == 0)[None, :, None]  # first block's
    new = k[jnp.arange(num_rows)[:, None, None], jnp.clip(rel, 0, num_new - 1)]
    new = jnp.swapaxes(new, 2, 3).astype(self.TAIL_DTYPE)  # [B, span, H, bs, D]
    keys = jnp.where(is_new[:, :, None, :, None], new,
                     jnp.where(is_older[:, :, None, :, None], older[:, None],
                               jnp.zeros((), self.TAIL_DTYPE)))
    return keys, start, count, logical, physical

  def _write_keys(self, pool, layer, k, batch):
    return self._store_keys(pool, layer, batch, *self._assemble(pool, layer, k, batch))

  def _store_keys(self, pool, layer, batch, keys, start, count, logical, physical):
    """Blocks now full are quantized into the pool; the row's last block, while partial,
    becomes its lane's tail."""
    bs = pool.block_size
    end = start + count
    full = (count[:, None] > 0) & ((logical + 1) * bs <= end[:, None])  # [B, span]
    blocks = jnp.where(full, physical, NULL_BLOCK)  # the rest is written into the null block
    packed, scale, zero = codecs.quantize_int4_channels(keys)
    pool = pool.replace(k=pool.k.at[layer, blocks].set(packed),
                        k_scale=pool.k_scale.at[layer, blocks].set(scale),
                        k_zero=pool.k_zero.at[layer, blocks].set(zero))
    rows = jnp.arange(keys.shape[0])
    last = jnp.maximum((end - 1) // bs - start // bs, 0)  # span index of the newest token's
    partial = (count > 0) & (end % bs != 0)
    return self._store_tails(pool, layer, jnp.where(count > 0, batch.lanes, NULL_LANE),
                             jnp.where(partial, physical[rows, last], self.NO_TAIL),
                             keys[rows, last])

  def read(self, pool, layer, batch):
    """The blocks, with each row's partial last block read from its lane's tail (this step's
    write has just put it there): what the row's newest query reads (attention proper reads
    per query, `write_view`)."""
    k, v = self.read_blocks(pool, layer, batch.block_tables)
    ctx = batch.context_lens
    bs = pool.block_size
    at_tail = (jnp.arange(k.shape[1])[None, :] == (ctx // bs)[:, None]) & (ctx % bs != 0)[:, None]
    tail = pool.k_tail[layer, batch.lanes].astype(jnp.float32)  # [B, H, bs, D]
    return jnp.where(at_tail[:, :, None, None, None], tail[:, None], k), v

  # ---- attention's per-query view (pool.write_and_attend) ----

  per_query_view = True

  def write_view(self, pool, layer, k, v, batch):
    """write(), and what attention reads, flat over each row's table [B, MB * bs, H, D]:
    (k_lo, v_lo) the blocks as stored, (k_hi, v_hi) with the keys of this step's blocks in
    bfloat16. A query reads its own block's keys from k_hi (recent_masks)."""
    assembled = self._assemble(pool, layer, k, batch)
    pool = self._write_values(pool, layer, v, batch)
    pool = self._store_keys(pool, layer, batch, *assembled)
    k_lo, v_lo = (flat_slots(x) for x in self.read_blocks(pool, layer, batch.block_tables))
    keys, _, _, logical, physical = assembled
    pos = logical[:, :, None] * pool.block_size + jnp.arange(pool.block_size)  # [B, span, bs]
    pos = jnp.where((physical != NULL_BLOCK)[:, :, None], pos, k_lo.shape[1])  # else dropped
    k_hi = scatter_slots(k_lo, pos.reshape(pos.shape[0], -1),
                         flat_slots(keys).astype(jnp.float32))
    return pool, (k_lo, v_lo, k_hi, v_lo)

  def recent_masks(self, positions, num_slots, block_size):
    """[B, T, S] masks of the slots a query reads from k_hi (its own block) and from v_hi
    (none: values are stored per token)."""
    own = (jnp.arange(num_slots)[None, None, :] // block_size ==
           (positions // block_size)[:, :, None])
    return own, jnp.zeros_like(own)

  def copy_blocks(self, pool, src, dst):
    """Block arrays copied; each destination forgets any stale tail tag and reads its older
    tokens from its source's tail until a lane holds its own."""
    pool = super().copy_blocks(pool, src, dst)
    stale = jnp.any(pool.k_tail_block[..., None] == dst, axis=-1)
    src_of = jnp.broadcast_to(src[None, :, None], (1, dst.shape[0], pool.k_tail_src.shape[2]))
    return pool.replace(k_tail_block=jnp.where(stale, self.NO_TAIL, pool.k_tail_block),
                        k_tail_src=pool.k_tail_src.at[:, dst].set(src_of))


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

  @property
  def lane_fields(self):
    return self.inner.lane_fields + ('recent_k', 'recent_v')

  @property
  def keeps_tails(self) -> bool:
    return self.inner.keeps_tails

  def shapes(self, lead, head_dim, num_lanes):
    ring = ((lead[0], num_lanes, lead[2], self.window, head_dim), self.RING_DTYPE)
    return {**self.inner.shapes(lead, head_dim, num_lanes), 'recent_k': ring, 'recent_v': ring}

  def write(self, pool, layer, k, v, batch):
    """Ring write, then the inner format's."""
    return self.inner.write(self._write_rings(pool, layer, k, v, batch), layer, k, v, batch)

  def _write_rings(self, pool, layer, k, v, batch):
    """Only positions still among the newest `window` after this step are written to the row's
    lane, so a chunk longer than the window cannot collide with itself; everything else (and
    padding) goes to the null lane."""
    pos = batch.positions
    keep = (pos >= 0) & (pos >= batch.context_lens[:, None] - self.window)
    lanes = jnp.where(keep, batch.lanes[:, None], NULL_LANE)
    at = lambda a: a.at[layer, lanes, :, jnp.maximum(pos, 0) % self.window]
    return pool.replace(recent_k=at(pool.recent_k).set(k.astype(self.RING_DTYPE)),
                        recent_v=at(pool.recent_v).set(v.astype(self.RING_DTYPE)))

  # ---- attention's per-query view (pool.write_and_attend) ----

  per_query_view = True

  def write_view(self, pool, layer, k, v, batch):
    """write(), and what attention reads, flat [B, MB * bs, H, D]: the inner format's view,
    with the newest `window` tokens before this step (from the rings, read before the write) and
    this step's tokens in bfloat16 in k_hi and v_hi."""
    pool, view, _, _ = self.write_window_view(pool, layer, k, v, batch, batch, 0)
    return pool, view

  def write_window_view(self, pool, layer, k, v, absolute, inner_batch, first_slot):
    """write_view with the rings written and read at `absolute`'s positions and the inner format
    over `inner_batch`, whose slot 0 is position first_slot (0, or [B] per row: the streamed
    path's windows, model/streamed_attention.py; ring tokens before it are left out of the
    view). Returns (pool, view, ring_pos [B, window]: each ring slot's position, the rings
    [k, v] [B, window, H, D] as read before the write)."""
    pos = absolute.positions
    start = jnp.where(pos[:, 0] >= 0, pos[:, 0], 0)[:, None]
    slot = jnp.arange(self.window)[None, :]
    ring_pos = start - 1 - (start - 1 - slot) % self.window  # newest position < start in slot
    rings = [jnp.swapaxes(a[layer, absolute.lanes], 1, 2) for a in (pool.recent_k, pool.recent_v)]
    pool = self._write_rings(pool, layer, k, v, absolute)
    if self.inner.per_query_view:
      pool, (k_lo, v_lo, k_hi, v_hi) = self.inner.write_view(pool, layer, k, v, inner_batch)
    else:
      pool = self.inner.write(pool, layer, k, v, inner_batch)
      k_lo, v_lo = (flat_slots(x)
                    for x in self.inner.read_blocks(pool, layer, inner_batch.block_tables))
      k_hi, v_hi = k_lo, v_lo
    num_slots, first = k_lo.shape[1], jnp.reshape(jnp.asarray(first_slot), (-1, 1))
    ring_at = jnp.where(ring_pos >= first, ring_pos - first, num_slots)  # else dropped
    new_at = jnp.where(pos >= 0, pos - first, num_slots)
    unquantized = lambda x: x.astype(self.RING_DTYPE).astype(jnp.float32)
    k_hi = scatter_slots(scatter_slots(k_hi, ring_at, rings[0]), new_at, unquantized(k))
    v_hi = scatter_slots(scatter_slots(v_hi, ring_at, rings[1]), new_at, unquantized(v))
    return pool, (k_lo, v_lo, k_hi, v_hi), ring_pos, rings

  def recent_masks(self, positions, num_slots, block_size):
    """A query reads its newest `window` tokens, keys and values, from the rings; and
    whatever the inner format reads unquantized."""
    slots, p = jnp.arange(num_slots)[None, None, :], positions[:, :, None]
    window = (slots > p - self.window) & (slots <= p)
    if not self.inner.per_query_view:
      return window, window
    keys, values = self.inner.recent_masks(positions, num_slots, block_size)
    return window | keys, window | values

  def read_blocks(self, pool, layer, tables):
    return self.inner.read_blocks(pool, layer, tables)

  def copy_blocks(self, pool, src, dst):
    return self.inner.copy_blocks(pool, src, dst)

  def gather_tails(self, pool, blocks):
    return self.inner.gather_tails(pool, blocks)

  def restore_tails(self, pool, lanes, blocks, tails):
    return self.inner.restore_tails(pool, lanes, blocks, tails)

  def read(self, pool, layer, batch):
    """What the inner format reads, with each row's newest `window` tokens replaced by their
    ring copies."""
    k, v = self.inner.read(pool, layer, batch)
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
