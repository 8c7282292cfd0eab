"""Routing across replicas, simulated: which router keeps TTFT down when prefixes repeat.

  python -m experiments.cluster --workdir=runs/cluster
  python -m experiments.cluster --config=configs/cluster.py:tiny --workdir=/tmp/cluster

`cluster.replicas` simulated replicas (pagedjax/cluster/sim.py: the real engine host code each,
device time from pagedjax/sim's cost model) behind each router row of `cluster.routers` replay
one multi-tenant trace (configs/cluster.py: llm-d's precise-routing benchmark, scaled down):
Poisson arrivals in stages of rising rate. Per router and per stage: TTFT and TPOT
p50/p90/p99, throughput, the prompt share the chosen replica's device cache held at routing, and
load imbalance; per router and replica: hit rate, prompt tokens computed. Then the routing
cost: each router deciding over `cluster.routing_replicas` replicas whose KV index holds every
tenant's prefix on `routing_copies` of them, timed per request on this machine's clock (wall
seconds, so the figure depends on this machine and its load; the load average is recorded).

The question the study answers (llm-d's finding): is the p90 TTFT ordering at high load precise
< approximate < load-aware ~ random?

  python -m experiments.cluster --config=configs/cluster.py:llmd_host --workdir=runs/llmd_host

is the same question where the hot prefixes exceed the replicas' device memory and live in a
host-RAM KV tier (config.tiers.host_blocks; configs/cluster.py:llmd_host): does the tier-aware
router at least match precise routing, and beat it? Per router also the tier hit mix (device,
host), the host share expected at routing, the promotions and host evictions; the rows of
`cluster.device_only_routers` are replayed without the host tier ("ROUTER (device only)").

  python -m experiments.cluster --config=configs/cluster.py:mooncake --workdir=runs/mooncake

`workload.kind='mooncake'` (configs/cluster.py:mooncake) is another question, Mooncake's
(FAST'25): how much more of the prompts does one cache shared by all replicas find than each
replica's local cache, with each router? Every router row replays a block-hash trace with local
caches, then the rows named in `cluster.store_routers` again with a shared store under the
replicas (sim.py). Per row: the share of prompt tokens found cached when routed (device, and
the shared store past it), the prompt tokens computed, prefill compute seconds by the cost
model (computed tokens x prefill s/token, plus the store's loads at store_bytes_per_s), TTFT
(simulated; local-cache timing in every row: a simulated pool holds no contents to load), the
routing time in the run, and the routing cost at `routing_replicas` replicas. Writes
routers.csv, table.md, mooncake.png and summary.json (with the shared / local hit-rate ratios
set beside the paper's 1.38-2.36x).

Writes to WORKDIR:
  stages.csv        per router and stage: the figures above
  routers.csv       per router, over the whole trace (and the routing cost)
  replicas.csv      per router and replica
  table.md          the p90-TTFT table (router x stage) and the routers table
  cluster.png       p90 TTFT, held-at-routing fraction and throughput against the rate
  summary.json      everything above, the ordering per stage and whether it holds, the setting,
                    the load average, config, versions, git state
Every figure but the routing cost is simulated seconds, and says so.

  python -m experiments.cluster --config.cluster.routing_only=True --workdir=runs/routing

measures the routing cost alone (no simulation; routing.csv, summary.json): per request the
prompt's chain keys (computed once and handed to the chosen replica's engine, which would
otherwise compute the same keys) and the router's decision, in wall and thread CPU time.
"""
import gc
import os
import time

import numpy as np

from experiments import cli
from pagedjax import sizing
from pagedjax.studies import run_info
from pagedjax.cluster import routers as routers_lib
from pagedjax.cluster.index import KVIndex
from pagedjax.cluster.sim import ClusterRequest, SimulatedCluster, latency_figures
from pagedjax.config import Config, ConfigError
from pagedjax.host import kv_events
from pagedjax.host.tiers import tier_cost
from pagedjax.sim import hardware, simulated_device
from pagedjax.studies import workloads

STAGE_COLUMNS = ('router', 'rate', 'finished_requests', 'ttft_p50_s', 'ttft_p90_s',
                 'ttft_p99_s', 'tpot_p50_s', 'tpot_p90_s', 'tpot_p99_s', 'requests_per_s',
                 'generated_tokens_per_s', 'cached_at_routing_fraction',
                 'host_at_routing_fraction')
