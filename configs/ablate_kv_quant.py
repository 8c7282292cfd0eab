"""KV quantization ablation on SmolLM2-135M: quality through the real paged cache vs bytes.

  python -m experiments.sweep --config=configs/ablate_kv_quant.py --workdir=runs/ablate_kv_quant
  python -m experiments.sweep --config=configs/ablate_kv_quant.py:tiny --workdir=/tmp/kvq

Each point stores the pool as one kv_dtype (int4 with its options) and scores KJV text through it
in prefill chunks (experiments/kv_quality.py): perplexity at each context length against the same
run with a bfloat16 pool, top-1 agreement, logit error by position, KV bytes per token (scales
included), sequences of the longest context that fit `eval.pool_budget_mb`, decode tokens/s.
`:tiny` runs the same pipeline on a tiny random model (a byte vocabulary: the text is scored as
its UTF-8 bytes) at two points (int8, and int4 with groups of 8, per-channel keys and a recent
window; each scored against the bfloat16 reference): no quality figures.
"""
import ml_collections

from configs import default


def kv_point(kv_dtype, group_size=32, key_per_channel=False, recent_window=0):
  return {'pool.kv_dtype': kv_dtype, 'pool.kv_group_size': group_size,
          'pool.kv_key_per_channel': key_per_channel, 'pool.kv_recent_window': recent_window}


def add_eval(config):
  config.eval = ml_collections.ConfigDict(dict(
      contexts=[512, 2048],  # perplexity over the first N predicted tokens of each sequence
      num_sequences=1,       # sequences of max(contexts) + 1 tokens from spread-out KJV books
      chunk=128,             # prefill chunk: queries attend to the quantized cache beyond it
      reference_kv_dtype='bfloat16',
      pool_budget_mb=256,    # for max_concurrent_sequences
      decode_batch=8, decode_tokens=16,  # decode_tokens_per_second: a warm batch decode
      decode_prompt_len=128))
  return config


def get_config(arg=None):
  config = add_eval(default.get_config('tiny' if arg == 'tiny' else None))
  config.job = 'experiments.kv_quality:kv_quality'
  config.attention.impl = 'xla'
  config.engine.max_seq_len = 4096
  config.sweep = [
      kv_point('float32'),
      kv_point('bfloat16'),
      kv_point('int8'),
      kv_point('fp8_e4m3'),
      kv_point('fp8_e5m2'),
      kv_point('int8', recent_window=64),
      kv_point('fp8_e4m3', recent_window=64),
      kv_point('int4', group_size=64),  # naive: one range per token and head
      kv_point('int4', group_size=32),
      kv_point('int4', group_size=32, key_per_channel=True),  # KIVI keys
      kv_point('int4', group_size=32, key_per_channel=True, recent_window=64),
  ]
  config.plot = ml_collections.ConfigDict(dict(
      x='kv_bytes_per_token', y=['perplexity_delta_pct', 'greedy_agreement'],
      group='pool.kv_dtype', logx=True))
  config.title = 'KV quantization: quality through the paged cache vs bytes, SmolLM2-135M (CPU)'
  if arg == 'tiny':
    config.title = 'KV quantization: the pipeline on a tiny random Llama (CPU; no quality figures)'
    config.eval.update(dict(contexts=[32, 64], num_sequences=2, chunk=16, pool_budget_mb=1,
                            decode_batch=2, decode_tokens=4, decode_prompt_len=16))
    # A byte vocabulary (256): the text is scored as its UTF-8 bytes (experiments/kv_quality.py)
    # and no tokenizer is built; the default random model's 49,152-word head is most of a tiny
    # step.
    config.model.random.vocab_size = 256
    config.engine.max_seq_len = 256
    # Decode calls of the batch's 2 rows, not padded to the engine's default 8 (which also
    # runs them unrolled, programs that compile 3-4x slower): the tiny run is the pipeline.
    config.engine.decode_min_rows = 2
    config.sweep = [kv_point('int8'),
                    kv_point('int4', group_size=8, key_per_channel=True, recent_window=16)]
  elif arg:
    raise ValueError(f'configs/ablate_kv_quant.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
