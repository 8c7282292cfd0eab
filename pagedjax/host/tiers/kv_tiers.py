"""The KV cache as managed working memory: the device pool (tier 1) over host RAM (tier 2) and
disk (tier 3, disk_store.py), behind one prefix cache (prefix_cache.py or radix_cache.py).

Vocabulary: *demote* = copy a block down a tier, *promote* = load it back up before
the step that needs it, *drop* = forget it (the lowest tier does). A block is named in every tier
by its content key, the prefix cache's chain key (salt included), and each entry keeps the
content the key was computed from, so a key collision is a miss, never another prefix's K/V.

Movement:
  write-back     when the device cache evicts a block (CacheBase.evict) it is demoted to the
                 first lower tier instead of dropped (no copy if the key is already there).
  write-through  (config tiers.write_through) every block the device cache takes in is also
                 copied to every lower tier, right after the step that filled it; eviction then
                 finds it below and copies nothing.
  tier 2 -> 3    a block tier 2 evicts is demoted to tier 3 (its bytes are on the host, so the
                 disk write is issued at once); tier 3 drops what it evicts.
  promotion      at admission (BlockManager.allocate_waiting) the lookup continues past the device hits,
                 block by block in prefix order, tier 2 then tier 3, up to the first miss. The
                 cost model (tier_cost.py) says how many of the found blocks to load; each gets a
                 fresh device block and its tokens count as cached. Tier-2 bytes are copied out
                 at once (a demotion later in the iteration may then reuse the slot); tier-3
                 reads are issued then and waited for just before the scatter that needs them.
                 A block evicted earlier in the same iteration is still on the device (its
                 demotion's gather has not run): it is copied device to device, in the
                 iteration's copy call, which runs after the gather and before any write.
Tiers are inclusive: a promoted block keeps its lower copy, so evicting it again copies nothing
(a cached prefix is read far more often than it changes tier), and write-through makes every
cached block a lower copy by design. A key is at most once per tier, and all its copies hold
the same bytes.
Each lower tier has its own capacity and LRU/LFU order (tier_index.py).

The device side, per iteration (executor.py): ONE gather of every block demoted since the last
one (with the blocks swapped out), before anything the iteration writes into evicted blocks; ONE
scatter of every promoted block (with the blocks swapped in), before the steps; and, with
write-through, one more gather after the steps, of the blocks they filled.

Prefetch: each iteration, before the scheduler runs, the prefixes of the first waiting
requests (PREFETCH_SEQUENCES of them) are looked up below the device and the tier-3 reads of
what is found there are issued at once (at most PREFETCH_BLOCKS in flight), so they run while
the iterations before the request's admission compute; at admission `find` takes the read in
flight instead of issuing one. A prefetched read nobody took within PREFETCH_ITERATIONS is
dropped (its pin released).

A tier-3 read that does not verify (disk_store.py) is a miss found late: the sequence's cached
count is cut back to that block, so the step recomputes it and everything after it; the device
blocks are the sequence's own, so nothing else changes.
"""
import collections
import dataclasses
import hashlib
from typing import Dict, List, Optional

import numpy as np

from pagedjax.host import capacity as capacity_lib
from pagedjax.host import kv_events
from pagedjax.host.tiers.disk_store import DiskRead, DiskStore
from pagedjax.host.cache.prefix_cache import content_bytes
from pagedjax.host.tiers.tier_cost import TierCosts
from pagedjax.host.tiers.tier_index import TierIndex

WINDOW = 32  # iterations in the sliding-window hit rates
PREFETCH_SEQUENCES = 8  # waiting requests whose tier-3 blocks are read ahead of admission
PREFETCH_BLOCKS = 256  # tier-3 reads in flight ahead of admission, at most (and half of tier 3)
PREFETCH_ITERATIONS = 64  # a read ahead not taken by then is dropped
# The run's counts (figures() and each timeline row report all of them, zeros included).
COUNTS = ('queried_blocks', 'tier1_hit_blocks', 'tier2_hit_blocks', 'tier3_hit_blocks',
          'evicted_now_hit_blocks', 'declined_blocks', 'tier3_failed_blocks', 'promoted_blocks',
          'promoted_bytes', 'promote_seconds', 'tier2_demoted_blocks', 'tier3_demoted_blocks',
          'demoted_bytes', 'demote_seconds', 'tier1_evictions', 'tier2_evictions',
          'tier3_evictions', 'tier2_full_skips', 'tier3_full_skips', 'prefetched_blocks',
          'prefetch_taken_blocks', 'prefetch_dropped_blocks')


