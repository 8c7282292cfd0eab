"""A cluster-wide KV index: which replica holds which block in which tier, kept from KV events.

Each replica's engine announces what its caches store and drop (pagedjax/host/kv_events.py);
`KVIndex.apply(replica, batch)` folds a batch in. A block is named by its chain key
(prefix_cache.block_key), which covers the whole prefix up to it, so a router that computes a
prompt's chain keys (`prompt_keys`) with the engines' block size and salt asks `match` how long
a prefix each replica holds, and in which tier each block of it sits: the precise routers
(routers.py) read this, as llm-d's kv-cache indexer and Dynamo's KV router do for vLLM.

The index is exact as of the last batch applied: events of a replica's iteration in flight are
not in yet (a real indexer reads them off a queue, later still). Plain host Python (no jax).

A shared store (`shared_media`, e.g. ('DISK',): the replicas' disk tiers are one store,
disk_store.make_shared) is one holder, SHARED, whatever replica announced a block in it: a
block stored there is available to every replica at that tier, a replica's death or
AllBlocksCleared does not take it away, and a BlockRemoved in that medium (the block was
overwritten or failed a read) does. `match(keys, replicas)` then gives every replica named the
longest prefix held on its own tiers or in the store.
"""
import collections
from typing import Callable, Dict, Iterable, List, Optional, Sequence as Seq, Union

from pagedjax.host import kv_events
from pagedjax.host.cache.prefix_cache import chain_keys

# bit (1 << tier) per medium; a block may sit in several tiers at once (tiers are inclusive)
_BIT = {m: 1 << t for m, t in kv_events.TIER_OF_MEDIUM.items()}
_ALL = sum(_BIT.values())
# the best (fastest, lowest-numbered) tier of a mask of tier bits
_BEST = {mask: min(t for t in kv_events.MEDIUM_OF_TIER if mask >> t & 1)
         for mask in range(2, _ALL + 1) if mask & _ALL == mask and mask}


