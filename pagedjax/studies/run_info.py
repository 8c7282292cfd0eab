"""What every experiment records next to its figures (config and its variant, versions, device,
git revision, machine load), and how it writes them: atomically, so an interrupted run leaves the previous file, never half
of one."""
import contextlib
import csv
import json
import os
import platform
import secrets
import subprocess
from typing import Optional

import jax

GIT_TIMEOUT_S = 10


def git_state(cwd: Optional[str] = None) -> dict:
  """{'git_revision': full HEAD hash, 'git_dirty': tracked files modified} of the checkout at
  cwd (default: the one holding this package); None for what cannot be known.

  Read-only on the checkout: plain `git status` refreshes the index's stat data and writes it
  back under index.lock, and a `git commit` or `git add` that runs meanwhile (in the same
  checkout, by someone else) fails on that lock. --no-optional-locks (and GIT_OPTIONAL_LOCKS=0,
  its environment form) skip that write. A missing git, a directory outside any checkout or a
  hung git give None, never a failed run.
  """
  cwd = cwd or os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, GIT_OPTIONAL_LOCKS='0')

  def git(*args) -> Optional[str]:
    try:
      done = subprocess.run(['git', '--no-optional-locks', *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):  # no git, no such cwd, timeout
      return None
    return done.stdout if done.returncode == 0 else None

  rev = git('rev-parse', 'HEAD')
  status = git('status', '--porcelain', '--untracked-files=no') if rev else None
  return {'git_revision': rev.strip() if rev else None,
          'git_dirty': None if status is None else bool(status.strip())}


def environment() -> dict:
  import flax
  import numpy as np
  devices = jax.devices()
  return {
      **git_state(),
      'versions': {'python': platform.python_version(), 'jax': jax.__version__,
                   'jaxlib': jax.lib.__version__ if hasattr(jax.lib, '__version__') else None,
                   'flax': flax.__version__, 'numpy': np.__version__},
      'device': {'backend': jax.default_backend(), 'kind': devices[0].device_kind,
                 'count': len(devices), 'cpu': platform.processor() or platform.machine(),
                 'cpu_count': os.cpu_count()},
      # 1, 5 and 15 minute load averages when the summary is written: on a shared machine,
      # other work moves every timed figure.
      'load_average': list(os.getloadavg()) if hasattr(os, 'getloadavg') else None,
  }


def summary_fields(config) -> dict:
  """What every study's summary.json carries besides its figures: the config's variant ('full',
  or e.g. 'tiny': a smoke-size run, not the study's figures), the whole config, and
  environment()."""
  return {'variant': str(config.get('variant', None) or 'full'), 'config': config.to_dict(),
          **environment()}


@contextlib.contextmanager
def atomic_write(path: str, mode: str = 'w', **open_kwargs):
  """A new file object whose contents replace `path` only when the block completes.

  It is a temporary file in the same directory (the same filesystem, so os.replace is atomic),
  flushed and fsynced before the replace: readers see the old file or the whole new one, and an
  exception, a kill or a full disk leaves the old one. mode is 'w' or 'wb'; open_kwargs go to
  open (newline='' for csv).
  """
  if mode not in ('w', 'wb'):
    raise ValueError(f'atomic_write mode={mode!r} is not allowed: w or wb')
  directory, name = os.path.split(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  # Created by open() ('x': never an existing file) so the umask applies, as for a plain open;
  # mkstemp would leave it readable by its owner only.
  tmp = os.path.join(directory, f'.{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp')
  try:
    with open(tmp, mode.replace('w', 'x'), **open_kwargs) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def write_json(path: str, data: dict) -> None:
  """data as indented JSON, atomically (see atomic_write)."""
  with atomic_write(path) as f:
    json.dump(data, f, indent=2, default=str)
    f.write('\n')


def write_csv(path: str, rows: list, columns=None) -> None:
  """rows (dicts) as a CSV of `columns` (other keys left out), atomically. columns None: every
  scalar key in first-seen order (lists and dicts, e.g. timelines, stay in the JSON files)."""
  if columns is None:
    columns = []
    for row in rows:
      columns += [k for k, v in row.items()
                  if k not in columns and not isinstance(v, (list, dict))]
  with atomic_write(path, newline='') as f:
    writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction='ignore')
    writer.writeheader()
    writer.writerows(rows)


def markdown_table(rows: list, columns, digits: int = 3) -> str:
  """rows (dicts) as a markdown table of `columns`; floats to `digits` significant digits (whole
  numbers from 10**digits up, never 1.2e+04), None blank."""
  def fmt(v):
    if v is None:
      return ''
    if isinstance(v, float):
      return f'{v:.0f}' if abs(v) >= 10**digits and v == v and abs(v) != float('inf') else (
          f'{v:.{digits}g}')
    return str(v)
  lines = ['| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(fmt(r.get(k)) for k in columns) + ' |' for r in rows]
  return '\n'.join(lines)
