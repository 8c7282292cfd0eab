"""A model-free stand-in for CompiledStep, for tests of scheduling and metrics.

No model and no compilation, so property tests can run hundreds of engine iterations in
seconds. The 'sampled' token is a fixed function of the last fed token and its position, so a
request's outputs do not depend on batching, chunking or preemption (as greedy decoding of a
real model does not): `expected_outputs` predicts them without an engine.
"""
import numpy as np

from pagedjax.engine import Engine
from pagedjax.model import ModelConfig

VOCAB = 97
CFG = ModelConfig(vocab_size=VOCAB, d_model=8, num_layers=1, num_heads=1, num_kv_heads=1,
                  head_dim=2, ffn_dim=8, max_seq_len=4096)


def next_token(last: int, length: int) -> int:
  return (last * 31 + length * 7 + 3) % VOCAB


class FakeStep:
  return_logits = False
  num_compilations = 0

  def __init__(self, on_call=None):
    self.on_call = on_call  # e.g. advance a fake clock, as device time would
    self.calls = []  # (rows, query tokens) of each call's real rows

  def __call__(self, params, pool, inputs):
    if self.on_call:
      self.on_call()
    real = inputs.context_lens > 0
    self.calls.append((int(real.sum()), int((inputs.positions >= 0).sum())))
    last = inputs.tokens[np.arange(len(inputs.logits_index)), inputs.logits_index]
    return pool, np.asarray([next_token(t, n) for t, n in zip(last, inputs.context_lens)],
                            np.int32)


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
  return Engine(CFG, None, **kw)
