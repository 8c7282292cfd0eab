"""The jitted step: run the model over a bucketed batch, write K/V into the pool, sample.

One pure function serves chunked prefill (T > 1 query tokens per row) and decode (T = 1):
the new tokens' K/V are scattered into their slots first, then each query attends over its
sequence's blocks up to its own position, so a prefill chunk sees the cached prefix plus the
causal part of itself. The pool is donated, so XLA updates it in place. Only the sampled token
ids (and, when asked for, the sampled rows' logits) come back to the host. A step built with
`return_topk=K` (`with_topk`, for beam search, beam.py) also returns each row's K best token ids
and their log-probs: a separate program with a static K, so the default step is unchanged.

With a mesh (tensor parallelism, pagedjax/model/sharding.py) the step is the same function:
params and pool arrive sharded, and the returned pool is pinned to the pool's sharding so the
donated buffers are reused in place and the next call sees the same input shardings (no copy, no recompile).

Decode calls (one query token per row) can run the model's layers unrolled instead of under its
layer scan (`decode_layers`, llama.py's `layer_loop`). Under the scan each iteration reads its
layer as a slice of the stacked weight arrays, and XLA:CPU materialises that slice as a copy: a
decode step copies the whole model's weights (~370 MB for SmolLM2-135M in float32) to do a
few rows of matmul with them. Unrolled, the params are split per layer once (views of the same
buffers on CPU, no copy) and each layer's dots read its weights in place. The copy is a fixed
cost per call, so it matters where a call does little work per weight: every decode call
('auto', from AUTO_UNROLLED_MIN_ROWS rows), on one CPU device. Even at one row, where the copy
might overlap the memory-bound dots on a spare core, it does not: the 1-row step is slower under
the scan (docs/decode_speed.md). Prefill chunks share the copy over many tokens and keep the
scan, which compiles several times faster. Each input shape compiles exactly once, in one of
the two programs, and both give the same logits bit for bit. Measured step times for both
programs: docs/decode_speed.md.
"""
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from pagedjax.device import traces
from pagedjax.model import sharding
from pagedjax.kernels import linear_cpu
from pagedjax.model.llama import Llama, ModelConfig, per_layer_params
from pagedjax.device.pool import KVPool
from pagedjax.device.sampling import sample, top_candidates


DECODE_LAYERS = ('auto', 'scan', 'unrolled')  # CompiledStep(decode_layers=...)
AUTO_UNROLLED_MIN_ROWS = 1  # 'auto': decode calls of this many rows and more run unrolled


def unrolled_min_rows(decode_layers: str, mesh: Optional[Mesh]) -> Optional[int]:
  """Decode calls with at least this many rows run the layers unrolled; None = never.
  'auto' unrolls only on a single CPU device: accelerators read a layer's slice of the stacked
  weights in place, and the mesh path keeps one program."""
  if decode_layers not in DECODE_LAYERS:
    raise ValueError(f'decode_layers={decode_layers!r} is not allowed: one of {DECODE_LAYERS}')
  if decode_layers == 'scan':
    return None
  if decode_layers == 'unrolled':
    return 1
  on_one_cpu = mesh is None and jax.default_backend() == 'cpu'
  return AUTO_UNROLLED_MIN_ROWS if on_one_cpu else None


class _PerLayerParams:
  """per_layer_params of the params objects last passed in, made once each. A step and its
  top-k variants share one. Keeps the last KEEP objects (a step shared by engines of different
  models); each entry holds its params object, so its id cannot be reused while cached."""
  KEEP = 2

  def __init__(self, pack: bool = False):
    self.pack = pack  # Dense kernels as packed copies (linear_impl='cpu_packed')
    self._entries = []  # [(params, per-layer params)], newest last

  def __call__(self, params):
    for stacked, split in self._entries:
      if stacked is params:
        return split
    split = per_layer_params(params, pack=self.pack)
    self._entries = self._entries[-(self.KEEP - 1):] + [(params, split)]
    return split


