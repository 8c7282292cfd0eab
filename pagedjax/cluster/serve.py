"""pagedjax engine replicas on Ray Serve, routed by pagedjax's routers (or Ray's own).

  client --HTTP 127.0.0.1--> Serve proxy --> CompletionsIngress --handle--> EngineReplica x N
                                              (parse, tokenize,     ^  router: a RequestRouter
                                               retry on a dead       |  subclass in the ingress's
                                               replica)              |  process, choose_replicas
                                                                     |
                                   KVEventBus (a named actor) <------+  each replica publishes
                                   its KV events and load after every engine iteration; the
                                   router pulls what is new before each decision

  EngineReplica      one pagedjax engine (factory.build_engine) per Serve replica, driven by a
                     thread that submits what comes in between two steps and steps it while
                     it has work (every step shape run before it takes traffic, warm_shapes:
                     a request never waits for a compilation); `complete` (whole answer) and
                     `complete_stream` (token deltas). A request the engine refuses comes back
                     as {'error': RequestError message}, never an exception.
  KVEventBus         a Ray actor holding, in order, every replica's KV event batches
                     (host/kv_events.py, vLLM's wire layout) and its latest load figures
                     (routers.ReplicaState's fields). Why a bus: Serve's own per-replica stats
                     channel (`record_routing_stats`) is polled by the controller every
                     `request_routing_stats_period_s` and replaces a whole dict each time, which
                     suits load figures but not a stream of per-iteration deltas; a named actor
                     the replicas push to and the routers pull from is what Ray's own
                     PrefixCacheAffinityRouter does with its prefix-tree actor.
  PagedjaxRequestRouter  a Serve RequestRouter: any pagedjax/cluster/routers.py policy (registry
                     name or 'module:Class') deciding over Serve's candidate replicas, with its
                     own KVIndex kept from the bus. It ranks the pick first and the rest after
                     (Serve tries the next rank when a replica is full). A replica that dies, or
                     leaves the replica set, is forgotten: its blocks are cleared from the index.
  CompletionsIngress the HTTP face: POST /v1/completions in OpenAI's shape (`prompt`,
                     `max_tokens`, `temperature`, `top_p`, `seed`, `stream`, `model`, and
                     vLLM's `cache_salt` and `ignore_eos`); 400 with the engine's RequestError
                     message for a request it refuses; a request whose replica died is sent
                     again (the router picks a live one), a stream resuming after the tokens
                     already sent (greedy and seeded sampling give the same tokens again).
  ServeDeployment    starts (and always stops) Ray, Serve, the bus and the application on
                     127.0.0.1, with bounded waits.

Ray's baselines: `ray_pow2` (PowerOfTwoChoicesRequestRouter, Serve's default) and `ray_prefix`
(PrefixCacheAffinityRouter). The public import of the latter, ray.serve.llm.request_router,
needs `ray[llm]` (pyarrow, vLLM's stack) at import time; the class itself is generic (it reads
`.prompt` text off the request's first argument and keeps a character prefix tree per replica),
so it is imported from where it is defined (ray.llm._internal...), which needs nothing more.

Serve ships PagedjaxRequestRouter by value: its RequestRouterConfig registers this module with
cloudpickle.register_pickle_by_value, so in the ingress the router runs against a copy of this
module's globals, where a class defined here is a second class of the same name. So nothing the
router must recognise by class is defined here: the request, RoutedPrompt, is completions.py's.
"""
import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Dict, List, Optional

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedjax.cluster import routers as routers_lib
from pagedjax.cluster.completions import RoutedPrompt, parse_completion
from pagedjax.cluster.index import KVIndex
from pagedjax.host import kv_events
from pagedjax.host.tiers import disk_store
from pagedjax.host.requests.intake import RequestError

BUS_NAMESPACE = 'pagedjax'
APP_NAME = 'pagedjax'
ROUTE = '/v1/completions'
RAY_ROUTERS = {
    'ray_pow2': 'ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter',
    'ray_prefix': ('ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:'
                   'PrefixCacheAffinityRouter'),
}
FINISH_REASONS = {'eos': 'stop'}  # pagedjax's reason -> OpenAI's; the rest are 'length'

# A request's way to its first token, as wall-clock stamps (time.time(), one machine):
# (stage, from stamp, to stamp). The ingress, the router and the replica stamp the request
# (RoutedPrompt.times) and the replica's first answer carries them back (the first streamed
# event's `pagedjax.times`); the client adds its own: 'arrival' (when the request was due),
# 'sent' and 'first_event'. Ray's routers add no router stamps.
STAGES = (
    ('wait_slot', 'arrival', 'sent'),          # the client's connections were all busy
    ('to_ingress', 'sent', 'ingress'),         # HTTP, Serve's proxy, its call to the ingress
    ('parse', 'ingress', 'handle'),            # the body read and parsed
    ('to_router', 'handle', 'route_start'),    # Serve's handle, until a routing task runs it
    ('pull', 'route_start', 'pulled'),         # the router's pull from the KV event bus
    ('policy', 'pulled', 'routed'),            # the policy's decision
    ('to_replica', 'routed', 'replica'),       # Serve sends it; the replica's loop takes it
    ('submit', 'replica', 'submitted'),        # to the engine's thread, between two steps
    ('engine_queue', 'submitted', 'scheduled'),  # until a step starts with it in the batch
    ('prefill', 'scheduled', 'first_token'),   # its prompt's steps, to its first token
    ('to_ingress_back', 'first_token', 'first_item'),  # the replica's stream to the ingress
    ('to_client', 'first_item', 'first_event'),        # the SSE event through the proxy
)


