"""The jitted step: run the model over a bucketed batch, write K/V into the pool, sample.

One pure function serves chunked prefill (T > 1 query tokens per row) and decode (T = 1):
the new tokens' K/V are scattered into their slots first, then each query attends over its
sequence's blocks up to its own position, so a prefill chunk sees the cached prefix plus the
causal part of itself. The pool is donated, so XLA updates it in place. Only the sampled token
ids (and, when asked for, the sampled rows' logits) come back to the host. A step built with
`return_topk=K` (`with_topk`, for beam search, beam.py) also returns each row's K best token ids
and their log-probs: a separate program with a static K, so the default step is unchanged.

With a mesh (tensor parallelism, pagedjax/sharding.py) the step is the same function: params and
pool arrive sharded, and the returned pool is pinned to the pool's sharding so the donated buffers
are reused in place and the next call sees the same input shardings (no copy, no recompile).
"""
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from pagedjax.device import traces
from pagedjax.model import sharding
from pagedjax.model.llama import Llama, ModelConfig
from pagedjax.device.pool import KVPool
from pagedjax.device.sampling import sample


class CompiledStep:
  """`step(params, pool, inputs) -> (pool, tokens[, logits][, topk_ids, topk_logprobs])`,
  counting its compilations.

  `inputs` is the host's StepInputs (pagedjax/host/step_inputs.py), a NamedTuple of bucketed
  numpy arrays. A trace happens exactly when jit meets a new input shape signature; traces are
  counted per step object and process-wide (traces.py), which the engine reports.
  """

  def __init__(self, cfg: ModelConfig, attention_impl: str = 'reference',
               return_logits: bool = False, mesh: Optional[Mesh] = None,
               return_topk: int = 0):
    """mesh: run tensor-parallel on it; cfg must then be the sharded model's (sharding.py).
    return_topk: K > 0 also returns [B, K] token ids (int32) and log-probs (float32)."""
    self.num_compilations = 0
    self.return_logits = return_logits
    self.return_topk = return_topk
    self.mesh = mesh
    self._args = (cfg, attention_impl, return_logits, mesh)
    self._topk_steps = {}
    model = Llama(cfg, attention_impl, mesh)

    def step(params, pool: KVPool, inputs):
      self.num_compilations += 1  # runs at trace time only
      traces.record()
      logits, pool = model.apply(params, inputs.tokens, inputs.positions, pool, inputs,
                                 logits_index=inputs.logits_index)
      tokens = sample(logits, inputs.temperature, inputs.top_k, inputs.top_p, inputs.seeds,
                      inputs.counters)
      topk = ()
      if return_topk:
        topk_logprobs, topk_ids = jax.lax.top_k(
            jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), return_topk)
        topk = (topk_ids.astype(jnp.int32), topk_logprobs)
      if mesh is not None:
        pool = jax.lax.with_sharding_constraint(pool, sharding.pool_sharding(mesh))
        # Replicated outputs: the host reads one local copy instead of gathering shards, and a
        # process of a multi-host mesh can read them at all (it holds no other devices' shards).
        replicated = NamedSharding(mesh, sharding.REPLICATED)
        tokens, logits, topk = jax.lax.with_sharding_constraint((tokens, logits, topk),
                                                                replicated)
      return ((pool, tokens, logits) if return_logits else (pool, tokens)) + topk

    self._jitted = jax.jit(step, donate_argnums=(1,))

  def with_topk(self, k: int) -> 'CompiledStep':
    """The same step also returning each row's top-k (built once per k, then reused)."""
    if k not in self._topk_steps:
      self._topk_steps[k] = CompiledStep(*self._args, return_topk=k)
    return self._topk_steps[k]

  @property
  def num_topk_compilations(self) -> int:
    return sum(s.num_compilations for s in self._topk_steps.values())

  def __call__(self, params, pool, inputs):
    return self._jitted(params, pool, inputs)
