import numpy as np
import pytest

from pagedjax.host.allocator import AllocationError, BlockAllocator


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
