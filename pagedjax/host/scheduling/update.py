"""The update step: everything one iteration changes on the host after its device calls.

An iteration is schedule -> run -> update (device_api.py). `StepUpdate.update(plan, output,
now)` takes the plan the scheduler made and the StepOutput the executor returned, and, in this
order:

  1. marks each row's fed tokens cached (num_cached, and max_cached, the high-water mark that
     tells recomputation after a preemption from new work) and offers the blocks they filled to
     the prefix cache; a beam row hands its top-K candidates to its group; a mid-prompt chunk
     samples nothing;
  2. appends each sampling row's token (and its logits, when recorded), stamps its first-token
     time and decides whether it finished ('eos', 'length', 'max_seq_len': Sequence
     .finish_reason_now);
  3. records the iteration's memory sample and timings (metrics.py: taken before finished
     requests free their blocks, when each sequence is as full as it gets), and hands the
     hit-rate alert's throttle to the scheduler (host/alerts.py);
  4. retires the finished sequences: blocks and lanes back (Scheduler.finish), completions
     built (host/requests/completions.py);
  5. advances the beam groups whose beams all hold candidates (host/requests/beam_search.py);
  6. reports the iteration's counts to the metrics, their one owner (Metrics.count_*).
It returns the completions of the requests that finished in the iteration.
"""
from typing import List, Optional

from pagedjax.host.alerts import HitRateMonitor
from pagedjax.host.metrics import Metrics
from pagedjax.host.requests.beam_search import BeamSearch
from pagedjax.host.requests.completions import Completions
from pagedjax.host.requests.sequence import Completion, Sequence
from pagedjax.host.scheduling.block_manager import BlockManager
from pagedjax.host.scheduling.device_api import StepOutput
from pagedjax.host.scheduling.scheduler import Plan, Scheduler


class StepUpdate:

  def __init__(self, scheduler: Scheduler, blocks: BlockManager, beams: BeamSearch,
               completions: Completions, metrics: Metrics, hit_rate: HitRateMonitor, *,
               eos_id: Optional[int], max_seq_len: int):
    self.scheduler, self.blocks, self.beams = scheduler, blocks, beams
    self.completions, self.metrics, self.hit_rate = completions, metrics, hit_rate
    self.eos_id, self.max_seq_len = eos_id, max_seq_len

  def update(self, plan: Plan, output: StepOutput, now: float, *,
             host_s: float) -> List[Completion]:
    """Every post-step update of one iteration (module docstring); returns its completions.
    now: the engine clock at the iteration's end; host_s: the iteration's host seconds (the
    metrics' timeline; the device's are output.device_s)."""
    sampled, (fed, prompt_computed, recomputed) = self._advance(output)
    finishing = [(seq, self._append(seq, token, logits, now)) for seq, token, logits in sampled]
    self._record_step(plan, output, now, host_s)
    completions = []
    for seq, reason in finishing:
      if reason:
        self.scheduler.finish(seq, now)
        completions.append(self.completions.of_sequence(seq, reason, now))
    beams = self.beams.advance(now)
    completions += [self.completions.of_beams(group, now) for group in beams.finished]
    self.metrics.count_plan(plan)
    self.metrics.count_device(output)
    self.metrics.count_tokens(fed=fed, prompt_computed=prompt_computed, recomputed=recomputed,
                              generated=len(sampled) + beams.tokens, forks=beams.forks)
    return completions

  def _advance(self, output: StepOutput):
    """Step 1: marks the fed tokens cached and offers the filled blocks; beam rows hand their
    candidates to their group. Returns (seq, token, logits or None) of the rows that sample,
    and the positions (fed, prompt ones computed, recomputed)."""
    fed = prompt = recomputed = 0
    sampled = []
    for call in output.calls:
      tokens, logits, cands = call.tokens, call.logits, call.candidates
      for i, (seq, n) in enumerate(call.rows):
        # Prompt positions fed (recomputation after preemption included): what prefix caching
        # saves.
        prompt += max(0, min(seq.num_cached + n, len(seq.prompt_ids)) - seq.num_cached)
        # Positions it had cached before a recompute preemption, fed again: thrashing's waste.
        # (The high-water mark starts from what admission, a fork or a promotion handed it.)
        seq.max_cached = max(seq.max_cached, seq.num_cached)
        recomputed += max(0, min(seq.num_cached + n, seq.max_cached) - seq.num_cached)
        fed += n
        seq.num_cached += n
        seq.max_cached = max(seq.max_cached, seq.num_cached)
        self.blocks.offer_full_blocks(seq)
        if seq.num_pending:  # a mid-prompt chunk samples nothing
          continue
        if seq.beam:  # a beam's token is chosen by its group
          seq.beam.offer(seq, cands[0][i], cands[1][i])
        else:
          sampled.append((seq, int(tokens[i]), None if logits is None else logits[i]))
    return sampled, (fed, prompt, recomputed)

  def _append(self, seq: Sequence, token: int, logits, now: float) -> Optional[str]:
    """Step 2: appends a sampled token; returns why the sequence finishes, or None."""
    seq.output_ids.append(token)
    if logits is not None:
      self.completions.logits[seq.request_id].append(logits)
    if seq.first_token_time is None:
      seq.first_token_time = now
    return seq.finish_reason_now(self.eos_id, self.max_seq_len)

  def _record_step(self, plan: Plan, output: StepOutput, now: float, host_s: float) -> None:
    """Step 3: the memory sample and timings; the throttle while the hit-rate alert is on."""
    s = self.scheduler
    self.metrics.record_step(
        t=now, running=s.running, num_waiting=len(s.waiting), num_swapped=len(s.swapped),
        free_blocks=self.blocks.allocator.num_free, memory_blocked=plan.memory_blocked,
        prefill_tokens=plan.num_prefill_tokens, decode_tokens=plan.num_decode_tokens,
        host_s=host_s, device_s=output.device_s, compile_s=output.compile_s)
    if self.hit_rate.throttle_prefill_tokens:  # admission throttled while the alert is active
      s.prefill_cap = self.hit_rate.prefill_cap
