"""Block-size ablation: the reproduce_memory trace through the paged pool at one KV budget.

  python -m experiments.sweep --config=configs/ablate_block_size.py --workdir=runs/ablate_block_size
  python -m experiments.sweep --config=configs/ablate_block_size.py:tiny --workdir=/tmp/bs_tiny

Every point keeps the same usable KV memory (the budget of configs/reproduce_memory.py, in
token slots; block 0, the null block, comes on top) and changes only pool.block_size, so
num_blocks = budget / block_size + 1. Small blocks waste less in each sequence's last block;
large ones cost fewer loop steps in the attention kernel and fewer table entries.
`:tiny` is the seconds-long variant (two block sizes) the tests run.
"""
from configs import reproduce_memory

BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)


def get_config(arg=None):
  config = reproduce_memory.get_config('tiny' if arg == 'tiny' else None)
  if arg not in (None, 'tiny'):
    raise ValueError(f'configs/ablate_block_size.py: unknown variant {arg!r}; allowed: tiny')
  budget = (config.pool.num_blocks - 1) * config.pool.block_size
  config.pool.kind = 'paged'
  sizes = (8, 16) if arg == 'tiny' else BLOCK_SIZES
  config.sweep = [{'pool.block_size': bs, 'pool.num_blocks': budget // bs + 1} for bs in sizes]
  config.plot = dict(x='pool.block_size', logx=True,
                     y=['kv_utilization', 'generated_tokens_per_s', 'mean_concurrent_sequences',
                        'kv_internal_fragmentation'])
  return config
