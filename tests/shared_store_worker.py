"""One process of tests/test_shared_store.py's concurrency test: opens a shared DiskStore and,
for a while, writes and reads random keys of a small key set whose home slots collide. Kept
apart from the test module so a spawned process imports numpy and tensorstore, not jax."""
import random
import time

import numpy as np

from pagedjax.host.tiers.disk_store import DiskStore

FINGERPRINT = b'shared-test-fp!!'
RECORD_BYTES = 4096
SLOTS = 8
KEYS = [k * SLOTS + k % 3 for k in range(12)]  # 12 keys on 3 home slots (key mod 8 = 0, 1, 2)


def digest(key: int) -> bytes:
  return key.to_bytes(16, 'little')  # the content a key names (one per key, as chain keys)


def record(key: int, writer: int) -> np.ndarray:
  """A record whose bytes say which key and writer made it: writers write different bytes for
  one key (as replicas with nondeterministic kernels would), all valid for that key."""
  body = np.random.default_rng(key * 1000 + writer).integers(0, 256, RECORD_BYTES - 16,
                                                              np.uint8)
  head = np.frombuffer(key.to_bytes(8, 'little') + writer.to_bytes(8, 'little'), np.uint8)
  return np.concatenate([head, body])


def run(url: str, writer: int, seconds: float, out) -> None:
  store = DiskStore(url, SLOTS, RECORD_BYTES, FINGERPRINT)
  assert store.shared, store.off_reason
  rng = random.Random(writer)
  counts = dict(writes=0, hits=0, hits_of_others=0, wrong=0, failed_reads=0)
  end = time.monotonic() + seconds
  while time.monotonic() < end:
    key = rng.choice(KEYS)
    if rng.random() < 0.4:
      if key not in store.index and store.reserve(key, digest(key)):
        store.write(key, record(key, writer))
        counts['writes'] += 1
    else:
      read = store.read(key, digest(key))
      got = store.finish(read) if read is not None else None
      if got is not None:
        made_by = (int.from_bytes(got[:8].tobytes(), 'little'),
                   int.from_bytes(got[8:16].tobytes(), 'little'))
        counts['hits'] += 1
        counts['hits_of_others'] += made_by[1] != writer
        counts['wrong'] += made_by[0] != key or not np.array_equal(got, record(*made_by))
    store.poll()
  store.flush()
  counts['failed_reads'] = store.read_failures
  out.put((writer, counts))
