"""Thrashing: pool size against arrival rate until preemption dominates, then the mitigations.

  python -m experiments.thrashing --workdir=runs/thrashing
  python -m experiments.thrashing --config=configs/thrashing.py:tiny --workdir=/tmp/thrashing
  python -m experiments.thrashing --config=configs/thrashing.py:sim --workdir=runs/thrashing_sim

A tiny random Llama (byte vocabulary: prompts are UTF-8 bytes of KJV text) replays one
ShareGPT-like trace open-loop (pagedjax.studies.workloads.synthetic_trace: ShareGPT's lognormal length
laws with their means scaled by `workload.length_scale` to fit a CPU, Poisson arrivals, EOS
ignored so every request generates its trace length, greedy).

Part A (`thrashing.pool_blocks` x `thrashing.rates`): the unmitigated engine (victim newest,
recompute preemption, watermark admission). Goodput peaks at some rate for the pool
`thrashing.chosen_pool` (usable blocks); Part B replays the trace at `overload` x that rate
through every row of `thrashing.rows`, each a set of dotted overrides of this config:
  unmitigated            as Part A
  victim=least_progress  preempt the sequence with the fewest cached tokens
  victim=priority        preempt the least important (priority classes: see `priority_classes`)
  victim=cost            preempt the cheapest by the cost model (with swap allowed: preemption
                         auto, so a victim goes whichever way is cheaper)
  projected_hN           admission 'projected' with admission_horizon N tokens (0: to each
                         request's max_new_tokens, which this trace makes exact)
  write_through          prefix cache with a host-RAM tier written through as blocks fill: a
                         recompute-preempted sequence finds its blocks there on readmission
  swap, auto             preemption by swap to host RAM, or the cheaper of the two per victim
  projected_hN+swap, projected_hN+write_through
                         combinations: projected admission (the last horizon) leaves few
                         preemptions, and swap or write-through keeps what they would lose
The cost model's figures are measured once per run (the first Part B engine) and fixed in
config.tiers for every row, so rows differ only in policy. Every figure is the median of
`repeats` runs (run round-robin over the rows, so every row sees the same stretch of machine
load). `:tiny` is a smoke-size run of the same pipeline (one pool, two rates, five rows, 10 requests); its
figures are not the study's.
"""
import ml_collections

from configs import default
from configs import simulate_vllm

BLOCK_SIZE = 16
MAX_SEQ_LEN = 512
HOST_BLOCKS = 1024  # the write-through tier: room for every block of the trace's running set


def mitigation_rows(horizons):
  """(name, dotted overrides) of Part B, unmitigated first."""
  write_through = {'prefix_cache.enabled': True, 'tiers.host_blocks': HOST_BLOCKS,
                   'tiers.write_through': True, 'tiers.promotion': 'load'}
  rows = [('unmitigated', {}),
          ('victim=least_progress', {'scheduler.victim': 'least_progress'}),
          ('victim=priority', {'scheduler.victim': 'priority'}),
          ('victim=cost', {'scheduler.victim': 'cost', 'scheduler.preemption': 'auto'})]
  rows += [(f'projected_h{h}', {'scheduler.admission': 'projected',
                                'scheduler.admission_horizon': h}) for h in horizons]
  swap = {'scheduler.preemption': 'swap'}
  rows += [('write_through', write_through), ('swap', swap),
           ('auto', {'scheduler.preemption': 'auto'})]
  # Combinations: the last horizon's projected admission (few preemptions) with a way of
  # keeping what those few preemptions would throw away.
  projected = {'scheduler.admission': 'projected', 'scheduler.admission_horizon': horizons[-1]}
  rows += [(f'projected_h{horizons[-1]}+swap', {**projected, **swap}),
           (f'projected_h{horizons[-1]}+write_through', {**projected, **write_through})]
  return [[name, overrides] for name, overrides in rows]


