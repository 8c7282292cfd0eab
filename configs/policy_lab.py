"""The prefix-cache policy lab on Mooncake's conversation trace (experiments/policy_lab.py): every
eviction policy's hit rate against cache capacity, with the offline optimum (Belady) as the bound
and LRU as the reference. A host-only replay: no model runs.

  python -m experiments.policy_lab --workdir=runs/policy_lab
  python -m experiments.policy_lab --config=configs/policy_lab.py:tiny --workdir=DIR

config.lab:
  trace         the block-hash trace (JSON lines; /work/shared/traces/README.md)
  start, limit  the requests replayed: start..start + limit - 1 (limit 0: to the end)
  capacities    device cache capacities in tokens (blocks of 512)
  gap_capacity  where the goal is judged: an online policy closes half of LRU's gap to the
                optimum there (Mooncake's prefill nodes hold 3M tokens each)
  design        the prefix cache design replayed: hash (chain over full blocks) or radix
  rows          experiments/policy_lab.ROWS names, or 'package.module:Class' eviction policies
  tune          row -> values of its parameter (policy_lab.TUNABLE), chosen on the first half
                (rows in policy_lab.FITTED also fit their return model on the first half)
  tiers         tier arrangements through the real tier code (host/tiers/kv_tiers.py):
                arrangements: name -> [host, disk] capacity as multiples of the device's (0: no
                such tier); capacities: device capacities in tokens ([]: no tier study); rows:
                the device cache's policies (online); eviction: the lower tiers' policy
  bound         what a release's classes are worth (studies/retention_model.py): capacities
                (some of lab.capacities; []: none) and classings (retention_model.CLASSINGS);
                per pair, the fluid optimum and the real cache with its holds, in hindsight
`:tiny` is a seconds-long smoke run of the same pipeline on the first 300 requests; `:bound`
runs the bound study alone (LRU and Belady for reference) at 1e6, 3e6 and 1e7 tokens.
"""
import ml_collections

from pagedjax.studies.retention_model import CLASSINGS

TRACE = '/work/shared/traces/mooncake_conversation.jsonl'
ROWS = ['lru', 'lfu', 'session_lru', 'session_lfu', 'leaves_first', 'gdsf', 's3fifo',
        'session_recency', 'hit_density', 'arc', 'lrfu', 'return_predictor', 'retention',
        'reuse_oracle', 'belady']  # also in ROWS, not run by default: 'reuse_distance' (docs/policy_lab.md)


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.variant = 'full'
  config.lab = ml_collections.ConfigDict(dict(
      trace=TRACE, start=0, limit=0,
      capacities=[1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8], gap_capacity=3e6, design='hash',
      rows=list(ROWS),
      tune={'session_recency': [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0],
            's3fifo': [0.05, 0.1, 0.2, 0.4],
            'gdsf': [0.0, 0.02, 0.1, 0.5],
            'hit_density': [2.0, 8.0, 32.0],
            'lrfu': [0.5, 1.0, 2.0],
            'return_predictor': [1.0, 2.0, 4.0]},
      tiers=ml_collections.ConfigDict(dict(
          arrangements={'device': [0, 0], 'device_host': [4, 0], 'device_host_disk': [4, 32]},
          capacities=[3e5, 1e6, 3e6], rows=['lru'], eviction='lru')),
      bound=ml_collections.ConfigDict(dict(capacities=[3e6], classings=list(CLASSINGS)))))
  if arg == 'tiny':
    config.variant = 'tiny'
    config.lab.update(dict(limit=300, capacities=[1e5, 3e5, 1e6], gap_capacity=3e5,
                           tune={'session_recency': [0.0, 1.0], 's3fifo': [0.1]}))
    config.lab.tiers.capacities = [1e5, 3e5]
    config.lab.bound.capacities = [3e5]
  elif arg == 'bound':
    config.variant = 'bound'
    config.lab.update(dict(capacities=[1e6, 3e6, 1e7], rows=['lru', 'belady']))
    config.lab.tune = {}
    config.lab.tiers.capacities = []
    config.lab.bound.capacities = [1e6, 3e6, 1e7]
  elif arg is not None:
    raise ValueError(f'configs/policy_lab.py:{arg}: unknown variant; use :tiny, :bound or '
                     'nothing')
  return config
