"""The KV-quantization and GQA sweeps end to end on their `:tiny` configs (a tiny random model:
the pipeline, not quality): every point's row, the table, CSV and plot (tests/study_outputs.py),
and the figures that follow from the formats and head counts exactly."""
import csv

import pytest

from configs import ablate_gqa, ablate_kv_quant
from experiments import sweep
from study_outputs import check_outputs, run_tiny


@pytest.mark.slow
def test_kv_quality_sweep_scores_through_quantized_pool(tmp_path):
  config = ablate_kv_quant.get_config('tiny')
  result, stdout = run_tiny(sweep.study, config, tmp_path, check=sweep.check)
  check_outputs(tmp_path, stdout)
  rows = {r['pool.kv_dtype']: r for r in result['rows']}
  assert list(rows) == ['int8', 'int4']
  row = rows['int4']  # group 8, per-channel keys, recent window 16
  layers, heads, dim, block = 2, 2, 16, 16
  codes = 2 * layers * heads * dim / 2  # K and V, two channels per byte
  value_ranges = 2 * layers * heads * (dim // 8) * 2  # float16 scale and zero per 8 channels
  key_ranges = 2 * layers * heads * dim * 2 / block  # float16 scale and zero per block channel
  tail_source = heads * 4 / block  # int32 per block and head: whose key tail a COW copy reads
  assert row['kv_bytes_per_token'] == codes + value_ranges + key_ranges + tail_source == 112.5
  assert rows['int8']['kv_bytes_per_token'] == 2 * layers * heads * (dim + 2)  # + a float16 scale
  assert row['kv_bytes_per_token'] < rows['int8']['kv_bytes_per_token']
  assert row['perplexity_32'] > 1 and row['reference_perplexity_64'] > 1
  assert 0 < row['greedy_agreement'] <= 1 and row['logit_error_mean'] > 0
  assert row['decode_tokens_per_second'] > 0
  name = sweep.point_name(config.sweep[1])
  assert (tmp_path / 'points' / name / 'logit_error_by_position.json').exists()
  with open(tmp_path / 'results.csv') as f:
    header = next(csv.reader(f))
  # One column per swept field, first; the legend names every field that differs.
  assert header[:4] == ['pool.kv_dtype', 'pool.kv_group_size', 'pool.kv_key_per_channel',
                        'pool.kv_recent_window']


@pytest.mark.slow
def test_gqa_sweep_bytes_scale_with_kv_heads(tmp_path):
  config = ablate_gqa.get_config('tiny')
  result, stdout = run_tiny(sweep.study, config, tmp_path, check=sweep.check)
  check_outputs(tmp_path, stdout)
  rows = {r['model.random.num_kv_heads']: r for r in result['rows']}
  assert list(rows) == [4, 1]
  assert rows[4]['kv_bytes_per_token'] == 4 * rows[1]['kv_bytes_per_token']
  assert rows[1]['max_concurrent_sequences'] == 4 * rows[4]['max_concurrent_sequences']