class CompiledStep:
  """`step(params, pool, inputs) -> (pool, tokens[, logits][, topk_ids, topk_logprobs])`,
  counting its compilations.

  `inputs` is the host's StepInputs (pagedjax/host/scheduling/step_inputs.py), a NamedTuple of bucketed
  numpy arrays. A trace happens exactly when jit meets a new input shape signature; traces are
  counted per step object and process-wide (traces.py), which the engine reports.
  """

  def __init__(self, cfg: ModelConfig, attention_impl: str = 'reference',
               return_logits: bool = False, mesh: Optional[Mesh] = None,
               return_topk: int = 0, decode_layers: str = 'auto', linear_impl: str = 'auto',
               _per_layer: Optional[_PerLayerParams] = None):
    """mesh: run tensor-parallel on it; cfg must then be the sharded model's (sharding.py).
    return_topk: K > 0 also returns [B, K] token ids (int32) and log-probs (float32).
    decode_layers: how decode calls run the layers (DECODE_LAYERS, unrolled_min_rows).
    linear_impl: how the linear layers multiply (llama.LINEAR_IMPLS: 'auto' = the native CPU
    kernel for decode-sized calls on CPU, kernels/linear_cpu.py)."""
    self.num_compilations = 0
    self.return_logits = return_logits
    self.return_topk = return_topk
    self.mesh = mesh
    self.decode_layers = decode_layers
    self.linear_impl = linear_impl
    self.unrolled_min_rows = unrolled_min_rows(decode_layers, mesh)
    self._args = (cfg, attention_impl, return_logits, mesh)
    self._topk_steps = {}
    self._per_layer = _per_layer or _PerLayerParams(
        pack=mesh is None and linear_cpu.packs(linear_impl))

    def make_step(model):
      def step(params, pool: KVPool, inputs):
        self.num_compilations += 1  # runs at trace time only
        traces.record()
        return run_model(model, params, pool, inputs)
      return jax.jit(step, donate_argnums=(1,))

    def run_model(model, params, pool, inputs):
      logits, pool = model.apply(params, inputs.tokens, inputs.positions, pool, inputs,
                                 logits_index=inputs.logits_index)
      tokens = sample(logits, inputs.temperature, inputs.top_k, inputs.top_p, inputs.seeds,
                      inputs.counters)
      topk = top_candidates(logits, return_topk) if return_topk else ()
      if mesh is not None:
        pool = jax.lax.with_sharding_constraint(pool, sharding.pool_sharding(mesh))
        # Replicated outputs: the host reads one local copy instead of gathering shards, and a
        # process of a multi-host mesh can read them at all (it holds no other devices' shards).
        replicated = NamedSharding(mesh, sharding.REPLICATED)
        tokens, logits, topk = jax.lax.with_sharding_constraint((tokens, logits, topk),
                                                                replicated)
      return ((pool, tokens, logits) if return_logits else (pool, tokens)) + topk

    self._jitted = make_step(Llama(cfg, attention_impl, mesh, linear_impl=linear_impl))
    self._jitted_unrolled = (
        None if self.unrolled_min_rows is None else
        make_step(Llama(cfg, attention_impl, mesh, layer_loop='unrolled',
                        linear_impl=linear_impl)))

  def with_topk(self, k: int) -> 'CompiledStep':
    """The same step also returning each row's top-k (built once per k, then reused)."""
    if k not in self._topk_steps:
      self._topk_steps[k] = CompiledStep(*self._args, return_topk=k,
                                         decode_layers=self.decode_layers,
                                         linear_impl=self.linear_impl,
                                         _per_layer=self._per_layer)
    return self._topk_steps[k]

  @property
  def num_topk_compilations(self) -> int:
    return sum(s.num_compilations for s in self._topk_steps.values())

  def runs_unrolled(self, inputs) -> bool:
    """Whether a call with these StepInputs runs the unrolled program."""
    rows, tokens = inputs.tokens.shape
    return (self.unrolled_min_rows is not None and tokens == 1
            and rows >= self.unrolled_min_rows)

  def program_for(self, params, pool, inputs) -> tuple:
    """(the jitted program a call with these arguments runs, the arguments it takes): the
    unrolled program with the per-layer params for a decode call of enough rows, else the
    scanned one. What __call__ runs; a caller that lowers or compiles the program itself
    (experiments/profile_decode.py) asks here."""
    if self.runs_unrolled(inputs):
      return self._jitted_unrolled, (self._per_layer(params), pool, inputs)
    return self._jitted, (params, pool, inputs)

  def __call__(self, params, pool, inputs):
    program, args = self.program_for(params, pool, inputs)
    return program(*args)
