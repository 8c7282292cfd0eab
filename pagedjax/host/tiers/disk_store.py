"""Tier 3: KV blocks in a tensorstore kvstore (a local directory, memory, or a shared store).

Layout, under `<kvstore>/<fingerprint>/` (so engines of different models, KV schemes or block
sizes pointed at one store never see each other's blocks):
  blocks/   zarr3 uint8 array [MAX_SLOTS, record_nbytes], one chunk per slot: one block's arrays
            exactly as the pool stores them (codes, scales, zero points), packed to bytes
            (kv_tiers.BlockLayout), so a quantized block comes back bit for bit.
  headers/  zarr3 uint8 array [MAX_SLOTS, HEADER_BYTES], one chunk per slot: magic, format
            version, the fingerprint, the block's content key, a digest of its content
            (prefix_cache.content_bytes: parent key, token ids, salt), a checksum of its record,
            a write serial (recency across restarts) and a checksum of the header itself.
The arrays are far larger than any capacity: `capacity` only bounds the slots used, so a restart
with another capacity reopens the same arrays. Chunks are written and read asynchronously
(tensorstore futures): writes are issued as soon as a block's bytes are on the host and
committed to the index when they complete; a promotion's read is issued at admission and waited
for just before the scatter that needs it.

Never wrong: a read is served only if its header parses, names this fingerprint, the key and
content digest asked for, and the record's checksum matches. Anything else (a chunk missing,
truncated, corrupted, a header written without its record or the reverse, as a process killed
mid-write leaves them) is a miss: the entry is dropped and the block recomputed. Entries with a
write in flight are not matched, and entries with a read in flight are not evicted.

A store that cannot be opened (unreachable, or a new store in a read-only place) switches the
tier off with one warning; the engine goes on with the tiers above. A store that opens but
refuses a write (read-only, disk full) becomes read-only with one warning: the entries it holds
are still served (every read verifies), nothing more is written to it. Call `flush()` before a
process exits: writes still in flight are lost (a miss after a restart, as any torn write).

Sharing a store between processes (replicas of a deployment; `make_shared(url, slots)` once,
before they open it). A private store (the default) gives each key any free slot, so two
processes on it keep separate indexes, overwrite each other's slots and never find each other's
blocks: misses, never wrong K/V. A shared store is marked so at its root
(`pagedjax-layout.json`: the layout and the slot count), and every DiskStore opened on it then
uses the same placement: a block's slot is its home slot, content key mod slots
(`HomeSlotIndex`; a direct-mapped cache: a block whose home slot holds another replaces it,
unless that one is being written or read here). A lookup that this process's index misses reads
the header at the key's home slot (one small synchronous read) and adopts an entry another
process wrote there if the header verifies and names the key and content asked; the record is
verified on its read as always. So a block one replica computed is a tier-3 hit on every other.
Concurrent writers and readers stay correct by the same rules: a header and its record are
separate chunks, each written whole (tensorstore writes a chunk file by rename), and a header
carries its record's checksum, so a header of one write read with the record of another is a
miss, and an entry overwritten after this process adopted it is a miss on its read
(tests/test_shared_store.py: several processes writing and reading the same keys). Every
process on a shared store must open it with `capacity` equal to its slot count.

Nothing but blocks and their headers is written into the store: the read figures of the cost
model (`measure_read`) come from reading its own records, or, in a store that holds none yet,
from scratch records in a temporary store of the same kind, removed after.

Capacity: slots are at most MAX_SLOTS, and a directory store's slots must fit the file system's
free space (a 'memory://' store's, the host RAM): else ConfigError, before anything is opened.
Memory grows with the slots in use, never with the capacity.
"""
import hashlib
import json
import os
import struct
import tempfile
import time
import uuid
import warnings
from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorstore as ts

from pagedjax.host import capacity as capacity_lib
from pagedjax.host.tiers.tier_index import TierIndex

FORMAT_VERSION = 1
MAGIC = b'PJKV'
# magic, format version, fingerprint, key, content digest, record checksum, write serial
_HEADER = struct.Struct('<4sI16sQ16s16sQ')
HEADER_BYTES = _HEADER.size + 8  # + the header's own checksum
MAX_SLOTS = 2**31
# One context per process: 'memory://' stores are scoped to a context, so engines of one process
# (a warm-restart test) share them as they would share a directory; file I/O pools are shared.
_CONTEXT = ts.Context()


RESTORE_ROWS = 1 << 16  # headers read per request at a restart
LAYOUT_KEY = 'pagedjax-layout.json'  # at a store's root: {"layout": "shared", "slots": N}