ROUTER_COLUMNS = ('router', 'finished_requests', 'prefix_hit_rate_tokens', 'hit_rate_tier1_tokens',
                  'hit_rate_tier2_tokens', 'hit_rate_tier3_tokens', 'hit_rate_tiered_tokens',
                  'host_at_routing_fraction', 'tiers_promoted_blocks', 'tiers_declined_blocks',
                  'tiers_tier2_evictions', 'prompt_tokens_computed',
                  'ttft_p50_s', 'ttft_p90_s', 'ttft_p99_s', 'tpot_p50_s', 'tpot_p90_s',
                  'tpot_p99_s', 'generated_tokens_per_s', 'imbalance_requests',
                  'imbalance_prefill', 'route_p50_ms', 'route_p99_ms', 'routing_p50_ms',
                  'routing_p99_ms', 'routing_max_ms', 'simulator_wall_s')
REPLICA_COLUMNS = ('router', 'replica', 'requests', 'prefix_hit_rate_tokens',
                   'prompt_tokens_computed', 'prefix_cache_evictions', 'preemptions',
                   'ttft_p50_s', 'ttft_p90_s', 'ttft_p99_s')
ORDER = ('precise', 'approximate', 'load_aware', 'random')  # the ordering the study checks
MOONCAKE_COLUMNS = ('router', 'cache', 'finished_requests', 'hit_rate_with_store_tokens',
                    'cached_at_routing_fraction', 'hit_rate_shared_tokens',
                    'prefix_hit_rate_tokens', 'prompt_tokens_computed_with_store',
                    'prefill_compute_s', 'ttft_p50_s', 'ttft_p90_s', 'imbalance_requests',
                    'imbalance_prefill', 'route_p50_ms', 'route_p99_ms', 'routing_p50_ms',
                    'routing_p99_ms', 'routing_max_ms', 'simulator_wall_s')
PAPER_RATIO = (1.38, 2.36)  # Mooncake FAST'25: global cache hit rate / local caches'
WORKLOAD_KINDS = ('tenants', 'mooncake')


def model_shape(config) -> sizing.ModelShape:
  return sizing.ModelShape(**config.sim.shape.to_dict())


def _fail(name, value, allowed):
  raise ConfigError(f'config.{name}={value!r} is not allowed: {allowed}')


def check(config) -> None:
  """Config errors named before anything runs."""
  w, c = config.workload, config.cluster
  fail = _fail
  kind = w.get('kind', 'tenants')
  if kind not in WORKLOAD_KINDS:
    fail('workload.kind', kind, f'one of {WORKLOAD_KINDS}')
  if kind == 'mooncake':
    check_mooncake(config)
  else:
    check_tenants(config)
  for name in ('replicas', 'routing_replicas', 'routing_copies', 'routing_requests'):
    if not isinstance(c[name], int) or c[name] < 1:
      fail(f'cluster.{name}', c[name], 'an integer >= 1')
  if not isinstance(c.get('routing_only', False), bool):
    fail('cluster.routing_only', c.routing_only, 'True or False')
  if c.routing_copies > c.routing_replicas:
    fail('cluster.routing_copies', c.routing_copies,
         f'at most cluster.routing_replicas={c.routing_replicas}')
  labels = [row[0] for row in c.routers]
  if not labels or len(set(labels)) != len(labels):
    fail('cluster.routers', labels, 'a non-empty tuple of (label, router, kwargs), labels '
         'unique')
  for row in c.routers:
    if len(row) != 3:
      fail('cluster.routers', row, 'rows of (label, router, kwargs)')
    label, name, kwargs = row
    try:
      routers_lib.make_router(name, **dict(kwargs))
    except (ValueError, TypeError) as e:
      fail(f'cluster.routers[{label!r}]', name, str(e))
  for field in ('store_routers', 'device_only_routers'):
    unknown = [label for label in c.get(field, ()) if label not in labels]
    if unknown:
      fail(f'cluster.{field}', tuple(c[field]), f'labels of cluster.routers {labels}')
  if c.get('device_only_routers') and not config.tiers.host_blocks:
    fail('cluster.device_only_routers', tuple(c.device_only_routers),
         '() unless tiers.host_blocks > 0 (the rows replayed without the host tier)')
  if config.tiers.disk_blocks:
    fail('tiers.disk_blocks', config.tiers.disk_blocks,
         '0 (a simulated replica has a host-RAM tier only)')
  if config.tiers.host_blocks and c.get('store_routers'):
    fail('cluster.store_routers', tuple(c.store_routers),
         '() when tiers.host_blocks > 0 (a shared store under replicas with their own tiers '
         'is not modelled)')
  if c.get('store_routers'):
    if not isinstance(c.shared_store_blocks, int) or c.shared_store_blocks < 1:
      fail('cluster.shared_store_blocks', c.shared_store_blocks,
           'an integer >= 1 when cluster.store_routers names rows')
    own = c.get('store_replica_blocks', 0)
    if not isinstance(own, int) or own < 0:
      fail('cluster.store_replica_blocks', own, 'an integer >= 0 (0: pool.num_blocks)')
    if not c.store_bytes_per_s > 0 or not c.store_latency_s >= 0:
      fail('cluster.store_bytes_per_s', c.store_bytes_per_s,
           'bytes/s > 0 (and store_latency_s >= 0) when cluster.store_routers names rows')
  if not config.prefix_cache.enabled:
    fail('prefix_cache.enabled', False, 'True (a replica reuses cached prefixes)')
  model_shape(config)  # the shape's own checks (ValueError naming the field)
  hardware.get_hardware(config.sim.hardware)


