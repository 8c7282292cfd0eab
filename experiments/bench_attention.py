"""Paged attention paths vs attention over a contiguous cache holding the same tokens.

  python -m experiments.bench_attention --config=configs/bench_attention.py --workdir=runs/bench_attention
  python -m experiments.bench_attention --config=configs/bench_attention.py:tiny --workdir=/tmp/bench_attention

For each (context, dtype) of `config.bench` (configs/bench_attention.py) the run builds one paged
pool (shuffled block table, block 0 the null block) and contiguous copies of the same K/V, checks
every paged path against contiguous attention, then times, interleaved round by round so that
load from other processes hits every variant alike:
  contiguous_dense  einsum + masked softmax over [B, Hkv, S, D]
  contiguous_flash  the xla path's online-softmax loop over [B, S/bs, Hkv, bs, D] (no indirection)
  <impl>            every paged path in bench.impls (default: all that run natively here; on CPU
                    reference, xla, and cpu, the native kernel, where it builds)
plus this machine's memory bandwidth (read-only sum, and an in-place donated copy), timed in the
same rounds. Figures are medians over rounds. For every variant: its K/V read bandwidth (the
cache's bytes over its time) and that over the copy bandwidth (bytes read + written per second);
`paged_over_contiguous` divides the best paged path by the best contiguous variant. Nothing here
asserts a time.

Writes DIR/summary.json (figures per shape, the config, versions, device, git state),
DIR/results.csv (one row per variant and shape) and DIR/bench_attention.png.
"""
import functools
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import kernels
import pagedjax.kernels.xla  # noqa: F401  (sets kernels.xla)
from experiments import cli, plots
from pagedjax.studies import run_info
from pagedjax.config import ConfigError

NATIVE = {
    'cpu': ('reference', 'xla', 'cpu'),
    'gpu': ('reference', 'xla', 'pallas_gpu', 'triton'),
    'tpu': ('reference', 'xla', 'pallas_tpu'),
}
CONTIGUOUS = ('contiguous_dense', 'contiguous_flash')
DTYPES = ('float32', 'bfloat16')
COLUMNS = ('context', 'dtype', 'variant', 'ms', 'kv_gbs', 'share_of_copy', 'over_best_contiguous',
           'copy_gbs', 'read_gbs')


def contiguous_dense(q, k, v, context_lens):
  """q [B, 1, Hq, D]; k, v [B, Hkv, S, D]: one einsum per side, masked softmax."""
  batch, _, num_heads, head_dim = q.shape
  num_kv_heads, length = k.shape[1], k.shape[2]
  qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, -1, head_dim) * head_dim ** -0.5
  s = jnp.einsum('bhgd,bhsd->bhgs', qg, k.astype(jnp.float32))
  visible = (jnp.arange(length)[None, :] < context_lens[:, None])[:, None, None, :]
  p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
  out = jnp.einsum('bhgs,bhsd->bhgd', p, v.astype(jnp.float32))
  return out.reshape(batch, 1, num_heads, head_dim).astype(q.dtype)


def contiguous_flash(q, k, v, context_lens):
  """q [B, 1, Hq, D]; k, v [B, S/bs, Hkv, bs, D]: the xla path's loop, blocks by plain slicing,
  with the same split of the batch into independent loops (one per core)."""
  batch = q.shape[0]
  splits = min(kernels.xla._SEQ_SPLITS, batch)  # pylint: disable=protected-access
  bounds = [batch * i // splits for i in range(splits + 1)]
  return jnp.concatenate([_contiguous_flash(q[a:b], k, v, context_lens[a:b], a, b)
                          for a, b in zip(bounds[:-1], bounds[1:])], axis=0)


def _contiguous_flash(q, k, v, context_lens, first, last):
  """Sequences first..last-1 of the cache (sliced per block inside the loop: slicing the whole
  cache up front would copy it)."""
  batch, _, num_heads, head_dim = q.shape
  _, num_blocks, num_kv_heads, block_size, _ = k.shape
  qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, -1, head_dim) * head_dim ** -0.5

  # Same conversion as the xla path (kernels/xla.py): slice raw bits, widen in the loop; a plain
  # astype gets hoisted by XLA into a conversion of the whole cache per call.
  k_bits, v_bits = kernels.xla._as_bits(k), kernels.xla._as_bits(v)  # pylint: disable=protected-access
  to_f32 = kernels.xla._gather_block  # pylint: disable=protected-access

  def step(j, carry):
    m, l, acc = carry
    kb = to_f32(k_bits, slice(first, last), j, k.dtype)
    vb = to_f32(v_bits, slice(first, last), j, v.dtype)
    inb = (j * block_size + jnp.arange(block_size))[None, :] < context_lens[:, None]
    s = jnp.sum(qg[:, :, :, None, :] * kb[:, :, None], axis=-1)
    s = jnp.where(inb[:, None, None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.where(inb[:, None, None, :], jnp.exp(s - m_shift[..., None]), 0.0)
    alpha = jnp.exp(m - m_shift)
    pv = jnp.sum(p[..., None] * vb[:, :, None], axis=-2)
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

  shape = qg.shape[:3]
  init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(qg.shape))
  _, l, acc = jax.lax.fori_loop(0, num_blocks, step, init)
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]
  return out.reshape(batch, 1, num_heads, head_dim).astype(q.dtype)


