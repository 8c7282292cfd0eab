"""Block sharing study (vLLM, Kwon et al. SOSP 2023, sections 4.4 and 6.3) on CPU.

  python -m experiments.reproduce_sharing --workdir=runs/reproduce_sharing
  python -m experiments.reproduce_sharing --config=configs/reproduce_sharing.py:tiny --workdir=/tmp/rs

Two studies with one tiny random Llama (configs/reproduce_memory.py's shape, byte vocabulary):
  shared_prompt      every request starts with the same `system_tokens`-token system prompt;
                     the trace is replayed with prefix caching off and on.
  parallel_sampling  Alpaca-like and ShareGPT-like traces, each request asking for n samples
                     (n in `sample_n`); KV memory saved by sharing the prompt's blocks.
  multi_turn         chats that resend their history each turn, caching off and on.
  beam_search        the parallel_sampling traces decoded by beam search (widths
                     `beam_widths`); KV memory saved by the beams' shared blocks. `:tiny`
                     leaves it out (beam_widths=[]) so its smoke run stays as it was;
                     `:tiny_beam` is `:tiny` with it.
`:tiny` is a smoke-size run of the same pipeline; its figures are not the study's.
"""
import ml_collections

from configs import default

BLOCK_SIZE = 16


def get_config(arg=None):
  config = default.get_config('tiny')
  config.model.random.vocab_size = 256  # prompts are UTF-8 bytes (see reproduce_memory.py)
  config.model.random.max_seq_len = 2048
  config.attention.impl = 'auto'
  config.engine.max_seq_len = 2048
  config.engine.max_batch_size = 32
  config.engine.prefill_chunk = 64
  config.pool.block_size = BLOCK_SIZE
  config.pool.num_blocks = 2048 + 1  # + the null block: 32k token slots
  config.scheduler.max_num_batched_tokens = 256
  config.prefix_cache.eviction = 'lru'

  config.shared_prompt = ml_collections.ConfigDict(dict(
      num_requests=48, system_tokens=1000, dataset='alpaca', rate=2.0, seed=0,
      max_input_len=64, max_output_len=16, calibrate=False))
  config.multi_turn = ml_collections.ConfigDict(dict(
      num_conversations=16, turns=4, dataset='sharegpt', rate=0.5, turn_gap_s=5.0, seed=0,
      max_input_len=256, max_output_len=64, calibrate=False))
  config.parallel_sampling = ml_collections.ConfigDict(dict(
      datasets=['alpaca', 'sharegpt'], sample_n=[2, 4, 6], num_requests=8, seed=0,
      max_input_len=1024, max_output_len=1024, temperature=1.0, calibrate=True))
  config.beam_search = ml_collections.ConfigDict(dict(
      datasets=['alpaca', 'sharegpt'], beam_widths=[2, 4, 6], num_requests=8, seed=0,
      max_input_len=1024, max_output_len=1024, calibrate=True))

  if arg in ('tiny', 'tiny_beam'):
    config.engine.max_seq_len = 256
    config.engine.max_batch_size = 8
    config.engine.prefill_chunk = 32
    config.pool.num_blocks = 96 + 1
    config.scheduler.max_num_batched_tokens = 64
    config.shared_prompt.update(dict(num_requests=6, system_tokens=100, max_input_len=16,
                                     max_output_len=4))
    config.multi_turn.update(dict(num_conversations=2, turns=3, max_input_len=24,
                                  max_output_len=8))
    config.parallel_sampling.update(dict(sample_n=[2], num_requests=3, max_input_len=48,
                                         max_output_len=16, calibrate=False))
    config.beam_search.update(dict(beam_widths=[2] if arg == 'tiny_beam' else [],
                                   num_requests=3, max_input_len=48, max_output_len=16,
                                   calibrate=False))
  elif arg:
    raise ValueError(f'configs/reproduce_sharing.py: unknown variant {arg!r}; allowed: tiny, '
                     'tiny_beam')
  config.variant = arg or 'full'
  return config
