"""The policy table of a KV cache treated as working memory, on CPU with a small random Llama.

  python -m experiments.reproduce_policies --workdir=runs/policies
  python -m experiments.reproduce_policies --config=configs/policy_table.py:tiny --workdir=/tmp/pt

Rows (`policies.rows`), each a change to this config (experiments/reproduce_policies.py):
  unlimited   a device pool that holds every block: the hit-rate reference
  recompute   no prefix cache: every prompt prefilled in full
  lru, lfu    the device prefix cache alone, evicting the coldest blocks (LRU / LFU)
  pin         lru plus the trace's hot prefixes pinned (system prompt, documents, scaffold)
  ram         lru over a host-RAM tier (write-back, every hit loaded)
  ram_disk    lru over host RAM over a disk tier (local tensorstore files under the workdir)
  sessions    ram_disk, and a conversation idle for `session_idle_s` is demoted as a unit
              (requests of multi-turn traces carry their conversation as session_id in every
              row with a prefix cache; sessions are evicted as units in every such row)
  auto        sessions with the cost model choosing load or recompute per hit and swap or
              recompute per preemption victim, calibrated at engine start
Traces (`policies.traces`, built by pagedjax.studies.workloads with byte tokens of KJV text):
  multi_turn  chats resending their history each turn after a think time, many more
              conversations than the device pool holds (`device_share` of the working set)
  rag         few-shot / RAG prompts over a small set of hot documents (`documents`)
  agent       agent loops: a shared scaffold, each step appending a tool result
The device pool of every row but `unlimited` holds `device_share` of the trace's working set
(its distinct full prompt blocks; at least one longest request plus a block per batch row), the
host tier `host_share` of it, the disk tier `disk_share`.
`:tiny` is a smoke-size run of the same pipeline (a 2-layer model, short traces, one repeat); its
figures are not the study's.
"""
import ml_collections

from configs import default

BLOCK_SIZE = 16
ROWS = ('unlimited', 'recompute', 'lru', 'lfu', 'pin', 'ram', 'ram_disk', 'sessions', 'auto')


def get_config(arg=None):
  config = default.get_config('tiny')
  config.model.random.vocab_size = 256  # prompts are UTF-8 bytes (see reproduce_memory.py)
  config.model.random.max_seq_len = 2048
  # Wide enough that a prompt's prefill costs more than the host's work around it (with the
  # 2-layer d_model=64 default, Python bookkeeping hid what a cache hit saves): 4 layers,
  # d_model 256, 4 query / 2 KV heads of 64.
  config.model.random.update(dict(d_model=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                  head_dim=64, ffn_dim=768))
  config.attention.impl = 'auto'
  config.engine.max_seq_len = 2048
  config.engine.max_batch_size = 16
  config.engine.prefill_chunk = 64
  config.pool.block_size = BLOCK_SIZE
  config.scheduler.max_num_batched_tokens = 256
  config.prefix_cache.enabled = True
  config.policies = ml_collections.ConfigDict(dict(
      # tuples, so that the command line can cut them: --config.policies.rows='("lru", "auto")'
      rows=ROWS, traces=('multi_turn', 'rag', 'agent'),
      device_share=0.25,  # device pool / multi_turn working set (the goal setting)
      host_share=0.5, disk_share=1.5,  # tier capacities, shares of the same working set
      session_idle_s=2.0,  # rows sessions and auto: half the multi-turn think time
      unlimited_blocks=4096 + 1,
      repeats=3))  # runs per row (figures: medians); timings swing on a shared CPU
  config.multi_turn = ml_collections.ConfigDict(dict(
      conversations=32, turns=4, dataset='sharegpt', rate=2.0, think_time_s=4.0,
      system_tokens=128, seed=0, max_input_len=160, max_output_len=32))
  config.rag = ml_collections.ConfigDict(dict(
      requests=64, documents=4, shots=6, dataset='alpaca', rate=4.0, seed=0,
      max_input_len=96, max_output_len=24))
  config.agent = ml_collections.ConfigDict(dict(
      agents=8, steps=6, scaffold_tokens=384, dataset='alpaca', rate=1.0, step_gap_s=2.0,
      seed=0, max_input_len=96, max_output_len=24))
  if arg == 'tiny':
    config.model.random.update(dict(d_model=64, num_layers=2, head_dim=16, ffn_dim=128))
    config.engine.max_seq_len = 512
    config.engine.max_batch_size = 8
    config.engine.prefill_chunk = 32
    config.scheduler.max_num_batched_tokens = 64
    config.policies.unlimited_blocks = 512 + 1
    config.policies.repeats = 1
    config.multi_turn.update(dict(conversations=6, turns=3, system_tokens=32, max_input_len=48,
                                  max_output_len=8))
    config.rag.update(dict(requests=10, documents=2, shots=2, max_input_len=32,
                           max_output_len=8))
    config.agent.update(dict(agents=3, steps=3, scaffold_tokens=64, max_input_len=32,
                             max_output_len=8))
  elif arg:
    raise ValueError(f'configs/policy_table.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
