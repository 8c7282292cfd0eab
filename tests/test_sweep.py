"""The sweep runner: every point once, rows and files written, done points skipped on rerun (also
through the command line), bad points rejected before anything runs, a torn results line
recomputed, one sweep per workdir; and the memory study's figures from the same runner. Tiny
configs: a 1-layer random model, a dozen short requests."""
import csv
import fcntl
import json
import logging
import math
import os
import re
import subprocess
import sys

import pytest

from configs import ablate_block_size, reproduce_memory as reproduce_config
from experiments import block_overhead, cli, jobs, plots, reproduce_memory, sweep
from pagedjax import executor
from pagedjax.studies import run_info
from pagedjax.config import ConfigError
from study_outputs import check_outputs, run_tiny

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def counting_job(calls, tables=None):
  """The config's own job, counting its calls; with `tables`, also recording per block size
  every step call's padded block-table shape and its real rows' table lengths."""
  def job(config, workdir):
    calls.append(config.pool.block_size)
    if tables is None:
      return jobs.get_job(config.job)(config, workdir)
    calls_tables = tables.setdefault(config.pool.block_size, [])
    build = executor.build_step_inputs

    def recording_build(specs, *args):
      inputs = build(specs, *args)
      calls_tables.append((inputs.block_tables.shape, [len(s.block_table) for s in specs]))
      return inputs
    executor.build_step_inputs = recording_build
    try:
      return jobs.get_job(config.job)(config, workdir)
    finally:
      executor.build_step_inputs = build
  return job


def check_block_costs(row, tables):
  """The row's block-table and kernel figures against the step calls' own tables and the
  trace's lengths."""
  bs, iterations = row['pool.block_size'], row['iterations']
  padded = sum(rows * width * 4 for (rows, width), _ in tables)
  entries = [n for _, lengths in tables for n in lengths]
  assert row['block_table_bytes_per_iteration'] == pytest.approx(padded / iterations)
  assert row['block_table_entries_mean'] == pytest.approx(sum(entries) / len(entries))
  assert row['block_table_padding_fraction'] == pytest.approx(1 - 4 * sum(entries) / padded)
  # The longest request's last decode call feeds all its tokens but the last one sampled.
  assert row['block_table_entries_max'] == max(entries) == math.ceil(
      (row['trace_max_tokens'] - 1) / bs)
  assert 0 < row['step_input_s_per_iteration'] < row['host_s_per_step']
  settings = ablate_block_size.get_config('tiny').block_overhead
  assert row['attention_blocks_read'] == settings.batch * math.ceil(settings.context / bs)
  # The xla kernel's loop takes 64 tokens a step; other paths' loops are their own (None).
  assert row['attention_loop_steps'] == (math.ceil(settings.context / 64) if row[
      'attention_impl_timed'] == 'xla' else None)
  # Two block sizes: the line goes through both points.
  assert row['attention_fixed_s'] + row['attention_s_per_block'] * row[
      'attention_blocks_read'] == pytest.approx(row['attention_s'], rel=1e-6, abs=1e-9)
  assert row['attention_steps_fit_s_per_loop_step'] is None  # equal loop steps: not separable
  assert row['step_inputs_fixed_s'] + row['step_inputs_s_per_entry'] * row[
      'attention_blocks_read'] == pytest.approx(row['step_inputs_call_s'], rel=1e-6, abs=1e-9)


def test_sweep_runs_each_point_once_and_skips_done_points(tmp_path):
  config = ablate_block_size.get_config('tiny')
  workdir, calls, tables = str(tmp_path), [], {}
  rows = sweep.run_sweep(config, workdir, job=counting_job(calls, tables))
  assert calls == [8, 16]
  for name in ('results.jsonl', 'results.csv', 'summary.json', 'plot.png'):
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  for row in rows:  # every request of the trace finished, none rejected
    assert row['finished_requests'] == row['trace_requests'] and row['rejected_requests'] == 0
    assert 0 < row['kv_utilization'] <= 1
    check_block_costs(row, tables[row['pool.block_size']])
  # One kernel measurement for the sweep: both rows carry the same fit.
  assert rows[0]['attention_s_per_block'] == rows[1]['attention_s_per_block']
  with open(os.path.join(workdir, 'results.csv')) as f:
    table = list(csv.DictReader(f))
  assert [int(r['pool.block_size']) for r in table] == [8, 16]
  assert os.path.exists(os.path.join(workdir, 'points', 'pool.block_size=8,pool.num_blocks=65',
                                     'timeline.json'))

  calls.clear()
  assert sweep.run_sweep(config, workdir, job=counting_job(calls)) == rows
  assert calls == []  # both points were in results.jsonl

  # A new point with the shapes of a done one (no compilation): only it runs.
  config.sweep = list(config.sweep) + [{'pool.block_size': 16, 'pool.num_blocks': 33,
                                        'scheduler.watermark': 0.05}]
  rows = sweep.run_sweep(config, workdir, job=counting_job(calls))
  assert calls == [16] and len(rows) == 3

  # The command line skips them all too (and so compiles nothing).
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.sweep', '--config=configs/ablate_block_size.py:tiny',
       f'--workdir={workdir}'], cwd=REPO, capture_output=True, text=True, check=True)
  assert '2 of 2 points already in' in out.stdout
  check_outputs(workdir, out.stdout)  # the table, CSV, plot and summary rewritten from the rows
  assert '| pool.block_size | pool.num_blocks | kv_utilization |' in out.stdout
  with open(os.path.join(workdir, 'results.csv')) as f:
    header = next(csv.reader(f))
  assert header[:2] == ['pool.block_size', 'pool.num_blocks']
  assert 'block_size' not in header and 'pool_kind' in header  # pool.kind is not swept here
  with open(os.path.join(workdir, 'results.jsonl')) as f:
    assert len(f.readlines()) == 3


