"""The vLLM memory study at its own scale, simulated: OPT-13B on one A100 40GB, paged vs contiguous.

  python -m experiments.simulate --config=configs/simulate_vllm.py --workdir=runs/sim_vllm
  python -m experiments.simulate --config=configs/simulate_vllm.py:tiny --workdir=/tmp/sim_vllm

The engine's real host code (scheduler, allocator, block manager, preemption) on a simulated
A100 40GB (pagedjax/sim: NVIDIA's spec sheet, efficiency factors assumed, not calibrated). The
KV pool is what the device's memory holds after the fp16 weights (plan_pool: 90% of HBM, less
weights and an activation reserve), the same for both designs; `contiguous` reserves
engine.max_seq_len = 2048 slots per request at admission (the paper's "Orca (Max)"), `paged`
allocates blocks on demand. A ShareGPT-like trace (vLLM paper means: 161 in / 338 out tokens)
replays at each request rate; the study reports, per latency threshold, the highest rate each
design sustains with mean normalized latency (end-to-end seconds per output token) under it,
and the paged / contiguous ratio. `:tiny` is a smoke run of the same pipeline (under a second of
simulation): SmolLM2-135M's shape on the A100 40GB with a 65-block pool, 16 short requests, two
rates.
"""
import ml_collections

from pagedjax.config import Config

RATES = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0)
KINDS = ('contiguous', 'paged')


def simulation(model: str, hardware: str, weight_dtype: str = 'bf16') -> ml_collections.ConfigDict:
  """config.sim: which preset on which device. activation_dtype is also the KV dtype when
  pool.kv_dtype is 'auto'; bf16 stands in for fp16 (same bytes; the pool stores bfloat16)."""
  return ml_collections.ConfigDict(dict(
      model=model, hardware=hardware, weight_dtype=weight_dtype, activation_dtype='bf16',
      memory_fraction=0.9,  # vLLM's gpu_memory_utilization default
      num_kv_heads=0,  # 0: the preset's; else a GQA ablation's count
      num_blocks=0,  # 0: as many as fit the device (plan_pool)
      # Charge the padded rows and whole prompt chunks this engine computes (False: only real
      # tokens, as a server with ragged batches would; a projection, not this engine).
      count_padding=True))


def get_config(arg=None):
  config = Config().to_configdict()
  config.sim = simulation('opt-13b', 'a100-40gb', weight_dtype='fp16')
  config.engine.max_seq_len = 2048  # OPT's context; what a contiguous request reserves
  config.engine.max_batch_size = 256  # vLLM's max_num_seqs default
  # This engine pads a prompt-chunk call to whole chunks (executor.py); 128 keeps that padding
  # small next to ShareGPT's prompts while a 2048-token budget takes 16 chunks per iteration.
  config.engine.prefill_chunk = 128
  config.scheduler.max_num_batched_tokens = 2048
  config.pool.block_size = 16
  config.trace = ml_collections.ConfigDict(dict(
      dataset='sharegpt', num_requests=600, rate=1.0, seed=0, max_input_len=1024,
      max_output_len=1024, calibrate=True))
  config.sweep = [{'pool.kind': k, 'trace.rate': r} for k in KINDS for r in RATES]
  config.study = 'vllm'
  config.latency_thresholds = [0.1, 0.2, 0.5]  # seconds per output token
  config.title = 'vLLM memory study: OPT-13B on 1x A100 40GB, ShareGPT-like'
  config.plot = ml_collections.ConfigDict(dict(
      kind='line', x='trace_rate', group='pool.kind',
      y=['normalized_latency_s', 'generated_tokens_per_s', 'mean_concurrent_sequences']))
  config.table_columns = ['pool.kind', 'trace_rate', 'generated_tokens_per_s',
                          'normalized_latency_s', 'ttft_p50_s', 'tpot_p50_s',
                          'mean_concurrent_sequences', 'kv_utilization', 'preemptions',
                          'simulator_wall_s']
  if arg == 'tiny':
    config.sim = simulation('smollm2-135m', 'a100-40gb')
    config.sim.num_blocks = 4 * 256 // 16 + 1  # 4 contiguous reservations of 256 tokens
    config.engine.update(dict(max_seq_len=256, max_batch_size=16, prefill_chunk=32))
    config.scheduler.max_num_batched_tokens = 128
    config.trace.update(dict(num_requests=16, max_input_len=96, max_output_len=96,
                             calibrate=False))
    config.sweep = [{'pool.kind': k, 'trace.rate': r} for k in KINDS for r in (20.0, 80.0)]
    config.latency_thresholds = [0.01]
    config.title = ('vLLM memory study pipeline: SmolLM2-135M on 1x A100 40GB, 65-block pool, '
                    '16 short ShareGPT-like requests')
  elif arg:
    raise ValueError(f'configs/simulate_vllm.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
