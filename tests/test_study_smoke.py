"""The smoke matrix: every study's `:tiny` variant runs its whole pipeline in the suite (config
checks, the runs, table, CSV, plot, summary.json; tests/study_outputs.py checks the shape every
run shares), in this process through cli.run_config, as `python -m experiments.NAME
--config=configs/NAME.py:tiny --workdir=DIR` does. STUDIES names, for every config in configs/,
the test that runs its `:tiny` pipeline: the studies that already had one run it there (with
their own figure checks), the rest here; NOT_RUN the configs no test runs yet, with the reason.
A new config in neither fails test_every_config_has_a_smoke_run.
"""
import ast
import importlib
import os

import pytest

from study_outputs import check_outputs, run_tiny

TESTS = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(os.path.dirname(TESTS), 'configs')

# config -> (entry point, the test running its :tiny pipeline: file::function)
STUDIES = {
    'default': ('experiments.decode', 'test_decode_experiment.py::test_decode_tiny_writes_summary'),
    'ablate_block_size': ('experiments.sweep',
                          'test_sweep.py::test_sweep_runs_each_point_once_and_skips_done_points'),
    'ablate_gqa': ('experiments.sweep', 'test_kv_ablation.py::test_gqa_sweep_bytes_scale_with_kv_heads'),
    'ablate_kv_quant': ('experiments.sweep',
                        'test_kv_ablation.py::test_kv_quality_sweep_scores_through_quantized_pool'),
    'reproduce_memory': ('experiments.reproduce_memory', 'test_sweep.py::test_memory_study_figures'),
    'reproduce_sharing': ('experiments.reproduce_sharing',
                          'test_sharing.py::test_reproduce_sharing_tiny'),
    'policy_table': ('experiments.reproduce_policies',
                     'test_reproduce_policies.py::test_policy_table_writes_rows_goals_and_plot'),
    'simulate_vllm': ('experiments.simulate', 'test_simulator.py::test_simulate_vllm_tiny'),
    'simulate_cpu': ('experiments.simulate', 'test_simulator.py::test_calibrate_and_validate_tiny'),
    # Studies other files own, each with its own :tiny test.
    'bench_decode': ('experiments.bench_decode', 'test_bench_decode.py'),
    'bench_linear': ('experiments.bench_linear',
                     'test_bench_linear.py::test_bench_linear_tiny_writes_summary_csv_and_table'),
    'bench_attention': ('experiments.bench_attention',
                        'test_bench_attention.py::test_bench_attention_tiny_writes_summary_csv_and_plot'),
    'policy_lab': ('experiments.policy_lab', 'test_policy_lab.py::test_tiny_study'),
    'policy_lab_sim': ('experiments.policy_lab_sim', 'test_policy_lab.py::test_tiny_simulated_node'),
    'cluster': ('experiments.cluster', 'test_cluster.py::test_study_writes_its_files'),
    'profile_decode': ('experiments.profile_decode', 'test_profile_decode.py::test_tiny_profile'),
    'recompute_storm': ('experiments.recompute_storm', 'test_study_smoke.py::test_tiny_pipeline'),
    'thrashing': ('experiments.thrashing', 'test_study_smoke.py::test_tiny_pipeline'),
    'long_context': ('experiments.long_context', 'test_study_smoke.py::test_tiny_pipeline'),
    'simulate_ablations': ('experiments.simulate', 'test_study_smoke.py::test_tiny_pipeline'),
    'simulate_scale': ('experiments.simulate', 'test_study_smoke.py::test_tiny_pipeline'),
}
# Configs whose :tiny pipeline no test runs yet, and why (each its owner's to add).
NOT_RUN = {
    'serve': 'live Ray Serve replicas over HTTP; tests/test_serve.py tests the deployment',
}
HERE = sorted(name for name, (_, test) in STUDIES.items() if test.startswith('test_study_smoke'))


