"""Continuous batching on the host: which sequences run in this iteration, with how many tokens.

Queues:
  waiting  visible requests holding no blocks (new, or preempted by recompute), in the queue-order
           policy's order (`queue_order`: 'fcfs' (arrival_time, request_id), 'sjf', 'priority')
  running  sequences holding device blocks, in FCFS order (Sequence.order)
  swapped  sequences preempted by swap; their cached K/V sit in the host tier; FCFS order

`schedule()` plans one iteration (the order follows vLLM's scheduler):
  0. A leader of parallel samples whose prompt is cached but for its last token forks its
     samples (block_manager.fork); each then decodes that token with its own seed.
  1. Every running sequence that is decoding gets a slot for its next token (but an offloaded
     one sitting this iteration out: offload.decode_every). When the pool is out of blocks, a
     victim is preempted until it fits (see Preemption below); the oldest running
     sequence is never a victim while another runs, so the run cannot livelock.
  2. If nothing was preempted, swapped sequences come back in FCFS order while blocks allow.
  3. If nothing was preempted and none is swapped (they arrived first), waiting requests are
     admitted in queue order while batch rows, the token budget and blocks allow, keeping a
     watermark of free blocks for running sequences to grow into, and while the admission policy
     agrees. A head that does not fit blocks the queue: no request skips ahead. Admission
     'watermark' asks nothing more; 'projected' also asks that the blocks every running sequence
     and the head will hold `admission_horizon` tokens from now (each capped at its
     max_new_tokens) fit the pool: fewer admissions, fewer preemptions.
  4. Token budget: every decode costs one token and always fits (the budget is at least the batch
     size); what is left goes to prompt chunks (at most prefill_chunk tokens each) in FCFS order,
     at most `prefill_cap` prompt tokens per iteration when that is set (a throttle a caller
     may set between iterations; None = no cap).
     A prompt's blocks are allocated whole at admission, so a sequence mid-prompt never needs
     more blocks and never preempts anyone.
  5. Lanes: sequences preempted now give theirs back, then every running sequence without one
     takes one (lanes.py), listed in `Plan.lanes`.
  6. Tier work: the demotions, tier-1 copies and promotions the KV tiers queued since the last
     plan (evictions this pass caused, idle sessions demoted before it, prefixes found below the
     device at admission; host/tiers/kv_tiers.py) move into the plan.
Admission takes a prompt's cached prefix from the prefix cache when there is one
(block_manager.allocate_waiting). A decode whose slot lies in a shared block gets a private copy
(copy-on-write), listed in `Plan.copies`. Batch rows count a leader's pending forks.

The plan is the iteration's whole work order: pure host bookkeeping, which the executor
(pagedjax/executor.py) turns into device calls and nothing else, in the order `Plan` lists. What
the steps sample comes back as a StepOutput (device_api.py) for the update step (update.py).

Victim, admission and queue order are plug-ins (host/policies.py: their registries, protocols and
the built-in policies; a config may also name 'package.module:function').

Preemption. The victim (`victim`):
  newest          the newest running sequence (vLLM's choice; FCFS order, Sequence.order)
  least_progress  the one with the fewest tokens in the cache (the least work lost), newest first
                  among equals
  priority        the one with the largest SamplingParams.priority value (lower is served
                  first), newest first among equals
  cost            the one whose preemption costs least by the cost model (host/tiers/tier_cost.py):
                  min(recompute_s, swap_s) when swapping is possible, else recompute_s
How its K/V are kept (`preemption`):
  recompute  dropped; its prompt and generated tokens are prefilled again on readmission
  swap       copied to the host tier when it has room (else recompute)
  auto       the cheaper by the cost model: swap when swap_s(blocks) < recompute_s(tokens)
             and the host tier has room, where swap_s is a copy out plus a copy back in
"""
import dataclasses
from typing import List, Optional, Tuple

from pagedjax.host import policies
from pagedjax.host.scheduling.allocator import BlockAllocator
from pagedjax.host.scheduling.block_manager import BlockManager
from pagedjax.host.scheduling.lanes import Lanes
from pagedjax.host.requests.sequence import Sequence, Status
from pagedjax.host.tiers.tier_cost import TierCosts

PREEMPTION_POLICIES = ('recompute', 'swap', 'auto')


