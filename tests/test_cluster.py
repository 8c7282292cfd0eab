"""The simulated cluster (pagedjax/cluster/sim.py) and its study (experiments/cluster.py), on the
tiny config: the KV index kept from events equals every replica's device cache after a run,
every request finishes once on the replica it was routed to and after it arrived, prefix-aware
routing finds more of each prompt cached than random routing, and the study writes its files.
With a shared store: the index's shared holder is exactly the store, the store finds more of
the prompts than local caches do under prefix-blind routing, and the Mooncake study's tiny run
writes its comparison. With host-RAM tiers (:tiny_llmd_host): the index holds each replica's
device and host keys, and the study reports the tier mix against device-only replays."""
import functools
import json
import os

import pytest

from configs import cluster as cluster_config
from experiments import cluster as study_lib
from pagedjax.cluster import index as index_lib
from pagedjax.cluster import routers
from pagedjax.cluster.sim import SimulatedCluster
from pagedjax.config import ConfigError


def config():
  return cluster_config.get_config('tiny')


@functools.lru_cache(maxsize=None)
def trace():
  return tuple(study_lib.make_trace(config()))


@functools.lru_cache(maxsize=None)
def run(router: str, store_blocks: int = 0) -> SimulatedCluster:
  cfg = config()
  engines, costs = study_lib.make_engines(cfg, cfg.cluster.replicas)
  if store_blocks:  # loads from the store: 100 GB/s, 100 us (the Mooncake study's figures)
    cfg.cluster.update(dict(store_bytes_per_s=100e9, store_latency_s=1e-4))
    costs = [study_lib.store_costs(cfg, c) for c in costs]
  cluster = SimulatedCluster(engines, routers.make_router(router), costs,
                             shared_store_blocks=store_blocks)
  cluster.run(trace())
  return cluster


@pytest.mark.parametrize('router', ['precise', 'random'])
def test_every_request_finishes_once_where_it_was_routed(router):
  cluster = run(router)
  outcomes = cluster.outcomes
  assert sorted(o.request_id for o in outcomes) == [r.request_id for r in trace()]
  assert not cluster.rejected
  assert sum(r.routed for r in cluster.replicas) == len(trace())
  by_replica = [sum(o.replica == r.index for o in outcomes) for r in cluster.replicas]
  assert by_replica == [r.routed for r in cluster.replicas]
  assert all(o.first_token_time > o.arrival_time and o.finish_time >= o.first_token_time
             for o in outcomes)
  assert all(o.output_len == config().workload.output_tokens for o in outcomes)


def test_max_in_flight_holds_arrivals_until_a_request_finishes():
  """With one request in flight at a time, each reaches a replica only once the one before it
  finished (its TTFT still counts from its arrival); the trace's own times overlap."""
  cfg = config()
  requests = trace()[:8]
  engines, _ = study_lib.make_engines(cfg, cfg.cluster.replicas)
  cluster = SimulatedCluster(engines, routers.make_router('round_robin'), max_in_flight=1)
  outcomes = sorted(cluster.run(requests), key=lambda o: o.first_token_time)
  assert [o.request_id for o in outcomes] == [r.request_id for r in requests]
  assert all(b.first_token_time > a.finish_time for a, b in zip(outcomes, outcomes[1:]))
  assert any(b.arrival_time < a.finish_time for a, b in zip(outcomes, outcomes[1:]))
  assert all(o.arrival_time == r.arrival_time for o, r in zip(outcomes, requests))
  with pytest.raises(ValueError, match='max_in_flight=0 is not allowed'):
    SimulatedCluster(engines, routers.make_router('round_robin'), max_in_flight=0)


def test_kv_index_equals_each_replica_device_cache():
  cluster = run('precise')
  for r in cluster.replicas:
    cache, engine = r.engine.prefix_cache, r.engine
    device = {cache.entry(b)[0] for b in range(1, engine.allocator.num_blocks)
              if cache.is_cached(b)}
    assert {k for k in device if r.index in cluster.index.holders(k)} == device
    assert cluster.index.num_blocks(r.index) == len(device)
    assert engine.summary()['prefix_cache_evictions'] > 0  # the index followed evictions too


