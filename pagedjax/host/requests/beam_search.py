"""Beam coordination: advances every beam group whose live beams all hold this iteration's
candidates, using the selection rule of beam.py.

A beam kept c times continues with its best kept token and forks c - 1 children (shared blocks;
the next iteration's slot reservation copies a partly filled last block, as for parallel
samples); a beam kept 0 times frees its blocks. This runs after the iteration's memory sample,
like retirement; the update step (host/scheduling/update.py) calls it and reports what it
returns. Plain host bookkeeping: the candidates come from the step variant that returns top-K
log-probs (pagedjax/model/step.py).
"""
from typing import List, NamedTuple

import numpy as np

from pagedjax.host.requests import beam as beam_lib
from pagedjax.host.scheduling.scheduler import Scheduler
from pagedjax.host.requests.sequence import Sequence, Status


class Advanced(NamedTuple):
  """What one advance did: the groups that finished, the tokens kept, the beams forked."""
  finished: List[beam_lib.BeamGroup]
  tokens: int
  forks: int


class BeamSearch:

  def __init__(self, scheduler: Scheduler, max_seq_len: int):
    self.scheduler = scheduler
    self.max_seq_len = max_seq_len
    self.groups: List[beam_lib.BeamGroup] = []  # beam requests under way

  def advance(self, now: float) -> Advanced:
    """Expands every ready group; returns the groups that finished (their beams freed) and
    the tokens and forks of the expansions."""
    done, tokens, forks = [], 0, 0
    for group in list(self.groups):
      if not group.ready(Status.RUNNING):
        continue
      kept, forked, finished = self._expand(group, now)
      tokens, forks = tokens + kept, forks + forked
      if finished:
        for beam in group.live:
          self.drop(beam, now)
        group.live = []
        self.groups.remove(group)
        done.append(group)
    return Advanced(done, tokens, forks)

  def _expand(self, group: beam_lib.BeamGroup, now: float):
    """One expansion step of a ready group; returns (tokens kept, beams forked, whether the
    group is done)."""
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
        self.drop(beam, now)
    live, forks = self._continue(group, beams, kept)
    group.live, group.logprob = live, {}
    for beam, (_, _, lp) in zip(group.live, kept):
      group.logprob[id(beam)] = lp
    group.candidates = {}
    leader.extra_rows = 0  # its reserved rows are the forks' now
    if leader.first_token_time is None:
      leader.first_token_time = now
    return len(kept), forks, group.done(kept)

  def _continue(self, group, beams: List[Sequence], kept):
    """The live beams after this step, in `kept` order (best first): a beam keeps its best
    kept token and forks a child for each other one. Returns (live beams, children forked)."""
    outputs = [list(b.output_ids) for b in beams]  # before any kept token is appended
    live, used, forks = [], set(), 0
    for b, token, _ in kept:
      target = beams[b]
      if b in used:
        target = Sequence(group.leader.request_id, target.prompt_ids, target.params,
                          arrival_time=target.arrival_time, output_ids=list(outputs[b]),
                          group_id=group.leader.group_id, beam=group)
        self.scheduler.fork_running(beams[b], target)
        forks += 1
      used.add(b)
      target.output_ids.append(token)
      live.append(target)
    return live, forks

  def drop(self, beam: Sequence, now: float) -> None:
    """Frees a beam's blocks and lane (scheduler.finish); its preemptions count toward its
    group's."""
    beam.beam.num_preemptions += beam.num_preemptions
    self.scheduler.finish(beam, now)
    beam.status = Status.FINISHED
