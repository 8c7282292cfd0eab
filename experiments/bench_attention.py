"""Paged attention paths vs attention over a contiguous cache holding the same tokens.

  python -m experiments.bench_attention --workdir=runs/bench_attention           # full
  python -m experiments.bench_attention --workdir=runs/bench_attention --quick   # ~1 min

For each (context, dtype) the run builds one paged pool (shuffled block table, block 0 the null
block) and contiguous copies of the same K/V, then times, interleaved round by round so that
load from other processes hits every variant alike:
  contiguous_dense  einsum + masked softmax over [B, Hkv, S, D]
  contiguous_flash  the online-softmax loop over [B, S/bs, Hkv, bs, D] (no indirection)
  <impl>            every paged path that runs natively on this backend
plus this machine's memory bandwidth (read-only sum, and an in-place donated copy), timed in the
same rounds. Figures are medians over rounds. `paged_over_contiguous` divides the best paged
path by the best contiguous variant; `bandwidth_fraction` is the K/V bytes the best paged path
reads per second over the copy bandwidth (bytes read + written per second). Nothing here
asserts a time.

Writes DIR/summary.json (figures, flags, versions, device, git revision) and DIR/results.jsonl
(one row per variant and shape).
"""
import functools
import importlib
import json
import os
import platform
import subprocess
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import kernels
import kernels.xla
from experiments import cli

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Output directory.', required=True)
flags.DEFINE_bool('quick', False, 'Small shapes and few rounds (a smoke run).')
flags.DEFINE_integer('batch', 32, 'Sequences.')
flags.DEFINE_integer('num_kv_heads', 8, 'KV heads.')
flags.DEFINE_integer('num_heads', 32, 'Query heads.')
flags.DEFINE_integer('head_dim', 64, 'Head dim.')
flags.DEFINE_integer('block_size', 64, 'Tokens per block.')
flags.DEFINE_list('contexts', ['1024', '8192'], 'Context lengths (tokens per sequence).')
flags.DEFINE_list('dtypes', ['float32', 'bfloat16'], 'Pool and query dtypes.')
flags.DEFINE_list('impls', None, 'Paged paths to time (default: all native to the backend).')
flags.DEFINE_integer('rounds', 15, 'Timed rounds; each round calls every variant once.')

NATIVE = {
    'cpu': ('reference', 'xla'),
    'gpu': ('reference', 'xla', 'pallas_gpu', 'triton'),
    'tpu': ('reference', 'xla', 'pallas_tpu'),
}


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
  """fns: name -> zero-arg callable. Median seconds per name over rounds that call every
  variant once, in an order rotated each round (a variant timed right after one that freed
  a large buffer pays for it; rotating spreads that over all)."""
  for fn in fns.values():
    jax.block_until_ready(fn())  # compile + warm up
  names = list(fns)
  times = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      t0 = time.perf_counter()
      jax.block_until_ready(fns[name]())
      times[name].append(time.perf_counter() - t0)
  return {name: float(np.median(t)) for name, t in times.items()}


def git_revision():
  try:
    return subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True,
                          check=True, cwd=os.path.dirname(__file__)).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None


