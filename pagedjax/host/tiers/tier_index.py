"""One lower KV tier's bookkeeping: which content key sits in which slot, under a capacity.

Tiers 2 (host RAM, kv_tiers.py) and 3 (disk, disk_store.py) each own one TierIndex over their
`capacity` slots. A key's life in a tier:

  reserve  a slot is taken for the key (evicting the policy's victim when none is free); the
           key is *pending*: its bytes have not landed yet (a device gather or a disk write is
           under way), so it can neither be matched (a lookup would read garbage) nor evicted
           (its slot would be handed out twice).
  commit   the bytes are in: the key matches lookups and may be evicted.
  pin      a read of the key is in flight (a disk read for a promotion): not evictable, so its
           slot is not rewritten under the read.
  remove   the entry is forgotten (evicted, failed verification, tier switched off).

A key maps to one slot and a slot to one key. Each entry also keeps the content the key was
computed from (prefix_cache.block_content, or a digest of it), and a lookup counts only when the
query's content equals it: a key collision costs a miss, never another prefix's K/V.

Eviction: over committed, unpinned entries, by the tier's EvictionQueue (host/policies.py, the
same policies as the device prefix cache's; config.tiers.eviction names it): 'lru' takes the
entry used longest ago, 'lfu' the one with the fewest hits (then least recently used); a lazy
heap keeps both O(log n). A pending or pinned entry the policy reaches is passed over until it
is committed or unpinned.
"""
from typing import Dict, Hashable, List, Optional, Tuple

from pagedjax.host.scheduling.allocator import FreeIds
from pagedjax.host import policies


class TierIndex:
  events, medium = None, None  # kv_events.KVEvents and this tier's medium (KVTiers.attach)

  def __init__(self, capacity: int, eviction='lru'):
    """eviction: a policy name or 'module:Class' (policies.EVICTION), or an EvictionQueue."""
    if capacity < 1:
      raise ValueError(f'capacity={capacity}: a tier needs at least one slot')
    self.capacity, self.eviction = capacity, policies.eviction_name(eviction)
    self.queue = policies.eviction_queue(eviction)  # committed entries, in eviction order
    self._slot: Dict[int, int] = {}  # key -> slot
    self._key_at: Dict[int, int] = {}  # slot -> key
    self._content: Dict[int, Hashable] = {}  # key -> what it was computed from
    self._free = FreeIds(0, capacity)  # memory grows with the slots used, not with capacity
    self._pending: set = set()
    self._pins: Dict[int, int] = {}  # key -> reads in flight
    self.evictions = 0

  def __len__(self) -> int:
    return len(self._slot)

  def __contains__(self, key: int) -> bool:
    return key in self._slot

  def keys(self) -> List[int]:
    return list(self._slot)

  def slot(self, key: int) -> int:
    return self._slot[key]

  def content(self, key: int) -> Hashable:
    return self._content[key]

  def is_pending(self, key: int) -> bool:
    return key in self._pending

  def find(self, key: int, content: Hashable) -> Optional[int]:
    """The slot of a committed entry for key with this content, else None."""
    slot = self._slot.get(key)
    if slot is None or key in self._pending or self._content[key] != content:
      return None
    return slot

  def touch(self, key: int, hit: bool = True) -> None:
    """A use of key (a hit, or a demotion finding it already here): moves it to the back of the
    eviction order."""
    if hit:
      self.queue.hit(key)
    self.queue.push(key)

  def reserve(self, key: int, content: Hashable
              ) -> Optional[Tuple[int, Optional[Tuple[int, Hashable, int]]]]:
    """Takes a slot for key (pending). Returns (slot, victim) where victim is the (key, content,
    slot) evicted to make room, or None when every entry is pending or pinned (then nothing is
    reserved)."""
    if key in self._slot:
      raise ValueError(f'key {key} is already in this tier (slot {self._slot[key]})')
    victim = None
    if not self._free:
      victim = self._evict()
      if victim is None:
        return None
    slot = self._free.pop()
    self._add(key, content, slot)
    self._pending.add(key)
    return slot, victim

  def restore(self, entries: List[Tuple[int, Hashable, int]]) -> None:
    """Committed entries (key, content, slot) of a reopened store, oldest first (so LRU order
    survives a restart); slots must be free, keys new."""
    for key, content, slot in entries:
      self._add(key, content, slot)
      self.queue.push(key)
    self._free.take(slot for _, _, slot in entries)

  def _add(self, key: int, content: Hashable, slot: int) -> None:
    self._slot[key], self._key_at[slot], self._content[key] = slot, key, content
    self.queue.add(key, chain_key=key)

  def commit(self, key: int) -> None:
    if self.events and key in self._pending:  # someone listens (kv_events.py)
      self.events.stored(self.medium, key, self._content[key])
    self._pending.discard(key)
    self.queue.push(key)

  def pin(self, key: int) -> None:
    self._pins[key] = self._pins.get(key, 0) + 1

  def unpin(self, key: int) -> None:
    if key in self._pins:
      self._pins[key] -= 1
      if not self._pins[key]:
        del self._pins[key]
        self.queue.requeue(key)  # evictable again if the policy passed it over

  def remove(self, key: int) -> Optional[int]:
    """Forgets key; returns the slot it held (now free), or None if it was not here."""
    slot = self._slot.pop(key, None)
    if slot is None:
      return None
    if self.events and key not in self._pending:  # a pending key was never announced
      self.events.removed(self.medium, key)
    del self._key_at[slot], self._content[key]
    self.queue.remove(key)
    self._pending.discard(key)
    self._pins.pop(key, None)
    self._free.push(slot)
    return slot

  def _evict(self) -> Optional[Tuple[int, Hashable, int]]:
    """Removes the policy's victim among committed, unpinned entries; (key, content, slot)."""
    key = self.queue.pop(lambda k: k not in self._pending and k not in self._pins)
    if key is None:
      return None
    content = self._content[key]
    self.evictions += 1
    return key, content, self.remove(key)

  def check(self) -> None:
    """Invariants (tests): slots and keys are one-to-one, every slot is free or used once,
    occupancy within capacity."""
    assert len(self._slot) <= self.capacity, (len(self._slot), self.capacity)
    assert {self._key_at[s]: s for s in self._key_at} == self._slot
    used, free = set(self._key_at), list(self._free)
    assert len(set(free)) == len(free) == len(self._free) and not used & set(free)
    assert len(used) + len(free) == self.capacity and all(0 <= s < self.capacity for s in used)
    assert self._pending <= set(self._slot) and set(self._pins) <= set(self._slot)
