"""Scheduling and caching policies as plug-ins: one small registry per decision.

  registry    decides                                     protocol (below)      default
  VICTIM      which running sequence a full pool preempts  victim function       'newest'
  ADMISSION   whether the waiting head may be admitted     admission function    'watermark'
  QUEUE_ORDER the order of the waiting queue               queue-order function  'fcfs'
  EVICTION    which idle cached block (or tier entry) goes EvictionQueue class   'lru'

A config names a policy by its registered name (config.scheduler.victim='least_progress') or as
'package.module:attr', imported when the config is validated, so a policy kept in a researcher's
own module runs in every experiment, the sweep and the simulator without editing pagedjax:

  config.prefix_cache.eviction = 'my_lab.policies:SizeAwareLRU'

`Registry.register` adds a name at import time (`@EVICTION.register('mine')`); `Registry.get`
resolves either form and raises PolicyError (a ValueError) naming the value and the registered
names. Nothing here imports jax (host code never does).

Protocols, one per registry:

victim(scheduler, candidates) -> Sequence
  candidates: the running sequences the scheduler may preempt, oldest first (FCFS; the oldest of
  all is left out while another runs, so the run cannot livelock). Return one of them. The
  scheduler's public state is there to read: scheduler.running, scheduler.blocks (the
  BlockManager), scheduler.cost (the cost model, None unless preemption 'auto' or victim 'cost'
  asked for one), and scheduler.cost_s(seq): what preempting seq would cost, in seconds.

admission(scheduler, unit) -> bool
  unit: the waiting head (a beam group's siblings with it). Called only once its batch rows and
  blocks fit; True admits it now, False blocks the queue this iteration (no request skips ahead).

queue_order(seq) -> sort key
  The waiting queue is kept sorted by this key, smallest first: admission takes the head. Ties
  must be broken (request_id is unique), so the order is total and reproducible. Running and
  swapped sequences stay in FCFS order (victim policies reason about age).

EvictionQueue (a class, instantiated once per cache or tier with no arguments)
  The ordered set of idle entries of one cache: device blocks of the prefix cache (hash and
  radix designs, prefix_cache.py, radix_cache.py) or content keys of a lower tier
  (tier_index.py). The cache calls
    add(key, depth, chain_key)    a new entry; depth: its block's index in its prompt (0 = the
                                  first block); chain_key: the content key naming it in every
                                  process (what an oracle knows the future of)
    hit(key)                      a lookup used it
    push(key, session)            it became evictable (again), or was used again while idle (a
                                  tier); session: (turns, tick of its last turn's end) of the
                                  session that owns the block (sessions.py), else None
    discard(key) -> bool          it stopped being evictable (taken by a sequence, pinned);
                                  False if it was not evictable
    remove(key)                   it left the cache (evicted or forgotten)
  and asks
    pop(can_evict) -> key | None  takes the next victim out of the evictable set, or None if
                                  none is left; a key for which can_evict(key) is False is
                                  passed over and stays out of the running (still evictable)
                                  until requeue(key). The cache then evicts the victim and
                                  calls remove(key).
    requeue(key)                  a passed-over key may go now
    ranked(keys) -> list          those evictable keys in eviction order
    tick() -> int                 the cache's logical clock (sessions stamp their turns with it)
    key in queue, len(queue), queue.keys()   the evictable set
  HeapQueue implements all of that with a lazy heap (O(log n) per event) for any policy that is a
  priority: subclass it and write priority(key, tick, session), smallest evicted first. A policy
  that is not a priority (S3-FIFO, ARC) implements the protocol itself.
  Every event reaches the queue in the order the cache sees it, so a policy may keep any
  statistics it likes (hits, ages, ghosts); it must not assume a key it never saw added.
  A class with `offline = True` (Belady) needs the future and is refused by engine configs; a
  study hands it the future (experiments/policy_lab.py).

docs/policies.md walks through adding an eviction policy.
"""
import bisect
import heapq
import importlib
import itertools
import math
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Tuple


class PolicyError(ValueError):
  """A policy name that is neither registered nor an importable 'module:attr'."""


class Registry:
  """Named policies of one kind; a name resolves to the registered object or 'module:attr'."""

  def __init__(self, kind: str, check: Callable[[object], bool], what: str):
    self.kind, self._check, self._what = kind, check, what
    self._entries: Dict[str, object] = {}

  def register(self, name: str, obj=None):
    """Registers obj under name (as a decorator when obj is omitted); returns obj."""
    def add(obj):
      if not isinstance(name, str) or not name or ':' in name:
        raise PolicyError(f'{self.kind} policy name {name!r}: a non-empty string without ":"')
      if name in self._entries and self._entries[name] is not obj:
        raise PolicyError(f'{self.kind} policy {name!r} is already registered')
      if not self._check(obj):
        raise PolicyError(f'{self.kind} policy {name!r} is {obj!r}, not {self._what}')
      self._entries[name] = obj
      return obj
    return add if obj is None else add(obj)

  def unregister(self, name: str) -> None:
    """Forgets a registered name (tests and notebooks that register a policy for a while)."""
    if name not in self._entries:
      raise PolicyError(f'{self.kind} policy {name!r} is not registered')
    del self._entries[name]

  def names(self) -> Tuple[str, ...]:
    return tuple(self._entries)

  def __contains__(self, name) -> bool:
    return name in self._entries

  def get(self, spec):
    """The policy a config value names: a registered name or 'package.module:attr'."""
    allowed = (f"one of {self.names()} or 'package.module:attr' naming {self._what}")
    if not isinstance(spec, str):
      raise PolicyError(f'{self.kind} policy {spec!r} is not allowed: {allowed}')
    if spec in self._entries:
      return self._entries[spec]
    module, sep, attr = spec.partition(':')
    if not sep:
      raise PolicyError(f'{self.kind} policy {spec!r} is not registered: {allowed}')
    try:
      obj = getattr(importlib.import_module(module), attr)
    except ImportError as e:
      raise PolicyError(f'{self.kind} policy {spec!r}: module {module!r} does not import '
                        f'({e})') from None
    except AttributeError:
      raise PolicyError(f'{self.kind} policy {spec!r}: module {module!r} has no {attr!r}'
                        ) from None
    if not self._check(obj):
      raise PolicyError(f'{self.kind} policy {spec!r} is {obj!r}, not {self._what}')
    return obj