def make_inputs(batch, num_kv_heads, num_heads, head_dim, block_size, context, dtype, seed=0):
  rng = np.random.default_rng(seed)
  blocks_per_seq = -(-context // block_size)
  num_blocks = batch * blocks_per_seq + 1  # + the null block
  shape = (num_blocks, num_kv_heads, block_size, head_dim)
  k_blocks = rng.standard_normal(shape, np.float32)
  v_blocks = rng.standard_normal(shape, np.float32)
  block_tables = rng.permutation(np.arange(1, num_blocks)).reshape(batch, blocks_per_seq)
  # Contiguous copies of the same tokens in both contiguous layouts.
  k5, v5 = k_blocks[block_tables], v_blocks[block_tables]  # [B, MB, Hkv, bs, D]
  k4 = k5.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, head_dim)
  v4 = v5.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, head_dim)
  context_lens = np.full((batch,), context, np.int32)
  as_dtype = lambda x: jnp.asarray(x, dtype)
  return dict(
      q=as_dtype(rng.standard_normal((batch, 1, num_heads, head_dim), np.float32)),
      k_blocks=as_dtype(k_blocks), v_blocks=as_dtype(v_blocks),
      block_tables=jnp.asarray(block_tables, jnp.int32),
      context_lens=jnp.asarray(context_lens),
      q_positions=jnp.asarray(context_lens[:, None] - 1),
      k4=as_dtype(k4), v4=as_dtype(v4), k5=as_dtype(k5), v5=as_dtype(v5))


