"""The native CPU linear-layer kernel against XLA's dots on a decode step's matmul shapes.

  python -m experiments.bench_linear --config=configs/bench_linear.py --workdir=runs/bench_linear
  python -m experiments.bench_linear --config=configs/bench_linear.py --config.bench.baseline=REV --workdir=runs/bench_linear
  python -m experiments.bench_linear --config=configs/bench_linear.py:tiny --workdir=/tmp/bench_linear

For every (rows, shape) of `config.bench` (configs/bench_linear.py) the variants
  kernel    linear_cpu.kernel (kernels/linear_cpu.py), this tree's build, W read in place
  packed    the same kernel reading W from linear_cpu.pack's copy (packed once, before the
            rounds; the transposed head packed as its transpose)
  baseline  the same kernel built from bench.baseline's sources (a git revision), if given
  xla       XLA's dot (jnp.dot; the transposed head as x @ w.T, as linear_impl='xla' runs it)
run on x [rows, K] through enough distinct copies of W to hold bench.min_bytes (W from DRAM,
as in a decode step), outputs summed, after a check that each matches a float64 oracle. Rounds
call every variant once in a rotating order, so load from other processes hits all alike;
per variant the median time, W's bytes read per second and GFLOP/s, and the median over rounds
of its time over the kernel's (`over_kernel`: above 1 = slower than the kernel). `step` adds the
shapes' medians weighted by how many of each a decode step runs (per_step): the step's matmul
time per variant. Nothing here asserts a time.

Writes DIR/summary.json (figures, the config, versions, git state, load), DIR/results.csv (one
row per rows, shape and variant), DIR/table.md and DIR/bench_linear.png (the step's matmul time
and weight bandwidth per variant against the rows).
"""
import ctypes
import functools
import os
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli
from experiments import plots
from pagedjax.config import ConfigError
from pagedjax.kernels import cpu, linear_cpu
from pagedjax.studies import run_info

BASELINE_TARGET = 'pagedjax_linear_cpu_baseline'
COLUMNS = ('rows', 'shape', 'K', 'N', 'transposed', 'copies', 'variant', 'ms', 'w_gbs', 'gflops',
           'over_kernel')


def check(config):
  """config.bench's fields (ConfigError naming the field, the value and what is allowed)."""
  cli.check_fields(config, 'bench', rows=cli.list_of(cli.POSITIVE_INT),
                   min_bytes=cli.POSITIVE_INT, rounds=cli.POSITIVE_INT,
                   baseline=(lambda v: isinstance(v, str), 'a git revision, or "" for none'))
  shapes = config.bench.shapes
  good = lambda s: (len(s) == 5 and isinstance(s[0], str) and isinstance(s[3], bool) and all(
      isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (s[1], s[2], s[4])))
  if not shapes or not all(isinstance(s, (tuple, list)) and good(s) for s in shapes):
    raise ConfigError(f'config.bench.shapes={shapes!r} is not allowed: a non-empty tuple of '
                      '(name, K, N, transposed, per_step) with K, N, per_step integers >= 1')
  if not linear_cpu.available():
    raise ConfigError(f'the native linear kernel is unavailable: {linear_cpu.unavailable_reason()}')


