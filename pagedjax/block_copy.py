"""Copy-on-write on the device: every block copy of an iteration in one jitted call.

The scheduler lists (shared block, private copy) pairs (block_manager.may_append); the engine
hands them all here before the step writes. The pool is donated, so the copy is in place. All
sources are read before any destination is written (a functional gather, then one scatter),
so a pair whose destination was another pair's source still copies the old contents. Counts
are padded to power-of-two buckets with null-block -> null-block pairs (block 0's contents are
garbage by design, pool.py), so a run compiles a handful of copy programs.

Block-indexed fields only (k, v and their scales and zero points, block axis at 1). Pools with a
recent window keep per-sequence rings that a block copy cannot carry; the engine refuses
sharing with them.
"""
import functools
from typing import Sequence as Seq, Tuple

import jax
import numpy as np

from pagedjax.pool import NULL_BLOCK, KVPool
from pagedjax.step_inputs import bucket, power_of_two_buckets

BLOCK_FIELDS = ('k', 'v', 'k_scale', 'v_scale', 'k_zero', 'v_zero')
_traces = [0]  # module-wide, like swap.py: jit caches programs per shape for the process


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy(pool: KVPool, src, dst) -> KVPool:
  _traces[0] += 1  # trace time only
  fields = {name: getattr(pool, name) for name in BLOCK_FIELDS}
  return pool.replace(**{name: x.at[:, dst].set(x[:, src])
                         for name, x in fields.items() if x is not None})


class BlockCopier:

  def __init__(self, num_blocks: int):
    self._buckets = power_of_two_buckets(max(num_blocks - 1, 1))
    self.num_compilations = 0

  def __call__(self, pool: KVPool, copies: Seq[Tuple[int, int]]) -> KVPool:
    """pool with each destination block holding its source block's contents."""
    if not copies:
      return pool
    size = bucket(len(copies), self._buckets)
    src = np.full(size, NULL_BLOCK, np.int32)
    dst = np.full(size, NULL_BLOCK, np.int32)
    src[:len(copies)], dst[:len(copies)] = zip(*copies)
    before = _traces[0]
    pool = _copy(pool, src, dst)
    jax.block_until_ready(pool)
    self.num_compilations += _traces[0] - before
    return pool

