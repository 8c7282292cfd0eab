"""How long one device call takes, from what it computes and reads: a roofline per op class.

One engine iteration makes at most two step calls (prompt chunks, then decodes; executor.py) and
a few block transfers. A step call is described by its `StepShape`: the padded rows and query
tokens the jitted program really computes (the engine pads rows to powers of two and prompt
chunks to a whole chunk, and a dense matmul computes the padding too), and per row the new
tokens and the context attention reads. Per call, on ONE device of a tp-way split:

  op class     FLOPs                                  bytes moved
  linear       2 x padded tokens x projection+MLP     those weights, once; activations in/out
               params per device
  head         2 x rows x d_model x vocab/tp          the head's weights; the logits
  attention    4 x query heads/tp x head_dim x        every row's context x KV bytes per token
               layers x (query, key) pairs            per device (the scheme's true size,
                                                      scales included); the new K/V written
  elementwise  -                                      norms, residuals, RoPE, SwiGLU product:
                                                      ~10 d + 2 (Hq+Hkv) Dh + 3 ffn values per
                                                      token and layer
  time(class) = max(FLOPs / (peak x eff_flops), bytes / (bandwidth x eff_bytes))

plus, with tp > 1, two all-reduces of the activations per layer and an all-gather of the logits
over the interconnect (ring: 2 (tp-1)/tp of the bytes each way; no overlap with compute assumed),
plus fixed overheads per call and per layer, and one more per prompt-chunk call (calls with more
than one query token per row; `chunk_overhead_s`: on the CPU its small-M matmuls fall short of
the rate one matmul efficiency fits, and sharing one constant with decode calls biased those).
Host time between steps (the Python scheduler, block bookkeeping) is `host_time`: per
iteration plus per row. Block transfers: a swap moves blocks x block bytes per device over the
host link; a copy-on-write copy reads and writes them in HBM. The efficiencies and overheads are the hardware's (hardware.py): fitted by --calibrate
on the machine that runs, assumed for the accelerator presets.

Attention's pairs depend on the kernel: GPU/TPU kernels read each row's own context
(`per_row`); this CPU's xla kernel walks each of its batch loops (kernels/xla_loops.py: two
halves, or one loop for decode batches under 64 rows) to the loop's longest context, every
padded query row and padded row included (`batch_max`).
"""
import dataclasses
import math
from typing import Dict, List, Sequence, Tuple

import numpy as np

from pagedjax.kernels import xla_loops
from pagedjax import sizing
from pagedjax.sim.hardware import Hardware

OP_CLASSES = ('linear', 'head', 'attention', 'elementwise', 'collectives', 'overhead')


@dataclasses.dataclass
class StepShape:
  """One device call: padded rows x padded query tokens, and per padded row its real new tokens
  and its context after the call (0 and 0 for padding rows)."""
  rows: int
  tokens_per_row: int
  q_lens: np.ndarray        # [rows] int64
  context_lens: np.ndarray  # [rows] int64

  @classmethod
  def from_inputs(cls, inputs) -> 'StepShape':
    """From the StepInputs a jitted step receives (pagedjax/host/scheduling/step_inputs.py)."""
    rows, tokens = inputs.tokens.shape
    q = (np.asarray(inputs.positions) >= 0).sum(axis=1).astype(np.int64)
    return cls(rows, tokens, q, np.asarray(inputs.context_lens, np.int64))

  @classmethod
  def from_rows(cls, rows: Sequence[Tuple[int, int]], num_rows: int,
                tokens_per_row: int) -> 'StepShape':
    """From (new tokens, context after) per real row, padded to num_rows x tokens_per_row
    (the buckets the executor would pick)."""
    q = np.zeros(num_rows, np.int64)
    ctx = np.zeros(num_rows, np.int64)
    if rows:
      q[:len(rows)], ctx[:len(rows)] = zip(*rows)
    return cls(num_rows, tokens_per_row, q, ctx)

  def __eq__(self, other):
    return (self.rows, self.tokens_per_row) == (other.rows, other.tokens_per_row) and (
        np.array_equal(self.q_lens, other.q_lens) and
        np.array_equal(self.context_lens, other.context_lens))


@dataclasses.dataclass(frozen=True)
class OpCost:
  flops: float
  bytes: float
  compute_s: float
  memory_s: float

  @property
  def time_s(self) -> float:
    return max(self.compute_s, self.memory_s)

  @property
  def bound(self) -> str:
    return 'compute' if self.compute_s >= self.memory_s else 'memory'


