"""Runs one iteration's plan (pagedjax/host/scheduling/scheduler.py) on the device, in this order:

  1. one gather of every block swapped out and every block demoted to a lower KV tier since the
     last gather (host/tiers/kv_tiers.py: evicted ones must be read before this iteration writes into
     them), one gather of the blocks offloaded sequences move out of their windows
     (host/scheduling/offload.py), then one copy of every copy-on-write block, then one scatter of every
     block swapped in and every block promoted from a lower tier
     (pagedjax/device/block_transfer.py; block ids padded to power-of-two buckets with the null
     block);
  2. one jitted step for the prompt chunks, then one for the decodes (one query token each),
     then each row of an offloaded sequence (one with blocks in host RAM, host/scheduling/offload.py)
     through the streamed path (model/streamed_attention.py), one row at a time;
  3. with write-through tiers, one gather of the blocks those steps filled and the cache took.
     Two calls rather than one mixed batch: a mixed batch is padded to its longest row, so every
     decode row would pay for a whole chunk of query tokens. Chunks go first, so a prompt that
     finishes samples its first token in the same iteration.

Every call's shape is bucketed (rows, query tokens, block-table width), so a run compiles a
handful of times. Each device call is timed and charged to `compile` when it traced a new
program (pagedjax/device/traces.py) and to `device` otherwise; the engine's clock leaves
compilation out.
"""
import collections
import math
from typing import Callable, Optional

import jax
import numpy as np

from pagedjax import tiering
from pagedjax.device import block_transfer, traces
from pagedjax.device import pool as pool_lib
from pagedjax.model.step import CompiledStep
from pagedjax.model.streamed_attention import StreamedRow
from pagedjax.host.requests import beam as beam_lib
from pagedjax.host.scheduling.block_manager import BlockManager
from pagedjax.host.scheduling.swap_store import SwapStore
from pagedjax.host.scheduling.scheduler import Plan
from pagedjax.host.scheduling.step_inputs import (RowSpec, bucket, build_step_inputs, padded_ids,
                                       power_of_two_buckets)