def check_mooncake(config) -> None:
  w = config.workload
  if not os.path.isfile(w.path):
    _fail('workload.path', w.path, 'a block-hash trace file (JSON lines, Mooncake\'s format)')
  for name in ('start', 'limit'):
    if not isinstance(w[name], int) or w[name] < 0:
      _fail(f'workload.{name}', w[name], 'an integer >= 0 (limit 0: to the end)')
  if not isinstance(w.output_tokens, int) or w.output_tokens < 1:
    _fail('workload.output_tokens', w.output_tokens, 'an integer >= 1')
  if not 0 < w.length_scale <= 1:
    _fail('workload.length_scale', w.length_scale, 'a number in (0, 1]')
  if not w.time_scale > 0:
    _fail('workload.time_scale', w.time_scale, 'a number > 0')


def check_tenants(config) -> None:
  w = config.workload
  fail = _fail
  for name in ('tenants', 'prefix_tokens', 'users_per_tenant', 'question_tokens',
               'output_tokens', 'token_range'):
    if not isinstance(w[name], int) or w[name] < 1:
      fail(f'workload.{name}', w[name], 'an integer >= 1')
  if not w.rates or any(not isinstance(r, (int, float)) or r <= 0 for r in w.rates):
    fail('workload.rates', w.rates, 'a non-empty list of requests/s > 0')
  if not w.stage_s > 0:
    fail('workload.stage_s', w.stage_s, 'simulated seconds > 0')
  longest = w.prefix_tokens + w.question_tokens + w.output_tokens
  if longest > config.engine.max_seq_len:
    fail('workload.prefix_tokens', w.prefix_tokens, f'prefix + question + output tokens ('
         f'{longest}) at most engine.max_seq_len={config.engine.max_seq_len}')


def make_trace(config) -> list:
  """The stages' Poisson arrivals; a request is a random tenant's prefix + a random user's
  fresh question (token ids below workload.token_range). A 'mooncake' workload: mooncake_trace."""
  if config.workload.get('kind', 'tenants') == 'mooncake':
    return mooncake_trace(config)[0]
  w = config.workload
  rng = np.random.default_rng(w.seed)
  draw = lambda n: [int(t) for t in rng.integers(0, w.token_range, n)]
  prefixes = [draw(w.prefix_tokens) for _ in range(w.tenants)]
  requests, start = [], 0.0
  for rate in w.rates:
    t = start
    while True:
      t += rng.exponential(1.0 / rate)
      if t >= start + w.stage_s:
        break
      tenant = int(rng.integers(w.tenants))
      user = int(rng.integers(w.users_per_tenant))
      requests.append(ClusterRequest(len(requests), prefixes[tenant] + draw(w.question_tokens),
                                     w.output_tokens, t, label=float(rate), tenant=tenant,
                                     user=user))
    start += w.stage_s
  return requests


def mooncake_trace(config) -> tuple:
  """(requests, left out): the block-hash trace's requests (studies/workloads.py
  block_trace_requests: each hash id its own block of tokens, blocks and arrival gaps scaled),
  each asking for workload.output_tokens; prompts longer than engine.max_seq_len minus that are
  left out (counted)."""
  w = config.workload
  vocab = model_shape(config).vocab_size
  requests, dropped = [], 0
  for r in workloads.block_trace_requests(w.path, vocab, start=w.start, limit=w.limit or None,
                                          time_scale=w.time_scale,
                                          length_scale=w.length_scale):
    if len(r.prompt_ids) + w.output_tokens > config.engine.max_seq_len:
      dropped += 1
      continue
    requests.append(ClusterRequest(len(requests), r.prompt_ids, w.output_tokens, r.arrival_time,
                                   user=r.conversation_id))
  return requests, dropped


