"""The simulated device: the real engine and host code, with the device replaced by a cost model.

`Engine(..., backend=SimulatedBackend(...), timer=backend.clock)` (or `simulated_engine`) runs
the engine's own scheduler, allocator, block manager, prefix caches, sharing, preemption and
host-tier bookkeeping unchanged. Only what executor.DEVICE would do on the device is replaced:

  pool      SimulatedPool: the pool's byte counts (pool.pool_bytes, the same scheme code as a
            real pool: scales and zero points included) and no arrays, so a Llama-3-70B engine
            allocates nothing. Its host stores are bookkeeping only (no block data is kept):
            the swap store, and the KV tiers' host RAM (config.tiers.host_blocks) over
            kv_tiers.ContentFreeLayout, whose demotions, finds, promotions, evictions and KV
            events are the real KVTiers' (tiering.build_tiers; a disk tier is refused).
  steps     each step call advances the clock by CostModel.step_time of the call's StepShape
            (the padded rows and tokens the real program would compute) and returns one token
            per sampling row: a fixed function of the row's seed, tokens generated so far and
            context (never the EOS id), so stopping follows each request's max_new_tokens, i.e.
            the trace's output lengths, and parallel samples differ as real ones do.
  transfers swap-out/in, the KV tiers' demotions (a gather) and promotions (a scatter), and
            copy-on-write copies advance the clock by the cost model's transfer times (bytes
            over the host link, or a read and a write in HBM), where the real engine makes the
            same calls on its critical path (executor.py: the gather before, the scatter after
            the iteration's copies, both before the steps; write-through's gather after them).
  host      each iteration adds CostModel.host_time(rows) to the clock: the time the Python host
            code takes on the target machine (calibrated on this one), since the simulator's own
            Python time is not the engine's clock.

The clock (`SimClock`) is the engine's timer: it moves only when the simulated device says so,
so a run's figures (TTFT, TPOT, throughput) are simulated seconds, and the same run gives the
same figures on any machine.

The engine's executor is the real PlanExecutor (pagedjax/executor.py): the same plan, the same
calls in the same order, the same shape buckets and top-K choice. `SimulatedDevice` is the
Device it runs them on (host/scheduling/device_api.py's protocol; no subclass of the executor):
it skips building the StepInputs (the largest host cost at thousands of rows per second) and
gives the cost model the StepShape those inputs would have. `SimulatedStep` has the jitted
step's interface (`step(params, pool, inputs) -> (pool, tokens)`) and can drive the real
JaxDevice instead: tests check the two agree call for call.
"""
import dataclasses
import math
from typing import Optional

import numpy as np

from pagedjax import sizing
from pagedjax.config import Config
from pagedjax.device import pool as pool_lib
from pagedjax.device.kv_schemes import KVQuantConfig, scheme_for
from pagedjax.engine import Engine
from pagedjax.executor import PlanExecutor
from pagedjax.host.scheduling.device_api import CallResult, StepCall
from pagedjax.model.llama import ModelConfig
from pagedjax.host.tiers import kv_tiers, tier_cost
from pagedjax.sim.cost_model import CostModel, StepShape, prefill_step
from pagedjax.sim.hardware import Hardware, get_hardware


class SimClock:
  """The engine's timer in a simulation: simulated seconds, moved only by `advance`.
  `slowdown` stretches every advance (1: the device alone; a simulated cluster whose replicas
  share one machine sets it per iteration, cluster/sim.py)."""

  def __init__(self):
    self.now = 0.0
    self.slowdown = 1.0

  def __call__(self) -> float:
    return self.now

  def advance(self, seconds: float) -> None:
    self.now += seconds * self.slowdown


# ---- tokens ---------------------------------------------------------------------------------

def sim_tokens(seeds, counters, contexts, vocab_size: int, eos_id: Optional[int]) -> np.ndarray:
  """One token per row: a fixed function of (seed, tokens generated, context), never eos_id."""
  mix = (np.asarray(seeds, np.int64) * 1_000_003 + np.asarray(counters, np.int64) * 7_919 +
         np.asarray(contexts, np.int64) * 104_729) % vocab_size
  if eos_id is not None:
    mix = np.where(mix == eos_id, (mix + 1) % vocab_size, mix)
  return mix.astype(np.int32)


def sim_candidates(tokens: np.ndarray, contexts, k: int, vocab_size: int):
  """Beam rows' k candidates: distinct ids, best first, log-probs that differ per row."""
  ids = (tokens[:, None].astype(np.int64) + 13 * np.arange(k)) % vocab_size
  logprobs = -0.5 * (np.arange(k) + 1) - 0.1 * (np.asarray(contexts)[:, None] % 5)
  return ids.astype(np.int32), logprobs.astype(np.float32)


