"""The device adaptor: runs one iteration's Plan (host/scheduling/scheduler.py) as Device calls
(host/scheduling/device_api.py) and returns what they sampled, a StepOutput.

One iteration is schedule -> run -> update (engine.py): the plan is the whole work order, this
file only carries it out, and the update step (host/scheduling/update.py) does every host-side
change after it. `PlanExecutor.run(plan)` makes these calls, in this order:

  1. one gather of every block swapped out and every block the KV tiers demote
     (Plan.demotions: evicted ones must be read before this iteration writes into them), one
     gather of the blocks offloaded sequences move out of their windows (Plan.offload_out,
     host/scheduling/offload.py), then one copy of every copy-on-write block and tier-1 hit
     (Plan.copies, Plan.tier_copies), then one scatter of every block swapped in and every block
     promoted from a lower tier (Plan.swap_in, Plan.promotions);
  2. one step call for the prompt chunks, then one for the decodes (one query token each), then
     the offloaded rows (those with blocks in host RAM) through the streamed path
     (model/streamed_attention.py, `_run_streamed`). Two calls rather than one mixed batch: a
     mixed batch is padded to its longest row, so every decode row would pay for a whole chunk
     of query tokens. Chunks go first, so a prompt that finishes samples its first token in the
     same iteration.
With write-through KV tiers, the blocks the update step just gave the prefix cache are copied
down by `write_through`, the iteration's last device call: they are known only once the step's
tokens are counted in.

Every call's shape is bucketed (rows, query tokens, block-table width, block ids), so a run
compiles a handful of times; the executor picks the buckets and, for a call holding a beam row,
the top-K bucket (host/requests/beam.py). Each device call is timed and charged to `compile`
when it traced a new program (pagedjax/device/traces.py) and to `device` otherwise; the
engine's clock leaves compilation out.

The devices: `JaxDevice` (below) runs the calls as jitted programs on a KV pool
(pagedjax/device/block_transfer.py for blocks, the model's CompiledStep for steps); the
simulator's SimulatedDevice (pagedjax/sim/simulated_device.py) charges a cost model's times to a
simulated clock. `JaxBackend` (DEVICE) is what Engine(backend=...) builds an engine's pool,
executor and step from.
"""
import math
from typing import Callable, Dict, List, Optional, Tuple

import jax
import numpy as np

from pagedjax import tiering
from pagedjax.device import block_transfer, traces
from pagedjax.device import pool as pool_lib
from pagedjax.model.step import CompiledStep
from pagedjax.model.streamed_attention import StreamedRow
from pagedjax.host.metrics import add_counts
from pagedjax.host.requests import beam as beam_lib
from pagedjax.host.scheduling.block_manager import BlockManager
from pagedjax.host.scheduling.device_api import CallResult, Device, StepCall, StepOutput
from pagedjax.host.scheduling.swap_store import SwapStore
from pagedjax.host.scheduling.scheduler import Plan
from pagedjax.host.scheduling.step_inputs import (RowSpec, bucket, build_step_inputs, padded_ids,
                                                  power_of_two_buckets)