def make_engines(config, n: int) -> tuple:
  """n simulated replicas and each one's tier cost model (host/tiers/tier_cost.py)."""
  typed = Config.from_configdict(config)
  shape, hw, sim = model_shape(config), hardware.get_hardware(config.sim.hardware), config.sim
  engines, costs = [], []
  for _ in range(n):
    engine = simulated_device.simulated_engine(
        shape, hw, typed, weight_dtype=sim.weight_dtype, activation_dtype=sim.activation_dtype,
        count_padding=sim.count_padding)
    engines.append(engine)  # with KV tiers, the figures their promotion rule weighs
    costs.append(engine.tiers.cost if engine.tiers is not None and engine.tiers.cost else
                 engine.executor.backend.preemption_cost(typed.tiers, engine.executor))
  return engines, costs


def store_costs(config, cost: tier_cost.TierCosts) -> tier_cost.TierCosts:
  """A replica's cost model with the shared store as its tier 3 (cluster.store_bytes_per_s,
  store_latency_s, behind the host link)."""
  c = config.cluster
  return tier_cost.TierCosts.for_tiers(cost.block_size, cost.block_bytes,
                                       cost.prefill_s_per_token,
                                       (cost.bytes_per_s[2], cost.latency_s[2]),
                                       (c.store_bytes_per_s, c.store_latency_s))


def device_only(config):
  """The config without the replicas' KV tiers."""
  config = config.copy_and_resolve_references()
  config.tiers.host_blocks = 0
  config.cluster.device_only_routers = ()
  return config


def run_router(config, row, requests, shared_store: bool = False,
               device_only_row: bool = False) -> tuple:
  label, name, kwargs = row
  store_blocks = config.cluster.shared_store_blocks if shared_store else 0
  own = config.cluster.get('store_replica_blocks', 0)
  if shared_store and own:  # the replicas' own pools in the store's rows
    config = config.copy_and_resolve_references()
    config.pool.num_blocks = config.sim.num_blocks = own
  if device_only_row:
    config, label = device_only(config), f'{label} (device only)'

  engines, costs = make_engines(config, config.cluster.replicas)
  if shared_store:
    costs = [store_costs(config, cost) for cost in costs]
  cluster = SimulatedCluster(engines, routers_lib.make_router(name, **dict(kwargs)), costs,
                             shared_store_blocks=store_blocks)
  cluster.run(requests)
  overall = {**cluster.figures(), 'router': label, 'router_class': name}
  stages = []
  for rate in config.workload.get('rates', ()):
    mine = [o for o in cluster.outcomes if o.label == float(rate)]
    stages.append({'router': label, 'rate': float(rate), **latency_figures(mine)})
  replicas = [{'router': label, **r} for r in cluster.replica_figures()]
  return overall, stages, replicas, cluster


def _figure(value) -> str:
  """A figure for the progress lines: 3 decimals, or 'n/a' where there was nothing to measure
  (a hit rate of a run that computed no prompt tokens, a TTFT of no finished request)."""
  return 'n/a' if value is None else f'{value:.3f}'