# ---- eviction -------------------------------------------------------------------------------


class EvictionQueue:
  """The protocol (see the module docstring); the events a policy may ignore are no-ops."""

  def __init__(self):
    self._clock = itertools.count()

  def tick(self) -> int:
    return next(self._clock)

  def add(self, key: Hashable, depth: int = 0, chain_key: Optional[int] = None) -> None:
    pass

  def hit(self, key: Hashable) -> None:
    pass

  def push(self, key: Hashable, session: Optional[Tuple[int, int]] = None) -> None:
    raise NotImplementedError

  def discard(self, key: Hashable) -> bool:
    raise NotImplementedError

  def remove(self, key: Hashable) -> None:
    raise NotImplementedError

  def pop(self, can_evict: Optional[Callable[[Hashable], bool]] = None) -> Optional[Hashable]:
    raise NotImplementedError

  def requeue(self, key: Hashable) -> None:
    raise NotImplementedError

  def ranked(self, keys: Iterable[Hashable]) -> List[Hashable]:
    raise NotImplementedError

  def keys(self) -> List[Hashable]:
    raise NotImplementedError

  def __contains__(self, key) -> bool:
    raise NotImplementedError

  def __len__(self) -> int:
    raise NotImplementedError


class HeapQueue(EvictionQueue):
  """An eviction policy that is a priority: the evictable key with the smallest
  priority(key, tick, session) goes first. Priorities are fixed when a key is pushed (tick is
  the clock then), kept in a lazy heap: a stale heap entry (the key was pushed again, discarded
  or removed since) is skipped when it surfaces. `hits` counts each key's hits since it was added."""

  def __init__(self):
    super().__init__()
    self.hits: Dict[Hashable, int] = {}
    self.depth: Dict[Hashable, int] = {}
    self._priority: Dict[Hashable, tuple] = {}  # evictable key -> its priority
    self._heap: List[tuple] = []  # (priority, key)
    self.last_priority: Optional[tuple] = None  # the last victim's

  def priority(self, key, tick: int, session: Optional[Tuple[int, int]]) -> tuple:
    raise NotImplementedError

  def add(self, key, depth=0, chain_key=None):
    self.hits[key] = 0
    self.depth[key] = depth

  def hit(self, key):
    self.hits[key] += 1

  def push(self, key, session=None):
    priority = self.priority(key, self.tick(), session)
    self._priority[key] = priority
    heapq.heappush(self._heap, (priority, key))

  def discard(self, key) -> bool:
    return self._priority.pop(key, None) is not None

  def remove(self, key):
    self._priority.pop(key, None)
    self.hits.pop(key, None)
    self.depth.pop(key, None)

  def pop(self, can_evict=None):
    while self._heap:
      priority, key = heapq.heappop(self._heap)
      if self._priority.get(key) != priority:
        continue  # stale
      if can_evict is None or can_evict(key):
        del self._priority[key]
        self.last_priority = priority
        return key
      # passed over: out of the heap (still evictable) until requeue(key)
    return None

  def requeue(self, key):
    if key in self._priority:
      heapq.heappush(self._heap, (self._priority[key], key))

  def ranked(self, keys):
    return sorted((k for k in keys if k in self._priority), key=self._priority.get)

  def keys(self):
    return list(self._priority)

  def __contains__(self, key) -> bool:
    return key in self._priority

  def __len__(self) -> int:
    return len(self._priority)


def _session_major(tick: int, session) -> int:
  return session[1] if session is not None else tick


class LRU(HeapQueue):
  """Least recently used: the key pushed longest ago goes first; a session's blocks go by the
  end of its last turn, all together (deepest first: blocks are released tail first)."""

  def priority(self, key, tick, session):
    return (_session_major(tick, session), tick)


class LFU(HeapQueue):
  """Least frequently used: fewest hits first (a session's block counts its session's turns,
  or its own hits if more), least recently used among equals."""

  def priority(self, key, tick, session):
    count = max(session[0] if session is not None else 0, self.hits[key])
    return (count, _session_major(tick, session), tick)


