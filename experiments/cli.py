"""What every experiment entry point shares: its --config/--workdir flags and --help, the checks
it makes before any model loads, errors that read as one line instead of a traceback, progress
bars, and the list of files a run wrote.

A study is `study(config, workdir, **options) -> summary dict`; its whole `__main__` is

  if __name__ == '__main__':
    cli.run_study('configs/NAME.py', 'What the config holds.', study, check=check)

and `python -m experiments.NAME --config=configs/NAME.py[:tiny] --workdir=DIR` then validates
the config (pagedjax/studies/workloads.py validate_config, then `check(config, **options)`), creates DIR,
holds its lock, prints what runs (the config's variant included), runs the study, and lists the
files it wrote. What a study itself does, the same way in every study:
  - prints a short table of its results (run_info.markdown_table) and writes it to table.md;
  - writes summary.json with run_info.summary_fields(config) (variant, config, versions, git
    state, machine load), a CSV of its rows (run_info.write_csv: one column per swept field and
    per figure) and its plots (experiments/plots.py: words, units, plots.save);
  - labels titles with variant_note(config) (`:tiny` runs say they are smoke-size);
  - wraps loops longer than a few seconds in progress(...), printing lines there with say(...).

The API (kept stable for new studies):
  run_study(default_config, help_string, study, check=None, validate=True)   a study's __main__
  run_config(study, config, workdir, check=None, validate=True, **options)   the same, no flags
  study_flag(flags.DEFINE_bool, 'calibrate', False, help)  a study's own flag, listed by --help,
                                                          passed to study and check by name
  progress(iterable, desc), say(line)            tqdm on stderr; a line that leaves it whole
  variant(config), variant_note(config)          'tiny'; ' [tiny variant: ...]' for titles
  refuse_swept_overrides(config, argv=None)      ConfigError for --config.X of a swept field
  check_fields(config, 'section', name=POSITIVE_INT, kind=one_of(KINDS), ...)  a section's
                                                 fields, each refused as one ConfigError line
  report_trace(profile_dir)                      after jax.profiler.stop_trace: path and viewer
  prepare_workdir, lock_workdir, check_model_path, fail, USER_ERRORS   the parts used above
validate=False is for a study whose base config is completed per point (simulate sizes each
point's pool from its device): its check validates every point instead.

Entry points that do not fit that shape (decode, bench_*) use the parts:

  if __name__ == '__main__':
    cli.define_flags('configs/default.py', 'Experiment config.')
    cli.run(main)           # main reads flags.FLAGS.config and flags.FLAGS.workdir

--help on any of them shows --config, --workdir and the entry point's own flags (key flags of
the main module; absl lists other modules' flags under --helpfull only), after the entry
point's docstring and its config file's (what the study measures, its commands, its variants).

A config or request error (pagedjax.config.ConfigError, RequestError, a bad --workdir, an
override of a field the config does not have, a config file that does not load) prints
`error: <what, the value, what is allowed>` to stderr and exits with status 2. Anything else is
a bug and keeps its traceback.
"""
import ast
import contextlib
import fcntl
import os
import re
import sys
import tempfile
import time
from typing import Callable, Optional

import tqdm

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_dict
from ml_collections import config_flags

from pagedjax.studies import run_info
from pagedjax.config import ConfigError
from pagedjax.studies.workloads import validate_config
from pagedjax.host.requests.intake import RequestError  # pagedjax.engine.RequestError is this class

EXIT_USAGE = 2
_CONFIG_FLAG = re.compile(r'^--?config(=|$)')
_OVERRIDE_FLAG = re.compile(r'^--?(?:no)?config\.([^=]+)(?:=(.*))?$')
_DEFAULT_CONFIG = [None]  # the config file used when the command line names none
_HELD_LOCKS = {}  # realpath of a locked workdir -> its open lock file (this process's)
_STUDY_FLAGS = []  # names of the flags study_flag defined: run_study passes them to the study


class WorkdirError(ValueError):
  """An output directory that cannot be used; the message names it and why."""


USER_ERRORS = (ConfigError, RequestError, WorkdirError)


def fail(message: str) -> None:
  """The one line a user error gets, then exit."""
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(EXIT_USAGE)


