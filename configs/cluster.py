"""Routing across replicas, simulated: llm-d's precise prefix-cache routing setup on this CPU.

  python -m experiments.cluster --workdir=runs/cluster
  python -m experiments.cluster --config=configs/cluster.py:tiny --workdir=/tmp/cluster

llm-d's benchmark of its precise prefix-cache-aware scheduler: Qwen3-32B on 8 vLLM pods of 2 x
H100 (tensor parallel 2, KV block size 64), each with 307,328 tokens of KV cache; 150 tenants,
each a 6,000-token system prompt, 5 users per tenant asking 1,200-token questions; Poisson load
rising 3 -> 60 requests/s. Here every pod is a simulated replica (pagedjax/sim: the real engine
host code, device time from the cost model with the H100 SXM preset, efficiencies assumed), the
model a Qwen3-32B-shaped preset (its config.json numbers, below), the pool fixed at 307,328
tokens (4,802 blocks of 64). Scaled down to run in minutes: `workload.stage_s` simulated seconds
per load stage (llm-d ran minutes per stage), `workload.output_tokens` generated per request
(a choice of this study). Prompts are random token ids below 256 (the content only has to be
distinct: keys are over 64-token blocks); a request is a random tenant's prompt and a fresh
question of a random one of its users. Every router row replays the same trace.
`:tiny` is a seconds-long smoke run of the same pipeline (a 4-replica Llama-3-8B cluster).

`:llmd_host` is the same setup where the hot prefixes exceed the replicas' device memory and
live in host RAM: each replica gets a host-RAM KV tier (config.tiers.host_blocks on the
simulated device: the real KVTiers without block contents, promotions and demotions charged at
the preset's host link, pagedjax/sim) of 24,000 blocks (1,536,000 tokens, 403 GB of Qwen3-32B
KV at 256 KiB a token): a DGX H100 node's 2 TB of RAM shared by its 4 two-GPU pods is 512 GB
each, less ~100 GB for the OS and the serving processes. 600 tenants instead of 150 (3.6 M
prefix tokens): a prefix-affine router gives each replica 75 of them, 450 K tokens, more than
its whole 307,328-token device pool (which also holds the running requests), but well within
device + host (1.84 M); all 600 do not fit one replica (so prefix-blind routing still loses
hits). Stages of 12 s instead of 6 (2,5xx requests, ~4 per tenant), so prefixes repeat. The
`cluster.device_only_routers` rows are replayed without the host tier, for comparison.
`:tiny_llmd_host` is its test-sized run (the tiny cluster, 32 tenants of 256 tokens: 2,048 per
replica under affinity against 1,536 device tokens; a 2,048-token host tier).

`:mooncake` is Mooncake's (FAST'25) local-vs-global cache comparison on its conversation trace
(/work/shared/traces/mooncake_conversation.jsonl: 12,031 requests over 59 minutes, blocks of 512
tokens by hash id): 10 prefill replicas of a Llama-3-70B-shaped model on 8 x A100 80GB (the
paper's A800s), 3M tokens of cache each, outputs cut to one token; every router with local
caches, then a few with one shared store of the replicas' pooled 30M tokens under them
(pagedjax/cluster/sim.py's SharedStore) and each replica's own cache cut to a working set of 8
longest prompts (so both hold about 30M tokens in all). Scaled by `workload.length_scale`
(1/8: blocks of 64 tokens, the engines' block size, so the trace's reuse is kept block for
block; the caches scale with it, 375 K tokens per replica) with arrival gaps scaled alike
(`time_scale`), so the tokens per second the replicas see stay the trace's. `:tiny_mooncake` is its test-sized run
(the first 300 requests at 1/64, 4 replicas of 2,048 tokens, three rows).
"""
import ml_collections

from configs import simulate_vllm
from pagedjax.config import Config

# Qwen/Qwen3-32B config.json: hidden 5120, 64 layers, 64 query / 8 KV heads of 128, MLP 25600,
# vocabulary 151,936, untied embeddings, 40,960 positions (no q/k/v bias in Qwen3).
QWEN3_32B = dict(name='Qwen3-32B', num_layers=64, d_model=5120, num_heads=64, num_kv_heads=8,
                 head_dim=128, ffn_dim=25600, vocab_size=151936, tie_embeddings=False,
                 max_seq_len=40960)
