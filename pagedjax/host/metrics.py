"""Per-run serving metrics: KV memory use over time, where the rest went, latency, throughput.

Memory is sampled once per iteration, after the iteration's writes and before finished requests
free their blocks (each sequence is then as full as it gets). Slots of the pool (block 0, the
null block, excluded) fall in exactly one of:
  token_states            slots holding a real token's K/V
  internal_fragmentation  the unused tail of each sequence's last written block
  reservation             blocks a sequence holds but has not written yet: a contiguous
                          sequence's max_seq_len reservation, or a paged prompt's later chunks
  free_unusable           free slots while the waiting head was refused for lack of blocks
                          (too few for its reservation or prompt, or under the watermark)
  free_idle               other free slots: nothing was waiting for them
  pinned                  slots of pinned cached blocks no sequence holds (prefix_cache.py:
                          pinning): kept for prefixes expected back, neither free nor evictable
Run figures are sums over iterations (each iteration is one state of the pool), so
`kv_utilization` = sum token_states / sum reserved slots, reserved being the first three: the
share of the memory handed to sequences that holds token states, the figure the vLLM paper
reports (20.4-38.2% for prior systems, ~96% paged).

Times are engine-clock seconds (see engine.py: wall time of the engine's work, compilation
excluded, idle gaps jumped). Latency figures: TTFT = first token - arrival; TPOT (time per
output token) = (finish - first token) / (outputs - 1) per request; normalized latency =
(finish - arrival) / outputs, the vLLM paper's serving metric. Goodput = generated tokens of
requests that finished (not aborted) per second of the run (first arrival to last finish).

Thrashing (preemption dominating): preempted and re-preempted requests (preempted >= 1 and
>= 2 times), and `recomputed_token_fraction` = positions fed again below what their sequence
had cached before a recompute preemption ('recomputed_tokens', counted by the update step,
host/scheduling/update.py) over all positions
fed ('tokens_fed': prompt chunks, recomputation and decodes).

Prefix lookups: with a prefix cache, each iteration also records the tokens its admissions
queried and found in the cache, the windowed hit rate over recent iterations and whether the
hit-rate alert is active (host/alerts.py: the alert, its records and the throttle it drives).

Counters: `Metrics.counters` is the run's one set of counts (engine.stats is this object, read
only by convention), written only here, by the count_* methods the engine's iteration calls:
count_submitted at submission, count_plan with each iteration's plan (preemptions by policy,
forks, iterations), count_device with what the executor returned (StepOutput.counts: blocks
swapped, copied and offloaded, steps by kind, compilations, the block-table and streamed-path
figures; the device and compile seconds), count_tokens with the update step's tallies
(positions fed, prompt positions computed and recomputed, tokens generated, beam forks) and
count_aborted. A count named *_max keeps the largest value reported; the rest add up.
"""
import collections
import itertools
from typing import Dict, List, Optional, Sequence as Seq

import numpy as np

from pagedjax.host.alerts import HitRateMonitor
from pagedjax.host.requests.sequence import Completion, Sequence

# The counters (Metrics.counters) that engine_summary() reports next to the metrics.
ENGINE_COUNTERS = ('preemptions', 'preemptions_recompute', 'preemptions_swap',
                   'swapped_out_blocks', 'swapped_in_blocks', 'forks', 'cow_copies',
                   'prompt_tokens_submitted', 'prompt_tokens_computed', 'aborted',
                   'tokens_fed', 'recomputed_tokens')
WASTE = ('token_states', 'internal_fragmentation', 'reservation', 'free_unusable', 'free_idle',
         'pinned')


def slot_usage(seqs: Seq[Sequence], block_size: int) -> Dict[str, int]:
  """Slots of the given sequences' blocks, split into token states, tail, and reservation.

  A block shared by several sequences (forks, prefix hits) is counted once, as full as its
  fullest holder has it."""
  # Vectorised (it runs every iteration, over every running block: a per-block Python loop
  # was half of a 10,000-request simulation's time): each table slot's fill, then the fullest
  # holder's fill per distinct block.
  tables = [s.block_table for s in seqs if s.block_table]
  if not tables:
    return {'token_states': 0, 'internal_fragmentation': 0, 'reservation': 0}
  blocks = np.fromiter(itertools.chain.from_iterable(tables), np.int64)
  index = np.concatenate([np.arange(len(t)) for t in tables])
  cached = np.repeat([s.num_cached for s in seqs if s.block_table], [len(t) for t in tables])
  fill = np.clip(cached - index * block_size, 0, block_size)
  distinct, where = np.unique(blocks, return_inverse=True)
  filled = np.zeros(len(distinct), np.int64)
  np.maximum.at(filled, where, fill)
  used = int(filled.sum())
  written = int(np.count_nonzero(filled)) * block_size
  return {'token_states': used, 'internal_fragmentation': written - used,
          'reservation': len(distinct) * block_size - written}


