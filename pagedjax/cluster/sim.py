"""A simulated cluster: N replicas, each the real engine host code on a simulated device
(pagedjax/sim), on one event clock behind a router.

Each replica is an Engine with its own clock (simulated seconds, pagedjax/sim/simulated_device.py).
`SimulatedCluster.run(requests)` replays a trace of `ClusterRequest`s in time order; the next
event is whichever comes first:
  an arrival      the router picks a replica (its decision timed on this machine's clock:
                  that is the routing cost a real router would add), the request is submitted
                  there with its arrival time, and the replica's state counts it as queued
  an iteration    the replica whose clock is earliest among those with work runs one engine
                  step; then its KV events (host/kv_events.py) go into the cluster's KVIndex
                  (index.py), as a per-iteration publication would, and its ReplicaState is
                  refreshed from the engine
So a replica never runs ahead of an arrival it could have seen, and a router sees each replica
as of its last iteration. With `max_in_flight` (a client's connections), a request that arrives
while that many are routed and unfinished reaches the cluster when one finishes.

A shared store (`shared_store_blocks` > 0; Mooncake Store, LMCache, or the replicas' disk tiers
on one disk_store.make_shared store): one LRU store of that many blocks under every replica.
Every block a replica's device cache keys is written to it (its BlockStored(GPU) events), and
the store's own stores and evictions go into the KV index as medium DISK, which the index
shares among all replicas (KVIndex(shared_media=('DISK',))), so the precise and tier-aware
routers count a store block on every replica at disk cost. At submission, the prompt's blocks
past what the replica's device cache holds that the store holds (as a prefix, short of the
block holding the last prompt token) are the request's shared hits, `Outcome.shared_at_routing`
tokens (`hit_rate_shared_tokens`): they are loaded into the replica's device cache as a tier-3
promotion puts them (Replica.load_from_store: cached, idle, announced), so the engine does not
compute them, and the request reaches the engine only after the load, at its arrival time plus
its cost model's tier-3 time for those blocks (`tier_cost.TierCosts.load_s`: the store's
latency and bandwidth behind the host link; SimulatedCluster then needs `costs`). Its TTFT,
counted from its arrival at the cluster, includes the load. What this leaves out: the blocks
are in the device cache from the routing decision on, not from the load's end, and loads do
not contend for the store's bandwidth.

Replicas with KV tiers (config.tiers.host_blocks on the simulated device: pagedjax/sim, the
real KVTiers over blocks without contents) demote what their device cache evicts to host RAM
and promote it back at admission, the host link's time charged by the cost model; their host
tier's stores and removals are KV events of medium CPU, so the index and the precise and
tier-aware routers see host-resident prefixes. At submission, the prompt's blocks past the
device prefix that the host tier holds (committed, as a prefix, short of the block holding the
last prompt token) are `Outcome.host_at_routing` tokens: what its admission is expected to load
rather than compute (the promotion rule may still decline some, and the tier may evict them
before admission). A shared store under replicas with their own tiers is not modelled (refused).

Queued prefill work (ReplicaState.queued_prefill_tokens): for each request routed to a replica
and not yet prefilled, the prompt tokens neither its device cache nor its host tier (nor the
shared store) held at routing time, and for running ones what is left of their prompt. Figures (`figures`): per replica and for the cluster,
the prefix hit rate by tier, TTFT and TPOT p50/p90/p99, throughput, load imbalance (max / mean
of requests and of prompt tokens computed per replica), and the router's decision time.
"""
import collections
import dataclasses
import heapq
import math
import time
from typing import Dict, List, NamedTuple, Optional, Sequence as Seq

import numpy as np

from pagedjax.cluster.index import KVIndex
from pagedjax.cluster.routers import ReplicaState, RouteRequest, Router
from pagedjax.host import kv_events
from pagedjax.host.requests.intake import RequestError
from pagedjax.host.requests.sequence import Sequence
from pagedjax.host.requests.sampling_params import SamplingParams

QUANTILES = (50, 90, 99)


@dataclasses.dataclass
class ClusterRequest:
  request_id: int
  prompt_ids: List[int]
  max_new_tokens: int
  arrival_time: float
  salt: Optional[str] = None
  label: object = None  # e.g. the load stage it belongs to (figures group by it)
  tenant: Optional[int] = None  # who sent it (workload bookkeeping; routers never see it)
  user: Optional[int] = None