def kvstore_spec(url: str) -> ts.KvStore.Spec:
  """A tensorstore kvstore URL ('file:///dir/', 'memory://name/', 'gs://bucket/dir/', ...) or a
  plain directory path (a local file store). Only a URL is percent-decoded: the path
  '/tmp/kv%20store' is a directory of that name, 'file:///tmp/kv%20store' is '/tmp/kv store'."""
  if '://' not in url:
    path = os.path.abspath(os.path.expanduser(url))
    return ts.KvStore.Spec({'driver': 'file', 'path': path.rstrip('/') + '/'})
  return ts.KvStore.Spec(url if url.endswith('/') else url + '/')


def check_capacity(url: str, capacity: int, record_nbytes: int,
                   field: str = 'tiers.disk_blocks') -> None:
  """ConfigError unless `capacity` slots of this record size fit (module docstring)."""
  if capacity > MAX_SLOTS:
    raise capacity_lib.ConfigError(
        f'config.{field}={capacity!r} is not allowed: at most {MAX_SLOTS:,} slots '
        '(the disk arrays\' first dimension)')
  spec = kvstore_spec(url).to_json()
  slot_bytes = record_nbytes + HEADER_BYTES
  if spec['driver'] == 'file':
    need = capacity * slot_bytes
    capacity_lib.check_blocks_fit(
        field, capacity, slot_bytes, capacity_lib.disk_space_available(spec['path'], need),
        'disk', f'free space under {spec["path"]!r}')
  elif spec['driver'] == 'memory':
    capacity_lib.check_blocks_fit(field, capacity, slot_bytes,
                                  capacity_lib.host_memory_available(),
                                  "host RAM (a 'memory://' store)")


def _root(url: str):
  return ts.KvStore.open(kvstore_spec(url), context=_CONTEXT).result()


def store_layout(url: str) -> Optional[dict]:
  """The layout a store was marked with (make_shared), or None: a private store."""
  found = _root(url).read(LAYOUT_KEY).result()
  if found.state != 'value':
    return None
  layout = json.loads(bytes(found.value))
  if layout.get('layout') != 'shared' or not isinstance(layout.get('slots'), int):
    raise ValueError(f'{LAYOUT_KEY} of {url!r} is {layout!r}: not a layout this code wrote')
  return layout


def make_shared(url: str, slots: int) -> None:
  """Marks the store at url shared by every process that opens it, with `slots` home slots
  (module docstring). Done once, before the processes open it; marking it again with the same
  slots is a no-op, with others a ValueError (the processes on it would disagree on where a
  block lives)."""
  if not isinstance(slots, int) or isinstance(slots, bool) or not 0 < slots <= MAX_SLOTS:
    raise ValueError(f'slots={slots!r} is not allowed: an integer in 1..{MAX_SLOTS:,}')
  layout = store_layout(url)
  if layout is not None and layout['slots'] != slots:
    raise ValueError(f'the store {url!r} is already shared with {layout["slots"]} slots, not '
                     f'{slots}: a shared store keeps its slot count')
  if layout is None:
    _root(url).write(LAYOUT_KEY, json.dumps({'layout': 'shared', 'slots': slots})).result()


class _NoFreeList:
  """A home-slot index hands out no free slots: a slot given back is simply unused."""

  def push(self, slot: int) -> None:
    pass

  def take(self, slots) -> None:
    pass


class HomeSlotIndex(TierIndex):
  """A shared store's index (module docstring): key -> its home slot, key mod capacity, the
  same in every process; reserving a key whose home slot holds another here replaces that one
  (announced as removed), unless it is pending or pinned. The eviction policy never runs: the
  slots decide what is replaced."""

  def __init__(self, capacity: int, eviction='lru'):
    super().__init__(capacity, eviction)
    self._free = _NoFreeList()

  def home(self, key: int) -> int:
    return key % self.capacity

  def reserve(self, key: int, content):
    if key in self._slot:
      raise ValueError(f'key {key} is already in this tier (slot {self._slot[key]})')
    slot, victim = self.home(key), None
    other = self._key_at.get(slot)
    if other is not None:
      if other in self._pending or other in self._pins:
        return None
      victim = (other, self._content[other], slot)
      self.evictions += 1
      self.remove(other)
    self._add(key, content, slot)
    self._pending.add(key)
    return slot, victim

  def adopt(self, key: int, content) -> bool:
    """An entry another process committed at key's home slot, known here from now on (and
    announced as stored); False when this process's entry in that slot is pending or pinned."""
    if self.reserve(key, content) is None:
      return False
    self.commit(key)
    return True

  def restore(self, entries) -> None:
    """Entries at their home slots (a store that was private once may hold others: unused)."""
    super().restore([(k, c, s) for k, c, s in entries if s == self.home(k)])

  def check(self) -> None:
    assert len(self._slot) <= self.capacity, (len(self._slot), self.capacity)
    assert {self._key_at[s]: s for s in self._key_at} == self._slot
    assert all(s == self.home(k) for k, s in self._slot.items())
    assert self._pending <= set(self._slot) and set(self._pins) <= set(self._slot)


