"""Experiment plumbing (experiments/cli.py, pagedjax/studies/run_info.py): result files replaced
atomically, the workdir checked before anything runs and locked by one run at a time, unknown
override fields named, and the git state read without taking the checkout's index lock."""
import fcntl
import json
import os
import re
import shutil
import subprocess

import pytest
from ml_collections import config_dict

from experiments import cli
from pagedjax.studies import run_info
from pagedjax.config import Config, ConfigError, ModelSection


class Unprintable:
  def __str__(self):
    raise RuntimeError('the run died while writing')


def test_failed_write_keeps_the_previous_file(tmp_path):
  """json.dump streams: a failure halfway used to leave a truncated summary.json."""
  path = tmp_path / 'summary.json'
  run_info.write_json(str(path), {'tokens_per_second': 79.4})
  with pytest.raises(RuntimeError, match='died'):
    run_info.write_json(str(path), {'a': 1, 'b': Unprintable()})
  assert json.loads(path.read_text()) == {'tokens_per_second': 79.4}
  assert os.listdir(tmp_path) == ['summary.json']  # no temporary left behind
  run_info.write_json(str(path), {'tokens_per_second': 80.0})
  assert json.loads(path.read_text()) == {'tokens_per_second': 80.0}


def test_atomic_write_respects_the_umask(tmp_path):
  old = os.umask(0o022)
  try:
    with run_info.atomic_write(str(tmp_path / 'results.csv'), newline='') as f:
      f.write('a,b\n')
  finally:
    os.umask(old)
  assert os.stat(tmp_path / 'results.csv').st_mode & 0o777 == 0o644


def test_prepare_workdir(tmp_path):
  new = tmp_path / 'runs' / 'new'
  assert cli.prepare_workdir(str(new)) == str(new) and new.is_dir()  # made, parents too
  assert cli.prepare_workdir(str(new)) == str(new)  # an existing one is fine
  for empty in ('', '  ', None):
    with pytest.raises(cli.WorkdirError, match='--workdir is empty'):
      cli.prepare_workdir(empty)
  (tmp_path / 'file').write_text('x')
  with pytest.raises(cli.WorkdirError, match='is an existing file, not a directory'):
    cli.prepare_workdir(str(tmp_path / 'file'))
  with pytest.raises(cli.WorkdirError, match='cannot be created'):
    cli.prepare_workdir(str(tmp_path / 'file' / 'below'))


def test_workdir_lock_refuses_a_second_holder_and_is_released(tmp_path):
  workdir = str(tmp_path)
  with cli.lock_workdir(workdir):
    with cli.lock_workdir(workdir):  # re-entrant in this process (reproduce_memory + sweep)
      pass
    # Another process: flock conflicts between open files even within one process.
    with open(tmp_path / '.lock') as other:
      with pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
  with open(tmp_path / '.lock') as other:
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on exit
    with pytest.raises(cli.WorkdirError,
                       match=re.escape(f'--workdir={workdir} is in use by another sweep')):
      with cli.lock_workdir(workdir):
        pass


def test_unknown_override_names_the_section_and_its_fields():
  config = config_dict.ConfigDict({'pool': {'block_size': 16, 'kind': 'paged'}, 'seed': 0})
  argv = ['prog', '--config=c.py', '--config.pool.block_size=8']
  assert cli.unknown_override(config, argv) is None
  assert cli.unknown_override(config, argv + ['--config.pool.foo=1']) == (
      "--config.pool.foo=1: config.pool has no field 'foo'; its fields: block_size, kind")
  assert cli.unknown_override(config, argv + ['--config.poool.kind=x']) == (
      "--config.poool.kind=x: config has no field 'poool'; its fields: pool, seed")
  assert 'config.seed is the value 0, not a section' in cli.unknown_override(
      config, argv + ['--config.seed.x=1'])


# ---- git state -------------------------------------------------------------------------------


def _git(repo, *args):
  subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@t', *args], cwd=repo,
                 check=True, capture_output=True)


@pytest.mark.skipif(shutil.which('git') is None, reason='needs git')
def test_git_state_does_not_rewrite_the_index(tmp_path):
  """Plain `git status` refreshes stale stat data and writes the index back (under
  index.lock, which makes a concurrent `git commit` in the checkout fail); a file touched
  since the last commit is exactly that case."""
  repo = tmp_path / 'repo'
  repo.mkdir()
  _git(repo, 'init', '-q')
  (repo / 'a.txt').write_text('a\n')
  _git(repo, 'add', 'a.txt')
  _git(repo, 'commit', '-q', '-m', 'a')
  head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=repo, capture_output=True,
                        text=True, check=True).stdout.strip()
  os.utime(repo / 'a.txt', ns=(10**18, 10**18))  # same content, new mtime: a stale index
  index = repo / '.git' / 'index'
  before = (index.read_bytes(), os.stat(index).st_mtime_ns)
  assert run_info.git_state(str(repo)) == {'git_revision': head, 'git_dirty': False}
  assert (index.read_bytes(), os.stat(index).st_mtime_ns) == before
  (repo / 'a.txt').write_text('changed\n')
  assert run_info.git_state(str(repo))['git_dirty'] is True


