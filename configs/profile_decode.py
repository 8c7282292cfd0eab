"""Where a decode step's time goes: a jax.profiler trace of the main job's warm decode steps,
its ops grouped into categories, next to the step's matmul floor (experiments/profile_decode.py).

  python -m experiments.profile_decode --config=configs/profile_decode.py --workdir=runs/profile_decode
  python -m experiments.profile_decode --config=configs/profile_decode.py:tiny --workdir=/tmp/profile_decode

The model is the main job's (configs/default.py: SmolLM2-135M-Instruct, float32), run as the
engine runs it (attention.impl and the step's linear_impl / decode_layers as set here; on CPU
`auto` is the native attention and linear kernels). Per batch in `profile.batches`: that many
prompts of `profile.prompt_len` token ids, prefilled, then `profile.warmup_steps` decode
iterations (the decode program compiles there), then `profile.steps` decode iterations traced.
Single rows decode in 1-row calls (engine.decode_min_rows=1, as configs/bench_decode.py).
The floor is bench_decode's (matmul_floor_fn: the step's matmuls alone, XLA's dots; with
`profile.kernel_floor` also through the native linear kernel), `profile.floor_calls` calls.
`profile.copy_mb` sizes the memory-copy probe the matmuls' GB/s are set against.

`:tiny` is a smoke-size run of the same pipeline: a random Llama of the tests' tiny shape
(tests/tiny_models.py), one batch, short prompts; its figures are not the study's.
"""
from ml_collections import config_dict

from configs import default


def get_config(arg=None):
  config = default.get_config()
  config.attention.impl = 'auto'
  config.engine.max_batch_size = 32
  config.engine.max_seq_len = 512
  config.engine.decode_min_rows = 1  # a lone row decodes in 1-row calls, not padded to 8
  config.pool.num_blocks = 400  # 32 sequences of 128 + 16 tokens at block_size 16, and spare
  config.profile = config_dict.ConfigDict(dict(
      batches=(1, 8, 32),  # a tuple: --config.profile.batches="(8,)" overrides it
      prompt_len=128,
      warmup_steps=3,  # decode iterations before the trace (the first compiles)
      steps=5,  # decode iterations traced per batch
      # The step's program, as CompiledStep takes them (pagedjax/model/step.py,
      # pagedjax/model/llama.py LINEAR_IMPLS): the engine's defaults.
      linear_impl='auto',
      decode_layers='auto',
      floor_calls=5,  # timed calls of the matmul floor per batch (median)
      kernel_floor=True,  # also the floor through the native linear kernel, where it runs
      copy_mb=256,  # the memory-copy probe's buffer (MB)
      seed=0,
  ))
  if arg == 'tiny':
    config.model.source = 'random'
    # The tests' tiny GQA Llama (tests/tiny_models.py): small enough to compile in a second.
    config.model.random.update(dict(vocab_size=97, d_model=48, num_layers=2, num_heads=4,
                                    num_kv_heads=2, head_dim=12, ffn_dim=96, max_seq_len=512))
    config.engine.max_batch_size = 2
    config.engine.max_seq_len = 128
    config.pool.num_blocks = 32
    config.profile.batches = (2,)
    config.profile.prompt_len = 12
    config.profile.warmup_steps = 2
    config.profile.steps = 2
    config.profile.floor_calls = 2
    config.profile.kernel_floor = False
    config.profile.copy_mb = 8
  elif arg:
    raise ValueError(f'configs/profile_decode.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
