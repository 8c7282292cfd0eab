"""The KV-quantization and GQA sweep jobs on a tiny random model (pipeline, not quality)."""
import pytest

from configs import ablate_gqa, ablate_kv_quant
from experiments import kv_quality, sweep
from pagedjax.config import validate_config


@pytest.mark.slow
def test_kv_quality_job_scores_through_quantized_pool(tmp_path):
  config = ablate_kv_quant.get_config('tiny')
  point = ablate_kv_quant.kv_point('int4', group_size=8, key_per_channel=True, recent_window=16)
  row = kv_quality.kv_quality(validate_config(sweep.apply_point(config, point)), str(tmp_path))
  layers, heads, dim, block = 2, 2, 16, 16
  codes = 2 * layers * heads * dim / 2  # K and V, two channels per byte
  value_ranges = 2 * layers * heads * (dim // 8) * 2  # float16 scale and zero per 8 channels
  key_ranges = 2 * layers * heads * dim * 2 / block  # float16 scale and zero per block channel
  assert row['kv_bytes_per_token'] == codes + value_ranges + key_ranges == 112
  assert row['perplexity_32'] > 1 and row['reference_perplexity_64'] > 1
  assert 0 < row['greedy_agreement'] <= 1 and row['logit_error_mean'] > 0
  assert row['decode_tokens_per_second'] > 0
  assert (tmp_path / 'logit_error_by_position.json').exists()


@pytest.mark.slow
def test_gqa_job_bytes_scale_with_kv_heads(tmp_path):
  config = ablate_gqa.get_config('tiny')
  rows = {n: kv_quality.gqa(validate_config(sweep.apply_point(config, p)), str(tmp_path))
          for n, p in zip((4, 1), (config.sweep[0], config.sweep[2]))}
  assert rows[4]['kv_bytes_per_token'] == 4 * rows[1]['kv_bytes_per_token']
  assert rows[1]['max_concurrent_sequences'] == 4 * rows[4]['max_concurrent_sequences']
