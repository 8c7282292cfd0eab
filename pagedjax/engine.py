"""The engine: runs the scheduler's plan for each iteration through jitted steps over the KV pool.

Host side (plain Python, between steps): the scheduler (scheduler.py: queues, admission, token
budget, preemption), the block manager (block_manager.py: paged or contiguous), the host tier
for swap preemption (swap.py) and the run's metrics (metrics.py). Device side: the KV pool,
threaded through every jitted call and donated.

One iteration runs one plan:
  1. one gather of every block swapped out, one jitted copy of every copy-on-write block
     (block_copy.py), then one scatter of every block swapped in;
  2. one jitted call for the prompt chunks, then one for the decodes (one query token each).
     Two calls rather than one mixed batch: a mixed batch is padded to its longest row, so every
     decode row would pay for a whole chunk of query tokens. Every call's shape is bucketed
     (rows, query tokens, blocks), so a run compiles a handful of times. Chunks go first, so a
     prompt that finishes samples its first token in the same iteration.

Clock: `clock` is simulated seconds, the measured time of the engine's own iterations with
compilation excluded (a one-off cost that would otherwise tax whichever run meets more shapes)
and idle gaps jumped to the next arrival rather than slept. A request submitted with an
arrival time becomes visible to the scheduler once the clock reaches it.

Sharing: with `prefix_caching`, full blocks are cached across requests (prefix_cache.py) and a
prompt's cached prefix skips prefill. `SamplingParams(n=k)` submits k samples of one prompt:
request ids id..id+k-1 (submit returns the first), one prefill, blocks shared until written.
`SamplingParams(beam_width=k)` runs beam search (beam.py): one request id, one prefill, then k
beams that fork (shared blocks, copy-on-write) and free as the search keeps and drops them;
decode calls holding a beam row use the step variant that returns top-K log-probs.
"""
import collections
import dataclasses
import heapq
import math
import time
from typing import Callable, Dict, List, Optional, Sequence as Seq, Union

import jax
import numpy as np

from pagedjax import beam as beam_lib
from pagedjax import pool as pool_lib
from pagedjax import quant
from pagedjax import prefix_cache, radix_cache
from pagedjax import sharding
from pagedjax.allocator import BlockAllocator
from pagedjax.block_copy import BlockCopier
from pagedjax.block_manager import BlockManager
from pagedjax import metrics as metrics_lib
from pagedjax.metrics import Metrics
from pagedjax.model import DTYPES, ModelConfig
from pagedjax.sampling import SamplingParams
from pagedjax.scheduler import Scheduler
from pagedjax.sequence import Completion, Sequence, Status
from pagedjax.step_inputs import RowSpec, build_step_inputs, power_of_two_buckets
from pagedjax.steps import CompiledStep
from pagedjax.swap import HostTier


# run() gives up after this many iterations in a row that compute nothing (a stall, e.g. beams
# waiting on a preempted sibling that can never be readmitted), instead of looping forever.
MAX_IDLE_ITERATIONS = 1000


class RequestError(ValueError):
  """A request rejected at submission; the engine and its other requests are unaffected."""


def _init_pool(model_cfg, num_blocks, block_size, kv_dtype, kv_quant, max_batch_size,
               preemption, mesh=None):
  """The empty pool: plain kv_dtype storage, or a quantized one (quant.py). With a mesh it is
  created already split over KV heads: each device allocates only its shard (a pool sized for
  the whole mesh need not fit on one device first)."""
  kv_dtype = kv_dtype or model_cfg.dtype
  if kv_quant is None and kv_dtype not in DTYPES:
    kv_quant = quant.KVQuantConfig(kv_dtype)  # a quantized storage named by kv_dtype alone
  if kv_quant and kv_quant.recent_window and preemption == 'swap':
    raise ValueError('swap preemption does not carry a recent-window pool\'s per-lane rings '
                     '(quant.py): use preemption=\'recompute\', which rebuilds them')
  # A recent window keeps one ring lane per running sequence: lanes 1..max_batch_size.
  make = lambda: pool_lib.init_pool(model_cfg.num_layers, num_blocks, model_cfg.num_kv_heads,
                                    block_size, model_cfg.head_dim, DTYPES.get(kv_dtype),
                                    kv_quant=kv_quant, max_sequences=max_batch_size)
  if mesh is None:
    return make()
  return sharding.empty_pool_like(jax.eval_shape(make), mesh, model_cfg.num_kv_heads)