def routing_cost(config, row, requests, shared_store: bool = False) -> dict:
  """Per-request decision time over routing_replicas replicas whose index holds each tenant's
  prefix blocks (as KV events would have announced them) on routing_copies replicas; for a
  block-hash trace, each routed prompt's blocks on routing_copies replicas. With a shared
  store, those blocks are also in it (the index's shared medium: every replica is matched).
  Every replica has the study's tier cost model (with the store's figures as its tier 3).
  Timed per request: the prompt's chain keys (computed once per request and kept on it, as
  the cluster's intake would; `routing_keys_*`), then the router's route and routed
  (`routing_decide_*`); `routing_p*_ms` is their sum, wall clock (under a loaded machine its
  tail is mostly the time other processes held the core), and `routing_cpu_*` the same span
  in this thread's CPU time (time.thread_time: the code's own cost, whatever the load)."""
  c, bs = config.cluster, config.pool.block_size
  cost = make_engines(config, 1)[1][0]
  if shared_store:
    cost = store_costs(config, cost)
  label, name, kwargs = row
  router = routers_lib.make_router(name, **dict(kwargs))
  index = KVIndex(shared_media=(kv_events.MEDIUM_DISK,) if shared_store else ())
  if getattr(router, 'index', False) is None:
    router.index = index
  rng = np.random.default_rng(1)
  prefixes = {}
  if config.workload.get('kind', 'tenants') == 'mooncake':
    prefixes = {r.request_id: r.prompt_ids for r in requests[:c.routing_requests]}
  else:
    for r in requests:
      prefixes.setdefault(r.tenant, r.prompt_ids[:config.workload.prefix_tokens])
  for tenant, prefix in prefixes.items():
    keys = routers_lib.RouteRequest(-1, prefix).keys(bs)
    for replica in rng.choice(c.routing_replicas, c.routing_copies, replace=False):
      index.apply(int(replica), [kv_events.BlockStored((k,), None, (), bs, None, 'GPU')
                                 for k in keys])
    if shared_store:
      index.apply(0, [kv_events.BlockStored(tuple(keys), None, (), bs, None, 'DISK')])
  states = [routers_lib.ReplicaState(i, capacity_blocks=config.pool.num_blocks - 1,
                                     block_size=bs, num_waiting=int(rng.integers(0, 8)),
                                     num_running=int(rng.integers(0, 32)),
                                     queued_prefill_tokens=int(rng.integers(0, 20000)),
                                     running_tokens=int(rng.integers(0, 200000)),
                                     kv_usage=float(rng.random()), cost=cost)
            for i in range(c.routing_replicas)]
  keys_s, decide_s, cpu_s = [], [], []
  # the trace's token lists are this process's, not a router's: a full collection walking
  # them (tens of ms for the Mooncake trace) would be timed as a decision
  gc.collect()
  gc.freeze()
  for r in requests[:c.routing_requests]:
    route = routers_lib.RouteRequest(r.request_id, r.prompt_ids, r.salt, r.max_new_tokens)
    cpu0, t0 = time.thread_time(), time.perf_counter()
    route.keys(bs)  # the prompt's chain keys, once per request (kept on it)
    t1 = time.perf_counter()
    pick = router.route(route, states)
    router.routed(route, pick)
    t2, cpu2 = time.perf_counter(), time.thread_time()
    keys_s.append(t1 - t0)
    decide_s.append(t2 - t1)
    cpu_s.append(cpu2 - cpu0)
  gc.unfreeze()
  q = lambda seconds, p: float(np.percentile(np.asarray(seconds) * 1e3, p))
  total = np.asarray(keys_s) + np.asarray(decide_s)
  blocks = [len(r.prompt_ids) // bs for r in requests[:c.routing_requests]]
  return {'routing_p50_ms': q(total, 50), 'routing_p99_ms': q(total, 99),
          'routing_max_ms': float(total.max()) * 1e3,
          'routing_keys_p50_ms': q(keys_s, 50), 'routing_keys_p99_ms': q(keys_s, 99),
          'routing_decide_p50_ms': q(decide_s, 50), 'routing_decide_p99_ms': q(decide_s, 99),
          'routing_cpu_p50_ms': q(cpu_s, 50), 'routing_cpu_p99_ms': q(cpu_s, 99),
          'routing_blocks_mean': float(np.mean(blocks)), 'routing_blocks_max': int(max(blocks)),
          'routing_replicas': c.routing_replicas}


def ordering(stages: list) -> list:
  """Per stage: the routers of ORDER by p90 TTFT, and whether precise < approximate < the
  better of load-aware and random."""
  out = []
  for rate in sorted({s['rate'] for s in stages}):
    p90 = {s['router']: s['ttft_p90_s'] for s in stages if s['rate'] == rate}
    if not all(p90.get(name) is not None for name in ORDER):
      continue
    holds = p90['precise'] < p90['approximate'] < min(p90['load_aware'], p90['random'])
    out.append({'rate': rate, 'by_p90_ttft': sorted(ORDER, key=p90.get),
                'p90_ttft_s': {k: p90[k] for k in ORDER}, 'holds': holds})
  return out


TIER_COLUMNS = ('router', 'hit_rate_tier1_tokens', 'hit_rate_tier2_tokens', 'hit_rate_tiered_tokens',
                'cached_at_routing_fraction', 'host_at_routing_fraction', 'tiers_promoted_blocks',
                'tiers_declined_blocks', 'tiers_tier2_demoted_blocks', 'tiers_tier2_evictions',
                'prompt_tokens_computed')


def tier_cost_vs_precise(stages: list) -> list:
  """Per stage: tier_cost's p90 TTFT over precise's (< 1: tier_cost is better), when both ran."""
  out = []
  for rate in sorted({s['rate'] for s in stages}):
    p90 = {s['router']: s['ttft_p90_s'] for s in stages if s['rate'] == rate}
    if p90.get('precise') and p90.get('tier_cost') is not None:
      out.append({'rate': rate, 'precise_p90_s': p90['precise'],
                  'tier_cost_p90_s': p90['tier_cost'],
                  'ratio': p90['tier_cost'] / p90['precise']})
  return out


def setting(config) -> str:
  shape, hw = model_shape(config), hardware.get_hardware(config.sim.hardware)
  tokens = (config.pool.num_blocks - 1) * config.pool.block_size
  host = config.tiers.host_blocks * config.pool.block_size
  return (f'{config.cluster.replicas} x {shape.name} on {config.mesh.model} x {hw.name}, '
          f'{tokens:,} KV tokens each' + (f' + {host:,} in host RAM' if host else '') +
          f', {config.workload.get("tenants", "-")} tenants (simulated)')


def plot(stages: list, config, workdir: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  for label in dict.fromkeys(s['router'] for s in stages):
    mine = [s for s in stages if s['router'] == label]
    rates = [s['rate'] for s in mine]
    for ax, key in zip(axes, ('ttft_p90_s', 'cached_at_routing_fraction',
                              'generated_tokens_per_s')):
      ax.plot(rates, [s.get(key) for s in mine], 'o-', label=label)
  for ax, title in zip(axes, ('TTFT p90 (s, simulated)', 'prompt share cached on the chosen '
                              'replica', 'throughput (generated tokens/s, simulated)')):
    ax.set_xlabel('arrival rate (requests/s)')
    ax.set_title(title)
    ax.legend(fontsize=8)
  axes[0].set_yscale('log')
  fig.suptitle(f'Routing: {setting(config)}')
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'cluster.png'), dpi=100)
  plt.close(fig)


