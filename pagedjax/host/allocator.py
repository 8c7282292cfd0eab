"""Host-side block allocator: free list and per-block reference counts.

Lives in plain Python between jitted steps; it never touches the device. Block 0 (the null
block, see device/pool.py) is reserved and never handed out.

A block's ref count is the number of sequences holding it (forks and prefix hits share blocks).
With a prefix cache (prefix_cache.py) a cached block whose count drops to 0 is not freed but
becomes evictable: it still counts as available (`num_free`), and `allocate` evicts such blocks,
by the cache's policy, only once the plain free list is empty. A pinned cached block no
sequence holds (prefix_cache.py: pinning) is neither free nor evictable.
"""
import numbers
import random
from typing import Iterable, List, Optional

# Block 0 of the device pool is the null block (pagedjax/device/pool.py): padding of block tables
# points at it and padded tokens write into it, so it is never handed out.
NULL_BLOCK = 0


class AllocationError(RuntimeError):
  """Raised when the pool has too few free blocks for a request."""


class BlockAllocator:

  def __init__(self, num_blocks: int, shuffle_seed: Optional[int] = None, cache=None):
    """shuffle_seed scatters physical placement (tests use it: nothing may depend on order).
    cache: a PrefixCache whose released blocks stay reusable until evicted."""
    if num_blocks < 2:
      raise ValueError(f'num_blocks={num_blocks}: need at least 2 (block 0 is the null block)')
    self.num_blocks = num_blocks
    # Pop from the end: low ids are handed out first, which keeps logs readable.
    self._free: List[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))
    if shuffle_seed is not None:
      random.Random(shuffle_seed).shuffle(self._free)
    self._ref_counts = [0] * num_blocks
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
    blocks = [self._free.pop() if self._free else self.cache.evict() for _ in range(n)]
    for b in blocks:
      self._ref_counts[b] = 1
    return blocks

  def take_cached(self, block: int) -> None:
    """One more holder of a cached block, which may be evictable (ref count 0) right now."""
    self._check(block)
    if self._ref_counts[block] == 0 and not self.cache.is_idle(block):
      raise ValueError(f'block {block} is neither held nor idle in the cache')
    self.cache.touch(block)
    self._ref_counts[block] += 1

  def ref_count(self, block: int) -> int:
    self._check(block)
    return self._ref_counts[block]

  def share(self, block: int) -> None:
    """One more holder of an allocated block (forks, prefix sharing)."""
    self._check(block)
    if self._ref_counts[block] == 0:
      raise ValueError(f'block {block} is free and cannot be shared')
    self._ref_counts[block] += 1

  def free(self, blocks: Iterable[int]) -> None:
    """Drop one reference to each block; a block with no holders left returns to the free list."""
    for b in blocks:
      self._check(b)
      if self._ref_counts[b] == 0:
        raise ValueError(f'double free of block {b}')
      self._ref_counts[b] -= 1
      if self._ref_counts[b] == 0:
        if self.cache is not None and self.cache.is_cached(b):
          self.cache.release(b)  # stays reusable until evicted
        else:
          self._free.append(b)

  def evict_now(self, blocks: Iterable[int]) -> int:
    """Evicts these evictable cached blocks from the cache at once (written back to lower
    tiers, if any) and frees them; returns how many went (the cache may keep some for now)."""
    evicted = [b for b in blocks if self.cache.evict_block(b)]
    self._free += evicted
    return len(evicted)

  def _check(self, block: int) -> None:
    if not isinstance(block, numbers.Integral) or not 0 < block < self.num_blocks:
      raise ValueError(f'block id {block!r} out of range: allocatable ids are 1..'
                       f'{self.num_blocks - 1} (0 is the null block)')