class LeavesFirstLRU(HeapQueue):
  """LRU over prefix-tree depth: the deepest idle block goes first, least recently used among
  equal depths, so roots that many requests share stay longest. (The radix design evicts leaves
  only anyway; this also orders the hash design's chains from their tips.)"""

  def priority(self, key, tick, session):
    return (-self.depth[key], _session_major(tick, session), tick)


class GDSF(HeapQueue):
  """GreedyDual-Size-Frequency (Cherkasova 1998) with a block's recompute cost for its value:
  priority H = L + frequency * cost(depth), smallest first, where L (the inflation) is the H of
  the last victim, so entries not used for a while age out. A block at depth d attends to d
  blocks before it when recomputed, so cost(d) = 1 + attention_weight * d (every block is the
  same size: size drops out). attention_weight=0 is plain GreedyDual-Frequency."""

  attention_weight = 0.05

  def __init__(self):
    super().__init__()
    self.inflation = 0.0

  def priority(self, key, tick, session):
    cost = 1.0 + self.attention_weight * self.depth[key]
    return (self.inflation + (1 + self.hits[key]) * cost, tick)

  def pop(self, can_evict=None):
    key = super().pop(can_evict)
    if key is not None:
      self.inflation = self.last_priority[0]
    return key


class SessionRecency(HeapQueue):
  """Conversation-aware LRU: a block's age counts from the end of its session's last turn, less
  a bonus that grows with the session's turns: priority = last-turn tick + turn_bonus *
  min(turns - 1, turn_cap), smallest first. A conversation that has come back before is likely
  to come back again, so its blocks outlive one-turn requests pushed at the same time. Ticks
  count releases, so turn_bonus is in blocks released since (the capacity that passes by).
  Without a session a block is an LRU block."""

  turn_bonus = 2000.0
  turn_cap = 2

  def priority(self, key, tick, session):
    if session is None:
      return (float(tick), tick)
    turns, major = session
    return (major + self.turn_bonus * min(turns - 1, self.turn_cap), tick)


class Retention(HeapQueue):
  """Hold times by conversation class: a block released by a turn of a conversation in class c
  (its session's turns: 1, 2, 3, 4, 5-8, 9+) is held `hold[c]` ticks before it competes with a
  block released now: priority = last-turn tick + hold[c], smallest first (deepest first within
  a release: blocks are pushed tail first). hold[c] = 0 for every class is LRU; a class whose
  hold is far below the others' is in effect not admitted (its blocks enter at the cold end and
  go before any other). Without a session a block is a first turn's, aged from its release.

  The hold times are what a fit says (studies/retention_model.py: per class, the hold that a
  fluid model of the cache, fed the return times of a trace's first half, finds best at this
  capacity); the class default is all zeros (LRU)."""

  hold = (0.0,) * 6
  CLASS_OF_TURNS = (0, 0, 1, 2, 3, 4, 4, 4, 4)  # index: turns 0..8; above: 5

  @classmethod
  def turns_class(cls, turns: int) -> int:
    return cls.CLASS_OF_TURNS[turns] if turns < len(cls.CLASS_OF_TURNS) else 5

  def priority(self, key, tick, session):
    turns, major = session if session is not None else (1, tick)
    return (major + self.hold[self.turns_class(turns)], tick)


class S3FIFO(EvictionQueue):
  """S3-FIFO (Yang et al., SOSP 2023): a small FIFO (small_share of the idle entries) that new
  entries enter, a main FIFO, and a ghost FIFO of keys recently evicted from the small one. An
  entry leaving the small FIFO moves to main if it was hit there, else it is evicted (its key
  remembered as a ghost); an entry admitted again while its key is a ghost goes straight to
  main. Main is FIFO with reinsertion: an entry hit since it entered goes round again once
  (its frequency, capped at 3, counts down) instead of being evicted.

  Idle entries only are queued: an entry taken by a sequence leaves the FIFOs and comes back at
  the tail of the one it was in. The ghosts are named by chain key, since a block number is
  reused for other content once evicted."""

  small_share = 0.1

  def __init__(self):
    super().__init__()
    self._small: Dict[Hashable, None] = {}  # idle keys in the small FIFO, oldest first
    self._main: Dict[Hashable, None] = {}
    self._in_main: set = set()  # admitted keys that belong to main (idle or not)
    self._freq: Dict[Hashable, int] = {}
    self._chain: Dict[Hashable, object] = {}
    self._ghosts: Dict[object, None] = {}
    self._parked: set = set()  # passed over by can_evict until requeue
    self._entries = 0  # admitted entries (the cache's size, idle or not)

  def add(self, key, depth=0, chain_key=None):
    name = key if chain_key is None else chain_key
    self._chain[key] = name
    self._freq[key] = 0
    self._entries += 1
    if name in self._ghosts:  # evicted from small a while ago and back: it goes to main
      del self._ghosts[name]
      self._in_main.add(key)

  def hit(self, key):
    self._freq[key] = min(self._freq[key] + 1, 3)

  def push(self, key, session=None):
    self.discard(key)
    (self._main if key in self._in_main else self._small)[key] = None

  def discard(self, key) -> bool:
    was = key in self
    self._small.pop(key, None)
    self._main.pop(key, None)
    self._parked.discard(key)
    return was

  def remove(self, key):
    self.discard(key)
    self._in_main.discard(key)
    self._freq.pop(key, None)
    self._chain.pop(key, None)
    self._entries -= 1

  def _ghost(self, key):
    self._ghosts[self._chain[key]] = None
    while len(self._ghosts) > max(self._entries, 1):
      del self._ghosts[next(iter(self._ghosts))]

  def pop(self, can_evict=None):
    while self._small or self._main:
      small = len(self._small) >= self.small_share * max(self._entries, 1) or not self._main
      fifo = self._small if small else self._main
      key = next(iter(fifo))
      del fifo[key]
      if self._freq[key] > 0:  # hit while queued: it earns a (further) round in main
        self._freq[key] = 0 if small else self._freq[key] - 1
        self._in_main.add(key)
        self._main[key] = None
        continue
      if can_evict is not None and not can_evict(key):
        self._parked.add(key)
        continue
      if small:
        self._ghost(key)
      return key
    return None

  def requeue(self, key):
    if key in self._parked:
      self._parked.discard(key)
      (self._main if key in self._in_main else self._small)[key] = None

  def ranked(self, keys):
    order = {k: i for i, k in enumerate(itertools.chain(self._small, self._main))}
    return sorted((k for k in keys if k in self), key=lambda k: order.get(k, math.inf))

  def keys(self):
    return list(self._small) + list(self._main) + list(self._parked)

  def __contains__(self, key) -> bool:
    return key in self._small or key in self._main or key in self._parked

  def __len__(self) -> int:
    return len(self._small) + len(self._main) + len(self._parked)


