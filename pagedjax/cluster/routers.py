"""Routers: which replica serves a request, as plug-in policies (plain host Python, no jax).

A router sees the request (`RouteRequest`: its prompt's token ids, salt, length) and one
`ReplicaState` per replica (load figures the cluster keeps up to date, sim.py) and returns a
replica index. Some also keep what they learn: `routed(request, replica)` after each decision.

  random        uniformly at random (seeded)
  round_robin   in turn
  least_loaded  the smallest load: `metric='tokens'` (queued prompt tokens still to prefill +
                context tokens of running sequences), 'kv' (fraction of KV blocks held) or
                'requests' (waiting + running)
  approx_prefix what the router saw of earlier prompts (SGLang's cache-aware router, Ray
                Serve's PrefixCacheAffinityRouter): a tree (here a chain of block keys) of the
                prompts routed to each replica, LRU-trimmed to what a replica could hold. If
                the load is imbalanced (max - min requests above `balance_abs` and max above
                `balance_rel` x min) the least loaded replica; else the replica whose remembered
                prompts share the longest prefix, if it covers `match_threshold` of the prompt;
                else the least loaded (`cold='routed'`: the replica sent the fewest prompt
                tokens so far, as Ray's router picks its smallest prefix tree).
  precise       what the replicas report holding (index.KVIndex, kept from their KV events;
                llm-d's precise prefix-cache scorer, Dynamo's KV router): score = w_prefix x
                (tier-weighted fraction of the prompt's blocks held, as a prefix) + w_kv x (1 -
                KV use) + w_queue x (1 - requests / the most any replica has); the best score.
  tier_cost     the least expected time to first token (host/tiers/tier_cost.py's cost model),
                plus the delay the request's own work adds to others: queued prefill work x
                prefill rate + (the part of the prompt not held x prefill rate + loading the
                held part from its tiers, each block from its best tier, the promotion rule's
                cheapest split of load vs recompute) x (1 + delay_weight x the larger of the
                requests waiting there and the mean waiting per replica). What it routed counts
                as held on the device there until the index shows it (PendingRoutes).

Every policy takes equally good replicas in turn (by index), after the least loaded among them
for precise and tier_cost (queued + running tokens): never always the first of equals.

`make_router(name, **kwargs)` builds one by registry name or 'package.module:Class' (any class
with `route(request, replicas) -> int`); `register(name)` adds a class to the registry (a
host/policies.py Registry, as the scheduling and eviction policies use).
"""
import collections
import dataclasses
import math
import random as random_lib
from typing import Callable, Dict, List, Optional, Sequence as Seq

from pagedjax.cluster.index import KVIndex, prompt_keys
from pagedjax.host import policies
from pagedjax.host.tiers import tier_cost

def _is_router_class(obj) -> bool:
  return isinstance(obj, type) and callable(getattr(obj, 'route', None))


# The registry helper the scheduling and caching policies use (host/policies.py): a name, or
# 'package.module:Class', resolves to a router class; PolicyError (a ValueError) names the rest.
ROUTERS = policies.Registry('router', _is_router_class,
                            'a class with route(request, replicas) -> int')


def register(name: str) -> Callable[[type], type]:
  """A class decorator: registers the router class under `name`."""
  def add(cls: type) -> type:
    ROUTERS.register(name, cls)
    cls.name = name
    return cls
  return add


def router_class(name: str) -> type:
  """A registered router, or 'package.module:Class'."""
  return ROUTERS.get(name)


def make_router(name: str, **kwargs):
  return router_class(name)(**kwargs)