def test_block_overhead_fits_and_settings():
  blocks, steps = [16384, 2048, 256, 128, 64], [32, 32, 32, 16, 8]
  seconds = [1e-4 + 5e-8 * b + 2e-5 * s for b, s in zip(blocks, steps)]
  assert block_overhead.fit_blocks_and_steps(blocks, steps, seconds) == pytest.approx(
      (1e-4, 5e-8, 2e-5))
  assert block_overhead.fit_blocks_and_steps(blocks[:3], steps[:3], seconds[:3]) is None
  assert block_overhead.fit_line([1, 3], [5, 11]) == pytest.approx((2, 3))
  assert [block_overhead.loop_steps('xla', 2048, bs) for bs in (1, 16, 64, 128, 256)] == [
      32, 32, 32, 16, 8]
  inputs = block_overhead.step_input_builders(100, 3, [16])[16]()  # 3 rows of 7 blocks
  assert inputs.block_tables.tolist() == [list(range(1 + 7 * i, 8 + 7 * i)) for i in range(3)]
  assert inputs.context_lens.tolist() == [100] * 3
  config = ablate_block_size.get_config('tiny')
  config.pool.block_size = 32
  with pytest.raises(ConfigError, match=r'pool.block_size=32 is not in config.block_overhead'):
    block_overhead.figures(config, None)
  config.block_overhead.rounds = 0
  with pytest.raises(ConfigError, match=r'config.block_overhead.rounds=0 is not allowed'):
    block_overhead.figures(config, None)


def test_bad_points_fail_before_any_run(tmp_path):
  config = ablate_block_size.get_config('tiny')
  config.sweep = [{'pool.block_size': 16}, {'pool.block_sise': 8}]
  with pytest.raises(ConfigError, match="no field 'pool.block_sise'"):
    sweep.run_sweep(config, str(tmp_path), job=counting_job([]))
  config.sweep = [{'pool.block_size': 16}, {'pool.block_size': 3}]
  with pytest.raises(ConfigError, match='pool.block_size=3 is not allowed'):
    sweep.run_sweep(config, str(tmp_path), job=counting_job([]))
  assert not os.path.exists(os.path.join(tmp_path, 'results.jsonl'))
  with pytest.raises(ConfigError, match="config.job='nope' is not allowed"):
    jobs.get_job('nope')
  with pytest.raises(ConfigError, match="config.job='no_such.module:job' is not allowed"):
    jobs.get_job('no_such.module:job')


def fake_job(calls):
  """Figures without an engine: these tests are about the runner's files."""
  def job(config, workdir):
    calls.append(config.pool.block_size)
    return {'slots': config.pool.block_size * (config.pool.num_blocks - 1)}
  return job


def fast_config():
  config = ablate_block_size.get_config('tiny')
  del config['plot']
  return config


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_torn_results_line_is_dropped_and_its_point_recomputed(tmp_path, caplog):
  config, workdir, calls = fast_config(), str(tmp_path), []
  rows = sweep.run_sweep(config, workdir, job=fake_job(calls))
  results = tmp_path / 'results.jsonl'
  whole = results.read_bytes()
  results.write_bytes(whole[:-20])  # killed halfway through appending the second row
  calls.clear()
  with caplog.at_level(logging.WARNING):
    assert sweep.run_sweep(config, workdir, job=fake_job(calls)) == rows
  assert calls == [16]  # only the torn point ran again
  assert len(_warnings(caplog)) == 1 and 'dropped 1 line' in _warnings(caplog)[0]
  assert results.read_bytes() == whole  # the torn line is gone, not left before the new row

  # A last row whose newline never landed is whole, but the next append would run into it.
  results.write_bytes(whole[:-1])
  config.sweep = list(config.sweep) + [{'pool.block_size': 32, 'pool.num_blocks': 17}]
  calls.clear()
  assert len(sweep.run_sweep(config, workdir, job=fake_job(calls))) == 3
  assert calls == [32]
  assert [json.loads(line)['pool.block_size'] for line in results.read_text().splitlines()] == [
      8, 16, 32]


