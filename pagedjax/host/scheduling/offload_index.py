"""Prefix caching over offloaded blocks: which block of the offload store holds which prefix.

The device prefix caches (host/cache/prefix_cache.py, radix_cache.py) index a sequence's blocks
from its first one, in the device pool. An offloaded sequence's oldest blocks live in the
offload store (host/scheduling/offload_store.py), so this index keeps their chain keys instead:
the same keys (prefix_cache.chain_keys over the sequence's token ids and cache salt, kept on
`Sequence.block_keys`), so a hit on block i means blocks 0..i are equal, and each entry keeps
the content it was keyed on (parent key, token ids, salt), which a hit must equal: a 64-bit
collision costs a miss, never another prefix's K/V.

Holders. The index holds one reference (OffloadIds.share) on every block it indexes, beside the
sequences whose host tables hold it; a block only the index holds is *idle*: its K/V stay in the
store, a later prompt with the same prefix takes it back (`take`), and it is evicted (its entry
dropped, its id freed) only when the store needs the room. Idle blocks go in the prefix cache's
eviction policy's order (an EvictionQueue, host/policies.py: 'lru', 'lfu', ... or
'package.module:Class'), told of every admission (add), hit, release (push) and eviction.

Blocks come in when they move out of a sequence's window (`store`), and, when a sequence
finishes, the full blocks its window still holds on the device are copied out to join them
(offload.py `keep_window`), so a follow-up turn over the whole context finds every full block of
it here. Lookups walk a prompt's blocks in order and stop at the first miss.

KV events (kv_events.py): with a listener on the engine's hub, an entry added is a BlockStored
and an evicted one a BlockRemoved, in medium 'CPU' (host RAM) or 'DISK' (the disk tier), as
the KV tiers' entries are; an indexer then sees these blocks too (only an offloaded request
uses them: an ordinary one does not look in the offload store).
"""
from typing import Dict, List, Optional, Tuple

from pagedjax.host import kv_events
from pagedjax.host import policies
from pagedjax.host.cache import prefix_cache


class OffloadIndex:
  """Chain key -> offload block, with the index's references and the idle blocks' eviction
  order (module docstring). `allocator`: the store's OffloadIds."""

  def __init__(self, allocator, block_size: int, eviction='lru'):
    self.allocator, self.block_size = allocator, block_size
    self.queue = policies.eviction_queue(eviction)  # idle blocks, in the policy's order
    self._block: Dict[int, int] = {}  # chain key -> block
    self._entry: Dict[int, Tuple[int, Tuple]] = {}  # block -> (chain key, content)
    self.hit_blocks = self.evictions = 0
    # The engine's KV events hub (kv_events.py; the prefix cache's, set by the engine): an
    # entry added is a BlockStored, one evicted a BlockRemoved, in the medium of the block's
    # tier ('CPU' for host RAM, 'DISK' for the disk tier). None or no listener: nothing built.
    self.events = None

  def __len__(self) -> int:
    return len(self._entry)

  @property
  def num_idle(self) -> int:
    """Indexed blocks no sequence holds: evictable, so free room for reservations."""
    return len(self.queue)

  def keys(self, seq, n: int) -> List[int]:
    """Chain keys of seq's first n full blocks, kept on seq (the device caches' keys)."""
    return prefix_cache.sequence_keys(seq, n, self.block_size)

  def _content(self, seq, keys: List[int], i: int) -> Tuple:
    return prefix_cache.sequence_block_content(seq, keys, i, self.block_size)

  def match(self, seq, n: int) -> List[int]:
    """The blocks of seq's longest indexed prefix among its first n full blocks."""
    if not self._entry:
      return []
    keys, out = self.keys(seq, n), []
    for i, key in enumerate(keys):
      block = self._block.get(key)
      if block is None or self._entry[block][1] != self._content(seq, keys, i):
        break
      out.append(block)
    return out

  def take(self, blocks: List[int]) -> None:
    """A sequence takes these matched blocks into its host table (one reference each)."""
    for block in blocks:
      self.allocator.share(block)
      self.queue.hit(block)
      self.queue.discard(block)
    self.hit_blocks += len(blocks)

  def store(self, seq, logical: int, block: int) -> bool:
    """seq's full logical block `logical` now lives in offload block `block`, which seq holds:
    the index takes a reference and an entry, unless its prefix is indexed already (another
    copy of the same tokens) or the block is (a fork's shared block)."""
    keys = self.keys(seq, logical + 1)
    if keys[logical] in self._block or block in self._entry:
      return False
    self._block[keys[logical]] = block
    self._entry[block] = (keys[logical], self._content(seq, keys, logical))
    self.allocator.share(block)
    self.queue.add(block, logical, keys[logical])
    if self.events:
      self.events.stored(self._medium(block), keys[logical], self._entry[block][1])
    return True

  def _medium(self, block: int) -> str:
    return kv_events.MEDIUM_CPU if self.allocator.tier_of(block) == 'host' else (
        kv_events.MEDIUM_DISK)

  def released(self, blocks: List[int]) -> None:
    """Sequences dropped these blocks (after the allocator freed their references): each
    indexed one only the index holds now becomes idle."""
    for block in blocks:
      if (block in self._entry and block not in self.queue and
          self.allocator.ref_count(block) == 1):
        self.queue.push(block)

  def indexed(self, seq, logical: int) -> bool:
    """Whether seq's full logical block's prefix has an entry (in some block)."""
    return self.keys(seq, logical + 1)[logical] in self._block

  def evict(self) -> Optional[int]:
    """Frees the policy's idle victim (entry dropped, id back to the store) and returns its
    id; None if no block is idle."""
    block = self.queue.pop()
    if block is None:
      return None
    self.queue.remove(block)
    key, _ = self._entry.pop(block)
    del self._block[key]
    if self.events:
      self.events.removed(self._medium(block), key)
    self.allocator.free([block])
    self.evictions += 1
    return block

  def figures(self) -> dict:
    return {'offload_cached_blocks': len(self), 'offload_idle_blocks': self.num_idle,
            'offload_prefix_hit_blocks': self.hit_blocks,
            'offload_prefix_evictions': self.evictions}
