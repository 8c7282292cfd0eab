"""A disk KV tier shared by several processes (pagedjax/host/tiers/disk_store.py, make_shared):
concurrent writers and readers of the same keys never read a wrong or torn block and do read
each other's; an engine finds the blocks another engine computed as tier-3 hits, with the same
greedy tokens, and so does one that restarts on the store; the cluster index counts a
shared-store block as held by every replica, and a replica's death does not take it away."""
import dataclasses
import multiprocessing
import warnings

import pytest

from pagedjax.cluster.index import KVIndex
from pagedjax.config import TiersConfig
from pagedjax.engine import Engine
from pagedjax.host import kv_events
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.tiers import disk_store
from pagedjax.host.tiers.disk_store import DiskStore

import shared_store_worker as worker
from tiny_models import engine_config, prompts, tiny

DOCS = prompts([64 + 3 * i for i in range(4)], seed=3)  # four documents of 4-5 blocks
PARAMS = SamplingParams(max_new_tokens=2)


def replica(tiers):
  """A tiny engine of the tier tests' shape (blocks of 16) on `tiers`."""
  cfg, params, step = tiny('gqa')
  config, rest = engine_config(cfg, num_blocks=24, block_size=16, max_batch_size=4,
                               prefill_chunk=16, prefix_caching=True)
  return Engine(cfg, params, dataclasses.replace(config, tiers=tiers), step_fn=step, **rest)


def outputs(engine):
  return [c.output_ids for c in engine.generate(DOCS, PARAMS)]


def test_concurrent_writers_and_readers_never_read_a_wrong_block(tmp_path):
  url = str(tmp_path)
  disk_store.make_shared(url, worker.SLOTS)
  ctx = multiprocessing.get_context('spawn')  # no fork of a process running jax's threads
  out = ctx.Queue()
  procs = [ctx.Process(target=worker.run, args=(url, w, 1.5, out)) for w in range(3)]
  for p in procs:
    p.start()
  results = dict(out.get(timeout=60) for _ in procs)
  for p in procs:
    p.join(10)
    assert p.exitcode == 0
  assert sum(c['wrong'] for c in results.values()) == 0, results
  assert all(c['writes'] > 0 and c['hits'] > 0 for c in results.values()), results
  assert sum(c['hits_of_others'] for c in results.values()) > 0, results  # really shared
  # what is left verifies: a fresh process restores only entries whose header verifies
  store = DiskStore(url, worker.SLOTS, worker.RECORD_BYTES, worker.FINGERPRINT)
  assert 0 < store.restored <= 3  # the keys' three home slots
  for key in store.index.keys():
    got = store.finish(store.read(key, worker.digest(key)))
    assert got is None or int.from_bytes(got[:8].tobytes(), 'little') == key


def test_a_shared_store_keeps_its_slot_count(tmp_path):
  url = str(tmp_path)
  assert disk_store.store_layout(url) is None
  disk_store.make_shared(url, 8)
  disk_store.make_shared(url, 8)  # again: a no-op
  assert disk_store.store_layout(url) == {'layout': 'shared', 'slots': 8}
  with pytest.raises(ValueError, match='already shared with 8 slots, not 16'):
    disk_store.make_shared(url, 16)
  with pytest.raises(ValueError, match='slots=0 is not allowed'):
    disk_store.make_shared(str(tmp_path / 'other'), 0)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    store = DiskStore(url, 16, 64, b'f' * 16)
  assert not store.enabled and 'shared with 8 slots' in store.off_reason
  assert len(caught) == 1


def test_a_block_one_replica_computed_is_a_disk_hit_on_another_and_after_a_restart(tmp_path):
  """Replicas a and b open one shared store before anything is in it; b finds the blocks a
  computed (adopted from their headers: neither restored them) and gives a's greedy tokens;
  a replica started later on the store restores them and hits again."""
  disk_store.make_shared(str(tmp_path), 4096)  # few home slots shared by two of the 15 keys
  tiers = TiersConfig(disk_blocks=4096, disk_kvstore=str(tmp_path), write_through=True,
                      promotion='load')
  a, b = replica(tiers), replica(tiers)
  want = outputs(a)
  a.tiers.flush()
  written = len(a.tiers.disk.index)  # every full block (write-through), at its home slot
  matchable = sum((len(d) - 1) // 16 for d in DOCS)  # a lookup never takes the last token
  assert written >= matchable and a.summary()['tiers_tier3_hit_blocks'] == 0
  assert outputs(b) == want
  s = b.summary()
  assert s['tier3_shared'] and s['tier3_restored_blocks'] == 0
  assert s['tiers_tier3_hit_blocks'] == matchable <= s['tier3_adopted_blocks']
  restarted = replica(tiers)
  assert restarted.summary()['tier3_restored_blocks'] == written
  assert outputs(restarted) == want
  assert restarted.summary()['tiers_tier3_hit_blocks'] == matchable


def test_the_cluster_index_counts_a_shared_block_on_every_replica():
  index = KVIndex(shared_media=(kv_events.MEDIUM_DISK,))
  stored = lambda keys, medium: [kv_events.BlockStored(tuple(keys), None, (), 16, None, medium)]
  index.apply(0, stored([1, 2, 3, 4], kv_events.MEDIUM_DISK))  # replica 0 wrote 4 blocks
  index.apply(1, stored([1, 2], kv_events.MEDIUM_GPU))  # replica 1 holds 2 on its device
  assert index.match([1, 2, 3, 4, 5], replicas=[0, 1, 2]) == {
      0: [3, 3, 3, 3], 1: [1, 1, 3, 3], 2: [3, 3, 3, 3]}
  assert index.match([1, 2, 3, 4, 5]) == {1: [1, 1]}  # replicas not named: only their own
  index.apply(0, [kv_events.AllBlocksCleared(None)])  # replica 0 died: the store stays
  assert index.match([1, 2, 3], replicas=[1, 2]) == {1: [1, 1, 3], 2: [3, 3, 3]}
  index.apply(2, [kv_events.BlockRemoved((3,), kv_events.MEDIUM_DISK)])  # overwritten
  assert index.match([1, 2, 3], replicas=[1, 2]) == {1: [1, 1], 2: [3, 3]}