def get_config(arg=None):
  config = default.get_config('tiny')
  config.model.random.vocab_size = 256  # prompts are UTF-8 bytes
  config.model.random.max_seq_len = MAX_SEQ_LEN
  config.attention.impl = 'auto'
  config.engine.max_seq_len = MAX_SEQ_LEN
  config.engine.max_batch_size = 16
  config.engine.prefill_chunk = 32
  config.pool.block_size = BLOCK_SIZE
  config.scheduler.max_num_batched_tokens = 128
  config.workload = ml_collections.ConfigDict(dict(
      dataset='sharegpt', length_scale=0.25,  # means 40 in / 84 out tokens
      num_requests=200, seed=0, max_input_len=256, max_output_len=256))
  config.thrashing = ml_collections.ConfigDict(dict(
      pool_blocks=(32, 64, 128),  # usable blocks (the pool has one more: the null block)
      rates=(25.0, 50.0, 100.0, 200.0, 400.0),  # requests/s, Poisson
      # The Part A pool whose goodput peak sets Part B's rate: 64 blocks (1024 token slots, ~8
      # requests of the trace's mean length) preempts little at low rates and thrashes once
      # the queue keeps all 16 batch rows admitted; 32 thrashes at every rate.
      chosen_pool=64,
      overload=2.0,  # Part B's rate: this many times the peak's
      rows=mitigation_rows([0, 64]),
      # victim=priority: the trace's requests in this many classes by total length (prompt +
      # max_new_tokens), the longest least important (priority = class index).
      priority_classes=3,
      repeats=3,  # runs per point; each figure is their median
      clock='cpu',  # the engine clock: cpu (this process's CPU seconds) | wall
      goal_goodput_ratio=0.9, goal_recomputed_fraction=0.05))  # the goal at overload
  if arg == 'tiny':
    config.model.random.update(dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                    head_dim=16, ffn_dim=64, max_seq_len=128))
    # Few compiled shapes (each costs seconds here): one pool, two batch rows.
    config.engine.update(dict(max_seq_len=128, max_batch_size=2, prefill_chunk=16))
    config.scheduler.max_num_batched_tokens = 32
    config.workload.update(dict(num_requests=10, length_scale=0.1, max_input_len=48,
                             max_output_len=48))
    config.thrashing.update(dict(pool_blocks=(8,), rates=(50.0, 200.0), chosen_pool=8,
                                 rows=[r for r in mitigation_rows([16]) if r[0] in (
                                     'unmitigated', 'victim=least_progress', 'projected_h16',
                                     'write_through', 'swap')],
                                 repeats=1))
  elif arg == 'sim':
    # The same study at accelerator scale on the simulated device (pagedjax/sim; its clock is
    # the cost model's, so one run per point): Llama-3-8B on one H100 SXM (preset figures,
    # efficiencies assumed), full ShareGPT lengths, pools far smaller than the device's memory
    # (what is left after the weights of a bigger model, or a longer context, would be) so
    # that preemption dominates. No write-through rows: a simulated pool holds no contents.
    config.sim = simulate_vllm.simulation('llama3-8b', 'h100-sxm')
    config.engine.update(dict(max_seq_len=2048, max_batch_size=256, prefill_chunk=128))
    config.scheduler.max_num_batched_tokens = 2048
    config.workload.update(dict(num_requests=1000, length_scale=1.0, max_input_len=1024,
                                max_output_len=1024))
    config.thrashing.update(dict(
        pool_blocks=(1024, 2048, 4096), rates=(4.0, 8.0, 16.0, 32.0, 64.0, 128.0),
        chosen_pool=2048, repeats=1,
        rows=[r for r in mitigation_rows([0, 256]) if 'write_through' not in r[0]]))
  elif arg:
    raise ValueError(f'configs/thrashing.py: unknown variant {arg!r}; allowed: tiny, sim')
  # Every run sets its own pool (thrashing.pool_blocks); this one is what validation sees.
  config.pool.num_blocks = config.thrashing.chosen_pool + 1
  config.variant = arg or 'full'
  return config
