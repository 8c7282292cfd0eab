"""Request intake: validation at submission, request ids, and the arrival clock.

A request is checked whole before anything is queued, and a bad one raises RequestError naming the
field, the value and what is allowed; the engine and its other requests are unaffected. A request
submitted with an arrival time waits here, invisible to the scheduler, until the engine clock
reaches it (`release`).
"""
import dataclasses
import heapq
import math
from typing import List, Optional, Sequence as Seq, Union

import numpy as np

from pagedjax.host import beam as beam_lib
from pagedjax.host.block_manager import BlockManager
from pagedjax.host.sampling_params import SamplingParams
from pagedjax.host.sequence import Sequence, Status


class RequestError(ValueError):
  """A request rejected at submission; the engine and its other requests are unaffected."""


def prompt_ids(prompt: Seq[int], vocab_size: int) -> List[int]:
  """A prompt's token ids as a list of ints, or RequestError naming what is wrong (empty, or ids
  outside the vocabulary)."""
  prompt = list(prompt)
  if not prompt:
    raise RequestError('empty prompt: a request needs at least one token')
  bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size]
  if bad:
    raise RequestError(f'token ids {bad[:5]} out of vocabulary: allowed 0..{vocab_size - 1}')
  return [int(t) for t in prompt]


class RequestIntake:

  def __init__(self, blocks: BlockManager, *, vocab_size: int, max_seq_len: int,
               max_batch_size: int, can_share: bool, eos_id: Optional[int], tokenizer=None):
    """can_share: whether the pool lets sequences share blocks (forks, beams)."""
    self.blocks, self.vocab_size, self.max_seq_len = blocks, vocab_size, max_seq_len
    self.max_batch_size, self.can_share = max_batch_size, can_share
    self.eos_id, self.tokenizer = eos_id, tokenizer
    self.pending: list = []  # heap of (arrival_time, request_id, Sequence) not yet visible
    self.next_id = 0

  def tokens(self, prompt: Union[str, Seq[int]]) -> List[int]:
    """The prompt as validated token ids."""
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise RequestError('a text prompt needs an engine built with a tokenizer')
      prompt = self.tokenizer.encode(prompt)
    prompt = prompt_ids(prompt, self.vocab_size)
    if len(prompt) >= self.max_seq_len:
      raise RequestError(f'prompt of {len(prompt)} tokens: the maximum is '
                         f'{self.max_seq_len - 1} (max_seq_len {self.max_seq_len})')
    return prompt

  def check(self, prompt: List[int], params: SamplingParams) -> None:
    """Raises RequestError unless the engine can serve this request."""
    try:
      params.validate()
    except ValueError as e:
      raise RequestError(str(e)) from None
    for name, width in (('n', params.n), ('beam_width', params.beam_width)):
      if width > self.max_batch_size:
        raise RequestError(f'{name}={width}: at most max_batch_size={self.max_batch_size} '
                           '(a group decodes in one batch)')
      if width > 1 and not self.can_share:
        raise RequestError(f'{name}={width}: a group shares blocks, which a recent-window '
                           'pool cannot')
    if params.session_id is not None and self.blocks.cache is None:
      raise RequestError(f'session_id={params.session_id!r} needs prefix_cache.enabled=True '
                         '(a session is the cached blocks of its turns)')
    longest = min(len(prompt) + params.max_new_tokens, self.max_seq_len)
    # Beams run (and come back from preemption) together, each with all of its blocks: after a
    # recompute or swap they share nothing, so the group must fit k times over.
    copies = max(params.beam_width, 1)
    needed = copies * self.blocks.blocks_for(longest)
    if needed > self.blocks.allocator.num_blocks - 1:
      group = f' for {copies} beams' if copies > 1 else ''
      raise RequestError(
          f'request needs up to {needed} blocks of {self.blocks.block_size} tokens{group} '
          f'({longest} tokens{" each" if copies > 1 else ""}) but the pool has only '
          f'{self.blocks.allocator.num_blocks - 1}: it can never fit')

  def checked(self, prompt, params: SamplingParams, arrival_time) -> tuple:
    """(token ids, params, arrival) of a request that passed every check."""
    ids = self.tokens(prompt)
    self.check(ids, params)
    return ids, params, self.arrival(arrival_time)

  def arrival(self, arrival_time) -> float:
    """A requested arrival time as engine-clock seconds."""
    if isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float, np.number)) \
        or not math.isfinite(arrival_time) or arrival_time < 0:
      raise RequestError(f'arrival_time={arrival_time!r} is not allowed: a finite number of '
                         'engine-clock seconds >= 0')
    return float(arrival_time)

  def admit(self, prompt: List[int], params: SamplingParams, arrival: float) -> List[Sequence]:
    """Sequences for a checked request (one, or n parallel samples), queued until `arrival`.
    Sample i draws with seed `seed + i`; a beam request is one sequence leading a BeamGroup."""
    group = [Sequence(self.next_id + i, prompt, dataclasses.replace(params, seed=params.seed + i),
                      arrival_time=arrival, status=Status.PENDING,
                      group_id=self.next_id if params.n > 1 else None)
             for i in range(params.n)]
    seq = group[0]
    seq.forks = group[1:]
    if params.beam_width:
      seq.group_id, seq.extra_rows = seq.request_id, params.beam_width - 1
      seq.beam = beam_lib.BeamGroup(seq, params.beam_width, params.length_penalty,
                                    self.eos_id if params.stop_on_eos else None)
    self.next_id += params.n
    heapq.heappush(self.pending, (arrival, seq.request_id, seq))
    return group

  def next_arrival(self) -> Optional[float]:
    return self.pending[0][0] if self.pending else None

  def release(self, clock: float) -> List[Sequence]:
    """Requests whose arrival time the clock has reached, in arrival order."""
    out = []
    while self.pending and self.pending[0][0] <= clock:
      out.append(heapq.heappop(self.pending)[2])
    return out

