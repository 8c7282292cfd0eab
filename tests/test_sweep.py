"""The sweep runner: every point once, rows and files written, done points skipped on rerun (also
through the command line), bad points rejected before anything runs; and the memory study's
figures from the same runner. Tiny configs: a 1-layer random model, a dozen short requests."""
import csv
import json
import os
import subprocess
import sys

import pytest

from configs import ablate_block_size, reproduce_memory as reproduce_config
from experiments import jobs, reproduce_memory, sweep
from pagedjax.config import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def counting_job(calls):
  def job(config, workdir):
    calls.append(config.pool.block_size)
    return jobs.trace(config, workdir)
  return job


def test_sweep_runs_each_point_once_and_skips_done_points(tmp_path):
  config = ablate_block_size.get_config('tiny')
  workdir, calls = str(tmp_path), []
  rows = sweep.run_sweep(config, workdir, job=counting_job(calls))
  assert calls == [8, 16]
  for name in ('results.jsonl', 'results.csv', 'summary.json', 'plot.png'):
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  for row in rows:  # every request of the trace finished, none rejected
    assert row['finished_requests'] == row['trace_requests'] and row['rejected_requests'] == 0
    assert 0 < row['kv_utilization'] <= 1
  with open(os.path.join(workdir, 'results.csv')) as f:
    table = list(csv.DictReader(f))
  assert [int(r['pool.block_size']) for r in table] == [8, 16]
  assert os.path.exists(os.path.join(workdir, 'points', 'pool.block_size=8,pool.num_blocks=65',
                                     'timeline.json'))

  calls.clear()
  assert sweep.run_sweep(config, workdir, job=counting_job(calls)) == rows
  assert calls == []  # both points were in results.jsonl

  config.sweep = list(config.sweep) + [{'pool.block_size': 32, 'pool.num_blocks': 17}]
  rows = sweep.run_sweep(config, workdir, job=counting_job(calls))
  assert calls == [32] and len(rows) == 3  # only the new point ran

  # The command line skips them all too (and so compiles nothing).
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.sweep', '--config=configs/ablate_block_size.py:tiny',
       f'--workdir={workdir}'], cwd=REPO, capture_output=True, text=True, check=True)
  assert '2 of 2 points already in' in out.stdout
  with open(os.path.join(workdir, 'results.jsonl')) as f:
    assert len(f.readlines()) == 3


def test_bad_points_fail_before_any_run(tmp_path):
  config = ablate_block_size.get_config('tiny')
  config.sweep = [{'pool.block_size': 16}, {'pool.block_sise': 8}]
  with pytest.raises(ConfigError, match="no field 'pool.block_sise'"):
    sweep.run_sweep(config, str(tmp_path), job=counting_job([]))
  config.sweep = [{'pool.block_size': 16}, {'pool.block_size': 3}]
  with pytest.raises(ConfigError, match='pool.block_size=3 is not allowed'):
    sweep.run_sweep(config, str(tmp_path), job=counting_job([]))
  assert not os.path.exists(os.path.join(tmp_path, 'results.jsonl'))
  with pytest.raises(ValueError, match="config.job='nope' is not allowed"):
    jobs.get_job('nope')


def test_memory_study_figures(tmp_path):
  config = reproduce_config.get_config('tiny')
  rows = sweep.run_sweep(config, str(tmp_path))
  figures = reproduce_memory.summarize(rows)
  reproduce_memory.plot(os.path.join(tmp_path, 'memory.png'), rows, str(tmp_path))
  assert os.path.getsize(os.path.join(tmp_path, 'memory.png')) > 0
  assert figures['same_kv_pool_bytes']
  # Same pool: contiguous holds 4 reservations of max_seq_len, paged more sequences, fuller.
  assert figures['contiguous_peak_sequences'] == 4
  assert figures['paged_peak_sequences'] > figures['contiguous_peak_sequences']
  assert figures['paged_kv_utilization'] > figures['contiguous_kv_utilization']
  assert figures['contiguous_preemptions'] == 0
  json.dumps(figures)  # summary.json material