class Belady(HeapQueue):
  """The offline optimum (Belady's MIN), adapted to prefix blocks: the evictable block whose
  next use is furthest in the future goes first (never used again: first of all), the deepest
  among equals, so a block never outlives its parent (its uses are a subset of its parent's:
  a prompt that reaches a block passes its parent first).

  An oracle, not an online policy: it must be told the future before any block is released,
  with see(future, clock): future maps a chain key to the sorted positions (requests, in trace
  order) that read it; clock() is the position being served now. experiments/policy_lab.py
  computes both from the trace. A block's next use is fixed when it is released (the next
  position after clock() that reads it), which is exact while requests run one at a time.

  What it bounds: with requests served one at a time and every missed block cached (no
  admission control), no policy gets more hit blocks from the same cache; hit tokens follow,
  since every full block is the same size. What it does not: concurrency (blocks held by
  running requests), admission control (declining to cache a block), costs that differ by
  block (a deep block costs more to recompute), or lower tiers."""

  offline = True  # needs the trace's future: config.prefix_cache.eviction cannot name it

  def __init__(self):
    super().__init__()
    self.future: Optional[Dict[int, List[int]]] = None
    self.clock: Optional[Callable[[], int]] = None
    self.chain: Dict[Hashable, int] = {}

  def see(self, future: Dict[int, List[int]], clock: Callable[[], int]) -> 'Belady':
    self.future, self.clock = future, clock
    return self

  def add(self, key, depth=0, chain_key=None):
    super().add(key, depth, chain_key)
    self.chain[key] = key if chain_key is None else chain_key

  def remove(self, key):
    super().remove(key)
    self.chain.pop(key, None)

  def next_use(self, key) -> float:
    uses = self.future.get(self.chain[key], ())
    i = bisect.bisect_right(uses, self.clock())
    return uses[i] if i < len(uses) else math.inf

  def priority(self, key, tick, session):
    if self.future is None:
      raise RuntimeError('Belady is an oracle: call see(future, clock) before the cache runs '
                         '(experiments/policy_lab.py does)')
    return (-self.next_use(key), -self.depth[key], tick)


class ReuseOracle(Belady):
  """Half an oracle, to take the optimum's advantage apart: it knows whether a block will be
  read again, not when. Blocks never read again go first, then LRU order. What it gains over LRU
  is what knowing which conversations come back is worth; what Belady gains over it is the
  timing."""

  def priority(self, key, tick, session):
    if self.future is None:
      raise RuntimeError('ReuseOracle is an oracle: call see(future, clock) before the cache '
                         'runs (experiments/policy_lab.py does)')
    return (0 if math.isinf(self.next_use(key)) else 1, _session_major(tick, session), tick)