def prefill_compute_s(cluster: SimulatedCluster, cost: tier_cost.TierCosts) -> float:
  """Prefill compute by the cost model: the prompt tokens computed (with the store's tokens
  loaded, not computed) at prefill s/token, plus each request's load from the store."""
  computed = cluster.figures()['prompt_tokens_computed_with_store']
  loads = sum(cost.load_s([3] * -(-o.shared_at_routing // cost.block_size))
              for o in cluster.outcomes if o.shared_at_routing)
  return computed * cost.prefill_s_per_token + loads


def mooncake_rows(config, requests) -> list:
  """One row per router with local caches, then per cluster.store_routers row with the store."""
  c = config.cluster
  runs = [(row, False) for row in c.routers]
  runs += [(row, True) for label in c.store_routers for row in c.routers if row[0] == label]
  rows = []
  for row, shared in runs:
    overall, _, _, cluster = run_router(config, row, requests, shared_store=shared)
    cost = cluster.replicas[0].state.cost
    if not shared:  # a local run's figures still cost the store's loads as 0 (it has none)
      cost = store_costs(config, cost) if c.get('store_routers') else cost
    overall.update(cache='shared' if shared else 'local',
                   prefill_compute_s=prefill_compute_s(cluster, cost),
                   **routing_cost(config, row, requests, shared))
    rows.append(overall)
    print(f"{row[0]:>12} ({overall['cache']:>6}): hit rate "
          f"{_figure(overall['hit_rate_with_store_tokens'])}, prefill compute "
          f"{overall['prefill_compute_s']:.0f} s, routing p99 {overall['routing_p99_ms']:.3f} ms "
          f"at {overall['routing_replicas']} replicas; simulated in "
          f"{overall['simulator_wall_s']:.0f} s", flush=True)
    del cluster
  return rows


def compare_caches(rows: list) -> dict:
  """Shared / local hit rate and prefill compute: per router run both ways, and against the
  best local row (Mooncake's comparison: its local caches with prefix-match scheduling)."""
  local = {r['router']: r for r in rows if r['cache'] == 'local'}
  best = max(local.values(), key=lambda r: r['hit_rate_with_store_tokens'])
  out = {'best_local_router': best['router'],
         'best_local_hit_rate': best['hit_rate_with_store_tokens'], 'paper_ratio': PAPER_RATIO,
         'shared': []}
  ratio = lambda a, b: a / b if b else None
  for r in rows:
    if r['cache'] != 'shared':
      continue
    same = local.get(r['router'])
    out['shared'].append({
        'router': r['router'], 'hit_rate': r['hit_rate_with_store_tokens'],
        'hit_ratio_vs_same_router_local': ratio(r['hit_rate_with_store_tokens'],
                                                same['hit_rate_with_store_tokens']),
        'hit_ratio_vs_best_local': ratio(r['hit_rate_with_store_tokens'],
                                         best['hit_rate_with_store_tokens']),
        'prefill_compute_vs_same_router_local': ratio(r['prefill_compute_s'],
                                                      same['prefill_compute_s']),
        'prefill_compute_vs_best_local': ratio(r['prefill_compute_s'],
                                               best['prefill_compute_s'])})
  return out


def plot_mooncake(rows: list, config, workdir: str, title: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
  names = [f"{r['router']}\n({r['cache']})" for r in rows]
  colors = ['tab:orange' if r['cache'] == 'shared' else 'tab:blue' for r in rows]
  for ax, key, label in ((axes[0], 'hit_rate_with_store_tokens', 'prompt share found cached'),
                         (axes[1], 'prefill_compute_s', 'prefill compute (s, cost model)')):
    ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
    ax.set_xticks(range(len(rows)), names, fontsize=7)
    ax.set_title(label)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'mooncake.png'), dpi=100)
  plt.close(fig)


def mooncake_study(config, workdir: str) -> dict:
  load_before = os.getloadavg()
  requests, dropped = mooncake_trace(config)
  c, w = config.cluster, config.workload
  bs = config.pool.block_size
  tokens = (config.pool.num_blocks - 1) * bs
  own = ((c.store_replica_blocks or config.pool.num_blocks) - 1) * bs
  title = (f'{c.replicas} x {model_shape(config).name} on {config.mesh.model} x '
           f'{hardware.get_hardware(config.sim.hardware).name}, {tokens:,} cache tokens each, '
           f'or a shared store of {c.shared_store_blocks * bs:,} over replicas of {own:,}; '
           f'{len(requests)} requests of {os.path.basename(w.path)} at length scale '
           f'{w.length_scale:g}, {w.output_tokens} output token (simulated)'
           f'{cli.variant_note(config)}')
  print(f'{title} ({dropped} left out as longer than max_seq_len)', flush=True)
  rows = mooncake_rows(config, requests)
  comparison = compare_caches(rows)
  run_info.write_csv(os.path.join(workdir, 'routers.csv'), rows, MOONCAKE_COLUMNS)
  lines = [f"- {s['router']} with the shared store: hit rate {s['hit_rate']:.3f}, "
           f"{s['hit_ratio_vs_same_router_local']:.2f}x its local run's and "
           f"{s['hit_ratio_vs_best_local']:.2f}x the best local router's "
           f"({comparison['best_local_router']}, {comparison['best_local_hit_rate']:.3f}); "
           f"prefill compute {s['prefill_compute_vs_best_local']:.2f}x the best local's"
           for s in comparison['shared']]
  table = (f'{title}\n\n{run_info.markdown_table(rows, MOONCAKE_COLUMNS)}\n\n'
           + '\n'.join(lines) + f'\n\n(Mooncake FAST\'25: {PAPER_RATIO[0]}-{PAPER_RATIO[1]}x)\n')
  cli.write_table(workdir, table)
  plot_mooncake(rows, config, workdir, title)
  worst = max(r['routing_p99_ms'] for r in rows)
  summary = {
      'setting': title, 'simulated': True, 'requests': len(requests),
      'left_out_too_long': dropped, 'comparison': comparison, 'routers': rows,
      'routing_cost': {'goal_ms': c.route_goal_ms, 'worst_p99_ms': worst,
                       'met': worst <= c.route_goal_ms, 'replicas': c.routing_replicas,
                       'note': 'wall time on this machine, under its load'},
      'timing_note': ('TTFT is simulated with local-cache timing in every row (a simulated '
                      'pool holds no contents to load); prefill_compute_s is the cost model\'s'),
      'load_average': {'start': load_before, 'end': os.getloadavg()},
      **run_info.summary_fields(config)}
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  return summary


ROUTING_COLUMNS = ('router', 'cache', 'routing_replicas', 'routing_blocks_mean',
                   'routing_blocks_max', 'routing_p50_ms', 'routing_p99_ms', 'routing_max_ms',
                   'routing_keys_p50_ms', 'routing_keys_p99_ms', 'routing_decide_p50_ms',
                   'routing_decide_p99_ms', 'routing_cpu_p50_ms', 'routing_cpu_p99_ms')


def routing_study(config, workdir: str) -> dict:
  """cluster.routing_only: the routing cost alone (routing_cost) for every router row, and
  for the cluster.store_routers rows again with the shared store; no simulation. Writes
  routing.csv and summary.json."""
  load_before = os.getloadavg()
  requests = make_trace(config)
  c = config.cluster
  runs = [(row, False) for row in c.routers]
  runs += [(row, True) for label in c.get('store_routers', ()) for row in c.routers
           if row[0] == label]
  rows = []
  for row, shared in runs:
    rows.append({'router': row[0], 'cache': 'shared' if shared else 'local',
                 **routing_cost(config, row, requests, shared)})
    r = rows[-1]
    print(f"{row[0]:>12} ({r['cache']:>6}): p50 / p99 {r['routing_p50_ms']:.3f} / "
          f"{r['routing_p99_ms']:.3f} ms wall (keys {r['routing_keys_p99_ms']:.3f}, decision "
          f"{r['routing_decide_p99_ms']:.3f} at p99), {r['routing_cpu_p50_ms']:.3f} / "
          f"{r['routing_cpu_p99_ms']:.3f} ms thread CPU", flush=True)
  run_info.write_csv(os.path.join(workdir, 'routing.csv'), rows, ROUTING_COLUMNS)
  worst = lambda name: max(r[name] for r in rows)
  summary = {
      'setting': f'{c.routing_replicas} replicas, {len(requests)} requests in the trace, the '
                 f'first {c.routing_requests} routed', 'routers': rows,
      'routing_cost': {'goal_ms': c.route_goal_ms, 'worst_p99_ms': worst('routing_p99_ms'),
                       'worst_cpu_p99_ms': worst('routing_cpu_p99_ms'),
                       'worst_decide_p99_ms': worst('routing_decide_p99_ms'),
                       'met': worst('routing_p99_ms') <= c.route_goal_ms,
                       'met_in_cpu_time': worst('routing_cpu_p99_ms') <= c.route_goal_ms,
                       'note': 'wall and thread CPU time on this machine, under its load'},
      'load_average': {'start': load_before, 'end': os.getloadavg()},
      **run_info.summary_fields(config)}
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  return summary


def study(config, workdir: str) -> dict:
  if config.cluster.get('routing_only', False):
    return routing_study(config, workdir)
  if config.workload.get('kind', 'tenants') == 'mooncake':
    return mooncake_study(config, workdir)
  load_before = os.getloadavg()
  requests = make_trace(config)
  print(f'{setting(config)}: {len(requests)} requests over {len(config.workload.rates)} '
        'stages', flush=True)
  overall, stages, replicas = [], [], []
  c = config.cluster
  runs = [(row, False) for row in c.routers]
  runs += [(row, True) for label in c.get('device_only_routers', ()) for row in c.routers
           if row[0] == label]
  for row, device_only_row in runs:
    o, s, r, cluster = run_router(config, row, requests, device_only_row=device_only_row)
    o.update(routing_cost(config, row, requests))
    overall.append(o)
    stages += s
    replicas += r
    print(f"{o['router']:>12}: TTFT p90 {_figure(o['ttft_p90_s'])} s, hit rate "
          f"{_figure(o['prefix_hit_rate_tokens'])} device, "
          f"{_figure(o['hit_rate_tier2_tokens'])} host, "
          f"routing p99 {o['routing_p99_ms']:.3f} ms at "
          f"{o['routing_replicas']} replicas; simulated in {o['simulator_wall_s']:.0f} s",
          flush=True)
    del cluster
  run_info.write_csv(os.path.join(workdir, 'stages.csv'), stages, STAGE_COLUMNS)
  run_info.write_csv(os.path.join(workdir, 'routers.csv'), overall, ROUTER_COLUMNS)
  run_info.write_csv(os.path.join(workdir, 'replicas.csv'), replicas, REPLICA_COLUMNS)
  order = ordering(stages)
  p90_rows = [{'router': o['router'], **{f"{s['rate']:g}/s": s['ttft_p90_s'] for s in stages
                                          if s['router'] == o['router']}} for o in overall]
  table = (f'{setting(config)}\n\nTTFT p90 (simulated s) per router and stage rate\n\n'
           f'{run_info.markdown_table(p90_rows, list(p90_rows[0]))}\n\nRouters, whole trace\n\n'
           f'{run_info.markdown_table(overall, ROUTER_COLUMNS)}\n')
  if config.tiers.host_blocks:
    table += (f'\nTier hit mix (share of prompt tokens queried)\n\n'
              f'{run_info.markdown_table(overall, TIER_COLUMNS)}\n')
  cli.write_table(workdir, table)
  worst = max(o['routing_p99_ms'] for o in overall)
  summary = {
      'setting': setting(config), 'simulated': True, 'requests': len(requests),
      'ordering': order, 'ordering_holds_at_top_rate': order[-1]['holds'] if order else None,
      'tier_cost_vs_precise': tier_cost_vs_precise(stages),
      'routing_cost': {'goal_ms': config.cluster.route_goal_ms, 'worst_p99_ms': worst,
                       'met': worst <= config.cluster.route_goal_ms,
                       'replicas': config.cluster.routing_replicas,
                       'note': 'wall time on this machine, under its load'},
      'routers': overall, 'stages': stages, 'replicas': replicas,
      'load_average': {'start': load_before, 'end': os.getloadavg()},
      'config': config.to_dict(), **run_info.environment()}
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  plot(stages, config, workdir)
  for o in order:
    print(f"{o['rate']:g} req/s: {' < '.join(o['by_p90_ttft'])} "
          f"(precise < approximate < load-aware ~ random: {o['holds']})")
  met = 'met' if summary['routing_cost']['met'] else 'not met'
  print(f'routing p99 at {config.cluster.routing_replicas} replicas: worst {worst:.3f} ms '
        f'(goal {config.cluster.route_goal_ms} ms: {met}; wall time under this machine\'s load)')
  return summary


if __name__ == '__main__':
  cli.run_study('configs/cluster.py', 'Cluster routing study config.', study, check=check)