def stage_seconds(times: dict) -> Dict[str, Optional[float]]:
  """STAGES' seconds from a request's stamps. A stage whose end stamp is missing is None; one
  whose start stamp is missing starts at the last stamp before it (with Ray's routers,
  'to_replica' runs from 'handle'), so the stages present add up to the span they cover."""
  out, last = {}, None
  for name, start, end in STAGES:
    begin = times.get(start, last)
    if end in times and begin is not None:
      out[name] = times[end] - begin
      last = times[end]
    else:
      out[name] = None
  return out


# ---- the request (completions.py: its class must not be defined in this module, see there) ---

# ---- the KV event bus --------------------------------------------------------------------------

@ray.remote(num_cpus=0)
class KVEventBus:
  """Every replica's KV event batches in order, and its latest load figures.

  publish(replica, wire_batch, state, summary, serving): a replica's batch
  (kv_events.batch_to_wire, or None), its ReplicaState fields, its Engine.summary() (or None)
  and the request ids (RoutedPrompt.request_id) it has in flight. serving(request_id) -> the
  replicas whose latest publication lists it (a test kills the one serving its request).
  since(cursor) -> (next cursor, [(replica, wire batch)], {replica: state}, lost): what came
  after `cursor`; lost is True when the bus had already dropped some of it (it keeps the last
  `max_batches`), and the reader must then start its index over.
  forget(replica): the replica is gone; readers get an AllBlocksCleared for it. summaries():
  each replica's Engine.summary() as it last published it (when it last went idle)."""

  def __init__(self, max_batches: int = 100_000):
    self._log = collections.deque(maxlen=max_batches)
    self._next = 0  # sequence number of the next batch
    self._states: Dict[str, dict] = {}
    self._summaries: Dict[str, dict] = {}
    self._serving: Dict[str, frozenset] = {}  # replica -> request ids in flight there

  def publish(self, replica: str, batch: Optional[list], state: dict,
              summary: Optional[dict] = None, serving=()) -> None:
    if batch is not None:
      self._log.append((self._next, replica, batch))
      self._next += 1
    self._states[replica] = state
    self._serving[replica] = frozenset(serving)
    if summary is not None:
      self._summaries[replica] = summary

  def serving(self, request_id: str) -> List[str]:
    """The replicas whose latest publication lists request_id in flight (sorted)."""
    return sorted(r for r, ids in self._serving.items() if request_id in ids)

  def summaries(self) -> Dict[str, dict]:
    """replica -> its Engine.summary() as last published (when it last went idle)."""
    return dict(self._summaries)

  def forget(self, replica: str) -> None:
    self._serving.pop(replica, None)
    if self._states.pop(replica, None) is not None:
      self._log.append((self._next, replica, kv_events.batch_to_wire(kv_events.KVEventBatch(
          time.time(), (kv_events.AllBlocksCleared(None),)))))
      self._next += 1

  def since(self, cursor: int) -> tuple:
    first = self._log[0][0] if self._log else self._next
    new = [(replica, batch) for n, replica, batch in self._log if n >= cursor]
    return self._next, new, dict(self._states), cursor < first


# ---- the replica --------------------------------------------------------------------------------

class _Waiter:
  """A request in flight on a replica: the loop and queue its caller waits on."""

  def __init__(self, loop, stream: bool, request: RoutedPrompt):
    self.loop, self.stream, self.queue, self.sent = loop, stream, asyncio.Queue(), 0
    self.request_id, self.times = request.request_id, request.times
    self.compile_at_submit = None  # the engine's compile seconds when it was submitted
    self.compile_s = None  # those its engine spent from then to its first token

  def put(self, item) -> None:
    self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def warm_up(engine) -> None:
  """One short request that compiles the first shapes before a replica takes traffic (its
  prompt is shorter than a block: nothing is cached). An engine of the same config in the
  driver that runs it first, with JAX's persistent compilation cache on (the replicas inherit
  the driver's environment), lets the replicas load these programs instead of compiling them."""
  engine.generate([[1, 2, 3]], dict(max_new_tokens=2, temperature=0.0))


