"""KV cache events: what an engine's caches store and drop, per tier, for an indexer outside it.

A router that knows which replica holds which block (pagedjax/cluster/index.py; llm-d's
kv-cache indexer and Dynamo's KV router do this for vLLM) learns it from these events. The
schema follows vLLM's KV events (vllm/distributed/kv_events.py), field for field:

  BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)
      a block's K/V are now held in `medium`. Here one block per event: block_hashes is its
      chain key (prefix_cache.block_key, 64-bit, the same in every process), parent_block_hash
      the key of the block before it (None for a prompt's first block), token_ids its tokens.
      Disk entries keep only a digest of their content, so a DISK event carries no parent and no
      tokens; an indexer needs only the hash.
  BlockRemoved(block_hashes, medium)
      the block left `medium` (evicted, failed verification, tier switched off).
  AllBlocksCleared(medium)
      everything in `medium` is gone (None: every medium). vLLM's has no fields; the medium is
      this module's extension, so a cleared disk tier need not drop the device's entries.

Media: 'GPU' is the device pool (tier 1; on this CPU too: the name is vLLM's), 'CPU' the
host-RAM tier (tier 2, kv_tiers.py), 'DISK' the disk tier (tier 3, disk_store.py). A move
between tiers is, as in vLLM, a BlockStored in the new medium and a BlockRemoved in the old:
demoting a device block gives Removed(GPU) when the device cache evicts it and Stored(CPU) when
its bytes land in host RAM (the same iteration); tiers are inclusive (kv_tiers.py), so a
promotion is a Stored(GPU) while the lower copy stays.

Who emits: the device cache (prefix_cache.CacheBase: a newly cached full block, an evicted one),
each lower tier's index (tier_index.TierIndex: an entry committed, an entry removed) and the
offload store's index (scheduling/offload_index.py: an offloaded block indexed, one evicted), all
into one KVEvents hub per engine, `engine.prefix_cache.events` (kv_tiers.KVTiers.attach hands
the cache's hub to the tiers). Each site is one line guarded by the hub's truth value, which is
false while nobody listens: an engine without subscribers builds no event and calls nothing.

Delivery: a subscriber is a callable taking one event, called as the event happens (inside the
engine's iteration, so it must be quick and must not call back into the engine). `EventLog` is
the usual subscriber: it keeps events and `drain(ts)` hands them over as one KVEventBatch (vLLM
publishes a batch per scheduler step; pagedjax/cluster/ drains after every iteration).
`to_wire` / `from_wire` give vLLM's msgpack layout (msgspec array_like, tagged: a list
[tag, field, ...]) as plain lists, for any serializer.
"""
import dataclasses
from typing import Callable, List, Optional, Sequence as Seq, Tuple, Union

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK = 'GPU', 'CPU', 'DISK'
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)
TIER_OF_MEDIUM = {MEDIUM_GPU: 1, MEDIUM_CPU: 2, MEDIUM_DISK: 3}  # tier numbers as kv_tiers.py
MEDIUM_OF_TIER = {tier: medium for medium, tier in TIER_OF_MEDIUM.items()}


@dataclasses.dataclass(frozen=True)
class BlockStored:
  block_hashes: Tuple[int, ...]
  parent_block_hash: Optional[int]
  token_ids: Tuple[int, ...]
  block_size: int
  lora_id: Optional[int] = None
  medium: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
  block_hashes: Tuple[int, ...]
  medium: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
  medium: Optional[str] = None  # None: every medium


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


@dataclasses.dataclass(frozen=True)
class KVEventBatch:
  """One publication: the events since the last, in order, stamped with the engine clock."""
  ts: float
  events: Tuple[KVEvent, ...]
  data_parallel_rank: Optional[int] = None  # the replica, in a cluster


def _check_medium(medium) -> None:
  if medium is not None and medium not in MEDIA:
    raise ValueError(f'medium={medium!r} is not allowed: one of {MEDIA} or None')