def main(argv):
  cli.quiet_libraries(argv)  # results, not jax's backend-probing log lines
  os.makedirs(FLAGS.workdir, exist_ok=True)
  backend = jax.default_backend()
  contexts = [int(c) for c in FLAGS.contexts]
  batch, rounds = FLAGS.batch, FLAGS.rounds
  if FLAGS.quick:
    contexts, batch, rounds = [min(contexts[0], 512)], min(batch, 8), min(rounds, 5)
  impls = FLAGS.impls or [i for i in NATIVE.get(backend, ('reference', 'xla'))
                          if i != 'triton' or _has_jax_triton()]
  dims = (batch, FLAGS.num_kv_heads, FLAGS.num_heads, FLAGS.head_dim, FLAGS.block_size)

  figures, rows = {}, []
  # At least 256 MiB, far past the 32 MiB L3, so this is DRAM and not cache bandwidth.
  memory = MemoryTraffic(max(2**28, 2 * batch * max(contexts) * FLAGS.num_kv_heads *
                             FLAGS.head_dim * 4))
  for context in contexts:
    for dtype_name in FLAGS.dtypes:
      dtype = jnp.dtype(dtype_name)
      x = make_inputs(*dims, context, dtype)
      paged = (x['q'], x['k_blocks'], x['v_blocks'], x['block_tables'], x['context_lens'],
               x['q_positions'])
      fns = {
          'contiguous_dense': functools.partial(jax.jit(contiguous_dense), x['q'], x['k4'],
                                                x['v4'], x['context_lens']),
          'contiguous_flash': functools.partial(jax.jit(contiguous_flash), x['q'], x['k5'],
                                                x['v5'], x['context_lens']),
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
      times = time_interleaved(fns, rounds)
      if slow:
        times.update(time_interleaved(slow, max(3, rounds // 3)))
      read_gbs, copy_gbs = memory.gbs(times)
      times = {name: t for name, t in times.items() if not name.startswith('mem_')}
      kv_bytes = x['k4'].nbytes + x['v4'].nbytes
      best_contig = min(('contiguous_dense', 'contiguous_flash'), key=times.get)
      paged_impls = [i for i in impls if i != 'reference'] or impls
      best = min(paged_impls, key=times.get)
      key = f'ctx{context}_{dtype_name}'
      figures[key] = dict(
          context=context, dtype=dtype_name, best_paged=best, best_contiguous=best_contig,
          paged_over_contiguous=times[best] / times[best_contig],
          copy_gbs=copy_gbs, read_gbs=read_gbs,
          achieved_read_gbs=kv_bytes / times[best] / 1e9,
          bandwidth_fraction=kv_bytes / times[best] / 1e9 / copy_gbs,
          read_bandwidth_fraction=kv_bytes / times[best] / 1e9 / read_gbs,
          ms={name: t * 1e3 for name, t in times.items()},
          over_best_contiguous={name: t / times[best_contig] for name, t in times.items()})
      for name, t in times.items():
        rows.append(dict(context=context, dtype=dtype_name, variant=name, ms=t * 1e3,
                         kv_gbs=kv_bytes / t / 1e9, over_best_contiguous=t / times[best_contig]))
      print(f'{key}: ' + '  '.join(f'{n} {t * 1e3:.2f}ms' for n, t in times.items()) +
            f'  | best {best} {figures[key]["paged_over_contiguous"]:.2f}x {best_contig}, '
            f'{figures[key]["bandwidth_fraction"]:.0%} of copy bandwidth ({copy_gbs:.1f} GB/s; '
            f'read {read_gbs:.1f} GB/s)', flush=True)
      del x, fns

  summary = dict(
      figures=figures, memory_traffic_bytes=memory.nbytes,
      flags=dict(batch=batch, num_kv_heads=FLAGS.num_kv_heads, num_heads=FLAGS.num_heads,
                 head_dim=FLAGS.head_dim, block_size=FLAGS.block_size, contexts=contexts,
                 dtypes=FLAGS.dtypes, impls=impls, rounds=rounds, quick=FLAGS.quick),
      versions=dict(jax=jax.__version__, numpy=np.__version__, python=platform.python_version()),
      device=dict(backend=backend, kind=jax.devices()[0].device_kind, cpus=os.cpu_count(),
                  xla_flags=os.environ.get('XLA_FLAGS', '')),
      git_revision=git_revision())
  with open(os.path.join(FLAGS.workdir, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  with open(os.path.join(FLAGS.workdir, 'results.jsonl'), 'w') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')
  print(f'wrote {FLAGS.workdir}/summary.json')


def _has_jax_triton():
  try:
    importlib.import_module('jax_triton')
  except Exception:  # pylint: disable=broad-except  # a mismatched jax raises more than ImportError
    return False
  return True


if __name__ == '__main__':
  app.run(main)