def warm_shapes(engine, context_tokens: int) -> int:
  """Every step shape the engine can call (rows, query tokens and table width buckets) for
  contexts up to `context_tokens`, run once now (pagedjax/sim/calibrate.py's step grid), so
  that serving compiles nothing; with JAX's persistent compilation cache filled by an engine of
  the same config (the driver's), a replica loads them. Without it a replica met its row and
  width buckets while serving, and every request on it waited: 3-4 new shapes per replica
  in a replay of 60 requests, 0.4-2.2 s each under load. The calls write KV into every block
  of the pool, so it runs only on an engine that holds nothing yet (ValueError otherwise);
  a request then reads only positions it wrote itself. Returns how many programs it traced (compiled, or
  loaded from that cache)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from pagedjax.device import traces  # pylint: disable=import-outside-toplevel  (jax)
  from pagedjax.sim import calibrate  # pylint: disable=import-outside-toplevel
  allocator, executor = engine.allocator, engine.executor
  held = allocator.num_blocks - 1 - len(allocator.free_blocks())
  if held or engine.has_work():
    raise ValueError(f'warm_shapes needs an engine that holds nothing (its calls write KV into '
                     f'every block of the pool): {held} blocks are held or cached, and it has '
                     f'{"" if engine.has_work() else "no "}requests in flight')
  rng = np.random.default_rng(0)
  before = traces.count()  # (engine.num_compilations counts its own device calls only)
  # fill 1.0: every rows bucket is some point's own row count
  calibrate.compile_shapes(executor, [calibrate.grid_inputs(
      p, executor, engine.model_cfg.vocab_size, rng) for p in step_points(engine, context_tokens)])
  return traces.count() - before


def step_points(engine, context_tokens: int, fills=(1.0,)) -> list:
  """calibrate.step_grid's calls for the engine's executor and scheduler budget, each row's
  context within the smallest table width that holds `context_tokens` (the widest, past it):
  every step shape that requests of contexts up to `context_tokens` can reach."""
  from pagedjax.sim import calibrate  # pylint: disable=import-outside-toplevel
  executor, scheduler = engine.executor, engine.scheduler
  widths = [w * executor.block_size for w in executor.table_width_buckets]
  reach = min([w for w in widths if w >= context_tokens] or [widths[-1]])
  return [p for p in calibrate.step_grid(executor, scheduler.max_num_batched_tokens,
                                         scheduler.prefill_chunk, tuple(fills))
          if max(ctx for _, ctx in p.rows) <= reach]


class EngineReplica:
  """One engine per Serve replica (see the module docstring)."""

  STATE_EVERY_S = 0.02  # load figures alone are published at most this often

  def __init__(self, config, bus_name: str, tokenizer=None,
               warm_context_tokens: Optional[int] = None):
    """tokenizer: the driver's (None: the replica loads the config's; parsing a GGUF takes
    seconds per replica). warm_context_tokens: every step shape for contexts up to this many
    tokens is run before the replica takes traffic (warm_shapes); None: only warm_up's."""
    from pagedjax import factory  # pylint: disable=import-outside-toplevel  (jax: replicas only)
    self.engine = engine = factory.build_engine(config, tokenizer)
    if engine.prefix_cache is None:
      raise ValueError('a served replica needs prefix_cache.enabled=True (the routers route by '
                       'cached prefix)')
    if warm_context_tokens:
      warm_shapes(engine, warm_context_tokens)
    warm_up(engine)
    self.uid = serve.get_replica_context().replica_id.unique_id
    self.log = kv_events.EventLog(engine.prefix_cache.events)
    self.capacity = engine.allocator.num_blocks - 1
    self.bus = ray.get_actor(bus_name, namespace=BUS_NAMESPACE)
    self.waiters: Dict[int, _Waiter] = {}
    # requests come in here and the engine's thread submits them, between two steps (_admit)
    self._inbox: collections.deque = collections.deque()
    # requests whose chain keys came computed from the router (RoutedPrompt.route), so the
    # engine did not hash their prompts again
    self.keys_handed = 0
    self.received = 0  # requests that came in (a running count the routers read: InTransit)
    self._last_state, self._dirty = 0.0, False
    self._wake, self._stop = threading.Event(), threading.Event()
    self._publish(force=True, summary=True)  # (its warm-up's figures: compile seconds)
    self._thread = threading.Thread(target=self._drive, name='pagedjax-engine', daemon=True)
    self._thread.start()

  # the engine's thread ---------------------------------------------------------------------

  def _drive(self) -> None:
    while not self._stop.is_set():
      self._admit()
      if not self.engine.has_work():
        if self._dirty:  # gone idle: the figures of what it served so far
          if self.engine.tiers is not None:  # disk writes in flight land (and are announced)
            with self.engine.lock:
              self.engine.tiers.flush()
          self._publish(force=True, summary=True)
          self._dirty = False
        self._wake.wait(0.05)  # a request coming in sets it (after its append: none is missed)
        self._wake.clear()
        continue
      with self.engine.lock:  # the step and its notifications as one: no waiter misses its end
        started = time.time()
        try:
          done = self.engine.step()
        except Exception as e:  # pylint: disable=broad-except  (a bug: fail what is in flight)
          for rid in list(self.waiters):
            self.waiters.pop(rid).put({'error': f'engine step failed: {e!r}', 'status': 500})
          continue
        self._notify(done, started)
      self._dirty = True
      self._publish()

  def _admit(self) -> None:
    """The requests that came in since the last iteration, into the engine, on this thread.
    (A submission from another thread waits for the engine's lock, which this thread takes
    again right after each step: a lock is not fair, so on a busy engine it could wait for
    several steps; and it took a hop through the loop's executor.)"""
    while self._inbox:
      request, waiter = self._inbox.popleft()
      self._dirty = True  # published when idle again, even if refused (its `received` count)
      with self.engine.lock:
        try:
          rid = self.engine.submit(request.prompt_ids, request.params)
        except RequestError as e:
          waiter.put({'error': str(e), 'status': 400, 'replica': self.uid})
          continue
        except Exception as e:  # pylint: disable=broad-except  (a bug: fail this request)
          waiter.put({'error': f'engine submit failed: {e!r}', 'status': 500})
          continue
        if request.route is not None:  # the chain keys the router computed: not hashed again
          self.keys_handed += request.route.hand_keys(self.engine, rid)
        waiter.compile_at_submit = self.engine.stats['compile_seconds']
        request.times['submitted'] = time.time()
        self.waiters[rid] = waiter

  def _notify(self, done, started: float) -> None:
    """Each waiter's new tokens (a stream's) or its end, after the step that began at
    `started`; the request's first answer carries its stamps (STAGES)."""
    now = time.time()
    for c in done:
      waiter = self.waiters.pop(c.request_id, None)
      if waiter is not None:
        self._stamp(waiter, started, now, scheduled=True, sampled=True)
        waiter.put(self._final(c, waiter))
    live = self.engine.completions.live
    for rid, waiter in self.waiters.items():
      seq = live.get(rid)
      if seq is None:
        continue
      self._stamp(waiter, started, now, scheduled=seq.num_cached > 0,
                  sampled=bool(seq.output_ids))
      if waiter.stream and len(seq.output_ids) > waiter.sent:
        waiter.put({'token_ids': list(seq.output_ids[waiter.sent:]), **self._first(waiter)})
        waiter.sent = len(seq.output_ids)

  def _stamp(self, waiter: _Waiter, started: float, now: float, scheduled: bool,
             sampled: bool) -> None:
    """'scheduled': the start of the first step after which the request holds KV (its prompt
    admitted: cached or computed); 'first_token': the end of the step that sampled its first
    token, and the compile seconds its engine spent meanwhile."""
    times = waiter.times
    if scheduled and 'scheduled' not in times:
      times['scheduled'] = started
    if sampled and 'first_token' not in times:
      times['first_token'] = now
      waiter.compile_s = self.engine.stats['compile_seconds'] - waiter.compile_at_submit

  def _first(self, waiter: _Waiter) -> dict:
    """What a request's first answer adds: its stamps, and the compile seconds between its
    submission and its first token."""
    if waiter.sent:
      return {}
    return {'times': dict(waiter.times), 'compile_s': waiter.compile_s}

  def _final(self, c, waiter: _Waiter) -> dict:
    out = {'token_ids': list(c.output_ids[waiter.sent:]), 'replica': self.uid, 'done': True,
           'finish_reason': FINISH_REASONS.get(c.finish_reason, 'length'),
           'prompt_tokens': len(c.prompt_ids), 'completion_tokens': len(c.output_ids),
           **self._first(waiter)}
    if not waiter.stream:
      out['text'] = c.text
    return out

  def state(self) -> dict:
    """routers.ReplicaState's fields, as the engine has them now, the requests in the inbox
    (not submitted yet) counted as waiting; and `received`, the requests that came in so far
    (routers.InTransit)."""
    e = self.engine
    with e.lock:
      received = self.received  # (before the inbox: a request that comes in between is counted
      #  twice until the next publication, never missed)
      inbox = [request.prompt_ids for request, _ in list(self._inbox)]
      waiting = list(e.scheduler.waiting) + [item[2] for item in e.intake.pending]
      running = list(e.running)
      return dict(
          capacity_blocks=self.capacity, block_size=e.block_size,
          num_waiting=len(waiting) + len(inbox), num_running=len(running),
          queued_prefill_tokens=(sum(len(s.prompt_ids) for s in waiting) +
                                 sum(len(ids) for ids in inbox) +
                                 sum(max(0, len(s.prompt_ids) - s.num_cached) for s in running)),
          running_tokens=sum(s.num_cached for s in running),
          kv_usage=e.allocator.num_used / self.capacity, received=received)

  def _publish(self, force: bool = False, summary: bool = False) -> None:
    """The KV events since the last publication and the load figures, to the bus (a call
    nobody waits for); load figures alone at most every STATE_EVERY_S."""
    batch = self.log.drain(time.time())
    now = time.monotonic()
    if batch is None and not force and now - self._last_state < self.STATE_EVERY_S:
      return
    self._last_state = now
    serving = [w.request_id for w in list(self.waiters.values())]
    self.bus.publish.remote(self.uid, batch and kv_events.batch_to_wire(batch), self.state(),
                            self.summary() if summary else None, serving)

  # the requests --------------------------------------------------------------------------------

  def _submit(self, request: RoutedPrompt, stream: bool) -> _Waiter:
    """The request to the engine's thread (_admit); its answers, or the engine's refusal
    ({'error', 'status': 400}), come on the waiter's queue."""
    request.times['replica'] = time.time()
    waiter = _Waiter(asyncio.get_running_loop(), stream, request)
    self._inbox.append((request, waiter))
    self.received += 1
    self._wake.set()
    return waiter

  async def complete(self, request: RoutedPrompt) -> dict:
    """The whole completion: token_ids, text, finish_reason, counts, the replica's id; or
    {'error', 'status'}."""
    return await self._submit(request, stream=False).queue.get()

  async def complete_stream(self, request: RoutedPrompt):
    """Yields {'token_ids': new ids} as they are sampled, the last with 'done' and the counts;
    or one {'error', 'status'}."""
    waiter = self._submit(request, stream=True)
    while True:
      item = await waiter.queue.get()
      yield item
      if item.get('done') or 'error' in item:
        return

  def summary(self) -> dict:
    """The engine's figures (Engine.summary) with this replica's id, how many requests came
    with their chain keys computed (`keys_handed`) and its process id (`pid`: a study on one
    machine reads its CPU time)."""
    return {**self.engine.summary(), 'replica': self.uid, 'keys_handed': self.keys_handed,
            'pid': os.getpid()}

  def __del__(self):
    self._stop.set()


