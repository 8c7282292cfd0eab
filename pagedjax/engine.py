"""The engine: admits requests, runs jitted steps over the paged pool, retires finished ones.

Host side (plain Python, between steps): the block allocator, each sequence's block table, and a
first-come-first-served schedule. A step either prefills (a chunk of each sequence's uncached
tokens) or decodes (one token per running sequence); prefill goes first so new requests join
the decode batch quickly. When the pool cannot hold the next tokens, the newest running sequence
is preempted by recompute: its blocks are freed and it re-enters the queue, to be prefilled again
(prompt plus what it already generated) later; greedy outputs do not change.
"""
import collections
import math
import time
from typing import Dict, List, Optional, Sequence as Seq, Union

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import pool as pool_lib
from pagedjax.allocator import BlockAllocator
from pagedjax.model import DTYPES, ModelConfig
from pagedjax.sampling import SamplingParams
from pagedjax.sequence import Completion, Sequence, Status
from pagedjax.step_inputs import RowSpec, build_step_inputs, power_of_two_buckets
from pagedjax.steps import CompiledStep


class RequestError(ValueError):
  """A request rejected at admission; the engine and its other requests are unaffected."""


class Engine:

  def __init__(self, model_cfg: ModelConfig, params, *, block_size: int = 16,
               num_blocks: int = 256, max_batch_size: int = 8, prefill_chunk: int = 128,
               max_seq_len: Optional[int] = None, attention_impl: str = 'reference',
               kv_dtype: Optional[str] = None, eos_id: Optional[int] = None, tokenizer=None,
               record_logits: bool = False, step_fn: Optional[CompiledStep] = None,
               shuffle_blocks_seed: Optional[int] = None):
    """step_fn lets engines of the same model share compiled steps (tests, sweeps)."""
    self.cfg = model_cfg
    self.params = params
    self.block_size = block_size
    self.max_batch_size = max_batch_size
    self.prefill_chunk = prefill_chunk
    self.max_seq_len = min(max_seq_len or model_cfg.max_seq_len, model_cfg.max_seq_len)
    self.eos_id = eos_id
    self.tokenizer = tokenizer

    self.allocator = BlockAllocator(num_blocks, shuffle_seed=shuffle_blocks_seed)
    self.pool = pool_lib.init_pool(model_cfg.num_layers, num_blocks, model_cfg.num_kv_heads,
                                   block_size, model_cfg.head_dim,
                                   DTYPES[kv_dtype or model_cfg.dtype])
    self.step_fn = step_fn or CompiledStep(model_cfg, attention_impl, record_logits)
    self.record_logits = self.step_fn.return_logits
    max_blocks_per_seq = math.ceil(self.max_seq_len / block_size)
    self.batch_buckets = power_of_two_buckets(max_batch_size)
    # Coarse buckets keep compilations few (each costs ~1 s on CPU even for a tiny model):
    # decode rows are 1 token, prefill chunks at least 16, block tables cover >= 256 tokens.
    self.token_buckets = [1] + power_of_two_buckets(prefill_chunk, min(16, prefill_chunk))
    self.block_buckets = power_of_two_buckets(
        max_blocks_per_seq, min(math.ceil(256 / block_size), max_blocks_per_seq))

    self.waiting: collections.deque = collections.deque()
    self.running: List[Sequence] = []
    self.finished: Dict[int, Completion] = {}
    self._logits: Dict[int, list] = collections.defaultdict(list)
    self._next_id = 0
    self.stats = collections.Counter()
    self.peak_blocks_used = 0
    self.utilization_at_peak = 0.0

  # ---- admission -------------------------------------------------------------------------

  def submit(self, prompt: Union[str, Seq[int]], params: SamplingParams = SamplingParams()) -> int:
    """Validate and queue a request; raises RequestError naming what is wrong."""
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
    longest = min(len(prompt) + params.max_new_tokens, self.max_seq_len)
    if math.ceil(longest / self.block_size) > self.allocator.num_blocks - 1:
      raise RequestError(
          f'request needs up to {math.ceil(longest / self.block_size)} blocks of '
          f'{self.block_size} tokens ({longest} tokens) but the pool has only '
          f'{self.allocator.num_blocks - 1}: it can never fit')
    seq = Sequence(self._next_id, [int(t) for t in prompt], params)
    self._next_id += 1
    self.waiting.append(seq)
    return seq.request_id

  def _admit(self):
    """FCFS: admit from the head of the queue while batch slots and blocks for the uncached
    tokens allow; never skip ahead of a request that does not fit yet."""
    while self.waiting and len(self.running) < self.max_batch_size:
      seq = self.waiting[0]
      if not self.allocator.can_allocate(self._blocks_short(seq, seq.num_tokens)):
        break
      self.waiting.popleft()
      seq.status = Status.RUNNING
      self.running.append(seq)

  # ---- blocks ----------------------------------------------------------------------------

  def _blocks_short(self, seq: Sequence, num_tokens: int) -> int:
    return max(0, math.ceil(num_tokens / self.block_size) - len(seq.block_table))

  def _preempt(self, seq: Sequence):
    """Recompute preemption: drop the cache, keep the tokens, requeue at the front."""
    self.allocator.free(seq.block_table)
    seq.block_table, seq.num_cached = [], 0
    seq.status = Status.WAITING
    seq.num_preemptions += 1
    self.stats['preemptions'] += 1
    self.running.remove(seq)
    self.waiting.appendleft(seq)

  def _reserve(self, rows: List[Sequence], counts: Dict[int, int]) -> List[Sequence]:
    """Give every row blocks for its next tokens, preempting the newest sequences if needed."""
    kept = list(rows)
    for seq in rows:
      if seq not in kept:
        continue
      need = self._blocks_short(seq, seq.num_cached + counts[seq.request_id])
      while not self.allocator.can_allocate(need):
        victim = self.running[-1]
        self._preempt(victim)
        if victim in kept:
          kept.remove(victim)
        if victim is seq:
          break
      if seq in kept:
        seq.block_table += self.allocator.allocate(need)
    return kept

  # ---- stepping --------------------------------------------------------------------------

  def step(self) -> List[Completion]:
    """One scheduling iteration; returns the requests that finished in it."""
    self._admit()
    if not self.running:
      return []
    prefilling = [s for s in self.running if s.num_pending > 1]
    rows = prefilling or list(self.running)
    counts = {s.request_id: min(s.num_pending, self.prefill_chunk) for s in rows}
    rows = self._reserve(rows, counts)
    if not rows:
      return []

    specs = []
    for seq in rows:
      n = counts[seq.request_id]
      p = seq.params
      specs.append(RowSpec(seq.all_ids[seq.num_cached:seq.num_cached + n], seq.num_cached,
                           seq.block_table, p.temperature, p.top_k, p.top_p, p.seed,
                           len(seq.output_ids)))
    inputs = build_step_inputs(specs, self.block_size, self.batch_buckets, self.token_buckets,
                               self.block_buckets)
    t0 = time.perf_counter()
    out = self.step_fn(self.params, self.pool, inputs)
    self.pool, tokens = out[0], np.asarray(out[1])
    self.stats['device_seconds'] += time.perf_counter() - t0
    self.stats['steps'] += 1
    self.stats['prefill_steps' if prefilling else 'decode_steps'] += 1
    logits = np.asarray(out[2]) if self.record_logits else None

    for seq in rows:
      seq.num_cached += counts[seq.request_id]
    self._track_memory()
    done = []
    for i, seq in enumerate(rows):
      if seq.num_pending:
        continue  # mid-prompt chunk: nothing sampled yet
      seq.output_ids.append(int(tokens[i]))
      self.stats['generated_tokens'] += 1
      if logits is not None:
        self._logits[seq.request_id].append(logits[i])
      reason = self._finish_reason(seq)
      if reason:
        done.append(self._retire(seq, reason))
    return done

  def _finish_reason(self, seq: Sequence) -> Optional[str]:
    if seq.params.stop_on_eos and self.eos_id is not None and seq.output_ids[-1] == self.eos_id:
      return 'eos'
    if len(seq.output_ids) >= seq.params.max_new_tokens:
      return 'length'
    if seq.num_tokens >= self.max_seq_len:
      return 'max_seq_len'
    return None

  def _retire(self, seq: Sequence, reason: str) -> Completion:
    self.allocator.free(seq.block_table)
    seq.block_table = []
    seq.status, seq.finish_reason = Status.FINISHED, reason
    self.running.remove(seq)
    text = self.tokenizer.decode(seq.output_ids) if self.tokenizer else None
    done = Completion(seq.request_id, seq.prompt_ids, seq.output_ids, reason,
                      seq.num_preemptions, text, self._logits.pop(seq.request_id, None))
    self.finished[seq.request_id] = done
    return done

  def _track_memory(self):
    """Called after each step's writes, before frees. Utilization = cached tokens / slots of
    allocated blocks; `utilization_at_peak` is taken at the last step holding the peak block
    count (sequences there are as full as they get before one retires)."""
    used = self.allocator.num_used
    util = sum(s.num_cached for s in self.running) / max(used * self.block_size, 1)
    self.stats['utilization_sum'] += util
    if used >= self.peak_blocks_used:
      self.peak_blocks_used = used
      self.utilization_at_peak = util

  @property
  def mean_utilization(self) -> float:
    """Step-averaged KV utilization."""
    return self.stats['utilization_sum'] / max(self.stats['steps'], 1)

  # ---- driving ---------------------------------------------------------------------------

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def run(self) -> List[Completion]:
    """Step until every queued request has finished; completions in submission order."""
    ids = [s.request_id for s in self.waiting] + [s.request_id for s in self.running]
    while self.has_work():
      self.step()
    return [self.finished[i] for i in sorted(ids)]

  def generate(self, prompts, params: SamplingParams = SamplingParams()) -> List[Completion]:
    for prompt in prompts:
      self.submit(prompt, params)
    return self.run()

  @property
  def num_compilations(self) -> int:
    return self.step_fn.num_compilations

  @property
  def kv_bytes_per_token(self) -> int:
    return self.pool.bytes_per_token
