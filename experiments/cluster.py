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

Writes to WORKDIR:
  stages.csv        per router and stage: the figures above
  routers.csv       per router, over the whole trace (and the routing cost)
  replicas.csv      per router and replica
  table.md          the p90-TTFT table (router x stage) and the routers table
  cluster.png       p90 TTFT, held-at-routing fraction and throughput against the rate
  summary.json      everything above, the ordering per stage and whether it holds, the setting,
                    the load average, config, versions, git state
Every figure but the routing cost is simulated seconds, and says so.
"""
import dataclasses
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
from pagedjax.sim import hardware, simulated_device

STAGE_COLUMNS = ('router', 'rate', 'finished_requests', 'ttft_p50_s', 'ttft_p90_s',
                 'ttft_p99_s', 'tpot_p50_s', 'tpot_p90_s', 'tpot_p99_s', 'requests_per_s',
                 'generated_tokens_per_s', 'cached_at_routing_fraction')
ROUTER_COLUMNS = ('router', 'finished_requests', 'prefix_hit_rate_tokens', 'hit_rate_tier1_tokens',
                  'hit_rate_tier2_tokens', 'hit_rate_tier3_tokens', 'prompt_tokens_computed',
                  'ttft_p50_s', 'ttft_p90_s', 'ttft_p99_s', 'tpot_p50_s', 'tpot_p90_s',
                  'tpot_p99_s', 'generated_tokens_per_s', 'imbalance_requests',
                  'imbalance_prefill', 'route_p50_ms', 'route_p99_ms', 'routing_p50_ms',
                  'routing_p99_ms', 'routing_max_ms', 'simulator_wall_s')
REPLICA_COLUMNS = ('router', 'replica', 'requests', 'prefix_hit_rate_tokens',
                   'prompt_tokens_computed', 'prefix_cache_evictions', 'preemptions',
                   'ttft_p50_s', 'ttft_p90_s', 'ttft_p99_s')
ORDER = ('precise', 'approximate', 'load_aware', 'random')  # the ordering the study checks


def model_shape(config) -> sizing.ModelShape:
  return sizing.ModelShape(**config.sim.shape.to_dict())


def check(config) -> None:
  """Config errors named before anything runs."""
  w, c = config.workload, config.cluster

  def fail(name, value, allowed):
    raise ConfigError(f'config.{name}={value!r} is not allowed: {allowed}')
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
  for name in ('replicas', 'routing_replicas', 'routing_copies', 'routing_requests'):
    if not isinstance(c[name], int) or c[name] < 1:
      fail(f'cluster.{name}', c[name], 'an integer >= 1')
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
  if not config.prefix_cache.enabled:
    fail('prefix_cache.enabled', False, 'True (a replica reuses cached prefixes)')
  model_shape(config)  # the shape's own checks (ValueError naming the field)
  hardware.get_hardware(config.sim.hardware)


def make_trace(config) -> list:
  """The stages' Poisson arrivals; a request is a random tenant's prefix + a random user's
  fresh question (token ids below workload.token_range)."""
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


def make_engines(config, n: int) -> tuple:
  """n simulated replicas and each one's tier cost model (host/tiers/tier_cost.py)."""
  typed = Config.from_configdict(config)
  shape, hw, sim = model_shape(config), hardware.get_hardware(config.sim.hardware), config.sim
  engines, costs = [], []
  for _ in range(n):
    engine = simulated_device.simulated_engine(
        shape, hw, typed, weight_dtype=sim.weight_dtype, activation_dtype=sim.activation_dtype,
        count_padding=sim.count_padding)
    engines.append(engine)
    costs.append(engine.executor.backend.preemption_cost(typed.tiers, engine.executor))
  return engines, costs