# ---- the router -------------------------------------------------------------------------------

def route_request(pending: Optional[PendingRequest]) -> routers_lib.RouteRequest:
  """What a pagedjax router sees of a Serve request (its first argument, a RoutedPrompt),
  made once per request and kept on it (RoutedPrompt.route, with its chain keys)."""
  arg = pending.args[0] if pending is not None and pending.args else None
  if isinstance(arg, RoutedPrompt) and arg.route is not None:
    return arg.route
  ids = getattr(arg, 'prompt_ids', None)
  if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
    ids = []  # the engine will refuse it; any replica can say so
  max_new = arg.params.get('max_new_tokens', 0) if isinstance(arg, RoutedPrompt) else 0
  route = routers_lib.RouteRequest(0, ids, getattr(arg, 'salt', None), max_new)
  if isinstance(arg, RoutedPrompt):
    arg.route = route
  return route


class PagedjaxRequestRouter(RequestRouter):
  """A pagedjax/cluster/routers.py policy as a Serve RequestRouter (see the module docstring).

  request_router_kwargs: router (a registry name or 'module:Class'), router_kwargs (its keyword
  arguments), bus (the KVEventBus actor's name), pull_timeout_s (the longest a decision waits
  for the bus; past it, the router decides on what it already has), shared_store (the replicas'
  disk tiers are one shared store, disk_store.make_shared: the index counts a block any of them
  announced on disk as on every replica's)."""

  FETCH_TIMEOUT_S = 30.0  # a pull not back by then is given up; the next decision pulls again

  def initialize_state(self, router: str = 'precise', router_kwargs: Optional[dict] = None,
                       bus: str = '', pull_timeout_s: float = 0.5, shared_store: bool = False):
    self.policy = routers_lib.make_router(router, **(router_kwargs or {}))
    self._shared_media = (kv_events.MEDIUM_DISK,) if shared_store else ()
    self._links_index = getattr(self.policy, 'index', False) is None
    self._new_index()
    self._bus_name, self._bus, self._pull_timeout_s = bus, None, pull_timeout_s
    self._cursor = 0
    self._fetching: Optional[asyncio.Future] = None  # the pull from the bus in flight
    self._states: Dict[str, dict] = {}
    self._transit = routers_lib.InTransit()  # what was sent that the states do not show yet
    self._numbers: Dict[str, int] = {}  # replica unique id -> the int the policy sees
    self.decisions, self.pull_failures = 0, 0

  def _new_index(self) -> None:
    self.kv_index = KVIndex(shared_media=self._shared_media)
    if self._links_index:
      self.policy.index = self.kv_index  # routers that read the KV index read this one

  def _number(self, uid: str) -> int:
    return self._numbers.setdefault(uid, len(self._numbers))

  async def _pull(self) -> None:
    """What the bus has that is new, into the index, before a decision; waiting at most
    pull_timeout_s (past it, the decision is made on what is known and the pull lands later).
    One pull at a time: decisions while one is in flight wait for that one. (Concurrent
    decisions each with its own pull from the same cursor apply the same batches twice, and
    an older reply landing after a newer one would bring back blocks the newer had removed.)"""
    if self._fetching is None:
      self._fetching = asyncio.ensure_future(self._fetch())
    try:
      await asyncio.wait_for(asyncio.shield(self._fetching), self._pull_timeout_s)
    except asyncio.TimeoutError:
      self.pull_failures += 1

  async def _fetch(self) -> None:
    try:
      if self._bus is None:
        self._bus = ray.get_actor(self._bus_name, namespace=BUS_NAMESPACE)
      cursor, batches, states, lost = await asyncio.wait_for(
          self._bus.since.remote(self._cursor), self.FETCH_TIMEOUT_S)
      if lost:  # the bus dropped batches this router never read: start the index over
        self._new_index()
      for uid, wire in batches:
        self.kv_index.apply(self._number(uid), kv_events.batch_from_wire(wire))
      self._cursor, self._states = cursor, states
    except (asyncio.TimeoutError, ValueError, ray.exceptions.RayError):
      self.pull_failures += 1  # decided on what is known; the next pull catches up
    finally:  # (only now: a pull started before the batches landed would repeat them)
      self._fetching = None

  def _state(self, replica: RunningReplica) -> routers_lib.ReplicaState:
    uid = replica.replica_id.unique_id
    state = self._transit.state(self._number(uid), uid, self._states.get(uid, {}))
    queued = self._replica_queue_len_cache.get(replica.replica_id)
    if queued is not None and uid not in self._states:
      state.num_waiting = queued  # Serve's own count until the replica has published
    return state

  async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                            pending_request: Optional[PendingRequest] = None
                            ) -> List[List[RunningReplica]]:
    if not candidate_replicas:
      return []
    arg = pending_request.args[0] if pending_request is not None and pending_request.args else None
    times = arg.times if isinstance(arg, RoutedPrompt) else {}  # its stamps (STAGES)
    times['route_start'] = time.time()
    await self._pull()
    times['pulled'] = time.time()
    states = [self._state(r) for r in candidate_replicas]
    pick = self.policy.route(route_request(pending_request), states)
    self.decisions += 1
    first = next(r for r, s in zip(candidate_replicas, states) if s.index == pick)
    times['routed'] = time.time()
    return [[first], [r for r in candidate_replicas if r is not first]]

  def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                        result) -> None:
    route = route_request(pending_request)
    self._transit.sent(replica_id.unique_id, len(route.prompt_ids))
    self.policy.routed(route, self._number(replica_id.unique_id))

  def _forget(self, replica_id: ReplicaID) -> None:
    uid = replica_id.unique_id
    if uid in self._numbers:
      self.kv_index.apply(self._numbers[uid], [kv_events.AllBlocksCleared(None)])
    self._states.pop(uid, None)
    self._transit.forget(uid)
    if self._bus is not None:
      self._bus.forget.remote(uid)

  def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
    super().on_replica_actor_died(replica_id)
    self._forget(replica_id)

  def update_replicas(self, replicas: List[RunningReplica]) -> None:
    before = set(self._replica_id_set)
    super().update_replicas(replicas)
    for replica_id in before - set(self._replica_id_set):
      self._forget(replica_id)