class Engine:

  def __init__(self, model_cfg: ModelConfig, params, *, block_size: int = 16,
               num_blocks: int = 256, max_batch_size: int = 8, prefill_chunk: int = 128,
               max_seq_len: Optional[int] = None, attention_impl: str = 'reference',
               kv_dtype: Optional[str] = None, eos_id: Optional[int] = None, tokenizer=None,
               record_logits: bool = False, step_fn: Optional[CompiledStep] = None,
               shuffle_blocks_seed: Optional[int] = None, pool_kind: str = 'paged',
               preemption: str = 'recompute', watermark: float = 0.01,
               max_num_batched_tokens: Optional[int] = None, swap_blocks: Optional[int] = None,
               kv_quant: Optional[quant.KVQuantConfig] = None,
               prefix_caching: bool = False, prefix_cache_design: str = 'hash',
               prefix_cache_eviction: str = 'lru',
               timer: Callable[[], float] = time.perf_counter, mesh=None):
    """step_fn lets engines of the same model share compiled steps (tests, sweeps).

    pool_kind: 'paged' or 'contiguous' (block_manager.py). preemption: 'recompute' or 'swap'.
    watermark: share of the pool's blocks paged admission keeps free. max_num_batched_tokens:
    query tokens per iteration (default: a full chunk for every row). swap_blocks: host tier
    size (default: as many blocks as the pool). kv_quant: the pool's storage (quant.py;
    default: plain kv_dtype). prefix_caching: reuse cached full blocks of earlier prompts
    (design 'hash': prefix_cache.py, or 'radix': radix_cache.py; eviction 'lru' or 'lfu').
    timer: the clock's source (tests inject one). mesh: the ('model',) mesh of a tensor-parallel
    engine (factory.make_engine passes it with params and a step_fn built for it); the pool is
    then created split over KV heads.
    """
    self.cfg = model_cfg
    self.params = params
    self.block_size = block_size
    self.max_batch_size = max_batch_size
    self.prefill_chunk = prefill_chunk
    self.max_seq_len = min(max_seq_len or model_cfg.max_seq_len, model_cfg.max_seq_len)
    self.eos_id = eos_id
    self.tokenizer = tokenizer
    self.pool_kind, self.preemption = pool_kind, preemption

    if prefix_cache_design not in prefix_cache.DESIGNS:
      raise ValueError(f'prefix_cache_design {prefix_cache_design!r} is not allowed: one of '
                       f'{prefix_cache.DESIGNS}')
    self.prefix_cache_design = prefix_cache_design
    design = {'hash': prefix_cache.PrefixCache, 'radix': radix_cache.RadixCache}
    self.prefix_cache = (design[prefix_cache_design](block_size, prefix_cache_eviction)
                         if prefix_caching else None)
    self.allocator = BlockAllocator(num_blocks, shuffle_seed=shuffle_blocks_seed,
                                    cache=self.prefix_cache)
    self.blocks = BlockManager(self.allocator, block_size, pool_kind, self.max_seq_len,
                               watermark_blocks=int(watermark * (num_blocks - 1)))
    self.pool = _init_pool(model_cfg, num_blocks, block_size, kv_dtype, kv_quant,
                           max_batch_size, preemption, mesh)
    # Rings of a recent window belong to a lane, not to blocks: shared blocks cannot carry them.
    self._can_share = not self.pool.scheme.recent_window
    if prefix_caching and not self._can_share:
      raise ValueError('prefix caching cannot share a recent-window pool\'s per-sequence rings '
                       '(quant.py): use kv_recent_window=0')
    self.copier = BlockCopier(num_blocks)
    self._free_lanes = list(range(max_batch_size, 0, -1))  # see _assign_lanes
    self.tier = None
    if preemption == 'swap':
      self.tier = HostTier(self.pool, swap_blocks or num_blocks - 1)
    self.scheduler = Scheduler(
        self.blocks, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk,
        max_num_batched_tokens=max_num_batched_tokens or max_batch_size * prefill_chunk,
        preemption=preemption, host_allocator=self.tier and self.tier.allocator)
    self.step_fn = step_fn or CompiledStep(model_cfg, attention_impl, record_logits)
    self.record_logits = self.step_fn.return_logits
    max_blocks_per_seq = math.ceil(self.max_seq_len / block_size)
    self.batch_buckets = power_of_two_buckets(max_batch_size)
    # Decode calls start at 8 rows: fewer rows only happen at a run's start and tail, and a
    # padded decode row costs little next to a compilation.
    self.decode_batch_buckets = power_of_two_buckets(max_batch_size, min(8, max_batch_size))
    # Coarse buckets keep compilations few (each costs seconds on this CPU even for a tiny
    # model, and the shapes multiply): decode rows are 1 token; prompt chunks are padded to a
    # whole chunk (chunk calls are a small share of a serving run's calls, and each chunk
    # bucket would multiply the row and table buckets); block tables cover >= 256 tokens.
    self.token_buckets = sorted({1, prefill_chunk})
    self.block_buckets = power_of_two_buckets(
        max_blocks_per_seq, min(math.ceil(256 / block_size), max_blocks_per_seq))

    self.clock = 0.0
    self._timer = timer
    self._pending: list = []  # heap of (arrival_time, request_id, Sequence) not yet visible
    self._live: Dict[int, Sequence] = {}
    self.finished: Dict[int, Completion] = {}
    self._logits: Dict[int, list] = collections.defaultdict(list)
    self._next_id = 0
    self._beam_groups: List[beam_lib.BeamGroup] = []  # beam requests under way
    self.metrics = Metrics(block_size, num_blocks)
    self.stats = collections.Counter()

  @property
  def waiting(self) -> List[Sequence]:
    return self.scheduler.waiting

  @property
  def running(self) -> List[Sequence]:
    return self.scheduler.running

  @property
  def swapped(self) -> List[Sequence]:
    return self.scheduler.swapped

  # ---- submission ------------------------------------------------------------------------

  def submit(self, prompt: Union[str, Seq[int]], params: SamplingParams = SamplingParams(),
             arrival_time: Optional[float] = None) -> int:
    """Validate and queue a request; raises RequestError naming what is wrong.

    arrival_time (engine-clock seconds, default now): the scheduler sees it from then on.
    """
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise RequestError('a text prompt needs an engine built with a tokenizer')
      prompt = self.tokenizer.encode(prompt)
    prompt = list(prompt)
    if not prompt:
      raise RequestError('empty prompt: a request needs at least one token')
    bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or
           not 0 <= t < self.cfg.vocab_size]
    if bad:
      raise RequestError(f'token ids {bad[:5]} out of vocabulary: allowed 0..'
                         f'{self.cfg.vocab_size - 1}')
    if len(prompt) >= self.max_seq_len:
      raise RequestError(f'prompt of {len(prompt)} tokens: the maximum is '
                         f'{self.max_seq_len - 1} (max_seq_len {self.max_seq_len})')
    try:
      params.validate()
    except ValueError as e:
      raise RequestError(str(e)) from None
    if params.n > self.max_batch_size:
      raise RequestError(f'n={params.n} parallel samples: at most max_batch_size='
                         f'{self.max_batch_size} (they decode in one batch)')
    if params.n > 1 and not self._can_share:
      raise RequestError('parallel samples share blocks, which a recent-window pool cannot')
    if params.beam_width > self.max_batch_size:
      raise RequestError(f'beam_width={params.beam_width}: at most max_batch_size='
                         f'{self.max_batch_size} (the beams decode in one batch)')
    if params.beam_width and not self._can_share:
      raise RequestError('beams share blocks, which a recent-window pool cannot')
    longest = min(len(prompt) + params.max_new_tokens, self.max_seq_len)
    if self.blocks.blocks_for(longest) > self.allocator.num_blocks - 1:
      raise RequestError(
          f'request needs up to {self.blocks.blocks_for(longest)} blocks of '
          f'{self.block_size} tokens ({longest} tokens) but the pool has only '
          f'{self.allocator.num_blocks - 1}: it can never fit')
    arrival = self.clock if arrival_time is None else float(arrival_time)
    prompt = [int(t) for t in prompt]
    group = [Sequence(self._next_id + i, prompt, dataclasses.replace(params, seed=params.seed + i),
                      arrival_time=arrival, status=Status.PENDING,
                      group_id=self._next_id if params.n > 1 else None)
             for i in range(params.n)]
    seq = group[0]
    seq.forks = group[1:]
    if params.beam_width:
      seq.group_id, seq.extra_rows = seq.request_id, params.beam_width - 1
      seq.beam = beam_lib.BeamGroup(seq, params.beam_width, params.length_penalty,
                                    self.eos_id if params.stop_on_eos else None)
      self._beam_groups.append(seq.beam)
    self._next_id += params.n
    for s in group:
      self._live[s.request_id] = s
    self.stats['prompt_tokens_submitted'] += len(prompt)
    heapq.heappush(self._pending, (arrival, seq.request_id, seq))
    self._release_arrivals()
    return seq.request_id

  def _release_arrivals(self):
    while self._pending and self._pending[0][0] <= self.clock:
      self.scheduler.add(heapq.heappop(self._pending)[2])

  # ---- one iteration ---------------------------------------------------------------------

  def step(self) -> List[Completion]:
    """One scheduling iteration; returns the requests that finished in it."""
    start = self._timer()
    if not self.scheduler.has_work() and self._pending:
      self.clock = max(self.clock, self._pending[0][0])  # idle until the next arrival
    self._release_arrivals()
    if not self.scheduler.has_work():
      return []
    plan = self.scheduler.schedule()
    self._assign_lanes(plan)
    timing = collections.Counter()
    if plan.swap_out:
      self.stats['swapped_out_blocks'] += self._timed(timing, self.tier.swap_out, self.pool,
                                                      plan.swap_out)
    if plan.copies:  # after swap-out read the blocks preempted now, before anything writes
      self.pool = self._timed(timing, self.copier, self.pool, plan.copies)
      self.stats['cow_copies'] += len(plan.copies)
    if plan.swap_in:
      self.pool = self._timed(timing, self.tier.swap_in, self.pool, plan.swap_in)
      self.stats['swapped_in_blocks'] += sum(len(src) for src, _ in plan.swap_in)
    for seq, policy in plan.preempted:
      self.stats['preemptions'] += 1
      self.stats[f'preemptions_{policy}'] += 1
    self.stats['forks'] += len(plan.forked)

    chunks = [(s, n) for s, n in plan.rows if n > 1]
    decodes = [(s, n) for s, n in plan.rows if n == 1]
    sampled = []
    for rows, kind in ((chunks, 'prefill'), (decodes, 'decode')):
      if rows:
        sampled += self._run(rows, kind, timing)
        self.stats[f'{kind}_steps'] += 1
    self.stats['steps'] += 1

    now = self.clock + self._timer() - start - timing['compile']
    done = []
    for seq, token, logits in sampled:
      seq.output_ids.append(token)
      self.stats['generated_tokens'] += 1
      if logits is not None:
        self._logits[seq.request_id].append(logits)
      if seq.first_token_time is None:
        seq.first_token_time = now
      reason = self._finish_reason(seq)
      if reason:
        done.append((seq, reason))
    self.metrics.record_step(
        t=now, running=self.running, num_waiting=len(self.waiting),
        num_swapped=len(self.swapped), free_blocks=self.allocator.num_free,
        memory_blocked=plan.memory_blocked, prefill_tokens=sum(n for _, n in chunks),
        decode_tokens=len(decodes), host_s=now - self.clock - timing['device'],
        device_s=timing['device'], compile_s=timing['compile'])
    completions = [self._retire(seq, reason, now) for seq, reason in done]
    completions += self._advance_beams(now)
    self.stats['device_seconds'] += timing['device']
    self.stats['compile_seconds'] += timing['compile']
    self.clock = now
    return completions

  def _assign_lanes(self, plan):
    """Preempted sequences give their lane back; running ones without a lane take one."""
    for seq, _ in plan.preempted:
      self._release_lane(seq)
    for seq in self.running:
      if not seq.lane:
        seq.lane = self._free_lanes.pop()

  def _release_lane(self, seq):
    if seq.lane:
      self._free_lanes.append(seq.lane)
      seq.lane = 0

  def _timed(self, timing, fn, *args):
    """Runs a device call (which must block on its result), charging compile or device time."""
    before = self.num_compilations
    t0 = self._timer()
    out = fn(*args)
    compiled = self.num_compilations - before
    self.stats['compilations'] += compiled
    timing['compile' if compiled else 'device'] += self._timer() - t0
    return out

  def _run(self, rows, kind, timing) -> list:
    """One jitted call over rows of (seq, tokens to feed); returns (seq, token, logits) for the
    rows whose prompt or decode token is now fully cached, i.e. that sample."""
    specs = []
    for seq, n in rows:
      start, p = seq.num_cached, seq.params
      specs.append(RowSpec(seq.all_ids[start:start + n], start,
                           self.blocks.visible_table(seq, start + n), p.temperature, p.top_k,
                           p.top_p, p.seed, len(seq.output_ids), seq.lane))
    batch_buckets = self.decode_batch_buckets if kind == 'decode' else self.batch_buckets
    inputs = build_step_inputs(specs, self.block_size, batch_buckets, self.token_buckets,
                               self.block_buckets)
    # A call holding a beam row returns top-K candidates too (one K bucket for the call).
    topk = max((beam_lib.topk_bucket(s.params.beam_width, self.cfg.vocab_size)
                for s, _ in rows if s.beam), default=0)
    step_fn = self.step_fn.with_topk(topk) if topk else self.step_fn

    def call():
      out = step_fn(self.params, self.pool, inputs)
      logits = np.asarray(out[2]) if self.record_logits else None
      cands = (np.asarray(out[-2]), np.asarray(out[-1])) if topk else None
      return out[0], np.asarray(out[1]), logits, cands

    self.pool, tokens, logits, cands = self._timed(timing, call)
    sampled = []
    for i, (seq, n) in enumerate(rows):
      # Prompt positions fed (recomputation after preemption included): what prefix caching saves.
      self.stats['prompt_tokens_computed'] += max(
          0, min(seq.num_cached + n, len(seq.prompt_ids)) - seq.num_cached)
      seq.num_cached += n
      self.blocks.offer_full_blocks(seq)
      if not seq.num_pending and seq.beam:  # a beam's token is chosen by its group
        seq.beam.offer(seq, cands[0][i], cands[1][i])
      elif not seq.num_pending:  # not a mid-prompt chunk
        sampled.append((seq, int(tokens[i]), None if logits is None else logits[i]))
    return sampled

  # ---- beam search -----------------------------------------------------------------------

  def _advance_beams(self, now: float) -> List[Completion]:
    """Expands every beam group whose live beams all hold this iteration's candidates
    (beam.py): a beam kept c times continues with its best kept token and forks c - 1 children
    (shared blocks; the next iteration's slot reservation copies a partly filled last block),
    a beam kept 0 times frees its blocks. After the iteration's memory sample, like retirement.
    Returns the completions of the groups that finished."""
    done = []
    for group in list(self._beam_groups):
      if not group.ready(Status.RUNNING):
        continue
      beams, leader = group.live, group.leader
      ids = np.stack([group.candidates[id(b)][0] for b in beams])
      logprobs = np.stack([group.candidates[id(b)][1] for b in beams])
      length = len(beams[0].output_ids) + 1
      out_of_room = beams[0].num_tokens + 1 >= self.max_seq_len
      last = length >= leader.params.max_new_tokens or out_of_room
      kept, ended = beam_lib.expand([group.logprob[id(b)] for b in beams], ids, logprobs,
                                    width=group.width, eos_id=group.eos_id, last=last)
      for b, token, lp in ended:
        reason = ('eos' if group.eos_id is not None and token == group.eos_id else
                  'length' if length >= leader.params.max_new_tokens else 'max_seq_len')
        group.add_finished(beams[b].output_ids + [token], lp, reason)
      kept_beams = {b for b, _, _ in kept}
      for b, beam in enumerate(beams):
        if b not in kept_beams:
          self._drop_beam(beam)
      outputs = [list(b.output_ids) for b in beams]  # before any kept token is appended
      live, logprob, used = [], {}, set()
      for b, token, lp in kept:  # best first: a beam keeps its best token, forks the others
        target = beams[b]
        if b in used:
          target = Sequence(leader.request_id, target.prompt_ids, target.params,
                            arrival_time=target.arrival_time, output_ids=list(outputs[b]),
                            group_id=leader.group_id, beam=group)
          self.scheduler.fork_running(beams[b], target)
          self.stats['forks'] += 1
        used.add(b)
        target.output_ids.append(token)
        live.append(target)
        logprob[id(target)] = lp
      self.stats['generated_tokens'] += len(kept)
      leader.extra_rows = 0  # its reserved rows are the forks' now
      if leader.first_token_time is None:
        leader.first_token_time = now
      group.live, group.logprob, group.candidates = live, logprob, {}
      if group.done(kept):
        done.append(self._retire_beams(group, now))
    return done

  def _drop_beam(self, beam: Sequence) -> None:
    beam.beam.num_preemptions += beam.num_preemptions
    self.scheduler.finish(beam)
    self._release_lane(beam)
    beam.status = Status.FINISHED

  def _retire_beams(self, group: beam_lib.BeamGroup, now: float) -> Completion:
    """Frees the group's remaining live beams; its Completion is the best hypothesis, with all
    k (output ids, score) best first in `beams`."""
    for beam in group.live:
      self._drop_beam(beam)
    group.live = []
    self._beam_groups.remove(group)
    leader, best = group.leader, group.best()
    top = best[0]
    leader.status, leader.finish_reason, leader.finish_time = (Status.FINISHED,
                                                               top.finish_reason, now)
    del self._live[leader.request_id]
    text = self.tokenizer.decode(top.output_ids) if self.tokenizer else None
    done = Completion(leader.request_id, leader.prompt_ids, top.output_ids, top.finish_reason,
                      group.num_preemptions, text, None, leader.arrival_time,
                      leader.first_token_time, now, leader.group_id, score=top.score,
                      beams=[(h.output_ids, h.score) for h in best])
    self.finished[leader.request_id] = done
    self.metrics.record_finish(done)
    return done

  def _finish_reason(self, seq: Sequence) -> Optional[str]:
    if seq.params.stop_on_eos and self.eos_id is not None and seq.output_ids[-1] == self.eos_id:
      return 'eos'
    if len(seq.output_ids) >= seq.params.max_new_tokens:
      return 'length'
    if seq.num_tokens >= self.max_seq_len:
      return 'max_seq_len'
    return None

  def _retire(self, seq: Sequence, reason: str, now: float) -> Completion:
    self.scheduler.finish(seq)
    self._release_lane(seq)
    seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, reason, now
    del self._live[seq.request_id]
    text = self.tokenizer.decode(seq.output_ids) if self.tokenizer else None
    done = Completion(seq.request_id, seq.prompt_ids, seq.output_ids, seq.finish_reason,
                      seq.num_preemptions, text, self._logits.pop(seq.request_id, None),
                      seq.arrival_time, seq.first_token_time, now, seq.group_id)
    self.finished[seq.request_id] = done
    self.metrics.record_finish(done)
    return done

  # Memory figures come from the metrics' per-iteration record (taken after the iteration's
  # writes, before frees: each sequence as full as it gets before one retires).
  @property
  def peak_blocks_used(self) -> int:
    return self.metrics.peak_blocks_used()

  @property
  def utilization_at_peak(self) -> float:
    """KV utilization (token states / slots of allocated blocks) at the last iteration that held
    the peak block count."""
    return self.metrics.utilization_at_peak()

  @property
  def mean_utilization(self) -> float:
    """Iteration-averaged KV utilization."""
    return self.metrics.mean_utilization()

  # ---- driving ---------------------------------------------------------------------------

  def has_work(self) -> bool:
    return bool(self._pending) or self.scheduler.has_work()

  def run(self) -> List[Completion]:
    """Step until every submitted request has finished; completions in submission order."""
    ids = sorted(self._live)
    idle = 0
    while self.has_work():
      before = self._progress()
      self.step()
      idle = 0 if self._progress() != before else idle + 1
      if idle >= MAX_IDLE_ITERATIONS:  # a scheduling bug or a pool too small to make progress
        raise RuntimeError(
            f'no progress in {idle} iterations: {len(self.running)} running, '
            f'{len(self.waiting)} waiting, {self.allocator.num_free} free blocks')
    return [self.finished[i] for i in ids]

  def _progress(self) -> tuple:
    """What an iteration that does any work changes: tokens cached, generated, finished."""
    return (self.stats['generated_tokens'], len(self.finished),
            sum(seq.num_cached for seq in self.running))

  def generate(self, prompts, params: SamplingParams = SamplingParams()) -> List[Completion]:
    for prompt in prompts:
      self.submit(prompt, params)
    return self.run()

  def summary(self) -> dict:
    """The run's figures (metrics.py) with the engine's own counters."""
    out = self.metrics.summary()
    out.update({k: self.stats[k] for k in (
        'preemptions', 'preemptions_recompute', 'preemptions_swap', 'swapped_out_blocks',
        'swapped_in_blocks', 'forks', 'cow_copies', 'prompt_tokens_submitted',
        'prompt_tokens_computed')})
    submitted = self.stats['prompt_tokens_submitted']
    out['prefill_tokens_saved_fraction'] = (
        1 - self.stats['prompt_tokens_computed'] / submitted if submitted else None)
    out['prefix_caching'] = self.prefix_cache is not None
    if self.prefix_cache is not None:
      out.update(self.prefix_cache.figures(), prefix_cache_eviction=self.prefix_cache.eviction,
                 prefix_cache_design=self.prefix_cache_design)
    out.update(pool_kind=self.pool_kind, preemption=self.preemption,
               block_size=self.block_size, num_blocks=self.allocator.num_blocks,
               kv_bytes_per_token=self.kv_bytes_per_token, kv_pool_bytes=self.pool.nbytes,
               peak_blocks_used=self.peak_blocks_used,
               kv_utilization_at_peak=self.utilization_at_peak,
               num_compilations=self.stats['compilations'])  # this engine's, not step_fn's
    return out

  @property
  def num_compilations(self) -> int:
    """Compilations of the (possibly shared) step and copy programs, all engines included."""
    return (self.step_fn.num_compilations + self.copier.num_compilations +
            getattr(self.step_fn, 'num_topk_compilations', 0) +
            (self.tier.num_compilations if self.tier else 0))

  @property
  def kv_bytes_per_token(self) -> int:
    return self.pool.bytes_per_token