BLOCK_SIZE = 64  # llm-d's vLLM --block-size
KV_TOKENS = 307_328  # per pod, as llm-d's benchmark reports
# meta-llama/Meta-Llama-3-70B config.json: hidden 8192, 80 layers, 64 query / 8 KV heads of
# 128, MLP 28672, vocabulary 128,256, untied embeddings, 8,192 positions (the trace's prompts
# are longer: max_seq_len is the study's, as a long-context deployment would set it)
LLAMA3_70B = dict(name='Llama-3-70B', num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8,
                  head_dim=128, ffn_dim=28672, vocab_size=128256, tie_embeddings=False,
                  max_seq_len=131072)
MOONCAKE_TRACE = '/work/shared/traces/mooncake_conversation.jsonl'
MOONCAKE_CACHE_TOKENS = 3_000_000  # per prefill node (the paper's local cache)


def router_rows():
  """(label, registry name or 'module:Class', keyword arguments) per router row; a tuple, so
  --config.cluster.routers="(('mine', 'my_lab.routers:Mine', {}),)" overrides it."""
  return (('random', 'random', {'seed': 0}),
          ('round_robin', 'round_robin', {}),
          ('load_aware', 'least_loaded', {'metric': 'tokens'}),
          ('approximate', 'approx_prefix', {}),
          ('precise', 'precise', {}),
          ('tier_cost', 'tier_cost', {}))


def get_config(arg=None):
  config = Config().to_configdict()
  config.sim = simulate_vllm.simulation(QWEN3_32B['name'], 'h100-sxm')
  config.sim.shape = ml_collections.ConfigDict(QWEN3_32B)  # the model (`model` names it only)
  config.sim.num_blocks = KV_TOKENS // BLOCK_SIZE + 1  # + the null block
  config.mesh.model = 2
  config.pool.block_size = BLOCK_SIZE
  config.pool.num_blocks = config.sim.num_blocks
  config.prefix_cache.enabled = True
  config.engine.max_seq_len = 8192
  config.engine.max_batch_size = 128
  config.engine.prefill_chunk = 512
  config.scheduler.max_num_batched_tokens = 4096
  config.workload = ml_collections.ConfigDict(dict(
      kind='tenants',  # 'tenants' (llm-d's) or 'mooncake' (a block-hash trace; mooncake())
      tenants=150, prefix_tokens=6000, users_per_tenant=5, question_tokens=1200,
      output_tokens=128, rates=(3.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0), stage_s=6.0,
      token_range=256, seed=0))
  config.cluster = ml_collections.ConfigDict(dict(
      replicas=8, routers=router_rows(),
      # the routing-cost measurement: every router deciding over this many replicas whose KV
      # index holds each tenant's prefix on `routing_copies` of them, `routing_requests` times
      routing_replicas=16, routing_copies=2, routing_requests=300,
      route_goal_ms=1.0, routing_only=False,  # True: that measurement alone, no simulation
      # rows (by label) replayed again with one shared store of shared_store_blocks blocks under
      # every replica (sim.py); its loads cost store_bytes_per_s and store_latency_s per batch
      store_routers=(), shared_store_blocks=0, store_bytes_per_s=0.0, store_latency_s=0.0,
      store_replica_blocks=0,  # the replicas' own pools in those rows (0: pool.num_blocks)
      # rows (by label) replayed again without the replicas' KV tiers (tiers.host_blocks = 0)
      device_only_routers=()))
  if arg in ('tiny', 'tiny_llmd_host'):
    config.sim.model = 'Llama-3-8B'
    config.sim.shape = ml_collections.ConfigDict(dict(
        name='Llama-3-8B', num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
        head_dim=128, ffn_dim=14336, vocab_size=128256, tie_embeddings=False, max_seq_len=8192))
    config.mesh.model = 1
    config.pool.block_size = 16
    config.sim.num_blocks = config.pool.num_blocks = 97  # 1,536 tokens per replica
    config.engine.update(dict(max_seq_len=1024, max_batch_size=16, prefill_chunk=128))
    config.scheduler.max_num_batched_tokens = 512
    config.workload.update(dict(tenants=12, prefix_tokens=256, users_per_tenant=2,
                                question_tokens=64, output_tokens=8, rates=(20.0, 80.0),
                                stage_s=0.5))
    config.cluster.update(dict(replicas=4, routing_replicas=4, routing_requests=20))
  elif arg in ('mooncake', 'tiny_mooncake'):
    mooncake(config, tiny=arg == 'tiny_mooncake')
  elif arg not in (None, '', 'llmd_host'):
    raise ValueError(f'configs/cluster.py: unknown variant {arg!r}; allowed: tiny, mooncake, '
                     'tiny_mooncake, llmd_host, tiny_llmd_host')
  if arg in ('llmd_host', 'tiny_llmd_host'):
    llmd_host(config, tiny=arg == 'tiny_llmd_host')
  config.variant = arg or 'full'
  return config