def content_digest(content) -> bytes:
  """A 128-bit digest of a block's content (block_content()): what tier 3 stores and compares."""
  return hashlib.blake2b(content_bytes(*content), digest_size=16).digest()


class BlockLayout:
  """One block's arrays (`KVPool.block_array_shapes()` without the block axis) and their packing
  into one byte record, exactly as stored: codes, scales and zero points alike."""

  def __init__(self, block_array_shapes: Dict[str, tuple]):
    self.fields = [(name, (shape[0],) + tuple(shape[2:]), np.dtype(dtype))
                   for name, (shape, dtype) in block_array_shapes.items()]
    self.sizes = [int(np.prod(shape)) * dtype.itemsize for _, shape, dtype in self.fields]
    self.nbytes = sum(self.sizes)

  def pack(self, block: Dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ascontiguousarray(block[name], dtype).reshape(-1).view(np.uint8)
                           for name, _, dtype in self.fields])

  def unpack(self, record: np.ndarray) -> Dict[str, np.ndarray]:
    out, offset = {}, 0
    for (name, shape, dtype), size in zip(self.fields, self.sizes):
      out[name] = record[offset:offset + size].view(dtype).reshape(shape)
      offset += size
    return out

  def zeros(self) -> Dict[str, np.ndarray]:
    return {name: np.zeros(shape, dtype) for name, shape, dtype in self.fields}


class ContentFreeLayout(BlockLayout):
  """A block without arrays: a simulated pool's (pagedjax/sim/simulated_device.py), whose blocks
  have a size but no contents. Tiers over it keep all their bookkeeping (which key sits in
  which slot, eviction order, promotions, KV events) and move no bytes; the device's transfer
  calls charge the moves' time. `nbytes` is the block's true size (every device's share,
  scales included), for the byte counts; a HostBlockStore over it allocates no arrays, so its
  capacity (the simulated node's host RAM, which the config sizes) is not checked against this
  machine's."""

  def __init__(self, nbytes: int):
    super().__init__({})
    self.nbytes = int(nbytes)

  def pack(self, block: Dict[str, np.ndarray]) -> np.ndarray:
    return np.zeros(0, np.uint8)


class HostBlockStore:
  """Tier 2: `capacity` blocks in numpy, laid out like the pool (block axis 1). A capacity that
  does not fit in host RAM is refused before anything is allocated (capacity.py); a layout
  without arrays (ContentFreeLayout) allocates nothing."""

  def __init__(self, layout: BlockLayout, capacity: int, eviction: str = 'lru'):
    capacity_lib.check_blocks_fit('tiers.host_blocks', capacity, sum(layout.sizes),
                                  capacity_lib.host_memory_available(), 'host RAM')
    self.index = TierIndex(capacity, eviction)
    self.arrays = {name: np.zeros((shape[0], capacity) + shape[1:], dtype)
                   for name, shape, dtype in layout.fields}

  def read(self, slot: int) -> Dict[str, np.ndarray]:
    return {name: a[:, slot].copy() for name, a in self.arrays.items()}

  def write(self, slot: int, block: Dict[str, np.ndarray]) -> None:
    for name, a in self.arrays.items():
      a[:, slot] = block[name]


@dataclasses.dataclass
class Hit:
  """A block found below the device and chosen for loading (tier 1: still on the device, in
  `source`, evicted this iteration and not yet gathered)."""
  tier: int
  key: int
  source: Optional[int] = None  # tier 1: the device block it is copied from
  data: Optional[Dict[str, np.ndarray]] = None  # tier 2: its arrays, copied at admission
  read: Optional[DiskRead] = None  # tier 3: the read in flight


@dataclasses.dataclass
class Promotion:
  seq: object
  index: int  # the block's position in seq's block table
  block: int  # the device block it goes to
  hit: Hit


@dataclasses.dataclass
class Demotion:
  block: int  # the device block to gather
  key: int
  tiers: List[int]  # the lower tiers that reserved a slot for it


