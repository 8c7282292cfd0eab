"""The native CPU linear-layer kernel against XLA's dots, and against the kernel as built from an
earlier git revision, on a decode step's matmul shapes (experiments/bench_linear.py).

  python -m experiments.bench_linear --config=configs/bench_linear.py --workdir=runs/bench_linear
  python -m experiments.bench_linear --config=configs/bench_linear.py --config.bench.baseline=REV --workdir=runs/bench_linear
  python -m experiments.bench_linear --config=configs/bench_linear.py:tiny --workdir=/tmp/bench_linear

`shapes` are (name, K, N, transposed, per_step): SmolLM2-135M's linear layers (q/o 576 x 576, k/v
576 x 192, gate/up 576 x 1536, down 1536 x 576, per_step = how many a decode step runs over its
30 layers) and the tied head (the [49152, 576] embedding read as [N, K]); `rows` the x rows of a
call (1, 2: the streaming path; 8, 32: decode batches). Each call runs x through enough distinct
copies of W that they hold at least `min_bytes` (past the 32 MiB L3: W comes from DRAM, as in a
decode step), outputs summed. `rounds` timed rounds call every variant once in a rotating order;
ratios are per round, then the median. `baseline`: a git revision whose kernel sources
(kernels/csrc) are built too and timed as 'baseline' ('' = none). `:tiny` is the same pipeline
at smoke size (small shapes, 2 rounds): it proves the run works, its figures mean nothing.
"""
import ml_collections

# (name, K, N, transposed, per decode step): SmolLM2-135M, 30 layers, tied head.
SMOLLM2_SHAPES = (
    ('q_o', 576, 576, False, 60),
    ('k_v', 576, 192, False, 60),
    ('gate_up', 576, 1536, False, 60),
    ('down', 1536, 576, False, 30),
    ('head', 576, 49152, True, 1),
)


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.bench = ml_collections.ConfigDict(dict(
      rows=(1, 2, 8, 32),
      shapes=SMOLLM2_SHAPES,
      min_bytes=2**27,  # 128 MiB of W per call, four times the L3
      rounds=9,
      baseline='',  # a git revision to build the kernel from too; '' = none
      seed=0,
  ))
  if arg == 'tiny':
    config.bench.update(dict(rows=(8,), shapes=(('dense', 64, 40, False, 2),
                                                  ('head', 48, 100, True, 1)),
                             min_bytes=2**16, rounds=2))
  elif arg:
    raise ValueError(f'configs/bench_linear.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
