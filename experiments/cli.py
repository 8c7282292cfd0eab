"""What every experiment entry point shares: its --config/--workdir flags, the checks it makes
before any model loads, and errors that read as one line instead of a traceback.

  if __name__ == '__main__':
    cli.define_flags('configs/default.py', 'Experiment config.')
    cli.run(main)           # main reads flags.FLAGS.config and flags.FLAGS.workdir

A config or request error (pagedjax.config.ConfigError, RequestError, a bad --workdir, an
override of a field the config does not have, a config file that does not load) prints
`error: <what, the value, what is allowed>` to stderr and exits with status 2. Anything else is
a bug and keeps its traceback.
"""
import contextlib
import fcntl
import os
import re
import sys
import tempfile
from typing import Optional

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_dict
from ml_collections import config_flags

from pagedjax.config import ConfigError, validate_config
from pagedjax.host.intake import RequestError  # pagedjax.engine.RequestError is this class

EXIT_USAGE = 2
_CONFIG_FLAG = re.compile(r'^--?config(=|$)')
_OVERRIDE_FLAG = re.compile(r'^--?(?:no)?config\.([^=]+)(?:=(.*))?$')
_DEFAULT_CONFIG = [None]  # the config file used when the command line names none
_HELD_LOCKS = {}  # realpath of a locked workdir -> its open lock file (this process's)


class WorkdirError(ValueError):
  """An output directory that cannot be used; the message names it and why."""


USER_ERRORS = (ConfigError, RequestError, WorkdirError)


def fail(message: str) -> None:
  """The one line a user error gets, then exit."""
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(EXIT_USAGE)


def define_flags(default_config: Optional[str], help_string: str, lock_config: bool = True):
  """--config (a config file, `path.py:arg`, with --config.a.b=value overrides) and --workdir.

  The config flag is defined without a default: ml_collections parses a default file, with the
  command line's overrides, the moment the flag is defined, where an unknown override field
  would raise before anything could report it. parse_flags puts the default on the command
  line instead.
  """
  _DEFAULT_CONFIG[0] = default_config
  help_string += f' Default: {default_config}.' if default_config else ' Required.'
  config_flags.DEFINE_config_file('config', None, help_string, lock_config=lock_config)
  flags.DEFINE_string('workdir', None, 'Output directory (created if missing).', required=True)


def _last_line(error: BaseException) -> str:
  lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
  return lines[-1] if lines else type(error).__name__


def _config_path(argv) -> Optional[str]:
  for i, arg in enumerate(argv[1:], 1):
    if _CONFIG_FLAG.match(arg):
      if '=' in arg:
        return arg.split('=', 1)[1]
      return argv[i + 1] if i + 1 < len(argv) else None
  return None


def unknown_override(config, argv) -> Optional[str]:
  """The first --config.a.b=value whose field the config lacks, as one line naming the fields
  it has there; None if every override names an existing field."""
  for arg in argv[1:]:
    match = _OVERRIDE_FLAG.match(arg)
    if not match:
      continue
    names, node = match.group(1).split('.'), config
    for i, name in enumerate(names):
      where = '.'.join(['config'] + names[:i])
      if not isinstance(node, config_dict.ConfigDict):
        return f'{arg}: {where} is the value {node!r}, not a section with fields'
      if name not in node:
        return (f'{arg}: {where} has no field {name!r}; its fields: '
                f'{", ".join(sorted(node.keys()))}')
      node = node[name]
  return None


def parse_flags(argv):
  """absl's flag parsing (for app.run's flags_parser), with config errors as one line."""
  if _DEFAULT_CONFIG[0] and not any(_CONFIG_FLAG.match(a) for a in argv[1:]):
    argv = [argv[0], f'--config={_DEFAULT_CONFIG[0]}', *argv[1:]]
    # ml_collections reads the overrides from sys.argv itself, and orders them against --config.
    sys.argv[:] = argv
  path = _config_path(argv)
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:  # a bad value for a flag, a missing required flag
    message = str(e)
    if 'Error whilst parsing config file' in message:  # get_config raised: its own words
      message = f'--config={path}: {_last_line(e)}'
    fail(message.replace('\n', ' '))
  except (AttributeError, KeyError, IndexError, TypeError, ValueError, OSError) as e:
    # ml_collections on an override of a field the config does not have (its message is just
    # the field name), or on overrides of a config file that did not load.
    message = None
    if path is not None:
      with contextlib.suppress(Exception):  # diagnosing only: the file may not load at all
        # The flag's parser loads the file alone; the overrides are the flag's own doing.
        message = unknown_override(flags.FLAGS['config'].parser.parse(path), argv)
    fail(message or f'--config={path}: {_last_line(e)}')
  if path is None:
    fail('--config is required: a config file, e.g. --config=configs/ablate_block_size.py')
  config = flags.FLAGS.config
  try:
    config.keys()  # a file that failed to load is a placeholder raising on any access
  except (OSError, AttributeError) as e:
    fail(f'--config={path}: the config file does not load: {_last_line(e)}')
  return rest