def prompt_keys(token_ids: Seq[int], block_size: int, salt: Optional[str] = None) -> List[int]:
  """The chain keys of a prompt's full blocks, as the engines compute them."""
  return chain_keys(token_ids, block_size, len(token_ids) // block_size, salt)


SHARED = -1  # the holder of a shared medium's blocks


class KVIndex:

  def __init__(self, shared_media: Iterable[str] = ()):
    """shared_media: media whose blocks every replica reaches (one store; module docstring)."""
    self.shared_media = frozenset(shared_media)
    unknown = self.shared_media - set(kv_events.MEDIA)
    if unknown:
      raise ValueError(f'shared_media={sorted(unknown)} is not allowed: media among '
                       f'{kv_events.MEDIA}')
    self._holders: Dict[int, Dict[int, int]] = {}  # key -> replica -> mask of tier bits
    self._keys: Dict[int, Dict[str, set]] = collections.defaultdict(
        lambda: {m: set() for m in kv_events.MEDIA})  # replica -> medium -> keys
    self.events_applied = 0
    self._stored_listeners: List[Callable[[int, Seq[int]], None]] = []

  def on_stored(self, listener: Callable[[int, Seq[int]], None]) -> None:
    """listener(replica, keys) after every BlockStored a replica announces on its own tiers
    (not the shared store's): what a router that tracks its own routes confirms them by."""
    if listener not in self._stored_listeners:
      self._stored_listeners.append(listener)

  def apply(self, replica: int,
            events: Union[kv_events.KVEventBatch, Iterable[kv_events.KVEvent]]) -> None:
    """Folds one replica's events in, in order."""
    if isinstance(events, kv_events.KVEventBatch):
      events = events.events
    for event in events:
      self.events_applied += 1
      if isinstance(event, (kv_events.BlockStored, kv_events.BlockRemoved)):
        medium = event.medium or kv_events.MEDIUM_GPU
        holder = SHARED if medium in self.shared_media else replica
        if isinstance(event, kv_events.BlockStored):
          self._store(holder, medium, event.block_hashes)
          if holder != SHARED:
            for listener in self._stored_listeners:
              listener(holder, event.block_hashes)
        else:
          self._remove(holder, medium, event.block_hashes)
      elif isinstance(event, kv_events.AllBlocksCleared):
        for medium in [event.medium] if event.medium else kv_events.MEDIA:
          if medium not in self.shared_media:  # one replica's view of the store, not the store
            self._remove(replica, medium, list(self._keys[replica][medium]))
      else:
        raise TypeError(f'event {event!r} is not allowed: a kv_events.BlockStored, '
                        'BlockRemoved or AllBlocksCleared')

  def _store(self, replica: int, medium: str, keys) -> None:
    bit, mine = _BIT[medium], self._keys[replica][medium]
    for key in keys:
      holders = self._holders.setdefault(key, {})
      holders[replica] = holders.get(replica, 0) | bit
      mine.add(key)

  def _remove(self, replica: int, medium: str, keys) -> None:
    bit, mine = _BIT[medium], self._keys[replica][medium]
    for key in keys:
      holders = self._holders.get(key)
      if holders is None or replica not in holders:
        continue  # removed twice, or stored before the index started listening
      mask = holders[replica] & ~bit
      if mask:
        holders[replica] = mask
      else:
        del holders[replica]
        if not holders:
          del self._holders[key]
      mine.discard(key)

  def match(self, keys: Seq[int], replicas: Optional[Iterable[int]] = None
            ) -> Dict[int, List[int]]:
    """replica -> the tiers (1 device, 2 host RAM, 3 disk: the best one each) of the blocks of
    the longest prefix of `keys` it holds; replicas holding none are left out, and so are
    replicas not among `replicas` when it is given. With a shared store, each of `replicas`
    also holds what the store does (without `replicas`, only the replicas' own tiers count).

    A replica's prefix may begin on the store's blocks and go on on its own tiers: it joins
    the store's prefix at the first block it holds (when every block before it is the store's)
    and ends at the first block neither holds. Computed as list operations over the blocks up to
    the first one nobody holds (each block's holders looked up once), then per replica that
    holds one of them on its own tiers; the replicas that hold nothing of their own get the
    store's prefix. tests/test_cluster_routing.py checks it against a block-by-block walk."""
    wanted = None if replicas is None else set(replicas)
    shared_on = wanted is not None and bool(self.shared_media)
    get = self._holders.get
    found = [get(key) for key in keys]
    if None in found:
      found = found[:found.index(None)]
    out: Dict[int, List[int]] = {}
    if not found:
      return out
    if shared_on:
      shared = [h.get(SHARED, 0) for h in found]
      store_len = shared.index(0) if 0 in shared else len(shared)
    else:
      shared, store_len = None, 0
    # who can hold a prefix: a holder of a block no later than the first the store lacks
    joining = set().union(*found[:store_len + 1])
    joining.discard(SHARED)
    if wanted is not None:
      joining &= wanted
    for r in joining:
      if shared is None:
        masks = [h.get(r, 0) for h in found]
      else:
        masks = [h.get(r, 0) | s for h, s in zip(found, shared)]
      stop = masks.index(0) if 0 in masks else len(masks)
      if stop:
        out[r] = [_BEST[m] for m in masks[:stop]]
    if store_len:
      store = [_BEST[m] for m in shared[:store_len]]
      for r in wanted:
        if r not in out:
          out[r] = list(store)
    return out

  def num_blocks(self, replica: int, medium: str = kv_events.MEDIUM_GPU) -> int:
    return len(self._keys[replica][medium]) if replica in self._keys else 0

  def blocks(self, replica: int, medium: str = kv_events.MEDIUM_GPU) -> frozenset:
    """The keys a replica (or SHARED, for a shared medium) holds in a medium."""
    return frozenset(self._keys[replica][medium]) if replica in self._keys else frozenset()

  def holders(self, key: int) -> Dict[int, List[int]]:
    """replica -> the tiers holding this block there."""
    return {r: [t for t in kv_events.MEDIUM_OF_TIER if mask >> t & 1]
            for r, mask in self._holders.get(key, {}).items()}

  def __len__(self) -> int:
    return len(self._holders)
