"""Scale: 10,000 ShareGPT-like requests to Llama-3-70B on 8 H100 SXM (tensor parallel), simulated.

  python -m experiments.simulate --config=configs/simulate_scale.py --workdir=runs/sim_scale
  python -m experiments.simulate --config=configs/simulate_scale.py:tiny --workdir=runs/sim_scale_tiny

The goal is the simulator's own speed: the real host code schedules every iteration of the
whole trace, and `simulator_wall_s` in the row is the wall time of engine.run() (the trace's
generation is outside it). The device is an H100 preset with assumed efficiencies; the pool
holds what each GPU's memory has left after its eighth of the bf16 weights. `:tiny` is the same
run at 100 requests.
"""
import ml_collections

from configs import simulate_vllm
from pagedjax.config import Config


def get_config(arg=None):
  config = Config().to_configdict()
  config.sim = simulate_vllm.simulation('llama3-70b', 'h100-sxm')
  config.mesh.model = 8
  config.engine.update(dict(max_seq_len=8192, max_batch_size=256, prefill_chunk=128))
  config.scheduler.max_num_batched_tokens = 2048
  config.pool.block_size = 16
  config.trace = ml_collections.ConfigDict(dict(
      dataset='sharegpt', num_requests=10_000, rate=20.0, seed=0, max_input_len=1024,
      max_output_len=1024, calibrate=True))
  config.sweep = [{}]
  config.study = 'scale'
  config.table_columns = ['trace_requests', 'iterations', 'generated_tokens',
                          'generated_tokens_per_s', 'ttft_p50_s', 'tpot_p50_s',
                          'mean_concurrent_sequences', 'kv_capacity_tokens', 'simulator_wall_s']
  if arg == 'tiny':
    config.trace.num_requests = 100
  elif arg:
    raise ValueError(f'configs/simulate_scale.py: unknown variant {arg!r}; allowed: tiny')
  config.title = (f'Scale: Llama-3-70B, TP=8 on H100 SXM, {config.trace.num_requests:,} '
                  'ShareGPT-like requests')
  config.variant = arg or 'full'
  return config
