"""The policy-table experiment end to end on its `:tiny` config, cut to four rows of one trace,
through cli.run_config in this process (the full command is in configs/policy_table.py's
docstring)."""
import csv
import json

import pytest

from configs import policy_table
from pagedjax.config import ConfigError
from experiments import reproduce_policies
from study_outputs import check_outputs, run_tiny


def test_policy_table_writes_rows_goals_and_plot(tmp_path):
  config = policy_table.get_config('tiny')
  config.policies.rows = ['recompute', 'lru', 'ram_disk', 'auto']
  config.policies.traces = ['multi_turn']
  summary, stdout = run_tiny(reproduce_policies.study, config, tmp_path,
                             check=reproduce_policies.check)
  check_outputs(tmp_path, stdout)
  assert 'goal multi_turn_ttft_p50_speedup_vs_recompute (>= 3)' in stdout
  rows = {r['policy']: r for r in summary['rows']}
  assert list(rows) == list(config.policies.rows)
  # The device pool holds part of the working set; the tiers find what it lost.
  size = summary['sizes']['multi_turn']
  assert size['device'] - 1 < size['working_set_blocks']
  assert rows['recompute']['hit_rate'] == 0
  assert rows['ram_disk']['hit_rate'] > rows['lru']['hit_rate']
  assert rows['ram_disk']['tier3_hit_rate'] > 0 and rows['ram_disk']['tier3_demoted_bytes'] > 0
  assert (rows['ram_disk']['prompt_tokens_computed'] < rows['lru']['prompt_tokens_computed'] <
          rows['recompute']['prompt_tokens_computed'])
  assert set(summary['goals']) == {'multi_turn_ttft_p50_speedup_vs_recompute',
                                   'multi_turn_auto_ttft_p50_vs_best_fixed'}
  with open(tmp_path / 'results.csv') as f:
    assert [r['policy'] for r in csv.DictReader(f)] == list(config.policies.rows)
  assert json.loads((tmp_path / 'summary.json').read_text())['sizes'] == summary['sizes']
  assert (tmp_path / 'policies.png').stat().st_size > 0
  assert (tmp_path / 'table.md').read_text().count('\n') == 2 + len(rows)
  with open(tmp_path / 'timelines' / 'multi_turn-ram_disk.csv') as f:
    timeline = list(csv.DictReader(f))
  assert sum(int(r['tier3_hit_blocks']) for r in timeline) > 0
  assert max(int(r['tier3_blocks']) for r in timeline) <= rows['ram_disk']['disk_blocks']
  assert not (tmp_path / 'timelines' / 'multi_turn-lru.csv').exists()
  # auto keeps sessions: conversations idle past session_idle_s were demoted as units.
  assert rows['auto']['session_idle_demoted_blocks'] > 0


@pytest.mark.parametrize('section, field, value, allowed', [
    ('policies', 'rows', ('lru', 'mru'), r"a non-empty list, each one of \('unlimited'"),
    ('policies', 'device_share', 0.0, 'a finite number > 0'),
    ('rag', 'documents', 0, 'an integer >= 1'),
    ('multi_turn', 'dataset', 'wiki', "one of \\('sharegpt'"),
])
def test_bad_study_fields_are_refused_before_any_engine(section, field, value, allowed):
  config = policy_table.get_config('tiny')
  config[section][field] = value
  with pytest.raises(ConfigError, match=rf'config.{section}.{field}=.* is not allowed: {allowed}'):
    reproduce_policies.check(config)