def test_every_config_has_a_smoke_run():
  configs = {f[:-3] for f in os.listdir(CONFIGS) if f.endswith('.py') and f != '__init__.py'}
  assert set(STUDIES) | set(NOT_RUN) == configs and not set(STUDIES) & set(NOT_RUN)
  for name, (_, where) in STUDIES.items():
    path, _, function = where.partition('::')
    with open(os.path.join(TESTS, path)) as f:
      tree = ast.parse(f.read())
    if function:
      assert function in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, where
    # Every config documents its :tiny command (the docstring --help shows).
    with open(os.path.join(CONFIGS, f'{name}.py')) as f:
      doc = ast.get_docstring(ast.parse(f.read()))
    assert f'configs/{name}.py:tiny' in doc or name.startswith('bench_') and ':tiny' in doc, name


def _study(name: str):
  """(study function, check, validate) of a config's entry point, as its __main__ passes them
  to cli.run_study."""
  module = importlib.import_module(STUDIES[name][0])
  check = {'experiments.recompute_storm': 'check_storm',
           'experiments.long_context': 'check_run'}.get(module.__name__, 'check')
  return module.study, getattr(module, check), module.__name__ != 'experiments.simulate'


@pytest.mark.parametrize('name', HERE)
def test_tiny_pipeline(name, tmp_path):
  config = importlib.import_module(f'configs.{name}').get_config('tiny')
  study, check, validate = _study(name)
  result, stdout = run_tiny(study, config, tmp_path, check=check, validate=validate)
  # simulate_scale is one point: its table is the result, there is nothing to plot.
  summary = check_outputs(tmp_path, stdout, plots=0 if name == 'simulate_scale' else 1)
  if name == 'recompute_storm':
    assert [r['row'] for r in summary['rows']] == list(config.storm.rows)
    assert summary['outputs_token_identical'] is True
    assert all(r['alerts_fired'] >= 1 for r in summary['rows'])  # the switch fires the alert
    assert os.path.exists(tmp_path / 'storm.png')
  elif name == 'thrashing':
    assert [r['row'] for r in summary['mitigations']] == [n for n, _ in config.thrashing.rows]
    assert summary['outputs_identical'] is True
    by_row = {r['row']: r for r in summary['mitigations']}
    assert by_row['swap']['recomputed_token_fraction'] == 0.0
    assert (tmp_path / 'sweep.png').exists() and (tmp_path / 'mitigations.png').exists()
  elif name == 'long_context':
    assert summary['goal']['tokens_identical_everywhere'] is True
    assert summary['refused']  # the normal engine's RequestError for the pool it cannot fit
    rows = summary['rows']
    assert [(r['placement'], r['window_blocks'], r['chunk_blocks']) for r in rows] == [
        ('host', *p) for p in config.long_context.points] + [
        ('disk', *p) for p in config.long_context.disk_points]
    spread = summary['beside']['decode_every']  # the long one on 1 iteration in k, beside
    assert [p['decode_every'] for p in spread] == list(config.long_context.beside_decode_every)
    assert all(p['long_tokens_identical'] and p['long_tpot_ms'] > 0 for p in spread)
    turn = summary['follow_up']  # a follow-up turn over the document, its blocks indexed
    assert summary['goal']['follow_up_tokens_identical'] is True
    assert (turn['indexed']['prompt_tokens_computed'] <
            turn['device_cache_only']['prompt_tokens_computed'])
    assert turn['indexed']['offload_prefix_hit_blocks'] > 0
    assert {'long_context.png', 'beside.png', 'break_even.png', 'projection.csv'} <= set(
        os.listdir(tmp_path))
  else:  # the simulated studies: every row and title marked simulated
    assert summary['simulated'] is True and all(r['simulated'] for r in summary['rows'])
    assert len(summary['rows']) == len(config.sweep)
    assert '(simulated)' in (tmp_path / 'table.md').read_text()
    assert f"{config.trace.num_requests:,} ShareGPT-like" in summary['title']
  assert result is not None
