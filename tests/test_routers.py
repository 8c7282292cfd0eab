"""Routers and the cluster KV index (pagedjax/cluster/): each policy's decision on hand-built
replica states, the index's view after stored / removed / cleared events, the tier-cost
router's expected TTFT against the formula, the registry, and that none of it needs jax."""
import math
import pathlib
import subprocess
import sys

import pytest

from pagedjax.cluster import routers
from pagedjax.cluster.index import KVIndex, prompt_keys
from pagedjax.host import kv_events
from pagedjax.host.tiers.tier_cost import TierCosts

BS = 4
ROOT = pathlib.Path(__file__).resolve().parent.parent


def states(n=3, **fields):
  return [routers.ReplicaState(i, capacity_blocks=64, block_size=BS,
                               **{k: v[i] for k, v in fields.items()}) for i in range(n)]


def request(ids, rid=0, salt=None):
  return routers.RouteRequest(rid, list(ids), salt)


def stored(keys, medium='GPU'):
  return [kv_events.BlockStored((k,), None, (), BS, None, medium) for k in keys]


PROMPT = list(range(40))  # 10 full blocks
KEYS = prompt_keys(PROMPT, BS)


def test_index_follows_events_and_matches_longest_prefix_with_best_tier():
  index = KVIndex()
  index.apply(0, stored(KEYS[:6]))
  index.apply(1, stored(KEYS[:3]) + stored(KEYS[:8], 'CPU'))
  index.apply(2, stored(KEYS[1:5]))  # no first block: holds no prefix
  assert index.match(KEYS) == {0: [1] * 6, 1: [1, 1, 1, 2, 2, 2, 2, 2]}
  index.apply(1, [kv_events.BlockRemoved((KEYS[1],), 'GPU')])
  assert index.match(KEYS)[1] == [1, 2, 1, 2, 2, 2, 2, 2]
  assert index.holders(KEYS[1]) == {0: [1], 1: [2], 2: [1]}
  index.apply(0, kv_events.KVEventBatch(1.0, (kv_events.BlockRemoved((KEYS[2],), 'GPU'),)))
  assert index.match(KEYS)[0] == [1, 1]
  index.apply(1, [kv_events.AllBlocksCleared('CPU')])
  assert index.match(KEYS)[1] == [1] and index.num_blocks(1, 'CPU') == 0
  index.apply(0, [kv_events.AllBlocksCleared()])
  assert 0 not in index.match(KEYS) and index.num_blocks(0) == 0
  index.apply(0, [kv_events.BlockRemoved((KEYS[0],), 'GPU')])  # removed twice: ignored
  with pytest.raises(TypeError, match='BlockStored'):
    index.apply(0, ['not an event'])
  assert index.match(prompt_keys(PROMPT, BS, salt='other tenant')) == {}


