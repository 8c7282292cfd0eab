import random

import numpy as np
import pytest

from pagedjax.host.scheduling.allocator import AllocationError, BlockAllocator, FreeIds


def test_null_block_is_never_handed_out():
  alloc = BlockAllocator(5)
  assert alloc.num_free == 4
  assert sorted(alloc.allocate(4)) == [1, 2, 3, 4]
  assert alloc.num_free == 0 and not alloc.can_allocate(1)
  with pytest.raises(AllocationError, match='asked for 1 blocks, only 0 free'):
    alloc.allocate(1)


def test_freed_blocks_return_and_refcounts():
  alloc = BlockAllocator(8, shuffle_seed=3)
  a = alloc.allocate(3)
  b = alloc.allocate(2)
  alloc.share(a[0])
  assert alloc.ref_count(a[0]) == 2
  alloc.free(a)
  assert alloc.num_free == 7 - 2 - 1  # a[0] still held by its second holder
  alloc.free([a[0]])
  alloc.free(b)
  assert alloc.num_free == 7
  assert all(alloc.ref_count(i) == 0 for i in range(1, 8))


def test_double_free_and_bad_ids_raise():
  alloc = BlockAllocator(4)
  (blk,) = alloc.allocate(1)
  alloc.free([blk])
  with pytest.raises(ValueError, match=f'double free of block {blk}'):
    alloc.free([blk])
  for bad in (0, 4, -1, 2.5, '1'):
    with pytest.raises(ValueError, match='out of range'):
      alloc.free([bad])
  with pytest.raises(ValueError, match='is free and cannot be shared'):
    alloc.share(1)
  assert alloc.num_free == 3  # failed calls left the free list intact
  with pytest.raises(ValueError, match='at least 2'):
    BlockAllocator(1)


def test_numpy_ids_accepted():
  alloc = BlockAllocator(4)
  blocks = np.asarray(alloc.allocate(2))
  alloc.free(blocks)
  assert alloc.num_free == 3


def test_a_huge_allocator_costs_memory_per_block_used():
  """10^12 blocks: nothing is built per block (a list of them would take terabytes)."""
  alloc = BlockAllocator(10**12)
  blocks = alloc.allocate(3)
  assert blocks == [1, 2, 3] and alloc.num_free == 10**12 - 4
  alloc.free([blocks[1]])
  assert alloc.allocate(2) == [2, 4]  # the returned block first, then the next never used


@pytest.mark.parametrize('seed', [None, 0, 1])
def test_free_ids_hand_out_each_id_once_in_any_order(seed):
  rng = None if seed is None else random.Random(seed)
  free = FreeIds(1, 40, rng)
  taken = [free.pop() for _ in range(20)]
  free.push(taken.pop(3))
  rest = list(free)
  assert len(rest) == len(free) == 20
  assert sorted(taken + rest) == list(range(1, 40))
  drained = [free.pop() for _ in range(len(free))]
  assert sorted(taken + drained) == list(range(1, 40)) and len(free) == 0
  with pytest.raises(IndexError):
    free.pop()
  if seed is not None:
    assert taken != sorted(taken)  # shuffled


def test_free_ids_take_removes_restored_ids():
  free = FreeIds(0, 10)
  assert free.pop() == 0
  free.push(0)
  free.take([0, 5, 7])
  assert sorted(free) == [1, 2, 3, 4, 6, 8, 9] and len(free) == 7
  assert [free.pop() for _ in range(7)] == [1, 2, 3, 4, 6, 8, 9]
