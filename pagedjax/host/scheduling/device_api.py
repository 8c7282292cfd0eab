"""What one iteration asks of a device, and what it gives back: the `Device` protocol, `StepCall`
and `StepOutput`.

An iteration is schedule -> run -> update:

  Scheduler.schedule() -> Plan     the whole work order (scheduler.py): rows, admissions,
                                   preemptions, swaps, tier demotions and promotions, copy-on-write
                                   copies, offload moves, lanes
  PlanExecutor.run(plan) -> StepOutput
                                   the device adaptor (pagedjax/executor.py): turns the plan into
                                   Device calls in a fixed order and returns what they sampled
  StepUpdate.update(plan, output, now) -> finished
                                   every post-step update (update.py): cached counts, the prefix
                                   cache, tokens, finishes, beams, metrics

The executor talks to the device only through the five methods below. pagedjax/executor.py's
JaxDevice runs them as jitted programs on a KV pool; pagedjax/sim/simulated_device.py's
SimulatedDevice advances a simulated clock by a cost model's times instead. Neither knows about
plans: the order of the calls, the bucketing of their shapes, the choice of the top-K bucket for
beam rows and the timing (compile or device) are the executor's, shared by both.

Plain host types (numpy, no jax): the update step reads StepOutput without a device.
"""
import collections
import dataclasses
from typing import Dict, List, NamedTuple, Optional, Protocol, Sequence as Seq, Tuple
from typing import runtime_checkable

import numpy as np

from pagedjax.host.requests.sequence import Sequence

Rows = List[Tuple[Sequence, int]]  # (sequence, tokens to feed from its num_cached on)


class StepCall(NamedTuple):
  """One step call: rows of one kind, padded to the executor's shape buckets."""
  rows: Rows
  kind: str  # 'prefill' (prompt chunks) or 'decode' (one token per row)
  num_rows: int  # padded batch rows (a bucket >= len(rows))
  num_tokens: int  # padded query tokens per row (a bucket >= every row's tokens)
  topk: int = 0  # > 0: also return each row's topk best (ids, log-probs): beam rows


class CallResult(NamedTuple):
  """What one call sampled, row i for rows[i] (arrays may carry padding rows after them)."""
  rows: Rows
  tokens: Seq[int]  # each row's sampled token (a mid-prompt chunk's is ignored)
  logits: Optional[Seq[np.ndarray]] = None  # [V] per row, when the step records logits
  candidates: Optional[Tuple[np.ndarray, np.ndarray]] = None  # ([R, K] ids, [R, K] log-probs)
  counts: Dict[str, float] = {}  # what the device counted building the call (metrics.py)
  # Seconds of the call the device spent on the host (building its inputs): the executor charges
  # them to the host's time, not the device's.
  host_s: float = 0.0


@dataclasses.dataclass
class StepOutput:
  """What PlanExecutor.run gives the update step: every call's result, in the order the calls
  ran (prompt chunks, decodes, offloaded rows), the device and compile seconds of the whole
  run, and the run's counts (blocks moved, calls made, compilations: metrics.py reports them)."""
  calls: List[CallResult] = dataclasses.field(default_factory=list)
  device_s: float = 0.0
  compile_s: float = 0.0
  counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@runtime_checkable
class Device(Protocol):
  """What PlanExecutor needs from a device. Block ids are device block ids, unpadded (a device
  pads them to its own shape buckets); `data` is field name -> [layers, blocks, ...] numpy
  arrays laid out like the pool's blocks (KVPool.block_array_shapes; {} for a pool that holds
  no arrays). Every call returns once its work is done, so the executor can time it."""

  def start_iteration(self, num_rows: int) -> None:
    """Called once per iteration before any other call (a simulated device charges the host
    code's time for num_rows rows here; a real one does nothing)."""

  def gather(self, blocks: List[int]) -> Dict[str, np.ndarray]:
    """Device -> host: the contents of `blocks`, in order."""

  def scatter(self, blocks: List[int], data: Dict[str, np.ndarray]) -> None:
    """Host -> device: data[name][:, i] into blocks[i]."""

  def copy(self, pairs: List[Tuple[int, int]]) -> None:
    """Device -> device: each (source, destination) block pair, all in one call."""

  def step(self, call: StepCall) -> CallResult:
    """Feeds each row's tokens (from its num_cached on), writes their K/V into the row's blocks
    and samples one token per row; with call.topk, also the rows' topk candidates."""
