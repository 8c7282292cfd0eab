"""The README's "From Python" snippet, run exactly as written (in its own process)."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_snippet() -> str:
  text = (ROOT / 'README.md').read_text()
  match = re.search(r'<!-- snippet: from-python -->\n```python\n(.*?)```\n<!-- end snippet -->',
                    text, re.S)
  assert match, 'README.md lost its from-python snippet markers'
  return match.group(1)


@pytest.mark.slow
def test_readme_from_python_snippet_runs_and_reports_the_kv_figures():
  out = subprocess.run([sys.executable, '-c', readme_snippet()], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  assert len(lines) == 3, out.stdout  # two completions and the figures: no library logs
  assert lines[-1].startswith('KV bytes per token: 46080, prefix hit rate: ')
  hit_rate = int(re.search(r'prefix hit rate: (\d+)%', lines[-1]).group(1))
  assert hit_rate > 0  # the second call reused the first call's cached prefix blocks