def test_random_and_round_robin():
  s = states(4)
  draws = [[r.route(request(PROMPT), s) for _ in range(50)]
           for r in (routers.make_router('random', seed=3), routers.make_router('random', seed=3))]
  assert draws[0] == draws[1] and set(draws[0]) == {0, 1, 2, 3}  # seeded, and covers them all
  rr = routers.make_router('round_robin')
  assert [rr.route(request(PROMPT), s) for _ in range(6)] == [0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize('metric,expected', [('tokens', 2), ('kv', 0), ('requests', 1)])
def test_least_loaded_metrics(metric, expected):
  s = states(3, queued_prefill_tokens=[500, 0, 10], running_tokens=[500, 900, 10],
             kv_usage=[0.1, 0.5, 0.9], num_running=[4, 1, 3])
  assert routers.make_router('least_loaded', metric=metric).route(request(PROMPT), s) == expected


def test_approx_prefix_affinity_balance_and_forgetting():
  r = routers.make_router('approx_prefix', block_size=BS, match_threshold=0.5, balance_abs=4,
                          balance_rel=1.5, capacity_blocks=12)
  s = states(3, num_running=[2, 1, 0])
  first = r.route(request(PROMPT), s)
  assert first == 2  # nothing remembered: least loaded
  r.routed(request(PROMPT), first)
  s[2].num_running = 2  # now busier than replica 1, but it holds the prefix
  assert r.route(request(PROMPT + [7, 7, 7, 7]), s) == 2
  other = [1000 + t for t in PROMPT]
  assert r.route(request(PROMPT[:8] + other), s) == 1  # 2 of 12 blocks: below the threshold
  s[2].num_running = 9  # imbalanced: max - min > 4 and max > 1.5 x min
  assert r.route(request(PROMPT), s) == 1
  s[2].num_running = 2
  r.routed(request(other), 2)  # 10 more blocks on replica 2: over its 12, the oldest go
  assert r.route(request(PROMPT), s) == 1  # only PROMPT's first 2 blocks are left there


def test_approx_prefix_sends_cold_prompts_where_it_has_sent_least():
  """cold='routed': a prompt no replica matches goes to the replica sent the fewest prompt
  tokens so far (Ray's smallest prefix tree), however loaded it is now; 'load' (the default)
  to the least loaded. A bad mode is named."""
  s = states(3, num_running=[0, 3, 3])
  by_routed = routers.make_router('approx_prefix', block_size=BS, cold='routed')
  by_load = routers.make_router('approx_prefix', block_size=BS)
  for r in (by_routed, by_load):
    r.routed(request(range(100, 140)), 0)  # 40 tokens sent to replica 0
    r.routed(request(range(200, 208)), 1)  # 8 to replica 1
  cold = request(range(500, 540))
  assert by_load.route(cold, s) == 0  # the least loaded
  assert by_routed.route(cold, s) == 2  # nothing sent there yet
  by_routed.routed(request(range(300, 316)), 2)  # 16 to replica 2: replica 1 has had least
  assert by_routed.route(cold, s) == 1
  assert by_routed.route(request(range(100, 140)), s) == 0  # a match still goes to its holder
  with pytest.raises(ValueError, match="cold='tree' is not allowed: one of load, routed"):
    routers.make_router('approx_prefix', cold='tree')


def test_precise_prefers_held_prefix_then_device_tier_then_load():
  index = KVIndex()
  index.apply(0, stored(KEYS[:2]))
  index.apply(1, stored(KEYS, 'CPU'))
  index.apply(2, stored(KEYS))
  r = routers.make_router('precise', index=index)
  s = states(3)
  assert r.route(request(PROMPT), s) == 2  # all blocks on the device
  index.apply(2, [kv_events.AllBlocksCleared()])
  assert r.route(request(PROMPT), s) == 1  # all in host RAM beats two on the device
  s[1].kv_usage, s[1].num_running = 1.0, 10  # full and the busiest: load outweighs the prefix
  assert r.route(request(PROMPT), s) == 0  # and two blocks held beat none
  assert r.route(request([99] * 3), states(3, num_running=[3, 1, 2])) == 1  # no full block


def test_ties_go_to_the_least_loaded_then_in_turn():
  """Idle replicas and prefixes nobody holds score the same: the cold prefixes are spread in
  turn (not all on replica 0), the least queued tokens first; a held prefix still decides.
  The other policies take equals in turn too."""
  index = KVIndex()
  r = routers.make_router('precise', index=index)
  cold = [request(range(100 + 8 * i, 108 + 8 * i), i) for i in range(6)]
  assert [r.route(q, states(3)) for q in cold] == [0, 1, 2, 0, 1, 2]
  assert r.route(cold[0], states(3, queued_prefill_tokens=[40, 8, 40])) == 1
  assert {r.route(q, states(3, running_tokens=[0, 9, 0])) for q in cold[:2]} == {0, 2}
  index.apply(1, stored(KEYS))
  assert [r.route(request(PROMPT), states(3)) for _ in range(3)] == [1, 1, 1]
  for name, kwargs in (('least_loaded', {}), ('approx_prefix', {}),
                       ('tier_cost', {'index': KVIndex()})):
    other = routers.make_router(name, **kwargs)
    assert [other.route(q, states(3)) for q in cold[:4]] == [0, 1, 2, 0], name


def test_tier_cost_expected_ttft_is_the_formula():
  cost = TierCosts.for_tiers(BS, block_bytes=1000, prefill_s_per_token=1e-3, host=(1e5, 0.002),
                             disk=(1e4, 0.01))
  index = KVIndex()
  index.apply(0, stored(KEYS[:4]) + stored(KEYS[:8], 'CPU'))
  index.apply(1, stored(KEYS, 'DISK'))
  r = routers.make_router('tier_cost', index=index)
  s = states(3, queued_prefill_tokens=[100, 0, 0])
  for state in s:
    state.cost = cost
  held = index.match(KEYS)
  # replica 0: 100 queued + 8 prompt tokens not held; 4 host blocks: load (2 ms + 4 x 10 ms) vs
  # recompute 16 ms: recomputed
  assert math.isclose(r.expected_ttft_s(request(PROMPT), s[0], held[0]), 0.1 + 0.008 + 0.016)
  # replica 1: every block on disk, each 1000 B / (1/(1/1e4 + 1/1e5)) = 0.11 s: recompute all
  assert math.isclose(r.expected_ttft_s(request(PROMPT), s[1], held[1]), 0.040)
  assert r.route(request(PROMPT), s) == 1  # ties with replica 2 (holds nothing) go to less load
  s[1].running_tokens = 5
  assert r.route(request(PROMPT), s) == 2
  s[0].queued_prefill_tokens = 0
  assert r.route(request(PROMPT), s) == 0  # 8 ms + 16 ms (host blocks recomputed) < 40 ms
  fast_host = TierCosts.for_tiers(BS, 1000, 1e-3, host=(1e9, 0.0), disk=(1e4, 0.01))
  s[0].cost = fast_host
  assert math.isclose(r.expected_ttft_s(request(PROMPT), s[0], held[0]), 0.008 + 4e-6)  # loaded


def test_tier_cost_charges_the_work_it_adds_for_the_requests_it_delays():
  """score_s = expected TTFT + delay_weight x the prompt's own work x the larger of the requests
  waiting at the replica and the mean waiting over the replicas. A holder with the longer
  queue loses to an idle replica on the TTFT alone (delay_weight=0) and wins once the cluster
  has requests waiting (the idle replica would recompute the whole prompt for them)."""
  cost = TierCosts.for_tiers(BS, 1000, 1e-3, host=(1e5, 0.002), disk=(1e4, 0.01))
  index = KVIndex()
  index.apply(0, stored(KEYS[:8]))  # replica 0 holds 8 of the 10 blocks: 8 tokens to compute
  s = states(3, queued_prefill_tokens=[30, 0, 0], num_waiting=[0, 0, 0])
  for state in s:
    state.cost = cost
  held = index.match(KEYS)
  plain = routers.make_router('tier_cost', index=index, delay_weight=0.0)
  delaying = routers.make_router('tier_cost', index=index, delay_weight=2.0)
  assert math.isclose(delaying.score_s(request(PROMPT), s[0], held[0]), 0.030 + 0.008)
  assert plain.route(request(PROMPT), s) == delaying.route(request(PROMPT), s) == 0  # idle
  s[0].queued_prefill_tokens = 60  # 68 ms on the holder against 40 ms anywhere else
  assert plain.route(request(PROMPT), s) == delaying.route(request(PROMPT), s) in (1, 2)
  s[0].num_waiting, s[1].num_waiting, s[2].num_waiting = 3, 0, 0  # mean 1: 40 ms x (1 + 2)
  assert math.isclose(delaying.score_s(request(PROMPT), s[1], (), mean_waiting=1.0), 0.120)
  assert math.isclose(delaying.score_s(request(PROMPT), s[0], held[0], mean_waiting=1.0),
                      0.060 + 0.008 * (1 + 2 * 3))  # 116 ms
  assert plain.route(request(PROMPT), s) in (1, 2)
  assert delaying.route(request(PROMPT), s) == 0
  with pytest.raises(ValueError, match='delay_weight=-1.0 is not allowed'):
    routers.make_router('tier_cost', delay_weight=-1.0)


def test_pending_routes_count_a_routed_prompt_until_the_index_shows_it():
  """tier_cost sends a prompt's second request where the first went while the index cannot
  show it yet (prefill queued); once the index has been told of the blocks (its on_stored
  listener), it alone decides (an eviction is not papered over), and an entry the index never
  confirms expires."""
  cost = TierCosts.for_tiers(BS, 1000, 1e-3, host=(1e5, 0.002), disk=(1e4, 0.01))
  index = KVIndex()
  r = routers.make_router('tier_cost', index=index, pending_decisions=3)
  s = states(3)
  for state in s:
    state.cost = cost
  q = request(PROMPT)
  first = r.route(q, s)
  r.routed(q, first)
  s[first].queued_prefill_tokens = 10  # its prefill queued there: 10 + 0 ms against 40 ms
  assert r.route(request(PROMPT, 1), s) == first
  pending = r.pending.extend(KEYS, {})
  assert pending == {first: [1] * len(KEYS)}
  index.apply(first, stored(KEYS[:6]))  # computed in part: the index shows 6 blocks
  assert r.pending.extend(KEYS, index.match(KEYS)) == {first: [1] * len(KEYS)}
  index.apply(first, [kv_events.AllBlocksCleared()])  # evicted: confirmed blocks never count
  assert r.pending.extend(KEYS, index.match(KEYS)) == {}
  q2 = request(range(100, 140), 2)
  r.routed(q2, 2)
  keys2 = q2.keys(BS)
  assert r.pending.extend(keys2, {}) == {2: [1] * len(keys2)}
  for _ in range(2):
    r.pending.extend([], {})
  assert r.pending.extend(keys2, {}) == {}  # 3 decisions on: expired
  assert not r.pending._entries and not r.pending._queue  # pylint: disable=protected-access
  # routed to a replica the index already shows holding the prompt: nothing is pending there,
  # so an eviction afterwards is not papered over either
  index2 = KVIndex()
  index2.apply(1, stored(KEYS))
  r2 = routers.make_router('tier_cost', index=index2)
  q3 = request(PROMPT, 3)
  assert r2.route(q3, s) == 1
  r2.routed(q3, 1)
  index2.apply(1, [kv_events.AllBlocksCleared()])
  assert r2.pending.extend(KEYS, index2.match(KEYS)) == {}
  off = routers.make_router('tier_cost', index=index, pending_decisions=0)
  assert off.pending is None
  with pytest.raises(ValueError, match='pending_decisions=-1 is not allowed'):
    routers.make_router('tier_cost', pending_decisions=-1)


def test_in_transit_adds_the_sends_a_replica_has_not_counted_yet():
  """A live router's view of a replica: as published, plus what it sent there that the
  replica's `received` count does not cover yet, as waiting requests and prompt tokens."""
  transit = routers.InTransit()
  published = dict(capacity_blocks=64, block_size=BS, num_waiting=1, queued_prefill_tokens=10,
                   received=1)
  for tokens in (10, 20, 30):
    transit.sent('a', tokens)
  state = transit.state(0, 'a', published)
  assert (state.index, state.num_waiting, state.queued_prefill_tokens) == (0, 3, 60)
  assert transit.state(0, 'a', {**published, 'received': 3}).num_waiting == 1  # all arrived
  assert transit.state(0, 'a', {**published, 'received': 9}).num_waiting == 1  # other routers
  no_count = {k: v for k, v in published.items() if k != 'received'}
  assert transit.state(0, 'a', no_count).queued_prefill_tokens == 10  # as published
  assert transit.state(1, 'b', {}).num_waiting == 0  # nothing sent, nothing published
  # least loaded no longer sends a second request to the replica the first went to while
  # neither replica's publication shows it (replica 1 published a little more load)
  published = [dict(capacity_blocks=64, block_size=BS, received=0),
               dict(capacity_blocks=64, block_size=BS, received=0, running_tokens=5)]
  transit, router = routers.InTransit(), routers.make_router('least_loaded')
  picks = []
  for _ in range(2):
    pick = router.route(request(range(8)), [transit.state(i, i, published[i]) for i in range(2)])
    transit.sent(pick, 8)
    picks.append(pick)
  assert picks == [0, 1]
  transit.forget(0)
  assert transit.state(0, 0, published[0]).num_waiting == 0


def test_registry():
  assert set(routers.ROUTERS.names()) >= {'random', 'round_robin', 'least_loaded', 'approx_prefix',
                                  'precise', 'tier_cost'}
  cls = routers.router_class('pagedjax.cluster.routers:RoundRobinRouter')
  assert cls is routers.RoundRobinRouter
  with pytest.raises(ValueError,
                     match=r"router policy 'nearest' is not registered: one of \('random'"):
    routers.make_router('nearest')
  with pytest.raises(ValueError, match="has no 'Nope'"):
    routers.make_router('pagedjax.cluster.routers:Nope')
  with pytest.raises(ValueError, match='not a class with route'):
    routers.make_router('pagedjax.cluster.index:KVIndex')
  with pytest.raises(ValueError, match='already registered'):
    routers.register('random')(routers.RoundRobinRouter)
  with pytest.raises(ValueError, match="metric='hops'"):
    routers.make_router('least_loaded', metric='hops')
  with pytest.raises(ValueError, match='match_threshold=2'):
    routers.make_router('approx_prefix', match_threshold=2)


def test_routers_and_index_import_without_jax():
  code = '''
import importlib, sys
BLOCKED = ('jax', 'jaxlib', 'flax', 'kernels', 'pagedjax.device', 'pagedjax.model', 'torch')
class Refuse:
  def find_spec(self, name, path=None, target=None):
    if any(name == b or name.startswith(b + '.') for b in BLOCKED):
      raise ImportError(f'router code imported {name}')
sys.meta_path.insert(0, Refuse())
import pagedjax.cluster.routers, pagedjax.cluster.index
print('ok')
'''
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                       check=False)
  assert out.returncode == 0 and out.stdout.strip() == 'ok', out.stderr
