"""Block-size ablation: the reproduce_memory trace through the paged pool at one KV budget.

  python -m experiments.sweep --config=configs/ablate_block_size.py --workdir=runs/ablate_block_size
  python -m experiments.sweep --config=configs/ablate_block_size.py:tiny --workdir=/tmp/bs_tiny

Every point keeps the same usable KV memory (the budget of configs/reproduce_memory.py, in
token slots; block 0, the null block, comes on top) and changes only pool.block_size, so
num_blocks = budget / block_size + 1. Small blocks waste less in each sequence's last block;
large ones cost fewer loop steps in the attention kernel and fewer table entries. Both sides
are in every row: the memory and serving figures of the trace, what block tables cost the host
(table entries per sequence, table bytes and input-building time per iteration), and the
attention kernel and the building of one call's inputs timed at one context across all the
block sizes, with their per-block costs fitted (config.block_overhead;
experiments/block_overhead.py). The plot's first row is the benefits of small blocks, its second
their costs.
`:tiny` is the smoke-size variant (two block sizes, the tiny trace) the tests run.
"""
import ml_collections

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
  config.job = 'trace_with_block_overhead'
  # One decode call of 8 sequences at 2048 tokens (the trace's longest) with the model's heads,
  # its attention and its inputs timed; a few seconds in all. :tiny: a short context, few rounds.
  config.block_overhead = ml_collections.ConfigDict(dict(
      context=128 if arg == 'tiny' else 2048, batch=2 if arg == 'tiny' else 8,
      block_sizes=sizes, rounds=2 if arg == 'tiny' else 30))
  config.title = ('Block size at one KV budget: ' + ('tiny random Llama, 2 block sizes'
                   if arg == 'tiny' else 'the reproduce_memory trace, tiny random Llama, CPU'))
  config.table_columns = ['pool.block_size', 'pool.num_blocks', 'kv_utilization',
                          'generated_tokens_per_s', 'kv_internal_fragmentation',
                          'block_table_entries_mean', 'step_input_s_per_iteration',
                          'attention_s']
  config.plot = dict(
      x='pool.block_size', logx=True,
      row_titles=['what small blocks save', 'what small blocks cost'],
      y=[['kv_utilization', 'generated_tokens_per_s', 'mean_concurrent_sequences',
          'kv_internal_fragmentation'],
         ['block_table_entries_mean', 'block_table_bytes_per_iteration',
          'step_input_s_per_iteration', 'step_inputs_call_s', 'attention_s']],
      logy=['block_table_entries_mean', 'block_table_bytes_per_iteration',
            'step_input_s_per_iteration', 'step_inputs_call_s', 'attention_s'])
  config.variant = arg or 'full'
  return config
