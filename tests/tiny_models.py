"""Tiny random Llamas and their compiled steps, shared by every test file in the session.

Each compile of a step costs ~1 s on a 2-core CPU, so engines of one model share a CompiledStep.
"""
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine import Engine
from pagedjax.model import ModelConfig, forward_dense, init_params
from pagedjax.steps import CompiledStep

VOCAB = 97
HEADS = {'mha': (4, 4), 'gqa': (4, 2), 'mqa': (4, 1)}


@functools.lru_cache(maxsize=None)
def tiny(kind='gqa'):
  """(cfg, params, CompiledStep returning logits) for one attention kind."""
  heads, kv_heads = HEADS[kind]
  cfg = ModelConfig(vocab_size=VOCAB, d_model=48, num_layers=2, num_heads=heads,
                    num_kv_heads=kv_heads, head_dim=12, ffn_dim=96, max_seq_len=512)
  return cfg, init_params(cfg, seed=1), CompiledStep(cfg, return_logits=True)


@functools.lru_cache(maxsize=None)
def dense_fn(kind='gqa'):
  cfg, params, _ = tiny(kind)
  return jax.jit(lambda tokens: forward_dense(cfg, params, tokens))


def make_engine(kind='gqa', **kw) -> Engine:
  cfg, params, step = tiny(kind)
  kw = {'block_size': 16, 'num_blocks': 64, 'max_batch_size': 4, 'prefill_chunk': 16,
        'step_fn': step, **kw}
  return Engine(cfg, params, **kw)


def prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def dense_logits(kind, completion):
  """Dense no-cache logits at every position that produced a generated token."""
  ids = completion.prompt_ids + completion.output_ids
  logits = np.asarray(dense_fn(kind)(jnp.asarray([ids]))[0])
  start = len(completion.prompt_ids) - 1
  return logits[start:start + len(completion.output_ids)]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_experiment(module: str, *flags: str) -> subprocess.CompletedProcess:
  """`python -m module flags...` from the repo root, in its own process (experiments' absl flags
  would clash inside the test process)."""
  return subprocess.run([sys.executable, '-m', module, *flags], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, check=False)