def router_config(row, bus: str, shared_store: bool = False) -> RequestRouterConfig:
  """A Serve RequestRouterConfig for a router row (label, name, kwargs): name is 'ray_pow2',
  'ray_prefix' (Ray's, kwargs to its initialize_state) or a pagedjax router (told whether the
  replicas share one disk store)."""
  label, name, kwargs = row
  if name in RAY_ROUTERS:
    return RequestRouterConfig(request_router_class=RAY_ROUTERS[name],
                               request_router_kwargs=dict(kwargs))
  routers_lib.make_router(name, **dict(kwargs))  # a bad row fails here, named, not in Serve
  return RequestRouterConfig(
      request_router_class=PagedjaxRequestRouter,
      request_router_kwargs=dict(router=name, router_kwargs=dict(kwargs), bus=bus,
                                 shared_store=shared_store))


# ---- the HTTP ingress -------------------------------------------------------------------------

class CompletionsIngress:
  """POST /v1/completions (see the module docstring)."""

  def __init__(self, engines, tokenizer=None, request_timeout_s: float = 120.0,
               max_attempts: int = 3):
    self.engines, self.tokenizer = engines, tokenizer
    self.request_timeout_s, self.max_attempts = request_timeout_s, max_attempts

  async def __call__(self, request):
    from starlette.responses import JSONResponse  # pylint: disable=import-outside-toplevel
    received = time.time()
    if request.url.path.rstrip('/') != ROUTE or request.method != 'POST':
      return _error(404, f'{request.method} {request.url.path} is not served: POST {ROUTE}')
    try:
      body = json.loads(await request.body())
    except ValueError as e:
      return _error(400, f'request body is not JSON: {e}')
    try:
      routed = parse_completion(body, self.tokenizer)
    except RequestError as e:
      return _error(400, str(e))
    routed.times['ingress'] = received
    if routed.stream:
      return await self._stream(routed)
    out, attempts = None, 0
    while out is None:
      attempts += 1
      routed.times['handle'] = time.time()
      try:
        out = await asyncio.wait_for(self.engines.complete.remote(routed),
                                     self.request_timeout_s)
      except asyncio.TimeoutError:
        return _error(504, f'no completion within {self.request_timeout_s} s')
      except ray.exceptions.RayActorError as e:  # its replica died: send it again
        if attempts >= self.max_attempts:
          return _error(503, f'replicas died {attempts} times serving this request: {e}')
    if 'error' in out:
      return _error(out['status'], out['error'])
    return JSONResponse(self._body(routed, out, out['text'], attempts))

  def _body(self, routed: RoutedPrompt, out: dict, text: Optional[str], attempts: int,
            token_ids=None) -> dict:
    choice = {'index': 0, 'text': text, 'logprobs': None,
              'finish_reason': out.get('finish_reason'),
              'token_ids': out['token_ids'] if token_ids is None else token_ids}
    body = {'id': routed.request_id, 'object': 'text_completion', 'created': int(time.time()),
            'model': routed.model, 'choices': [choice],
            'pagedjax': {'replica': out.get('replica'), 'attempts': attempts}}
    if 'times' in out:  # the request's first answer: its stamps to here (STAGES)
      body['pagedjax'].update(times=out['times'], compile_s=out['compile_s'])
    if 'prompt_tokens' in out:
      body['usage'] = {'prompt_tokens': out['prompt_tokens'],
                       'completion_tokens': out['completion_tokens'],
                       'total_tokens': out['prompt_tokens'] + out['completion_tokens']}
    return body

  async def _stream(self, routed: RoutedPrompt):
    from starlette.responses import StreamingResponse  # pylint: disable=import-outside-toplevel
    sent: List[int] = []  # token ids already sent to the client
    attempts = [0]

    async def items():
      """The replica's deltas; after a replica died, the request again with the tokens already
      sent skipped (the same tokens come again: greedy, or sampling from the same seed)."""
      while True:
        attempts[0] += 1
        skip = len(sent)
        routed.times['handle'] = time.time()
        gen = self.engines.options(stream=True).complete_stream.remote(routed)
        try:
          while True:
            item = await asyncio.wait_for(gen.__anext__(), self.request_timeout_s)
            if 'times' in item:
              item['times']['first_item'] = time.time()
            ids = item.get('token_ids', [])
            drop = min(skip, len(ids))
            item = {**item, 'token_ids': ids[drop:]}
            skip -= drop
            yield item
            if item.get('done') or 'error' in item:
              return
        except StopAsyncIteration:
          return
        except ray.exceptions.RayActorError as e:
          if attempts[0] >= self.max_attempts:
            yield {'error': f'replicas died {attempts[0]} times serving this request: {e}',
                   'status': 503}
            return

    stream = items()
    try:
      first = await stream.__anext__()
    except asyncio.TimeoutError:
      return _error(504, f'no first token within {self.request_timeout_s} s')
    if 'error' in first:
      return _error(first['status'], first['error'])

    async def events():
      item, text = first, ''
      try:
        while True:
          sent.extend(item.get('token_ids', []))
          full = self.tokenizer.decode(sent) if self.tokenizer is not None else ''
          delta, text = full[len(text):], full
          if 'error' in item:  # after the stream started: the last event says so
            yield _sse({'error': {'message': item['error'], 'code': item['status']}})
            break
          yield _sse(self._body(routed, item, delta, attempts[0], item['token_ids']))
          if item.get('done'):
            break
          item = await stream.__anext__()
      except (StopAsyncIteration, asyncio.TimeoutError):
        pass
      yield 'data: [DONE]\n\n'
    return StreamingResponse(events(), media_type='text/event-stream')


