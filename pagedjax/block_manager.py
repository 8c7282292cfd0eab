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
"""
import math
from typing import List

from pagedjax.allocator import BlockAllocator
from pagedjax.sequence import Sequence

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
    self.reserve_blocks = self.blocks_for(max_seq_len)
    if kind == 'contiguous' and self.reserve_blocks > allocator.num_blocks - 1:
      raise ValueError(
          f'a contiguous pool reserves {self.reserve_blocks} blocks of {block_size} tokens '
          f'(max_seq_len {max_seq_len}) per sequence, but the pool has only '
          f'{allocator.num_blocks - 1}: raise num_blocks or lower max_seq_len')
    # A reservation never grows, so contiguous admission needs no headroom.
    self.watermark_blocks = watermark_blocks if kind == 'paged' else 0

  def blocks_for(self, num_tokens: int) -> int:
    return math.ceil(num_tokens / self.block_size)

  def _short(self, seq: Sequence) -> int:
    """Blocks seq lacks to hold all its tokens (cached and pending)."""
    want = self.reserve_blocks if self.kind == 'contiguous' else self.blocks_for(seq.num_tokens)
    return max(0, want - len(seq.block_table))

  def can_allocate(self, seq: Sequence, watermark: bool = True) -> bool:
    """Room to (re)admit seq with blocks for all its tokens (contiguous: its reservation)."""
    headroom = self.watermark_blocks if watermark else 0
    return self.allocator.can_allocate(self._short(seq) + headroom)

  def allocate(self, seq: Sequence) -> List[int]:
    """Gives seq its missing blocks; returns them (swap-in fills the first ones)."""
    new = self.allocator.allocate(self._short(seq))
    seq.block_table += new
    return new

  def can_append(self, seq: Sequence) -> bool:
    """Room for seq's pending token(s): a slot in its last block, or a free block."""
    return self.allocator.can_allocate(self._short(seq))

  def may_append(self, seq: Sequence) -> None:
    self.allocate(seq)

  def deallocate(self, seq: Sequence) -> None:
    self.allocator.free(seq.block_table)
    seq.block_table = []

  def visible_table(self, seq: Sequence, num_tokens: int) -> List[int]:
    """The blocks holding seq's first num_tokens tokens: what a step's kernels read."""
    return seq.block_table[:self.blocks_for(num_tokens)]
