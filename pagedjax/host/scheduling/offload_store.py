"""Where offloaded blocks live: host RAM, the disk tier, or both (config.offload).

An offloaded sequence's blocks beyond its device window (host/scheduling/offload.py) live in
one id space over two tiers:

  ids 1..H          host RAM: numpy arrays laid out like the pool (block axis 1), H =
                    offload.host_blocks, checked against host RAM at engine build
  ids H+1..H+D      the disk tier: D = offload.disk_blocks in a tensorstore kvstore
                    (offload.disk_kvstore: a directory or URL, host/tiers/disk_store.kvstore_spec)
  id 0              never handed out: zeros, the padding of a short chunk

`offload.placement` says which tier a block moving out of a window goes to first ('host' or
'disk'); the other takes it when that one is full, so a sequence may hold blocks on both and
the engine can hold what host RAM plus the disk tier can (submit refuses beyond that).

The disk tier follows the KV tiers' store (host/tiers/disk_store.py): the kvstore spec, its
capacity check against the file system's free space (or host RAM for 'memory://'), zarr3 uint8
arrays of blocks exactly as the pool stores them (codes, scales and zero points as bytes, so a
quantized block comes back bit for bit) and asynchronous reads and writes. What differs is what
a block is: here the only copy of a running sequence's K/V, read every step one layer at a
time, found by content only through this engine's own index (offload_index.py, which also
decides evictions), never kept across processes. So each pool
field is an array [layers, D + 1, bytes of one layer's block] with one chunk per (layer, block),
under a fresh `offload-<uuid>/` directory of the kvstore that is removed when the store goes
(engines sharing a directory never see each other's blocks), and no headers: a block is read
only by the engine that wrote it, after its write has completed (`start_read` waits for writes
in flight first).
"""
import shutil
import uuid
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorstore as ts

from pagedjax.host import capacity
from pagedjax.host.scheduling.allocator import BlockAllocator
from pagedjax.host.scheduling.swap_store import block_nbytes
from pagedjax.host.tiers import disk_store

PLACEMENTS = ('host', 'disk')
RAM_ALIGN = 64  # bytes: XLA:CPU takes a host array starting on such a boundary without a copy


def aligned_array(shape, dtype, zeros: bool = False, align: int = RAM_ALIGN) -> np.ndarray:
  """np.empty (zeros: np.zeros) of shape and dtype, starting on an `align`-byte boundary.
  numpy aligns large arrays to 16 bytes only; jax.device_put onto a CPU device then copies the
  array (SmolLM2's streamed decode step: 47 MB, a third of its time), where an aligned one
  becomes the device buffer itself (zero-copy; on an accelerator the transfer copies either
  way). Whoever refills such an array must first wait for every program that read it
  (StreamedAttention._run_batch does)."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = (np.zeros if zeros else np.empty)(nbytes + align, np.uint8)
  start = -raw.ctypes.data % align
  return raw[start:start + nbytes].view(dtype).reshape(shape)


class OffloadIds:
  """Block ids and ref counts over the two tiers (module docstring): BlockAllocator's
  interface, each tier its own allocator; `allocate` takes from the placement's tier first."""

  def __init__(self, host_blocks: int, disk_blocks: int, placement: str):
    self.host_blocks = host_blocks
    self.tiers = {'host': BlockAllocator(host_blocks + 1) if host_blocks else None,
                  'disk': BlockAllocator(disk_blocks + 1) if disk_blocks else None}
    self._order = [placement] + [t for t in PLACEMENTS if t != placement]

  def tier_of(self, block: int) -> str:
    return 'host' if block <= self.host_blocks else 'disk'

  def _route(self, block: int) -> Tuple[BlockAllocator, int]:
    tier = self.tier_of(block)
    local = block if tier == 'host' else block - self.host_blocks
    if self.tiers[tier] is None or not 0 < local < self.tiers[tier].num_blocks:
      raise ValueError(f'offload block id {block!r} out of range: allocatable ids are 1..'
                       f'{self.num_blocks - 1} (0 pads)')
    return self.tiers[tier], local

  @property
  def num_blocks(self) -> int:  # as BlockAllocator's: the ids, padding block 0 included
    return 1 + sum(a.num_blocks - 1 for a in self.tiers.values() if a is not None)

  @property
  def num_free(self) -> int:
    return sum(a.num_free for a in self.tiers.values() if a is not None)

  @property
  def num_used(self) -> int:
    return sum(a.num_used for a in self.tiers.values() if a is not None)

  def used(self, tier: str) -> int:
    return self.tiers[tier].num_used if self.tiers[tier] is not None else 0

  def allocate(self, n: int = 1) -> List[int]:
    out = []
    for tier in self._order:
      allocator = self.tiers[tier]
      take = min(n - len(out), allocator.num_free) if allocator is not None else 0
      offset = 0 if tier == 'host' else self.host_blocks
      out += [b + offset for b in allocator.allocate(take)] if take else []
    if len(out) < n:
      self.free(out)
      raise RuntimeError(f'asked for {n} offload blocks, only {len(out)} free')
    return out

  def share(self, block: int) -> None:
    allocator, local = self._route(block)
    allocator.share(local)

  def free(self, blocks) -> None:
    for block in blocks:
      allocator, local = self._route(block)
      allocator.free([local])

  def ref_count(self, block: int) -> int:
    allocator, local = self._route(block)
    return allocator.ref_count(local)


