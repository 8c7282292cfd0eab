"""Which device blocks each sequence holds: the one place the paged and contiguous caches differ.

  paged       a sequence holds blocks only for the tokens it has: its prompt's at admission, then
              one more whenever decoding fills the last one (vLLM).
  contiguous  a sequence reserves ceil(max_seq_len / block_size) blocks at admission, i.e.
              max_seq_len slots, and never grows, as pre-paging systems (FasterTransformer, Orca)
              did. The reserved blocks need not be adjacent in the pool: every reservation has the
              same size, so a pool cut into equal regions would not fragment externally either,
              and scattered blocks hold exactly as many sequences.

Both hand the kernels only the blocks that hold tokens (`visible_table`), so a comparison of the
two runs the same model, scheduler and kernels and isolates the cache design.

Sharing (either kind):
  prefix cache  at admission, a prompt's leading full blocks found in the cache (prefix_cache.py,
                radix_cache.py)
                are taken instead of allocated, and their tokens count as cached, so prefill
                skips them. At most num_tokens - 1 tokens are taken: the last prompt token must
                run to give logits to sample from. Blocks that fill up are offered to the cache.
  offloaded     a sequence that will be offloaded (a window; host/scheduling/offload.py) may
                find its prefix among the offload store's indexed blocks instead
                (offload_index.py): when that covers more blocks than the device cache, it
                takes those as its leading host blocks, and their tokens count as cached.
  lower tiers   with host-RAM / disk tiers under the cache (kv_tiers.py), the lookup continues
                past the device hits; the blocks found there that the cost model says to load
                get fresh device blocks, filled by the executor before this iteration's steps,
                and their tokens count as cached too.
  fork          a child shares every block of its parent (ref count +1 each).
  copy-on-write before a sequence writes into a block someone else also holds, it takes a new
                block and the plan records (old, new); the engine copies all of an iteration's
                pairs in one jitted call before the step writes. A shared block is never written.
"""
import math
from typing import List, Optional, Tuple

from pagedjax.host.scheduling.allocator import BlockAllocator
from pagedjax.host.requests.sequence import Sequence

KINDS = ('paged', 'contiguous')


