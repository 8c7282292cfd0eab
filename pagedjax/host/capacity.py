"""Whether a host-side KV store of some number of blocks fits where it would live: host RAM
(tier 2, the swap tier, a 'memory://' disk tier) or a local file system (a directory disk tier).

Checked before anything is allocated, so a capacity no machine has is one error naming the
config field, its value and the most blocks that fit, not a MemoryError traceback (or numpy's
lazily committed zeros, a kill by the OOM killer once they are touched). The device pool gets
the same check in factory.check_pool_fits.

  host RAM   MemAvailable of /proc/meminfo (what the kernel can hand out without swapping),
             else the free physical pages (os.sysconf).
  a file store  shutil.disk_usage of the nearest existing directory of the store, plus the
             bytes the store itself holds already (a warm restart reuses its slots).
"""
import os
import shutil
from typing import Optional


class ConfigError(ValueError):
  """A config field with a value that is not allowed; the message names both and the choices.
  Defined here, without jax, so that host code checking a size against the machine raises the
  same error as config validation (pagedjax.config re-exports it)."""


def host_memory_available() -> int:
  """Bytes of host RAM the kernel can hand out now without swapping."""
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_AVPHYS_PAGES')


def _existing_ancestor(path: str) -> str:
  path = os.path.abspath(path)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return path


def _bytes_under(path: str) -> int:
  total = 0
  for folder, _, files in os.walk(path):
    for name in files:
      try:
        total += os.path.getsize(os.path.join(folder, name))
      except OSError:
        pass  # removed meanwhile
  return total


def disk_space_available(directory: str, need: int) -> int:
  """Bytes a store in `directory` may use: the file system's free space there, plus what the
  store already holds when the free space alone is short of `need` (it reuses those bytes)."""
  free = shutil.disk_usage(_existing_ancestor(directory)).free
  if free < need and os.path.isdir(directory):
    free += _bytes_under(directory)
  return free


def check_blocks_fit(field: str, num_blocks: int, block_bytes: int, available: int,
                     medium: str, detail: Optional[str] = None) -> None:
  """ConfigError unless num_blocks blocks of block_bytes fit in `available` bytes."""
  need = num_blocks * block_bytes
  if need <= available:
    return
  detail = f' ({detail})' if detail else ''
  raise ConfigError(
      f'config.{field}={num_blocks!r} is not allowed: {num_blocks:,} blocks of {block_bytes:,} '
      f'B need {need / 2**30:,.2f} GiB of {medium}{detail}, and {available / 2**30:,.2f} GiB '
      f'are available: at most {available // block_bytes:,} blocks fit')