# ---- pool -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SimulatedPool:
  """A pool's geometry and true byte counts, without arrays (the engine reads only these)."""
  model_cfg: ModelConfig
  num_blocks: int
  block_size: int
  spec: KVQuantConfig
  max_sequences: int

  def __post_init__(self):
    self.spec.validate(self.model_cfg.head_dim)

  @property
  def scheme(self):
    return scheme_for(self.spec)

  def _bytes(self, num_blocks, spec, lanes=0) -> int:
    m = self.model_cfg
    return pool_lib.pool_bytes(m.num_layers, num_blocks, m.num_kv_heads, self.block_size,
                               m.head_dim, spec, lanes)

  @property
  def nbytes(self) -> int:
    return self._bytes(self.num_blocks, self.spec, self.max_sequences)

  @property
  def bytes_per_token(self) -> float:
    """Bytes one block slot takes over all layers, scales included, per-lane arrays excluded:
    the scheme's own count, as KVPool.bytes_per_token's and sizing.py's."""
    m = self.model_cfg
    return self.scheme.bytes_per_token(m.num_layers, m.num_kv_heads, self.block_size,
                                       m.head_dim)

  def block_array_shapes(self) -> dict:
    """None: a simulated host tier stores no block contents, only its bookkeeping."""
    return {}

  @property
  def block_nbytes(self) -> int:
    """One block's bytes over every device (scales included): what a host tier stores of it."""
    return int(round(self.bytes_per_token * self.block_size))


# ---- step and device ------------------------------------------------------------------------

class SimulatedStep:
  """The jitted step's interface, run by the cost model: `step(params, pool, inputs)`."""
  return_logits = False
  num_compilations = 0

  def __init__(self, backend: 'SimulatedBackend', topk: int = 0):
    self.backend, self.topk = backend, topk
    self.calls = []  # the StepShape of every call, in order (with backend.record_shapes)

  def with_topk(self, k: int) -> 'SimulatedStep':
    step = SimulatedStep(self.backend, k)
    step.calls = self.calls
    return step

  def __call__(self, params, pool, inputs):
    del params
    b = self.backend
    shape = StepShape.from_inputs(inputs)
    if b.record_shapes:
      self.calls.append(shape)
    b.clock.advance(b.cost.step_time(shape))
    tokens = sim_tokens(inputs.seeds, inputs.counters, inputs.context_lens, b.vocab_size,
                        b.eos_id)
    if not self.topk:
      return pool, tokens
    return (pool, tokens, *sim_candidates(tokens, inputs.context_lens, self.topk, b.vocab_size))


class SimulatedDevice:
  """The Device protocol (host/scheduling/device_api.py) on a simulated clock: every call
  advances the backend's clock by the cost model's time for it and moves no data.

  Transfers (swap-out/in, and the KV tiers' demotions and promotions, whose stores hold no
  block contents) take the host link's time for their blocks (CostModel.swap_time: the call's
  overhead plus each device's share of the blocks over its own host link); copies a read and a
  write in HBM; a step the time of the StepShape its padded rows and tokens make, and its tokens
  (and a beam call's candidates) are sim_tokens' and sim_candidates'. Each iteration also
  charges the host code's time for its rows (CostModel.host_time)."""
  params = None
  step_fn = None
  record_logits = False  # a simulated step has no logits (SimulatedBackend.step refuses them)

  def __init__(self, backend: 'SimulatedBackend', pool: SimulatedPool):
    self.backend, self.pool = backend, pool
    self.shapes = []  # the StepShape of every step call, in order (with backend.record_shapes)

  def start_iteration(self, num_rows: int) -> None:
    self.backend.clock.advance(self.backend.cost.host_time(num_rows))

  def gather(self, blocks) -> dict:
    self.backend.clock.advance(self.backend.cost.swap_time(len(blocks)))
    return {}  # the pool's block_array_shapes(): a simulated store keeps no contents

  def scatter(self, blocks, data) -> None:
    del data
    self.backend.clock.advance(self.backend.cost.swap_time(len(blocks)))

  def copy(self, pairs) -> None:
    self.backend.clock.advance(self.backend.cost.copy_time(len(pairs)))

  def step(self, call: StepCall) -> CallResult:
    b, rows = self.backend, call.rows
    shape = StepShape.from_rows([(n, seq.num_cached + n) for seq, n in rows], call.num_rows,
                                call.num_tokens)
    if b.record_shapes:
      self.shapes.append(shape)
    b.clock.advance(b.cost.step_time(shape))
    contexts = shape.context_lens[:len(rows)]
    tokens = sim_tokens([s.params.seed for s, _ in rows], [len(s.output_ids) for s, _ in rows],
                        contexts, b.vocab_size, b.eos_id)
    cands = sim_candidates(tokens, contexts, call.topk, b.vocab_size) if call.topk else None
    return CallResult(rows, tokens, None, cands)


