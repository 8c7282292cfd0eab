"""Run every point of a config's sweep, skipping points already done; tabulate and plot.

  python -m experiments.sweep --config=configs/ablate_block_size.py --workdir=runs/block_size
  python -m experiments.sweep --config=configs/ablate_block_size.py:tiny --workdir=/tmp/bs

A sweep config is an experiment config plus
  config.job    the per-point job: a key of experiments.jobs.JOBS or 'package.module:function'
  config.sweep  a list of points, each a dict of dotted overrides of the base config, e.g.
                {'pool.block_size': 16, 'pool.num_blocks': 1025}
  config.plot   (optional) x: a swept key or a figure; y: figures to plot, one panel each
                (or a list of such lists: one row of panels each, row_titles naming the
                rows); logx: bool; logy: figures drawn on a log scale. Points that differ in
                swept fields other than x (and fields x fixes) are separate series, each
                named by every such field (group: the one to name first)
  config.title, config.table_columns (optional): the plot's title; the printed table's figures
Each point is the base config with its overrides applied, validated, then run; its row (the
overrides, then the job's figures) is appended to WORKDIR/results.jsonl the moment it is done,
so an interrupted sweep resumes where it stopped: a rerun skips every point whose overrides and
base config (everything but sweep and plot) match a stored row. Afterwards it writes
results.csv (one column per swept field, then one per figure; no duplicates), table.md (printed
too) and summary.json (all rows, in sweep order) and, with config.plot, plot.png.
Each point's job may leave files in WORKDIR/points/<name>/. A command-line override of a swept
field (--config.pool.block_size=32 on the block-size sweep) is refused: every point would
replace it.

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

from absl import logging

from experiments import cli
from experiments import jobs
from experiments import plots
from pagedjax.studies import run_info
from pagedjax.config import Config, ConfigError
from pagedjax.studies.workloads import validate_config

SWEEP_FIELDS = ('sweep', 'plot')
ROW_KEYS = ('point', 'config_hash')  # resume bookkeeping of results.jsonl, not figures


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
    for point, cfg in cli.progress(todo, desc='sweep', unit='point'):
      figures = job(cfg, os.path.join(workdir, 'points', point_name(point)))
      row = {'point': point_key(point), 'config_hash': digest, **point, **figures}
      append_row(results, row)
      done[row['point']] = row
    rows = [done[point_key(p)] for p in points]
    run_info.write_csv(os.path.join(workdir, 'results.csv'), rows, csv_columns(rows, points))
    if config.get('plot'):
      plot(os.path.join(workdir, 'plot.png'), rows, config.plot,
           config.get('title', 'sweep') + cli.variant_note(config), swept_fields(points))
    run_info.write_json(os.path.join(workdir, 'summary.json'), {
        'job': config.get('job'), 'points': len(points), 'config_hash': digest, 'rows': rows,
        **run_info.summary_fields(config)})
  return rows


def swept_fields(points) -> list:
  """The dotted fields the points set, in first-seen order."""
  out = []
  for p in points:
    out += [k for k in dict(p) if k not in out]
  return out


def _duplicates(rows: list, field: str, key: str) -> bool:
  """Whether figure `key` only repeats swept `field` (the engine's `block_size` beside the
  point's `pool.block_size`, `pool_kind` beside `pool.kind`): same name, same value everywhere."""
  parts = field.split('.')
  names = {parts[-1], '_'.join(parts), '_'.join(parts[-2:])}
  return key in names and key != field and all(r.get(key) == r.get(field) for r in rows)


def csv_columns(rows: list, points) -> list:
  """One column per swept field, then each scalar figure once, in first-seen order; the resume
  bookkeeping (point, config_hash) and figures that repeat a swept field are left out."""
  swept = swept_fields(points)
  columns = list(swept)
  for row in rows:
    for key, value in row.items():
      if key in columns or key in ROW_KEYS or isinstance(value, (list, dict)):
        continue
      if not any(_duplicates(rows, field, key) for field in swept):
        columns.append(key)
  return columns


def table_columns(config, points) -> list:
  """The printed table: config.table_columns, else the swept fields and the plotted figures."""
  if config.get('table_columns'):
    return list(config.table_columns)
  columns = swept_fields(points)
  spec = config.get('plot') or {}
  ys = spec.get('y') or ()
  for y in ys:
    columns += [f for f in ([y] if isinstance(y, str) else y) if f not in columns]
  return columns


def series_fields(rows: List[dict], spec, swept) -> list:
  """The swept fields that name a plot's series: those whose value differs between points,
  except x and, when x is swept, the fields each x value fixes (the block-size sweep's
  num_blocks); spec.group first. With x a measured figure (bytes per token), every differing
  swept field names its points."""
  order = [spec.group] if spec.get('group') else []
  order += [f for f in swept if f not in order]
  return [f for f in plots.varying(rows, order) if f != spec.x and not (
      x_is_swept(rows, spec.x, swept) and plots.determined_by(rows, f, spec.x))]


def x_is_swept(rows: List[dict], x: str, swept) -> bool:
  """Whether x is a swept field, or a figure repeating one (the GQA sweep's num_kv_heads)."""
  return x in swept or any(_duplicates(rows, field, x) for field in swept)


def plot(path: str, rows: List[dict], spec, title: str = 'sweep', swept=()) -> None:
  """One panel per figure in spec.y against spec.x (a spec.y of lists: one row of panels per
  list, titled by spec.row_titles). Points differing in a swept field other than x (one x does
  not fix) are separate series; the legend names every such field."""
  plt = plots.pyplot()
  grid = [list(y) for y in spec.y] if all(isinstance(y, (list, tuple)) for y in spec.y) else [
      list(spec.y)]
  x, logy = spec.x, set(spec.get('logy') or ())
  fields = series_fields(rows, spec, swept)
  series = {}
  for r in rows:
    series.setdefault(plots.series_label(r, fields) if fields else None, []).append(r)
  width = max(len(ys) for ys in grid)
  fig = plt.figure(figsize=(4.2 * width, 3.5 * len(grid) + (0.5 if fields else 0)),
                   layout='constrained')
  subfigs = fig.subfigures(len(grid), 1, squeeze=False)[:, 0]
  row_titles = list(spec.get('row_titles') or ())
  xs = [r[x] for r in rows if r.get(x) is not None]
  handles = {}
  for i, (subfig, ys) in enumerate(zip(subfigs, grid)):
    axes = subfig.subplots(1, len(ys), squeeze=False)[0]
    if i < len(row_titles):
      subfig.suptitle(row_titles[i], fontsize=10, fontweight='bold')
    for ax, y in zip(axes, ys):
      factor, y_unit = plots.scaled(y, [r.get(y) for r in rows])
      for label, mine in series.items():
        pts = sorted((r[x], factor * r[y]) for r in mine
                     if r.get(y) is not None and r.get(x) is not None)
        if pts:
          (line,) = ax.plot(*zip(*pts), marker='o', ls='-' if len(pts) > 1 else 'none',
                            label=label)
          handles.setdefault(label, line)
      if x_is_swept(rows, x, swept):  # a setting: tick each value, plainly (log if asked)
        if spec.get('logx'):
          ax.set_xscale('log')
        if len(set(xs)) <= 12:
          plots.plain_ticks(ax, xs)
      elif spec.get('logx'):  # a measured figure: log where it spans a decade
        plots.log_x(ax, xs)
      if y in logy:
        plots.log_y(ax, [factor * r[y] for r in rows if r.get(y) is not None])
      elif all(r.get(y) is None or r[y] >= 0 for r in rows):
        ax.set_ylim(bottom=0)
      ax.set_title(plots.words(y), fontsize=9)
      ax.set_ylabel(y_unit)
      ax.set_xlabel(plots.axis(x))
      ax.grid(alpha=0.3)
  if fields:
    fig.legend(list(handles.values()), list(handles), loc='outside lower center',
               ncol=min(len(handles), 3), fontsize=8, frameon=False)
  fig.suptitle(title, fontsize=11)
  plots.save(fig, path)


def study(config, workdir: str) -> dict:
  """run_sweep, then the table of its rows printed and written to table.md."""
  rows = run_sweep(config, workdir)
  points = [dict(p) for p in config.sweep]
  table = run_info.markdown_table(rows, table_columns(config, points), digits=4)
  title = config.get('title', 'sweep') + cli.variant_note(config)
  cli.write_table(workdir, f'{title}\n\n{table}')
  return {'rows': rows}


def check(config) -> None:
  """Before the workdir: a command-line override of a swept field is refused (cli)."""
  if not config.get('sweep'):
    raise ConfigError('config.sweep is empty: list at least one point of dotted overrides')
  cli.refuse_swept_overrides(config)


if __name__ == '__main__':
  # Defined here, not at import, so other entry points (reproduce_memory) can use run_sweep.
  cli.run_study(None, 'Sweep config.', study, check=check)
