"""Request intake: validation at submission, request ids, and the arrival clock.

A request is checked whole before anything is queued, and a bad one raises RequestError naming the
field, the value and what is allowed; the engine and its other requests are unaffected. A request
submitted with an arrival time waits here, invisible to the scheduler, until the engine clock
reaches it (`release`).
"""
import dataclasses
import heapq
import math
import numbers
from collections.abc import Iterable, Mapping, Set as AbstractSet
from typing import List, Optional, Sequence as Seq, Union

import numpy as np

from pagedjax.host.requests import beam as beam_lib
from pagedjax.host.scheduling.block_manager import BlockManager
from pagedjax.host.requests.sampling_params import SamplingParams, as_params, brief
from pagedjax.host.requests.sequence import Sequence, Status


class RequestError(ValueError):
  """A request rejected at submission; the engine and its other requests are unaffected."""


def prompt_ids(prompt, vocab_size: Optional[int], name: str = 'prompt', text: bool = False,
               shown: Optional[str] = None) -> List[int]:
  """A prompt's token ids as a list of ints, or RequestError naming `name`, the value and what is
  allowed. Token ids come as a list or tuple of ints, or a 1-D integer array (numpy, or anything
  numpy can read, such as a jax array); numpy integers count as ints, bools do not. The ids must
  lie in 0..vocab_size-1 (vocab_size None: any id >= 0), and there must be at least one. text:
  whether the caller also takes a str (to say so when refusing something else); shown: how
  messages show the prompt (default: name=value)."""
  span = f'0..{vocab_size - 1}' if vocab_size is not None else '>= 0'
  allowed = f'ints in {span}' if vocab_size is not None else 'ints >= 0'
  shown = shown or f'{name}={brief(prompt)}'
  if isinstance(prompt, (bytes, bytearray, memoryview)):
    raise RequestError(f'{shown} ({type(prompt).__name__}) is not allowed: decode it to a str, '
                       f'or pass token ids as a list of {allowed}')
  if hasattr(prompt, '__array__') and not isinstance(prompt, np.ndarray):
    try:
      prompt = np.asarray(prompt)
    except Exception as e:  # pylint: disable=broad-except  (whatever the object's __array__ does)
      raise RequestError(f'{shown} is not readable as an array of token ids: {e}') from None
  if isinstance(prompt, np.ndarray):
    if prompt.ndim != 1 or prompt.dtype.kind not in 'iuO':
      raise RequestError(f'{shown} (a {prompt.ndim}-D {prompt.dtype} array) is not allowed: '
                         f'token ids are a 1-D integer array or a list of {allowed}')
    prompt = prompt.tolist()
  elif not isinstance(prompt, (list, tuple, range)):
    hint = (' (encode text with the tokenizer first)' if isinstance(prompt, str) else '')
    raise RequestError(f'{shown} ({type(prompt).__name__}) is not allowed: '
                       f'{"a str (with a tokenizer), or " if text else ""}token ids as a list or '
                       f'1-D integer array of {allowed}{hint}')
  if not prompt:
    raise RequestError(f'{shown}: empty prompt: a request needs at least one token')
  for i, t in enumerate(prompt):
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
      why = ' (bools are not token ids)' if isinstance(t, (bool, np.bool_)) else ''
      raise RequestError(f'{shown}: token id {brief(t)} ({type(t).__name__}, at index {i}) is '
                         f'not allowed: {allowed}{why}')
  bad = [t for t in prompt if t < 0 or (vocab_size is not None and t >= vocab_size)]
  if bad:
    raise RequestError(f'{shown}: token ids {brief(bad[:5])} out of vocabulary: allowed {span}')
  return [int(t) for t in prompt]


def prompt_list(prompts) -> list:
  """generate's batch as a list of prompts, or RequestError: a str or one list of token ids is
  one prompt, not a batch (it would otherwise be read as one prompt per character or id)."""
  if isinstance(prompts, (str, bytes)) or _one_prompt_of_ids(prompts):
    raise RequestError(f'prompts={brief(prompts)} is one prompt: generate takes a list of '
                       f'prompts, e.g. generate([{brief(prompts, 30)}])')
  if isinstance(prompts, (Mapping, AbstractSet)) or not isinstance(prompts, Iterable) or (
      isinstance(prompts, np.ndarray) and prompts.ndim == 0):
    raise RequestError(f'prompts={brief(prompts)} ({type(prompts).__name__}) is not allowed: a '
                       'list of prompts, each a str or token ids (a list or 1-D integer array)')
  return list(prompts)  # a 2-D array: one prompt per row


def _one_prompt_of_ids(value) -> bool:
  if isinstance(value, np.ndarray):
    return value.ndim == 1 and value.dtype.kind in 'biu'
  return isinstance(value, (list, tuple)) and bool(value) and all(
      isinstance(t, (int, np.integer, np.bool_)) for t in value)


