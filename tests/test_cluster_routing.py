"""What makes a routing decision cheap, checked against the slow definitions it replaces: the
one-pass chain keys equal block_key chained block by block (the engines' prefix-cache keys), a
router's keys handed to a simulated replica are the keys its cache files blocks under, the
index's one-pass match equals a replica-by-replica walk (with and without a shared store), the
tier-cost router's per-case memo picks what the formula picks, and the promotion rule's
one-pass split equals its quadratic definition."""
import dataclasses
import os
import random

import pytest

from configs import cluster as cluster_config
from experiments import cluster as study_lib
from pagedjax.cluster import routers
from pagedjax.cluster.index import SHARED, KVIndex, prompt_keys
from pagedjax.cluster.sim import ClusterRequest, Replica
from pagedjax.host import kv_events
from pagedjax.host.cache import native_keys, prefix_cache
from pagedjax.host.cache.prefix_cache import block_key, chain_keys, content_bytes
from pagedjax.host.tiers.tier_cost import TierCosts


def chained(ids, bs, n, salt=None, parent=None, start=0):
  """chain_keys' definition: block_key of each block, in turn."""
  keys = []
  for i in range(start, n):
    parent = block_key(parent, ids[i * bs:(i + 1) * bs], salt)
    keys.append(parent)
  return keys


@pytest.mark.parametrize('impl', ['chain_keys', 'chain_keys_python', 'native'])
def test_chain_keys_equal_block_key_chained(impl):
  """Every implementation of the one-pass keys (the C module where it builds, the Python loop)
  equals block_key chained, on ids of any int64 size, salts, parents and starts; token_ids may
  be a list or a tuple."""
  if impl == 'native':
    native = native_keys.chain_keys_fn()
    if native is None:
      pytest.skip(f'the C chain-key module is unavailable: {native_keys.unavailable_reason()}')
    fn = lambda ids, bs, n, salt=None, parent=None, start=0: native(
        ids, start * bs, max(0, n - start), bs, content_bytes(parent, (), salt))
  else:
    fn = getattr(prefix_cache, impl)
  rng = random.Random(0)
  for _ in range(300):
    bs, length = rng.choice([rng.randint(1, 17), 64, 16, 15]), rng.randint(0, 200)
    ids = [rng.choice([rng.randrange(2**40), rng.randrange(-2**63, 2**63)])
           for _ in range(length)]
    n = length // bs
    start = rng.randint(0, n)
    salt = rng.choice([None, '', 'tenant', 'zürich', 's' * 300])
    parent = rng.choice([None, rng.randrange(2**64)])
    seq = ids if rng.random() < 0.5 else tuple(ids)
    assert fn(seq, bs, n, salt, parent, start) == chained(ids, bs, n, salt, parent, start)
  assert fn([1, 2, 3], 2, 0) == [] and fn([1, 2, 3], 2, 1, start=1) == []


def test_native_chain_keys_refuse_bad_input_by_name():
  native = native_keys.chain_keys_fn()
  if native is None:
    pytest.skip(f'the C chain-key module is unavailable: {native_keys.unavailable_reason()}')
  with pytest.raises(OverflowError):
    native([2**63], 0, 1, 1, b'N')
  with pytest.raises(TypeError):
    native(['a'], 0, 1, 1, b'N')
  with pytest.raises(ValueError, match='need 8 token ids; there are 3'):
    native([1, 2, 3], 0, 2, 4, b'N')
  with pytest.raises(ValueError, match='block_size=0'):
    native([1], 0, 1, 0, b'N')


def test_the_chain_key_module_build_names_the_compiler_it_could_not_run(tmp_path, monkeypatch):
  """Without a working $CC the build says so (and chain_keys keeps its Python loop, the
  parametrized test above); with one, the module this process loaded is the cached file that
  build() names, not compiled again."""
  monkeypatch.setenv('PAGEDJAX_HOST_CACHE', str(tmp_path))
  monkeypatch.setenv('CC', '/nonexistent/cc')
  with pytest.raises(RuntimeError, match="no working C compiler '/nonexistent/cc'"):
    native_keys.build()
  monkeypatch.delenv('CC')
  monkeypatch.delenv('PAGEDJAX_HOST_CACHE')
  if native_keys.chain_keys_fn() is None:
    pytest.skip(f'no C compiler here: {native_keys.unavailable_reason()}')
  path = native_keys.build()
  assert os.path.dirname(path) == native_keys.cache_dir() and native_keys.build() == path
  assert native_keys.chain_keys_fn().__module__ == '_chain_keys'