@dataclasses.dataclass
class Outcome:
  """One finished request: where it ran and its times (simulated seconds)."""
  request_id: int
  replica: int
  label: object
  arrival_time: float
  first_token_time: float
  finish_time: float
  prompt_len: int
  output_len: int
  cached_at_routing: int  # prompt tokens its replica's device cache held when it was routed
  route_s: float  # the router's decision, wall seconds on this machine
  shared_at_routing: int = 0  # prompt tokens past those that the shared store held
  host_at_routing: int = 0  # prompt tokens past the device's that its host tier held

  @property
  def ttft_s(self) -> float:
    return self.first_token_time - self.arrival_time

  @property
  def tpot_s(self) -> Optional[float]:
    if self.output_len < 2:
      return None
    return (self.finish_time - self.first_token_time) / (self.output_len - 1)


class SharedStore:
  """One store of `capacity_blocks` blocks (chain keys) every replica writes to and reads
  from, least recently used first out (see the module docstring). It announces what it stores
  and evicts as KV events of medium DISK (`events`, drained by the cluster)."""

  def __init__(self, capacity_blocks: int, block_size: int):
    if not isinstance(capacity_blocks, int) or capacity_blocks < 1:
      raise ValueError(f'shared_store_blocks={capacity_blocks!r} is not allowed: an integer >= 1 '
                       '(0: no shared store)')
    self.capacity, self.block_size = capacity_blocks, block_size
    self._lru: collections.OrderedDict = collections.OrderedDict()
    self.events: List[kv_events.KVEvent] = []
    self.stored = self.evicted = 0

  def __len__(self) -> int:
    return len(self._lru)

  def __contains__(self, key: int) -> bool:
    return key in self._lru

  def keys(self) -> List[int]:
    """The blocks held, least recently used first."""
    return list(self._lru)

  def put(self, keys) -> None:
    new = []
    for key in keys:
      if key in self._lru:
        self._lru.move_to_end(key)
        continue
      self._lru[key] = None
      new.append(key)
    gone = []
    while len(self._lru) > self.capacity:
      gone.append(self._lru.popitem(last=False)[0])
    self.stored += len(new)
    self.evicted += len(gone)
    if new:
      self.events.append(kv_events.BlockStored(tuple(new), None, (), self.block_size, None,
                                               kv_events.MEDIUM_DISK))
    if gone:
      self.events.append(kv_events.BlockRemoved(tuple(gone), kv_events.MEDIUM_DISK))

  def prefix(self, keys, start: int) -> int:
    """How many of keys[start:] the store holds, in order from start (each one touched)."""
    n = 0
    for key in keys[start:]:
      if key not in self._lru:
        break
      self._lru.move_to_end(key)
      n += 1
    return n


class Routed(NamedTuple):
  """A request a replica took, and what its prompt found at routing (Outcome's fields)."""
  request: ClusterRequest
  cached: int  # prompt tokens its device cache held
  route_s: float
  shared: int  # past those, the shared store's
  host: int  # past those, its host tier's

  @property
  def queued(self) -> int:
    """Prompt tokens to compute, as routing saw it (ReplicaState.queued_prefill_tokens)."""
    return len(self.request.prompt_ids) - self.cached - self.shared - self.host