class DiskBlocks:
  """The disk tier's arrays (module docstring): store and read blocks by local id 1..D."""

  def __init__(self, url: str, block_array_shapes, num_blocks: int):
    self.url = url
    layers = {shape[0] for shape, _ in block_array_shapes.values()}.pop()
    self.fields = {name: (tuple(shape[2:]), np.dtype(dtype))
                   for name, (shape, dtype) in block_array_shapes.items()}
    one_layer = block_nbytes(block_array_shapes) // layers  # one block's bytes, one layer
    disk_store.check_capacity(url, num_blocks, one_layer * layers, field='offload.disk_blocks')
    self._base = disk_store.kvstore_spec(url) / f'offload-{uuid.uuid4().hex}/'
    self._arrays = {}
    for name, (shape, dtype) in self.fields.items():
      row = int(np.prod(shape)) * dtype.itemsize
      spec = {'driver': 'zarr3', 'kvstore': (self._base / f'{name}/').to_json(),
              'metadata': {'shape': [layers, num_blocks + 1, row], 'data_type': 'uint8',
                           'chunk_grid': {'name': 'regular',
                                          'configuration': {'chunk_shape': [1, 1, row]}}}}
      try:
        self._arrays[name] = ts.open(spec, create=True, delete_existing=True).result()
      except (ValueError, OSError, RuntimeError) as e:
        raise capacity.ConfigError(f'config.offload.disk_kvstore={url!r} is not allowed: '
                                   f'cannot open it ({e})') from None
    self._writes: list = []  # futures of writes in flight
    self._finalizer = weakref.finalize(self, _remove, self._base.to_json())

  def write(self, local_ids: np.ndarray, data: Dict[str, np.ndarray]) -> None:
    """Issues the writes of data[name][:, i] (one block, every layer) into local_ids[i]."""
    for name, array in self._arrays.items():
      raw = np.ascontiguousarray(data[name]).view(np.uint8).reshape(
          data[name].shape[0], len(local_ids), -1)
      self._writes.append(array[:, local_ids].write(raw))

  def read(self, layer: int, local_ids: np.ndarray) -> Callable[[], Dict[str, np.ndarray]]:
    """Issues the reads of one layer of these blocks; the callable waits for them and returns
    field -> [len(local_ids), ...] (block contents as the pool stores them)."""
    for future in self._writes:  # a block is read only once its write has completed
      future.result()
    self._writes.clear()
    futures = {name: array[layer, local_ids].read() for name, array in self._arrays.items()}

    def result():
      return {name: futures[name].result().view(dtype).reshape((len(local_ids),) + shape)
              for name, (shape, dtype) in self.fields.items()}
    return result

  def close(self) -> None:
    """Waits for writes in flight and removes the store's directory (also done when it goes)."""
    for future in self._writes:
      future.result()
    self._writes.clear()
    self._finalizer()


def _remove(spec: dict) -> None:
  """Removes an offload store's directory: the files of a local one, the keys of any other."""
  if spec.get('driver') == 'file':
    shutil.rmtree(spec['path'], ignore_errors=True)
    return
  try:
    ts.KvStore.open(spec).result().delete_range(ts.KvStore.KeyRange()).result()
  except (ValueError, OSError, RuntimeError):
    pass  # a remote store that went away: nothing more to do


