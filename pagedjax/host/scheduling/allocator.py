"""Host-side block allocator: free list and per-block reference counts.

Lives in plain Python between jitted steps; it never touches the device. Block 0 (the null
block, see device/pool.py) is reserved and never handed out.

A block's ref count is the number of sequences holding it (forks and prefix hits share blocks).
With a prefix cache (prefix_cache.py) a cached block whose count drops to 0 is not freed but
becomes evictable: it still counts as available (`num_free`), and `allocate` evicts such blocks,
by the cache's policy, only once the plain free list is empty. A pinned cached block no
sequence holds (prefix_cache.py: pinning) is neither free nor evictable.

Memory grows with the blocks handed out, never with the capacity (a host tier may have 10^8
slots): the free list is a FreeIds, and reference counts are kept for held blocks only.
"""
import numbers
import random
from typing import Dict, Iterable, Iterator, List, Optional

# Block 0 of the device pool is the null block (pagedjax/device/pool.py): padding of block tables
# points at it and padded tokens write into it, so it is never handed out.
NULL_BLOCK = 0


class AllocationError(RuntimeError):
  """Raised when the pool has too few free blocks for a request."""


class FreeIds:
  """The free ids among lo..hi-1, in memory that grows with the ids handed out, not with hi - lo:
  ids never handed out are a counter, returned ones a stack that is taken from first (most
  recently returned first). Fresh ids come in increasing order, or in a random order with `rng`
  (a lazy Fisher-Yates shuffle that remembers only the positions its draws moved)."""

  def __init__(self, lo: int, hi: int, rng: Optional[random.Random] = None):
    self._next, self._end, self._rng = lo, hi, rng
    self._returned: List[int] = []
    self._moved: Dict[int, int] = {}  # with rng: undrawn position -> the id a draw moved there
    self._taken: set = set()  # fresh ids removed by take()

  def __len__(self) -> int:
    return len(self._returned) + self._end - self._next - len(self._taken)

  def pop(self) -> int:
    """A free id (IndexError when none is left)."""
    if self._returned:
      return self._returned.pop()
    while self._next < self._end:
      fresh = self._draw()
      if fresh not in self._taken:
        return fresh
      self._taken.remove(fresh)
    raise IndexError('no free id left')

  def _draw(self) -> int:
    i = self._next
    self._next += 1
    if self._rng is None:
      return i
    j = self._rng.randrange(i, self._end)
    drawn = self._moved.pop(j, j)
    if j != i:
      self._moved[j] = self._moved.pop(i, i)
    return drawn

  def push(self, i: int) -> None:
    """Returns a handed-out id."""
    self._returned.append(i)

  def take(self, ids: Iterable[int]) -> None:
    """Removes these ids, which must be free, from the free list (a restore found them in use).
    Only for increasing order: with rng, which fresh ids remain is not tracked."""
    if self._rng is not None:
      raise ValueError('take() needs fresh ids in increasing order (no rng)')
    ids = set(ids)
    self._returned = [i for i in self._returned if i not in ids]
    self._taken |= {i for i in ids if self._next <= i < self._end}

  def __iter__(self) -> Iterator[int]:
    """Every free id, returned ones first (tests; takes time in the number of free ids)."""
    yield from self._returned
    for p in range(self._next, self._end):
      fresh = self._moved.get(p, p)
      if fresh not in self._taken:
        yield fresh


class BlockAllocator:

  def __init__(self, num_blocks: int, shuffle_seed: Optional[int] = None, cache=None):
    """shuffle_seed scatters physical placement (tests use it: nothing may depend on order).
    cache: a PrefixCache whose released blocks stay reusable until evicted."""
    if num_blocks < 2:
      raise ValueError(f'num_blocks={num_blocks}: need at least 2 (block 0 is the null block)')
    self.num_blocks = num_blocks
    # Low ids are handed out first, which keeps logs readable.
    self._free = FreeIds(NULL_BLOCK + 1, num_blocks,
                         None if shuffle_seed is None else random.Random(shuffle_seed))
    self._ref_counts: Dict[int, int] = {}  # held blocks only (absent: 0)
    self.cache = cache

  @property
  def num_free(self) -> int:
    """Blocks an allocation can take: free ones plus evictable cached ones."""
    return len(self._free) + (self.cache.num_evictable if self.cache else 0)

  @property
  def num_used(self) -> int:
    return self.num_blocks - 1 - self.num_free

  def free_blocks(self) -> List[int]:
    """The plain free list (tests check it against the holders)."""
    return list(self._free)

  def can_allocate(self, n: int) -> bool:
    return n <= self.num_free

  def allocate(self, n: int = 1) -> List[int]:
    if n > self.num_free:
      raise AllocationError(f'asked for {n} blocks, only {self.num_free} free')
    blocks = [self._free.pop() if len(self._free) else self.cache.evict() for _ in range(n)]
    for b in blocks:
      self._ref_counts[b] = 1
    return blocks

  def take_cached(self, block: int) -> None:
    """One more holder of a cached block, which may be evictable (ref count 0) right now."""
    self._check(block)
    if block not in self._ref_counts and not self.cache.is_idle(block):
      raise ValueError(f'block {block} is neither held nor idle in the cache')
    self.cache.touch(block)
    self._ref_counts[block] = self._ref_counts.get(block, 0) + 1

  def ref_count(self, block: int) -> int:
    self._check(block)
    return self._ref_counts.get(block, 0)

  def share(self, block: int) -> None:
    """One more holder of an allocated block (forks, prefix sharing)."""
    self._check(block)
    if block not in self._ref_counts:
      raise ValueError(f'block {block} is free and cannot be shared')
    self._ref_counts[block] += 1

  def free(self, blocks: Iterable[int]) -> None:
    """Drop one reference to each block; a block with no holders left returns to the free list."""
    for b in blocks:
      self._check(b)
      if b not in self._ref_counts:
        raise ValueError(f'double free of block {b}')
      self._ref_counts[b] -= 1
      if self._ref_counts[b] == 0:
        del self._ref_counts[b]
        if self.cache is not None and self.cache.is_cached(b):
          self.cache.release(b)  # stays reusable until evicted
        else:
          self._free.push(b)

  def evict_now(self, blocks: Iterable[int]) -> int:
    """Evicts these evictable cached blocks from the cache at once (written back to lower
    tiers, if any) and frees them; returns how many went (the cache may keep some for now)."""
    evicted = [b for b in blocks if self.cache.evict_block(b)]
    for b in evicted:
      self._free.push(b)
    return len(evicted)

  def _check(self, block: int) -> None:
    if not isinstance(block, numbers.Integral) or not 0 < block < self.num_blocks:
      raise ValueError(f'block id {block!r} out of range: allocatable ids are 1..'
                       f'{self.num_blocks - 1} (0 is the null block)')