def logical_slots(seqs: Seq[Sequence], block_size: int) -> int:
  """Slots the sequences' block tables name, a shared block once per holder: what they would
  take without sharing."""
  return sum(len(s.block_table) for s in seqs) * block_size


def add_counts(total: Dict[str, float], counts: Dict[str, float]) -> None:
  """Adds counts into total; a count named *_max keeps the larger value instead."""
  for key, value in counts.items():
    total[key] = max(total.get(key, 0), value) if key.endswith('_max') else (
        total.get(key, 0) + value)


def percentile(values, q) -> Optional[float]:
  return float(np.percentile(values, q)) if len(values) else None


class Metrics:

  def __init__(self, block_size: int, num_blocks: int, cache=None,
               hit_rate: Optional[HitRateMonitor] = None):
    """cache: the prefix cache, whose pinned idle blocks are neither held nor free, and whose
    lookups feed hit_rate (host/alerts.py; by default a monitor with no alert)."""
    self.block_size, self.cache = block_size, cache
    self.hit_rate = hit_rate or HitRateMonitor()
    self._lookups = (0, 0)  # the cache's cumulative (queried, hit) tokens at the last iteration
    self.capacity = (num_blocks - 1) * block_size
    self.steps: Dict[str, List[float]] = collections.defaultdict(list)
    self.requests: List[Completion] = []
    self.counters: collections.Counter = collections.Counter()  # module docstring: Counters

  # ---- counters ----------------------------------------------------------------------------

  def count_submitted(self, prompt_tokens: int) -> None:
    self.counters['prompt_tokens_submitted'] += prompt_tokens

  def count_plan(self, plan) -> None:
    """An executed iteration's plan (host/scheduling/scheduler.py): its preemptions by how
    they kept the victim's K/V, and the parallel samples forked."""
    c = self.counters
    c['steps'] += 1
    for _, policy in plan.preempted:
      c['preemptions'] += 1
      c[f'preemptions_{policy}'] += 1
    c['forks'] += len(plan.forked)

  def count_device(self, output) -> None:
    """What the executor did (a StepOutput, host/scheduling/device_api.py): its counts, and its
    device and compile seconds."""
    c = self.counters
    add_counts(c, output.counts)
    c['device_seconds'] += output.device_s
    c['compile_seconds'] += output.compile_s

  def count_tokens(self, *, fed: int, prompt_computed: int, recomputed: int, generated: int,
                   forks: int = 0) -> None:
    """The update step's tallies: positions fed (prompt chunks, recomputation, decodes), prompt
    positions computed, positions fed again below a sequence's high-water mark (thrashing's
    waste), tokens generated, beams forked."""
    c = self.counters
    c['tokens_fed'] += fed
    c['prompt_tokens_computed'] += prompt_computed
    c['recomputed_tokens'] += recomputed
    c['generated_tokens'] += generated
    c['forks'] += forks

  def count_aborted(self) -> None:
    self.counters['aborted'] += 1

  # ---- per-iteration samples ---------------------------------------------------------------

  def record_step(self, *, t: float, running: Seq[Sequence], num_waiting: int,
                  num_swapped: int, free_blocks: int, memory_blocked: bool,
                  prefill_tokens: int, decode_tokens: int, host_s: float, device_s: float,
                  compile_s: float) -> None:
    usage = slot_usage(running, self.block_size)
    free = free_blocks * self.block_size
    usage['free_unusable'] = free if memory_blocked else 0
    usage['free_idle'] = free - usage['free_unusable']
    usage['pinned'] = self.cache.num_pinned_idle * self.block_size if self.cache else 0
    if sum(usage.values()) != self.capacity:  # a leaked or doubly held block
      raise RuntimeError(f'slot accounting {usage} does not add up to the pool\'s '
                         f'{self.capacity} slots')
    row = dict(usage, t=t, running=len(running),
               logical_slots=logical_slots(running, self.block_size), waiting=num_waiting,
               swapped=num_swapped,
               prefill_tokens=prefill_tokens, decode_tokens=decode_tokens, host_s=host_s,
               device_s=device_s, compile_s=compile_s)
    if self.cache is not None:
      row.update(self._lookup_row(t))
    for key, value in row.items():
      self.steps[key].append(value)

  def _lookup_row(self, t: float) -> dict:
    """This iteration's prefix lookups (the cache counts them cumulatively), fed to hit_rate."""
    total = (self.cache.queried_tokens, self.cache.hit_tokens)
    queried, hit = total[0] - self._lookups[0], total[1] - self._lookups[1]
    self._lookups = total
    self.hit_rate.observe(len(self.steps['t']), t, queried, hit)
    return dict(prefix_queried_tokens=queried, prefix_hit_tokens=hit,
                prefix_hit_rate_windowed=self.hit_rate.rate,
                hit_rate_alert=int(self.hit_rate.active))

  def record_finish(self, completion: Completion) -> None:
    self.requests.append(completion)

  def timeline(self) -> Dict[str, list]:
    """Per-iteration series, plus utilization = token states / reserved slots."""
    out = {k: list(v) for k, v in self.steps.items()}
    reserved = self._reserved()
    out['kv_utilization'] = [u / r if r else None for u, r in
                             zip(out.get('token_states', []), reserved)]
    return out

  def _reserved(self) -> np.ndarray:
    return sum(np.asarray(self.steps[k], float) for k in WASTE[:3])

  def _utilization(self) -> np.ndarray:
    """Per iteration: token states / reserved slots (0 while nothing is reserved)."""
    reserved = self._reserved()
    return np.asarray(self.steps['token_states'], float) / np.maximum(reserved, 1)

  def peak_blocks_used(self) -> int:
    """Most blocks held by sequences in one iteration (reserved slots are whole blocks)."""
    return int(self._reserved().max()) // self.block_size if self.steps.get('t') else 0

  def utilization_at_peak(self) -> float:
    """Utilization at the last iteration holding the peak block count."""
    if not self.steps.get('t'):
      return 0.0
    reserved = self._reserved()
    return float(self._utilization()[np.flatnonzero(reserved == reserved.max())[-1]])

  def mean_utilization(self) -> float:
    """Utilization averaged over iterations (the token-weighted figure is summary()'s
    kv_utilization)."""
    return float(self._utilization().mean()) if self.steps.get('t') else 0.0

  def summary(self) -> dict:
    s = {k: np.asarray(v, float) for k, v in self.steps.items()}
    n = len(s.get('t', []))
    out = {'iterations': n}
    if n:
      reserved = self._reserved().sum()
      out['kv_utilization'] = float(s['token_states'].sum() / reserved) if reserved else None
      for key in WASTE:  # shares of the pool, averaged over iterations
        out[f'kv_{key}'] = float(s[key].sum() / (self.capacity * n))
      out.update(
          peak_concurrent_sequences=int(s['running'].max()),
          mean_concurrent_sequences=float(s['running'].mean()),
          peak_kv_slots_reserved=int(self._reserved().max()),
          host_s_per_step=float(s['host_s'].mean()),
          device_s_per_step=float(s['device_s'].mean()),
          compile_s=float(s['compile_s'].sum()))
      # Sharing (vLLM's "memory saving"): slots that sharing spared, over what the same block
      # tables would take unshared, summed over iterations.
      logical = s['logical_slots'].sum()
      out['kv_sharing_saved_fraction'] = (
          float(1 - self._reserved().sum() / logical) if logical else 0.0)
    out.update(self._request_figures())
    return out

  def engine_summary(self, prefix_cache=None, **fields) -> dict:
    """summary() with the run's counters (ENGINE_COUNTERS), what prefix caching saved, the
    cache's own figures, the peak memory sample and `fields` (the engine's settings)."""
    counters = self.counters
    out = self.summary()
    out.update({k: counters[k] for k in ENGINE_COUNTERS})
    submitted = counters['prompt_tokens_submitted']
    out['prefill_tokens_saved_fraction'] = (
        1 - counters['prompt_tokens_computed'] / submitted if submitted else None)
    fed = counters['tokens_fed']
    out['recomputed_token_fraction'] = counters['recomputed_tokens'] / fed if fed else None
    out['prefix_caching'] = prefix_cache is not None
    if prefix_cache is not None:
      out.update(prefix_cache.figures(), prefix_cache_eviction=prefix_cache.eviction)
      out.update(self.hit_rate.figures())
    out.update(peak_blocks_used=self.peak_blocks_used(),
               kv_utilization_at_peak=self.utilization_at_peak(), **fields)
    return out

  def _request_figures(self) -> dict:
    reqs = self.requests
    generated = sum(len(c.output_ids) for c in reqs)
    out = {'finished_requests': len(reqs), 'generated_tokens': generated,
           'preempted_requests': sum(c.num_preemptions >= 1 for c in reqs),
           're_preempted_requests': sum(c.num_preemptions >= 2 for c in reqs),
           'max_preemptions_per_request': max((c.num_preemptions for c in reqs), default=0)}
    if not reqs:
      return out
    start = min(c.arrival_time for c in reqs)
    duration = max(c.finish_time for c in reqs) - start
    # A request aborted before its first token has no TTFT, TPOT or per-token latency.
    started = [c for c in reqs if c.first_token_time is not None and c.output_ids]
    ttft = [c.first_token_time - c.arrival_time for c in started]
    tpot = [(c.finish_time - c.first_token_time) / (len(c.output_ids) - 1)
            for c in started if len(c.output_ids) > 1]
    norm = [(c.finish_time - c.arrival_time) / len(c.output_ids) for c in started]
    # Goodput counts only requests that finished (an aborted one's tokens served nobody).
    good = sum(len(c.output_ids) for c in reqs if c.finish_reason != 'aborted')
    out.update(
        duration_s=duration,
        generated_tokens_per_s=generated / duration if duration > 0 else None,
        goodput_tokens_per_s=good / duration if duration > 0 else None,
        requests_per_s=len(reqs) / duration if duration > 0 else None,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
        normalized_latency_s=float(np.mean(norm)) if norm else None)
    return out