def define_flags(default_config: Optional[str], help_string: str, lock_config: bool = True):
  """--config (a config file, `path.py:arg`, with --config.a.b=value overrides) and --workdir,
  both key flags of the main module (so plain --help lists them), and the config file's
  docstring added to --help (see help_doc).

  The config flag is defined without a default: ml_collections parses a default file, with the
  command line's overrides, the moment the flag is defined, where an unknown override field
  would raise before anything could report it. parse_flags puts the default on the command
  line instead.
  """
  _DEFAULT_CONFIG[0] = default_config
  help_string += ' A Python file with get_config(arg); `file.py:arg` picks a variant (e.g. :tiny).'
  if not default_config:
    help_string += ' Required.'
  config = config_flags.DEFINE_config_file('config', None, help_string, lock_config=lock_config)
  if default_config:  # what --help shows as the default (the flag itself has none, see above)
    flags.FLAGS['config'].default_as_str = repr(default_config)
  workdir = flags.DEFINE_string('workdir', None, 'Output directory (created if missing).',
                                required=True)
  for holder in (config, workdir):
    _key_flag_of_main(holder.name)
  main = sys.modules.get('__main__')
  if main is not None:
    main.__doc__ = help_doc(main.__doc__, _config_path(sys.argv) or default_config)


def _key_flag_of_main(name: str) -> None:
  """Lists flag `name` in plain --help: absl shows there only the main module's key flags, and
  a flag defined here (experiments.cli) is this module's. absl names the main module by
  sys.argv[0] (flags.FLAGS.main_module_help)."""
  flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


def study_flag(define: Callable, name: str, default, help_string: str, **kwargs):
  """A flag of one study, e.g. study_flag(flags.DEFINE_bool, 'calibrate', False, 'help'):
  defined with `define` (any absl DEFINE_*), listed by plain --help next to --config and
  --workdir, and passed by run_study to the study as the keyword argument `name`. Returns the
  FlagHolder."""
  holder = define(name, default, help_string, **kwargs)
  _key_flag_of_main(name)
  if name not in _STUDY_FLAGS:
    _STUDY_FLAGS.append(name)
  return holder


def profile_dir_flag():
  """--profile_dir, for the entry points that trace warm steps (experiments.decode,
  bench_decode): defined by the first of them imported and shared by the rest, so one process
  can import several (the test suite does). Listed by plain --help; `.value` is the directory."""
  if 'profile_dir' not in flags.FLAGS:
    flags.DEFINE_string(
        'profile_dir', None, 'Write a jax.profiler trace of warm decode steps here (which steps: '
        "the entry point's docstring); the run prints the trace's path and the command that "
        'opens it (xprof, from requirements-profile.txt).')
  _key_flag_of_main('profile_dir')
  return flags.FLAGS['profile_dir']


def config_docstring(path: Optional[str]) -> Optional[str]:
  """The docstring of the config file `path` (or `path:arg`), read without running the file;
  None if there is none or the file does not read."""
  if not path:
    return None
  try:
    with open(path.split(':', 1)[0]) as f:
      return ast.get_docstring(ast.parse(f.read()))
  except (OSError, SyntaxError, ValueError):
    return None


def help_doc(entry_doc: Optional[str], config_path: Optional[str]) -> str:
  """--help's text above the flags: the entry point's docstring, then its config file's (the
  config of --config, or the default). absl %-formats this text with sys.argv[0], so every '%'
  is doubled."""
  parts = [(entry_doc or '').strip()]
  config_doc = config_docstring(config_path)
  if config_doc and config_doc.strip() not in parts[0]:
    parts.append(f'Config {config_path}:\n\n{config_doc.strip()}')
  return '\n\n'.join(p for p in parts if p).replace('%%', '%').replace('%', '%%') + '\n'


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


def run_study(default_config: str, help_string: str, study, check=None,
              validate: bool = True) -> None:
  """The whole `__main__` of a study: --config (default_config) and --workdir flags; then
  run_config with the parsed config and workdir, and every study_flag's value as a keyword of
  `study`; user errors reported as one line."""
  define_flags(default_config, help_string, lock_config=False)

  def main(argv):
    del argv
    options = {name: flags.FLAGS[name].value for name in _STUDY_FLAGS}
    run_config(study, flags.FLAGS.config, flags.FLAGS.workdir, check=check, validate=validate,
               **options)
  run(main)


