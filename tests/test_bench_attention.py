"""The attention benchmark runs end to end at its :tiny size and writes what docs/attention.md
quotes (no time asserted), and refuses bad config fields by name.

It runs in this process through cli.run_config (what `python -m experiments.bench_attention`
runs after parsing its flags), with the tiny config's float32 shape only.
"""
import csv
import json

import pytest

from pagedjax import kernels
from configs import bench_attention as bench_config
from experiments import bench_attention, cli
from pagedjax.config import ConfigError


def tiny(**bench):
  config = bench_config.get_config('tiny')
  config.bench.update(dict(dtypes=('float32',), **bench))
  return config


def test_bench_attention_tiny_writes_summary_csv_and_plot(tmp_path):
  summary = cli.run_config(bench_attention.study, tiny(), str(tmp_path),
                           check=bench_attention.check)
  assert json.loads((tmp_path / 'summary.json').read_text()) == json.loads(
      json.dumps(summary, default=str))
  assert summary['variant'] == 'tiny' and summary['config']['bench']['batch'] == 4
  figure = summary['figures']['ctx128_float32']
  paged = {'xla', 'cpu'} if kernels.runs_on('cpu') else {'xla'}
  assert set(figure['ms']) == {'contiguous_dense', 'contiguous_flash', 'reference'} | paged
  assert figure['best_paged'] in paged  # the reference is never "best paged" when xla runs
  assert figure['copy_gbs'] > 0 and figure['read_gbs'] > 0
  assert 0 < figure['bandwidth_fraction'] == figure['achieved_read_gbs'] / figure['copy_gbs']
  for name, gbs in figure['kv_gbs'].items():  # every variant's K/V bandwidth vs the same copy
    assert figure['share_of_copy'][name] == pytest.approx(gbs / figure['copy_gbs'])
  with open(tmp_path / 'results.csv') as f:
    rows = list(csv.DictReader(f))
  assert [r['variant'] for r in rows] == list(figure['ms'])
  assert tuple(rows[0]) == bench_attention.COLUMNS
  assert (tmp_path / 'bench_attention.png').read_bytes()[:4] == b'\x89PNG'


@pytest.mark.parametrize('field,value,message', [
    ('rounds', 0, r'config.bench.rounds=0 is not allowed: an integer >= 1'),
    ('num_heads', 6, r'config.bench.num_heads=6 is not allowed: a multiple of num_kv_heads=4'),
    ('contexts', (128, -1), r'config.bench.contexts=\(128, -1\) is not allowed'),
    ('dtypes', ('float64',), r"config.bench.dtypes=\('float64',\) is not allowed: .*'bfloat16'"),
    ('impls', ('triton_on_cpu',), r"config.bench.impls has 'triton_on_cpu', which is not "
                                  r"allowed on the \w+ backend: one of \('reference', 'xla'"),
])
def test_bench_attention_refuses_bad_fields(field, value, message):
  config = tiny(num_kv_heads=4) if field == 'num_heads' else tiny()
  config.bench[field] = value
  with pytest.raises(ConfigError, match=message):
    bench_attention.check(config)


def test_bench_attention_config_variants():
  assert bench_config.get_config().variant == 'full'
  with pytest.raises(ValueError, match="unknown variant 'quick'; allowed: tiny"):
    bench_config.get_config('quick')