def run_router(config, row, requests) -> tuple:
  label, name, kwargs = row
  engines, costs = make_engines(config, config.cluster.replicas)
  cluster = SimulatedCluster(engines, routers_lib.make_router(name, **dict(kwargs)), costs)
  cluster.run(requests)
  overall = {**cluster.figures(), 'router': label, 'router_class': name}
  stages = []
  for rate in config.workload.rates:
    mine = [o for o in cluster.outcomes if o.label == float(rate)]
    stages.append({'router': label, 'rate': float(rate), **latency_figures(mine)})
  replicas = [{'router': label, **r} for r in cluster.replica_figures()]
  return overall, stages, replicas, cluster


def routing_cost(config, row, requests) -> dict:
  """Per-request decision time over routing_replicas replicas whose index holds each tenant's
  prefix blocks (as KV events would have announced them) on routing_copies replicas."""
  c, bs = config.cluster, config.pool.block_size
  label, name, kwargs = row
  router = routers_lib.make_router(name, **dict(kwargs))
  index = KVIndex()
  if getattr(router, 'index', False) is None:
    router.index = index
  rng = np.random.default_rng(1)
  prefixes = {}
  for r in requests:
    prefixes.setdefault(r.tenant, r.prompt_ids[:config.workload.prefix_tokens])
  for tenant, prefix in prefixes.items():
    keys = routers_lib.RouteRequest(-1, prefix).keys(bs)
    for replica in rng.choice(c.routing_replicas, c.routing_copies, replace=False):
      index.apply(int(replica), [kv_events.BlockStored((k,), None, (), bs, None, 'GPU')
                                 for k in keys])
  states = [routers_lib.ReplicaState(i, capacity_blocks=config.pool.num_blocks - 1,
                                     block_size=bs, num_waiting=int(rng.integers(0, 8)),
                                     num_running=int(rng.integers(0, 32)),
                                     queued_prefill_tokens=int(rng.integers(0, 20000)),
                                     running_tokens=int(rng.integers(0, 200000)),
                                     kv_usage=float(rng.random()))
            for i in range(c.routing_replicas)]
  times = []
  for r in requests[:c.routing_requests]:
    route = routers_lib.RouteRequest(r.request_id, r.prompt_ids, r.salt, r.max_new_tokens)
    t0 = time.perf_counter()
    pick = router.route(route, states)
    router.routed(route, pick)
    times.append(time.perf_counter() - t0)
  ms = np.asarray(times) * 1e3
  return {'routing_p50_ms': float(np.percentile(ms, 50)),
          'routing_p99_ms': float(np.percentile(ms, 99)), 'routing_max_ms': float(ms.max()),
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


def setting(config) -> str:
  shape, hw = model_shape(config), hardware.get_hardware(config.sim.hardware)
  tokens = (config.pool.num_blocks - 1) * config.pool.block_size
  return (f'{config.cluster.replicas} x {shape.name} on {config.mesh.model} x {hw.name}, '
          f'{tokens:,} KV tokens each (simulated)')


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


def study(config, workdir: str) -> dict:
  load_before = os.getloadavg()
  requests = make_trace(config)
  print(f'{setting(config)}: {len(requests)} requests over {len(config.workload.rates)} '
        'stages', flush=True)
  overall, stages, replicas = [], [], []
  for row in config.cluster.routers:
    o, s, r, cluster = run_router(config, row, requests)
    o.update(routing_cost(config, row, requests))
    overall.append(o)
    stages += s
    replicas += r
    print(f"{row[0]:>12}: TTFT p90 {o['ttft_p90_s']:.3f} s, hit rate "
          f"{o['prefix_hit_rate_tokens']:.3f}, routing p99 {o['routing_p99_ms']:.3f} ms at "
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
  cli.write_table(workdir, table)
  worst = max(o['routing_p99_ms'] for o in overall)
  summary = {
      'setting': setting(config), 'simulated': True, 'requests': len(requests),
      'ordering': order, 'ordering_holds_at_top_rate': order[-1]['holds'] if order else None,
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
