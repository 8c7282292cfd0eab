"""The main job end to end: the tiny config through absl flags, and SmolLM2 through the engine."""
import json

import pytest

from pagedjax import factory
from pagedjax.host.sampling_params import SamplingParams
from configs import default
from tiny_models import run_experiment

SUMMARY_KEYS = ('model', 'num_requests', 'generated_tokens', 'tokens_per_second',
                'kv_blocks_total', 'kv_blocks_peak_used', 'kv_utilization', 'num_compilations',
                'outputs')


@pytest.mark.slow
def test_decode_tiny_writes_summary(tmp_path):
  run = run_experiment('experiments.decode', '--config=configs/default.py:tiny',
                       f'--workdir={tmp_path}', '--config.pool.block_size=8',
                       '--config.sampling.max_new_tokens=5')
  assert run.returncode == 0, run.stderr[-3000:]
  summary = json.loads((tmp_path / 'summary.json').read_text())
  assert set(SUMMARY_KEYS) <= set(summary)
  n = len(default.PROMPTS)
  assert summary['num_requests'] == n and summary['generated_tokens'] == 5 * n
  assert summary['config']['pool']['block_size'] == 8
  assert 0 < summary['kv_utilization'] <= 1
  assert 0 < summary['kv_blocks_peak_used'] < summary['kv_blocks_total']
  assert summary['num_compilations'] == summary['num_compilations_first_pass'] <= 6
  assert [o['prompt'] for o in summary['outputs']] == list(default.PROMPTS)


def test_bad_config_fails_before_loading(tmp_path):
  run = run_experiment('experiments.decode', '--config=configs/default.py:tiny',
                       f'--workdir={tmp_path}', '--config.pool.block_size=12')
  assert run.returncode != 0
  assert 'config.pool.block_size=12 is not allowed: a power of two' in run.stderr


@pytest.mark.slow
def test_smollm2_paged_greedy_knows_paris(smollm2):
  cfg, params, tokenizer = smollm2
  config = default.get_config()
  engine = factory.make_engine(config, cfg, params, tokenizer)
  done = engine.generate(['The capital of France is', 'The largest planet in our solar system is'],
                         SamplingParams(max_new_tokens=6))
  assert 'Paris' in done[0].text, done[0].text
  assert 'Jupiter' in done[1].text, done[1].text