class OffloadStore:
  """The contents of offloaded blocks over both tiers; `allocator` (OffloadIds) hands out ids.
  block_array_shapes: KVPool.block_array_shapes() (field -> (shape, dtype), block axis 1)."""

  def __init__(self, block_array_shapes, host_blocks: int, disk_blocks: int = 0,
               disk_kvstore: str = '', placement: str = 'host'):
    capacity.check_blocks_fit('offload.host_blocks', host_blocks,
                              block_nbytes(block_array_shapes), capacity.host_memory_available(),
                              'host RAM')
    self.host_blocks = host_blocks
    self.allocator = OffloadIds(host_blocks, disk_blocks, placement)
    # Host block 0 stays zeros: the padding of a short chunk, whatever tier the rest is on.
    # Each array starts on a RAM_ALIGN boundary: a CPU program takes it in place (`in_place`).
    self._ram = {name: aligned_array((shape[0], host_blocks + 1) + tuple(shape[2:]), dtype,
                                     zeros=True)
                 for name, (shape, dtype) in block_array_shapes.items()}
    self.disk = (DiskBlocks(disk_kvstore, block_array_shapes, disk_blocks)
                 if disk_blocks else None)
    self.layer_block_bytes = block_nbytes(block_array_shapes) // next(
        iter(block_array_shapes.values()))[0][0]  # one block of one layer, every field
    self.bytes_read = {'host': 0, 'disk': 0}  # real blocks read (padding left out)

  def _split(self, ids) -> Tuple[np.ndarray, np.ndarray]:
    """(positions in ids of disk blocks, their local disk ids)."""
    ids = np.asarray(ids, np.int64)
    on_disk = np.flatnonzero(ids > self.host_blocks)
    return on_disk, ids[on_disk] - self.host_blocks

  def store(self, ids: Sequence[int], data: Dict[str, np.ndarray]) -> None:
    """Writes data[name][:, i] into block ids[i] (data may carry padding columns)."""
    ids = np.asarray(ids, np.int64)
    in_ram = np.flatnonzero(ids <= self.host_blocks)
    for name, array in self._ram.items():
      array[:, ids[in_ram]] = np.asarray(data[name])[:, in_ram]
    on_disk, local = self._split(ids)
    if len(on_disk):
      self.disk.write(local, {name: np.asarray(d)[:, on_disk] for name, d in data.items()})

  def start_read(self, layer: int, ids, out=None) -> Callable[[], Dict[str, np.ndarray]]:
    """One layer's arrays of blocks `ids` (0 = zeros): the disk's reads are issued now, and
    the callable returns field -> [len(ids), ...] once they are done (a copy; into `out`,
    field -> such an array, when given: a buffer reused saves allocating, and the page faults
    of, fresh memory on every read)."""
    ids = np.asarray(ids, np.int64)
    on_disk, local = self._split(ids)
    if not len(on_disk):
      return lambda: self._gather(layer, ids, out)
    unique, inverse = np.unique(local, return_inverse=True)  # forks share blocks: read once
    pending = self.disk.read(layer, unique)

    def result():
      got = self._gather(layer, np.where(ids > self.host_blocks, 0, ids), out)
      disk = pending()
      for name, blocks in disk.items():
        got[name][on_disk] = blocks[inverse]
      self.bytes_read['disk'] += len(on_disk) * self.layer_block_bytes
      return got
    return result

  def _gather(self, layer: int, ids: np.ndarray, out=None) -> Dict[str, np.ndarray]:
    self.bytes_read['host'] += int(np.count_nonzero(ids)) * self.layer_block_bytes
    # ids are host ids 0..H here (start_read replaced the disk's by 0): 'clip' never clips, and
    # lets take write into `out` unbuffered.
    return {name: np.take(array[layer], ids, axis=0, mode='clip',
                          out=None if out is None else out[name])
            for name, array in self._ram.items()}

  def read_buffer(self, num_blocks: int) -> Dict[str, np.ndarray]:
    """Fresh arrays for `start_read(..., out=)`: field -> [num_blocks, ...] as one layer's
    blocks are laid out, each on a RAM_ALIGN boundary (aligned_array)."""
    return {name: aligned_array((num_blocks,) + array.shape[2:], array.dtype)
            for name, array in self._ram.items()}

  def in_place(self, ids, num_layers: int) -> Optional[Dict[str, np.ndarray]]:
    """The host-RAM arrays themselves (field -> [layers, H + 1, ...], no copy, each on a
    RAM_ALIGN boundary), for a reader that takes blocks `ids` out of them by id (the streamed
    path's native kernel on a CPU), counted as num_layers layers' reads of those blocks; None
    when a block among ids is on the disk tier (it must be read into a buffer)."""
    ids = np.asarray(ids, np.int64)
    if self.disk is not None and bool((ids > self.host_blocks).any()):
      return None
    self.bytes_read['host'] += int(np.count_nonzero(ids)) * self.layer_block_bytes * num_layers
    return self._ram

  def layer_chunk(self, layer: int, ids) -> Dict[str, np.ndarray]:
    """Field name -> [len(ids), ...]: one layer's arrays of these blocks (a copy)."""
    return self.start_read(layer, ids)()

  def close(self) -> None:
    if self.disk is not None:
      self.disk.close()
