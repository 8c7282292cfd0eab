"""Paged attention paths against attention over a contiguous cache holding the same tokens, and
this machine's memory bandwidth measured in the same rounds (experiments/bench_attention.py).

  python -m experiments.bench_attention --config=configs/bench_attention.py --workdir=runs/bench_attention
  python -m experiments.bench_attention --config=configs/bench_attention.py:tiny --workdir=/tmp/bench_attention

Decode (one query token per sequence) at every (context, dtype) in `bench`: batch 32, 8 KV / 32
query heads (GQA 4), head_dim 64, blocks of 64 tokens, contexts 1024 and 8192, float32 and
bfloat16 pools and queries. `impls` names the paged paths to time; empty: every path that runs
natively on the backend (on CPU: reference, xla, and cpu where its kernel builds). `rounds`
timed rounds each call every variant once, in a rotating order. `memory_bytes` is the buffer the
bandwidth probes read and copy: at least this, and at least the largest K/V of the run.
`:tiny` is the same pipeline at smoke size (batch 4, one 128-token context, 2 rounds, a 16 MiB
probe that fits in cache): it proves the run works, its figures mean nothing.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.bench = ml_collections.ConfigDict(dict(
      batch=32,
      num_kv_heads=8,
      num_heads=32,
      head_dim=64,
      block_size=64,
      contexts=(1024, 8192),  # tuples, so --config.bench.contexts='(512,)' overrides them
      dtypes=('float32', 'bfloat16'),
      impls=(),  # () = every paged path native to the backend
      rounds=15,
      memory_bytes=2**28,  # 256 MiB, far past the 32 MiB L3: DRAM, not cache bandwidth
      seed=0,
  ))
  if arg == 'tiny':
    config.bench.update(dict(batch=4, num_kv_heads=2, num_heads=8, block_size=16,
                             contexts=(128,), rounds=2, memory_bytes=2**24))
  elif arg:
    raise ValueError(f'configs/bench_attention.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
