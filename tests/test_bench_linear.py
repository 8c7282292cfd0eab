"""The linear-kernel benchmark runs end to end at its :tiny size (every variant checked against
a float64 oracle before timing; no time asserted) and refuses bad config fields by name."""
import csv
import json

import pytest

from configs import bench_linear as bench_config
from experiments import bench_linear
from pagedjax.config import ConfigError
from pagedjax.kernels import linear_cpu
from study_outputs import check_outputs, run_tiny

needs_kernel = pytest.mark.skipif(not linear_cpu.available(),
                                  reason=f'needs the native linear kernel: '
                                         f'{linear_cpu.unavailable_reason()}')


@needs_kernel
def test_bench_linear_tiny_writes_summary_csv_and_table(tmp_path):
  config = bench_config.get_config('tiny')
  summary, stdout = run_tiny(bench_linear.study, config, tmp_path, check=bench_linear.check)
  check_outputs(tmp_path, stdout)  # the table, files listed, CSV columns, the plot
  assert json.loads((tmp_path / 'summary.json').read_text()) == json.loads(
      json.dumps(summary, default=str))
  assert summary['variant'] == 'tiny'
  with open(tmp_path / 'results.csv') as f:
    rows = list(csv.DictReader(f))
  assert [(r['shape'], r['variant']) for r in rows] == [
      (shape, variant) for shape in ('dense', 'head') for variant in ('kernel', 'packed', 'xla')]
  assert all(float(r['ms']) > 0 and float(r['w_gbs']) > 0 for r in rows)
  assert float(rows[0]['over_kernel']) == 1.0
  assert set(summary['step_ms']['8']) == {'kernel', 'packed', 'xla'}
  assert all(gbs > 0 for gbs in summary['step_w_gbs']['8'].values())
  assert '| 8 | packed |' in (tmp_path / 'table.md').read_text()


@needs_kernel
@pytest.mark.parametrize('field, value, words', [
    ('rows', (0,), 'config.bench.rows=(0,) is not allowed'),
    ('shapes', (('q', 8, 8, False),), 'config.bench.shapes='),
    ('min_bytes', 0, 'config.bench.min_bytes=0 is not allowed'),
])
def test_bench_linear_refuses_bad_fields(field, value, words):
  config = bench_config.get_config('tiny')
  config.bench[field] = value
  with pytest.raises(ConfigError, match=words.replace('(', r'\(').replace(')', r'\)')):
    bench_linear.check(config)