def test_a_replica_files_blocks_under_the_keys_its_router_computed():
  """Two simulated replicas serve one prompt: one is handed the router's keys, the other
  hashes its own; both caches then hold exactly the router's keys."""
  cfg = cluster_config.get_config('tiny')
  engines, _ = study_lib.make_engines(cfg, 2)
  bs = engines[0].block_size
  prompt = [random.Random(1).randrange(256) for _ in range(5 * bs + 3)]
  route = routers.RouteRequest(0, prompt, 'tenant-a')
  keys = route.keys(bs)
  assert keys == prompt_keys(prompt, bs, 'tenant-a') == chained(prompt, bs, 5, 'tenant-a')
  handed = Replica(0, engines[0])
  handed.submit(ClusterRequest(0, prompt, 2, 0.0, salt='tenant-a'), route, 0.0)
  seq = next(iter(engines[0].completions.live.values()))
  assert seq.block_keys == keys and seq.block_keys is not keys
  engines[1].submit(prompt, dict(max_new_tokens=2, stop_on_eos=False, cache_salt='tenant-a'))
  for engine in engines:
    while engine.has_work():
      engine.step()
  for engine in engines:
    cache = engine.prefix_cache
    cached = {cache.entry(b)[0] for b in range(1, engine.allocator.num_blocks)
              if cache.is_cached(b)}
    assert set(keys) <= cached
  # refused: another salt, other ids, or a sequence that already has keys
  other = routers.RouteRequest(1, prompt, 'tenant-b')
  other.keys(bs)
  rid = engines[0].submit(prompt, dict(max_new_tokens=1, cache_salt='tenant-a'))
  assert not other.hand_keys(engines[0], rid)
  assert route.hand_keys(engines[0], rid) and not route.hand_keys(engines[0], rid)


def walk(index: KVIndex, keys, replicas=None):
  """match's definition: each replica walked on its own, block by block, until it holds
  neither the block nor (a named replica, with a shared store) the store holds it."""
  holders = [index._holders.get(k, {}) for k in keys]  # pylint: disable=protected-access
  shared_on = replicas is not None and bool(index.shared_media)
  candidates = set(replicas) if replicas is not None else {
      r for h in holders for r in h if r != SHARED}
  out = {}
  for r in candidates:
    tiers = []
    for h in holders:
      mask = h.get(r, 0) | (h.get(SHARED, 0) if shared_on else 0)
      if not mask:
        break
      tiers.append(min(t for t in kv_events.MEDIUM_OF_TIER if mask >> t & 1))
    if tiers:
      out[r] = tiers
  return out


def test_match_equals_a_replica_by_replica_walk():
  rng = random.Random(2)
  media = list(kv_events.MEDIA)
  for trial in range(150):
    index = KVIndex(shared_media=(kv_events.MEDIUM_DISK,) if trial % 2 else ())
    keys = list(range(rng.randint(1, 12)))
    for _ in range(rng.randint(0, 30)):
      replica, medium = rng.randrange(4), rng.choice(media)
      block = tuple(rng.sample(keys, rng.randint(1, len(keys))))
      kind = rng.random()
      if kind < 0.75:
        index.apply(replica, [kv_events.BlockStored(block, None, (), 4, None, medium)])
      elif kind < 0.95:
        index.apply(replica, [kv_events.BlockRemoved(block, medium)])
      else:
        index.apply(replica, [kv_events.AllBlocksCleared(rng.choice([None, medium]))])
    for replicas in (None, [0, 1, 2, 3], [1, 3], []):
      assert index.match(keys, replicas) == walk(index, keys, replicas), (trial, replicas)


def test_tier_cost_picks_the_least_score():
  """Over 16 replicas sharing a store: the pick (computed once per distinct case) is the
  replica of least score_s, each computed on its own."""
  rng = random.Random(3)
  bs, keys = 16, prompt_keys(list(range(40 * 16 + 5)), 16)
  cost = TierCosts.for_tiers(bs, 2**20, 3e-5, (2e10, 1e-5), (1e9, 1e-4))
  for trial in range(20):
    index = KVIndex(shared_media=(kv_events.MEDIUM_DISK,))
    index.apply(0, [kv_events.BlockStored(tuple(keys[:rng.randint(0, 40)]), None, (), bs, None,
                                          kv_events.MEDIUM_DISK)])
    for r in rng.sample(range(16), 3):
      index.apply(r, [kv_events.BlockStored(tuple(keys[:rng.randint(1, 40)]), None, (), bs,
                                            None, rng.choice(['GPU', 'CPU']))])
    states = [routers.ReplicaState(i, block_size=bs, cost=cost,
                                   queued_prefill_tokens=rng.randrange(0, 4000),
                                   running_tokens=rng.randrange(0, 9000),
                                   num_waiting=rng.randrange(0, 5)) for i in range(16)]
    router = routers.make_router('tier_cost', index=index)
    request = routers.RouteRequest(trial, list(range(40 * 16 + 5)))
    held = index.match(request.keys(bs), range(16))
    mean = sum(r.num_waiting for r in states) / len(states)
    want = min(states, key=lambda r: (router.score_s(request, r, held.get(r.index, ()), mean),
                                      r.load_tokens, r.index)).index
    assert router.route(request, states) == want


def test_blocks_to_load_equals_its_definition():
  rng = random.Random(4)
  for _ in range(400):
    cost = TierCosts.for_tiers(16, rng.choice([4096, 2**20]), rng.choice([1e-6, 3e-5, 1e-4]),
                               (rng.choice([1e9, 2e10]), rng.choice([0.0, 1e-5, 1e-4])),
                               (rng.choice([1e8, 1e9, 1e10]), rng.choice([0.0, 1e-4, 1e-3])))
    tiers = [rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 30))]
    costs = [cost.load_s(tiers[:j]) + cost.recompute_s(len(tiers) - j)
             for j in range(len(tiers) + 1)]
    want = max(j for j, c in enumerate(costs) if c <= min(costs)) if tiers else 0
    assert cost.blocks_to_load(tiers, 'auto') == want
    assert dataclasses.replace(cost).blocks_to_load(tiers, 'load') == len(tiers)