class HitDensity(EvictionQueue):
  """Least expected hit density, learned online from the cache's own traffic (after LHD,
  Beckmann et al., NSDI 2018): the idle block with the fewest expected hits per unit of cache
  space-time from now on goes first.

  A block's class is its conversation's turn count (its session's turns; without a session, or
  for a block shared by several sessions, its own hits + 1), bucketed 1, 2, 3, 4, 5-8, 9-32,
  33+; its age counts ticks since its session's last turn ended (without a session, since its
  release). For each class the queue estimates the hazard of reuse by age (Kaplan-Meier over
  geometric age bins): an observation opens when a block is released and closes when it is
  read again (a hit while idle, or its content cached again after an eviction: a ghost list by
  chain key remembers evicted blocks) or is censored (the ghost is forgotten, or the block is
  taken without a hit). From the hazard, the density of a block in class c at age a is the best
  ratio over horizons L of expected reuses in [a, L) to the expected block-ticks it occupies
  until then. A conversation's next turn rarely comes within seconds of the last (a user reads
  and types), so a just-released block has a low density until its think time has passed, and
  an old one a low density once its conversation has likely ended: the queue keeps the blocks
  in between, where LRU keeps the newest. Ties within a (class, age bin) go the way the density
  falls (the younger end when density rises with age), deepest first among blocks of the same
  release, so a block does not outlive its parent.

  Until the first fit (and for bins no block has reached) every density is 0 and the oldest bin
  goes first: LRU by bins. Densities are refit every `refit_every` closed observations; counts
  halve every `half_life` observations."""

  first_edge = 16  # ticks: the first age bin is [0, first_edge)
  bin_ratio = 2 ** 0.5  # geometric age bins
  num_bins = 44
  ghost_factor = 8  # remembers up to ghost_factor x cached entries evicted blocks
  refit_every = 2048
  half_life = 100_000.0
  prior_weight = 8.0  # pseudo-observations of the pooled hazard added to each class's bin
  CLASS_OF_TURNS = (0, 0, 1, 2, 3, 4, 4, 4, 4) + (5,) * 24  # index: turns 0..32; above: 6
  num_classes = 7

  def __init__(self):
    super().__init__()
    self._now = -1
    edges = [0, self.first_edge]
    while len(edges) < self.num_bins:
      edges.append(max(edges[-1] + 1, int(math.ceil(edges[-1] * self.bin_ratio))))
    self._edges = edges  # bin b holds ages [edges[b], edges[b + 1]); the last is unbounded
    self._widths = [b - a for a, b in zip(edges, edges[1:])] + [edges[-1]]
    self._seq = itertools.count()
    self.depth: Dict[Hashable, int] = {}
    self.hits: Dict[Hashable, int] = {}
    self._chain: Dict[Hashable, object] = {}
    self._entry: Dict[Hashable, tuple] = {}  # idle key -> (r, -depth, seq, key, class)
    self._parked: Dict[Hashable, tuple] = {}  # passed over by can_evict until requeue
    self._lists: List[List[tuple]] = [[] for _ in range(self.num_classes)]  # sorted entries
    self._open: Dict[Hashable, Tuple[int, int]] = {}  # key -> (class, r): observation open
    self._ghosts: Dict[object, Tuple[int, int]] = {}  # chain key -> (class, r), oldest first
    self._reuse = [[0.0] * self.num_bins for _ in range(self.num_classes)]
    self._censor = [[0.0] * self.num_bins for _ in range(self.num_classes)]
    self._closed = 0
    self._group = (None, None)  # (depth, r) of the last push without a session
    self.density = [[0.0] * self.num_bins for _ in range(self.num_classes)]
    self._order = [self._bin_order(c) for c in range(self.num_classes)]
    self._younger_first = [[False] * self.num_bins for _ in range(self.num_classes)]

  # ---- the clock, classes, ages ----

  def tick(self) -> int:
    self._now = next(self._clock)
    return self._now

  def _bin(self, age: int) -> int:
    return bisect.bisect_right(self._edges, age) - 1

  def _class(self, key, session) -> int:
    hits = self.hits.get(key, 0)
    turns = session[0] if session is not None and hits <= session[0] else hits + 1
    return self.CLASS_OF_TURNS[turns] if turns < len(self.CLASS_OF_TURNS) else 6

  # ---- learning ----

  def _close(self, key, reused: bool) -> None:
    opened = self._open.pop(key, None)
    if opened is not None:
      self._count(opened, reused)

  def _count(self, opened, reused: bool) -> None:
    c, r = opened
    (self._reuse if reused else self._censor)[c][self._bin(max(self._now - r, 0))] += 1.0
    self._closed += 1
    if self._closed % self.refit_every == 0:
      self._refit()

  def _refit(self) -> None:
    keep = 0.5 ** (self.refit_every / self.half_life)
    for counts in (self._reuse, self._censor):
      for row in counts:
        row[:] = [x * keep for x in row]
    B, C = self.num_bins, self.num_classes
    # Kaplan-Meier: a block still observed (idle, or a remembered ghost) has survived to its
    # current age without reuse, so it counts as censored there, for this fit only.
    censor = [row[:] for row in self._censor]
    for c, r in itertools.chain(self._open.values(), self._ghosts.values()):
      censor[c][self._bin(max(self._now - r, 0))] += 1.0
    pooled_reuse = [sum(self._reuse[c][b] for c in range(C)) for b in range(B)]
    pooled_out = [pooled_reuse[b] + sum(censor[c][b] for c in range(C)) for b in range(B)]
    pooled = self._hazard(pooled_reuse, pooled_out, [0.0] * B, 0.0)
    for c in range(C):
      out = [self._reuse[c][b] + censor[c][b] for b in range(B)]
      hazard = self._hazard(self._reuse[c], out, pooled, self.prior_weight)
      self.density[c] = self._densities(hazard)
      self._order[c] = self._bin_order(c)
      d = self.density[c]
      self._younger_first[c] = [b + 1 < B and d[b + 1] > d[b] for b in range(B)]

  @staticmethod
  def _hazard(reuse, out, prior, weight) -> List[float]:
    """P(reuse in bin b | not reused before it), with `weight` pseudo-observations of prior."""
    hazard, at_risk = [0.0] * len(reuse), 0.0
    for b in range(len(reuse) - 1, -1, -1):
      at_risk += out[b]
      if at_risk + weight > 0:
        hazard[b] = (reuse[b] + weight * prior[b]) / (at_risk + weight)
    return hazard

  def _densities(self, hazard) -> List[float]:
    """Per bin a: max over horizons L >= a of E[reuses in bins a..L] / E[ticks held until]."""
    B, out = len(hazard), []
    for a in range(B):
      alive, hits, space, best = 1.0, 0.0, 0.0, 0.0
      for x in range(a, B):
        hits += alive * hazard[x]
        space += alive * self._widths[x] * (1.0 - hazard[x] / 2)
        alive *= 1.0 - hazard[x]
        if space > 0:
          best = max(best, hits / space)
        if alive < 1e-9:
          break
      out.append(best)
    return out

  def _bin_order(self, c) -> List[int]:
    """Class c's bins, lowest density first (the older bin first among equals: LRU)."""
    return sorted(range(self.num_bins), key=lambda b: (self.density[c][b], -b))

  # ---- events ----

  def add(self, key, depth=0, chain_key=None):
    self.depth[key] = depth
    self.hits[key] = 0
    name = key if chain_key is None else chain_key
    self._chain[key] = name
    ghost = self._ghosts.pop(name, None)
    if ghost is not None:  # evicted, and now read again: a reuse it would have served
      self._count(ghost, True)

  def hit(self, key):
    if key in self._entry or key in self._parked:
      self._close(key, True)
    self.hits[key] = self.hits.get(key, 0) + 1

  def push(self, key, session=None):
    self._unqueue(key)
    self._close(key, False)  # pushed again without a hit (a tier's re-use counts as a hit)
    if session is not None:
      r = session[1]
      self._group = (None, None)
    else:  # one release of a sequence pushes its blocks tail first: they age as one
      depth, last_r = self._group
      here = self.depth.get(key, 0)
      r = last_r if depth is not None and here < depth else self._now + 1
      self._group = (here, r)
    self.tick()
    r = min(r, self._now)  # a session tick from another clock cannot make an age negative
    c = self._class(key, session)
    entry = (r, -self.depth.get(key, 0), next(self._seq), key, c)
    self._entry[key] = entry
    self._open[key] = (c, r)
    self._insert(entry)

  def _insert(self, entry) -> None:
    bisect.insort(self._lists[entry[4]], entry)

  def _delete(self, entry) -> None:
    entries = self._lists[entry[4]]
    del entries[bisect.bisect_left(entries, entry)]

  def _unqueue(self, key) -> bool:
    entry = self._entry.pop(key, None)
    if entry is not None:
      self._delete(entry)
      return True
    return self._parked.pop(key, None) is not None

  def discard(self, key) -> bool:
    was = self._unqueue(key)
    self._close(key, False)  # taken without a hit (pinned): no reuse seen
    return was

  def remove(self, key):
    self._unqueue(key)
    opened = self._open.pop(key, None)
    name = self._chain.pop(key, key)
    if opened is not None:  # evicted while idle: remembered, to learn whether it comes back
      self._ghosts.pop(name, None)
      self._ghosts[name] = opened
      bound = self.ghost_factor * max(len(self.depth), 64)
      while len(self._ghosts) > bound:
        oldest = next(iter(self._ghosts))
        self._count(self._ghosts.pop(oldest), False)
    self.depth.pop(key, None)
    self.hits.pop(key, None)

  # ---- questions ----

  def _candidate(self, c, b, skip):
    """Class c's next victim in age bin b, or None: from the end where density is lower (the
    youngest release when it rises with age), deepest block first within a release."""
    entries, now = self._lists[c], self._now
    hi = self._edges[b + 1] if b + 1 < self.num_bins else math.inf
    lo_i = 0 if math.isinf(hi) else bisect.bisect_left(entries, (now - hi + 1,))
    hi_i = bisect.bisect_right(entries, (now - self._edges[b], math.inf))
    if self._younger_first[c][b]:
      i = hi_i - 1
      while i >= lo_i and entries[i][3] in skip:
        i -= 1
      if i < lo_i:
        return None
      for k in range(bisect.bisect_left(entries, (entries[i][0],), lo_i, i + 1), i + 1):
        if entries[k][3] not in skip:
          return entries[k]
    for i in range(lo_i, hi_i):
      if entries[i][3] not in skip:
        return entries[i]
    return None

  def _victim(self, skip=()):
    """The current entry of lowest density (the oldest bin among equals), skip excepted."""
    best = None
    for c, entries in enumerate(self._lists):
      if not entries:
        continue
      oldest = self._bin(max(self._now - entries[0][0], 0))
      youngest = self._bin(max(self._now - entries[-1][0], 0))
      for b in self._order[c]:
        if not youngest <= b <= oldest:
          continue
        rank = (self.density[c][b], -b)
        if best is not None and rank >= best[0]:
          break
        entry = self._candidate(c, b, skip)
        if entry is not None:
          best = (rank, entry)
          break
    return None if best is None else best[1]

  def pop(self, can_evict=None):
    passed, victim = set(), None
    while victim is None:
      entry = self._victim(passed)
      if entry is None:
        break
      if can_evict is None or can_evict(entry[3]):
        victim = entry[3]
        del self._entry[victim]
        self._delete(entry)
      else:
        passed.add(entry[3])
    for key in passed:  # passed over: out of the running until requeue(key)
      self._parked[key] = self._entry.pop(key)
      self._delete(self._parked[key])
    return victim

  def requeue(self, key):
    entry = self._parked.pop(key, None)
    if entry is not None:
      self._entry[key] = entry
      self._insert(entry)

  def _rank_key(self, key):
    entry = self._entry.get(key) or self._parked[key]
    c, b = entry[4], self._bin(max(self._now - entry[0], 0))
    young = self._younger_first[c][b]
    return (self.density[c][b], -b, -entry[0] if young else entry[0], entry[1], entry[2])

  def ranked(self, keys):
    return sorted((k for k in keys if k in self), key=self._rank_key)

  def keys(self):
    return list(self._entry) + list(self._parked)

  def __contains__(self, key) -> bool:
    return key in self._entry or key in self._parked

  def __len__(self) -> int:
    return len(self._entry) + len(self._parked)