class MemoryTraffic:
  """This machine's memory bandwidth over a buffer of `nbytes`, as two timed variants that run
  interleaved with the kernels (the same load hits both; a figure taken once at start-up swung
  from 59 to 112 GB/s between runs here): `read` sums the buffer, `copy` adds one to it in
  place (donated), reading and writing every byte."""

  def __init__(self, nbytes):
    self.nbytes = nbytes
    self.x = jnp.ones((nbytes // 4,), jnp.float32)
    self._sum = jax.jit(jnp.sum)
    self._add = jax.jit(lambda x: x + 1.0, donate_argnums=0)

  def read(self):
    return self._sum(self.x)

  def copy(self):
    self.x = self._add(self.x)
    return self.x

  def gbs(self, times):
    """(read GB/s, copy GB/s counting bytes read + written) from time_interleaved's medians."""
    return self.nbytes / times['mem_read'] / 1e9, 2 * self.nbytes / times['mem_copy'] / 1e9


def time_interleaved(fns, rounds):
  """fns: name -> zero-arg callable. Median seconds per name over cli.time_rounds' rotated
  rounds."""
  return {name: float(np.median(t)) for name, t in cli.time_rounds(fns, rounds).items()}


# ------------------------------------------------------------------------------------------------
# The study
# ------------------------------------------------------------------------------------------------
def native_impls(backend):
  """The paged paths that run un-interpreted on `backend` (kernels.runs_on; triton also needs
  jax_triton to import)."""
  return [i for i in NATIVE.get(backend, ('reference', 'xla'))
          if kernels.runs_on(i, backend) and (i != 'triton' or _has_jax_triton())]


def check(config):
  """config.bench's fields (ConfigError naming the field, the value and what is allowed)."""
  bench = config.get('bench')
  if bench is None:
    raise ConfigError('config.bench is missing: use configs/bench_attention.py')
  for name in ('batch', 'num_kv_heads', 'num_heads', 'head_dim', 'block_size', 'rounds',
               'memory_bytes'):
    value = bench[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ConfigError(f'config.bench.{name}={value!r} is not allowed: an integer >= 1')
  if bench.num_heads % bench.num_kv_heads:
    raise ConfigError(f'config.bench.num_heads={bench.num_heads} is not allowed: a multiple of '
                      f'num_kv_heads={bench.num_kv_heads}')
  contexts = tuple(bench.contexts)
  if not contexts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                         for c in contexts):
    raise ConfigError(f'config.bench.contexts={bench.contexts!r} is not allowed: a non-empty '
                      'tuple of token counts >= 1')
  if not tuple(bench.dtypes) or any(d not in DTYPES for d in bench.dtypes):
    raise ConfigError(f'config.bench.dtypes={bench.dtypes!r} is not allowed: a non-empty tuple '
                      f'of {DTYPES}')
  backend = jax.default_backend()
  for impl in bench.impls:
    if impl not in kernels.IMPLS or not kernels.runs_on(impl, backend):
      raise ConfigError(f'config.bench.impls has {impl!r}, which is not allowed on the {backend} '
                        f'backend: one of {tuple(native_impls(backend))}')


def measure(bench, context, dtype_name, impls, memory):
  """One shape: correctness against contiguous attention, then the interleaved rounds ->
  (figures, rows)."""
  dtype = jnp.dtype(dtype_name)
  backend = jax.default_backend()
  x = make_inputs(bench.batch, bench.num_kv_heads, bench.num_heads, bench.head_dim,
                  bench.block_size, context, dtype, seed=bench.seed)
  paged = (x['q'], x['k_blocks'], x['v_blocks'], x['block_tables'], x['context_lens'],
           x['q_positions'])
  fns = {
      'contiguous_dense': functools.partial(jax.jit(contiguous_dense), x['q'], x['k4'], x['v4'],
                                            x['context_lens']),
      'contiguous_flash': functools.partial(jax.jit(contiguous_flash), x['q'], x['k5'], x['v5'],
                                            x['context_lens']),
      'mem_read': memory.read,
      'mem_copy': memory.copy,
  }
  for impl in impls:
    fns[impl] = functools.partial(
        jax.jit(functools.partial(kernels.paged_attention, impl=impl)), *paged)
  ref = np.asarray(fns['contiguous_dense'](), np.float32)
  for impl in impls:  # a benchmark of a wrong kernel is worthless: check first
    err = float(np.max(np.abs(np.asarray(fns[impl](), np.float32) - ref)))
    # float32 on GPU/TPU may use TF32/bf16 passes in the contiguous einsums.
    tol = 2e-2 if dtype == jnp.bfloat16 else (1e-4 if backend == 'cpu' else 2e-3)
    if err > tol:
      raise RuntimeError(f'{impl} differs from contiguous attention by {err} at {context}')
  # The reference materialises the whole gathered cache; timed apart so that its large
  # allocations and frees do not land on the others.
  slow = {name: fns.pop(name) for name in ('reference',) if name in fns}
  times = time_interleaved(fns, bench.rounds)
  read_gbs, copy_gbs = memory.gbs(times)
  if slow:
    times.update(time_interleaved(slow, max(3, bench.rounds // 3)))
  times = {name: t for name, t in times.items() if not name.startswith('mem_')}
  kv_bytes = x['k4'].nbytes + x['v4'].nbytes
  best_contig = min(CONTIGUOUS, key=times.get)
  paged_impls = [i for i in impls if i != 'reference'] or impls
  best = min(paged_impls, key=times.get)
  kv_gbs = {name: kv_bytes / t / 1e9 for name, t in times.items()}
  figures = dict(
      context=context, dtype=dtype_name, kv_bytes=kv_bytes, best_paged=best,
      best_contiguous=best_contig, paged_over_contiguous=times[best] / times[best_contig],
      copy_gbs=copy_gbs, read_gbs=read_gbs,
      achieved_read_gbs=kv_gbs[best], bandwidth_fraction=kv_gbs[best] / copy_gbs,
      read_bandwidth_fraction=kv_gbs[best] / read_gbs,
      ms={name: t * 1e3 for name, t in times.items()},
      kv_gbs=kv_gbs, share_of_copy={name: g / copy_gbs for name, g in kv_gbs.items()},
      over_best_contiguous={name: t / times[best_contig] for name, t in times.items()})
  rows = [dict(context=context, dtype=dtype_name, variant=name, ms=t * 1e3, kv_gbs=kv_gbs[name],
               share_of_copy=kv_gbs[name] / copy_gbs, over_best_contiguous=t / times[best_contig],
               copy_gbs=copy_gbs, read_gbs=read_gbs)
          for name, t in times.items()]
  return figures, rows


def study(config, workdir):
  bench = config.bench
  backend = jax.default_backend()
  impls = list(bench.impls) or native_impls(backend)
  contexts = [int(c) for c in bench.contexts]
  kv_bytes = 2 * bench.batch * max(contexts) * bench.num_kv_heads * bench.head_dim * 4
  memory = MemoryTraffic(max(int(bench.memory_bytes), kv_bytes))
  figures, rows = {}, []
  for context in contexts:
    for dtype_name in bench.dtypes:
      key = f'ctx{context}_{dtype_name}'
      figures[key], shape_rows = measure(bench, context, dtype_name, impls, memory)
      rows += shape_rows
      f = figures[key]
      print(f'{key}: ' + '  '.join(f'{r["variant"]} {r["ms"]:.2f}ms ({r["share_of_copy"]:.0%})'
                                   for r in shape_rows) +
            f'  | best {f["best_paged"]} {f["paged_over_contiguous"]:.2f}x {f["best_contiguous"]}; '
            f'(%) = K/V GB/s over copy {f["copy_gbs"]:.1f} GB/s (read {f["read_gbs"]:.1f})',
            flush=True)
  cpu_kernel = None
  if 'cpu' in impls:
    from pagedjax.kernels import cpu  # pylint: disable=import-outside-toplevel
    cpu_kernel = dict(avx2=cpu.uses_avx2(), library=cpu.library_path())
  summary = dict(figures=figures, impls=impls, memory_traffic_bytes=memory.nbytes,
                 cpu_kernel=cpu_kernel, load_average_1m=os.getloadavg()[0],
                 xla_flags=os.environ.get('XLA_FLAGS', ''), **run_info.summary_fields(config))
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  run_info.write_csv(os.path.join(workdir, 'results.csv'), rows, COLUMNS)
  plot(os.path.join(workdir, 'bench_attention.png'), figures)
  return summary


def _shape_label(key: str) -> str:
  """'ctx1024_float32' -> '1024 tokens\nfloat32' (two short lines, so that labels never meet)."""
  context, dtype = key.split('_', 1)
  return f'{context[len("ctx"):]} tokens\n{dtype}'


def plot(path, figures):
  """Per shape: each variant's time (left) and its K/V read bandwidth next to the copy and read
  bandwidth of the same rounds (right). One legend under both panels names every bar and line."""
  plt = plots.pyplot()
  keys = list(figures)
  variants = list(dict.fromkeys(v for f in figures.values() for v in f['ms']))
  fig, axes = plt.subplots(1, 2, figsize=(max(9, 2.2 * len(keys) + 4), 4.2))
  width = 0.8 / len(variants)
  for i, name in enumerate(variants):
    at = [k + (i - (len(variants) - 1) / 2) * width for k in range(len(keys))]
    axes[0].bar(at, [figures[k]['ms'].get(name, np.nan) for k in keys], width, label=name)
    axes[1].bar(at, [figures[k]['kv_gbs'].get(name, np.nan) for k in keys], width)
  for k, key in enumerate(keys):
    for what, style, words in (('copy_gbs', '-', 'memory copy bandwidth (same rounds)'),
                               ('read_gbs', ':', 'memory read bandwidth (same rounds)')):
      axes[1].hlines(figures[key][what], k - 0.45, k + 0.45, colors='k', linestyles=style,
                     label=words if k == 0 else None)
  plots.log_y(axes[0], [t for f in figures.values() for t in f['ms'].values()])
  axes[0].set_ylabel('time per call, median over rounds (ms)')
  axes[1].set_ylim(bottom=0)
  axes[1].set_ylabel('K/V bytes read per second (GB/s)')
  for ax in axes:
    ax.set_xticks(range(len(keys)), [_shape_label(k) for k in keys])
    ax.set_xlabel('context and pool dtype')
    ax.set_xlim(-0.6, len(keys) - 0.4)
  axes[0].set_title('Decode attention: time per call')
  axes[1].set_title('K/V read bandwidth against the machine\'s')
  handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
  labels = [t for ax in axes for t in ax.get_legend_handles_labels()[1]]
  fig.legend(handles, labels, loc='upper center', bbox_to_anchor=(0.5, 0.0),
             ncol=min(7, len(labels)), fontsize=8, frameon=False)
  fig.tight_layout()
  plots.save(fig, path)


def _has_jax_triton():
  try:
    importlib.import_module('jax_triton')
  except Exception:  # pylint: disable=broad-except  # a mismatched jax raises more than ImportError
    return False
  return True


if __name__ == '__main__':
  cli.run_study('configs/bench_attention.py', 'Attention benchmark config.', study, check=check)
