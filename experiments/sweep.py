"""Run every point of a config's sweep, skipping points already done; tabulate and plot.

  python -m experiments.sweep --config=configs/ablate_block_size.py --workdir=runs/block_size
  python -m experiments.sweep --config=configs/ablate_block_size.py:tiny --workdir=/tmp/bs

A sweep config is an experiment config plus
  config.job    the per-point job: a key of experiments.jobs.JOBS or 'package.module:function'
  config.sweep  a list of points, each a dict of dotted overrides of the base config, e.g.
                {'pool.block_size': 16, 'pool.num_blocks': 1025}
  config.plot   (optional) x: a swept key; y: figures to plot, one panel each (or a list of
                such lists: one row of panels each); group: a swept key drawn as separate
                lines; logx: bool; logy: figures drawn on a log scale
Each point is the base config with its overrides applied, validated, then run; its row (the
overrides, then the job's figures) is appended to WORKDIR/results.jsonl the moment it is done,
so an interrupted sweep resumes where it stopped: a rerun skips every point whose overrides and
base config (everything but sweep and plot) match a stored row. Afterwards it writes
results.csv and summary.json (all rows, in sweep order) and, with config.plot, plot.png.
Each point's job may leave files in WORKDIR/points/<name>/.

A run holds WORKDIR/.lock (flock) from start to exit: a second sweep on the same workdir is
refused, naming it, instead of interleaving rows. Rows are appended flushed and fsynced; a line a
kill tore (or any line that is not a whole row) is dropped with one warning and its point run
again. results.csv, summary.json and plot.png are replaced atomically.
"""
import hashlib
import json
import os
import re
from typing import Callable, List, Optional, Tuple

from absl import flags
from absl import logging
import tqdm

from experiments import cli
from experiments import jobs
from pagedjax import run_info
from pagedjax.config import Config, ConfigError, validate_config

SWEEP_FIELDS = ('sweep', 'plot')


def base_config(config):
  """The config without its sweep description: what every point starts from."""
  base = config.copy_and_resolve_references()
  with base.unlocked():
    for name in SWEEP_FIELDS:
      if name in base:
        del base[name]
  return base