class LRFU(HeapQueue):
  """LRFU (Lee et al., IEEE ToC 2001): between LRU and LFU by one decay. Each key keeps a
  combined recency-frequency value CRF = sum over its references (its admission and its hits)
  of 2 ** (-(now - t_ref) / half_life); the smallest goes first. Since every CRF decays at the
  same rate, log2 CRF(now) + now / half_life does not change with now, so it is the priority,
  fixed at the key's last reference. half_life -> 0 is LRU, -> infinity LFU. Ticks count block
  releases (the study sets half_life in cache capacities). Sessions are ignored: a block's
  references are its own."""

  half_life = 4096.0

  def __init__(self):
    super().__init__()
    self._score: Dict[Hashable, float] = {}  # key -> log2 CRF(t) + t / half_life
    self._now = -1

  def tick(self) -> int:
    self._now = super().tick()
    return self._now

  def _reference(self, key) -> None:
    t = self._now / self.half_life
    old = self._score.get(key)
    # log2(2**old + 2**t), computed without overflow: the new reference adds 2**0 at time t
    self._score[key] = t if old is None else max(old, t) + math.log2(1 + 2 ** -abs(old - t))

  def add(self, key, depth=0, chain_key=None):
    super().add(key, depth, chain_key)
    self._reference(key)

  def hit(self, key):
    super().hit(key)
    self._reference(key)

  def remove(self, key):
    super().remove(key)
    self._score.pop(key, None)

  def priority(self, key, tick, session):
    return (self._score[key], tick)