def test_second_sweep_on_a_workdir_is_refused(tmp_path):
  calls = []
  with open(tmp_path / '.lock', 'w') as other:  # another sweep holds the workdir
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(cli.WorkdirError,
                       match=re.escape(f'--workdir={tmp_path} is in use by another sweep')):
      sweep.run_sweep(fast_config(), str(tmp_path), job=fake_job(calls))
  assert calls == [] and not os.path.exists(tmp_path / 'results.jsonl')
  sweep.run_sweep(fast_config(), str(tmp_path), job=fake_job(calls))  # free once it exits
  assert calls == [8, 16]


def test_results_csv_is_replaced_atomically(tmp_path):
  class Unprintable:
    def __str__(self):
      raise RuntimeError('killed mid-write')
  path = str(tmp_path / 'results.csv')
  run_info.write_csv(path, [{'a': 1, 'b': 2}])
  with pytest.raises(RuntimeError):
    run_info.write_csv(path, [{'a': 3, 'b': 4}, {'a': Unprintable(), 'b': 5}])
  with open(path) as f:
    assert list(csv.DictReader(f)) == [{'a': '1', 'b': '2'}]
  assert os.listdir(tmp_path) == ['results.csv']


def test_memory_study_figures(tmp_path, caplog):
  """The study's :tiny pipeline (experiments.reproduce_memory's study), then its figures."""
  config = reproduce_config.get_config('tiny')
  figures, stdout = run_tiny(reproduce_memory.study, config, tmp_path,
                             check=reproduce_memory.check)
  check_outputs(tmp_path, stdout)
  rows = figures['rows']
  assert [r['pool.kind'] for r in rows] == ['contiguous', 'paged']
  assert 'paged / contiguous throughput' in stdout
  assert os.path.getsize(os.path.join(tmp_path, 'memory.png')) > 0
  assert figures['same_kv_pool_bytes']
  # Same pool: contiguous holds 4 reservations of max_seq_len, paged more sequences, fuller.
  assert figures['contiguous_peak_sequences'] == 4
  assert figures['paged_peak_sequences'] > figures['contiguous_peak_sequences']
  assert figures['paged_kv_utilization'] > figures['contiguous_kv_utilization']
  assert figures['contiguous_preemptions'] == 0
  json.dumps(figures)  # summary.json material

  # A point's timeline lost since its run: the figure leaves it out (one warning), the study
  # does not crash after its work.
  name = sweep.point_name(json.loads(rows[0]['point']))
  os.remove(os.path.join(tmp_path, 'points', name, 'timeline.json'))
  os.remove(os.path.join(tmp_path, 'memory.png'))
  with caplog.at_level(logging.WARNING):
    reproduce_memory.plot(os.path.join(tmp_path, 'memory.png'), rows, str(tmp_path))
  assert os.path.getsize(os.path.join(tmp_path, 'memory.png')) > 0
  assert len(_warnings(caplog)) == 1 and 'timeline.json is unreadable' in _warnings(caplog)[0]

  config.sweep = [p for p in config.sweep if p['pool.kind'] == 'paged']
  with pytest.raises(ConfigError, match="pool.kind='contiguous' is missing"):
    reproduce_memory.check_kinds(config)  # before the runs, not after them


def test_a_command_line_override_of_a_swept_field_is_refused():
  """Every point sets its swept fields, so an override of one would silently be replaced: it
  is refused, naming the field and the points' values; other fields pass."""
  config = ablate_block_size.get_config('tiny')
  for arg in ('--config.pool.block_size=32', '--config.pool.num_blocks', '--config.pool=x'):
    with pytest.raises(ConfigError, match=r'--config.pool(.block_size|.num_blocks)? is not '
                       r'allowed: config.sweep sets pool.(block_size|num_blocks) per point '
                       r'\((8, 16|33, 65)\)'):
      cli.refuse_swept_overrides(config, ['prog', arg])
  cli.refuse_swept_overrides(config, ['prog', '--config.scheduler.watermark=0.05',
                                      '--workdir=/tmp/x'])


def test_plot_series_are_named_by_every_field_that_differs():
  """The KV sweep's points differ in dtype, group size, per-channel keys and window: the
  legend names them all; the block-size sweep's num_blocks follows its x (no legend)."""
  from configs import ablate_kv_quant  # pylint: disable=import-outside-toplevel
  kvq = ablate_kv_quant.get_config('tiny')
  rows = [dict(p, kv_bytes_per_token=b) for p, b in zip(kvq.sweep, (72, 112))]
  fields = sweep.series_fields(rows, kvq.plot, sweep.swept_fields(kvq.sweep))
  assert fields == ['pool.kv_dtype', 'pool.kv_group_size', 'pool.kv_key_per_channel',
                    'pool.kv_recent_window']
  assert plots.series_label(rows[1], fields) == (
      'int4, group 8, per-channel keys, recent window 16')
  bs = ablate_block_size.get_config('tiny')
  rows = [dict(p) for p in bs.sweep]
  assert sweep.series_fields(rows, bs.plot, sweep.swept_fields(bs.sweep)) == []
  assert sweep.csv_columns([dict(r, block_size=r['pool.block_size'], x=1) for r in rows],
                           bs.sweep) == ['pool.block_size', 'pool.num_blocks', 'x']