class CostModel:
  """Predicted seconds of a model's device calls on `tp` devices of `hardware`."""

  def __init__(self, shape: sizing.ModelShape, hardware: Hardware, *, kv_bytes_per_token: float,
               block_size: int, tp: int = 1, weight_dtype: str = 'bf16',
               activation_dtype: str = 'bf16', count_padding: bool = True):
    """kv_bytes_per_token: K and V of one token over all layers and KV heads, in the pool's
    scheme (scales included): what a device pool really stores (simulated_device.py takes it
    from the pool's own byte count).

    count_padding: charge the padded rows and tokens this engine's programs compute (True), or
    only the real ones, as a server with ragged batches would (False: a projection, not this
    engine)."""
    self.shape, self.hw, self.tp, self.block_size = shape, hardware, tp, block_size
    self.count_padding = count_padding
    self.eff = hardware.efficiency
    s = shape
    self.layers, self.d = s.num_layers, s.d_model
    self.q_heads = s.num_heads // tp
    self.kv_heads = sizing.kv_heads_per_device(s, tp)
    self.ffn = s.ffn_dim // tp
    self.vocab = math.ceil(s.vocab_size / tp)
    self.weight_bytes = sizing.DTYPE_BITS[sizing.canonical_dtype(weight_dtype)] / 8
    self.act_bytes = sizing.DTYPE_BITS[sizing.canonical_dtype(activation_dtype)] / 8
    parts = sizing.param_breakdown(s, tp)
    self.linear_params = parts['attention'] + parts['mlp']
    self.head_params = self.vocab * self.d  # tied or not, the head is a [d, vocab/tp] matmul
    self.weights_per_device = parts['total'] * self.weight_bytes
    # A device holds its KV heads' share of every token (a whole head when tp > kv heads).
    self.kv_per_token = kv_bytes_per_token * self.kv_heads / s.num_kv_heads
    self.block_bytes = self.kv_per_token * block_size
    dh, hq, hkv, f = s.head_dim, self.q_heads, self.kv_heads, self.ffn
    mlp_outs = 2 * f if s.gated_mlp else f
    # Values each linear layer reads or writes per token and layer (x in, q/k/v out, attention
    # out in, o out, x in, gate/up out, hidden in, down out).
    self.linear_act_values = 4 * self.d + (2 * hq + 2 * hkv) * dh + mlp_outs + f + self.d
    self.elementwise_values = 10 * self.d + 2 * (hq + hkv) * dh + (3 if s.gated_mlp else 2) * f

  # ---- one step call -----------------------------------------------------------------------

  def _roofline(self, flops, nbytes, eff_flops, eff_bytes) -> OpCost:
    hw = self.hw
    compute = flops / (hw.peak_flops * eff_flops) if flops else 0.0
    memory = nbytes / (hw.hbm_bandwidth * eff_bytes) if nbytes else 0.0
    return OpCost(float(flops), float(nbytes), compute, memory)

  def attention_pairs_and_reads(self, step: StepShape) -> Tuple[float, float]:
    """((query, key) pairs scored, context tokens whose K/V are read), summed over rows."""
    q, ctx = step.q_lens, step.context_lens
    if self.hw.attention_reads == 'per_row':
      # A chunk of q tokens ending at ctx: its j-th query sees ctx - q + 1 + j keys.
      return float((q * ctx - q * (q - 1) // 2).sum()), float(ctx.sum())
    # batch_max: each of the kernel's batch loops walks its rows to their longest context, in
    # whole blocks, every padded query token of every row in the loop scoring every key it walks.
    bs = self.block_size
    bounds = (xla_loops.batch_bounds(step.rows, step.tokens_per_row)
              if step.rows >= xla_loops.SEQ_SPLITS else [0, step.rows])
    pairs = reads = 0.0
    for a, b in zip(bounds[:-1], bounds[1:]):
      rows = ctx[a:b]
      if len(rows) and rows.max() > 0:
        span = -(-int(rows.max()) // bs) * bs
        pairs += len(rows) * step.tokens_per_row * span
        reads += len(rows) * span
    return pairs, reads

  def tokens_and_rows(self, step: StepShape) -> Tuple[int, int]:
    """(query tokens, rows) the dense layers compute: padded ones included, unless the model
    counts real ones only."""
    if self.count_padding:
      return step.rows * step.tokens_per_row, step.rows
    return int(step.q_lens.sum()), int((step.q_lens > 0).sum())

  def step_costs(self, step: StepShape) -> Dict[str, OpCost]:
    """Per op class, the cost of one step call on one device."""
    e, L = self.eff, self.layers
    tokens, rows = self.tokens_and_rows(step)
    costs = {
        'linear': self._roofline(
            2 * tokens * self.linear_params,
            self.linear_params * self.weight_bytes + tokens * L * self.linear_act_values *
            self.act_bytes, e.matmul_flops, e.weight_bandwidth),
        'head': self._roofline(
            2 * rows * self.head_params,
            self.head_params * self.weight_bytes + 2 * rows * self.vocab * 4,
            e.matmul_flops, e.weight_bandwidth),
    }
    pairs, reads = self.attention_pairs_and_reads(step)
    written = float(step.q_lens.sum())
    costs['attention'] = self._roofline(
        4 * self.q_heads * self.shape.head_dim * L * pairs,
        (reads + written) * self.kv_per_token, e.attention_flops, e.kv_bandwidth)
    costs['elementwise'] = self._roofline(
        0, tokens * L * self.elementwise_values * self.act_bytes, 1.0, e.elementwise_bandwidth)
    costs['collectives'] = OpCost(0, 0, 0.0, self.collective_time(step))
    chunk = e.chunk_overhead_s if step.tokens_per_row > 1 else 0.0
    costs['overhead'] = OpCost(0, 0, 0.0, e.step_overhead_s + chunk + L * e.layer_overhead_s)
    return costs

  def collective_time(self, step: StepShape) -> float:
    """Tensor parallelism: two all-reduces of [tokens, d_model] per layer (after attention's
    o_proj and the MLP's down_proj, Megatron-style) and one all-gather of the logits."""
    tp = self.tp
    if tp == 1:
      return 0.0
    bw, lat = self.hw.interconnect_bandwidth, self.eff.collective_latency_s
    tokens, rows = self.tokens_and_rows(step)
    all_reduce = lat + 2 * (tp - 1) / tp * tokens * self.d * self.act_bytes / bw
    gather = lat + (tp - 1) / tp * rows * self.vocab * tp * 4 / bw
    return 2 * self.layers * all_reduce + gather

  def step_time(self, step: StepShape) -> float:
    return sum(c.time_s for c in self.step_costs(step).values())

  # ---- between steps -----------------------------------------------------------------------

  def swap_time(self, num_blocks: int) -> float:
    """Blocks between HBM and host RAM (swap out or in): every device moves its own share of
    each block over its own host link, in parallel."""
    if not num_blocks:
      return 0.0
    return self.eff.step_overhead_s + num_blocks * self.block_bytes / self.hw.host_link_bandwidth

  def copy_time(self, num_blocks: int) -> float:
    """Copy-on-write block copies inside HBM: each block read once and written once."""
    if not num_blocks:
      return 0.0
    return self.eff.step_overhead_s + 2 * num_blocks * self.block_bytes / (
        self.hw.hbm_bandwidth * self.eff.elementwise_bandwidth)

  def host_time(self, num_rows: int) -> float:
    """The host's own time in one iteration with num_rows batch rows (scheduling, bookkeeping,
    building inputs): not device time, but on the engine's clock all the same."""
    return self.eff.iteration_overhead_s + num_rows * self.eff.row_overhead_s

  # ---- reports -----------------------------------------------------------------------------

  def describe(self, step: StepShape) -> dict:
    """Per class: time, bound, FLOPs and bytes (for tables and tests)."""
    return {name: {'time_s': c.time_s, 'bound': c.bound, 'flops': c.flops, 'bytes': c.bytes}
            for name, c in self.step_costs(step).items()}


def decode_step(rows: int, context: int, padded_rows: int = 0) -> StepShape:
  """A decode call of `rows` sequences at the same context (a helper for tables and tests)."""
  return StepShape.from_rows([(1, context)] * rows, max(rows, padded_rows), 1)


def prefill_step(lengths: List[int], chunk: int, padded_rows: int = 0) -> StepShape:
  """A prompt-chunk call: one row per prompt chunk of the given lengths, from position 0."""
  return StepShape.from_rows([(n, n) for n in lengths], max(len(lengths), padded_rows), chunk)