class ARC(EvictionQueue):
  """ARC (Megiddo and Modha, FAST 2003): two LRU lists, T1 for entries used once since they were
  cached and T2 for entries used again (a hit), and two ghost lists B1, B2 of the chain keys
  recently evicted from each. The target size p of T1 adapts: content cached again while its
  key is a B1 ghost says T1 was too small (p grows by max(1, |B2| / |B1|)); in B2, that T2 was
  (p shrinks). The victim is T1's least recently released idle entry while T1 holds more than p
  entries (idle or in use), else T2's. Content cached again from a ghost goes to T2. Ghosts are
  bounded by the cache's entries (each list, at most). Sessions are ignored."""

  def __init__(self):
    super().__init__()
    self.p = 0.0
    self._t1: Dict[Hashable, None] = {}  # idle keys of T1, least recently released first
    self._t2: Dict[Hashable, None] = {}
    self._in_t2: set = set()  # admitted keys that belong to T2 (idle or in use)
    self._chain: Dict[Hashable, object] = {}
    self._b1: Dict[object, None] = {}
    self._b2: Dict[object, None] = {}
    self._parked: set = set()
    self._entries = 0

  def add(self, key, depth=0, chain_key=None):
    name = key if chain_key is None else chain_key
    self._chain[key] = name
    self._entries += 1
    if name in self._b1:
      self.p = min(self.p + max(1.0, len(self._b2) / len(self._b1)), self._entries)
      del self._b1[name]
      self._in_t2.add(key)
    elif name in self._b2:
      self.p = max(self.p - max(1.0, len(self._b1) / len(self._b2)), 0.0)
      del self._b2[name]
      self._in_t2.add(key)

  def hit(self, key):
    self._in_t2.add(key)

  def push(self, key, session=None):
    self.discard(key)
    (self._t2 if key in self._in_t2 else self._t1)[key] = None

  def discard(self, key) -> bool:
    was = key in self
    self._t1.pop(key, None)
    self._t2.pop(key, None)
    self._parked.discard(key)
    return was

  def remove(self, key):
    self.discard(key)
    ghosts = self._b2 if key in self._in_t2 else self._b1
    self._in_t2.discard(key)
    ghosts[self._chain.pop(key)] = None
    self._entries -= 1
    while len(ghosts) > max(self._entries, 1):
      del ghosts[next(iter(ghosts))]

  def pop(self, can_evict=None):
    while self._t1 or self._t2:
      t1_size = self._entries - len(self._in_t2)
      lru = self._t1 if self._t1 and (t1_size > self.p or not self._t2) else self._t2
      key = next(iter(lru))
      del lru[key]
      if can_evict is None or can_evict(key):
        return key
      self._parked.add(key)
    return None

  def requeue(self, key):
    if key in self._parked:
      self._parked.discard(key)
      (self._t2 if key in self._in_t2 else self._t1)[key] = None

  def ranked(self, keys):
    """The order pop would take them in with p as it is now (T1 first while it is over p)."""
    t1_size = self._entries - len(self._in_t2)
    lists = (self._t1, self._t2) if t1_size > self.p else (self._t2, self._t1)
    order = {k: i for i, k in enumerate(itertools.chain(*lists))}
    return sorted((k for k in keys if k in self), key=lambda k: order.get(k, math.inf))

  def keys(self):
    return list(self._t1) + list(self._t2) + list(self._parked)

  def __contains__(self, key) -> bool:
    return key in self._t1 or key in self._t2 or key in self._parked

  def __len__(self) -> int:
    return len(self._t1) + len(self._t2) + len(self._parked)