@dataclasses.dataclass
class RouteRequest:
  """What a router sees of a request. Its chain keys (prefix_cache.chain_keys, the engines'
  prefix-cache keys) are computed once per block size (`keys`) and kept: the router, the
  cluster's look-ups of the chosen replica and a retry of the request all read the same list."""
  request_id: int
  prompt_ids: Seq[int]
  salt: Optional[str] = None
  max_new_tokens: int = 0
  _keys: Dict[object, List[int]] = dataclasses.field(default_factory=dict, repr=False)

  def keys(self, block_size: int) -> List[int]:
    if block_size not in self._keys:
      self._keys[block_size] = prompt_keys(self.prompt_ids, block_size, self.salt)
    return self._keys[block_size]

  def hand_keys(self, engine, request_id: int) -> bool:
    """Gives the engine's sequence for this request (submitted as `request_id`) the chain keys
    computed here, so its prefix cache does not hash the prompt again: only keys of the
    engine's block size and the request's salt, one per full block, and only to a sequence of
    these very token ids that has none yet (a request that reached another replica, or came
    over the wire, is checked the same way). True when handed (a prompt shorter than a block
    has none to hand)."""
    keys = self._keys.get(engine.block_size)
    seq = engine.completions.live.get(request_id)
    if (not keys or seq is None or seq.block_keys or seq.params.cache_salt != self.salt or
        seq.prompt_ids != list(self.prompt_ids) or
        len(keys) != len(seq.prompt_ids) // engine.block_size):
      return False
    seq.block_keys = list(keys)
    return True


@dataclasses.dataclass
class ReplicaState:
  """One replica's load, as the cluster last saw it (a real router scrapes these metrics)."""
  index: int
  capacity_blocks: int = 0  # KV blocks of its device pool
  block_size: int = 16
  num_waiting: int = 0
  num_running: int = 0
  queued_prefill_tokens: int = 0  # prompt tokens routed here and not computed yet (not cached)
  running_tokens: int = 0  # context tokens of its running sequences
  kv_usage: float = 0.0  # fraction of its blocks held by sequences
  cost: Optional[tier_cost.TierCosts] = None  # its prefill rate and tier transfer figures

  @property
  def num_requests(self) -> int:
    return self.num_waiting + self.num_running

  @property
  def load_tokens(self) -> int:
    return self.queued_prefill_tokens + self.running_tokens


class InTransit:
  """What a live router sent that its replica's published load does not show yet.

  A live router reads each replica's load as the replica last published it, which leaves out
  the requests on their way there (the call to the replica, its inbox until the next engine
  iteration, the publication's own trip back). Without them, requests that arrive close
  together all see the same replica as least loaded and go to it. The simulated cluster's
  router sees every request in its replica's state the moment it is routed. So the live router
  records each request it sends here (`sent`), each replica publishes how many requests it has
  received (`received`, a running count), and `state` adds the difference: the latest sends,
  as waiting requests and their prompt tokens still to prefill. A replica that publishes no
  count is taken as published; a count above this router's sends (other routers send there
  too) adds nothing."""
  KEEP = 1024  # sends remembered per replica (more than are ever in transit at once)

  def __init__(self):
    self._tokens: Dict[object, collections.deque] = {}  # replica -> prompt tokens per send
    self._sent: Dict[object, int] = collections.Counter()  # replica -> sends in all

  def sent(self, replica, prompt_tokens: int) -> None:
    self._tokens.setdefault(replica, collections.deque(maxlen=self.KEEP)).append(
        int(prompt_tokens))
    self._sent[replica] += 1

  def forget(self, replica) -> None:
    self._tokens.pop(replica, None)
    self._sent.pop(replica, None)

  def in_transit(self, replica, received: Optional[int]) -> List[int]:
    """Prompt tokens of each send `replica` had not received as of its count `received`."""
    if received is None:
      return []
    sends = self._tokens.get(replica, ())
    n = min(self._sent.get(replica, 0) - int(received), len(sends))
    return list(sends)[len(sends) - n:] if n > 0 else []

  def state(self, index: int, replica, published: dict) -> 'ReplicaState':
    """ReplicaState from the replica's published fields (with its `received` count), the
    requests still in transit added."""
    fields = dict(published)
    received = fields.pop('received', None)
    state = ReplicaState(index, **fields)
    transit = self.in_transit(replica, received)
    state.num_waiting += len(transit)
    state.queued_prefill_tokens += sum(transit)
    return state


class Router:
  """Base: `route` picks; `routed` is told the pick (routers that learn override it).

  Equally good replicas are taken in turn (`_in_turn`): always the first of equals would send
  every request that no replica is better for (a cold prefix on idle replicas) to one
  replica, which then evicts while the others sit empty."""
  name = 'router'
  index: Optional[KVIndex] = None  # routers that read the cluster's KV index set it
  _turn = 0  # ties broken so far (per router)

  def route(self, request: RouteRequest, replicas: Seq[ReplicaState]) -> int:
    raise NotImplementedError

  def routed(self, request: RouteRequest, replica: int) -> None:
    pass

  def _in_turn(self, tied: Seq[ReplicaState]) -> int:
    """One of equally good replicas: the next in turn, by index, as ties come."""
    if len(tied) == 1:
      return tied[0].index
    self._turn += 1
    return sorted(tied, key=lambda r: r.index)[(self._turn - 1) % len(tied)].index

  def _least(self, replicas: Seq[ReplicaState], load: Callable[[ReplicaState], float]) -> int:
    """The replica of least load; equals in turn."""
    least = min(load(r) for r in replicas)
    return self._in_turn([r for r in replicas if load(r) <= least + TIE_TOLERANCE])


TIE_TOLERANCE = 1e-9  # scores this close are equal (sums of float terms)


@register('random')
class RandomRouter(Router):

  def __init__(self, seed: int = 0):
    self._rng = random_lib.Random(seed)

  def route(self, request, replicas):
    return replicas[self._rng.randrange(len(replicas))].index


@register('round_robin')
class RoundRobinRouter(Router):

  def __init__(self):
    self._next = 0

  def route(self, request, replicas):
    pick = replicas[self._next % len(replicas)].index
    self._next += 1
    return pick


LOAD_METRICS = {'tokens': lambda r: r.load_tokens, 'kv': lambda r: r.kv_usage,
                'requests': lambda r: r.num_requests}


def _load_metric(metric: str) -> Callable[[ReplicaState], float]:
  if metric not in LOAD_METRICS:
    raise ValueError(f'metric={metric!r} is not allowed: one of {", ".join(LOAD_METRICS)}')
  return LOAD_METRICS[metric]


@register('least_loaded')
class LeastLoadedRouter(Router):

  def __init__(self, metric: str = 'tokens'):
    self.metric, self._load = metric, _load_metric(metric)

  def route(self, request, replicas):
    return self._least(replicas, self._load)


@register('approx_prefix')
class ApproxPrefixRouter(Router):
  """Prefix affinity from what this router routed (see the module docstring)."""

  COLD = ('load', 'routed')

  def __init__(self, block_size: int = 64, capacity_blocks: int = 0, match_threshold: float = 0.5,
               balance_abs: int = 32, balance_rel: float = 1.5, load: str = 'requests',
               cold: str = 'load'):
    """block_size: tokens per remembered block (the router's own, not the engines').
    capacity_blocks: remembered blocks per replica, LRU (0: the replica's KV capacity in these
    blocks, from its ReplicaState). cold: where a prompt no replica matches goes: 'load', the
    least loaded; 'routed', the replica this router has sent the fewest prompt tokens so far,
    the least loaded of equals (Ray Serve's PrefixCacheAffinityRouter sends it to the replica
    whose prefix tree, which only grows, is smallest: new prefixes go where traffic has been
    lightest, so hot tenants' replicas take no new ones)."""
    if block_size < 1:
      raise ValueError(f'block_size={block_size} is not allowed: >= 1')
    if cold not in self.COLD:
      raise ValueError(f'cold={cold!r} is not allowed: one of {", ".join(self.COLD)}')
    self.cold = cold
    self._routed_tokens: Dict[int, int] = collections.Counter()  # replica -> tokens sent
    if not 0 <= match_threshold <= 1:
      raise ValueError(f'match_threshold={match_threshold} is not allowed: in [0, 1]')
    self.block_size, self.capacity_blocks = block_size, capacity_blocks
    self.match_threshold, self.balance_abs, self.balance_rel = (match_threshold, balance_abs,
                                                                balance_rel)
    self._load = _load_metric(load)
    self._holders: Dict[int, set] = {}  # block key -> replicas it was routed to
    self._lru: Dict[int, collections.OrderedDict] = collections.defaultdict(
        collections.OrderedDict)  # replica -> its remembered keys, oldest first
    self._capacity: Dict[int, int] = {}

  def _keys(self, request: RouteRequest) -> List[int]:
    """Chain keys of the prompt's full router blocks: the engines' own (prefix_cache
    chain_keys), so with the engines' block size they are the keys the request already has."""
    return request.keys(self.block_size)

  def route(self, request, replicas):
    loads = [self._load(r) for r in replicas]
    lo, hi = min(loads), max(loads)
    for r in replicas:
      self._capacity.setdefault(r.index, self.capacity_blocks or max(
          1, r.capacity_blocks * r.block_size // self.block_size))
    if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
      return self._least(replicas, self._load)
    keys = self._keys(request)
    alive = {r.index for r in replicas}
    matched = dict.fromkeys(alive, 0)
    for i, key in enumerate(keys):
      alive &= self._holders.get(key, set())
      if not alive:
        break
      for r in alive:
        matched[r] = i + 1
    best = max(matched.values(), default=0)
    if keys and best / len(keys) >= self.match_threshold and best:
      return self._least([r for r in replicas if matched[r.index] == best], self._load)
    if self.cold == 'routed':
      fewest = min(self._routed_tokens[r.index] for r in replicas)
      replicas = [r for r in replicas if self._routed_tokens[r.index] == fewest]
    return self._least(replicas, self._load)

  def routed(self, request, replica):
    self._routed_tokens[replica] += len(request.prompt_ids)
    keys = self._keys(request)
    lru = self._lru[replica]
    for key in reversed(keys):  # the first block most recent: trimming takes tails first
      if key in lru:
        lru.move_to_end(key)
      else:
        lru[key] = None
        self._holders.setdefault(key, set()).add(replica)
    capacity = self._capacity.get(replica, self.capacity_blocks or math.inf)
    while len(lru) > capacity:
      key, _ = lru.popitem(last=False)
      holders = self._holders[key]
      holders.discard(replica)
      if not holders:
        del self._holders[key]


MEDIUM_WEIGHTS = {1: 1.0, 2: 0.8, 3: 0.5}  # what a held block counts for, by tier


@register('precise')
class PreciseRouter(Router):
  """Scores replicas on what they report holding (see the module docstring)."""

  def __init__(self, index: Optional[KVIndex] = None, block_size: int = 0, w_prefix: float = 3.0,
               w_kv: float = 2.0, w_queue: float = 2.0, tier_weights: Optional[dict] = None):
    """index: the cluster's KVIndex (the cluster sets it when None). block_size: the engines'
    (0: the replicas' ReplicaState.block_size)."""
    self.index, self.block_size = index, block_size
    self.w_prefix, self.w_kv, self.w_queue = w_prefix, w_kv, w_queue
    self.tier_weights = {**MEDIUM_WEIGHTS, **(tier_weights or {})}

  def route(self, request, replicas):
    keys = request.keys(self.block_size or replicas[0].block_size)
    held = self.index.match(keys, [r.index for r in replicas]) if keys else {}
    most = max(r.num_requests for r in replicas) or 1
    w = self.tier_weights

    def score(r: ReplicaState) -> float:
      tiers = held.get(r.index, ())
      prefix = sum(w[t] * tiers.count(t) for t in w) / len(keys) if tiers else 0.0
      return (self.w_prefix * prefix + self.w_kv * (1 - r.kv_usage) +
              self.w_queue * (1 - r.num_requests / most))
    scores = [score(r) for r in replicas]
    best = max(scores)
    # equal scores (idle replicas, a prefix nobody holds): the least tokens queued and running
    return self._least([r for r, x in zip(replicas, scores) if x >= best - TIE_TOLERANCE],
                       lambda r: r.load_tokens)


class PendingRoutes:
  """The prompts a router sent where the KV index cannot show them yet: a replica announces a
  block once it has computed it (its KV events), so a second request for a prefix whose first
  prefill is still queued or running would find it nowhere. `routed` records the prompt's keys
  on its replica for `decisions` routing decisions; `extend` counts a recorded prefix as held
  on the device (tier 1, as it will be) past what the index shows. A block the index has been
  told the replica stored (`stored`, the index's on_stored listener) is confirmed and never
  counted again: from then on the index tracks it, evictions included. A block it is never
  told of (the request failed, or was evicted before it was announced) stops counting when
  its entry expires."""

  def __init__(self, decisions: int):
    self.decisions = decisions
    self._now = 0  # routing decisions so far
    # key -> replica -> the last decision its entry lives (negated once confirmed)
    self._entries: Dict[int, Dict[int, int]] = {}
    self._queue: collections.deque = collections.deque()  # (expiry, key, replica), in order
    self.index: Optional[KVIndex] = None  # the index it listens to (listen)

  def listen(self, index: KVIndex) -> None:
    if index is not self.index:
      index.on_stored(self.stored)
      self.index = index

  def stored(self, replica: int, keys: Seq[int]) -> None:
    """The index was told `replica` stored these blocks: their entries are confirmed."""
    entries = self._entries
    for key in keys:
      mine = entries.get(key)
      if mine is not None:
        until = mine.get(replica, 0)
        if until > 0:
          mine[replica] = -until

  def routed(self, keys: Seq[int], replica: int, shown: int = 0) -> None:
    """Records keys on replica; the first `shown` are what the index shows it holding now
    (recorded as confirmed: the replica will not announce them again)."""
    until = self._now + self.decisions + 1
    entries = self._entries
    for i, key in enumerate(keys):
      mine = entries.setdefault(key, {})
      if mine.get(replica, 0) >= 0:  # a confirmed block stays the index's
        mine[replica] = -until if i < shown else until
        self._queue.append((until, key, replica))

  def extend(self, keys: Seq[int], held: Dict[int, List[int]]) -> Dict[int, List[int]]:
    """`held` (KVIndex.match's replica -> tiers of its prefix) with each replica's recorded,
    unconfirmed blocks right after it counted as device blocks; one routing decision passes.

    A chain key names its whole prefix, and `routed` records a prompt from its first block, so
    only replicas with an entry for keys[0] can have entries for this prompt at all."""
    self._now += 1
    queue, entries = self._queue, self._entries
    while queue and queue[0][0] <= self._now:
      until, key, replica = queue.popleft()
      mine = entries.get(key)
      if mine is not None and abs(mine.get(replica, 0)) == until:
        del mine[replica]
        if not mine:
          del entries[key]
    first = entries.get(keys[0]) if keys else None
    if not first:
      return held
    out = held
    for replica in first:
      tiers = held.get(replica, ())
      n = len(tiers)
      while n < len(keys):
        mine = entries.get(keys[n])
        if not mine or mine.get(replica, 0) <= 0:
          break
        n += 1
      if n > len(tiers):
        if out is held:
          out = dict(held)
        out[replica] = [*tiers, *([1] * (n - len(tiers)))]
    return out


@register('tier_cost')
class TierCostRouter(Router):
  """The least expected TTFT by the tier cost model (see the module docstring)."""

  def __init__(self, index: Optional[KVIndex] = None, block_size: int = 0,
               prefill_s_per_token: float = 0.0, delay_weight: float = 4.0,
               pending_decisions: int = 1024):
    """prefill_s_per_token: used for replicas whose ReplicaState has no cost model (0: a unit
    rate, see _per_token; a live replica publishes no cost model).
    pending_decisions: how many routing decisions a routed prompt counts as held on its
    replica before the index shows it (PendingRoutes; 0: the index alone).
    delay_weight: how many times the prompt's own work is charged per request it delays (0:
    this request's expected TTFT alone; see `score_s`). The default, 4, was the best of 0-16 in
    the simulated llm-d studies (docs/cluster.md)."""
    if not (prefill_s_per_token >= 0 and math.isfinite(prefill_s_per_token)):
      raise ValueError(f'prefill_s_per_token={prefill_s_per_token!r} is not allowed: a finite '
                       'number >= 0')
    if not (delay_weight >= 0 and math.isfinite(delay_weight)):
      raise ValueError(f'delay_weight={delay_weight!r} is not allowed: a finite number >= 0')
    if isinstance(pending_decisions, bool) or not isinstance(pending_decisions, int) or (
        pending_decisions < 0):
      raise ValueError(f'pending_decisions={pending_decisions!r} is not allowed: an integer >= 0')
    self.index, self.block_size = index, block_size
    self.prefill_s_per_token = prefill_s_per_token
    self.delay_weight = float(delay_weight)
    self.pending = PendingRoutes(pending_decisions) if pending_decisions else None
    self._keyed_with = 0  # the block size route() last keyed a request with
    self._shown, self._shown_for = {}, None  # the index's match for those keys

  def expected_ttft_s(self, request: RouteRequest, replica: ReplicaState,
                      tiers: Seq[int]) -> float:
    """Queued prefill, then this prompt: its held blocks loaded or recomputed (the promotion
    rule's cheapest split: device blocks cost nothing), the rest prefilled."""
    return (replica.queued_prefill_tokens * self._per_token(replica) +
            self._prompt_s(request, replica, tiers))

  def score_s(self, request: RouteRequest, replica: ReplicaState, tiers: Seq[int],
              mean_waiting: float = 0.0) -> float:
    """What `route` minimises: expected_ttft_s + delay_weight x the prompt's own work x the
    requests it holds up, the larger of the requests waiting at the replica and mean_waiting
    (the mean over the replicas routed among). By Little's law about as many requests arrive
    while a queue drains as wait in it now, and each waits for this work; a replica idle while
    the others have queues takes the requests the router would have sent elsewhere. So with
    nobody waiting anywhere the score is the TTFT alone, and under overload a prefix recomputed
    away from its holder is charged for every request it delays."""
    return self._score(replica, self._prompt_s(request, replica, tiers), mean_waiting)

  def _score(self, replica: ReplicaState, own_s: float, mean_waiting: float) -> float:
    """score_s from the prompt's own part (_prompt_s)."""
    return (replica.queued_prefill_tokens * self._per_token(replica) +
            own_s * (1.0 + self.delay_weight * max(replica.num_waiting, mean_waiting)))

  def _per_token(self, replica: ReplicaState) -> float:
    """Its cost model's prefill rate; without one, prefill_s_per_token, else 1 (a unit: with
    no tier figures every term is a token count times it, so the pick does not depend on it)."""
    cost = replica.cost
    if cost is not None:
      return cost.prefill_s_per_token
    return self.prefill_s_per_token or 1.0

  def _prompt_s(self, request: RouteRequest, replica: ReplicaState, tiers: Seq[int]) -> float:
    """This prompt's own part of expected_ttft_s."""
    cost, per_token = replica.cost, self._per_token(replica)
    bs = self.block_size or replica.block_size
    held_tokens = len(tiers) * bs
    own = (len(request.prompt_ids) - held_tokens) * per_token
    below = [t for t in tiers if t > 1]
    if below and cost is not None:
      j = cost.blocks_to_load(below, 'auto')
      own += cost.load_s(below[:j]) + cost.recompute_s(len(below) - j)
    elif below:
      own += len(below) * bs * per_token  # no transfer figures: recompute
    return own

  def route(self, request, replicas):
    self._keyed_with = self.block_size or replicas[0].block_size  # routed() keys with it too
    keys = request.keys(self._keyed_with)
    held = self.index.match(keys, [r.index for r in replicas]) if keys else {}
    if self.pending is not None:
      self.pending.listen(self.index)
      self._shown, self._shown_for = held, keys  # routed() records what the index showed
      held = self.pending.extend(keys, held)
    prompt_s: Dict[tuple, float] = {}  # replicas of one cost model holding the same tiers
    # (every replica on the shared store's prefix, say) cost the prompt the same: once each
    mean_waiting = sum(r.num_waiting for r in replicas) / len(replicas)

    def score(r: ReplicaState) -> float:  # score_s, memoised per case
      tiers = held.get(r.index, ())
      case = (id(r.cost), r.block_size, tuple(tiers))
      if case not in prompt_s:
        prompt_s[case] = self._prompt_s(request, r, tiers)
      return self._score(r, prompt_s[case], mean_waiting)
    times = [score(r) for r in replicas]
    least = min(times)
    return self._least([r for r, t in zip(replicas, times) if t <= least * (1 + TIE_TOLERANCE)],
                       lambda r: r.load_tokens)

  def routed(self, request, replica):
    if self.pending is not None and self._keyed_with:
      keys = request.keys(self._keyed_with)
      shown = self._shown.get(replica, ()) if self._shown_for is keys else ()
      self.pending.routed(keys, replica, len(shown))
