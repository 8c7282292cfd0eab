"""experiments/bench_decode.py end to end on its `:tiny` config: a tiny random Llama on both sides
(HF's LlamaForCausalLM built from the same params), the files it writes, and greedy tokens equal
to HF generate's. No wall-clock thresholds: timings on a shared CPU are only reported."""
import csv
import json

import pytest

from tiny_models import run_experiment

pytest.importorskip('torch', reason='bench_decode compares against HF (test extra)')
pytest.importorskip('transformers', reason='bench_decode compares against HF (test extra)')


@pytest.mark.slow
def test_bench_decode_tiny(tmp_path):
  profile = tmp_path / 'profile'
  run = run_experiment('experiments.bench_decode', '--config=configs/bench_decode.py:tiny',
                       f'--workdir={tmp_path}', f'--profile_dir={profile}')
  assert run.returncode == 0, run.stderr[-3000:]
  summary = json.loads((tmp_path / 'summary.json').read_text())
  batches = [r for r in summary['rows'] if r['kind'] == 'batch']
  assert [r['batch'] for r in batches] == summary['batches'] == [2]
  for r in batches:
    assert r['token_agreement'] == 1.0, r
    assert r['engine_tokens_per_s'] > 0 and r['hf_tokens_per_s'] > 0 and r['floor_s'] > 0
    assert r['decode_step_s'] > 0 and r['host_s_per_step'] >= 0
    assert r['step_over_floor'] == pytest.approx(r['decode_step_s'] / r['floor_s'])
  trace = [r for r in summary['rows'] if r['kind'] == 'trace']
  assert len(trace) == 1 and trace[0]['requests'] == 2
  assert summary['num_compilations_after_warmup'] == 0  # the timed rounds compile nothing
  assert '| batch |' in summary['markdown_table']
  with open(tmp_path / 'results.csv') as f:
    assert len(list(csv.DictReader(f))) == len(summary['rows'])
  assert (tmp_path / 'bench_decode.png').read_bytes()[:4] == b'\x89PNG'
  assert list(profile.glob('plugins/profile/*/*.xplane.pb'))
