"""Block copies and transfers on the device: copy-on-write inside the pool, and the device side of
moving blocks to and from a host tier (swap preemption).

Every function takes block ids the host has already padded to a bucketed length with null-block
entries (pagedjax.host.scheduling.step_inputs.padded_ids), so a run compiles a handful of programs per
function. Padding reads from and writes into the null block, whose contents are garbage by design
(pool.py). Gathers and scatters move every per-block array of the pool (`KVPool.block_arrays`: k,
v and any scales or zero points, block axis 1), so nothing here changes when a storage scheme
adds such a field; copies are the scheme's (`KVScheme.copy_blocks`: those arrays, plus any
bookkeeping of its own). Per-lane state (no block axis) is not moved with blocks: a recent
window's rings (the engine refuses block sharing and swap for them), and KIVI's key tails, whose
swapped-out copies travel with their sequences (gather_tails, restore_tails; executor.py).

jit caches these programs per shape for the whole process, so engines of one pool shape (a
sweep's points, the tests) compile each bucket once; traces.py counts them with the step's.
"""
import functools

import jax

from pagedjax.device import traces
from pagedjax.device.pool import KVPool


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_blocks(pool: KVPool, src, dst) -> KVPool:
  """The pool with block dst[i] holding block src[i]'s contents, in place (donated). All sources
  are read before any destination is written, so a pair whose destination is another pair's
  source still copies the old contents."""
  traces.record()  # trace time only
  return pool.scheme.copy_blocks(pool, src, dst)


@jax.jit
def gather_blocks(pool: KVPool, ids) -> dict:
  """Field name -> [layers, len(ids), ...] copies of the blocks `ids` (device -> host)."""
  traces.record()
  return {name: x[:, ids] for name, x in pool.block_arrays().items()}


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_blocks(pool: KVPool, ids, data: dict) -> KVPool:
  """The pool with blocks `ids` overwritten by `data` (host -> device), in place (donated)."""
  traces.record()
  return pool.replace(**{name: x.at[:, ids].set(data[name])
                         for name, x in pool.block_arrays().items()})


@jax.jit
def gather_tails(pool: KVPool, blocks):
  """[layers, len(blocks), kv_heads, block_size, head_dim] unquantized key tails of `blocks`,
  partial last blocks of sequences being swapped out (pools whose scheme keeps_tails)."""
  traces.record()
  return pool.scheme.gather_tails(pool, blocks)


@functools.partial(jax.jit, donate_argnums=(0,))
def restore_tails(pool: KVPool, lanes, blocks, tails) -> KVPool:
  """The pool with lane lanes[i] holding tails[:, i] as the tail of block blocks[i] (swap-in),
  in place (donated). Padding entries pass the null lane and the null block."""
  traces.record()
  return pool.scheme.restore_tails(pool, lanes, blocks, tails)