class SimulatedBackend:
  """What Engine(backend=...) builds the pool, executor and step from (executor.DEVICE is the
  real one): a SimulatedPool, the PlanExecutor on a SimulatedDevice, and a SimulatedStep. One
  backend per engine: it keeps that engine's clock and cost model."""

  def __init__(self, shape: sizing.ModelShape, hardware, *, tp: int = 1,
               weight_dtype: str = 'bf16', activation_dtype: str = 'bf16',
               eos_id: Optional[int] = None, clock: Optional[SimClock] = None,
               count_padding: bool = True, record_shapes: bool = False):
    """count_padding: see CostModel (False projects a server that computes no padding).
    record_shapes: keep every step call's StepShape (tests; a long trace makes millions)."""
    self.shape, self.hardware = shape, get_hardware(hardware)
    self.count_padding, self.record_shapes = count_padding, record_shapes
    self.tp, self.weight_dtype, self.activation_dtype = tp, weight_dtype, activation_dtype
    self.eos_id = eos_id
    self.clock = clock or SimClock()
    self.cost: Optional[CostModel] = None  # made with the pool: it needs the pool's KV bytes
    self.vocab_size = shape.vocab_size
    self.pool: Optional[SimulatedPool] = None

  def init_model_pool(self, model_cfg, num_blocks, block_size, kv_quant, max_sequences,
                      mesh=None) -> SimulatedPool:
    del mesh  # the cost model splits over `tp` devices itself
    self.pool = SimulatedPool(model_cfg, num_blocks, block_size, kv_quant, max_sequences)
    self.vocab_size = model_cfg.vocab_size
    self.cost = CostModel(self.shape, self.hardware, kv_bytes_per_token=self.pool.bytes_per_token,
                          block_size=block_size, tp=self.tp, weight_dtype=self.weight_dtype,
                          activation_dtype=self.activation_dtype,
                          count_padding=self.count_padding)
    return self.pool

  def executor(self, params, pool, step_fn, blocks, **kwargs) -> PlanExecutor:
    """The real executor, on this backend's SimulatedDevice (step_fn, a SimulatedStep, is not
    called: the device times the calls itself)."""
    del params, step_fn
    return PlanExecutor(None, pool, None, blocks, device=SimulatedDevice(self, pool), **kwargs)

  def preemption_cost(self, t, executor) -> tier_cost.TierCosts:
    """The figures preemption weighs (host/tiers/tier_cost.py), from this cost model rather than
    measured: seconds per token of a full prefill call at the executor's largest shape, and the
    host link's bandwidth and per-transfer overhead; config.tiers' non-zero figures win."""
    rows, chunk = executor.batch_buckets[-1], executor.token_buckets[-1]
    prefill = self.cost.step_time(prefill_step([chunk] * rows, chunk)) / (rows * chunk)
    host = (t.host_bytes_per_s or self.hardware.host_link_bandwidth,
            t.host_latency_s or self.cost.eff.step_overhead_s)
    return tier_cost.TierCosts.for_tiers(self.pool.block_size, self.cost.block_bytes,
                                         t.prefill_s_per_token or prefill, host,
                                         (math.inf, math.inf))

  def tier_layout(self, t, executor) -> kv_tiers.ContentFreeLayout:
    """The KV tiers' block layout (tiering.build_tiers): the pool's block size, no contents;
    host-RAM tiers only."""
    del executor
    if t.disk_blocks:
      raise ValueError(f'tiers.disk_blocks={t.disk_blocks} is not allowed on a simulated device: '
                       '0 (a simulated pool has host-RAM tiers only; its disk tier would need a '
                       'content-free disk store)')
    return kv_tiers.ContentFreeLayout(self.pool.block_nbytes)

  def tier_costs(self, t, executor, layout, disk) -> tier_cost.TierCosts:
    """The KV tiers' promotion figures (tiers.promotion='auto'): preemption_cost's, the ones
    the device charges a promotion's scatter (CostModel.swap_time: host_latency_s is the
    call's overhead, host_bytes_per_s the host link's, per device; config.tiers' non-zero
    figures win, as the real engine's)."""
    del layout, disk  # no disk tier here (tier_layout)
    return self.preemption_cost(t, executor)

  def step(self, model_cfg, attention_impl=None, return_logits=False,
           linear_impl=None) -> SimulatedStep:
    del model_cfg, attention_impl, linear_impl  # the cost model times the step
    if return_logits:
      raise ValueError('a simulated step has no logits to record (record_logits=False)')
    return SimulatedStep(self)


# ---- building simulated engines -------------------------------------------------------------

