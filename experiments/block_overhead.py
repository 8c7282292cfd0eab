"""What each block costs: the engine's paged-attention path, and the host's building of a step's
inputs, timed at one context length across block sizes, with time = fixed + per_block * blocks
fitted to each.

The block-size sweep (configs/ablate_block_size.py, job `trace_with_block_overhead` in
experiments/jobs.py) reads its figures from here. Settings, `config.block_overhead`:
  context      tokens of context per sequence (every sequence alike)
  batch        sequences per call (one decode query each)
  block_sizes  every block size timed; a sweep point's own block size must be one of them
  rounds       timed rounds; each calls every block size once
The query and KV head shape and dtype are the config's model's; the path is config.attention.impl
resolved as the engine resolves it, called through one jit (the engine calls it inside its
jitted step) on a one-layer layer-stacked pool with the layer index traced, as the model's layer
scan passes it, and shuffled block tables. The host side builds the same call's inputs as the
executor does (pagedjax/executor.py: each row's table sliced to the blocks it reads, then
pagedjax/host/step_inputs.build_step_inputs), its table exactly as wide as the rows' blocks (the
executor's bucket when the context is max_seq_len). All block sizes are timed together,
interleaved round by round, so load from other processes hits them alike (as
experiments/bench_attention.py does; that module defines absl flags at import, so it cannot be
imported into a sweep); the results are kept for the process, so every point of one sweep run
reads the same measurement.

The tokens read are the same at every block size, so in time = fixed + per_block * blocks
`fixed` holds the cost of the context itself and `per_block` what cutting it into more blocks
adds. For the `xla` path a second fit separates its loop: one loop step folds in about 64 tokens
of whole blocks (kernels/xla.py, _TOKENS_PER_STEP), so every block size up to 64 runs the same
number of steps and larger ones fewer; time = fixed + per_block * blocks + per_step * steps
(fitted when the block sizes give three independent columns, else None).
"""
import functools
import math
from typing import Callable, Dict

import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli
from pagedjax import kernels
import pagedjax.kernels.xla  # noqa: F401  (sets kernels.xla)
from pagedjax.config import ConfigError
from pagedjax.host.scheduling.step_inputs import RowSpec, build_step_inputs

_MEASURED: Dict[tuple, dict] = {}  # settings -> figures, one measurement per process
_MEASURED_HOST: Dict[tuple, dict] = {}


def check_settings(s) -> None:
  """config.block_overhead: ConfigError naming the first bad field."""
  if s is None:
    raise ConfigError('config.block_overhead is missing: a dict of context, batch, block_sizes '
                      'and rounds (configs/ablate_block_size.py sets one)')
  for name in ('context', 'batch', 'rounds'):
    value = s.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ConfigError(f'config.block_overhead.{name}={value!r} is not allowed: an int >= 1')
  sizes = s.get('block_sizes')
  if (not isinstance(sizes, (list, tuple)) or len(sizes) < 2 or
      not all(isinstance(b, int) and b >= 1 for b in sizes) or len(set(sizes)) < 2):
    raise ConfigError(f'config.block_overhead.block_sizes={sizes!r} is not allowed: at least two '
                      'distinct ints >= 1 (a line needs two points)')


def fit_line(x, y) -> tuple:
  """Least-squares (intercept, slope) of y = intercept + slope * x."""
  slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
  return float(intercept), float(slope)


def fit_blocks_and_steps(blocks, steps, seconds):
  """Least-squares (fixed, per_block, per_step) of seconds = fixed + per_block * blocks +
  per_step * steps; None when the columns do not determine them (e.g. equal step counts)."""
  x = np.stack([np.ones(len(blocks)), np.asarray(blocks, float), np.asarray(steps, float)], 1)
  if np.linalg.matrix_rank(x) < 3:
    return None
  coef = np.linalg.lstsq(x, np.asarray(seconds, float), rcond=None)[0]
  return tuple(float(c) for c in coef)


def loop_steps(impl: str, context: int, block_size: int):
  """Steps of the `xla` kernel's loop over one sequence of `context` tokens (None for other
  paths, whose loops are their own)."""
  if impl != 'xla':
    return None
  blocks = math.ceil(context / block_size)
  return math.ceil(blocks / kernels.xla._blocks_per_step(block_size, blocks))  # pylint: disable=protected-access


def blocks_read(context: int, batch: int, block_size: int) -> int:
  """Blocks one call reads (of K, and as many of V): every sequence's ceil(context / bs)."""
  return batch * math.ceil(context / block_size)


def decode_inputs(batch: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  context: int, dtype, seed: int = 0) -> tuple:
  """One decode call's arguments: q [B, 1, Hq, D], a layer-stacked pool [1, N, Hkv, bs, D] of
  exactly the blocks the sequences hold plus the null block 0, each sequence's blocks scattered
  over the pool (a shuffled table), every sequence `context` tokens long."""
  rng = np.random.default_rng(seed)
  per_seq = math.ceil(context / block_size)
  num_blocks = batch * per_seq + 1
  shape = (1, num_blocks, num_kv_heads, block_size, head_dim)
  pool = lambda: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  tables = rng.permutation(np.arange(1, num_blocks)).reshape(batch, per_seq).astype(np.int32)
  lens = np.full((batch,), context, np.int32)
  q = jnp.asarray(rng.standard_normal((batch, 1, num_heads, head_dim), np.float32), dtype)
  return q, pool(), pool(), jnp.asarray(tables), jnp.asarray(lens), jnp.asarray(lens[:, None] - 1)


