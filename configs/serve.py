"""pagedjax replicas on Ray Serve (live, on this machine), and the simulated cluster on the same
requests: which router finds the prompts cached, and what that does to TTFT.

  python -m experiments.serve --workdir=runs/serve
  python -m experiments.serve --config=configs/serve.py:tiny --workdir=/tmp/serve

Every router row starts a fresh deployment (`serve.replicas` EngineReplicas of the config's
model on 127.0.0.1, caches cold) and replays the same requests over HTTP (streamed, OpenAI
/v1/completions, greedy, ignore_eos), arrivals at their trace times with at most
`serve.concurrency` in flight. Router rows are (label, name, kwargs): name 'ray_pow2' and
'ray_prefix' are Ray's PowerOfTwoChoicesRequestRouter and PrefixCacheAffinityRouter (kwargs to
their initialize_state), any other a pagedjax router (pagedjax/cluster/routers.py).

Workloads (`workload.kind`):
  shared_prefix  `tenants` random prefixes of `prefix_tokens`, each request one of them and a
                 fresh `question_tokens`, Poisson arrivals at `rate`/s (llm-d's benchmark shape)
  mooncake       requests `start`.. of /work/shared/traces/mooncake_conversation.jsonl
                 (pagedjax.studies.workloads.block_trace_requests: block ids -> deterministic tokens,
                 blocks and outputs shrunk by `length_scale`, arrival gaps by `time_scale`);
                 requests longer than engine.max_seq_len are left out (counted). A slice of
                 consecutive requests reuses little: in any 60 of them only block 0 repeats
                 (5% of prompt tokens); a conversation's turns are minutes apart.

Default: SmolLM2-135M (the shipped GGUF), 3 replicas of 1,008 KV tokens, 240 requests of 8
tenants (a request's cached prefix is then 0.37 points of the hit rate: 60 requests made one
request 1.5 points, coarser than a 1-point comparison). `:slice` is the same on the random
tiny model (what docs/cluster.md reports; earlier runs there set
`--config.workload.requests=60`);
`:tiny` a test-sized smoke run (2 replicas, 12 requests, three routers). The simulated replay
runs on this machine's cost model, calibrated first for the config's model (serve.sim_hardware;
`--config.serve.sim_hardware=WORKDIR/hardware_profile.json` reuses an earlier calibration).
"""
import ml_collections

from pagedjax.config import Config

MOONCAKE = '/work/shared/traces/mooncake_conversation.jsonl'


def router_rows():
  """(label, name, kwargs); a tuple, so --config.serve.routers="(...)" overrides it."""
  return (('ray_pow2', 'ray_pow2', {}),
          ('ray_prefix', 'ray_prefix', {}),
          ('round_robin', 'round_robin', {}),
          ('load_aware', 'least_loaded', {'metric': 'tokens'}),
          ('approximate', 'approx_prefix', {'block_size': 16}),
          ('precise', 'precise', {}),
          ('tier_cost', 'tier_cost', {}))


def get_config(arg=None):
  config = Config().to_configdict()
  config.prefix_cache.enabled = True
  config.engine.max_seq_len = 1024
  # 63 usable blocks of 16 = 1,008 tokens of KV per replica: about three of the eight tenants'
  # prefixes, so where a tenant's requests go decides whether its prefix is still cached
  config.pool.num_blocks = 64
  config.serve = ml_collections.ConfigDict(dict(
      replicas=3, routers=router_rows(), concurrency=6, request_timeout_s=120.0,
      start_timeout_s=300.0, max_ongoing_requests=16,
      simulate=True,  # also replay the same requests on the simulated cluster (sim.py)
      # its device: 'calibrate' fits this machine's cost model for the replicas' model and
      # engine config first (WORKDIR/hardware_profile.json); or a profile .json a calibration
      # wrote, or a preset name ('h100-sxm': the tiny model would take milliseconds there)
      sim_hardware='calibrate',
      # the calibration (pagedjax/sim/calibrate.py): timing rounds over the step grid, batch
      # fills profiled, rounds and buffer size (MB) of the peak measurements
      calibration=ml_collections.ConfigDict(dict(rounds=3, fills=(0.25, 0.5, 1.0),
                                                 peak_rounds=3, copy_mb=64)),
      sim_time_scale=1.0,  # the simulated replay's arrival times, multiplied by this
      # the simulated replicas share one machine, as the live ones share this one: this many
      # step at full speed at once (1: each step uses every core; 0: a machine each), so an
      # iteration that starts while k replicas are busy takes k / share times as long
      # (cluster/sim.py SimulatedCluster machine_share). sim_share_from picks each router
      # row's share (experiments/serve.py machine_share): 'steps', the share at which the
      # simulated replicas spend the iteration seconds the live ones measured during that
      # row's replay; 'cpu', what the live replicas had of this machine's CPU (cores - what
      # everything else used) / cores; 'fixed', sim_machine_share (also where a run did not
      # measure what its mode needs)
      sim_share_from='steps',
      sim_machine_share=1.0,
      # the replay again at shares within this fraction of the one sim_share_from gave: the
      # simulated hit rate's range over them (sim_hit_rate_lo / _hi, live_in_sim_band)
      sim_share_band=0.1,
      # an earlier run's workdir: only the simulated replay again, against the live figures
      # and the calibrated device written there (experiments/serve.py replay_study); '' : a run
      replay_from=''))
  config.workload = ml_collections.ConfigDict(dict(
      kind='shared_prefix', tenants=8, prefix_tokens=256, question_tokens=32, output_tokens=8,
      requests=240, rate=10.0, seed=0,
      path=MOONCAKE, start=0, length_scale=1 / 32, time_scale=0.2))  # (kind='mooncake')
  if arg == 'slice':
    config.model.source = 'random'
  elif arg == 'tiny':
    config.model.source = 'random'
    config.pool.num_blocks = 256
    config.serve.update(dict(replicas=2, concurrency=4, routers=(
        ('ray_pow2', 'ray_pow2', {}), ('ray_prefix', 'ray_prefix', {}),
        ('precise', 'precise', {}))))
    config.serve.calibration.update(dict(rounds=2, fills=(1.0,), peak_rounds=2, copy_mb=16))
    config.workload.update(dict(requests=12, tenants=3, prefix_tokens=64, question_tokens=16,
                                output_tokens=4, rate=8.0))
  elif arg:
    raise ValueError(f'configs/serve.py: unknown variant {arg!r}; allowed: slice, tiny')
  config.variant = arg or 'full'
  return config