def model_config(shape: sizing.ModelShape, dtype: str = 'bfloat16',
                 max_seq_len: int = 0) -> ModelConfig:
  """The engine's view of a sizing preset: vocabulary, context and the pool's dimensions (OPT's
  ReLU MLP and LayerNorm matter to the cost model only, which reads the ModelShape itself)."""
  return ModelConfig(vocab_size=shape.vocab_size, d_model=shape.d_model,
                     num_layers=shape.num_layers, num_heads=shape.num_heads,
                     num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                     ffn_dim=shape.ffn_dim, max_seq_len=max_seq_len or shape.max_seq_len or 8192,
                     tie_embeddings=shape.tie_embeddings, dtype=dtype)


def activation_reserve_bytes(shape: sizing.ModelShape, *, tp: int, max_tokens: int,
                             max_rows: int, activation_dtype: str = 'bf16') -> int:
  """Device memory kept for one step's activations (vLLM measures it with a profiling run; this
  estimates it): the largest step's hidden states, q/k/v and MLP hidden per token, and the
  float32 logits and their softmax per row."""
  abytes = sizing.DTYPE_BITS[sizing.canonical_dtype(activation_dtype)] / 8
  hkv = sizing.kv_heads_per_device(shape, tp)
  per_token = 4 * shape.d_model + (shape.num_heads // tp + 2 * hkv) * shape.head_dim + (
      2 * shape.ffn_dim // tp)
  return int(max_tokens * per_token * abytes + 2 * max_rows * math.ceil(
      shape.vocab_size / tp) * 4)


def plan_pool(shape: sizing.ModelShape, hardware: Hardware, *, block_size: int,
              kv_quant: KVQuantConfig, tp: int = 1, max_tokens: int, max_rows: int,
              weight_dtype: str = 'bf16', activation_dtype: str = 'bf16',
              memory_fraction: float = 0.9) -> dict:
  """How many blocks fit one device's HBM: memory_fraction of it (vLLM's gpu_memory_utilization,
  default 0.9), less the weights (sizing.param_breakdown) and the activation reserve of a step
  of max_tokens query tokens and max_rows rows, over the bytes one block takes on one device in
  the pool's scheme (pool_bytes: scales included)."""
  kv_quant.validate(shape.head_dim)
  hkv = sizing.kv_heads_per_device(shape, tp)
  block_all = scheme_for(kv_quant).bytes_per_token(shape.num_layers, shape.num_kv_heads,
                                                    block_size, shape.head_dim) * block_size
  block_dev = block_all * hkv / shape.num_kv_heads
  weights = sizing.param_breakdown(shape, tp)['total'] * sizing.DTYPE_BITS[
      sizing.canonical_dtype(weight_dtype)] / 8
  reserve = activation_reserve_bytes(shape, tp=tp, max_tokens=max_tokens, max_rows=max_rows,
                                     activation_dtype=activation_dtype)
  budget = hardware.hbm_bytes * memory_fraction - weights - reserve
  num_blocks = int(budget // block_dev) + 1 if budget > 0 else 0  # + the null block
  return {'num_blocks': num_blocks, 'kv_block_bytes_per_device': block_dev,
          'kv_bytes_per_token': block_all / block_size,
          'kv_bytes_per_token_per_device': block_dev / block_size,
          'weight_bytes_per_device': weights, 'activation_reserve_bytes': reserve,
          'kv_budget_bytes_per_device': max(0.0, budget),
          'hbm_bytes': hardware.hbm_bytes, 'memory_fraction': memory_fraction}


def activation_dtype_name(name: str) -> str:
  """sizing's dtype names ('bf16') as the model's ('bfloat16')."""
  return {'fp32': 'float32', 'bf16': 'bfloat16', 'fp16': 'float16'}[sizing.canonical_dtype(name)]


def simulated_engine(shape: sizing.ModelShape, hardware, config: Config, *,
                     weight_dtype: str = 'bf16', activation_dtype: str = 'bf16',
                     eos_id: Optional[int] = None, count_padding: bool = True) -> Engine:
  """An engine of the real host code on a simulated device; tp is config.mesh.model.

  The engine's model config has the preset's dimensions and `activation_dtype` as its dtype, so
  pool.kv_dtype='auto' stores K/V in that dtype. config.pool.num_blocks is used as given
  (plan_pool computes how many fit the hardware's memory).
  """
  dtype = activation_dtype_name(activation_dtype)
  backend = SimulatedBackend(shape, hardware, tp=config.mesh.model, weight_dtype=weight_dtype,
                             activation_dtype=activation_dtype, eos_id=eos_id,
                             count_padding=count_padding)
  cfg = model_config(shape, dtype, config.engine.max_seq_len)
  return Engine(cfg, None, config, timer=backend.clock, backend=backend, eos_id=eos_id)