class KVEvents:
  """One engine's event hub: the caches emit into it, subscribers receive each event."""

  def __init__(self, block_size: int):
    self.block_size = block_size
    self._subscribers: List[Callable[[KVEvent], None]] = []

  def __bool__(self) -> bool:
    """True while anyone listens (the emitting sites test this before building an event)."""
    return bool(self._subscribers)

  def subscribe(self, subscriber: Callable[[KVEvent], None]) -> Callable[[KVEvent], None]:
    if not callable(subscriber):
      raise TypeError(f'subscriber={subscriber!r} is not allowed: a callable taking one event')
    self._subscribers.append(subscriber)
    return subscriber

  def unsubscribe(self, subscriber) -> None:
    self._subscribers.remove(subscriber)

  def emit(self, event: KVEvent) -> None:
    for subscriber in self._subscribers:
      subscriber(event)

  def stored(self, medium: str, key: int, content) -> None:
    """A block keyed `key` is held in `medium`. content: prefix_cache.block_content()'s
    (parent key, token ids, salt), or a digest of it (disk), which names neither."""
    parent, tokens = (content[0], tuple(content[1])) if isinstance(content, tuple) else (None, ())
    self.emit(BlockStored((key,), parent, tokens, self.block_size, None, medium))

  def removed(self, medium: str, key: int) -> None:
    self.emit(BlockRemoved((key,), medium))

  def cleared(self, medium: Optional[str] = None) -> None:
    _check_medium(medium)
    self.emit(AllBlocksCleared(medium))


class EventLog:
  """A subscriber that keeps the events until `drain` hands them over as one batch."""

  def __init__(self, hub: Optional[KVEvents] = None, rank: Optional[int] = None):
    self.rank = rank
    self.pending: List[KVEvent] = []
    if hub is not None:
      hub.subscribe(self)

  def __call__(self, event: KVEvent) -> None:
    self.pending.append(event)

  def drain(self, ts: float) -> Optional[KVEventBatch]:
    """The events since the last drain as a batch stamped `ts`, or None if there were none."""
    if not self.pending:
      return None
    batch = KVEventBatch(float(ts), tuple(self.pending), self.rank)
    self.pending = []
    return batch


# ---- wire form (vLLM's msgspec layout: array_like, tagged) ----------------------------------

def to_wire(event: KVEvent) -> list:
  """[tag, field values in order]: msgspec's array_like encoding with tag=True."""
  values = [getattr(event, f.name) for f in dataclasses.fields(event)]
  return [type(event).__name__, *(list(v) if isinstance(v, tuple) else v for v in values)]


def from_wire(item: Seq) -> KVEvent:
  """The event a to_wire list (or vLLM's decoded one) names; trailing fields may be omitted
  (msgspec's omit_defaults)."""
  if not item or item[0] not in EVENT_TYPES:
    raise ValueError(f'KV event {list(item)[:1]!r} is not allowed: a list starting with one of '
                     f'{tuple(EVENT_TYPES)}')
  cls = EVENT_TYPES[item[0]]
  fields = [f.name for f in dataclasses.fields(cls)]
  if len(item) - 1 > len(fields):
    raise ValueError(f'{item[0]} takes at most {len(fields)} fields ({", ".join(fields)}), '
                     f'got {len(item) - 1}')
  values = [tuple(v) if isinstance(v, list) else v for v in item[1:]]
  event = cls(**dict(zip(fields, values)))
  _check_medium(event.medium)
  return event


def batch_to_wire(batch: KVEventBatch) -> list:
  return [batch.ts, [to_wire(e) for e in batch.events], batch.data_parallel_rank]


def batch_from_wire(item: Seq) -> KVEventBatch:
  ts, events, *rank = item
  return KVEventBatch(float(ts), tuple(from_wire(e) for e in events), rank[0] if rank else None)