def config_hash(config) -> str:
  text = json.dumps(base_config(config).to_dict(), sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def point_key(point: dict) -> str:
  return json.dumps(point, sort_keys=True)


def point_name(point: dict) -> str:
  """A directory name for a point: 'pool.block_size=16,pool.num_blocks=1025'."""
  return re.sub(r'[^A-Za-z0-9_.=,+-]', '_', ','.join(f'{k}={v}' for k, v in point.items()))


def apply_point(config, point: dict):
  """The base config with the point's dotted overrides; unknown fields are an error."""
  cfg = base_config(config)
  for dotted, value in point.items():
    *path, leaf = dotted.split('.')
    node = cfg
    for name in path:
      if name not in node:
        raise ConfigError(f'sweep point {point}: config has no field {dotted!r}')
      node = node[name]
    if leaf not in node:
      raise ConfigError(f'sweep point {point}: config has no field {dotted!r}')
    node[leaf] = value
  return cfg


def _is_row(row) -> bool:
  """A whole row: its point key, its config hash, and the point's overrides as its fields."""
  if not isinstance(row, dict) or not isinstance(row.get('point'), str) or (
      not isinstance(row.get('config_hash'), str)):
    return False
  try:
    point = json.loads(row['point'])
  except ValueError:
    return False
  return isinstance(point, dict) and all(k in row and row[k] == v for k, v in point.items())


def load_rows(path: str) -> Tuple[List[dict], bool]:
  """(the whole rows of results.jsonl, whether the file must be rewritten before appending).

  A line that does not parse as a whole row (a kill mid-append tears the last one) is dropped,
  so its point runs again; so is a last line without its newline, which the next append would
  run into.
  """
  if not os.path.exists(path):
    return [], False
  with open(path, 'rb') as f:
    data = f.read()
  rows, dropped = [], 0
  for line in data.split(b'\n'):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except ValueError:  # torn, garbled or not UTF-8
      row = None
    if _is_row(row):
      rows.append(row)
    else:
      dropped += 1
  if dropped:
    logging.warning('%s: dropped %d line(s) that are not whole rows (a write torn by a kill, or '
                    'damage); their points run again', path, dropped)
  return rows, bool(dropped) or (bool(data) and not data.endswith(b'\n'))


def write_rows(path: str, rows: List[dict]) -> None:
  """results.jsonl rewritten atomically with these rows."""
  with run_info.atomic_write(path) as f:
    for row in rows:
      f.write(json.dumps(row, default=str) + '\n')


def append_row(path: str, row: dict) -> None:
  """One row, on disk before the next point starts: a kill loses at most the running point."""
  with open(path, 'a') as f:
    f.write(json.dumps(row, default=str) + '\n')
    f.flush()
    os.fsync(f.fileno())


def run_sweep(config, workdir: str, job: Optional[Callable] = None) -> List[dict]:
  """Runs the missing points; returns every point's row in sweep order."""
  points = [dict(p) for p in config.sweep]
  if not points:
    raise ConfigError('config.sweep is empty: list at least one point of dotted overrides')
  job = job or jobs.get_job(config.get('job'))
  configs = [validate_config(apply_point(config, p)) for p in points]  # fail before any run
  for cfg in configs:
    cli.check_model_path(Config.from_configdict(cfg))
  with cli.lock_workdir(workdir, 'sweep'):
    results = os.path.join(workdir, 'results.jsonl')
    stored, rewrite = load_rows(results)
    if rewrite:
      write_rows(results, stored)
    digest = config_hash(config)
    done = {r['point']: r for r in stored if r['config_hash'] == digest}
    todo = [(p, c) for p, c in zip(points, configs) if point_key(p) not in done]
    if len(todo) < len(points):
      print(f'{len(points) - len(todo)} of {len(points)} points already in {results}: skipped')
    for point, cfg in tqdm.tqdm(todo, desc='sweep', unit='point'):
      figures = job(cfg, os.path.join(workdir, 'points', point_name(point)))
      row = {'point': point_key(point), 'config_hash': digest, **point, **figures}
      append_row(results, row)
      done[row['point']] = row
    rows = [done[point_key(p)] for p in points]
    run_info.write_csv(os.path.join(workdir, 'results.csv'), rows)
    if config.get('plot'):
      plot(os.path.join(workdir, 'plot.png'), rows, config.plot)
    run_info.write_json(os.path.join(workdir, 'summary.json'), {
        'job': config.get('job'), 'points': len(points), 'config_hash': digest, 'rows': rows,
        'config': config.to_dict(), **run_info.environment()})
  return rows


def plot(path: str, rows: List[dict], spec) -> None:
  """One panel per figure in spec.y against spec.x, a line per value of spec.group; a spec.y of
  lists draws one row of panels per list."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  grid = [list(y) for y in spec.y] if all(isinstance(y, (list, tuple)) for y in spec.y) else [
      list(spec.y)]
  width = max(len(ys) for ys in grid)
  logy = set(spec.get('logy') or ())
  group = spec.get('group')
  fig, axes = plt.subplots(len(grid), width, figsize=(4.5 * width, 3.6 * len(grid)),
                           squeeze=False)
  groups = sorted({r.get(group) for r in rows}, key=str) if group else [None]
  panels = [(axes[i][j], y) for i, ys in enumerate(grid) for j, y in enumerate(ys)]
  for i, ys in enumerate(grid):  # rows shorter than the widest leave their last panels empty
    for ax in axes[i][len(ys):]:
      ax.axis('off')
  for ax, y in panels:
    for g in groups:
      sel = [r for r in rows if group is None or r.get(group) == g]
      pts = sorted((r[spec.x], r[y]) for r in sel if r.get(y) is not None)
      if pts:
        ax.plot(*zip(*pts), marker='o', label=None if g is None else f'{group}={g}')
    if spec.get('logx'):
      ax.set_xscale('log', base=2)
    if y in logy:
      ax.set_yscale('log')
    ax.set_xlabel(spec.x)
    ax.set_title(y)
    ax.grid(alpha=0.3)
    if group:
      ax.legend()
  fig.tight_layout()
  with run_info.atomic_write(path, 'wb') as f:
    fig.savefig(f, format='png', dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  config = flags.FLAGS.config
  workdir = cli.prepare_workdir(flags.FLAGS.workdir)  # the points are checked in run_sweep
  rows = run_sweep(config, workdir)
  print(f'{len(rows)} points: {workdir}/results.jsonl, results.csv, summary.json')


if __name__ == '__main__':
  # Defined here, not at import, so other entry points (reproduce_memory) can use run_sweep.
  cli.define_flags(None, 'Sweep config.', lock_config=False)
  cli.run(main)