def test_git_state_unknown_outside_a_checkout_or_without_git(tmp_path, monkeypatch):
  monkeypatch.setenv('GIT_CEILING_DIRECTORIES', str(tmp_path))  # no repo above tmp_path
  assert run_info.git_state(str(tmp_path)) == {'git_revision': None, 'git_dirty': None}
  monkeypatch.setenv('PATH', str(tmp_path))  # no git executable at all
  assert run_info.git_state() == {'git_revision': None, 'git_dirty': None}


def test_missing_model_path_is_a_config_error(tmp_path):
  gguf = Config(model=ModelSection(source='gguf', path=str(tmp_path / 'nope.gguf')))
  with pytest.raises(ConfigError, match=r"config\.model\.path='.*nope\.gguf' is not allowed: "
                     'a .gguf file that exists'):
    cli.check_model_path(gguf)
  (tmp_path / 'nope.gguf').write_bytes(b'GGUF')
  cli.check_model_path(gguf)
  cli.check_model_path(Config())  # smollm2: the shipped file, no path


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = '''"""A made-up study: 100% of this line is its docstring."""
from absl import flags
from experiments import cli


def study(config, workdir, fast=False):
  print(f'fast={fast}')
  return {}


if __name__ == '__main__':
  cli.study_flag(flags.DEFINE_bool, 'fast', False, 'Take the short way.')
  cli.run_study('configs/thrashing.py', 'Study config.', study)
'''


def test_help_lists_config_workdir_the_study_flags_and_the_config_docstring(tmp_path):
  """Plain --help (absl lists the main module's key flags only): --config with its default,
  --workdir and the study's own flags, after the entry point's docstring and its config's."""
  entry = tmp_path / 'entry.py'
  entry.write_text(ENTRY)
  env = dict(os.environ, PYTHONPATH=REPO)
  run = subprocess.run([os.sys.executable, str(entry), '--help'], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
  assert run.returncode in (0, 1), run.stderr[-2000:]  # absl's --help exits 1
  out = run.stdout
  assert out.startswith('A made-up study: 100% of this line is its docstring.')
  assert 'Config configs/thrashing.py:\n\nThrashing: pool size against arrival rate' in out
  assert 'configs/thrashing.py:tiny --workdir=' in out  # the config's variants and commands
  flags_part = out[out.index('\nflags:'):]
  for flag in ('--config:', "(default: 'configs/thrashing.py')", '--workdir:', '--[no]fast:',
               'Take the short way.'):
    assert flag in flags_part, flag
  assert "(default: 'None')" not in flags_part and '--helpfull' in flags_part


def test_run_config_validates_first_then_reports_what_ran_and_wrote(tmp_path, capsys):
  """The same path as the command line: check sees the study's options; the study's files are
  listed (a directory of many as one line), the variant named in the first line."""
  from configs import default  # pylint: disable=import-outside-toplevel
  seen = {}

  def check(config, fast=False):
    seen['check'] = fast

  def study(config, workdir, fast=False):
    seen['study'] = fast
    run_info.write_json(os.path.join(workdir, 'summary.json'), {})
    for i in range(6):
      run_info.write_csv(os.path.join(workdir, 'rows', f'{i}.csv'), [{'a': i}])
    return 'done'

  config = default.get_config('tiny')
  config.title = 'Writes a few files'  # else the first line of the study module's docstring
  assert cli.run_config(study, config, str(tmp_path / 'w'), check=check, fast=True) == 'done'
  assert seen == {'check': True, 'study': True}
  out = capsys.readouterr().out.splitlines()
  assert out[0] == (f"Writes a few files [tiny variant: a smoke-size run of the same pipeline, "
                    f"not the study's figures] -> {tmp_path / 'w'}")
  assert out[1].startswith('wrote (') and out[2:] == [
      f"  {tmp_path / 'w' / 'summary.json'}", f"  {tmp_path / 'w' / 'rows'}/ (6 files)"]
  bad = default.get_config('tiny')
  bad.pool.block_size = 12
  with pytest.raises(ConfigError, match='config.pool.block_size=12'):
    cli.run_config(study, bad, str(tmp_path / 'never'))
  assert not (tmp_path / 'never').exists()  # refused before the workdir


def test_markdown_table_writes_numbers_plainly():
  table = run_info.markdown_table([{'a': 12345.6, 'b': 0.000123456, 'c': None, 'd': 'x'}],
                                  ['a', 'b', 'c', 'd'], digits=3)
  assert table.splitlines()[-1] == '| 12346 | 0.000123 |  | x |'


def test_report_trace_names_the_files_and_the_viewer(tmp_path, capsys):
  run_dir = tmp_path / 'plugins' / 'profile' / '2026_01_01'
  run_dir.mkdir(parents=True)
  (run_dir / 'host.trace.json.gz').write_bytes(b'')
  (run_dir / 'host.xplane.pb').write_bytes(b'')
  assert len(cli.report_trace(str(tmp_path))) == 2
  out = capsys.readouterr().out
  assert f'xprof --logdir={tmp_path} --port=8791' in out and 'requirements-profile.txt' in out
  assert f'load {run_dir / "host.trace.json.gz"} at https://ui.perfetto.dev' in out
  with open(os.path.join(REPO, cli.PROFILE_REQUIREMENTS)) as f:
    assert re.search(r'^xprof==\d+\.\d+\.\d+$', f.read(), re.M)  # a pinned version
