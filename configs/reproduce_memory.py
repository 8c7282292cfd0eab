"""vLLM paper memory study on CPU: one ShareGPT-like trace, contiguous vs paged, same KV budget.

  python -m experiments.reproduce_memory --workdir=runs/reproduce_memory
  python -m experiments.reproduce_memory --config=configs/reproduce_memory.py:tiny --workdir=/tmp/rm

Both points replay the same trace (ShareGPT-like lengths, every request at t=0) through the same
tiny random Llama (configs/default.py:tiny shape, byte vocabulary), scheduler and kernels, in a
pool of the same size: BUDGET_SEQS * MAX_SEQ_LEN token slots, room for BUDGET_SEQS contiguous
reservations. They differ only in pool.kind. `:tiny` is a smoke-size run of the same
pipeline (1-layer model, 12 requests); its figures are not the study's.
"""
import ml_collections

from configs import default

MAX_SEQ_LEN = 2048  # what contiguous reserves per request: the ShareGPT limits 1024 in + 1024 out
BUDGET_SEQS = 8
BLOCK_SIZE = 16


def get_config(arg=None):
  config = default.get_config('tiny')
  config.job = 'trace'
  # Prompts of random models are UTF-8 bytes, so a byte vocabulary. :tiny's 49152-token head
  # costs 3.1M multiply-adds per token, most of this model's work, at a fixed cost per token
  # whatever the batch; it would mostly measure the head. To compare:
  # --config.model.random.vocab_size=49152.
  config.model.random.vocab_size = 256
  config.attention.impl = 'auto'
  config.engine.max_seq_len = MAX_SEQ_LEN
  config.engine.max_batch_size = 64
  config.engine.prefill_chunk = 64
  config.pool.block_size = BLOCK_SIZE
  config.pool.num_blocks = BUDGET_SEQS * MAX_SEQ_LEN // BLOCK_SIZE + 1  # + the null block
  config.scheduler.max_num_batched_tokens = 256
  config.trace = ml_collections.ConfigDict(dict(
      dataset='sharegpt', num_requests=200, rate=float('inf'), seed=0, max_input_len=1024,
      max_output_len=1024, calibrate=True))
  config.sweep = [{'pool.kind': 'contiguous'}, {'pool.kind': 'paged'}]

  if arg == 'tiny':
    config.model.random.update(dict(d_model=32, num_layers=1, num_heads=2,
                                    num_kv_heads=1, head_dim=16, ffn_dim=64, max_seq_len=256))
    config.engine.max_seq_len = 128
    config.engine.max_batch_size = 16
    config.engine.prefill_chunk = 32
    config.pool.num_blocks = 4 * 128 // BLOCK_SIZE + 1
    config.scheduler.max_num_batched_tokens = 64
    # ShareGPT's law clipped to these limits (its means do not fit under them).
    config.trace.update(dict(num_requests=12, max_input_len=48, max_output_len=48,
                             calibrate=False))
  elif arg:
    raise ValueError(f'configs/reproduce_memory.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