def time_interleaved(fns: Dict[int, Callable], rounds: int) -> Dict[int, float]:
  """Median seconds per call of each zero-argument fn (which must return only when its work is
done), over cli.time_rounds' rotated rounds (after one warm-up call each, which compiles)."""
  return {name: float(np.median(t)) for name, t in cli.time_rounds(fns, rounds).items()}


def measure(impl: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: str, *,
            context: int, batch: int, block_sizes, rounds: int) -> dict:
  """{'impl', 'seconds': {bs: median s per call}, 'blocks_read': {bs: n}, 'loop_steps':
  {bs: n or None}, 'fixed_s', 's_per_block', 'steps_fit': (fixed, per_block, per_step) or None};
  measured once per process for the same arguments."""
  key = (impl, num_heads, num_kv_heads, head_dim, dtype, context, batch, tuple(block_sizes),
         rounds)
  if key not in _MEASURED:
    attend = jax.jit(functools.partial(kernels.paged_attention, impl=impl))
    layer = jnp.int32(0)
    fns = {}
    for bs in block_sizes:
      args = decode_inputs(batch, num_heads, num_kv_heads, head_dim, bs, context,
                           jnp.dtype(dtype))

      def call(args=args):
        return jax.block_until_ready(attend(*args, layer=layer))
      fns[bs] = call
    seconds = time_interleaved(fns, rounds)
    counts = {bs: blocks_read(context, batch, bs) for bs in block_sizes}
    times = [seconds[b] for b in block_sizes]
    fixed, per_block = fit_line([counts[b] for b in block_sizes], times)
    resolved = kernels.best_impl() if impl == 'auto' else impl
    steps = {bs: loop_steps(resolved, context, bs) for bs in block_sizes}
    steps_fit = None if resolved != 'xla' else fit_blocks_and_steps(
        [counts[b] for b in block_sizes], [steps[b] for b in block_sizes], times)
    _MEASURED[key] = dict(impl=resolved, seconds=seconds, blocks_read=counts, loop_steps=steps,
                          fixed_s=fixed, s_per_block=per_block, steps_fit=steps_fit)
  return _MEASURED[key]


def step_input_builders(context: int, batch: int, block_sizes) -> Dict[int, Callable]:
  """Per block size, a function building one decode call's inputs as the executor does: `batch`
  rows of `context` tokens, each RowSpec's table sliced from the sequence's list of blocks."""
  fns = {}
  for bs in block_sizes:
    n = math.ceil(context / bs)
    tables = [list(range(1 + i * n, 1 + (i + 1) * n)) for i in range(batch)]

    def build(bs=bs, n=n, tables=tables):
      specs = [RowSpec([0], context - 1, table[:n]) for table in tables]
      return build_step_inputs(specs, bs, [batch], [1], [n])
    fns[bs] = build
  return fns


def measure_step_inputs(*, context: int, batch: int, block_sizes, rounds: int) -> dict:
  """{'seconds': {bs: median s to build one call's inputs}, 'entries': {bs: table entries},
  'fixed_s', 's_per_entry'}; measured once per process for the same arguments."""
  key = (context, batch, tuple(block_sizes), rounds)
  if key not in _MEASURED_HOST:
    seconds = time_interleaved(step_input_builders(context, batch, block_sizes), rounds)
    entries = {bs: blocks_read(context, batch, bs) for bs in block_sizes}
    fixed, per_entry = fit_line([entries[b] for b in block_sizes],
                                [seconds[b] for b in block_sizes])
    _MEASURED_HOST[key] = dict(seconds=seconds, entries=entries, fixed_s=fixed,
                               s_per_entry=per_entry)
  return _MEASURED_HOST[key]


def figures(config, model_cfg) -> dict:
  """A sweep row's kernel and step-input figures at config.pool.block_size (model_cfg: the
  model's ModelConfig, for the head shape and dtype)."""
  s = config.get('block_overhead')
  check_settings(s)
  bs = config.pool.block_size
  if bs not in s.block_sizes:
    raise ConfigError(f'pool.block_size={bs} is not in config.block_overhead.block_sizes='
                      f'{tuple(s.block_sizes)}: add it there to time the kernel at it')
  m = measure(config.attention.impl, model_cfg.num_heads, model_cfg.num_kv_heads,
              model_cfg.head_dim, model_cfg.dtype, context=s.context, batch=s.batch,
              block_sizes=tuple(s.block_sizes), rounds=s.rounds)
  host = measure_step_inputs(context=s.context, batch=s.batch, block_sizes=tuple(s.block_sizes),
                             rounds=s.rounds)
  steps_fit = m['steps_fit'] or (None, None, None)
  return dict(attention_impl_timed=m['impl'], attention_context=s.context,
              attention_batch=s.batch, attention_blocks_read=m['blocks_read'][bs],
              attention_loop_steps=m['loop_steps'][bs], attention_s=m['seconds'][bs],
              attention_fixed_s=m['fixed_s'], attention_s_per_block=m['s_per_block'],
              attention_steps_fit_fixed_s=steps_fit[0],
              attention_steps_fit_s_per_block=steps_fit[1],
              attention_steps_fit_s_per_loop_step=steps_fit[2],
              step_inputs_call_s=host['seconds'][bs], step_inputs_fixed_s=host['fixed_s'],
              step_inputs_s_per_entry=host['s_per_entry'])
