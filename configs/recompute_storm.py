"""A recomputation storm: the shared system prompt changes version mid-run, on CPU with a tiny
random Llama (experiments/recompute_storm.py).

  python -m experiments.recompute_storm --workdir=runs/storm
  python -m experiments.recompute_storm --config=configs/recompute_storm.py:tiny --workdir=DIR

Rows (`storm.rows`), each a change to this config:
  none              prefix caching and the hit-rate alert, no mitigation
  prewarm           `storm.prewarm_lead_s` before the switch, one request of the new system
                    prompt alone (one output token) computes it, pinned (tiers.pinned_blocks)
  throttle          while the alert is active, at most `storm.throttle_prefill_tokens` prompt
                    tokens per iteration (alerts.throttle_prefill_tokens)
  prewarm_throttle  both
The trace (`storm`, pagedjax.studies.workloads.system_prompt_switch, byte tokens of KJV text): Poisson
arrivals at `rate`, system prompt v1 before `switch_time_s` and v2 from then on, ShareGPT-like
user messages. Windows of the TTFT figures, by arrival time: steady state
[steady_start_s, switch - prewarm_lead_s), across the switch [switch - prewarm_lead_s,
switch + after_switch_s) (the pre-warm's own cost falls in it).
`:tiny` is a smoke-size run of the same pipeline: a 1-layer random Llama, 16 requests, one run per
row; its figures are not the study's.
"""
import ml_collections

from configs import default

ROWS = ['none', 'prewarm', 'throttle', 'prewarm_throttle']


def get_config(arg=None):
  config = default.get_config('tiny')
  config.model.random.vocab_size = 256  # prompts are UTF-8 bytes (see reproduce_memory.py)
  config.model.random.max_seq_len = 2048
  config.attention.impl = 'auto'
  config.engine.max_seq_len = 2048
  config.engine.max_batch_size = 16
  config.engine.prefill_chunk = 32
  config.pool.block_size = 16
  # Room for every duplicate prefill of a storm: no eviction, no preemption, in any row.
  config.pool.num_blocks = 2048 + 1
  config.scheduler.max_num_batched_tokens = 128
  config.prefix_cache.enabled = True
  config.alerts.hit_rate_window = 32  # iterations
  config.alerts.hit_rate_drop = 0.3  # every row watches; the throttle rows also act
  config.storm = ml_collections.ConfigDict(dict(
      rows=list(ROWS), requests=200, rate=10.0, switch_time_s=15.0, system_tokens=1024,
      dataset='sharegpt', max_input_len=128, max_output_len=32, seed=0,
      prewarm_lead_s=1.0, throttle_prefill_tokens=64,
      steady_start_s=3.0, after_switch_s=2.0,
      goal_ttft_p99_ratio=1.5,  # with pre-warming, across the switch / steady state
      repeats=3))  # runs per row (figures: medians): one stall of a shared CPU moves a p99
  if arg == 'tiny':
    # A 1-layer model of width 32 and 16 requests: compiling its few step shapes is most of
    # the run (a few seconds).
    config.model.random.update(dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                    head_dim=16, ffn_dim=64, max_seq_len=256))
    config.engine.max_seq_len = 256
    config.engine.max_batch_size = 2  # prompt chunks of 1 or 2 rows: two shapes to compile
    config.engine.prefill_chunk = 32
    config.pool.num_blocks = 128 + 1
    config.scheduler.max_num_batched_tokens = 64
    config.alerts.hit_rate_window = 8
    config.storm.update(dict(requests=16, rate=4.0, switch_time_s=3.0, system_tokens=64,
                             max_input_len=32, max_output_len=8, prewarm_lead_s=0.5,
                             throttle_prefill_tokens=32, steady_start_s=0.5,
                             after_switch_s=2.0, repeats=1))
  elif arg:
    raise ValueError(f'configs/recompute_storm.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