@functools.lru_cache(maxsize=None)
def run_host(router: str) -> SimulatedCluster:
  """The :tiny_llmd_host cluster (a 128-block host-RAM tier per replica) under one router."""
  cfg = cluster_config.get_config('tiny_llmd_host')
  engines, costs = study_lib.make_engines(cfg, cfg.cluster.replicas)
  cluster = SimulatedCluster(engines, routers.make_router(router), costs)
  cluster.run(study_lib.make_trace(cfg))
  return cluster


def test_kv_index_holds_each_replica_device_and_host_keys():
  """With host tiers, the index kept from the replicas' events holds exactly each one's device
  cache (medium GPU) and host tier (medium CPU), through evictions in both; the host tier
  served hits, announced at routing, and the cost model the routers weigh is the tiers'."""
  cluster = run_host('tier_cost')
  for r in cluster.replicas:
    cache, engine = r.engine.prefix_cache, r.engine
    device = {cache.entry(b)[0] for b in range(1, engine.allocator.num_blocks)
              if cache.is_cached(b)}
    host = engine.tiers.host.index
    assert cluster.index.blocks(r.index, 'GPU') == device
    assert cluster.index.blocks(r.index, 'CPU') == set(host.keys()) and len(host) > 0
    assert r.state.cost is engine.tiers.cost
    s = engine.summary()
    assert s['tiers_tier2_hit_blocks'] > 0 and s['prefix_cache_evictions'] > 0
  assert sum(r.engine.summary()['tiers_tier2_evictions'] for r in cluster.replicas) > 0
  f = cluster.figures()
  assert f['hit_rate_tier2_tokens'] > 0.05 and f['host_at_routing_fraction'] > 0.05
  assert f['hit_rate_tiered_tokens'] == pytest.approx(f['hit_rate_tier1_tokens'] +
                                                      f['hit_rate_tier2_tokens'])
  engines, costs = study_lib.make_engines(cluster_config.get_config('tiny_llmd_host'), 2)
  with pytest.raises(ValueError, match='shared_store_blocks=8 with replicas that have their own'):
    SimulatedCluster(engines, routers.make_router('random'), costs, shared_store_blocks=8)


def test_host_tier_study_reports_the_tier_mix(tmp_path):
  """:tiny_llmd_host with two of its routers: the row with the host tier finds more of the
  prompts (device + host) than its device-only replay and computes less."""
  cfg = cluster_config.get_config('tiny_llmd_host')
  cfg.cluster.routers = tuple(r for r in cfg.cluster.routers if r[0] in ('precise', 'tier_cost'))
  cfg.cluster.device_only_routers = ('tier_cost',)
  study_lib.check(cfg)
  summary = study_lib.study(cfg, str(tmp_path))
  assert 'Tier hit mix' in (tmp_path / 'table.md').read_text()
  rows = {o['router']: o for o in summary['routers']}
  assert list(rows) == ['precise', 'tier_cost', 'tier_cost (device only)']
  tiered, alone = rows['tier_cost'], rows['tier_cost (device only)']
  assert tiered['hit_rate_tier2_tokens'] > 0 and alone['hit_rate_tier2_tokens'] == 0
  assert tiered['hit_rate_tiered_tokens'] > alone['hit_rate_tiered_tokens']
  assert tiered['prompt_tokens_computed'] < alone['prompt_tokens_computed']
  assert rows['precise']['hit_rate_tier2_tokens'] > 0
  assert [r['rate'] for r in summary['tier_cost_vs_precise']] == [20.0, 80.0]
  cfg.cluster.device_only_routers = ('nearest',)
  with pytest.raises(ConfigError, match=r"cluster\.device_only_routers=\('nearest',\)"):
    study_lib.check(cfg)


def test_prefix_aware_routing_finds_more_cached_than_random():
  precise, rand = run('precise').figures(), run('random').figures()
  assert precise['prefix_hit_rate_tokens'] > rand['prefix_hit_rate_tokens'] + 0.2
  assert precise['cached_at_routing_fraction'] > rand['cached_at_routing_fraction'] + 0.2
  assert precise['prompt_tokens_computed'] < rand['prompt_tokens_computed']
  assert precise['route_p99_ms'] is not None and precise['kv_index_events'] > 0