class JaxDevice:
  """The Device protocol on a JAX KV pool: block transfers and copies as the jitted programs of
  device/block_transfer.py (block ids padded with the null block to `transfer_buckets`), steps
  as the model's jitted step over StepInputs built here (host/scheduling/step_inputs.py).

  Beyond the protocol, for what only a real pool has: the key tails of a KIVI pool
  (gather_tails, restore_tails; `keeps_tails`) and the streamed path of offloaded rows (the
  executor calls StreamedAttention on `pool` and `params` directly)."""

  def __init__(self, params, pool, step_fn, *, block_size: int, transfer_buckets,
               table_width_buckets, visible_table: Callable, timer: Callable[[], float]):
    """visible_table(seq, num_tokens): the blocks a row's kernels read (BlockManager's);
    timer: the engine's, which times building the step inputs."""
    self.params, self.pool, self.step_fn = params, pool, step_fn
    self.record_logits = step_fn.return_logits
    self.block_size, self.transfer_buckets = block_size, transfer_buckets
    self.table_width_buckets, self.visible_table = table_width_buckets, visible_table
    self._timer = timer
    # KIVI pools keep a sequence's partial last block unquantized in its lane, not in the block
    # (device/kv_schemes.py): a sequence swapped out takes that tail with it (Sequence.kv_tail).
    # A simulated pool driven through this device holds no arrays.
    self.keeps_tails = isinstance(pool, pool_lib.KVPool) and pool.scheme.keeps_tails

  def start_iteration(self, num_rows: int) -> None:
    del num_rows

  def gather(self, blocks: List[int]) -> Dict[str, np.ndarray]:
    return jax.device_get(
        block_transfer.gather_blocks(self.pool, padded_ids(blocks, self.transfer_buckets)))

  def scatter(self, blocks: List[int], data: Dict[str, np.ndarray]) -> None:
    padded = padded_ids(blocks, self.transfer_buckets)
    padding = [(0, 0), (0, len(padded) - len(blocks))]
    data = {name: np.pad(a, padding + [(0, 0)] * (a.ndim - 2))  # zeros into the null block
            for name, a in data.items()}
    self.pool = jax.block_until_ready(block_transfer.scatter_blocks(self.pool, padded, data))

  def copy(self, pairs: List[Tuple[int, int]]) -> None:
    src, dst = zip(*pairs)
    self.pool = jax.block_until_ready(block_transfer.copy_blocks(
        self.pool, padded_ids(src, self.transfer_buckets), padded_ids(dst, self.transfer_buckets)))

  def step(self, call: StepCall) -> CallResult:
    built = self._timer()
    specs = []
    for seq, n in call.rows:
      start, p = seq.num_cached, seq.params
      specs.append(RowSpec(seq.all_ids[start:start + n], start,
                           self.visible_table(seq, start + n), p.temperature, p.top_k,
                           p.top_p, p.seed, len(seq.output_ids), seq.lane))
    inputs = build_step_inputs(specs, self.block_size, [call.num_rows], [call.num_tokens],
                               self.table_width_buckets)
    # What small blocks cost the host (the block-size sweep reports these, experiments/jobs.py):
    # the time to build the inputs, the padded block-table bytes the step receives, and each
    # real row's table entries.
    entries = [len(spec.block_table) for spec in specs]
    counts = {'step_input_seconds': self._timer() - built,
              'block_table_bytes': inputs.block_tables.nbytes, 'block_table_rows': len(entries),
              'block_table_entries': sum(entries), 'block_table_entries_max': max(entries)}
    step_fn = self.step_fn.with_topk(call.topk) if call.topk else self.step_fn
    out = step_fn(self.params, self.pool, inputs)
    self.pool, tokens = out[0], np.asarray(out[1])
    logits = np.asarray(out[2]) if self.record_logits else None
    cands = (np.asarray(out[-2]), np.asarray(out[-1])) if call.topk else None
    return CallResult(call.rows, tokens, logits, cands, counts,
                      host_s=counts['step_input_seconds'])

  def gather_tails(self, blocks: List[int]) -> np.ndarray:
    """The unquantized key tails of `blocks` (a KIVI pool's partial last blocks), [.., i, ..]
    for blocks[i] on axis 1."""
    return jax.device_get(block_transfer.gather_tails(
        self.pool, padded_ids(blocks, self.transfer_buckets)))

  def restore_tails(self, lanes: np.ndarray, blocks: np.ndarray, tails: np.ndarray) -> None:
    self.pool = jax.block_until_ready(block_transfer.restore_tails(self.pool, lanes, blocks,
                                                                   tails))


