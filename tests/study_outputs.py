"""What every study run must leave behind (experiments/cli.py run_config's shape), checked in one
place: the tests that run a study's `:tiny` pipeline call `run_tiny` or `check_outputs`."""
import contextlib
import csv
import glob
import io
import json
import os

from experiments import cli


def run_tiny(study, config, workdir, check=None, validate=True, **options):
  """cli.run_config in this process, stdout captured: (the study's result, stdout)."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    result = cli.run_config(study, config, str(workdir), check=check, validate=validate,
                            **options)
  return result, out.getvalue()


def check_outputs(workdir, stdout: str, variant: str = 'tiny', table: bool = True,
                  plots: int = 1) -> dict:
  """The shape every study run has: stdout says which variant ran, prints a markdown table
  (when `table`) and lists what it wrote; summary.json has the variant, config, versions, git
  state and machine load; every CSV has unique, flat columns; at least `plots` PNGs, each
  named in the list of files. Returns summary.json."""
  workdir = str(workdir)
  if variant != 'full':
    assert f'[{variant} variant' in stdout.splitlines()[0], stdout[:300]
  if table:
    assert '|---' in stdout, stdout[-2000:]
  listed = stdout[stdout.rindex('wrote ('):]
  with open(os.path.join(workdir, 'summary.json')) as f:
    summary = json.load(f)
  assert summary['variant'] == variant
  for key in ('config', 'versions', 'git_revision', 'git_dirty', 'load_average', 'device'):
    assert key in summary, key
  assert os.path.join(workdir, 'summary.json') in listed
  csvs = glob.glob(os.path.join(workdir, '*.csv'))
  assert csvs, os.listdir(workdir)
  for path in csvs:
    with open(path) as f:
      header = next(csv.reader(f))
      first = next(csv.reader(f), None)
    assert len(header) == len(set(header)), (path, header)
    assert 'point' not in header and 'config_hash' not in header, path
    assert first is None or not any(v.startswith(('{', '[')) for v in first), (path, first)
  pngs = glob.glob(os.path.join(workdir, '*.png'))
  assert len(pngs) >= plots, os.listdir(workdir)
  for path in pngs:
    assert os.path.getsize(path) > 0 and path in listed, path
  return summary