class RequestIntake:

  def __init__(self, blocks: BlockManager, *, vocab_size: int, max_seq_len: int,
               max_batch_size: int, can_share: bool, eos_id: Optional[int], tokenizer=None,
               offload=None):
    """can_share: whether the pool lets sequences share blocks (forks, beams). offload:
    host/scheduling/offload.py's Offload, which serves requests that can never fit the pool, or None."""
    self.blocks, self.vocab_size, self.max_seq_len = blocks, vocab_size, max_seq_len
    self.offload = offload
    self.max_batch_size, self.can_share = max_batch_size, can_share
    self.eos_id, self.tokenizer = eos_id, tokenizer
    self.pending: list = []  # heap of (arrival_time, request_id, Sequence) not yet visible
    self.next_id = 0

  def tokens(self, prompt: Union[str, Seq[int]], name: str = 'prompt') -> List[int]:
    """The prompt as validated token ids (`name` is what error messages call it)."""
    shown = None
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise RequestError(f'{name}={brief(prompt)}: a text prompt needs an engine built with a '
                           'tokenizer')
      text = prompt
      try:
        prompt = self.tokenizer.encode(text)
      except ValueError as e:  # text the tokenizer cannot take (a lone surrogate)
        raise RequestError(f'{name}={brief(text)}: {e}') from None
      shown = f'{name}={brief(text, 40)} (token ids {brief(prompt, 40)})'
    prompt = prompt_ids(prompt, self.vocab_size, name, text=True, shown=shown)
    if len(prompt) >= self.max_seq_len:
      raise RequestError(f'{name} of {len(prompt)} tokens: the maximum is '
                         f'{self.max_seq_len - 1} (max_seq_len {self.max_seq_len})')
    return prompt

  def check(self, prompt: List[int], params: SamplingParams) -> SamplingParams:
    """Raises RequestError unless the engine can serve this request; returns its parameters as
    a SamplingParams (they may come as a dict of its fields, or None for the defaults)."""
    try:
      params = as_params(params)
      params.validate()
    except (TypeError, ValueError) as e:  # TypeError: a dict that SamplingParams(**d) refuses
      raise RequestError(str(e)) from None
    for name, width in (('n', params.n), ('beam_width', params.beam_width)):
      if width > self.max_batch_size:
        raise RequestError(f'{name}={width}: at most max_batch_size={self.max_batch_size} '
                           '(a group decodes in one batch)')
      if width > 1 and not self.can_share:
        raise RequestError(f'{name}={width}: a group shares blocks, which a recent-window '
                           'pool cannot')
    if params.session_id is not None and self.blocks.cache is None:
      raise RequestError(f'session_id={brief(params.session_id)} needs prefix_cache.enabled=True '
                         '(a session is the cached blocks of its turns)')
    longest = min(len(prompt) + params.max_new_tokens, self.max_seq_len)
    # Beams run (and come back from preemption) together, each with all of its blocks: after a
    # recompute or swap they share nothing, so the group must fit k times over.
    copies = max(params.beam_width, 1)
    needed = copies * self.blocks.blocks_for(longest)
    if needed > self.blocks.allocator.num_blocks - 1:
      if self.offload is not None:  # served from host RAM, or refused naming why
        refusal = self.offload.refusal(len(prompt), params)
        if refusal is None:
          return params
        raise RequestError(refusal)
      group = f' for {copies} beams' if copies > 1 else ''
      raise RequestError(
          f'request needs up to {needed} blocks of {self.blocks.block_size} tokens{group} '
          f'({longest} tokens{" each" if copies > 1 else ""}) but the pool has only '
          f'{self.blocks.allocator.num_blocks - 1}: it can never fit (offload.host_blocks > 0 '
          'serves such requests from host RAM)')
    return params

  def _offloaded(self, prompt: List[int], params: SamplingParams) -> bool:
    """Whether a checked request is served with offload: its blocks never fit the pool (a
    beam group's k times over, as `check` counts them)."""
    longest = min(len(prompt) + params.max_new_tokens, self.max_seq_len)
    copies = max(params.beam_width, 1)
    return (self.offload is not None and
            copies * self.blocks.blocks_for(longest) > self.blocks.allocator.num_blocks - 1)

  def checked(self, prompt, params, arrival_time, name: str = 'prompt') -> tuple:
    """(token ids, SamplingParams, arrival) of a request that passed every check."""
    ids = self.tokens(prompt, name)
    return ids, self.check(ids, params), self.arrival(arrival_time)

  def arrival(self, arrival_time) -> float:
    """A requested arrival time as engine-clock seconds."""
    try:  # float() of an int too large for one overflows
      seconds = float(arrival_time) if isinstance(arrival_time, numbers.Real) else math.nan
    except OverflowError:
      seconds = math.inf
    if isinstance(arrival_time, (bool, np.bool_)) or not math.isfinite(seconds) or seconds < 0:
      raise RequestError(f'arrival_time={brief(arrival_time)} is not allowed: a finite number of '
                         'engine-clock seconds >= 0')
    return seconds

  def enqueue(self, prompt: List[int], params: SamplingParams, arrival: float) -> List[Sequence]:
    """Sequences for a checked request (one, or n parallel samples), queued until `arrival`.
    Sample i draws with seed `seed + i`; a beam request is one sequence leading a BeamGroup."""
    group = [Sequence(self.next_id + i, prompt, dataclasses.replace(params, seed=params.seed + i),
                      arrival_time=arrival, status=Status.PENDING,
                      group_id=self.next_id if params.n > 1 else None)
             for i in range(params.n)]
    if self._offloaded(prompt, params):
      for member in group:
        member.window = self.offload.window
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

