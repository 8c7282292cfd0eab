"""Tiny random Llamas and their compiled steps, shared by every test file in the session.

Each compile of a step costs ~1 s on a 2-core CPU, so engines of one model share a CompiledStep.
"""
import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.config import Config
from pagedjax.engine import Engine
from pagedjax.model.llama import ModelConfig, forward_dense, init_params
from pagedjax.model.step import CompiledStep

VOCAB = 97
HEADS = {'mha': (4, 4), 'gqa': (4, 2), 'mqa': (4, 1)}


def tiny_config(kind='gqa') -> ModelConfig:
  """The tiny model's config for one attention kind (no params: cheap at collection time)."""
  heads, kv_heads = HEADS[kind]
  return ModelConfig(vocab_size=VOCAB, d_model=48, num_layers=2, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=12, ffn_dim=96, max_seq_len=512)


@functools.lru_cache(maxsize=None)
def tiny(kind='gqa'):
  """(cfg, params, CompiledStep returning logits) for one attention kind."""
  cfg = tiny_config(kind)
  return cfg, init_params(cfg, seed=1), CompiledStep(cfg, return_logits=True)


@functools.lru_cache(maxsize=None)
def dense_fn(kind='gqa'):
  """tokens [B, T] -> dense no-cache logits [B, T, V]. The sequence is padded to a power of two
  (64 at least: the tests' sequences are mostly shorter) before the jitted forward, so that
  the tests' many lengths share one or two programs; attention is causal, so the padding after position T - 1 changes none of the
  logits returned."""
  cfg, params, _ = tiny(kind)
  forward = jax.jit(lambda tokens: forward_dense(cfg, params, tokens))

  def logits(tokens):
    length = tokens.shape[1]
    padded = min(max(64, 1 << (length - 1).bit_length()), cfg.max_seq_len)
    tokens = np.pad(np.asarray(tokens, np.int32), ((0, 0), (0, padded - length)))
    return np.asarray(forward(tokens))[:, :length]  # numpy: no per-length slice to compile
  return logits


# Test engines name their settings flat; each maps to one field of the typed config.
CONFIG_FIELDS = {
    'block_size': ('pool', 'block_size'), 'num_blocks': ('pool', 'num_blocks'),
    'kv_dtype': ('pool', 'kv_dtype'), 'pool_kind': ('pool', 'kind'),
    'max_batch_size': ('engine', 'max_batch_size'), 'prefill_chunk': ('engine', 'prefill_chunk'),
    'max_seq_len': ('engine', 'max_seq_len'), 'decode_min_rows': ('engine', 'decode_min_rows'),
    'attention_impl': ('attention', 'impl'),
    'preemption': ('scheduler', 'preemption'), 'watermark': ('scheduler', 'watermark'),
    'max_num_batched_tokens': ('scheduler', 'max_num_batched_tokens'),
    'swap_blocks': ('scheduler', 'swap_blocks'), 'prefix_caching': ('prefix_cache', 'enabled'),
    'prefix_cache_design': ('prefix_cache', 'design'),
    'prefix_cache_eviction': ('prefix_cache', 'eviction'),
    'session_idle_s': ('prefix_cache', 'session_idle_s'),
    'victim': ('scheduler', 'victim'), 'admission': ('scheduler', 'admission'),
    'admission_horizon': ('scheduler', 'admission_horizon'),
    'prefill_s_per_token': ('tiers', 'prefill_s_per_token'),
    'host_bytes_per_s': ('tiers', 'host_bytes_per_s'),
    'host_latency_s': ('tiers', 'host_latency_s'),
}


def engine_config(model_cfg, kv_quant=None, **flat) -> tuple:
  """(Config, remaining Engine keywords) from flat test settings. Tests default to the reference
  attention path and the model's own max_seq_len; kv_quant (a KVQuantConfig) sets the pool's
  kv_* fields."""
  sections = {}
  flat = {'attention_impl': 'reference', 'max_seq_len': model_cfg.max_seq_len, **flat}
  if kv_quant is not None:
    sections['pool'] = dict(kv_dtype=kv_quant.kv_dtype, kv_group_size=kv_quant.group_size,
                            kv_key_per_channel=kv_quant.key_per_channel,
                            kv_recent_window=kv_quant.recent_window)
  rest = {}
  for name, value in flat.items():
    if name not in CONFIG_FIELDS:
      rest[name] = value
      continue
    section, field = CONFIG_FIELDS[name]
    sections.setdefault(section, {})[field] = 0 if value is None else value
  base = Config()
  config = dataclasses.replace(base, **{
      name: dataclasses.replace(getattr(base, name), **fields) for name, fields in sections.items()})
  return config, rest


def build_engine(model_cfg, params, **flat) -> Engine:
  config, rest = engine_config(model_cfg, **flat)
  return Engine(model_cfg, params, config, **rest)


def make_engine(kind='gqa', **kw) -> Engine:
  cfg, params, step = tiny(kind)
  kw = {'block_size': 16, 'num_blocks': 64, 'max_batch_size': 4, 'prefill_chunk': 16,
        'step_fn': step, **kw}
  return build_engine(cfg, params, **kw)


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
