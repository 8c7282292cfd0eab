"""The main job end to end: the tiny config through absl flags, and SmolLM2 through the engine;
its refusals (config, flags, workdir, prompts) as one line before anything loads or compiles."""
import csv
import json
import os
import subprocess
import sys

import pytest

from configs import default
from experiments import decode
from pagedjax import factory
from pagedjax.engine import RequestError
from pagedjax.host.requests.sampling_params import SamplingParams
from fakes import FakeStep, fake_engine
from tiny_models import ROOT, run_experiment

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
  assert summary['variant'] == 'tiny' and '[tiny variant' in run.stdout
  assert 'load_average' in summary and 'git_revision' in summary
  with open(tmp_path / 'results.csv') as f:  # one row of figures
    (figures,) = list(csv.DictReader(f))
  assert float(figures['tokens_per_second']) == pytest.approx(summary['tokens_per_second'])
  with open(tmp_path / 'completions.csv') as f:  # one row per completion
    assert [r['prompt'] for r in csv.DictReader(f)] == list(default.PROMPTS)
  assert (tmp_path / 'decode.png').read_bytes()[:4] == b'\x89PNG' and 'decode.png' in run.stdout


# Each refusal is one line on stderr, before anything loads (no jax backend log line either):
# flags that name no field (caught while absl parses them, also with the default config file),
# a config file that does not exist, a value the typed config rejects, an unusable workdir.
CLI_ERRORS = {
    'unknown_field': (['--config.pool.foo=1'],
                      "--config.pool.foo=1: config.pool has no field 'foo'; its fields: "
                      'block_size, kind'),
    'missing_config_file': (['--config=configs/nope.py'], "'configs/nope.py'"),
    'bad_value': (['--config=configs/default.py:tiny', '--config.pool.block_size=12'],
                  'config.pool.block_size=12 is not allowed: a power of two'),
    'empty_workdir': (['--config=configs/default.py:tiny', '--workdir='],
                      '--workdir is empty'),
    'workdir_is_a_file': (['--config=configs/default.py:tiny', '--workdir={file}'],
                          '--workdir={file} is an existing file, not a directory'),
}


@pytest.fixture(scope='module')
def cli_error_runs(tmp_path_factory):
  """case -> (exit status, stderr, tmp dir) of `python -m experiments.decode FLAGS` for every
  case, each command in a fork of one process that imported decode's imports once
  (tests/forked_cli.py): what each command does from main() on is a run of its own."""
  root = tmp_path_factory.mktemp('cli_errors')
  argvs, dirs = [], {}
  for case, (flags, _) in CLI_ERRORS.items():
    tmp = dirs[case] = root / case
    tmp.mkdir()
    file = tmp / 'results.txt'
    file.write_text('not a directory')
    flags = [f.format(file=file) for f in flags]
    if not any(f.startswith('--workdir') for f in flags):
      flags.append(f'--workdir={tmp / "out"}')
    argvs.append(flags)
  run = subprocess.run([sys.executable, os.path.join(ROOT, 'tests', 'forked_cli.py'),
                        'experiments.decode', str(root), json.dumps(argvs)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  codes = json.loads(run.stdout.strip().splitlines()[-1])
  return {case: (code, (root / f'{i}.err').read_text(), dirs[case])
          for i, (case, code) in enumerate(zip(CLI_ERRORS, codes))}


@pytest.mark.parametrize('case', CLI_ERRORS)
def test_cli_errors_are_one_line_before_loading(cli_error_runs, case):
  _, message = CLI_ERRORS[case]
  returncode, stderr, tmp_path = cli_error_runs[case]
  file = tmp_path / 'results.txt'
  lines = [line for line in stderr.splitlines() if line.strip()]
  assert returncode == 2, stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith('error: '), stderr[-3000:]
  assert message.format(file=file) in lines[0]
  assert not (tmp_path / 'out').exists()  # refused before the workdir was made


def test_prompts_are_checked_before_anything_compiles():
  """decode.check_prompts runs the engine's submit checks on every prompt, queuing nothing and
  calling no device step (so nothing compiles) before it refuses."""
  step = FakeStep()
  engine = fake_engine(max_seq_len=64, step_fn=step)
  ok, too_long = [1, 2, 3], list(range(1, 81))
  with pytest.raises(RequestError, match=r'config\.prompts\[1\]=.*prompt of 80 tokens: the '
                     r'maximum is 63'):
    decode.check_prompts(engine, [ok, too_long], SamplingParams(max_new_tokens=4))
  decode.check_prompts(engine, [ok], SamplingParams(max_new_tokens=4))
  assert not engine.has_work() and step.calls == [] and engine.stats['steps'] == 0


@pytest.mark.slow
def test_smollm2_paged_greedy_knows_paris(smollm2):
  cfg, params, tokenizer = smollm2
  config = default.get_config()
  engine = factory.make_engine(config, cfg, params, tokenizer)
  # ' Paris' and ' Jupiter' are the first greedy tokens (of the prefill); the second comes from a
  # decode step over the paged cache. More tokens only add 135M decode steps (~1 s of CPU each).
  done = engine.generate(['The capital of France is', 'The largest planet in our solar system is'],
                         SamplingParams(max_new_tokens=2))
  assert 'Paris' in done[0].text, done[0].text
  assert 'Jupiter' in done[1].text, done[1].text
