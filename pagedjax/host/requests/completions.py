"""Completions: the requests under way by id, and what each becomes when it ends.

A request is tracked from submission; when it finishes (or a beam group does, or a stalled one is
aborted) its Completion is built here, with the text if there is a tokenizer, recorded in the
run's metrics and kept in `finished` by request id.
"""
import collections
from typing import Dict, List, Optional

from pagedjax.host.metrics import Metrics
from pagedjax.host.requests.sequence import Completion, Sequence, Status


class Completions:

  def __init__(self, metrics: Metrics, tokenizer=None):
    self.metrics, self.tokenizer = metrics, tokenizer
    self.live: Dict[int, Sequence] = {}
    self.finished: Dict[int, Completion] = {}
    self.logits: Dict[int, list] = collections.defaultdict(list)  # when the step returns them

  def track(self, seqs: List[Sequence]) -> None:
    for seq in seqs:
      self.live[seq.request_id] = seq

  def of_sequence(self, seq: Sequence, reason: str, now: float) -> Completion:
    """A plain sequence (or one sample of n) that finished for `reason`."""
    seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, reason, now
    return self._complete(seq, seq.output_ids, reason, seq.num_preemptions, now=now,
                          logits=self.logits.pop(seq.request_id, None))

  def of_beams(self, group, now: float) -> Completion:
    """A finished beam group: its best hypothesis, with all k (output ids, score) best first in
    `beams`."""
    leader, best = group.leader, group.best()
    leader.status, leader.finish_reason, leader.finish_time = (Status.FINISHED,
                                                               best[0].finish_reason, now)
    return self._complete(leader, best[0].output_ids, best[0].finish_reason,
                          group.num_preemptions, now=now, score=best[0].score,
                          beams=[(h.output_ids, h.score) for h in best])

  def aborted(self, seq: Sequence, now: float) -> Completion:
    return self._complete(seq, seq.output_ids, 'aborted', seq.num_preemptions, now=now)

  def _complete(self, seq: Sequence, output_ids, reason: str, preemptions: int, *, now: float,
                logits: Optional[list] = None, **extra) -> Completion:
    del self.live[seq.request_id]
    text = self.tokenizer.decode(output_ids) if self.tokenizer else None
    done = Completion(seq.request_id, seq.prompt_ids, output_ids, reason, preemptions, text,
                      logits, seq.arrival_time, seq.first_token_time, now, seq.group_id,
                      **extra)
    self.finished[seq.request_id] = done
    self.metrics.record_finish(done)
    return done