class BlockManager:

  def __init__(self, allocator: BlockAllocator, block_size: int, kind: str, max_seq_len: int,
               watermark_blocks: int = 0):
    """watermark_blocks: free blocks paged admission leaves for running sequences to grow into,
    so that a new request does not force a preemption on the very next step."""
    if kind not in KINDS:
      raise ValueError(f'pool kind {kind!r} is not allowed: one of {KINDS}')
    self.allocator = allocator
    self.block_size = block_size
    self.kind = kind
    self.max_seq_len = max_seq_len
    self.reserve_blocks = self.blocks_for(max_seq_len)
    if kind == 'contiguous' and self.reserve_blocks > allocator.num_blocks - 1:
      raise ValueError(
          f'a contiguous pool reserves {self.reserve_blocks} blocks of {block_size} tokens '
          f'(max_seq_len {max_seq_len}) per sequence, but the pool has only '
          f'{allocator.num_blocks - 1}: raise num_blocks or lower max_seq_len')
    # A reservation never grows, so contiguous admission needs no headroom.
    self.watermark_blocks = watermark_blocks if kind == 'paged' else 0
    self.offload = None  # host/scheduling/offload.Offload, when the engine offloads (it sets it)

  def blocks_for(self, num_tokens: int) -> int:
    return math.ceil(num_tokens / self.block_size)

  def _short(self, seq: Sequence) -> int:
    """Blocks seq lacks to hold all its tokens (cached and pending); an offloaded sequence
    (host/scheduling/offload.py) holds those not in host RAM, at most its window of them."""
    want = self.reserve_blocks if self.kind == 'contiguous' else self.blocks_for(seq.num_tokens)
    want -= len(seq.host_table)
    if seq.window:
      want = min(want, seq.window)
    return max(0, want - len(seq.block_table))

  @property
  def cache(self):
    return self.allocator.cache

  @property
  def usable_blocks(self) -> int:
    """Blocks sequences may hold: the pool but the null block and pinned idle blocks."""
    pinned = self.cache.num_pinned_idle if self.cache is not None else 0
    return self.allocator.num_blocks - 1 - pinned

  @property
  def tiers(self):
    """The lower KV tiers under the prefix cache (kv_tiers.KVTiers), or None."""
    return self.cache.lower if self.cache is not None else None

  def can_allocate(self, seq: Sequence, watermark: bool = True) -> bool:
    """Room to (re)admit seq with blocks for all its tokens (contiguous: its reservation)."""
    headroom = self.watermark_blocks if watermark else 0
    return self.allocator.can_allocate(self._short(seq) + headroom)

  def can_allocate_all(self, seqs: List[Sequence], watermark: bool = True) -> bool:
    """Room for every one of seqs at once (a beam group coming back), prefix hits not counted."""
    headroom = self.watermark_blocks if watermark else 0
    return self.allocator.can_allocate(sum(self._short(s) for s in seqs) + headroom)

  def allocate(self, seq: Sequence) -> List[int]:
    """Gives seq its missing blocks; returns them (swap-in fills the first ones)."""
    new = self.allocator.allocate(self._short(seq))
    seq.block_table += new
    return new

  # ---- prefix cache ----------------------------------------------------------------------

  def _prefix_hits(self, seq: Sequence) -> List[int]:
    if self.cache is None or seq.block_table:
      return []
    # Never the whole prompt: its last token must run to be sampled from.
    return self.cache.match(seq, (seq.num_tokens - 1) // self.block_size)

  def _offloaded_hits(self, seq: Sequence, device_hits: List[int]) -> List[int]:
    """The offload store's blocks of seq's prefix, when they cover more than device_hits."""
    if self.offload is None:
      return []
    hits = self.offload.prefix_hits(seq, (seq.num_tokens - 1) // self.block_size)
    return hits if len(hits) > len(device_hits) else []

  def can_allocate_waiting(self, seq: Sequence, watermark: bool = True) -> bool:
    """can_allocate for a waiting sequence, counting the blocks its cached prefix provides
    (an evictable hit is taken out of the free space, a held one costs nothing; a prefix taken
    from the offload store provides no device block)."""
    hits = self._prefix_hits(seq)
    if self._offloaded_hits(seq, hits):
      hits = []
    revived = sum(self.allocator.ref_count(b) == 0 for b in hits)
    headroom = self.watermark_blocks if watermark else 0
    return self.allocator.can_allocate(self._short(seq) - len(hits) + revived + headroom)

  def allocate_waiting(self, seq: Sequence) -> List[int]:
    """allocate for a waiting sequence: takes its cached prefix first (so allocating the rest
    cannot evict it), marks those tokens cached, then allocates the rest."""
    hits = self._prefix_hits(seq)
    n = (seq.num_tokens - 1) // self.block_size
    offloaded = self._offloaded_hits(seq, hits)
    if offloaded:
      self.offload.adopt(seq, offloaded)
      self.cache.record_lookup(n, len(offloaded), seq.num_tokens)
      seq.num_cached, seq.num_offered = len(offloaded) * self.block_size, 0
      return self.allocate(seq)
    for b in hits:
      self.allocator.take_cached(b)
    if self.cache is not None:
      self.cache.record_lookup(n, len(hits), seq.num_tokens)
    seq.block_table = list(hits)
    seq.num_cached, seq.num_offered = len(hits) * self.block_size, len(hits)
    if self.tiers is not None and len(hits) < n:
      self._promote(seq, n)
    return self.allocate(seq)

  def _promote(self, seq: Sequence, n: int) -> None:
    """Continues seq's cached prefix below the device, up to its block n - 1 (kv_tiers.py)."""
    start = len(seq.block_table)
    found = self.tiers.find(seq, start, n)
    if found:
      # Fresh blocks: the data found below is copied out (tier 2) or pinned (tier 3) already,
      # so evictions these allocations cause cannot take it away.
      blocks = self.allocator.allocate(len(found))
      seq.block_table += blocks
      seq.num_cached += len(found) * self.block_size
      self.tiers.promote(seq, start, blocks, found)

  def offer_full_blocks(self, seq: Sequence) -> None:
    """Offers seq's newly filled blocks to the prefix cache (after the step that wrote them)."""
    if self.cache is None or seq.host_table:  # offloaded blocks are not offered (offload.py)
      return
    n = min(seq.num_cached // self.block_size, len(seq.block_table))
    if seq.num_offered >= n:
      return
    self.cache.offer(seq, n)
    seq.num_offered = n

  def end_turn(self, seq: Sequence, now: float) -> None:
    """seq, a turn of a session, finished: its cached blocks become the session's (before
    deallocate releases them, sessions.py)."""
    if seq.params.session_id is not None and self.cache is not None:
      # A block another sequence still holds (a shared system prompt) is not the session's own.
      own = [b for b in seq.block_table[:seq.num_offered] if self.allocator.ref_count(b) == 1]
      self.cache.end_turn(seq.params.session_id, own, now)

  def demote_idle_sessions(self, now: float) -> int:
    """Evicts, as a unit, the idle device blocks of every session idle past its timeout
    (sessions.py); returns the blocks freed."""
    freed = 0
    for session, blocks in (self.cache.idle_session_blocks(now) if self.cache else ()):
      n = self.allocator.evict_now(blocks)
      self.cache.sessions.demoted(session, n)
      freed += n
    return freed

  # ---- appends, copy-on-write, forks -----------------------------------------------------

  def _needs_copy(self, seq: Sequence) -> bool:
    """The block seq writes next exists and is shared: it must be copied first."""
    i = seq.num_cached // self.block_size - len(seq.host_table)
    return i < len(seq.block_table) and self.allocator.ref_count(seq.block_table[i]) > 1

  def can_append(self, seq: Sequence) -> bool:
    """Room for seq's pending token(s): a slot in its last block, or a free block (and one
    more for the copy when that slot lies in a shared block)."""
    return self.allocator.can_allocate(self._short(seq) + self._needs_copy(seq))

  def may_append(self, seq: Sequence) -> Optional[Tuple[int, int]]:
    """Makes room for seq's pending token; returns (shared block, its private copy) when the
    write must go to a copy, which the engine makes on the device before the step."""
    self.allocate(seq)
    if not self._needs_copy(seq):
      return None
    i = seq.num_cached // self.block_size - len(seq.host_table)
    old, (new,) = seq.block_table[i], self.allocator.allocate(1)
    seq.block_table[i] = new
    self.allocator.free([old])
    # A block nobody has written yet (a prompt's last block allocated at admission, or a
    # contiguous reservation) needs a new block but nothing copied into it.
    return (old, new) if seq.num_cached % self.block_size else None

  def fork(self, parent: Sequence, child: Sequence) -> None:
    """child holds every block of parent (its prompt and progress are parent's)."""
    for b in parent.block_table:
      self.allocator.share(b)
    child.block_table = list(parent.block_table)
    child.num_cached, child.num_offered = parent.num_cached, parent.num_offered
    child.block_keys = list(parent.block_keys)

  def deallocate(self, seq: Sequence) -> None:
    # Tail first: with a cache, a prefix's later blocks then become evictable before its
    # earlier ones, so LRU never evicts a block whose descendants stay cached but unreachable.
    self.allocator.free(seq.block_table[::-1] if self.cache else seq.block_table)
    seq.block_table = []
    seq.num_offered = 0

  def visible_table(self, seq: Sequence, num_tokens: int) -> List[int]:
    """The blocks holding seq's first num_tokens tokens: what a step's kernels read."""
    return seq.block_table[:self.blocks_for(num_tokens)]