def _is_queue_class(obj) -> bool:
  return isinstance(obj, type) and issubclass(obj, EvictionQueue)


EVICTION = Registry('eviction', _is_queue_class, 'an EvictionQueue subclass')
EVICTION.register('lru', LRU)
EVICTION.register('lfu', LFU)
EVICTION.register('leaves_first', LeavesFirstLRU)
EVICTION.register('gdsf', GDSF)
EVICTION.register('session_recency', SessionRecency)
EVICTION.register('s3fifo', S3FIFO)
EVICTION.register('hit_density', HitDensity)
EVICTION.register('lrfu', LRFU)
EVICTION.register('arc', ARC)
EVICTION.register('retention', Retention)
EVICTION.register('belady', Belady)
EVICTION.register('reuse_oracle', ReuseOracle)


def eviction_queue(spec) -> EvictionQueue:
  """A fresh queue for one cache or tier: spec is a registered name, 'module:Class', or an
  EvictionQueue instance (used as is: an oracle built with the future, a tuned policy)."""
  if isinstance(spec, EvictionQueue):
    return spec
  return EVICTION.get(spec)()


def eviction_name(spec) -> str:
  """How metrics name a cache's policy: its config value, or an instance's class name."""
  return spec if isinstance(spec, str) else type(spec).__name__


# ---- preemption victims -----------------------------------------------------------------------

VICTIM = Registry('victim', callable, 'a function (scheduler, candidates) -> Sequence')


@VICTIM.register('newest')
def newest(scheduler, candidates):
  """The newest running sequence (vLLM's choice)."""
  del scheduler
  return candidates[-1]


# min()/max() keep the first of equals: these scan newest first, so ties go to the newest.


@VICTIM.register('least_progress')
def least_progress(scheduler, candidates):
  """The fewest tokens in the cache (the least work lost)."""
  del scheduler
  return min(candidates[::-1], key=lambda s: s.num_cached)


@VICTIM.register('priority')
def priority(scheduler, candidates):
  """The largest SamplingParams.priority value (lower is served first)."""
  del scheduler
  return max(candidates[::-1], key=lambda s: s.params.priority)


@VICTIM.register('cost')
def cost(scheduler, candidates):
  """The cheapest to preempt by the cost model (host/tiers/tier_cost.py): swap or recompute, as the
  scheduler would do it."""
  return min(candidates[::-1], key=scheduler.cost_s)


VICTIMS_NEEDING_COST = ('cost',)  # the scheduler needs a cost model for these


# ---- admission ------------------------------------------------------------------------------

ADMISSION = Registry('admission', callable, 'a function (scheduler, unit) -> bool')


@ADMISSION.register('watermark')
def watermark(scheduler, unit):
  """Admit while batch rows and blocks (less the watermark) allow."""
  del scheduler, unit
  return True


@ADMISSION.register('projected')
def projected(scheduler, unit):
  """Also ask that the blocks every running sequence and the unit will hold admission_horizon
  tokens from now (each capped at its max_new_tokens; 0 = when it finishes) fit the blocks
  sequences may use (shared blocks counted once per holder: an upper bound)."""
  if not scheduler.running:
    return True
  blocks, horizon = scheduler.blocks, scheduler.admission_horizon

  def projected_blocks(seq):
    left = seq.params.max_new_tokens - len(seq.output_ids)
    ahead = min(left, horizon) if horizon else left
    n = blocks.blocks_for(min(seq.num_tokens + ahead, blocks.max_seq_len))
    return min(n, seq.window) if seq.window else n  # offloaded: its window at most

  need = sum(projected_blocks(s) * s.width for s in scheduler.running + unit)
  return need <= blocks.usable_blocks


# ---- waiting-queue order ----------------------------------------------------------------------

QUEUE_ORDER = Registry('queue order', callable, 'a function (seq) -> sort key')


@QUEUE_ORDER.register('fcfs')
def fcfs(seq):
  """First come, first served: (arrival_time, request_id) (Sequence.order)."""
  return seq.order


@QUEUE_ORDER.register('sjf')
def shortest_job_first(seq):
  """Shortest job first: the fewest tokens left to compute (prompt not cached yet plus the
  tokens still to generate), FCFS among equals."""
  left = seq.params.max_new_tokens - len(seq.output_ids)
  return (seq.num_pending + left,) + seq.order


@QUEUE_ORDER.register('priority')
def priority_first(seq):
  """The smallest SamplingParams.priority first, FCFS among equals."""
  return (seq.params.priority,) + seq.order
