"""Teacher-forced scoring through the real paged cache: perplexity and logit drift per position.

Text is fed in prefill chunks exactly as the engine feeds prompts: each chunk's K/V are written
into the pool (quantized, if the pool is) and its queries attend over what the pool holds. So a
quantized pool's perplexity measures the cache the decode loop would really read, not a
simulation. Two pools run in lockstep (a reference scheme and the scheme under test) so logits
can be compared position by position without storing [tokens, vocab] arrays.
"""
import dataclasses
import math
from typing import Dict, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.device import pool as pool_lib
from pagedjax.model.llama import Llama, ModelConfig
from pagedjax.device.kv_schemes import KVQuantConfig
from pagedjax.host.scheduling.step_inputs import RowSpec, build_step_inputs


class ChunkScorer:
  """`(params, pool, inputs, targets) -> (pool, logits [B, T, V])`, jitted once per shape."""

  def __init__(self, cfg: ModelConfig, attention_impl: str = 'reference'):
    model = Llama(cfg, attention_impl)

    def run(params, pool, inputs):
      logits, pool = model.apply(params, inputs.tokens, inputs.positions, pool, inputs)
      return pool, logits

    self._jitted = jax.jit(run, donate_argnums=(1,))

  def __call__(self, params, pool, inputs):
    return self._jitted(params, pool, inputs)


@jax.jit
def _compare(logits, ref_logits, targets, mask):
  """Per position: NLL under both, top-1 agreement, mean |logit error| over the vocabulary."""
  nll = lambda lg: -jnp.take_along_axis(jax.nn.log_softmax(lg), targets[..., None], -1)[..., 0]
  agree = jnp.argmax(logits, -1) == jnp.argmax(ref_logits, -1)
  err = jnp.mean(jnp.abs(logits - ref_logits), -1)
  return nll(logits) * mask, nll(ref_logits) * mask, agree & (mask > 0), err * mask


@dataclasses.dataclass
class ScoreResult:
  nll: np.ndarray        # [B, S-1] scheme under test, per predicted position
  ref_nll: np.ndarray    # [B, S-1] reference scheme
  agree: np.ndarray      # [B, S-1] top-1 (greedy) agreement with the reference
  logit_err: np.ndarray  # [B, S-1] mean |logit - reference logit|

  def perplexity(self, upto: int, ref: bool = False) -> float:
    """Perplexity over the first `upto` predicted tokens of every sequence."""
    nll = self.ref_nll if ref else self.nll
    return math.exp(float(nll[:, :upto].mean()))

  def error_by_position(self, num_buckets: int = 8) -> Dict[str, float]:
    """Mean logit error over equal position ranges: does error compound with length?"""
    edges = np.linspace(0, self.logit_err.shape[1], num_buckets + 1).astype(int)
    return {f'{a}-{b}': float(self.logit_err[:, a:b].mean()) for a, b in zip(edges, edges[1:])}


def score(cfg: ModelConfig, params, sequences: Sequence[Sequence[int]], kv_quant: KVQuantConfig,
          ref_quant: KVQuantConfig, *, block_size: int = 16, chunk: int = 256,
          scorer: ChunkScorer = None) -> ScoreResult:
  """Score equal-length token sequences with the pool stored as `kv_quant` vs `ref_quant`."""
  tokens = np.asarray(sequences, np.int32)
  num_seqs, length = tokens.shape
  blocks_per_seq = -(-length // block_size)
  num_blocks = num_seqs * blocks_per_seq + 1
  # Interleave sequences' blocks, so physical order differs from logical order.
  tables = [[1 + b * num_seqs + s for b in range(blocks_per_seq)] for s in range(num_seqs)]
  scorer = scorer or ChunkScorer(cfg)
  make = lambda q: pool_lib.init_pool(cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size,
                                      cfg.head_dim, kv_quant=q, max_sequences=num_seqs)
  pools = [make(kv_quant), make(ref_quant)]
  width = [blocks_per_seq]
  outputs = []
  for start in range(0, length - 1, chunk):
    stop = min(start + chunk, length - 1)  # the last token is only a target
    rows = [RowSpec(tokens[s, start:stop].tolist(), start, tables[s], lane=s + 1)
            for s in range(num_seqs)]
    inputs = build_step_inputs(rows, block_size, [num_seqs], [chunk], width)
    logits = []
    for i, pool in enumerate(pools):
      pools[i], lg = scorer(params, pool, inputs)
      logits.append(lg)
    t = inputs.tokens.shape[1]
    targets = np.zeros((num_seqs, t), np.int32)
    targets[:, :stop - start] = tokens[:, start + 1:stop + 1]
    mask = np.zeros((num_seqs, t), np.float32)
    mask[:, :stop - start] = 1
    outputs.append([np.asarray(x)[:, :stop - start] for x in
                    _compare(logits[0], logits[1], targets, mask)])
  nll, ref_nll, agree, err = (np.concatenate(parts, axis=1) for parts in zip(*outputs))
  return ScoreResult(nll, ref_nll, agree, err)