def test_a_shared_store_is_in_the_index_for_every_replica_and_finds_more():
  """Under round robin (prefix-blind), 4 replicas of 96 blocks each and one store of their
  pooled 384: the index's shared holder holds exactly the store's blocks; the store finds a
  larger share of the prompts than the replicas' own caches do, and its hits are counted
  beside them."""
  local, shared = run('round_robin'), run('round_robin', 4 * 96)
  store = shared.store
  assert 0 < len(store) <= 384 and store.evicted > 0
  assert shared.index.blocks(index_lib.SHARED, 'DISK') == set(store.keys())
  assert all(not shared.index.blocks(r, 'DISK') for r in range(4))  # none per replica
  f, g = shared.figures(), local.figures()
  assert f['shared_store'] and f['hit_rate_shared_tokens'] > 0.1
  assert f['hit_rate_with_store_tokens'] > g['hit_rate_with_store_tokens'] + 0.1
  assert g['hit_rate_shared_tokens'] == 0 and g['prompt_tokens_shared'] == 0
  # the store's blocks are loaded, not computed: fewer prompt tokens computed than local
  assert f['prompt_tokens_computed_with_store'] == f['prompt_tokens_computed']
  assert f['prompt_tokens_computed'] < g['prompt_tokens_computed'] - f['prompt_tokens_shared'] / 2
  # every replica counts a store block for the precise router: a prompt whose blocks only the
  # store holds matches on all of them
  keys = routers.RouteRequest(-1, trace()[-1].prompt_ids).keys(config().pool.block_size)
  held = shared.index.match(keys, range(4))
  assert len(held) == 4 and all(held[r] for r in range(4))


def test_mooncake_study_compares_local_caches_with_a_shared_store(tmp_path):
  cfg = cluster_config.get_config('tiny_mooncake')
  study_lib.check(cfg)
  summary = study_lib.study(cfg, str(tmp_path))
  for name in ('routers.csv', 'table.md', 'mooncake.png', 'summary.json'):
    assert os.path.getsize(tmp_path / name) > 0, name
  rows = [(r['router'], r['cache']) for r in summary['routers']]
  assert rows == [('round_robin', 'local'), ('precise', 'local'), ('precise', 'shared')]
  assert all(r['finished_requests'] == summary['requests'] == 300 for r in summary['routers'])
  shared = summary['comparison']['shared'][0]
  assert shared['router'] == 'precise' and shared['hit_ratio_vs_same_router_local'] >= 1
  assert summary['routers'][2]['hit_rate_shared_tokens'] > 0
  assert all(r['routing_replicas'] == 16 and r['routing_p50_ms'] > 0 for r in summary['routers'])
  assert json.loads((tmp_path / 'summary.json').read_text())['variant'] == 'tiny_mooncake'


def test_study_writes_its_files(tmp_path):
  cfg = config()
  cfg.cluster.routers = tuple(r for r in cfg.cluster.routers if r[0] in study_lib.ORDER)
  study_lib.check(cfg)
  summary = study_lib.study(cfg, str(tmp_path))
  for name in ('stages.csv', 'routers.csv', 'replicas.csv', 'table.md', 'cluster.png',
               'summary.json'):
    assert os.path.getsize(tmp_path / name) > 0, name
  saved = json.loads((tmp_path / 'summary.json').read_text())
  assert saved['simulated'] and [o['rate'] for o in saved['ordering']] == [20.0, 80.0]
  assert {o['router'] for o in summary['routers']} == set(study_lib.ORDER)
  assert saved['routing_cost']['replicas'] == cfg.cluster.routing_replicas


def test_check_names_the_bad_field():
  cfg = config()
  cfg.workload.rates = ()
  with pytest.raises(ConfigError, match=r'workload\.rates=\(\) is not allowed'):
    study_lib.check(cfg)
  cfg = config()
  cfg.cluster.routers = (('mine', 'nearest', {}),)
  with pytest.raises(ConfigError,
                     match=r"cluster\.routers\['mine'\]='nearest'.*one of \('random'"):
    study_lib.check(cfg)
  cfg = config()
  cfg.workload.prefix_tokens = 4000
  with pytest.raises(ConfigError, match='at most engine.max_seq_len=1024'):
    study_lib.check(cfg)
  cfg = cluster_config.get_config('tiny_mooncake')
  cfg.cluster.store_routers = ('nearest',)
  with pytest.raises(ConfigError, match=r"cluster\.store_routers=\('nearest',\) is not allowed"):
    study_lib.check(cfg)
  cfg = cluster_config.get_config('tiny_mooncake')
  cfg.cluster.shared_store_blocks = 0
  with pytest.raises(ConfigError, match=r'cluster\.shared_store_blocks=0 is not allowed'):
    study_lib.check(cfg)
  cfg = cluster_config.get_config('tiny_mooncake')
  cfg.workload.path = '/no/such/trace.jsonl'
  with pytest.raises(ConfigError, match=r'workload\.path=.*block-hash trace'):
    study_lib.check(cfg)


