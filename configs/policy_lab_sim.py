"""Time and cost of the policy lab's eviction policies on one simulated prefill node
(experiments/policy_lab_sim.py): Llama-3-70B, tensor parallel over 8 x A100 80GB (Mooncake's
8 x A800 has the same memory and compute), a 3M-token host-RAM cache per node (Mooncake's), a
slice of the conversation trace with arrivals stretched 10x (one of ten prefill nodes' load).

  python -m experiments.policy_lab_sim --workdir=runs/policy_lab_sim
  python -m experiments.policy_lab_sim --config=configs/policy_lab_sim.py:tiny --workdir=DIR

config.sim_lab:
  trace, start, limit   the slice of requests served
  time_scale            arrivals stretched by it
  cache_tokens          the node's prefix cache (host RAM), tokens
  rows                  'no_cache' and online rows of experiments/policy_lab.ROWS
  params                tuned values (policy_lab.TUNABLE) per row: the lab's first-half choices
                        (a full lab run's summary.json 'tuned'); lab_summary: read them, and the
                        return model, from that file instead
  model, hardware, tp   the simulated node; max_seq_len, max_batch_size, prefill_chunk,
                        max_num_batched_tokens: its engine
`:tiny` serves 60 requests with three rows, for tests.
"""
import ml_collections

from configs import policy_lab

ROWS = ['no_cache', 'lru', 's3fifo', 'session_recency', 'hit_density', 'arc', 'lrfu',
        'return_predictor']


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.variant = 'full'
  config.sim_lab = ml_collections.ConfigDict(dict(
      trace=policy_lab.TRACE, start=0, limit=1000, time_scale=10.0, cache_tokens=3e6,
      rows=list(ROWS),
      params={'session_recency': 2.0, 's3fifo': 0.4, 'hit_density': 8.0, 'lrfu': 2.0,
              'return_predictor': 4.0},
      lab_summary='', model='llama3-70b', hardware='a100-80gb', tp=8, max_seq_len=131072,
      max_batch_size=64, prefill_chunk=2048, max_num_batched_tokens=8192))
  if arg == 'tiny':
    config.variant = 'tiny'
    config.sim_lab.update(dict(limit=60, rows=['no_cache', 'lru', 'session_recency']))
  elif arg is not None:
    raise ValueError(f'configs/policy_lab_sim.py:{arg}: unknown variant; use :tiny or nothing')
  return config