def run_config(study, config, workdir: Optional[str], check=None, validate: bool = True,
               **options):
  """One study run, the same from the command line and from tests: the config validated
  (pagedjax/studies/workloads.py validate_config, unless validate is False: a study whose base config is
  completed per point, whose `check` validates each point) and checked by
  `check(config, **options)`, if given, before the workdir is made; a line saying what runs
  (with the config's variant: a `:tiny` run says it is one); study(config, workdir, **options)
  under the workdir's lock; then the files it wrote and the time it took. Returns the study's
  result."""
  if validate:
    config = validate_config(config)
  if check is not None:
    check(config, **options)
  workdir = prepare_workdir(workdir)
  print(f'{study_title(study, config)} -> {workdir}', flush=True)
  start, before = time.perf_counter(), _files(workdir)
  with lock_workdir(workdir, 'study'):
    result = study(config, workdir, **options)
  print(f'wrote ({time.perf_counter() - start:.1f} s):', flush=True)
  for line in written(workdir, before):
    print(f'  {line}')
  return result


def study_title(study, config) -> str:
  """config.title, else the first line of the study's module docstring; with the config's
  variant."""
  if config.get('title', None):
    return str(config.title) + variant_note(config)
  module = sys.modules.get(getattr(study, '__module__', ''), None)
  doc = (getattr(module, '__doc__', None) or getattr(study, '__name__', 'study')).strip()
  return doc.splitlines()[0].rstrip('.') + variant_note(config)


def variant(config) -> str:
  """The config's variant: `config.variant` as its get_config set it ('full' if unset)."""
  return str(config.get('variant', None) or 'full')


def variant_note(config) -> str:
  """'' for the full study; ' [tiny variant: ...]' (words for titles and stdout) otherwise."""
  name = variant(config)
  if name == 'full':
    return ''
  if name.startswith('tiny'):
    return f' [{name} variant: a smoke-size run of the same pipeline, not the study\'s figures]'
  return f' [{name} variant]'


def _files(workdir: str) -> dict:
  out = {}
  for root, _, names in os.walk(workdir):
    for name in names:
      path = os.path.join(root, name)
      with contextlib.suppress(OSError):
        st = os.stat(path)
        out[os.path.relpath(path, workdir)] = (st.st_mtime_ns, st.st_size)
  return out


def written(workdir: str, before: dict, per_directory: int = 4) -> list:
  """The files under workdir that are new or changed since `before` (_files), as lines; a top
  directory holding more than `per_directory` of them is one line with their count. Hidden files
  (the lock, temporaries) are left out."""
  changed = sorted(p for p, stat in _files(workdir).items()
                   if before.get(p) != stat and not any(
                       part.startswith('.') for part in p.split(os.sep)))
  by_top = {}
  for path in changed:
    top = path.split(os.sep)[0] if os.sep in path else ''
    by_top.setdefault(top, []).append(path)
  lines = []
  for top, paths in sorted(by_top.items()):
    if top and len(paths) > per_directory:
      lines.append(f'{os.path.join(workdir, top)}/ ({len(paths)} files)')
    else:
      lines += [os.path.join(workdir, p) for p in paths]
  return lines


def write_table(workdir: str, text: str, echo: bool = True) -> None:
  """A study's results table: WORKDIR/table.md (written atomically, one trailing newline) and,
  with echo, the same text on stdout."""
  with run_info.atomic_write(os.path.join(workdir, 'table.md')) as f:
    f.write(text.rstrip('\n') + '\n')
  if echo:
    print(text)


def progress(iterable=None, desc: str = '', **kwargs):
  """A tqdm progress bar on stderr for a loop of a study (results go to stdout). Lines printed
  during it should go through `say` so they do not tear the bar."""
  kwargs.setdefault('file', sys.stderr)
  kwargs.setdefault('dynamic_ncols', True)
  kwargs.setdefault('leave', False)
  return tqdm.tqdm(iterable, desc=desc, **kwargs)


def say(line: str) -> None:
  """A line on stdout that leaves any progress bar whole."""
  tqdm.tqdm.write(line, file=sys.stdout)
  sys.stdout.flush()


def _number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float(
      'inf')


# Rules for check_fields: (predicate, what is allowed, in words).
POSITIVE_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                'an integer >= 1')
INT = (lambda v: isinstance(v, int) and not isinstance(v, bool), 'an integer')
POSITIVE = (lambda v: _number(v) and v > 0, 'a finite number > 0')
NON_NEGATIVE = (lambda v: _number(v) and v >= 0, 'a finite number >= 0')
BOOL = (lambda v: isinstance(v, bool), 'True or False')