@dataclasses.dataclass
class Plan:
  """One iteration's work order, in the order the executor does it:

    1. gather   swap_out's device blocks (to the swap store) and `demotions` (to the KV tiers),
                then offload_out's (to the offload store): before anything below writes
    2. copy     `copies` (copy-on-write) and `tier_copies` (tier-1 hits), in one call
    3. scatter  swap_in's host blocks and `promotions` (from the KV tiers), in one call
    4. step     `rows`: the prompt chunks, then the decodes, then the offloaded rows
  preempted, forked and lanes record what the scheduler changed on the host (the update step
  counts them); memory_blocked feeds the memory figures (metrics.py)."""
  # (device blocks, host blocks) of every sequence swapped out now / swapped in now
  swap_out: List[Tuple[List[int], List[int]]] = dataclasses.field(default_factory=list)
  swap_in: List[Tuple[List[int], List[int]]] = dataclasses.field(default_factory=list)
  rows: List[Tuple[Sequence, int]] = dataclasses.field(default_factory=list)  # (seq, tokens)
  preempted: List[Tuple[Sequence, str]] = dataclasses.field(default_factory=list)  # (seq, policy)
  memory_blocked: bool = False  # the waiting head found too few free blocks to be admitted
  copies: List[Tuple[int, int]] = dataclasses.field(default_factory=list)  # copy-on-write
  # (shared block, private copy), made on the device after swap-out, before the steps
  forked: List[Sequence] = dataclasses.field(default_factory=list)  # samples split off now
  # (device block, host block) of every block an offloaded sequence moves out of its window now
  # (host/scheduling/offload.py), copied out with the swap-outs, before anything is written
  offload_out: List[Tuple[int, int]] = dataclasses.field(default_factory=list)
  # KV tiers (host/tiers/kv_tiers.py): blocks to copy down (kv_tiers.Demotion), device copies
  # of blocks evicted this iteration and found again (source, destination), and blocks to load
  # up before the steps (kv_tiers.Promotion)
  demotions: list = dataclasses.field(default_factory=list)
  tier_copies: List[Tuple[int, int]] = dataclasses.field(default_factory=list)
  promotions: list = dataclasses.field(default_factory=list)
  lanes: List[Tuple[Sequence, int]] = dataclasses.field(default_factory=list)  # handed out now

  @property
  def num_prefill_tokens(self) -> int:
    return sum(n for _, n in self.rows if n > 1)

  @property
  def num_decode_tokens(self) -> int:
    return sum(1 for _, n in self.rows if n == 1)


def _fcfs(seq: Sequence):
  return seq.order


def _insert(queue: List[Sequence], seq: Sequence, order=_fcfs) -> None:
  """Insert keeping the queue sorted by `order` (queues are short; a sort is the clearest way)."""
  queue.append(seq)
  queue.sort(key=order)


