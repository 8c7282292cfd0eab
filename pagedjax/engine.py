"""The engine: the decode loop, one iteration at a time: schedule -> run -> update.

  plan = scheduler.schedule()          host/scheduling/scheduler.py: the whole work order (rows,
                                       admissions, preemptions, swaps, tier demotions and
                                       promotions, copy-on-write copies, offload moves, lanes)
  output = executor.run(plan)          executor.py: the device adaptor, plan -> Device calls
                                       (host/scheduling/device_api.py) -> a StepOutput (tokens,
                                       top-K candidates, logits, timings, counts)
  finished = update.update(plan, output, now)
                                       host/scheduling/update.py: every post-step update (cached
                                       counts, prefix cache, tokens, finishes, beams, metrics)

Before the plan: requests whose arrival time has come are released (host/requests/intake.py),
idle sessions demoted (host/cache/sessions.py) and lower-tier reads for waiting prompts issued
(host/tiers/kv_tiers.py). After the update, write-through tiers copy down the blocks the cache
just took (executor.write_through). Counters have one owner, the metrics (host/metrics.py;
`engine.stats` is theirs).

`clock` is simulated seconds: the measured time of the engine's own iterations without
compilation (a one-off cost that would tax whichever run meets more shapes), idle gaps jumped
to the next arrival rather than slept (the lower tiers' disk writes in flight are awaited
there, off the clock: they would have landed during the idle time).
"""
import threading
import time
from typing import Callable, List, Optional, Sequence as Seq, Union

from pagedjax import tiering
from pagedjax.config import Config
from pagedjax.model.step import CompiledStep
from pagedjax.model.streamed_attention import StreamedAttention
from pagedjax.executor import DEVICE
from pagedjax.host.alerts import HitRateMonitor
from pagedjax.host.scheduling.allocator import BlockAllocator
from pagedjax.host.requests.beam_search import BeamSearch
from pagedjax.host.scheduling.block_manager import BlockManager
from pagedjax.host.requests.completions import Completions
from pagedjax.host.scheduling.swap_store import SwapStore
from pagedjax.host.requests.intake import RequestError  # pylint: disable=unused-import  (re-exported)
from pagedjax.host.requests.intake import RequestIntake, prompt_list
from pagedjax.host.metrics import Metrics
from pagedjax.host.scheduling.offload import Offload
from pagedjax.host.cache.prefix_cache import make_prefix_cache
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.scheduling.scheduler import Scheduler
from pagedjax.host.scheduling.update import StepUpdate
from pagedjax.host.requests.sequence import Completion, Sequence, Status
from pagedjax.model.llama import ModelConfig

# After this many iterations in a row that compute nothing (a stall: a bug, since admission and
# the submit checks are meant to rule it out), run() fails one request and keeps serving.
MAX_IDLE_ITERATIONS = 1000