class Replica:
  """One engine, its KV event log and the state a router sees."""

  def __init__(self, index: int, engine, cost=None):
    if engine.prefix_cache is None:
      raise ValueError(f'replica {index}: a cluster replica needs prefix_cache.enabled=True '
                       '(routing by prefix is what the cluster studies)')
    self.index, self.engine = index, engine
    self.log = kv_events.EventLog(engine.prefix_cache.events, rank=index)
    self.state = ReplicaState(index, capacity_blocks=engine.allocator.num_blocks - 1,
                              block_size=engine.block_size, cost=cost)
    self.requests: Dict[int, Routed] = {}  # by engine request id
    self.routed = 0

  def has_work(self) -> bool:
    return self.engine.has_work()

  def device_prefix_blocks(self, request: RouteRequest) -> int:
    """Prompt blocks this replica's device cache holds now, as a prefix (as its next admission
    would find them, short of a hash collision)."""
    cache, n = self.engine.prefix_cache, 0
    for key in request.keys(self.engine.block_size):
      if cache.block_of(key) is None:
        break
      n += 1
    return n

  def host_prefix_blocks(self, request: RouteRequest, first: int) -> int:
    """Prompt blocks from block `first` on that this replica's host tier holds (committed), as a
    prefix (what its admission would find there, short of a hash collision)."""
    tiers = self.engine.tiers
    if tiers is None or tiers.host is None:
      return 0
    index, n = tiers.host.index, 0
    for key in request.keys(self.engine.block_size)[first:]:
      if key not in index or index.is_pending(key):
        break
      n += 1
    return n

  def device_prefix_tokens(self, request: RouteRequest) -> int:
    return self._tokens(self.device_prefix_blocks(request), request)

  def _tokens(self, blocks: int, request: RouteRequest) -> int:
    """Prompt tokens of `blocks` leading blocks (never the last token: it is always computed)."""
    return min(blocks * self.engine.block_size, len(request.prompt_ids) - 1)

  def submit(self, request: ClusterRequest, route: RouteRequest, route_s: float,
             store: Optional[SharedStore] = None, at: Optional[float] = None) -> None:
    """at: when the request reaches the cluster, if later than its arrival (it waited for a
    slot under SimulatedCluster's max_in_flight)."""
    device = self.device_prefix_blocks(route)
    cached = self._tokens(device, route)
    host = self._tokens(device + self.host_prefix_blocks(route, device), route) - cached
    shared, arrival = 0, max(request.arrival_time, at or 0.0)
    if store is not None:
      held = store.prefix(route.keys(self.engine.block_size), device)
      # the last prompt token is always computed: a block holding it is not loaded
      held = max(0, min(device + held, (len(request.prompt_ids) - 1) // self.engine.block_size)
                 - device)
      loaded = self.load_from_store(route, device, held)
      shared = self._tokens(device + loaded, route) - cached
      arrival += self.state.cost.load_s([3] * loaded) if loaded else 0.0
    local = self.engine.submit(request.prompt_ids, SamplingParams(
        max_new_tokens=request.max_new_tokens, stop_on_eos=False, cache_salt=request.salt),
                               arrival_time=arrival)
    route.hand_keys(self.engine, local)  # the keys routing computed: not hashed again
    routed = self.requests[local] = Routed(request, cached, route_s, shared, host)
    self.routed += 1
    self.state.num_waiting += 1
    self.state.queued_prefill_tokens += routed.queued

  def load_from_store(self, route: RouteRequest, first: int, n: int) -> int:
    """Blocks first..first+n-1 of the prompt, which the shared store holds, into this
    replica's device cache, as a tier-3 hit's promotion puts them (cached and idle, announced
    as BlockStored(GPU)), so the engine does not compute them; the blocks of its device prefix
    are held meanwhile so the allocation cannot evict them. As many as the pool has room for;
    returns how many."""
    engine = self.engine
    cache, allocator, bs = engine.prefix_cache, engine.allocator, engine.block_size
    keys = route.keys(bs)
    prefix = [cache.block_of(k) for k in keys[:first]]
    for block in prefix:
      allocator.take_cached(block)
    n = min(n, allocator.num_free)
    # a stand-in sequence holding the prompt's blocks, offered as a filled prompt's would be
    loading = Sequence(-1, list(route.prompt_ids), SamplingParams(cache_salt=route.salt))
    loading.block_table = prefix + allocator.allocate(n)
    loading.block_keys, loading.num_offered = list(keys[:first + n]), first
    cache.offer(loading, first + n)
    allocator.free(loading.block_table)
    return n

  def next_time(self) -> float:
    """When this replica next has something to do: now, or its next queued arrival (a
    request waiting for its load from the store) when it has nothing scheduled."""
    engine = self.engine
    if engine.scheduler.has_work() or not engine.intake.pending:
      return engine.clock
    return max(engine.clock, engine.intake.next_arrival())

  def step(self, index: KVIndex, store: Optional[SharedStore] = None) -> list:
    done = self.engine.step()
    batch = self.log.drain(self.engine.clock)
    if batch is not None:
      index.apply(self.index, batch)
      if store is not None:  # every block the device cache keyed is written to the store
        for event in batch.events:
          if isinstance(event, kv_events.BlockStored) and event.medium in (
              None, kv_events.MEDIUM_GPU):
            store.put(event.block_hashes)
        index.apply(self.index, store.events)  # medium DISK: the index's shared holder
        store.events.clear()
    self.refresh()
    return done

  def refresh(self) -> None:
    """The ReplicaState from the engine (what a metrics scrape would read)."""
    e, s = self.engine, self.state
    waiting = list(e.scheduler.waiting) + [item[2] for item in e.intake.pending]
    s.num_waiting, s.num_running = len(waiting), len(e.running)
    queued = sum(self.requests[seq.request_id].queued for seq in waiting
                 if seq.request_id in self.requests)
    queued += sum(max(0, len(seq.prompt_ids) - seq.num_cached) for seq in e.running)
    s.queued_prefill_tokens = queued
    s.running_tokens = sum(seq.num_cached for seq in e.running)
    s.kv_usage = e.allocator.num_used / s.capacity_blocks  # held by sequences (or pinned)


class SimulatedCluster:

  def __init__(self, engines: Seq, router: Router, costs: Optional[Seq] = None,
               shared_store_blocks: int = 0, max_in_flight: Optional[int] = None,
               machine_share: Optional[float] = None):
    """engines: simulated (or real) engines with prefix caching; costs: each one's
    tier_cost.TierCosts for routers that weigh costs (None: ReplicaState.cost stays None);
    shared_store_blocks: a shared store of that many blocks under every replica (0: none;
    module docstring); max_in_flight: at most this many requests routed and not finished, as
    a client with that many connections sends them (None: no limit). A request arriving when
    all are taken is routed when one finishes; its TTFT still counts from its arrival.
    machine_share: the replicas share one machine on which this many of them step at full
    speed at once (processor sharing; 1 where each step uses every core): an iteration that
    starts while k replicas are busy (stepping, or with work) takes max(1, k / machine_share)
    times its simulated time (None: each replica has a machine of its own). Simulated
    engines only (their SimClock stretches)."""
    if not engines:
      raise ValueError('a cluster needs at least one replica')
    if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
      raise ValueError(f'max_in_flight={max_in_flight!r} is not allowed: an integer >= 1 '
                       '(None: no limit)')
    if machine_share is not None:
      if not (isinstance(machine_share, (int, float)) and not isinstance(machine_share, bool)
              and math.isfinite(machine_share) and machine_share > 0):
        raise ValueError(f'machine_share={machine_share!r} is not allowed: a number > 0 '
                         '(None: a machine per replica)')
      if not all(hasattr(getattr(e, 'timer', None), 'slowdown') for e in engines):
        raise ValueError(f'machine_share={machine_share} needs simulated engines (a SimClock '
                         'timer): a real engine runs at the speed it runs')
    self.max_in_flight, self.machine_share = max_in_flight, machine_share
    self.slowdowns: List[float] = []  # per stepped iteration, with machine_share
    if shared_store_blocks and any(e.tiers is not None for e in engines):
      raise ValueError(f'shared_store_blocks={shared_store_blocks} with replicas that have their '
                       'own KV tiers (config.tiers) is not modelled: one or the other')
    if shared_store_blocks and not costs:
      raise ValueError(f'shared_store_blocks={shared_store_blocks} needs costs (each replica\'s '
                       'tier_cost.TierCosts: a load from the store takes its tier-3 time)')
    for i, cost in enumerate(costs or ()):
      if shared_store_blocks and not math.isfinite(cost.load_s([3])):
        raise ValueError(f'costs[{i}] has no tier-3 figures (bytes_per_s[3]='
                         f'{cost.bytes_per_s.get(3)}, latency_s[3]={cost.latency_s.get(3)}): '
                         'a shared store needs the time a load from it takes')
    self.replicas = [Replica(i, e, costs[i] if costs else None) for i, e in enumerate(engines)]
    self.store = (SharedStore(shared_store_blocks, engines[0].block_size)
                  if shared_store_blocks else None)
    self.router = router
    self.index = KVIndex(shared_media=(kv_events.MEDIUM_DISK,) if self.store is not None else ())
    if getattr(router, 'index', False) is None:
      router.index = self.index  # routers that read the KV index read the cluster's
    self.outcomes: List[Outcome] = []
    self.rejected: List[tuple] = []  # (request id, replica, error) refused at submission
    self.wall_s = 0.0

  def run(self, requests: Seq[ClusterRequest]) -> List[Outcome]:
    start = time.perf_counter()
    pending = sorted(requests, key=lambda r: (r.arrival_time, r.request_id))
    states = [r.state for r in self.replicas]
    # when each free slot of max_in_flight became free (a min-heap; no limit: never empty)
    slots = self._slots = [0.0] * (self.max_in_flight or 0)
    i = 0
    while True:
      busy = [r for r in self.replicas if r.has_work()]
      next_arrival = None  # when the next request reaches the cluster: it arrived, and a slot
      if i < len(pending) and (slots or self.max_in_flight is None):  # is free
        next_arrival = max(pending[i].arrival_time, slots[0] if slots else 0.0)
      if next_arrival is None and not busy:
        if i < len(pending):  # every slot taken and nothing running: cannot happen
          raise RuntimeError(f'{len(pending) - i} requests left with no slot free')
        break
      # with a store, a request may be queued for after its load: a replica waiting for one
      # is not stepped past arrivals it could still take
      when = (lambda r: r.next_time()) if self.store is not None else (lambda r: r.engine.clock)
      first = min(busy, key=lambda r: (when(r), r.index)) if busy else None
      if next_arrival is not None and (first is None or next_arrival <= when(first)):
        if slots:
          heapq.heappop(slots)
        self._route(pending[i], states, next_arrival)
        i += 1
      else:
        if self.machine_share is not None:
          t = first.engine.clock  # replicas busy when its iteration starts, itself included
          k = sum(1 for r in self.replicas if r is first or r.has_work() or r.engine.clock > t)
          first.engine.timer.slowdown = max(1.0, k / self.machine_share)
          self.slowdowns.append(first.engine.timer.slowdown)
        for c in first.step(self.index, self.store):
          self._finished(first, c)
          if self.max_in_flight is not None:
            heapq.heappush(slots, c.finish_time)
    self.wall_s = time.perf_counter() - start
    return self.outcomes

  def _route(self, request: ClusterRequest, states, at: Optional[float] = None) -> None:
    route = RouteRequest(request.request_id, request.prompt_ids, request.salt,
                         request.max_new_tokens)
    t0 = time.perf_counter()
    pick = self.router.route(route, states)
    self.router.routed(route, pick)
    route_s = time.perf_counter() - t0
    try:
      self.replicas[pick].submit(request, route, route_s, self.store, at)
    except RequestError as e:
      self.rejected.append((request.request_id, pick, str(e)))
      if self.max_in_flight is not None:  # refused: its slot is free again at once
        heapq.heappush(self._slots, at or request.arrival_time)

  def _finished(self, replica: Replica, c) -> None:
    request, cached, route_s, shared, host = replica.requests.pop(c.request_id)
    self.outcomes.append(Outcome(  # arrival: the cluster's (a store load came after it)
        request.request_id, replica.index, request.label, request.arrival_time,
        c.first_token_time,
        c.finish_time, len(c.prompt_ids), len(c.output_ids), cached, route_s, shared, host))

  # ---- figures -----------------------------------------------------------------------------

  def figures(self, outcomes: Optional[Seq[Outcome]] = None) -> dict:
    """Cluster figures over `outcomes` (default: all), with the replicas' cache figures."""
    outcomes = self.outcomes if outcomes is None else outcomes
    out = latency_figures(outcomes)
    summaries = [r.engine.summary() for r in self.replicas]
    queried = sum(s['prefix_queried_tokens'] for s in summaries)
    out['prefix_hit_rate_tokens'] = (sum(s['prefix_hit_tokens'] for s in summaries) / queried
                                     if queried else None)
    for tier in (2, 3):  # lower tiers, when the replicas have them (config.tiers)
      blocks = sum(s.get(f'tiers_tier{tier}_hit_blocks', 0) or 0 for s in summaries)
      out[f'hit_rate_tier{tier}_tokens'] = (blocks * self.replicas[0].engine.block_size /
                                           queried if queried else None)
    out['hit_rate_tier1_tokens'] = out['prefix_hit_rate_tokens']
    out['hit_rate_tiered_tokens'] = (
        out['prefix_hit_rate_tokens'] + out['hit_rate_tier2_tokens'] + out['hit_rate_tier3_tokens']
        if queried else None)
    for name in ('promoted_blocks', 'declined_blocks', 'tier2_demoted_blocks',
                 'tier2_evictions'):  # the host tiers' traffic, summed over replicas
      out[f'tiers_{name}'] = int(sum(s.get(f'tiers_{name}', 0) or 0 for s in summaries))
    computed = [s['prompt_tokens_computed'] for s in summaries]
    routed = [r.routed for r in self.replicas]
    shared = sum(o.shared_at_routing for o in outcomes)
    out.update(
        replicas=len(self.replicas), router=self.router.name,
        shared_store=self.store is not None,
        shared_store_blocks=self.store.capacity if self.store is not None else 0,
        prompt_tokens_computed=int(sum(computed)),
        prompt_tokens_shared=int(shared),
        prompt_tokens_computed_with_store=int(sum(computed)),  # loaded tokens are not
        imbalance_requests=_max_over_mean(routed), imbalance_prefill=_max_over_mean(computed),
        rejected_requests=len(self.rejected), simulator_wall_s=self.wall_s,
        kv_index_events=self.index.events_applied,
        slowdown_mean=float(np.mean(self.slowdowns)) if self.slowdowns else None)
    return out

  def replica_figures(self) -> List[dict]:
    rows = []
    for r in self.replicas:
      s = r.engine.summary()
      mine = [o for o in self.outcomes if o.replica == r.index]
      rows.append(dict(replica=r.index, requests=r.routed,
                       prefix_hit_rate_tokens=s['prefix_hit_rate_tokens'],
                       tier2_hit_rate=s.get('tier2_hit_rate'),
                       prompt_tokens_computed=s['prompt_tokens_computed'],
                       prefix_cache_evictions=s['prefix_cache_evictions'],
                       preemptions=s.get('preemptions', 0), **latency_figures(mine)))
    return rows


def _max_over_mean(values) -> Optional[float]:
  mean = float(np.mean(values)) if len(values) else 0.0
  return float(np.max(values)) / mean if mean else None


def latency_figures(outcomes: Seq[Outcome]) -> dict:
  """TTFT / TPOT quantiles, throughput and routing time over some finished requests."""
  out = {'finished_requests': len(outcomes)}
  ttft = [o.ttft_s for o in outcomes]
  tpot = [o.tpot_s for o in outcomes if o.tpot_s is not None]
  route = [o.route_s for o in outcomes]
  for name, values in (('ttft', ttft), ('tpot', tpot)):
    for q in QUANTILES:
      out[f'{name}_p{q}_s'] = float(np.percentile(values, q)) if values else None
  out['ttft_mean_s'] = float(np.mean(ttft)) if ttft else None
  if outcomes:
    span = max(o.finish_time for o in outcomes) - min(o.arrival_time for o in outcomes)
    generated = sum(o.output_len for o in outcomes)
    out['generated_tokens_per_s'] = generated / span if span > 0 else None
    out['requests_per_s'] = len(outcomes) / span if span > 0 else None
    cached = sum(o.cached_at_routing for o in outcomes)
    shared = sum(o.shared_at_routing for o in outcomes)
    prompt = sum(o.prompt_len for o in outcomes)
    out['cached_at_routing_fraction'] = cached / prompt
    out['hit_rate_shared_tokens'] = shared / prompt
    out['hit_rate_with_store_tokens'] = (cached + shared) / prompt
    out['host_at_routing_fraction'] = sum(o.host_at_routing for o in outcomes) / prompt
  for q in (50, 99):
    out[f'route_p{q}_ms'] = float(np.percentile(route, q)) * 1e3 if route else None
  out['route_max_ms'] = max(route) * 1e3 if route else None
  return out
