"""Contexts longer than the device pool: SmolLM2-135M float32, a context 4x the pool.

  python -m experiments.long_context --workdir=runs/long_context
  python -m experiments.long_context --config=configs/long_context.py:tiny --workdir=/tmp/lc

The device pool is `pool.num_blocks - 1` blocks of `pool.block_size` tokens (block 0 is the null
block): 16 x 16 = 256 tokens here. The prompt is KJV text cut so that prompt + max_new_tokens =
`long_context.context_multiple` x the pool (1024 tokens). experiments/long_context.py runs it
  - through the normal engine with this pool: refused at submit (the RequestError is recorded);
  - through the normal engine with a pool just big enough (all on the device): the reference
    tokens and logits, and its tokens/s;
  - through the engine with this pool and offload on (config.offload) at every `points` entry
    (window_blocks, chunk_blocks[, layers_per_call]): the newest window_blocks in the pool,
    older blocks in host RAM streamed chunk_blocks per fold step, layers_per_call layers per
    program (1 when not given); (16, C) holds the whole refused pool;
  - by recompute: the whole context re-run without a cache every step (each layer's K/V live
    only while that layer runs), for `recompute_tokens` tokens;
  - at every `disk_points` entry again, with the offloaded blocks on the disk tier;
  - `beside_requests` ordinary requests, timed alone and beside the long one (window
    `beside_window`) in one engine, and the long one's decode steps alone and beside a second
    long request;
  - a follow-up turn over the document and its answer, with prefix caching over the offloaded
    blocks and without;
and reports host/tiers/tier_cost.py's stream-vs-recompute break-even per point, and projected
for `project_contexts` on this CPU and the `project_hardware` presets.
`:tiny` runs the same pipeline on a 1-layer random Llama at one point, host and disk (seconds;
most of it compiling).
"""
import ml_collections

from pagedjax.config import Config


def get_config(arg=None):
  config = Config().to_configdict()
  config.model.source = 'smollm2'
  config.model.dtype = 'float32'
  config.attention.impl = 'auto'
  config.pool.block_size = 16
  config.pool.num_blocks = 17  # the device pool: 16 blocks of 16 tokens + the null block
  config.engine.max_batch_size = 1
  config.engine.prefill_chunk = 64
  config.engine.max_seq_len = 2048
  config.sampling.max_new_tokens = 32  # greedy (temperature 0)
  config.long_context = ml_collections.ConfigDict(dict(
      context_multiple=4,  # prompt + new tokens = this many times the pool's tokens
      prompt_verse=0,  # the KJV verse the prompt's text starts at
      prefill_chunk=64,  # prompt tokens per step of the streamed engines
      # (window_blocks, chunk_blocks[, layers_per_call]) of config.offload, each window at most
      # the pool: the window sweep at chunk 8, the chunk sweep at the whole pool, and every
      # layer in one streamed program (64 >= the model's 30 layers). A tuple, so the command
      # line can override it: --config.long_context.points='((16, 8),)'
      points=((16, 8), (8, 8), (4, 8), (2, 8), (16, 2), (16, 32), (16, 8, 64)),
      # Ordinary requests timed alone and beside the long one (offloaded with this window):
      beside_requests=2, beside_window=8, beside_prompt_tokens=32, beside_new_tokens=32,
      beside_decode_every=(2, 4, 8),  # again with the long one on 1 iteration in k
      # A follow-up turn over the document and its answer (follow_up_new_tokens each), with a
      # question of follow_up_tokens tokens, with prefix caching over the offloaded blocks
      # and without (offload.cache_blocks), at the first point's window and chunk:
      follow_up_tokens=64, follow_up_new_tokens=8,
      recompute_tokens=3,
      # Points run again with every offloaded block on the disk tier (offload.placement='disk')
      # in disk_kvstore ('' = WORKDIR/offload_disk, removed after).
      disk_points=((16, 8),), disk_kvstore='',
      # The recompute-vs-stream projection: contexts with a device window of this share of
      # each, on this CPU (measured) and on these sim/hardware.py presets for this model and
      # these sizing.py model presets (analytic: sim/cost_model.py, prefill chunks of
      # project_chunk_tokens).
      project_hardware=('h100-sxm', 'tpu-v5e'), project_models=('llama3-8b',),
      project_contexts=(4096, 16384, 65536, 131072), project_window_fraction=0.25,
      project_chunk_tokens=512,
      repeats=2))  # timed runs of every point, in rounds (decode steps pooled: the median)
  if arg == 'tiny':
    config.model.source = 'random'  # 1 layer; prompts are UTF-8 bytes (no tokenizer to build)
    config.model.random.update(dict(vocab_size=256, d_model=32, num_layers=1, num_heads=2,
                                    num_kv_heads=1, head_dim=16, ffn_dim=64))
    config.pool.num_blocks = 5  # 4 blocks of 16 = 64 tokens: the context is 256
    config.engine.prefill_chunk = 32
    config.sampling.max_new_tokens = 4
    config.long_context.prefill_chunk = 32
    # Half the pool's window, chunks of 8 as the full window sweep's: its up to 14 host blocks
    # fold in 1 or 2 steps, one set of programs (chunks of 2 compiled 4 fold-step buckets).
    config.long_context.points = ((2, 8),)
    config.long_context.update(dict(beside_window=2, beside_prompt_tokens=8,
                                    beside_new_tokens=4, beside_decode_every=(2,),
                                    follow_up_tokens=8, follow_up_new_tokens=2))
    config.long_context.recompute_tokens = 2
    config.long_context.repeats = 1
    config.long_context.disk_points = ((2, 8),)
    config.long_context.project_contexts = (1024, 8192)
  elif arg:
    raise ValueError(f'configs/long_context.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