def run(main) -> None:
  """app.run(main) with parse_flags, and USER_ERRORS from main reported as one line."""
  def guarded(argv):
    quiet_libraries(sys.argv)
    try:
      return main(argv)
    except USER_ERRORS as e:
      fail(str(e).replace('\n', ' '))
  app.run(guarded, flags_parser=parse_flags)


def run_study(default_config: str, help_string: str, study, check=None) -> None:
  """The whole `__main__` of a study: --config (default_config) and --workdir flags; the config
  validated (and checked by `check(config)`, if given) before the workdir is made; then
  study(config, workdir) under the workdir's lock, user errors reported as one line."""
  define_flags(default_config, help_string, lock_config=False)

  def main(argv):
    del argv
    config = validate_config(flags.FLAGS.config)
    if check is not None:
      check(config)
    workdir = prepare_workdir(flags.FLAGS.workdir)
    with lock_workdir(workdir, 'study'):
      study(config, workdir)
  run(main)


def quiet_libraries(argv) -> None:
  """Runs print results, not library logs: absl's default INFO level would show every
  checkpoint-library line (32 of them on a first SmolLM2 load). WARNING unless the command line
  asks for a level (--verbosity / -v, absl's own flags, which then win)."""
  if not any(a.startswith(('--verbosity', '-v=', '--v=')) or a == '-v' for a in argv[1:]):
    logging.set_verbosity(logging.WARNING)


def check_model_path(typed) -> None:
  """A gguf/safetensors model.path that is not there, refused before anything loads (the
  weights loader would find out only after the backend and the run had started)."""
  m = typed.model
  if m.source in ('gguf', 'safetensors') and not os.path.exists(m.path):
    kind = 'a .gguf file' if m.source == 'gguf' else 'an HF model directory'
    raise ConfigError(f'config.model.path={m.path!r} is not allowed: {kind} that exists '
                      f'(model.source={m.source!r})')


def prepare_workdir(path: Optional[str]) -> str:
  """The output directory as an absolute path, created if missing and checked writable, before
  any model loads or anything runs: a run should fail before its work, not after it."""
  if path is None or not path.strip():
    raise WorkdirError('--workdir is empty: give the directory for the outputs, e.g. '
                       '--workdir=runs/NAME')
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f'--workdir={path} is an existing file, not a directory')
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f'--workdir={path} cannot be created: {e.strerror or e}') from None
  try:  # access() is not the answer on every filesystem: write something
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise WorkdirError(f'--workdir={path} is not writable: {e.strerror or e}') from None
  return path


@contextlib.contextmanager
def lock_workdir(workdir: str, what: str = 'sweep'):
  """Holds an exclusive flock on workdir/.lock, so two runs cannot append to one results file;
  the kernel releases it when the process exits however it exits. Re-entrant in a process
  (reproduce_memory holds it around run_sweep, which takes it too)."""
  key = os.path.realpath(workdir)
  if key in _HELD_LOCKS:
    yield
    return
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, '.lock')
  f = open(path, 'a+')
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.seek(0)
    holder = f.read().strip()
    f.close()
    raise WorkdirError(
        f'--workdir={workdir} is in use by another {what} ({holder or "a process"} holds '
        f'{path}); wait for it to finish, or give another --workdir') from None
  try:
    f.truncate(0)
    f.write(f'pid {os.getpid()}\n')
    f.flush()
    _HELD_LOCKS[key] = f
    yield
  finally:
    _HELD_LOCKS.pop(key, None)
    f.close()  # releases the flock