class PlanExecutor:
  offload = None  # host/offload.Offload when config.offload is on (the engine sets both)
  streamed = None  # its device programs, device/streamed_attention.StreamedAttention

  def __init__(self, params, pool, step_fn, blocks: BlockManager, *, vocab_size: int,
               max_batch_size: int, prefill_chunk: int, max_seq_len: int,
               swap_store: Optional[SwapStore], timer: Callable[[], float], stats: collections.Counter,
               decode_min_rows: int = 8):
    self.params, self.pool, self.step_fn = params, pool, step_fn
    self.blocks, self.swap_store = blocks, swap_store
    self.vocab_size = vocab_size
    self._timer, self.stats = timer, stats
    self.record_logits = step_fn.return_logits
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
    # KIVI pools keep a sequence's partial last block unquantized in its lane, not in the block
    # (device/kv_schemes.py): a sequence swapped out takes that tail with it (Sequence.kv_tail).
    # A simulated device's pool holds no arrays.
    self.swaps_tails = isinstance(pool, pool_lib.KVPool) and pool.scheme.keeps_tails

  def execute(self, plan: Plan, timing: collections.Counter) -> list:
    """Runs the plan; returns (seq, token, logits or None) for every row that sampled."""
    self._move_blocks(plan, timing)
    batched = [(s, n) for s, n in plan.rows if not s.host_table]
    chunks = [(s, n) for s, n in batched if n > 1]
    decodes = [(s, n) for s, n in batched if n == 1]
    sampled = []
    for rows, kind in ((chunks, 'prefill'), (decodes, 'decode')):
      if rows:
        sampled += self._run(rows, kind, timing)
        self.stats[f'{kind}_steps'] += 1
    streamed = [(s, n) for s, n in plan.rows if s.host_table]
    if streamed:
      sampled += self._run_streamed(streamed, timing)
    tiers = self.blocks.tiers
    if tiers is not None:
      demoted = tiers.take_demotions()  # write-through: the blocks the steps just filled
      if demoted:
        self._timed(timing, self._swap_out, [], demoted)
      tiers.end_iteration()
    return sampled

  # ---- block movement ----------------------------------------------------------------------

  def _move_blocks(self, plan: Plan, timing) -> None:
    tiers = self.blocks.tiers
    demoted = tiers.take_demotions() if tiers is not None else []
    if plan.swap_out and self.swaps_tails:
      self._stash_tails(plan)
    if plan.swap_out or demoted:  # one gather for both (a subclass may time swaps only)
      args = (plan.swap_out, demoted) if demoted else (plan.swap_out,)
      self.stats['swapped_out_blocks'] += self._timed(timing, self._swap_out, *args)
    if plan.offload_out:  # read before anything below writes into the blocks freed by the move
      self._timed(timing, self._offload_out, plan.offload_out)
    # After the gather read the blocks preempted or evicted now: copy-on-write copies, and
    # blocks evicted now that a lookup found again (kv_tiers.py, tier-1 hits).
    copies = plan.copies + (tiers.take_copies() if tiers is not None else [])
    if copies:
      self.pool = self._timed(timing, self._copy, copies)
      self.stats['cow_copies'] += len(plan.copies)
    promoted = tiers.take_promotions() if tiers is not None else []
    if plan.swap_in or promoted:  # one scatter for both
      args = (plan.swap_in, promoted) if promoted else (plan.swap_in,)
      self.pool = self._timed(timing, self._swap_in, *args)
      self.stats['swapped_in_blocks'] += sum(len(src) for src, _ in plan.swap_in)

  def _swap_out(self, copies, demoted=()) -> int:
    """Device -> host in one gather: every (device blocks, host blocks) pair of a swap-out into
    the swap tier, and the blocks demoted to the KV tiers; returns the blocks swapped out."""
    start = self._timer()
    device = [b for src, _ in copies for b in src]
    ids = device + [d.block for d in demoted]
    data = jax.device_get(
        block_transfer.gather_blocks(self.pool, padded_ids(ids, self.transfer_buckets)))
    if device:
      self.swap_store.store([b for _, dst in copies for b in dst], data)
    if demoted:
      tiers = self.blocks.tiers
      tiers.store_demotions(demoted, {name: a[:, len(device):len(ids)]
                                      for name, a in data.items()})
      tiers.counters['demote_seconds'] += self._timer() - start
    return len(device)

  def _offload_out(self, moves) -> None:
    """Device -> host in one gather: the (device block, host block) pairs of blocks offloaded
    sequences move out of their windows now, into the offload store."""
    data = jax.device_get(block_transfer.gather_blocks(
        self.pool, padded_ids([d for d, _ in moves], self.transfer_buckets)))
    self.offload.store.store([h for _, h in moves], data)
    self.stats['offloaded_blocks'] += len(moves)

  def _swap_in(self, copies, promoted=()):
    """Host -> device in one donated scatter: every (host blocks, device blocks) pair of a
    swap-in, and the blocks promoted from the KV tiers. Returns the new pool."""
    start = self._timer()
    host = [b for src, _ in copies for b in src]
    ids = [b for _, dst in copies for b in dst] + [p.block for p in promoted]
    parts = ([self.swap_store.load(host, len(host))] if host else []) + (
        [self.blocks.tiers.load(promoted)] if promoted else [])
    padded = padded_ids(ids, self.transfer_buckets)
    data = {}
    for name in parts[0]:  # padding writes zeros into the null block
      joined = np.concatenate([part[name] for part in parts], axis=1)
      pad = [(0, 0), (0, len(padded) - len(ids))] + [(0, 0)] * (joined.ndim - 2)
      data[name] = np.pad(joined, pad)
    pool = jax.block_until_ready(block_transfer.scatter_blocks(self.pool, padded, data))
    if promoted:
      self.blocks.tiers.counters['promote_seconds'] += self._timer() - start
    return pool

  def _stash_tails(self, plan: Plan) -> None:
    """Each sequence swapped out now whose last block is partial takes that block's key tail
    to the host (one gather, before anything this iteration writes)."""
    tails = {}  # device block -> sequence
    for seq, policy in plan.preempted:
      if policy == 'swap' and seq.kv_tail is None and seq.num_cached % self.block_size:
        device = next(src for src, dst in plan.swap_out if dst == seq.host_blocks)
        tails[device[-1]] = seq
    if tails:
      data = jax.device_get(block_transfer.gather_tails(
          self.pool, padded_ids(list(tails), self.transfer_buckets)))
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
    self.pool = jax.block_until_ready(
        block_transfer.restore_tails(self.pool, lanes, blocks, np.moveaxis(tails, 0, 1)))

  def _copy(self, copies):
    src, dst = zip(*copies)
    pool = block_transfer.copy_blocks(self.pool, padded_ids(src, self.transfer_buckets),
                                      padded_ids(dst, self.transfer_buckets))
    return jax.block_until_ready(pool)

  # ---- steps -------------------------------------------------------------------------------

  def _run(self, rows, kind: str, timing) -> list:
    """One jitted call over rows of (seq, tokens to feed); returns (seq, token, logits) for the
    rows whose prompt or decode token is now fully cached, i.e. that sample."""
    if self.swaps_tails:
      self._timed(timing, self._restore_tails, rows)
    built = self._timer()
    specs = []
    for seq, n in rows:
      start, p = seq.num_cached, seq.params
      specs.append(RowSpec(seq.all_ids[start:start + n], start,
                           self.blocks.visible_table(seq, start + n), p.temperature, p.top_k,
                           p.top_p, p.seed, len(seq.output_ids), seq.lane))
    batch_buckets = self.decode_batch_buckets if kind == 'decode' else self.batch_buckets
    inputs = build_step_inputs(specs, self.block_size, batch_buckets, self.token_buckets,
                               self.table_width_buckets)
    # What small blocks cost the host (the block-size sweep reports these, experiments/jobs.py):
    # the time to build the inputs, the padded block-table bytes the step receives, and each
    # real row's table entries.
    self.stats['step_input_seconds'] += self._timer() - built
    self.stats['block_table_bytes'] += inputs.block_tables.nbytes
    entries = [len(spec.block_table) for spec in specs]
    self.stats['block_table_rows'] += len(entries)
    self.stats['block_table_entries'] += sum(entries)
    self.stats['block_table_entries_max'] = max(self.stats['block_table_entries_max'],
                                                max(entries))
    # A call holding a beam row returns top-K candidates too (one K bucket for the call).
    topk = max((beam_lib.topk_bucket(s.params.beam_width, self.vocab_size)
                for s, _ in rows if s.beam), default=0)
    step_fn = self.step_fn.with_topk(topk) if topk else self.step_fn

    def call():
      out = step_fn(self.params, self.pool, inputs)
      logits = np.asarray(out[2]) if self.record_logits else None
      cands = (np.asarray(out[-2]), np.asarray(out[-1])) if topk else None
      return out[0], np.asarray(out[1]), logits, cands

    self.pool, tokens, logits, cands = self._timed(timing, call)
    return self._advance(rows, tokens, logits, cands)

  def _run_streamed(self, rows, timing) -> list:
    """Each offloaded row through the streamed path, one at a time (module docstring)."""
    tokens, logits = [], []
    for seq, n in rows:
      start, p = seq.num_cached, seq.params
      row = StreamedRow(seq.all_ids[start:start + n], start, seq.host_table, seq.block_table,
                        p.temperature, p.top_k, p.top_p, p.seed, len(seq.output_ids))
      self.pool, token, row_logits, streamed = self._timed(
          timing, self.streamed.run, self.params, self.pool, self.offload.store, row)
      tokens.append(token)
      logits.append(row_logits)
      self.stats['streamed_rows'] += 1
      self.stats['streamed_tokens'] += n
      self.stats['streamed_bytes'] += streamed
    self.stats['streamed_steps'] += 1
    return self._advance(rows, tokens, logits if self.record_logits else None, None)

  def _advance(self, rows, tokens, logits, cands) -> list:
    """Marks the fed tokens cached; beam rows hand their candidates to their group."""
    sampled = []
    for i, (seq, n) in enumerate(rows):
      # Prompt positions fed (recomputation after preemption included): what prefix caching saves.
      self.stats['prompt_tokens_computed'] += max(
          0, min(seq.num_cached + n, len(seq.prompt_ids)) - seq.num_cached)
      # Positions it had cached before a recompute preemption, fed again: thrashing's waste.
      # (The high-water mark starts from what admission, a fork or a promotion handed it.)
      seq.max_cached = max(seq.max_cached, seq.num_cached)
      self.stats['recomputed_tokens'] += max(
          0, min(seq.num_cached + n, seq.max_cached) - seq.num_cached)
      self.stats['tokens_fed'] += n
      seq.num_cached += n
      seq.max_cached = max(seq.max_cached, seq.num_cached)
      self.blocks.offer_full_blocks(seq)
      if seq.num_pending:  # a mid-prompt chunk samples nothing
        continue
      if seq.beam:  # a beam's token is chosen by its group
        seq.beam.offer(seq, cands[0][i], cands[1][i])
      else:
        sampled.append((seq, int(tokens[i]), None if logits is None else logits[i]))
    return sampled

  def _timed(self, timing, fn, *args):
    """Runs a device call (which must block on its result), charging compile or device time."""
    before = traces.count()
    t0 = self._timer()
    out = fn(*args)
    compiled = traces.count() - before
    self.stats['compilations'] += compiled
    timing['compile' if compiled else 'device'] += self._timer() - t0
    return out


class Device:
  """What an engine runs its plans on (`Engine(backend=...)`): the device's pool, this executor
  and the jitted step. pagedjax/sim/simulated_device.py offers the same three, timed by a cost
  model instead of run."""
  init_model_pool = staticmethod(pool_lib.init_model_pool)
  executor = PlanExecutor
  step = CompiledStep
  preemption_cost = staticmethod(tiering.preemption_cost)  # measured on this device


DEVICE = Device()
