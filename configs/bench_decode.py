"""Decode speed: pagedjax's engine against HF transformers on SmolLM2-135M, float32, CPU.

  python -m experiments.bench_decode --workdir=runs/bench_decode
  python -m experiments.bench_decode --config=configs/bench_decode.py:tiny --workdir=runs/tiny

Per batch in `bench.batches`: the same token ids (real text, `bench.prompt_len` tokens each)
through the engine and through HF `generate` (greedy, EOS ignored, `bench.output_len` new
tokens), both warmed up, timed in interleaved rounds in one process, next to the step's matmuls
alone (the matmul floor) and the same step written as plain unrolled JAX over a dense cache
(experiments/plain_step.py). Then a `bench.trace_requests`-request trace (prompt lengths spread
around prompt_len) through the engine and HF's continuous-batching `generate_batch`.

`:tiny` is a small random Llama on both sides (the HF model built from the same weights) with
short lengths: what tests/test_bench_decode.py runs. Engine fields are pagedjax/config.py's.
"""
from ml_collections import config_dict

from pagedjax.config import Config


def get_config(arg=None):
  config = Config().to_configdict()
  # On CPU: the native `cpu` kernel where it builds (kernels/cpu.py), else `xla`;
  # --config.attention.impl=xla times the plain-JAX path instead.
  config.attention.impl = 'auto'
  config.engine.max_batch_size = 64
  config.engine.max_seq_len = 512
  config.pool.num_blocks = 1100  # 64 sequences of 256 tokens at block_size 16, and spare
  # Batch 1 is single-stream decoding: its lone row runs in 1-row calls, as HF's does, rather
  # than padded to the engine's default 8 (pagedjax/config.py EngineConfig.decode_min_rows).
  config.engine.decode_min_rows = 1
  config.bench = config_dict.ConfigDict(dict(
      batches=(1, 8, 32, 64),  # a tuple: --config.bench.batches="(1,8)" overrides it
      prompt_len=128,
      output_len=128,
      warmup_output_len=8,  # new tokens in the warm-up round (same shapes, compiles everything)
      rounds=2,  # timed rounds after the warm-up; each round runs every variant once
      floor_rounds=5,  # matmul-floor and plain-step calls per batch per round
      trace_requests=64,  # the continuous-batching trace; 0 skips it
      generate_batch=True,  # HF's generate_batch on the trace (if transformers has it)
      hf=True,  # False: engine, floor and plain step only
      # How the engine's decode calls run the layers (pagedjax/model/step.py DECODE_LAYERS):
      # auto (the engine's default) = unrolled over per-layer views of the weights for decode
      # calls of 8+ rows on one CPU device (no per-step weight copies; those programs compile
      # 3-4x slower), scan = always under the layer scan, unrolled = every decode call.
      decode_layers='auto',
      # The linear layers (pagedjax/model/llama.py LINEAR_IMPLS), one engine each, interleaved:
      # auto (the engine's default) = the native CPU kernel (kernels/linear_cpu.py) for decode
      # calls on CPU, xla = XLA's dots. The first is the engine every other figure is taken
      # with; ('auto',) runs that one alone.
      linear_impls=('auto', 'xla'),
      seed=0,
  ))
  if arg == 'tiny':
    config.model.source = 'random'
    config.engine.max_batch_size = 2
    config.engine.max_seq_len = 128
    config.pool.num_blocks = 32
    config.bench.batches = (2,)
    config.bench.prompt_len = 12
    config.bench.output_len = 6
    config.bench.warmup_output_len = 3
    config.bench.rounds = 1
    config.bench.floor_rounds = 2
    config.bench.trace_requests = 2
    config.bench.generate_batch = False  # its warm-up alone takes ~25 s on this CPU
  elif arg:
    raise ValueError(f'configs/bench_decode.py: unknown variant {arg!r}; allowed: tiny')
  return config