def _digest(data: bytes, size: int = 16) -> bytes:
  return hashlib.blake2b(data, digest_size=size).digest()


class DiskRead:
  """A promotion's read in flight: its key, slot, and the header and record futures."""
  __slots__ = ('key', 'digest', 'slot', 'header', 'record')

  def __init__(self, key, digest, slot, header, record):
    self.key, self.digest, self.slot, self.header, self.record = key, digest, slot, header, record


class DiskStore:

  def __init__(self, url: str, capacity: int, record_nbytes: int, fingerprint: bytes,
               eviction: str = 'lru'):
    """fingerprint: 16 bytes naming what K/V depend on: model, weights, KV scheme, block size,
    layout (tiering.py). ConfigError when `capacity` slots cannot fit (module docstring)."""
    check_capacity(url, capacity, record_nbytes)
    self.url, self.record_nbytes, self.fingerprint = url, record_nbytes, fingerprint
    self.index = TierIndex(capacity, eviction)
    self.enabled, self.off_reason = False, None
    self.read_only_reason: Optional[str] = None  # why writes stopped (None: writable)
    self.calibrated_on: Optional[str] = None  # what measure_read timed
    self._writes: Dict[int, Tuple[int, list]] = {}  # key -> (slot, write futures)
    self._serial = 0
    self.read_failures = 0  # reads that did not verify (misses)
    self.restored = 0  # entries found at open (warm restart)
    self.shared = False  # a store shared between processes (make_shared)
    self.probes = self.adopted = 0  # shared: home-slot header reads, entries others wrote found
    try:
      layout = store_layout(url)
      if layout is not None:
        if layout['slots'] != capacity:
          raise ValueError(f'it is shared with {layout["slots"]} slots and this engine asks for '
                           f'{capacity} (config.tiers.disk_blocks): every process sharing a '
                           'store opens it with its slot count')
        self.shared, self.index = True, HomeSlotIndex(capacity, eviction)
      self._base = kvstore_spec(url) / f'{fingerprint.hex()}/'
      self._headers = self._open('headers/', HEADER_BYTES)
      self._blocks = self._open('blocks/', record_nbytes)
      self._restore()
      self.enabled = True
    except (ValueError, OSError, RuntimeError) as e:
      self._off(f'cannot open {url!r}: {e}')

  @property
  def writable(self) -> bool:
    """On and taking writes (a read-only store still serves what it holds)."""
    return self.enabled and self.read_only_reason is None

  def _open(self, name: str, row_nbytes: int, base=None):
    spec = {'driver': 'zarr3', 'kvstore': ((base or self._base) / name).to_json(),
            'metadata': {'shape': [MAX_SLOTS, row_nbytes], 'data_type': 'uint8',
                         'chunk_grid': {'name': 'regular',
                                        'configuration': {'chunk_shape': [1, row_nbytes]}}}}
    return ts.open(spec, create=True, open=True, context=_CONTEXT).result()

  def _off(self, reason: str) -> None:
    """Switches the tier off (one warning); its entries are forgotten, so every lookup misses."""
    if self.off_reason is None:
      warnings.warn(f'disk KV tier switched off, the engine goes on without it: {reason}',
                    RuntimeWarning, stacklevel=3)
    self.enabled, self.off_reason = False, reason
    for key in self.index.keys():
      self.index.remove(key)
    self._writes.clear()

  def _write_failed(self, reason: str) -> None:
    """A refused write makes the store read-only (one warning): the entries committed before
    stay served, the ones whose writes were in flight are dropped (they may be torn)."""
    if self.read_only_reason is None:
      warnings.warn(f'disk KV tier is read-only from now on (its {len(self.index)} entries are '
                    f'still served, nothing more is written): {reason}', RuntimeWarning,
                    stacklevel=3)
      self.read_only_reason = reason
    for key, (slot, _) in list(self._writes.items()):
      if key in self.index and self.index.slot(key) == slot:
        self.index.remove(key)
    self._writes.clear()
    for key in self.index.keys():
      if self.index.is_pending(key):  # reserved, its write not issued yet
        self.index.remove(key)

  # ---- headers -----------------------------------------------------------------------------

  def _header(self, key: int, digest: bytes, record: np.ndarray, serial: int) -> np.ndarray:
    body = _HEADER.pack(MAGIC, FORMAT_VERSION, self.fingerprint, key, digest,
                        _digest(record.tobytes()), serial)
    return np.frombuffer(body + _digest(body, 8), np.uint8)

  def _parse(self, row: np.ndarray) -> Optional[tuple]:
    """(key, content digest, record checksum, serial) of a header row that verifies, else None."""
    raw = row.tobytes()
    body = raw[:_HEADER.size]
    if raw[_HEADER.size:] != _digest(body, 8):
      return None
    magic, version, fingerprint, key, digest, checksum, serial = _HEADER.unpack(body)
    if magic != MAGIC or version != FORMAT_VERSION or fingerprint != self.fingerprint:
      return None
    return key, digest, checksum, serial

  def _written_slots(self) -> List[int]:
    """The slots below capacity whose header chunk exists (keys 'c/<slot>/0' of headers/)."""
    slots = []
    for key in self._headers.kvstore.list().result():
      parts = key.decode(errors='replace').split('/')
      if len(parts) == 3 and parts[0] == 'c' and parts[1].isdigit():
        slots.append(int(parts[1]))
    return sorted(s for s in set(slots) if s < self.index.capacity)

  def _restore(self) -> None:
    """Rebuilds the index from the headers of the written slots below capacity (a warm
    restart), read RESTORE_ROWS at a time; a key found twice (a crash between two writes) keeps
    its newest slot, and the stale slot is reused."""
    slots = self._written_slots()
    newest = {}
    for i in range(0, len(slots), RESTORE_ROWS):
      batch = np.asarray(slots[i:i + RESTORE_ROWS], np.int64)
      for slot, row in zip(batch.tolist(), self._headers[batch].read().result()):
        parsed = self._parse(row) if row.any() else None
        if parsed and parsed[3] >= newest.get(parsed[0], (-1,))[0]:
          newest[parsed[0]] = (parsed[3], parsed[1], slot)
    entries = sorted((serial, key, digest, slot) for key, (serial, digest, slot) in newest.items())
    self.index.restore([(key, digest, slot) for _, key, digest, slot in entries])
    self._serial = entries[-1][0] + 1 if entries else 0
    self.restored = len(entries)

  # ---- writes ------------------------------------------------------------------------------

  def reserve(self, key: int, content_digest: bytes) -> bool:
    """Takes a slot for key (its victim, if any, is dropped: the lowest tier). False when the
    tier is off or read-only, or every slot is busy."""
    return self.writable and self.index.reserve(key, content_digest) is not None

  def write(self, key: int, record: np.ndarray) -> None:
    """Issues the asynchronous writes of a reserved key's record and header."""
    if not self.writable or key not in self.index:
      return
    slot = self.index.slot(key)
    header = self._header(key, self.index.content(key), record, self._serial)
    self._serial += 1
    try:
      futures = [self._blocks[slot].write(record), self._headers[slot].write(header)]
    except (ValueError, OSError, RuntimeError) as e:
      self._writes[key] = (slot, [])
      self._write_failed(f'write to {self.url!r} failed: {e}')
      return
    self._writes[key] = (slot, futures)

  def poll(self, wait: bool = False) -> None:
    """Commits the writes that completed (all of them, waiting, when `wait`); a failed write
    makes the store read-only."""
    for key, (slot, futures) in list(self._writes.items()):
      if not wait and not all(f.commit.done() for f in futures):
        continue
      del self._writes[key]
      try:
        for f in futures:
          f.result()
      except (ValueError, OSError, RuntimeError) as e:
        self._writes[key] = (slot, futures)
        self._write_failed(f'write to {self.url!r} failed: {e}')
        return
      if key in self.index and self.index.slot(key) == slot:
        self.index.commit(key)

  def flush(self) -> None:
    """Waits for every write in flight (before a process exits, for a warm restart)."""
    self.poll(wait=True)

  # ---- reads -------------------------------------------------------------------------------

  def find(self, key: int, content_digest: bytes) -> bool:
    if not self.enabled:
      return False
    if self.index.find(key, content_digest) is not None:
      return True
    return self.shared and self._probe(key, content_digest)

  def _probe(self, key: int, content_digest: bytes) -> bool:
    """A shared store: did another process write key's entry at its home slot? Reads that
    header (synchronously) and adopts the entry if it verifies and names this key and content
    (its record is verified when read)."""
    if key in self.index:  # here with other content, or being written from here
      return False
    self.probes += 1
    try:
      row = self._headers[self.index.home(key)].read().result()
    except (ValueError, OSError, RuntimeError):
      return False
    parsed = self._parse(row) if row.any() else None
    if parsed is None or parsed[:2] != (key, content_digest):
      return False
    if not self.index.adopt(key, content_digest):
      return False
    self.adopted += 1
    return True

  def read(self, key: int, content_digest: bytes) -> Optional[DiskRead]:
    """Issues the asynchronous read of a committed entry (pinned until `finish`)."""
    if not self.find(key, content_digest):
      return None
    slot = self.index.slot(key)
    try:
      futures = self._headers[slot].read(), self._blocks[slot].read()
    except (ValueError, OSError, RuntimeError):
      self.read_failures += 1
      self.index.remove(key)
      return None
    self.index.pin(key)
    self.index.touch(key)
    return DiskRead(key, content_digest, slot, *futures)

  def finish(self, read: DiskRead) -> Optional[np.ndarray]:
    """The record of a read that verifies, else None (the entry is dropped: a miss)."""
    self.index.unpin(read.key)
    try:
      header, record = read.header.result(), read.record.result()
    except (ValueError, OSError, RuntimeError):
      header = record = None
    parsed = self._parse(header) if header is not None else None
    if (parsed is None or parsed[:2] != (read.key, read.digest) or
        _digest(record.tobytes()) != parsed[2]):
      self.read_failures += 1
      if self.index.find(read.key, read.digest) == read.slot:
        self.index.remove(read.key)
      return None
    return record

  # ---- calibration -------------------------------------------------------------------------

  def measure_read(self, num_blocks: int) -> Tuple[float, float]:
    """(bytes/s, latency s) of reading records, timed on reading 1 and then up to num_blocks of
    them. Writes nothing into this store: it reads up to num_blocks of its own records when it
    holds any (a warm restart), else scratch records written to a temporary store of the same
    kind and removed after: a fresh 'memory://' store for a memory store, a temporary local
    directory for any other (for a remote store, then, the local disk's figures).
    `calibrated_on` (and figures()) says which."""
    slots = [self.index.slot(k) for k in self.index.keys()][:num_blocks]
    if slots:
      self.calibrated_on = f'{len(slots)} record{"s" * (len(slots) > 1)} of the store'
      return _time_reads(self._blocks, slots, self.record_nbytes)
    memory = kvstore_spec(self.url).to_json()['driver'] == 'memory'
    with tempfile.TemporaryDirectory(prefix='pagedjax-kv-calibration-') as tmp:
      base = (ts.KvStore.Spec(f'memory://pagedjax-calibration-{uuid.uuid4().hex}/') if memory
              else kvstore_spec(tmp))
      scratch = self._open('blocks/', self.record_nbytes, base=base)
      rng = np.random.default_rng(0)
      scratch[:num_blocks].write(
          rng.integers(0, 256, (num_blocks, self.record_nbytes), np.uint8)).result()
      self.calibrated_on = (f'{num_blocks} scratch records in a temporary '
                            f'{"memory store" if memory else "local directory"}')
      try:
        return _time_reads(scratch, list(range(num_blocks)), self.record_nbytes)
      finally:
        if memory:
          scratch.kvstore.delete_range(ts.KvStore.KeyRange()).result()

  def figures(self) -> dict:
    return {'tier3_enabled': self.enabled, 'tier3_off_reason': self.off_reason,
            'tier3_read_only': self.read_only_reason is not None,
            'tier3_read_only_reason': self.read_only_reason,
            'tier3_calibrated_on': self.calibrated_on,
            'tier3_read_failures': self.read_failures, 'tier3_restored_blocks': self.restored,
            'tier3_shared': self.shared, 'tier3_probes': self.probes,
            'tier3_adopted_blocks': self.adopted,
            'tier3_writes_in_flight': len(self._writes)}


def _time_reads(array, slots: List[int], record_nbytes: int) -> Tuple[float, float]:
  """(bytes/s, latency s): latency = reading slots[0]; bandwidth from reading all of them."""
  times: List[float] = []
  for n in (1, len(slots)):
    start = time.perf_counter()
    futures = [array[s].read() for s in slots[:n]]
    for f in futures:
      f.result()
    times.append(time.perf_counter() - start)
  latency = times[0]
  if len(slots) == 1:
    return record_nbytes / max(latency, 1e-9), latency
  return (len(slots) - 1) * record_nbytes / max(times[1] - times[0], 1e-9), latency
