"""A model-free stand-in for CompiledStep, for tests of scheduling and metrics.

No model and no compilation, so property tests can run hundreds of engine iterations in
seconds. The 'sampled' token is a fixed function of the last fed token and its position, so a
request's outputs do not depend on batching, chunking or preemption (as greedy decoding of a
real model does not): `expected_outputs` predicts them without an engine.
"""
import collections

import numpy as np

from pagedjax.engine import Engine
from tiny_models import build_engine
from pagedjax.model.llama import ModelConfig

VOCAB = 97
CFG = ModelConfig(vocab_size=VOCAB, d_model=8, num_layers=1, num_heads=1, num_kv_heads=1,
                  head_dim=2, ffn_dim=8, max_seq_len=4096)


def next_token(last: int, length: int) -> int:
  return (last * 31 + length * 7 + 3) % VOCAB


def candidates(last: int, length: int, k: int):
  """A beam row's k best (token ids, log-probs), a fixed function like next_token: distinct ids,
  best first, log-probs that depend on the row so beams rank differently."""
  ids = [(next_token(last, length) + 13 * j) % VOCAB for j in range(k)]
  logprobs = [-0.5 * (j + 1) - 0.1 * ((last * 7 + length) % 5) for j in range(k)]
  return ids, logprobs


class FakeStep:
  return_logits = False
  num_compilations = 0

  def __init__(self, on_call=None, check_inputs=None, topk=0):
    self.on_call = on_call  # e.g. advance a fake clock, as device time would
    self.check_inputs = check_inputs  # sees each call's StepInputs (e.g. which slots it writes)
    self.calls = []  # (rows, query tokens) of each call's real rows
    self.topk = topk

  def with_topk(self, k: int) -> 'FakeStep':
    """The beam-search variant: also returns each row's k candidates (as CompiledStep does)."""
    step = FakeStep(self.on_call, self.check_inputs, topk=k)
    step.calls = self.calls
    return step

  def __call__(self, params, pool, inputs):
    if self.on_call:
      self.on_call()
    if self.check_inputs:
      self.check_inputs(inputs)
    real = inputs.context_lens > 0
    self.calls.append((int(real.sum()), int((inputs.positions >= 0).sum())))
    last = inputs.tokens[np.arange(len(inputs.logits_index)), inputs.logits_index]
    tokens = np.asarray([next_token(t, n) for t, n in zip(last, inputs.context_lens)], np.int32)
    if not self.topk:
      return pool, tokens
    cands = [candidates(t, n, self.topk) for t, n in zip(last, inputs.context_lens)]
    return (pool, tokens, np.asarray([c[0] for c in cands], np.int32),
            np.asarray([c[1] for c in cands], np.float32))


def expected_outputs(prompt, max_new_tokens, max_seq_len):
  ids, out = list(prompt), []
  while len(out) < max_new_tokens and len(ids) < max_seq_len:
    ids.append(next_token(ids[-1], len(ids)))
    out.append(ids[-1])
  return out


class FakeClock:
  """A timer that only moves when told: each fake device call takes `step_s` seconds."""

  def __init__(self, step_s=1.0):
    self.now, self.step_s = 0.0, step_s

  def __call__(self):
    return self.now

  def tick(self):
    self.now += self.step_s


def fake_engine(clock=None, **kw) -> Engine:
  clock = clock or FakeClock()
  kw = {'block_size': 4, 'num_blocks': 17, 'max_batch_size': 4, 'prefill_chunk': 8,
        'step_fn': FakeStep(clock.tick), 'timer': clock, **kw}
  return build_engine(CFG, None, **kw)


def block_holders(engine) -> collections.Counter:
  """block -> how many sequences' block tables name it (a table may not name one twice)."""
  holders = collections.Counter()
  for seq in engine.running:
    assert len(set(seq.block_table)) == len(seq.block_table), seq.block_table
    holders.update(seq.block_table)
  return holders


def check_blocks(engine) -> None:
  """Reference counts equal holders (sequences; a cache entry is not a holder, see
  prefix_cache.py); free, evictable and held blocks partition the pool's non-null blocks."""
  alloc, cache = engine.allocator, engine.prefix_cache
  holders = block_holders(engine)
  for seq in engine.scheduler.waiting + engine.scheduler.swapped:
    assert not seq.block_table, (seq.request_id, seq.block_table)
  for seq in engine.running + engine.scheduler.waiting + engine.scheduler.swapped:
    for child in seq.forks:
      assert not child.block_table
  free = alloc.free_blocks()
  assert len(set(free)) == len(free), 'a block is on the free list twice'
  evictable = set(cache.evictable_blocks()) if cache else set()
  assert all(cache.is_cached(b) for b in evictable)
  for b in range(1, alloc.num_blocks):
    assert alloc.ref_count(b) == holders[b], (b, alloc.ref_count(b), holders[b])
  held = set(holders)
  assert not set(free) & held, 'a block is both free and held'
  assert not evictable & held and not set(free) & evictable
  assert set(free) | evictable | held == set(range(1, alloc.num_blocks)), 'a block leaked'
  assert 0 not in held, 'the null block was handed out'


def written_blocks(inputs, block_size):
  """Blocks a step's real query tokens write into."""
  real = inputs.positions >= 0
  return set((inputs.slot_mapping[real] // block_size).tolist())
