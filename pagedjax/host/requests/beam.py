"""Beam search on the host: which continuations of a request's beams survive an iteration.

A beam request (`SamplingParams(beam_width=k)`) is a group of Sequences, its live beams, that
decode in lockstep through the ordinary engine iteration. The compiled step returns each row's
top-K token ids and log-probs (steps.py, `return_topk`); once every live beam of a group has
them, `expand` picks the k best continuations over all beams by summed log-prob. The engine
then forks a beam kept more than once (block_manager.fork: shared blocks, copy-on-write on the
partly filled last block, as for parallel samples) and frees a beam that is dropped.

Scores: live beams rank by summed log-prob; finished hypotheses by summed log-prob divided by
GNMT's length penalty ((5 + len) / 6) ** alpha (Wu et al. 2016), len = generated tokens with
EOS; alpha = 0 (the default) ranks by summed log-prob. A candidate ending in EOS is a finished
hypothesis when it ranks among the top k (as in Hugging Face's BeamSearchScorer), and K = 2k
candidates per beam keep k live beams even if k of them end in EOS. At max_new_tokens the
top k candidates all finish. A group stops once it holds k finished hypotheses and its best
live beam, scored at its current length, cannot beat the k-th: exact for alpha = 0 (log-probs
only add negative terms), the usual heuristic otherwise.
"""
import dataclasses
from typing import List, Optional, Sequence as Seq, Tuple

import numpy as np


def length_penalty(length: int, alpha: float) -> float:
  """GNMT's ((5 + len) / 6) ** alpha; 1 for alpha = 0."""
  return ((5.0 + length) / 6.0) ** alpha


def topk_bucket(beam_width: int, vocab_size: int) -> int:
  """Static candidate count for the compiled step: a power of two >= 2 * beam_width, at most
  the vocabulary, so a run compiles one top-k step per bucket, not per width."""
  k = 1
  while k < 2 * beam_width:
    k *= 2
  return min(k, vocab_size)


@dataclasses.dataclass
class Hypothesis:
  output_ids: List[int]
  logprob: float  # summed log-probs of output_ids
  score: float  # logprob / length_penalty(len(output_ids), alpha)
  finish_reason: str  # 'eos' | 'length' | 'max_seq_len'


def expand(logprobs: Seq[float], cand_ids: np.ndarray, cand_logprobs: np.ndarray, *,
           width: int, eos_id: Optional[int], last: bool
           ) -> Tuple[List[Tuple[int, int, float]], List[Tuple[int, int, float]]]:
  """One beam-search step over a group's live beams.

  logprobs[b]: beam b's summed log-prob; cand_ids / cand_logprobs [beams, K]: its candidates.
  last: this token is the last allowed (max_new_tokens or max_seq_len).
  Returns (kept, ended): (beam, token, summed log-prob) triples, best first; kept continue as
  live beams (at most width), ended are finished hypotheses. Ties go to the lower beam, then
  the lower candidate rank, so the choice is deterministic.
  """
  cands = sorted(((logprobs[b] + float(cand_logprobs[b, j]), b, j)
                  for b in range(len(logprobs)) for j in range(cand_ids.shape[1])),
                 key=lambda c: (-c[0], c[1], c[2]))
  kept, ended = [], []
  for rank, (lp, b, j) in enumerate(cands):
    if len(kept) == width or (last and rank == width):
      break
    token = int(cand_ids[b, j])
    if last:
      ended.append((b, token, lp))
    elif eos_id is not None and token == eos_id:
      if rank < width:
        ended.append((b, token, lp))
    else:
      kept.append((b, token, lp))
  return kept, ended


class BeamGroup:
  """One beam request's state: its live beams (Sequences), their candidates this iteration, and
  its finished hypotheses."""

  def __init__(self, leader, width: int, alpha: float, eos_id: Optional[int]):
    self.leader = leader
    self.width, self.alpha, self.eos_id = width, alpha, eos_id
    self.live = [leader]
    self.logprob = {id(leader): 0.0}  # summed log-prob of each live beam's output_ids
    self.candidates = {}  # id(beam) -> (ids [K], logprobs [K]) from its latest step
    self.finished: List[Hypothesis] = []
    self.num_preemptions = 0  # of beams dropped or finished so far

  def offer(self, beam, ids: np.ndarray, logprobs: np.ndarray) -> None:
    """A step's top-K for beam (which just cached all of its tokens), best first. Only the
    first 2k are kept: a call's K is its largest group's, and 2k suffice (module docstring)."""
    self.candidates[id(beam)] = (ids[:2 * self.width], logprobs[:2 * self.width])

  def ready(self, running_status) -> bool:
    """Every live beam has its tokens cached and its candidates in: the group can expand. A beam
    preempted meanwhile samples again once it is back, so the group waits for it."""
    return all(b.status is running_status and not b.num_pending and id(b) in self.candidates
               for b in self.live)

  def add_finished(self, output_ids, logprob, reason) -> None:
    score = logprob / length_penalty(len(output_ids), self.alpha)
    self.finished.append(Hypothesis(list(output_ids), logprob, score, reason))
    self.finished.sort(key=lambda h: -h.score)

  def done(self, kept) -> bool:
    """No live beam left, or k finished hypotheses that the best live one cannot beat."""
    if not kept:
      return True
    if len(self.finished) < self.width:
      return False
    length = len(self.live[0].output_ids)
    best_live = max(lp for _, _, lp in kept) / length_penalty(length, self.alpha)
    return best_live <= self.finished[self.width - 1].score

  def best(self) -> List[Hypothesis]:
    return self.finished[:self.width]
