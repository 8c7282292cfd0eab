"""GQA and KV-quantization ablations projected to Llama-3-8B on one H100 SXM, simulated.

  python -m experiments.simulate --config=configs/simulate_ablations.py --workdir=runs/sim_ablations

Llama-3-8B's shape with num_kv_heads 32 (MHA), 8 (its GQA) and 1 (MQA) in bfloat16, then its 8
KV heads stored as fp8_e4m3, int8 (float16 scale per token and head) and int4 (groups of 32,
float16 scale and zero point): the KV bytes per token each scheme really stores (pool_bytes,
scales included), how many requests fit next to the bf16 weights (at the trace's mean length
and at the 8K context), and simulated throughput of 2000 ShareGPT-like requests all at t=0 with
vLLM's batch cap of 256 sequences, and with a cap of 1024. The H100's efficiencies are assumed,
not calibrated, and the cost model reads a quantized pool at its stored size (dequantization
assumed free, as in kernels that fuse it), so absolute tokens/s are estimates; the ratios
between points are the result. Weights are not changed by the ablation except the k/v
projections' size; quality is another study (configs/ablate_kv_quant.py measures it on SmolLM2).

  python -m experiments.simulate --config=configs/simulate_ablations.py:tiny --workdir=runs/sim_abl_tiny

`:tiny` simulates two points (bf16 and int4 KV, 8 KV heads) on 50 requests.
"""
import ml_collections

from configs import simulate_vllm
from pagedjax.config import Config

HEADS = (32, 8, 1)
KV_DTYPES = ('fp8_e4m3', 'int8', 'int4')


def get_config(arg=None):
  config = Config().to_configdict()
  config.sim = simulate_vllm.simulation('llama3-8b', 'h100-sxm')
  config.engine.update(dict(max_seq_len=8192, max_batch_size=256, prefill_chunk=128))
  config.scheduler.max_num_batched_tokens = 2048
  config.pool.block_size = 16
  config.trace = ml_collections.ConfigDict(dict(
      dataset='sharegpt', num_requests=2000, rate=float('inf'), seed=0, max_input_len=1024,
      max_output_len=1024, calibrate=True))
  # At vLLM's cap of 256 sequences the cap, not memory, bounds the batch of every point but MHA;
  # the 1024 points let the memory each scheme frees become batch.
  config.sweep = [{'engine.max_batch_size': b, 'sim.num_kv_heads': n, 'pool.kv_dtype': d}
                  for b in (256, 1024)
                  for n, d in [(n, 'bfloat16') for n in HEADS] + [(8, d) for d in KV_DTYPES]]
  config.study = 'ablation'
  config.title = 'GQA and KV dtype ablations: Llama-3-8B on 1x H100 SXM, ShareGPT-like'
  config.plot = ml_collections.ConfigDict(dict(
      kind='bar', label=['num_kv_heads', 'kv_dtype', 'engine.max_batch_size'],
      y=['kv_bytes_per_token', 'requests_fit_at_max_seq_len', 'mean_concurrent_sequences',
         'generated_tokens_per_s']))
  config.table_columns = ['engine.max_batch_size', 'num_kv_heads', 'kv_dtype', 'kv_bytes_per_token',
                          'requests_fit_at_mean_len', 'requests_fit_at_max_seq_len',
                          'mean_concurrent_sequences', 'generated_tokens_per_s', 'tpot_p50_s',
                          'preemptions', 'simulator_wall_s']
  if arg == 'tiny':
    config.title = 'KV dtype ablation pipeline: Llama-3-8B on 1x H100 SXM, 50 ShareGPT-like requests'
    config.trace.num_requests = 50
    config.sweep = [{'engine.max_batch_size': 256, 'sim.num_kv_heads': 8, 'pool.kv_dtype': d}
                    for d in ('bfloat16', 'int4')]
  elif arg:
    raise ValueError(f'configs/simulate_ablations.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
