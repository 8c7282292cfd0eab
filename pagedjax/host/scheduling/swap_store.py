"""The swap store: numpy copies in host RAM of the blocks a swap preemption moves off the device.

(Not a KV tier: the KV tiers, host/tiers/, hold cached prefix blocks any request may hit; the
swap store holds one preempted sequence's blocks until it resumes.)

Which host block holds what is the scheduler's bookkeeping, through `allocator`; this class only
stores and returns block contents. It is created from the pool's per-block array shapes
(`KVPool.block_array_shapes()`: field name -> (shape, dtype) with the block axis at 1), so it
holds codes, scales and zero points exactly as the device stores them. The device side of a
transfer (one jitted gather or scatter per iteration) is pagedjax/device/block_transfer.py.
A size that does not fit in host RAM is refused before anything is allocated (capacity.py).
"""
from typing import Dict, Sequence, Tuple

import numpy as np

from pagedjax.host import capacity
from pagedjax.host.scheduling.allocator import BlockAllocator


def block_nbytes(block_array_shapes: Dict[str, Tuple[tuple, np.dtype]]) -> int:
  """Bytes one block takes in host arrays laid out like the pool (block axis 1)."""
  return sum(int(np.prod((shape[0],) + tuple(shape[2:]))) * np.dtype(dtype).itemsize
             for shape, dtype in block_array_shapes.values())


class SwapStore:
  """Host-RAM block storage laid out like the pool (block axis 1); `allocator` hands out its ids."""

  def __init__(self, block_array_shapes: Dict[str, Tuple[tuple, np.dtype]], num_blocks: int,
               field: str = 'scheduler.swap_blocks'):
    """num_blocks: host blocks to hold; host block 0 stays unused, like the device's null block.
    field: the config field num_blocks comes from, named by the error when it does not fit."""
    capacity.check_blocks_fit(field, num_blocks, block_nbytes(block_array_shapes),
                              capacity.host_memory_available(), 'host RAM')
    self.allocator = BlockAllocator(num_blocks + 1)
    self._store = {name: np.zeros((shape[0], num_blocks + 1) + tuple(shape[2:]), dtype)
                   for name, (shape, dtype) in block_array_shapes.items()}

  def store(self, host_ids: Sequence[int], data: Dict[str, np.ndarray]) -> None:
    """Writes data[name][:, i] into host block host_ids[i] (data may carry padding columns)."""
    for name, array in self._store.items():
      array[:, list(host_ids)] = np.asarray(data[name])[:, :len(host_ids)]

  def load(self, host_ids: Sequence[int], padded_len: int) -> Dict[str, np.ndarray]:
    """Field name -> [layers, padded_len, ...]: the blocks host_ids, padded with host block 0."""
    rows = np.zeros(padded_len, np.int64)
    rows[:len(host_ids)] = host_ids
    return {name: array[:, rows] for name, array in self._store.items()}