def one_of(allowed) -> tuple:
  return (lambda v: v in allowed, f'one of {tuple(allowed)}')


def list_of(rule, non_empty: bool = True) -> tuple:
  test, words = rule
  return (lambda v: isinstance(v, (list, tuple)) and (bool(v) or not non_empty) and all(
      test(x) for x in v), f'a {"non-empty " if non_empty else ""}list, each {words}')


def check_fields(config, section: str, **rules) -> None:
  """ConfigError `config.SECTION.FIELD=VALUE is not allowed: ...` for the first field of
  config.SECTION that breaks its rule (POSITIVE_INT, one_of(...), list_of(...), ...); a field
  the section lacks is named too."""
  if section not in config:
    raise ConfigError(f'config.{section} is missing: a section with {", ".join(rules)}')
  values = config[section]
  for field, (test, allowed) in rules.items():
    if field not in values:
      raise ConfigError(f'config.{section} has no field {field!r}: {allowed}')
    value = values[field]
    if isinstance(value, config_dict.ConfigDict) or not test(value):
      raise ConfigError(f'config.{section}.{field}={value!r} is not allowed: {allowed}')


def time_rounds(fns, rounds: int) -> dict:
  """fns: name -> zero-argument callable. The seconds of every timed call per name ({name:
  [t, ...]}): one warm-up call each (which compiles), then `rounds` rounds that call every fn
  once, in an order rotated round by round (a variant timed right after one that freed a large
  buffer pays for it; rotating spreads that over all, and load from other processes hits all
  alike). Each call is timed to the end of its work: its result is waited for
  (jax.block_until_ready; a fn returning nothing must return only when done)."""
  import jax  # pylint: disable=import-outside-toplevel
  for fn in fns.values():
    jax.block_until_ready(fn())
  names = list(fns)
  times = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      start = time.perf_counter()
      jax.block_until_ready(fns[name]())
      times[name].append(time.perf_counter() - start)
  return times


PROFILE_REQUIREMENTS = 'requirements-profile.txt'


def report_trace(profile_dir: str) -> list:
  """After jax.profiler.stop_trace(): prints where the trace went and how to open it (xprof,
  the optional extra in requirements-profile.txt, or Perfetto's web UI); returns the trace
  files."""
  profile_dir = os.path.abspath(profile_dir)
  traces = []
  for root, _, names in os.walk(profile_dir):
    traces += sorted(os.path.join(root, n) for n in names
                     if n.endswith(('.trace.json.gz', '.xplane.pb')))
  print(f'profile trace in {profile_dir}:')
  for path in traces:
    print(f'  {path}')
  print(f'open it with: xprof --logdir={profile_dir} --port=8791   (then http://localhost:8791; '
        f'pip install -r {PROFILE_REQUIREMENTS} installs xprof)')
  json_traces = [p for p in traces if p.endswith('.trace.json.gz')]
  if json_traces:
    print(f'or load {json_traces[-1]} at https://ui.perfetto.dev (no install)')
  return traces


def command_line_overrides(argv=None) -> list:
  """The dotted fields the command line overrides (--config.a.b=value: 'a.b')."""
  argv = sys.argv if argv is None else argv
  return [m.group(1) for m in map(_OVERRIDE_FLAG.match, argv[1:]) if m]


def refuse_swept_overrides(config, argv=None) -> None:
  """A sweep sets its swept fields per point, so a command-line override of one would be
  silently replaced at every point: ConfigError naming it, the points' values and what to do
  instead (cut or change config.sweep)."""
  swept = {}
  for point in config.get('sweep') or ():
    for key, value in dict(point).items():
      swept.setdefault(key, []).append(value)
  for field in command_line_overrides(argv):
    hits = [k for k in swept if k == field or k.startswith(field + '.')]
    if hits:
      values = sorted(set(map(str, swept[hits[0]])), key=lambda v: (len(v), v))
      raise ConfigError(
          f'--config.{field} is not allowed: config.sweep sets {hits[0]} per point '
          f'({", ".join(values)}) and would replace the override at each one; change the '
          'points (config.sweep in the config file, or a config file building on it) instead')


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