def mooncake(config, tiny: bool = False) -> None:
  """Mooncake's local-vs-global cache setup (module docstring)."""
  scale = 1 / 64 if tiny else 1 / 8
  block = int(512 * scale)
  config.sim = simulate_vllm.simulation(LLAMA3_70B['name'], 'a100-80gb')
  config.sim.shape = ml_collections.ConfigDict(LLAMA3_70B)
  config.mesh.model = 8
  config.pool.block_size = block
  # per replica: 3M tokens at the scale (5,859 blocks of 64); the tiny one just holds its
  # longest prompt (2,048 tokens), so only the trace's first requests' own reuse is kept
  per_replica = 256 if tiny else int(MOONCAKE_CACHE_TOKENS * scale) // block
  config.sim.num_blocks = config.pool.num_blocks = per_replica + 1  # + the null block
  # the trace's longest prompt is 126,195 tokens: 15,775 at 1/8, 1,972 at 1/64
  config.engine.update(dict(max_seq_len=2048 if tiny else 16384, max_batch_size=64,
                            prefill_chunk=block * 8))
  config.scheduler.max_num_batched_tokens = block * 64
  config.workload = ml_collections.ConfigDict(dict(
      kind='mooncake', path=MOONCAKE_TRACE, start=0, limit=300 if tiny else 0,  # 0: all
      length_scale=scale, time_scale=scale, output_tokens=1))
  replicas = 4 if tiny else 10
  config.cluster.update(dict(
      replicas=replicas,
      routers=((('round_robin', 'round_robin', {}), ('precise', 'precise', {})) if tiny else
               router_rows()),
      store_routers=('precise',) if tiny else ('load_aware', 'precise', 'tier_cost'),
      shared_store_blocks=replicas * per_replica,  # the replicas' caches pooled (30M tokens)
      # with the store, a replica keeps on its own only the working set of its batches (as
      # Mooncake's prefill nodes keep HBM for the running requests): 8 longest prompts (131 K
      # tokens), so the cache memory in all is about the local rows' 30M, pooled (the tiny
      # run's replicas keep their whole pool: it is one longest prompt)
      store_replica_blocks=0 if tiny else 8 * 16384 // block + 1,
      # Mooncake moves KV over RDMA (its prefill nodes have 8 x 200 Gb/s NICs): 100 GB/s and
      # 100 us per batched load here, an assumption, not a measurement
      store_bytes_per_s=100e9, store_latency_s=1e-4,
      routing_replicas=16, routing_copies=2, routing_requests=20 if tiny else 300))


HOST_BLOCKS = 24_000  # per replica: 1,536,000 tokens, 403 GB of Qwen3-32B KV (module docstring)


def llmd_host(config, tiny: bool = False) -> None:
  """llm-d's setup with hot prefixes past device memory, in host RAM (module docstring)."""
  config.tiers.host_blocks = 128 if tiny else HOST_BLOCKS
  config.tiers.promotion = 'auto'  # load or recompute by the cost model's figures
  if tiny:
    config.workload.update(dict(tenants=32, stage_s=1.0))
  else:
    config.workload.update(dict(tenants=600, stage_s=12.0))
  config.cluster.device_only_routers = ('precise', 'tier_cost')