class Scheduler:

  def __init__(self, blocks: BlockManager, *, max_batch_size: int, max_num_batched_tokens: int,
               prefill_chunk: int, preemption: str = 'recompute', victim: str = 'newest',
               admission: str = 'watermark', admission_horizon: int = 0,
               queue_order: str = 'fcfs', host_allocator: Optional[BlockAllocator] = None,
               cost: Optional[TierCosts] = None, offload=None):
    """victim, admission, queue_order: policy names or 'module:function' (policies.py).
    host_allocator: bookkeeping of the host tier's blocks (swap and auto preemption).
    cost: the cost model (preemption 'auto', victim 'cost'). admission_horizon: tokens ahead
    that 'projected' admission looks (0 = each sequence's whole max_new_tokens).
    offload: host/scheduling/offload.py's Offload, which sequences with a window (Sequence.window) use."""
    if preemption not in PREEMPTION_POLICIES:
      raise ValueError(f'preemption {preemption!r} is not allowed: one of {PREEMPTION_POLICIES}')
    self._choose_victim = policies.VICTIM.get(victim)
    self._admits = policies.ADMISSION.get(admission)
    self._order = policies.QUEUE_ORDER.get(queue_order)
    if preemption != 'recompute' and host_allocator is None:
      raise ValueError(f'{preemption} preemption needs a host tier (host_allocator)')
    if cost is None and (preemption == 'auto' or victim == 'cost'):
      raise ValueError('preemption auto and victim cost need a cost model (cost)')
    if max_num_batched_tokens < max_batch_size:
      raise ValueError(f'max_num_batched_tokens={max_num_batched_tokens} is not allowed: at '
                       f'least max_batch_size={max_batch_size}, so every decode fits a step')
    self.blocks = blocks
    self.max_batch_size = max_batch_size
    self.max_num_batched_tokens = max_num_batched_tokens
    self.prefill_chunk = prefill_chunk
    self.preemption, self.victim, self.cost = preemption, victim, cost
    self.admission, self.admission_horizon = admission, admission_horizon
    self.queue_order = queue_order
    self.prefill_cap: Optional[int] = None  # prompt tokens per iteration at most (a throttle)
    self.iterations = 0  # plans made (offload.decode_every counts them)
    self.host = host_allocator
    self.offload = offload
    self.lanes = Lanes(max_batch_size)  # a running sequence's row in per-sequence device state
    self.waiting: List[Sequence] = []
    self.running: List[Sequence] = []
    self.swapped: List[Sequence] = []

  def add(self, seq: Sequence) -> None:
    seq.status = Status.WAITING
    _insert(self.waiting, seq, self._order)

  def has_work(self) -> bool:
    return bool(self.waiting or self.running or self.swapped)

  def finish(self, seq: Sequence, now: float) -> None:
    """seq is done (or a beam was dropped): its blocks and lane go back."""
    self.running.remove(seq)
    self.blocks.end_turn(seq, now)
    if seq.window:  # its window's full blocks join the offloaded prefix index (offload.py)
      self.offload.keep_window(seq)
    self.blocks.deallocate(seq)
    if seq.window:
      self.offload.release(seq)
    self.lanes.release(seq)

  def fork_running(self, parent: Sequence, child: Sequence) -> None:
    """A beam kept more than once (beam.py): child shares parent's blocks and runs beside it.
    Its batch row is one its group reserved at admission (Sequence.extra_rows)."""
    self.blocks.fork(parent, child)
    if parent.window:
      self.offload.fork(parent, child)
    child.status = Status.RUNNING
    _insert(self.running, child)

  def _rows_used(self) -> int:
    return sum(s.width for s in self.running)

  # ---- one iteration ---------------------------------------------------------------------

  def schedule(self) -> Plan:
    plan = Plan()
    self.iterations += 1
    resting = ({id(s) for s in self.offload.resting(self.running, self.iterations)}
               if self.offload is not None else set())
    self._fork_ready(plan)
    self._reserve_decode_slots(plan, resting)
    if not plan.preempted:
      self._swap_in(plan)
    budget = self.max_num_batched_tokens
    for seq in self.running:  # decodes first: one token each
      if seq.num_pending == 1 and not seq.forks and id(seq) not in resting:
        plan.rows.append((seq, 1))
        budget -= 1
    if self.prefill_cap is not None:
      budget = min(budget, self.prefill_cap)
    for seq in self.running:  # then prompts already under way
      # (a leader's last chunk may be one token: it is not a decode, its forks sample instead)
      if seq.num_to_prefill > (0 if seq.forks else 1) and budget > 0:
        budget -= self._add_chunk(plan, seq, budget)
    if not plan.preempted and not self.swapped:
      # A throttle never starves an idle engine: with nothing running, one chunk goes in.
      self._admit(plan, budget if self.running else max(budget, 1))
    self._hand_out_lanes(plan)
    self._take_tier_work(plan)
    if self.offload is not None:
      self.offload.take_pending(plan)
    return plan

  def _hand_out_lanes(self, plan: Plan) -> None:
    for seq, _ in plan.preempted:
      self.lanes.release(seq)
    plan.lanes = self.lanes.assign(self.running)

  def _take_tier_work(self, plan: Plan) -> None:
    """Everything the KV tiers queued since the last plan becomes this plan's (module docstring,
    step 6): nothing the executor runs comes from anywhere else."""
    tiers = self.blocks.tiers
    if tiers is not None:
      plan.demotions = tiers.take_demotions()
      plan.tier_copies = tiers.take_copies()
      plan.promotions = tiers.take_promotions()

  def _fork_ready(self, plan: Plan) -> None:
    for seq in list(self.running):
      if seq.forks and seq.num_pending == 1:
        for child in seq.forks:
          self.blocks.fork(seq, child)
          if seq.window:
            self.offload.fork(seq, child)
          child.status = Status.RUNNING
          _insert(self.running, child)
          plan.forked.append(child)
        seq.forks = []

  def _reserve_decode_slots(self, plan: Plan, resting: set) -> None:
    """resting: ids of the offloaded sequences sitting this iteration out."""
    for seq in list(self.running):
      if seq.status is not Status.RUNNING or seq.num_pending != 1:
        continue  # preempted a moment ago, or mid-prompt (its blocks came at admission)
      if id(seq) in resting:
        continue  # an offloaded decode sitting this iteration out (offload.decode_every)
      if seq.window:  # offloaded: its window's oldest block moves out when a new one is due
        self.offload.make_room(seq, seq.num_tokens, plan)
      while not self.blocks.can_append(seq):
        if self.offload is not None and self.offload.relieve(self.running, plan):
          continue  # a long sequence shrank to its window instead of anyone being preempted
        self._preempt(self._victim(), plan)
        if seq.status is not Status.RUNNING:
          break
      else:
        copy = self.blocks.may_append(seq)
        if copy:
          plan.copies.append(copy)

  def _head_unit(self, queue: List[Sequence]) -> List[Sequence]:
    """The queue's head and, for a beam, its siblings in the same queue: beams decode in
    lockstep, so they come back together or not at all (one beam running while its sibling
    waits for the blocks that beam holds would stall the group for good)."""
    head = queue[0]
    if head.beam is None:
      return [head]
    return [s for s in queue if s.beam is head.beam]

  def _fits(self, unit: List[Sequence], waiting: bool) -> bool:
    if len(unit) == 1:
      fits = self.blocks.can_allocate_waiting if waiting else self.blocks.can_allocate
      return fits(unit[0], watermark=bool(self.running))
    return self.blocks.can_allocate_all(unit, watermark=bool(self.running))

  def _swap_in(self, plan: Plan) -> None:
    while self.swapped:
      unit = self._head_unit(self.swapped)
      if (self._rows_used() + sum(s.width for s in unit) > self.max_batch_size or
          not self._fits(unit, waiting=False)):
        break
      for seq in unit:
        self.swapped.remove(seq)
        device = self.blocks.allocate(seq)
        if seq.host_blocks:
          plan.swap_in.append((seq.host_blocks, device[:len(seq.host_blocks)]))
        # Freed now, copied by the engine before anything reuses them: no swap-out happens in
        # an iteration that swaps in (step 2 runs only when step 1 preempted nobody).
        self.host.free(seq.host_blocks)
        seq.host_blocks = []
        seq.status = Status.RUNNING
        _insert(self.running, seq)

  def _admit(self, plan: Plan, budget: int) -> None:
    while self.waiting and budget > 0:
      unit = self._head_unit(self.waiting)
      if self._rows_used() + sum(s.width for s in unit) > self.max_batch_size:
        break
      if not self._fits(unit, waiting=True) or not self._admits(self, unit) or (
          unit[0].window and not self.offload.can_reserve(unit[0])):
        plan.memory_blocked = True
        break
      for seq in unit:
        self.waiting.remove(seq)
        if seq.window:
          self.offload.reserve(seq)
        self.blocks.allocate_waiting(seq)
        seq.status = Status.RUNNING
        _insert(self.running, seq)
        budget -= self._add_chunk(plan, seq, budget)

  def _add_chunk(self, plan: Plan, seq: Sequence, budget: int) -> int:
    """Adds seq's next prompt chunk (none for a leader whose forks are due); returns its size.
    A non-leader with one pending token goes as a one-token row, like a decode."""
    n = min(seq.num_to_prefill if seq.forks else seq.num_pending, self.prefill_chunk, budget)
    if n > 0 and seq.window:
      # An offloaded prompt holds only its window: a chunk is at most what the window holds
      # once its written blocks are out; older blocks move out, then the chunk's new ones come
      # (none free while others hold the blocks moved out: the chunk waits).
      n = min(n, self.offload.chunk_room(seq))
      self.offload.make_room(seq, seq.num_cached + n, plan)
      if not self.blocks.can_allocate(seq, watermark=False):
        return 0
      self.blocks.allocate(seq)
    if n > 0:
      plan.rows.append((seq, n))
    return n

  # ---- preemption ------------------------------------------------------------------------

  def _unit(self, seq: Sequence) -> List[Sequence]:
    """seq and, for a beam, its running siblings (beams come back together, see _head_unit)."""
    return [seq] if seq.beam is None else [s for s in self.running if s.beam is seq.beam]

  def _swap_blocks(self, unit: List[Sequence]) -> int:
    return sum(self.blocks.blocks_for(s.num_cached) for s in unit)

  def _swaps(self, unit: List[Sequence]) -> bool:
    """Whether preempting unit swaps it (the policy, the host tier's room and, for 'auto', the
    cost model) rather than recomputing it."""
    n = self._swap_blocks(unit)
    if self.preemption == 'recompute' or any(s.window for s in unit) or (
        not self.host.can_allocate(n)):  # an offloaded sequence is recomputed, never swapped
      return False
    return self.preemption == 'swap' or self.cost.swap_s(n) < self.cost.recompute_tokens_s(
        sum(s.num_cached for s in unit))

  def cost_s(self, seq: Sequence) -> float:
    """Seconds preempting seq (with its beam siblings) would cost by the cost model."""
    return self._cost_s(self._unit(seq))

  def _cost_s(self, unit: List[Sequence]) -> float:
    """Seconds preempting unit costs, as _preempt would do it (the cost model's figures)."""
    if self._swaps(unit):
      return self.cost.swap_s(self._swap_blocks(unit))
    return self.cost.recompute_tokens_s(sum(s.num_cached for s in unit))

  def _victim(self) -> Sequence:
    """The running sequence the victim policy preempts next; never the oldest while others
    run (the oldest always progresses)."""
    candidates = self.running[1:] or self.running
    seq = self._choose_victim(self, candidates)
    if not any(s is seq for s in candidates):
      raise ValueError(f'victim policy {self.victim!r} chose request {seq.request_id}, which is '
                       'not one of the candidates it was given')
    return seq

  def _preempt(self, seq: Sequence, plan: Plan) -> None:
    """Swap when the policy says so (auto: when the cost model finds it cheaper) and the host
    tier has room; otherwise recompute. A beam's running siblings go with it."""
    unit = self._unit(seq)
    # A group swaps only if the host tier holds all of it: half swapped, half waiting, its beams
    # could come back at different times.
    swap = self._swaps(unit)
    for member in unit:
      self._preempt_one(member, plan, swap)

  def stalled_unit(self) -> List[Sequence]:
    """What to fail when nothing progresses: the waiting head, else the swapped head, else the
    newest running sequence; with its beam siblings or not yet forked samples."""
    queue = next(q for q in (self.waiting, self.swapped, self.running[::-1]) if q)
    head = queue[0]
    if head.beam is None:
      return [head] + head.forks
    return [s for q in (self.waiting, self.swapped, self.running) for s in q
            if s.beam is head.beam]

  def abort(self, seq: Sequence) -> None:
    """Takes seq out of whichever queue holds it and frees its device and host blocks."""
    for queue in (self.waiting, self.running, self.swapped):
      if seq in queue:
        queue.remove(seq)
    self.blocks.deallocate(seq)
    if seq.window:
      self.offload.release(seq)
    if seq.host_blocks:
      self.host.free(seq.host_blocks)
      seq.host_blocks = []
    self.lanes.release(seq)

  def _preempt_one(self, seq: Sequence, plan: Plan, swap: bool) -> None:
    self.running.remove(seq)
    seq.num_preemptions += 1
    # Its copy-on-write copies of this iteration are void: their targets go back to the pool.
    # Until those copies run, the shared originals hold its data (swap-out reads them).
    undone = {new: old for old, new in plan.copies if new in seq.block_table}
    plan.copies = [c for c in plan.copies if c[1] not in undone]
    if swap and self._swap_out(seq, plan, undone):
      plan.preempted.append((seq, 'swap'))
      return
    self.blocks.deallocate(seq)
    if seq.window:
      self.offload.release(seq, plan)
    seq.num_cached = 0  # prompt and generated tokens are prefilled again on readmission
    self.add(seq)
    plan.preempted.append((seq, 'recompute'))

  def _swap_out(self, seq: Sequence, plan: Plan, undone) -> bool:
    n = self.blocks.blocks_for(seq.num_cached)
    if not self.host.can_allocate(n):
      return False
    seq.host_blocks = self.host.allocate(n)
    if n:
      # The device blocks are free for others from now on; the engine copies them out before
      # this iteration's copies and steps write anything.
      plan.swap_out.append(([undone.get(b, b) for b in seq.block_table[:n]], seq.host_blocks))
    self.blocks.deallocate(seq)
    seq.status = Status.SWAPPED
    _insert(self.swapped, seq)
    return True
