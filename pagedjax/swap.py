"""The host-RAM tier behind swap preemption: numpy copies of swapped-out blocks.

Which host block holds what is the scheduler's bookkeeping (through `allocator`); this module
only moves data, batched per iteration: every block swapped out in an iteration leaves in one
jitted gather, every block swapped in arrives in one jitted scatter with the pool donated, so
it is updated in place (a non-donated pool update copies the whole pool). Block counts are
padded to power-of-two buckets, padding reading from and writing into the null block 0 (whose
contents are garbage by design, see pool.py), so a run compiles a handful of copy programs.

Every array leaf of the pool is copied with its block axis at 1 (k and v, and any per-block
arrays such as quantization scales stored the same way), so the tier needs no change when the
pool grows a field.
"""
import functools
from typing import List, Sequence as Seq, Tuple

import jax
import numpy as np

from pagedjax.allocator import BlockAllocator
from pagedjax.pool import NULL_BLOCK
from pagedjax.step_inputs import bucket, power_of_two_buckets

Copies = Seq[Tuple[List[int], List[int]]]  # (source blocks, destination blocks) per sequence

# Traces of the two copy programs, module-wide: jit caches them per shape for the whole process,
# so engines of one pool shape (a sweep's points, the tests) compile each bucket once.
_traces = [0]


@jax.jit
def _gather(leaves, ids):
  _traces[0] += 1  # trace time only
  return [x[:, ids] for x in leaves]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(leaves, ids, data):
  _traces[0] += 1
  return [x.at[:, ids].set(d) for x, d in zip(leaves, data)]


class HostTier:

  def __init__(self, pool, num_blocks: int):
    """num_blocks: host blocks to hold; host block 0 stays unused, like the device's null block."""
    leaves, self._treedef = jax.tree.flatten(pool)
    device_blocks = leaves[0].shape[1]
    for leaf in leaves:
      if leaf.ndim < 2 or leaf.shape[1] != device_blocks:
        raise ValueError(f'pool leaf of shape {leaf.shape}: the host tier needs every leaf to '
                         f'have the block axis ({device_blocks} blocks) at position 1')
    self.allocator = BlockAllocator(num_blocks + 1)
    self._host = [np.zeros((x.shape[0], num_blocks + 1) + x.shape[2:], x.dtype) for x in leaves]
    self._buckets = power_of_two_buckets(max(device_blocks - 1, 1))
    self.num_compilations = 0  # copy programs compiled by this tier's calls

  def _traced(self, fn, *args):
    before = _traces[0]
    out = fn(*args)
    self.num_compilations += _traces[0] - before
    return out

  @property
  def nbytes(self) -> int:
    return sum(h.nbytes for h in self._host)

  def _padded(self, ids: List[int]) -> np.ndarray:
    out = np.full(bucket(len(ids), self._buckets), NULL_BLOCK, np.int32)
    out[:len(ids)] = ids
    return out

  def swap_out(self, pool, copies: Copies) -> int:
    """Device -> host for every (device blocks, host blocks) pair; returns blocks copied."""
    device = [b for src, _ in copies for b in src]
    host = [b for _, dst in copies for b in dst]
    if not device:
      return 0
    data = self._traced(_gather, jax.tree.leaves(pool), self._padded(device))
    for h, d in zip(self._host, data):
      h[:, host] = np.asarray(d)[:, :len(host)]
    return len(device)

  def swap_in(self, pool, copies: Copies):
    """Host -> device for every (host blocks, device blocks) pair; returns the new pool."""
    host = [b for src, _ in copies for b in src]
    device = [b for _, dst in copies for b in dst]
    if not host:
      return pool
    ids = self._padded(device)
    # Padding rows copy host block 0 (unused) into the null block.
    rows = np.zeros(len(ids), np.int64)
    rows[:len(host)] = host
    leaves = self._traced(_scatter, jax.tree.leaves(pool), ids, [h[:, rows] for h in self._host])
    return jax.tree.unflatten(self._treedef, leaves)
