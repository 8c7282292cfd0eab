"""Compiling a native library once into a cache path: a build step, neither host nor device
code, and free of jax. The native CPU kernels (kernels/cpu.py) and the prefix cache's C chain
keys (host/cache/native_keys.py) build this way.
"""
import os
import subprocess
import tempfile


def compile_once(command, path: str, what: str, timeout_s: float) -> str:
  """Runs `command` + ['-o', TMP] unless `path` exists, then renames TMP to `path` (two
  processes building at once both end with a whole file) -> path. RuntimeError naming the
  command and its last error lines (or `what` and the OS error) when it cannot."""
  if os.path.exists(path):
    return path
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix='.so.tmp', dir=os.path.dirname(path))
  os.close(fd)
  command = [*command, '-o', tmp]
  try:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    if done.returncode != 0:
      tail = ' '.join(done.stderr.strip().splitlines()[-5:])
      raise RuntimeError(f'{" ".join(command)} failed ({done.returncode}): {tail}')
    os.replace(tmp, path)
  except (OSError, subprocess.SubprocessError) as e:
    raise RuntimeError(f'compiling {what} failed: {e}') from None
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path