def _sse(data: dict) -> str:
  return f'data: {json.dumps(data)}\n\n'


def _error(status: int, message: str):
  from starlette.responses import JSONResponse  # pylint: disable=import-outside-toplevel
  kind = 'invalid_request_error' if status == 400 else 'server_error'
  return JSONResponse({'error': {'message': message, 'type': kind, 'code': status}},
                      status_code=status)


# ---- starting and stopping it all -------------------------------------------------------------

RAY_INIT = dict(num_cpus=1, object_store_memory=100 * 2**20, include_dashboard=False,
                log_to_driver=False, _node_ip_address='127.0.0.1',
                logging_level=logging.ERROR)  # not Ray's start-up INFO and WARNING lines


@contextlib.contextmanager
def ray_started(**ray_init):
  """Ray on this machine for the block (RAY_INIT, updated by ray_init), shut down after it;
  an already running Ray is used and left running. Deployments started inside reuse it."""
  if ray.is_initialized():
    yield
    return
  ray.init(namespace=BUS_NAMESPACE, **{**RAY_INIT, **ray_init})
  try:
    yield
  finally:
    ray.shutdown()


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class ServeDeployment:
  """Ray (if not running yet), Serve's HTTP proxy on 127.0.0.1:`port`, the KV event bus and the
  application: `replicas` EngineReplicas of `config` behind router `row`, and the ingress.

    with ServeDeployment(config, 2, ('precise', 'precise', {})) as d:
      post(d.url, {'prompt': 'Hi', 'max_tokens': 4})

  Ray's own footprint is kept small (RAY_INIT: 1 CPU slot, every actor 0 CPUs, a 100 MB
  object store, no dashboard, worker logs not copied to the driver). `stop()` (also on leaving
  the with block, and on a start that fails or times out) shuts Serve and the Ray it started
  down."""

  def __init__(self, config, replicas: int, row=('precise', 'precise', {}), *, tokenizer=None,
               port: int = 0, max_ongoing_requests: int = 32, request_timeout_s: float = 120.0,
               start_timeout_s: float = 300.0, ray_init: Optional[dict] = None,
               shared_store: bool = False, warm_context_tokens: Optional[int] = None):
    """warm_context_tokens: each replica runs every step shape for contexts up to this many
    tokens (the longest prompt and output it will serve) before it takes traffic
    (warm_shapes), so that no request waits for a compilation; None: only a short request's
    shapes (warm_up). shared_store: the replicas' disk tiers (config.tiers.disk_kvstore,
    disk_blocks) are one store, marked shared before they start (disk_store.make_shared): a
    block one replica computed is a tier-3 hit on the others and on a replica that replaces a
    dead one, and the router counts it on every replica."""
    if not isinstance(replicas, int) or replicas < 1:
      raise ValueError(f'replicas={replicas!r} is not allowed: an integer >= 1')
    if shared_store and not (config.tiers.disk_blocks and config.tiers.disk_kvstore):
      raise ValueError(f'shared_store=True needs a disk tier to share: config.tiers.disk_blocks='
                       f'{config.tiers.disk_blocks} and disk_kvstore='
                       f'{config.tiers.disk_kvstore!r} (a store URL and its slots)')
    self.shared_store, self.warm_context_tokens = shared_store, warm_context_tokens
    self.config, self.replicas, self.row, self.tokenizer = config, replicas, row, tokenizer
    self.port = port or free_port()
    self.url = f'http://127.0.0.1:{self.port}{ROUTE}'
    self.max_ongoing_requests, self.request_timeout_s = max_ongoing_requests, request_timeout_s
    self.start_timeout_s = start_timeout_s
    self.ray_init = {**RAY_INIT, **(ray_init or {})}
    self.bus_name = f'pagedjax-kv-events-{uuid.uuid4().hex[:8]}'
    self.bus = None
    self._started_ray = False
    self.start_s = None

  def __enter__(self):
    self.start()
    return self

  def __exit__(self, *exc):
    self.stop()

  def start(self) -> 'ServeDeployment':
    t0 = time.monotonic()
    try:
      self._start()
    except BaseException:
      self.stop()
      raise
    self.start_s = time.monotonic() - t0
    return self

  def start_ray(self) -> 'ServeDeployment':
    """Ray, if none is running yet (start() does it too; stop() shuts down a Ray this started).
    A driver that will run jax itself starts Ray first: Ray's processes are forked before
    jax's threads exist."""
    if not ray.is_initialized():
      ray.init(namespace=BUS_NAMESPACE, **self.ray_init)
      self._started_ray = True
    return self

  def _start(self) -> None:
    self.start_ray()
    if self.shared_store:  # marked before any replica opens it
      disk_store.make_shared(self.config.tiers.disk_kvstore, self.config.tiers.disk_blocks)
    self.bus = KVEventBus.options(name=self.bus_name, namespace=BUS_NAMESPACE).remote()
    serve.start(http_options={'host': '127.0.0.1', 'port': self.port},
                logging_config={'enable_access_log': False})
    engines = serve.deployment(EngineReplica).options(
        name='EngineReplica', num_replicas=self.replicas, ray_actor_options={'num_cpus': 0},
        max_ongoing_requests=self.max_ongoing_requests,
        request_router_config=router_config(self.row, self.bus_name, self.shared_store),
        health_check_period_s=2, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=5).bind(self.config, self.bus_name, self.tokenizer,
                                            self.warm_context_tokens)
    ingress = serve.deployment(CompletionsIngress).options(
        name='CompletionsIngress', ray_actor_options={'num_cpus': 0},
        max_ongoing_requests=1000).bind(engines, self.tokenizer, self.request_timeout_s)
    from ray.serve.api import RunTarget  # pylint: disable=import-outside-toplevel
    serve.run_many([RunTarget(ingress, name=APP_NAME, route_prefix='/')],
                   wait_for_applications_running=False)
    deadline = time.monotonic() + self.start_timeout_s
    while True:
      app = serve.status().applications.get(APP_NAME)
      status = app.status if app is not None else 'NOT_STARTED'
      if status == 'RUNNING':
        return
      if status in ('DEPLOY_FAILED', 'UNHEALTHY'):
        raise RuntimeError(f'the Serve application failed to start ({status}): {app.message}')
      if time.monotonic() > deadline:
        raise TimeoutError(f'the Serve application was not running after '
                           f'{self.start_timeout_s} s (status {status})')
      time.sleep(0.5)

  def engine_handle(self):
    return serve.get_deployment_handle('EngineReplica', app_name=APP_NAME)

  def replica_summaries(self, timeout_s: float = 30.0) -> Dict[str, dict]:
    """replica unique id -> its Engine.summary() as it last published it (each replica
    publishes one whenever it goes idle)."""
    return ray.get(self.bus.summaries.remote(), timeout=timeout_s)

  def replica_actors(self) -> Dict[str, object]:
    """replica unique id -> its actor handle (Serve names replica actors
    SERVE_REPLICA::<app>#<deployment>#<unique id>)."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
      name = a['name']
      if name.startswith(f'SERVE_REPLICA::{APP_NAME}#EngineReplica#'):
        out[name.rsplit('#', 1)[1]] = ray.get_actor(name, namespace=a['namespace'])
    return out

  def stop(self) -> None:
    """A Ray this started is shut down, and every process of it (Serve's, the bus) with it;
    else Serve, then the bus. Each step bounded, errors ignored (stopping must always finish)."""
    if self._started_ray and ray.is_initialized():
      ray.shutdown()  # no serve.shutdown first: it waits out each replica's graceful shutdown
      self._started_ray, self.bus = False, None
      return
    try:
      if ray.is_initialized():
        serve.shutdown()
    except Exception:  # pylint: disable=broad-except
      pass
    if self.bus is not None:
      try:
        ray.kill(self.bus)
      except Exception:  # pylint: disable=broad-except
        pass
      self.bus = None
    if self._started_ray and ray.is_initialized():
      ray.shutdown()
    self._started_ray = False


# ---- a small client (stdlib only) -------------------------------------------------------------

def post(url: str, body: dict, timeout_s: float = 120.0) -> tuple:
  """-> (HTTP status, JSON body) of one non-streaming request; status 0 when no HTTP answer came
  within timeout_s."""
  import urllib.error  # pylint: disable=import-outside-toplevel
  import urllib.request  # pylint: disable=import-outside-toplevel
  req = urllib.request.Request(url, json.dumps(body).encode(), method='POST',
                               headers={'Content-Type': 'application/json'})
  try:
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read() or b'null')
  except OSError as e:  # refused, reset, timed out: no HTTP status
    return 0, {'error': {'message': f'{type(e).__name__}: {e}'}}


def post_stream(url: str, body: dict, timeout_s: float = 120.0) -> tuple:
  """-> (HTTP status, [event dicts], seconds to the first event) of a streaming request; the
  events are the SSE `data:` payloads before [DONE]."""
  import urllib.error  # pylint: disable=import-outside-toplevel
  import urllib.request  # pylint: disable=import-outside-toplevel
  req = urllib.request.Request(url, json.dumps({**body, 'stream': True}).encode(),
                               method='POST', headers={'Content-Type': 'application/json'})
  t0 = time.monotonic()
  first, events = None, []
  try:
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
      for line in r:
        line = line.decode().strip()
        if not line.startswith('data: '):
          continue
        if first is None:
          first = time.monotonic() - t0
        if line == 'data: [DONE]':
          break
        events.append(json.loads(line[len('data: '):]))
      return r.status, events, first
  except urllib.error.HTTPError as e:
    return e.code, [json.loads(e.read() or b'null')], None
  except OSError as e:  # refused, reset, timed out (also mid-stream): no HTTP status
    return 0, events + [{'error': {'message': f'{type(e).__name__}: {e}'}}], first