class Engine:
  """The decode loop behind a small public API.

  submit(prompt, params) queues one request and returns its id; step() runs one iteration; run()
  steps until every request submitted so far has finished and returns their completions;
  generate(prompts, params) steps until its batch and every request submitted before it have
  finished, and returns the completions of its own prompts only (n of each with n parallel
  samples), in order; summary() gives the run's figures; prefix_cache.pin / unpin keep a
  prefix's blocks on the device. Every finished request's Completion stays in `finished`
  (request id -> Completion), whichever call drove it: after `submit(a); generate([b])`,
  generate returns b's completion and a's is in finished[a].

  Arguments: a prompt is a str (with a tokenizer) or token ids, a list or tuple of ints or a 1-D
  integer array (numpy integers are ints; bools are not); params is a SamplingParams, a dict of
  its fields (SamplingParams(**d), validated the same) or None (the defaults). A bad argument
  raises RequestError naming it, its value and what is allowed, and queues nothing.

  Threads: these calls may come from several threads at once. Each public call, and each
  iteration of run and generate, holds `lock` (a threading.RLock), so no two ever interleave
  inside the engine; concurrent generate calls are batched together by the scheduler and each
  returns exactly its own completions. To read several attributes consistently while other
  threads drive the engine (iterate `finished`, read `stats` and `running` together), hold
  `engine.lock` yourself.
  """

  def __init__(self, model_cfg: ModelConfig, params, config: Config = Config(), *,
               tokenizer=None, eos_id: Optional[int] = None, record_logits: bool = False,
               step_fn: Optional[CompiledStep] = None, shuffle_blocks_seed: Optional[int] = None,
               timer: Callable[[], float] = time.perf_counter, mesh=None, backend=DEVICE):
    """config: the typed config (config.py); its model section is the factory's business.

    step_fn lets engines of the same model share compiled steps (tests, sweeps).
    shuffle_blocks_seed scatters physical block placement (tests: nothing may depend on it).
    timer: the clock's source (tests inject one). mesh: the ('model',) mesh of a tensor-parallel
    engine (factory.make_engine passes it with params and a step_fn built for it); the pool is
    then created split over KV heads. backend: executor.DEVICE, or pagedjax/sim's simulated one.
    """
    self.model_cfg, self.config = model_cfg, config.validate()
    pool_cfg, eng, sched = config.pool, config.engine, config.scheduler
    self.block_size, self.tokenizer, self.eos_id = pool_cfg.block_size, tokenizer, eos_id
    self.max_seq_len = min(eng.max_seq_len, model_cfg.max_seq_len)
    self.lock = threading.RLock()  # held by each public call (see the class docstring)
    self.prefix_cache = make_prefix_cache(config.prefix_cache, pool_cfg.block_size)
    if self.prefix_cache is not None:  # pin() checks ids against the vocabulary, under the lock
      self.prefix_cache.lock, self.prefix_cache.vocab_size = self.lock, model_cfg.vocab_size
    self.allocator = BlockAllocator(pool_cfg.num_blocks, shuffle_seed=shuffle_blocks_seed,
                                    cache=self.prefix_cache)
    self.block_manager = BlockManager(
        self.allocator, pool_cfg.block_size, pool_cfg.kind, self.max_seq_len,
        watermark_blocks=int(sched.watermark * (pool_cfg.num_blocks - 1)))
    pool = backend.init_model_pool(model_cfg, pool_cfg.num_blocks, pool_cfg.block_size,
                                   pool_cfg.kv_quant(model_cfg.dtype), eng.max_batch_size, mesh)
    self.swap_store = swap = (SwapStore(pool.block_array_shapes(), sched.swap_blocks or pool_cfg.num_blocks
                                 - 1) if sched.preemption != 'recompute' else None)
    self.executor = backend.executor(
        params, pool, step_fn or backend.step(model_cfg, config.attention.impl, record_logits,
                                        linear_impl=eng.linear_impl),
        self.block_manager, vocab_size=model_cfg.vocab_size, max_batch_size=eng.max_batch_size,
        prefill_chunk=eng.prefill_chunk, max_seq_len=self.max_seq_len, swap_store=swap, timer=timer,
        decode_min_rows=eng.decode_min_rows)
    self.executor.backend = backend  # what built it (cost figures, experiments/cluster.py)
    self.tiers = tiering.build_tiers(config, model_cfg, self.executor)  # None: no lower tiers
    self.executor.tiers = self.tiers
    self.offload = self._build_offload(config, model_cfg, backend)  # None: off
    cost = None  # the cost model preemption weighs (host/tiers/tier_cost.py), measured on the device
    if sched.preemption == 'auto' or sched.victim == 'cost':
      cost = (self.tiers and self.tiers.cost) or backend.preemption_cost(config.tiers,
                                                                          self.executor)
    self.scheduler = Scheduler(
        self.block_manager, max_batch_size=eng.max_batch_size, prefill_chunk=eng.prefill_chunk,
        max_num_batched_tokens=(sched.max_num_batched_tokens or
                                eng.max_batch_size * eng.prefill_chunk),
        preemption=sched.preemption, victim=sched.victim, admission=sched.admission,
        admission_horizon=sched.admission_horizon, queue_order=sched.queue_order,
        host_allocator=swap and swap.allocator,
        cost=cost, offload=self.offload)
    self.intake = RequestIntake(
        self.block_manager, vocab_size=model_cfg.vocab_size, max_seq_len=self.max_seq_len,
        max_batch_size=eng.max_batch_size, can_share=not pool.scheme.recent_window,
        eos_id=eos_id, tokenizer=tokenizer, offload=self.offload)
    self.lanes = self.scheduler.lanes
    self.beams = BeamSearch(self.scheduler, self.max_seq_len)
    alerts = config.alerts  # the windowed prefix hit rate, its alert and throttle
    self.hit_rate = HitRateMonitor(alerts.hit_rate_window, alerts.hit_rate_drop,
                                   alerts.throttle_prefill_tokens)
    self.metrics = Metrics(pool_cfg.block_size, pool_cfg.num_blocks, self.prefix_cache,
                           self.hit_rate)
    self.clock, self._timer = 0.0, timer
    self.completions = Completions(self.metrics, tokenizer)
    self.finished = self.completions.finished  # request id -> Completion
    self.update = StepUpdate(self.scheduler, self.block_manager, self.beams, self.completions,
                             self.metrics, self.hit_rate, eos_id=eos_id,
                             max_seq_len=self.max_seq_len)

  def _build_offload(self, config: Config, model_cfg: ModelConfig, backend):
    """Offload (host/scheduling/offload.py) and its streamed path on the executor, when
    config.offload.host_blocks > 0; else None."""
    off = config.offload
    if not off.enabled:
      return None
    if backend is not DEVICE:
      raise ValueError('config.offload.host_blocks > 0 needs the real device backend: the '
                       'streamed path has no simulated cost yet')
    offload = Offload.from_config(self.executor.pool.block_array_shapes(), self.block_manager,
                                  off, self.max_seq_len, config.prefix_cache)
    self.executor.offload = self.block_manager.offload = offload
    if offload.index is not None:  # its entries are KV events too (offload_index.py)
      offload.index.events = self.prefix_cache.events
    self.executor.streamed = StreamedAttention(model_cfg, self.block_size, off.device_blocks,
                                               off.chunk_blocks, self.executor.token_buckets,
                                               self.executor.batch_buckets, off.layers_per_call,
                                               config.attention.impl)
    return offload

  @property
  def pool(self):
    """The device KV pool (pagedjax/device/pool.py), threaded through every jitted call."""
    return self.executor.pool

  @pool.setter
  def pool(self, pool):  # tests poison blocks the engine must never read
    self.executor.pool = pool

  @property
  def running(self) -> List[Sequence]:
    return self.scheduler.running

  @property
  def stats(self):
    """The run's counters (a collections.Counter), owned and written by the metrics
    (Metrics.counters, host/metrics.py): read them here, never write."""
    return self.metrics.counters

  # ---- submission --------------------------------------------------------------------------

  def submit(self, prompt: Union[str, Seq[int]],
             params: Union[SamplingParams, dict, None] = SamplingParams(),
             arrival_time: Optional[float] = None) -> int:
    """Validate and queue a request; raises RequestError naming what is wrong. Returns its id
    (with n parallel samples, the first of its n consecutive ids).

    arrival_time (engine-clock seconds, default now): the scheduler sees it from then on.
    """
    with self.lock:
      return self._queue(self._checked(prompt, params, arrival_time))[0]

  def _checked(self, prompt, params, arrival_time, name: str = 'prompt') -> tuple:
    return self.intake.checked(prompt, params, self.clock if arrival_time is None else
                               arrival_time, name)

  def _queue(self, request: tuple) -> List[int]:
    """Queues a checked request; returns the ids of the completions it will make."""
    ids, params, arrival = request
    group = self.intake.enqueue(ids, params, arrival)
    if group[0].beam:
      self.beams.groups.append(group[0].beam)
    self.completions.track(group)
    self.metrics.count_submitted(len(ids))
    self._release_arrivals()
    return [seq.request_id for seq in group]

  def _release_arrivals(self):
    for seq in self.intake.release(self.clock):
      self.scheduler.add(seq)

  # ---- one iteration -----------------------------------------------------------------------

  def step(self) -> List[Completion]:
    """One scheduling iteration; returns the requests that finished in it."""
    with self.lock:
      return self._step()

  def _step(self) -> List[Completion]:
    if not self.scheduler.has_work() and self.intake.pending:
      self.clock = max(self.clock, self.intake.next_arrival())  # idle until the next arrival
      if self.tiers is not None:
        self.tiers.flush()  # what background disk writes finish in the idle time jumped
    start = self._timer()
    self._release_arrivals()
    self.block_manager.demote_idle_sessions(self.clock)
    if self.tiers is not None:  # disk reads for waiting prompts, overlapped with this step
      self.tiers.prefetch(self.scheduler.waiting)
    if not self.scheduler.has_work():
      return []
    plan = self.scheduler.schedule()
    output = self.executor.run(plan)
    now = self.clock + self._timer() - start - output.compile_s
    finished = self.update.update(plan, output, now,
                                  host_s=now - self.clock - output.device_s)
    self.clock = now
    if self.tiers is not None:  # write-through copies of what the cache just took; tier row
      written = self.executor.write_through()
      self.metrics.count_device(written)
      self.clock += written.device_s
    return finished

  # ---- driving -----------------------------------------------------------------------------

  @property
  def timer(self) -> Callable[[], float]:
    """The clock's source (time.perf_counter, or a simulated device's SimClock)."""
    return self._timer

  def has_work(self) -> bool:
    with self.lock:
      return bool(self.intake.pending) or self.scheduler.has_work()

  def run(self) -> List[Completion]:
    """Step until every request submitted so far has finished; their completions in submission
    order. (Requests other threads submit meanwhile are served too, but not waited for.)"""
    with self.lock:
      ids = sorted(self.completions.live)
    return self._serve(ids)

  def _serve(self, ids: List[int]) -> List[Completion]:
    """Steps, one locked iteration at a time, until every request in ids has
    finished, whichever thread's iterations finish it; returns their completions."""
    done, idle = 0, 0  # ids[:done] have finished
    while True:
      with self.lock:
        while done < len(ids) and ids[done] in self.finished:
          done += 1
        if done == len(ids):
          return [self.finished[i] for i in ids]
        before = self._progress()
        self._step()
        idle = 0 if self._progress() != before else idle + 1
        if idle >= MAX_IDLE_ITERATIONS:
          self._abort_stalled()
          idle = 0
      if threading.active_count() > 1:  # locks are not fair: let a thread waiting for this
        time.sleep(0)                     # one (to submit, to step) take it between iterations

  def _abort_stalled(self) -> None:
    """No progress for MAX_IDLE_ITERATIONS iterations (admission and the submit checks are meant
    to rule this out): fail one stuck unit of sequences, releasing its blocks, and go on."""
    unit = self.scheduler.stalled_unit()
    self.metrics.count_aborted()
    for seq in unit:
      self.scheduler.abort(seq)
      seq.status = Status.FINISHED
    group = unit[0].beam
    if group is not None:
      self.beams.groups.remove(group)
      unit = [group.leader]
    for seq in unit:
      self.completions.aborted(seq, self.clock)

  def _progress(self) -> tuple:
    """What an iteration that does any work changes: tokens cached, generated, finished."""
    return (self.stats['generated_tokens'], len(self.finished),
            sum(seq.num_cached for seq in self.running))

  def generate(self, prompts, params: Union[SamplingParams, dict, None] = SamplingParams()
               ) -> List[Completion]:
    """Runs a batch (a list of prompts) and returns its completions only, in order (n of each
    with n parallel samples). Steps until they, and every request submitted before them, have
    finished; those others' completions are in `finished`. Every prompt is checked before any
    is queued, so a bad one raises RequestError (naming prompts[i]) and queues nothing."""
    prompts = prompt_list(prompts)
    with self.lock:
      requests = [self._checked(prompt, params, None, f'prompts[{i}]')
                  for i, prompt in enumerate(prompts)]
      earlier = sorted(self.completions.live)
      ids = [rid for request in requests for rid in self._queue(request)]
    self._serve(earlier + ids)
    return [self.finished[i] for i in ids]

  # ---- figures -----------------------------------------------------------------------------

  @property
  def num_compilations(self) -> int:
    """Programs compiled during this engine's device calls (steps, copies, transfers)."""
    return self.stats['compilations']

  @property
  def kv_bytes_per_token(self) -> float:
    return self.pool.bytes_per_token

  def summary(self) -> dict:
    """The run's figures (host/metrics.py) with the engine's counters and settings."""
    with self.lock:
      return self._summary()

  def _summary(self) -> dict:
    cfg = self.config
    extra = {'prefix_cache_design': cfg.prefix_cache.design} if self.prefix_cache else {}
    if self.offload is not None:  # blocks moved to host RAM, and what streaming them moved
      extra.update(self.offload.figures(), **{k: self.stats[k] for k in (
          'streamed_rows', 'streamed_tokens', 'streamed_steps',
          'streamed_bytes', 'joined_decode_rows')})
    return self.metrics.engine_summary(
        self.prefix_cache, pool_kind=cfg.pool.kind,
        preemption=cfg.scheduler.preemption, block_size=self.block_size,
        num_blocks=self.allocator.num_blocks, kv_bytes_per_token=self.kv_bytes_per_token,
        kv_pool_bytes=self.pool.nbytes, num_compilations=self.num_compilations, **extra)
