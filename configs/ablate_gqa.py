"""GQA ablation: one model shape, num_kv_heads = heads (MHA), a middle value (GQA), 1 (MQA).

  python -m experiments.sweep --config=configs/ablate_gqa.py --workdir=runs/ablate_gqa
  python -m experiments.sweep --config=configs/ablate_gqa.py:tiny --workdir=/tmp/gqa

A random model with SmolLM2-135M's shape (30 layers, d_model 576, 9 query heads of 64; the KV
head count is what varies): KV bytes per token, sequences of the longest context that fit the
pool budget, and warm decode step time (experiments/kv_quality.py:gqa). Weights are random, so
no quality figures: with trained weights, fewer KV heads is a quality trade made at training.
`:tiny` is the same sweep on a 2-layer, d_model 64 model (KV heads 4 and 1: MHA and MQA) at
short contexts.
"""
from configs import ablate_kv_quant, default


def get_config(arg=None):
  config = ablate_kv_quant.add_eval(default.get_config('tiny'))
  config.job = 'experiments.kv_quality:gqa'
  config.attention.impl = 'xla'
  # float32 KV: bfloat16 gathers are ~3x slower on XLA CPU and would swamp the comparison.
  config.pool.kv_dtype = 'float32'
  config.pool.num_blocks = 513  # 8 decode sequences of 512+ tokens fit without preemption
  config.model.random.update(dict(d_model=576, num_layers=30, num_heads=9, head_dim=64,
                                  ffn_dim=1536, max_seq_len=8192))
  config.engine.max_seq_len = 4096
  config.eval.decode_tokens = 32
  config.eval.decode_prompt_len = 512  # decode reads a long context, where KV heads matter
  config.sweep = [{'model.random.num_kv_heads': n} for n in (9, 3, 1)]
  config.plot = {'x': 'num_kv_heads', 'y': ['kv_bytes_per_token', 'max_concurrent_sequences',
                                            'decode_step_ms'], 'logx': False}
  config.title = 'GQA: KV heads of a random SmolLM2-135M-shaped model (CPU)'
  if arg == 'tiny':
    config.title = 'GQA: KV heads of a tiny random Llama (CPU)'
    # A byte vocabulary (256): the default random model's 49,152-word head is most of a tiny
    # step, and no tokenizer is built.
    config.model.random.update(dict(d_model=64, num_layers=2, num_heads=4, head_dim=16,
                                    ffn_dim=128, max_seq_len=512, vocab_size=256))
    config.engine.max_seq_len = 256
    config.pool.num_blocks = 64
    # Decode calls of the batch's 2 rows, not padded to the engine's default 8 (which also
    # runs them unrolled, programs that compile 3-4x slower): the tiny run is the pipeline.
    config.engine.decode_min_rows = 2
    config.eval.update(dict(contexts=[64], pool_budget_mb=1, decode_batch=2, decode_tokens=4,
                            decode_prompt_len=16))
    config.sweep = [{'model.random.num_kv_heads': n} for n in (4, 1)]
  elif arg:
    raise ValueError(f'configs/ablate_gqa.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