class KVTiers:

  def __init__(self, layout: BlockLayout, block_size: int, *, host_blocks: int = 0,
               disk: Optional[DiskStore] = None, eviction: str = 'lru',
               write_through: bool = False, promotion: str = 'auto',
               cost: Optional[TierCosts] = None):
    if promotion == 'auto' and cost is None:
      raise ValueError("promotion='auto' needs a cost model")
    self.layout, self.block_size = layout, block_size
    self.host = HostBlockStore(layout, host_blocks, eviction) if host_blocks else None
    self.disk = disk
    self.write_through, self.promotion, self.cost = write_through, promotion, cost
    self.cache = None
    self._demotions: List[Demotion] = []
    # key -> (device block, content) of blocks evicted since the last gather, whose bytes are
    # still on the device (nothing writes a block before the gather of its iteration)
    self._evicted_now: Dict[int, tuple] = {}
    self._copies: List[tuple] = []  # (device block, device block) for tier-1 hits
    self._promotions: List[Promotion] = []
    self._prefetched: Dict[int, tuple] = {}  # key -> (DiskRead in flight, iteration issued)
    self.counters = collections.Counter()
    self.rows: List[dict] = []  # per executed iteration (end_iteration)
    self._last_totals = collections.Counter()

  def attach(self, cache) -> 'KVTiers':
    """Puts these tiers under a device prefix cache (CacheBase.lower)."""
    cache.lower, self.cache = self, cache
    for tier in self._tiers():  # one event hub per engine, the cache's (kv_events.py)
      index = self._index(tier)
      index.events, index.medium = cache.events, kv_events.MEDIUM_OF_TIER[tier]
    return self

  def _tiers(self) -> List[int]:
    return ([2] if self.host else []) + ([3] if self.disk and self.disk.enabled else [])

  def _index(self, tier: int) -> TierIndex:
    return self.host.index if tier == 2 else self.disk.index

  # ---- demotion (hooks of the device cache) ------------------------------------------------

  def evicted(self, block: int, key: int, content) -> None:
    """Write-back: the device cache evicts block; demote it to the first lower tier that has it
    or takes it (tier 3 when every tier-2 slot waits for this iteration's gather). Until this
    iteration's gather, its bytes are still on the device: a lookup now copies them there."""
    self._evicted_now[key] = (block, content)
    self._demote(block, key, content, self._tiers(), first_only=True)

  def cached(self, block: int, key: int, content) -> None:
    """The device cache took in a newly filled block: with write-through, copy it down."""
    if self.write_through:
      self._demote(block, key, content, self._tiers())

  def _demote(self, block: int, key: int, content, tiers: List[int],
              first_only: bool = False) -> None:
    targets = []
    for tier in tiers:
      if tier == 3 and not self.disk.writable:
        continue  # a read-only store still serves hits, but takes nothing
      if key in self._index(tier):
        self._index(tier).touch(key, hit=False)
      elif self._reserve(tier, key, content):
        targets.append(tier)
      else:
        self.counters[f'tier{tier}_full_skips'] += 1  # every slot busy: not copied here
        continue
      if first_only:
        break
    if targets:
      self._demotions.append(Demotion(block, key, targets))

  def _reserve(self, tier: int, key: int, content) -> bool:
    if tier == 3:
      return self.disk.reserve(key, content_digest(content))
    taken = self.host.index.reserve(key, content)
    if taken is None:
      return False
    slot, victim = taken
    if victim is not None and self.disk and self.disk.writable and victim[0] not in self.disk.index:
      # Tier 2 evicts to tier 3: the victim's bytes are still in `slot` until this iteration's
      # gather lands, so pack them now and issue the disk write.
      if self.disk.reserve(victim[0], content_digest(victim[1])):
        self.disk.write(victim[0], self.layout.pack(self.host.read(slot)))
        self._count_demoted(3)
    return True

  def _count_demoted(self, tier: int) -> None:
    self.counters[f'tier{tier}_demoted_blocks'] += 1
    self.counters['demoted_bytes'] += self.layout.nbytes

  def take_demotions(self) -> List[Demotion]:
    """The demotions waiting for a gather (the executor does one now)."""
    out, self._demotions = self._demotions, []
    self._evicted_now.clear()
    return out

  def store_demotions(self, demotions: List[Demotion], data: Dict[str, np.ndarray]) -> None:
    """data: field -> [layers, len(demotions), ...], the gathered blocks in order."""
    for j, d in enumerate(demotions):
      block = {name: a[:, j] for name, a in data.items()}
      for tier in d.tiers:
        if tier == 2:
          self.host.write(self.host.index.slot(d.key), block)
          self.host.index.commit(d.key)
        else:
          self.disk.write(d.key, self.layout.pack(block))
        self._count_demoted(tier)

  # ---- promotion ---------------------------------------------------------------------------

  def find(self, seq, start: int, n: int) -> List[Hit]:
    """Blocks start..n-1 of seq's prefix found below the device, in order up to the first miss,
    cut to what the promotion rule loads; their reads are issued (tier 3) or done (tier 2)."""
    if self.disk:
      self.disk.poll()
    keys, located = self.cache.keys(seq, n), []
    for i in range(start, n):
      content = self.cache.content(seq, keys, i)
      tier = self._locate(keys[i], content)
      if tier is None:
        break
      located.append((tier, keys[i], content))
    tiers = [t for t, _, _ in located]
    j = (len(tiers) if self.promotion == 'load' else 0 if self.promotion == 'recompute'
         else self.cost.blocks_to_load(tiers, 'auto'))
    self.counters['declined_blocks'] += len(located) - j
    hits = []
    for tier, key, content in located[:j]:
      if tier == 1:
        hits.append(Hit(1, key, source=self._evicted_now[key][0]))
      elif tier == 2:
        slot = self.host.index.find(key, content)
        self.host.index.touch(key)
        hits.append(Hit(2, key, data=self.host.read(slot)))
      else:
        digest = content_digest(content)
        ahead = self._prefetched.pop(key, None)
        if ahead and ahead[0].digest != digest:  # read for a colliding key's other content
          self.disk.finish(ahead[0])
          ahead = None
        read = ahead[0] if ahead else self.disk.read(key, digest)
        if read is None:  # the read could not even be issued: a miss ends the prefix
          break
        self.counters['prefetch_taken_blocks'] += ahead is not None
        hits.append(Hit(3, key, read=read))
    return hits

  def prefetch(self, waiting) -> None:
    """Issues the tier-3 reads of the first waiting sequences' prefixes (module docstring)."""
    if not (self.disk and self.disk.enabled) or self.promotion == 'recompute':
      return
    self.disk.poll()  # writes landed since the last iteration can be read
    # At most half of tier 3 pinned by reads ahead: the rest stays free to take demotions.
    limit = min(PREFETCH_BLOCKS, self.disk.index.capacity // 2)
    for seq in waiting[:PREFETCH_SEQUENCES]:
      n = (seq.num_tokens - 1) // self.block_size  # never the last token, as admission
      keys = self.cache.keys(seq, n)
      for i in range(n):
        if len(self._prefetched) >= limit:
          return
        if keys[i] in self._prefetched or self.cache.block_of(keys[i]) is not None:
          continue  # a read is on its way, or the block is on the device
        content = self.cache.content(seq, keys, i)
        if self.host and self.host.index.find(keys[i], content) is not None:
          continue
        read = self.disk.read(keys[i], content_digest(content))
        if read is None:
          break  # a miss ends the prefix
        self._prefetched[keys[i]] = (read, len(self.rows))
        self.counters['prefetched_blocks'] += 1

  def _drop_stale_prefetches(self) -> None:
    for key, (read, issued) in list(self._prefetched.items()):
      if len(self.rows) - issued >= PREFETCH_ITERATIONS:
        del self._prefetched[key]
        self.disk.finish(read)  # releases its pin; the bytes are not needed
        self.counters['prefetch_dropped_blocks'] += 1

  def _locate(self, key: int, content) -> Optional[int]:
    if self._evicted_now.get(key, (None, None))[1] == content:
      return 1
    if self.host and self.host.index.find(key, content) is not None:
      return 2
    if self.disk and self.disk.find(key, content_digest(content)):
      return 3
    return None

  def promote(self, seq, start: int, blocks: List[int], hits: List[Hit]) -> None:
    """seq's blocks start.. (device `blocks`) are filled from `hits` before the next steps."""
    for i, (block, hit) in enumerate(zip(blocks, hits)):
      if hit.tier == 1:
        self._copies.append((hit.source, block))
        self._count_promoted(1)
      else:
        self._promotions.append(Promotion(seq, start + i, block, hit))

  def _count_promoted(self, tier: int) -> None:
    self.counters[f'tier{tier}_hit_blocks' if tier > 1 else 'evicted_now_hit_blocks'] += 1
    self.counters['promoted_blocks'] += 1
    self.counters['promoted_bytes'] += self.layout.nbytes

  def take_copies(self) -> List[tuple]:
    """(source, destination) device blocks of tier-1 hits, for this iteration's copy call."""
    out, self._copies = self._copies, []
    return out

  def take_promotions(self) -> List[Promotion]:
    out, self._promotions = self._promotions, []
    return out

  def load(self, promotions: List[Promotion]) -> Dict[str, np.ndarray]:
    """field -> [layers, len(promotions), ...] for the scatter. Waits for tier-3 reads; one that
    does not verify cuts its sequence's cached count back to that block (recomputed)."""
    blocks = []
    for p in promotions:
      block = p.hit.data
      if p.hit.tier == 3:
        record = self.disk.finish(p.hit.read)
        block = None if record is None else self.layout.unpack(record)
      if block is None:
        self.counters['tier3_failed_blocks'] += 1
        p.seq.num_cached = min(p.seq.num_cached, p.index * self.block_size)
        block = self.layout.zeros()
      blocks.append(block)
    for p in promotions:  # served = still below the (possibly cut) cached count
      if p.index * self.block_size < p.seq.num_cached:
        self._count_promoted(p.hit.tier)
    return {name: np.stack([b[name] for b in blocks], axis=1) for name, _, _ in self.layout.fields}

  def flush(self) -> None:
    """Waits for the disk writes in flight (before exit: what a warm restart finds)."""
    if self.disk:
      self.disk.flush()

  # ---- figures -----------------------------------------------------------------------------

  def _totals(self) -> collections.Counter:
    cache = self.cache
    totals = collections.Counter(dict.fromkeys(COUNTS, 0))
    totals.update(self.counters)
    # Tier-1 hits: the device cache's, and blocks found while still on the device after their
    # eviction this iteration (copied there).
    totals.update(queried_blocks=cache.queried_blocks,
                  tier1_hit_blocks=cache.hit_blocks + totals['evicted_now_hit_blocks'],
                  tier1_evictions=cache.evictions)
    for tier in (2, 3):
      store = self.host if tier == 2 else self.disk
      if store is not None:
        totals[f'tier{tier}_evictions'] = store.index.evictions
    return totals

  def _occupancy(self) -> dict:
    out = {'tier1_blocks': len(self.cache)}
    if self.host:
      out['tier2_blocks'] = len(self.host.index)
    if self.disk:
      out['tier3_blocks'] = len(self.disk.index)
    return out

  def end_iteration(self) -> None:
    """Appends this iteration's row: the counts since the last row, and occupancy."""
    if self.disk:
      self.disk.poll()  # commit the disk writes that completed meanwhile
      self._drop_stale_prefetches()
    totals = self._totals()
    row = {key: totals[key] - self._last_totals[key] for key in totals}
    row.update(self._occupancy())
    self.rows.append(row)
    self._last_totals = totals

  def timeline(self) -> Dict[str, list]:
    """Per-iteration series (one entry per executed iteration; a count absent in a row is 0)."""
    keys = sorted(set().union(*self.rows)) if self.rows else []
    return {key: [row.get(key, 0) for row in self.rows] for key in keys}

  def figures(self) -> dict:
    """Run totals, hit rates per tier (over the run and the last WINDOW iterations), occupancy
    (now and at peak), capacities, the cost model's figures and the disk tier's state."""
    totals = self._totals()
    out = {f'tiers_{k}': v for k, v in sorted(totals.items())}
    window = collections.Counter()
    for row in self.rows[-WINDOW:]:
      window.update(row)
    for name, source in (('', totals), (f'_last{WINDOW}', window)):
      queried = source.get('queried_blocks', 0)
      for tier in (1, 2, 3):
        hits = source.get(f'tier{tier}_hit_blocks', 0)
        out[f'tier{tier}_hit_rate{name}'] = hits / queried if queried else None
      hits = sum(source.get(f'tier{t}_hit_blocks', 0) for t in (1, 2, 3))
      out[f'tiered_hit_rate{name}'] = hits / queried if queried else None
    for key, value in self._occupancy().items():
      out[f'{key}_now'] = value
      out[f'{key}_peak'] = max([value] + [row.get(key, 0) for row in self.rows])
    out.update(tier2_capacity=self.host.index.capacity if self.host else 0,
               tier3_capacity=self.disk.index.capacity if self.disk else 0,
               tiers_write_through=self.write_through, tiers_promotion=self.promotion,
               tier_block_bytes=self.layout.nbytes)
    if self.cost is not None:
      out.update(self.cost.figures())
    if self.disk is not None:
      out.update(self.disk.figures())
    return out

  def check(self) -> None:
    """Invariants (tests): each tier's index is consistent and within capacity; nothing is
    left waiting for a transfer between iterations."""
    for tier in (2, 3):
      store = self.host if tier == 2 else self.disk
      if store is not None:
        store.index.check()
    assert not self._demotions and not self._promotions and not self._copies