def test_a_store_hit_is_loaded_not_computed_and_its_ttft_pays_the_load():
  """Two replicas under round robin and one store: the second request for a prompt lands on
  the replica that never saw it, finds its blocks in the store, computes only the rest, and
  its first token comes after the load's tier-3 time (store latency + bytes / bandwidth)."""
  cfg = cluster_config.get_config('tiny_mooncake')  # blocks of 8; a 100 GB/s, 100 us store
  engines, costs = study_lib.make_engines(cfg, 2)
  costs = [study_lib.store_costs(cfg, c) for c in costs]
  bs = engines[0].block_size
  prompt = list(range(10, 10 + 12 * bs + 5))  # 12 full blocks
  requests = [study_lib.ClusterRequest(i, prompt, 2, 1.0 * i) for i in range(2)]
  cluster = SimulatedCluster(engines, routers.make_router('round_robin'), costs,
                             shared_store_blocks=64)
  first, second = sorted(cluster.run(requests), key=lambda o: o.request_id)
  assert (first.replica, second.replica) == (0, 1)
  assert first.shared_at_routing == 0 and second.shared_at_routing == 12 * bs
  computed = [e.summary()['prompt_tokens_computed'] for e in engines]
  assert computed == [len(prompt), len(prompt) - 12 * bs]
  load_s = costs[1].load_s([3] * 12)
  assert load_s > 1e-4 and second.ttft_s > load_s
  assert second.ttft_s < first.ttft_s  # loading 12 blocks beats computing them here
  with pytest.raises(ValueError, match='shared_store_blocks=64 needs costs'):
    SimulatedCluster(engines, routers.make_router('round_robin'), shared_store_blocks=64)


def test_progress_figures_of_nothing_measured_read_n_a():
  """A run that computed no prompt tokens has no hit rate (None): its progress line says n/a
  instead of failing to format it."""
  assert study_lib._figure(None) == 'n/a' and study_lib._figure(0.4567) == '0.457'  # pylint: disable=protected-access


def test_replicas_sharing_one_machine_step_slower_while_others_are_busy():
  """machine_share=1: two requests at once on two replicas take about twice as long as on
  replicas with a machine each; a lone request (nobody else busy) takes exactly as long."""
  cfg = config()
  prompts = [list(range(1 + 100 * i, 65 + 100 * i)) for i in range(2)]

  def ttfts(requests, share):
    engines, _ = study_lib.make_engines(cfg, 2)
    cluster = SimulatedCluster(engines, routers.make_router('round_robin'),
                               machine_share=share)
    cluster.run(requests)
    return ([o.first_token_time - o.arrival_time for o in
             sorted(cluster.outcomes, key=lambda o: o.request_id)], cluster)

  together = [study_lib.ClusterRequest(i, p, 4, 0.0) for i, p in enumerate(prompts)]
  alone, _ = ttfts(together, None)
  shared, cluster = ttfts(together, 1.0)
  assert all(1.9 < s / a < 2.1 for s, a in zip(shared, alone)), (shared, alone)
  assert cluster.figures()['slowdown_mean'] > 1.5
  one = [study_lib.ClusterRequest(0, prompts[0], 4, 0.0)]
  assert ttfts(one, 1.0)[0] == ttfts(one, None)[0]
  engines, _ = study_lib.make_engines(cfg, 2)
  for bad in (0, -1.0, float('nan'), True):
    with pytest.raises(ValueError, match='machine_share=.* is not allowed'):
      SimulatedCluster(engines, routers.make_router('round_robin'), machine_share=bad)
