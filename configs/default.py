"""Default decode experiment: SmolLM2-135M-Instruct (shipped GGUF) on CPU, paged KV pool.

  python -m experiments.decode --config=configs/default.py --workdir=runs/default
  python -m experiments.decode --config=configs/default.py:tiny --workdir=runs/tiny

`:tiny` swaps in a small random Llama (same tokenizer) that runs in seconds. Any field can be
overridden on the command line, e.g. `--config.pool.block_size=32`.
"""
import ml_collections

PROMPTS = (
    'The capital of France is',
    'In the beginning God created',
    'The three primary colors are',
    'def fibonacci(n):',
    'Water boils at a temperature of',
    'The largest planet in our solar system is',
)


def get_config(arg=None):
  config = ml_collections.ConfigDict()

  config.model = ml_collections.ConfigDict()
  config.model.source = 'smollm2'  # smollm2 | gguf | safetensors | random
  config.model.path = ''  # file (gguf) or directory (safetensors)
  config.model.dtype = 'float32'  # compute dtype
  config.model.cache_dir = '~/.cache/pagedjax'  # orbax copy of converted params; '' disables
  config.model.random = ml_collections.ConfigDict(dict(  # shape when source == 'random'
      vocab_size=49152, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
      ffn_dim=128, max_seq_len=2048, rope_theta=10000.0, tie_embeddings=True, seed=0))

  config.pool = ml_collections.ConfigDict()
  config.pool.block_size = 16
  config.pool.num_blocks = 256  # block 0 is the null block
  config.pool.kv_dtype = 'auto'  # auto = model.dtype
  # Quantized storage (pagedjax/quant.py): kv_dtype int8 | fp8_e4m3 | fp8_e5m2 | int4.
  config.pool.kv_group_size = 32  # int4: channels per scale
  config.pool.kv_key_per_channel = False  # int4: KIVI keys, one range per channel per block
  config.pool.kv_recent_window = 0  # newest tokens per sequence also kept in bfloat16
  config.pool.kind = 'paged'  # paged | contiguous (reserves engine.max_seq_len per request)

  config.attention = ml_collections.ConfigDict()
  config.attention.impl = 'auto'  # reference | xla | pallas_tpu | pallas_gpu | triton | auto

  config.engine = ml_collections.ConfigDict()
  config.engine.max_batch_size = 8
  config.engine.prefill_chunk = 64
  config.engine.max_seq_len = 1024

  config.scheduler = ml_collections.ConfigDict()
  config.scheduler.preemption = 'recompute'  # recompute | swap (to a host-RAM tier)
  config.scheduler.watermark = 0.01  # share of pool blocks admission keeps free
  config.scheduler.max_num_batched_tokens = 0  # per iteration; 0 = max_batch_size * prefill_chunk
  config.scheduler.swap_blocks = 0  # host-tier blocks for swap; 0 = as many as the pool

  config.prefix_cache = ml_collections.ConfigDict()
  config.prefix_cache.enabled = False  # reuse cached full blocks of earlier prompts
  config.prefix_cache.design = 'hash'  # hash (chain over full blocks) | radix (tree)
  config.prefix_cache.eviction = 'lru'  # lru | lfu: which evictable cached block goes first

  config.sampling = ml_collections.ConfigDict()
  config.sampling.max_new_tokens = 24
  config.sampling.temperature = 0.0
  config.sampling.top_k = 0
  config.sampling.top_p = 1.0
  config.sampling.seed = 0

  config.mesh = ml_collections.ConfigDict()
  config.mesh.model = 1  # tensor-parallel degree: KV pool over KV heads, weights over heads/MLP

  config.prompts = list(PROMPTS)

  if arg == 'tiny':
    config.model.source = 'random'
    config.sampling.max_new_tokens = 16
  elif arg:
    raise ValueError(f'configs/default.py: unknown variant {arg!r}; allowed: tiny')
  return config
