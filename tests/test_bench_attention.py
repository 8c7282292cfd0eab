"""The attention benchmark runs end to end and writes what docs/attention.md quotes (no time asserted).

It runs as its own process (its absl flags would clash inside pytest's) and needs only kernels/,
so this file imports nothing of the engine.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_attention_quick_writes_summary(tmp_path):
  done = subprocess.run([sys.executable, '-m', 'experiments.bench_attention',
                         f'--workdir={tmp_path}', '--quick', '--contexts=128',
                         '--dtypes=float32', '--rounds=2'],
                        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  summary = json.loads((tmp_path / 'summary.json').read_text())
  figure = summary['figures']['ctx128_float32']
  assert figure['best_paged'] == 'xla'  # the reference is never "best paged" when xla runs
  assert set(figure['ms']) == {'contiguous_dense', 'contiguous_flash', 'reference', 'xla'}
  assert figure['copy_gbs'] > 0 and figure['read_gbs'] > 0
  assert 0 < figure['bandwidth_fraction'] == figure['achieved_read_gbs'] / figure['copy_gbs']
  rows = (tmp_path / 'results.jsonl').read_text().splitlines()
  assert len(rows) == len(figure['ms'])