class PlanExecutor:
  """run(plan) -> StepOutput on a Device (module docstring). Holds the stores the transfers
  read and write: the swap store (swap preemption), the KV tiers' (demotions, promotions; the
  engine sets `tiers`) and the offload store (`offload`, with its streamed programs)."""
  offload = None  # host/scheduling/offload.Offload when config.offload is on (the engine sets
  streamed = None  # both; its device programs: model/streamed_attention.StreamedAttention)
  tiers = None  # host/tiers/kv_tiers.KVTiers when config.tiers is on (the engine sets it)
  backend = None  # the backend that built it (Engine(backend=...); the engine sets it)

  def __init__(self, params, pool, step_fn, blocks: BlockManager, *, vocab_size: int,
               max_batch_size: int, prefill_chunk: int, max_seq_len: int,
               swap_store: Optional[SwapStore], timer: Callable[[], float],
               decode_min_rows: int = 8, device: Optional[Device] = None):
    """device: the Device to run on; None builds a JaxDevice on params, pool and step_fn."""
    self.blocks, self.swap_store = blocks, swap_store
    self.vocab_size = vocab_size
    self._timer = timer
    block_size, num_blocks = blocks.block_size, blocks.allocator.num_blocks
    self.block_size = block_size
    # Up to twice the pool: one gather may read a block for a swap-out and for a demotion.
    self.transfer_buckets = power_of_two_buckets(max(2 * (num_blocks - 1), 1))
    self.batch_buckets = power_of_two_buckets(max_batch_size)
    # Decode calls start at decode_min_rows (config.engine; 8 by default): fewer rows only
    # happen at a run's start and tail, and a padded decode row costs little next to a
    # compilation, unless a lone sequence decodes for long (then 1).
    self.decode_batch_buckets = power_of_two_buckets(max_batch_size,
                                                     min(decode_min_rows, max_batch_size))
    # Coarse buckets keep compilations few (each costs seconds on this CPU even for a tiny
    # model, and the shapes multiply): decode rows are 1 token; prompt chunks are padded to a
    # whole chunk (chunk calls are a small share of a serving run's calls, and each chunk
    # bucket would multiply the row and table buckets); block tables are at least 256 tokens
    # wide.
    self.token_buckets = sorted({1, prefill_chunk})
    max_table_width = math.ceil(max_seq_len / block_size)
    self.table_width_buckets = power_of_two_buckets(
        max_table_width, min(math.ceil(256 / block_size), max_table_width))
    self.device = device or JaxDevice(
        params, pool, step_fn, block_size=block_size, transfer_buckets=self.transfer_buckets,
        table_width_buckets=self.table_width_buckets, visible_table=blocks.visible_table,
        timer=timer)
    self.swaps_tails = getattr(self.device, 'keeps_tails', False)

  # The device's state, for the engine, calibration (tiering.py, sim/calibrate.py) and tests.
  @property
  def pool(self):
    return self.device.pool

  @pool.setter
  def pool(self, pool):
    self.device.pool = pool

  @property
  def params(self):
    return self.device.params

  @property
  def step_fn(self):
    return self.device.step_fn

  @step_fn.setter
  def step_fn(self, step_fn):  # tests and calibration wrap the step to record its calls
    self.device.step_fn = step_fn

  # ---- one iteration -----------------------------------------------------------------------

  def run(self, plan: Plan) -> StepOutput:
    """Carries out the plan (module docstring); returns every call's result, its timings and
    counts. Makes no device call the plan does not name."""
    out = StepOutput()
    self.device.start_iteration(len(plan.rows))
    self._move_blocks(plan, out)
    batched = [(s, n) for s, n in plan.rows if not s.host_table]
    streamed = [(s, n) for s, n in plan.rows if s.host_table]
    joined = self._joining(batched, streamed)
    if joined:
      joining = {id(s) for s, _ in joined}
      batched = [(s, n) for s, n in batched if id(s) not in joining]
    for kind, rows in (('prefill', [(s, n) for s, n in batched if n > 1]),
                       ('decode', [(s, n) for s, n in batched if n == 1])):
      if rows:
        out.calls.append(self._step(rows, kind, out))
        out.counts[f'{kind}_steps'] += 1
    if streamed:
      out.calls.append(self._run_streamed(streamed, out, joined))
    return out

  def _joining(self, batched, streamed):
    """The ordinary decode rows that join this iteration's streamed decode batch
    (offload.join_decodes): when an offloaded row decodes, every one-token row whose blocks
    fit the streamed window goes through the same per-layer programs, one pass over the
    weights for both instead of a batched step and then the streamed one."""
    if (self.offload is None or not self.offload.join_decodes or
        not any(n == 1 for _, n in streamed)):
      return []
    window = self.offload.window
    return [(s, n) for s, n in batched
            if n == 1 and len(self.blocks.visible_table(s, s.num_cached + 1)) <= window]

  def write_through(self) -> StepOutput:
    """With write-through KV tiers: one gather of the blocks the prefix cache took in since the
    last gather (the update step offered them), into the tiers; then the tiers' iteration row
    (kv_tiers.end_iteration). The iteration's last device call (module docstring)."""
    out = StepOutput()
    demoted = self.tiers.take_demotions()
    if demoted:
      self._timed(out, self._gather_out, [], demoted)
    self.tiers.end_iteration()
    return out

  # ---- block movement ----------------------------------------------------------------------

  def _move_blocks(self, plan: Plan, out: StepOutput) -> None:
    if plan.swap_out and self.swaps_tails:
      self._stash_tails(plan)
    if plan.swap_out or plan.demotions:  # one gather for both
      out.counts['swapped_out_blocks'] += self._timed(out, self._gather_out, plan.swap_out,
                                                      plan.demotions)
    if plan.offload_out:  # read before anything below writes into the blocks freed by the move
      self._timed(out, self._offload_out, plan.offload_out)
      out.counts['offloaded_blocks'] += len(plan.offload_out)
    # After the gather read the blocks preempted or evicted now: copy-on-write copies, and
    # blocks evicted now that a lookup found again (kv_tiers.py, tier-1 hits).
    copies = plan.copies + plan.tier_copies
    if copies:
      self._timed(out, self.device.copy, copies)
      out.counts['cow_copies'] += len(plan.copies)
    if plan.swap_in or plan.promotions:  # one scatter for both
      self._timed(out, self._scatter_in, plan.swap_in, plan.promotions)
      out.counts['swapped_in_blocks'] += sum(len(src) for src, _ in plan.swap_in)

  def _gather_out(self, swaps, demoted) -> int:
    """Device -> host in one gather: every (device blocks, host blocks) pair of a swap-out into
    the swap store, and the blocks demoted to the KV tiers; returns the blocks swapped out."""
    start = self._timer()
    device = [b for src, _ in swaps for b in src]
    data = self.device.gather(device + [d.block for d in demoted])
    if device:
      self.swap_store.store([b for _, dst in swaps for b in dst], data)
    if demoted:
      self.tiers.store_demotions(demoted, {name: a[:, len(device):len(device) + len(demoted)]
                                           for name, a in data.items()})
      self.tiers.counters['demote_seconds'] += self._timer() - start
    return len(device)

  def _offload_out(self, moves) -> None:
    """Device -> host in one gather: the (device block, host block) pairs of blocks offloaded
    sequences move out of their windows now, into the offload store."""
    data = self.device.gather([d for d, _ in moves])
    self.offload.store.store([h for _, h in moves], data)

  def _scatter_in(self, swaps, promoted) -> None:
    """Host -> device in one scatter: every (host blocks, device blocks) pair of a swap-in, and
    the blocks promoted from the KV tiers."""
    start = self._timer()
    host = [b for src, _ in swaps for b in src]
    ids = [b for _, dst in swaps for b in dst] + [p.block for p in promoted]
    parts = ([self.swap_store.load(host, len(host))] if host else []) + (
        [self.tiers.load(promoted)] if promoted else [])
    data = {name: np.concatenate([part[name] for part in parts], axis=1) for name in parts[0]}
    self.device.scatter(ids, data)
    if promoted:
      self.tiers.counters['promote_seconds'] += self._timer() - start

  def _stash_tails(self, plan: Plan) -> None:
    """Each sequence swapped out now whose last block is partial takes that block's key tail
    to the host (one gather, before anything this iteration writes)."""
    tails = {}  # device block -> sequence
    for seq, policy in plan.preempted:
      if policy == 'swap' and seq.kv_tail is None and seq.num_cached % self.block_size:
        device = next(src for src, dst in plan.swap_out if dst == seq.host_blocks)
        tails[device[-1]] = seq
    if tails:
      data = self.device.gather_tails(list(tails))
      for i, seq in enumerate(tails.values()):
        seq.kv_tail = (seq.num_cached, data[:, i])

  def _restore_tails(self, rows) -> None:
    """Rows back from swap put their key tails into their new lanes, before their first step."""
    back = []
    for seq, _ in rows:
      if seq.kv_tail is not None:
        cached_then, tail = seq.kv_tail
        seq.kv_tail = None
        if cached_then == seq.num_cached:  # else it was recomputed since: nothing to put back
          back.append((seq, tail))
    if not back:
      return
    n = bucket(len(back), self.batch_buckets)
    lanes, blocks = np.zeros(n, np.int32), np.zeros(n, np.int32)  # padding: null lane and block
    tails = np.zeros((n,) + back[0][1].shape, back[0][1].dtype)
    for i, (seq, tail) in enumerate(back):
      lanes[i], tails[i] = seq.lane, tail
      blocks[i] = seq.block_table[seq.num_cached // self.block_size]
    self.device.restore_tails(lanes, blocks, np.moveaxis(tails, 0, 1))

  # ---- steps -------------------------------------------------------------------------------

  def _topk(self, rows) -> int:
    """A call holding a beam row returns top-K candidates too: one K bucket for the call."""
    return max((beam_lib.topk_bucket(s.params.beam_width, self.vocab_size)
                for s, _ in rows if s.beam), default=0)

  def _step(self, rows, kind: str, out: StepOutput) -> CallResult:
    """One step call over rows of (seq, tokens to feed), its shape bucketed here."""
    if self.swaps_tails:
      self._timed(out, self._restore_tails, rows)
    batch_buckets = self.decode_batch_buckets if kind == 'decode' else self.batch_buckets
    call = StepCall(rows, kind, bucket(len(rows), batch_buckets),
                    bucket(max(n for _, n in rows), self.token_buckets), self._topk(rows))
    result = self._timed(out, self.device.step, call)
    add_counts(out.counts, result.counts)
    return result

  def _run_streamed(self, rows, out: StepOutput, joined=()) -> CallResult:
    """The offloaded rows, and the ordinary decode rows joining them (`_joining`: no host
    blocks, their visible blocks as the window), through the streamed path, batched
    (model/streamed_attention.py). A JAX pool's path only: the simulator refuses offload."""
    if joined and self.swaps_tails:
      self._timed(out, self._restore_tails, joined)
    specs = []
    for seq, n in list(rows) + list(joined):
      start, p = seq.num_cached, seq.params
      window = (seq.block_table if seq.host_table else
                self.blocks.visible_table(seq, start + n))
      specs.append(StreamedRow(seq.all_ids[start:start + n], start, seq.host_table, window,
                               p.temperature, p.top_k, p.top_p, p.seed, len(seq.output_ids),
                               seq.lane))
    every = list(rows) + list(joined)
    self.pool, tokens, logits, streamed, cands = self._timed(
        out, self.streamed.run, self.params, self.pool, self.offload.store, specs,
        self._topk(every))
    out.counts['streamed_rows'] += len(rows)
    out.counts['streamed_tokens'] += sum(n for _, n in rows)
    out.counts['streamed_bytes'] += streamed
    out.counts['streamed_steps'] += 1
    out.counts['joined_decode_rows'] += len(joined)
    return CallResult(every, tokens, logits if self.device.record_logits else None, cands)

  def _timed(self, out: StepOutput, fn, *args):
    """Runs a device call (which must block on its result), charging compile or device time."""
    before = traces.count()
    t0 = self._timer()
    result = fn(*args)
    compiled = traces.count() - before
    out.counts['compilations'] += compiled
    # A step call's host part (building its inputs) is the host's time (CallResult.host_s).
    seconds = self._timer() - t0 - (result.host_s if isinstance(result, CallResult) else 0.0)
    if compiled:
      out.compile_s += seconds
    else:
      out.device_s += seconds
    return result


class JaxBackend:
  """What an engine runs its plans on (`Engine(backend=...)`): the device's pool, this executor
  (on a JaxDevice) and the jitted step. pagedjax/sim/simulated_device.py's SimulatedBackend
  offers the same, on a SimulatedDevice timed by a cost model."""
  init_model_pool = staticmethod(pool_lib.init_model_pool)
  executor = PlanExecutor
  step = CompiledStep
  preemption_cost = staticmethod(tiering.preemption_cost)  # measured on this device
  tier_layout = staticmethod(tiering.pool_layout)  # the KV tiers' (tiering.build_tiers)
  tier_costs = staticmethod(tiering.calibrated_cost)


DEVICE = JaxBackend()