def build_baseline(revision: str, workdir: str):
  """The kernel's sources at a git revision, compiled like this tree's (cpu.CXXFLAGS) into
  workdir and registered as BASELINE_TARGET; returns the library's path."""
  root = subprocess.run(['git', 'rev-parse', '--show-toplevel'], capture_output=True, text=True,
                        check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
  commit = subprocess.run(['git', 'rev-parse', '--short', revision], capture_output=True,
                          text=True, cwd=root)
  if commit.returncode:
    raise ConfigError(f'config.bench.baseline={revision!r} is not allowed: not a git revision '
                      f'of {root}')
  src = tempfile.mkdtemp(prefix='linear_baseline_', dir=workdir)
  for name in linear_cpu.SOURCES:
    text = subprocess.run(['git', 'show', f'{revision}:kernels/csrc/{name}'], capture_output=True,
                          check=True, cwd=root).stdout
    with open(os.path.join(src, name), 'wb') as f:
      f.write(text)
  path = os.path.join(workdir, f'linear_cpu_{commit.stdout.strip()}.so')
  subprocess.run([os.environ.get('CXX', 'g++'), *cpu.CXXFLAGS, '-isystem', jax.ffi.include_dir(),
                  os.path.join(src, linear_cpu.SOURCES[0]), '-o', path], check=True)
  lib = ctypes.cdll.LoadLibrary(path)
  jax.ffi.register_ffi_target(BASELINE_TARGET, jax.ffi.pycapsule(lib.LinearCpu), platform='cpu')
  return path


def baseline_kernel(x, w, *, transposed):
  n = w.shape[0] if transposed else w.shape[1]
  call = jax.ffi.ffi_call(BASELINE_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                          vmap_method='sequential')
  return call(x, w, transposed=np.int64(bool(transposed)))


def packed_kernel(x, w, *, transposed):
  del transposed  # pack took care of it
  return linear_cpu.kernel(x, w)


def xla_dot(x, w, *, transposed):
  return jnp.dot(x, w.T if transposed else w)


def chained(matmul, transposed):
  """x through every copy of W (each its own argument: a slice of one stacked array would be
  copied before the call), outputs summed."""
  def fn(x, *ws):
    return sum(matmul(x, w, transposed=transposed) for w in ws)
  return jax.jit(fn)


def measure(bench, rows, shape, variants):
  """One (rows, shape): check every variant against float64, then the interleaved rounds ->
  figures."""
  name, k, n, transposed, _ = shape
  copies = max(1, -(-int(bench.min_bytes) // (4 * k * n)))
  rng = np.random.default_rng(bench.seed)
  x = rng.standard_normal((rows, k), np.float32)
  ws = rng.standard_normal((copies, n, k) if transposed else (copies, k, n), np.float32)
  x64, w64 = x.astype(np.float64), [(w.T if transposed else w).astype(np.float64) for w in ws]
  want = sum(x64 @ w for w in w64)
  bound = sum(np.abs(x64) @ np.abs(w) for w in w64)  # float32 rounding scales with this
  del w64
  x, ws = jnp.asarray(x), [jnp.asarray(w) for w in ws]
  fns = {}
  for variant, matmul in variants.items():
    fn = chained(matmul, transposed)
    operands = ([linear_cpu.pack(w, transposed=transposed) for w in ws] if variant == 'packed'
                else ws)
    err = np.abs(np.asarray(fn(x, *operands), np.float64) - want)
    if not np.all(err <= 1e-5 * bound + 1e-30):  # a benchmark of a wrong kernel is worthless
      raise RuntimeError(f'{variant} differs from the float64 oracle by {err.max()} at {rows} x '
                         f'{name}')
    fns[variant] = functools.partial(fn, x, *operands)
  rounds = cli.time_rounds(fns, bench.rounds)
  w_bytes, flops = 4 * copies * k * n, 2 * rows * copies * k * n
  kernel = np.asarray(rounds['kernel'])
  out = []
  for variant, times in rounds.items():
    t = float(np.median(times))
    out.append(dict(rows=rows, shape=name, K=k, N=n, transposed=transposed, copies=copies,
                    variant=variant, ms=t * 1e3 / copies, w_gbs=w_bytes / t / 1e9,
                    gflops=flops / t / 1e9,
                    over_kernel=float(np.median(np.asarray(times) / kernel))))
  return out


def step_bandwidth(bench, step_ms: dict) -> dict:
  """rows -> variant -> W's bytes read per second over a whole step's matmuls (GB/s)."""
  step_bytes = sum(s[1] * s[2] * 4 * s[4] for s in bench.shapes)
  return {rows: {v: step_bytes / (ms * 1e-3) / 1e9 for v, ms in per.items()}
          for rows, per in step_ms.items()}


def plot(path, step_ms: dict, step_gbs: dict, title_note: str = '') -> None:
  """Per variant against the rows: the step's matmul time (left, log axes) and its weights'
  read bandwidth (right)."""
  plt = plots.pyplot()
  rows = sorted(step_ms)
  variants = list(dict.fromkeys(v for per in step_ms.values() for v in per))
  fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), layout='constrained')
  for name in variants:
    axes[0].plot(rows, [step_ms[r][name] for r in rows], 'o-', label=name)
    axes[1].plot(rows, [step_gbs[r][name] for r in rows], 'o-', label=name)
  plots.log_x(axes[0], rows)
  plots.log_y(axes[0], [ms for per in step_ms.values() for ms in per.values()])
  plots.log_x(axes[1], rows)
  axes[1].set_ylim(bottom=0)
  axes[0].set_ylabel("a decode step's matmuls, median (ms)")
  axes[1].set_ylabel("weights read per second over the step (GB/s)")
  for ax in axes:
    plots.plain_ticks(ax, rows)
    ax.set_xlabel('rows (sequences in the decode call)')
  axes[0].set_title('Matmul time per decode step' + title_note)
  axes[1].set_title('Weight read bandwidth' + title_note)
  plots.legend_below(axes[0], ncol=len(variants))
  plots.save(fig, path)


def study(config, workdir):
  bench = config.bench
  variants = {'kernel': linear_cpu.kernel, 'packed': packed_kernel}
  baseline_library = None
  if bench.baseline:
    baseline_library = build_baseline(bench.baseline, workdir)
    variants['baseline'] = baseline_kernel
  variants['xla'] = xla_dot
  rows_out, step = [], {}
  for rows in bench.rows:
    for shape in bench.shapes:
      results = measure(bench, int(rows), tuple(shape), variants)
      rows_out += results
      cli.say(f'rows {rows} {shape[0]} ({shape[1]} x {shape[2]}'
              f'{", [N, K]" if shape[3] else ""}): ' + '  '.join(
                  f'{r["variant"]} {r["ms"]:.3f} ms {r["w_gbs"]:.1f} GB/s '
                  f'{r["gflops"]:.0f} GFLOP/s (x{r["over_kernel"]:.2f})' for r in results))
      for r in results:
        step.setdefault(rows, {}).setdefault(r['variant'], 0.0)
        step[rows][r['variant']] += r['ms'] * shape[4]
  table = ['| rows | variant | ' + ' | '.join(s[0] for s in bench.shapes)
           + ' | step ms (per_step-weighted) | step over kernel |',
           '|---' * (len(bench.shapes) + 4) + '|']
  for rows in bench.rows:
    for variant in variants:
      cells = [f'{r["w_gbs"]:.1f} GB/s, x{r["over_kernel"]:.2f}' for r in rows_out
               if r['rows'] == rows and r['variant'] == variant]
      ms = step[rows][variant]
      table.append(f'| {rows} | {variant} | ' + ' | '.join(cells) +
                   f' | {ms:.2f} | {ms / step[rows]["kernel"]:.2f} |')
  cli.write_table(workdir, '\n'.join(table) + '\n\nGB/s = W bytes read per second; xR = time '
                  'over the kernel\'s, median of per-round ratios' + cli.variant_note(config))
  step_gbs = step_bandwidth(bench, step)
  plot(os.path.join(workdir, 'bench_linear.png'), step, step_gbs,
       ' (tiny variant)' if cli.variant(config) != 'full' else '')
  summary = dict(results=rows_out, step_ms={str(r): v for r, v in step.items()},
                 step_w_gbs={str(r): v for r, v in step_gbs.items()},
                 avx2=linear_cpu.uses_avx2(), baseline_library=baseline_library,
                 load_average_1m=os.getloadavg()[0], **run_info.summary_fields(config))
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  run_info.write_csv(os.path.join(workdir, 'results.csv'), rows_out, COLUMNS)
  return summary


if __name__ == '__main__':
  cli.run_study('configs/bench_linear.py', 'Linear-kernel benchmark config.', study, check=check)
