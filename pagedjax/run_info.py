"""What every experiment records next to its figures: config, versions, device, git revision."""
import json
import os
import platform
import subprocess

import jax


def environment() -> dict:
  import flax
  import numpy as np
  try:
    rev = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True,
                         cwd=os.path.dirname(__file__), check=False).stdout.strip() or None
    dirty = bool(subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'],
                                capture_output=True, text=True, check=False,
                                cwd=os.path.dirname(__file__)).stdout.strip())
  except OSError:
    rev, dirty = None, None
  devices = jax.devices()
  return {
      'git_revision': rev,
      'git_dirty': dirty,
      'versions': {'python': platform.python_version(), 'jax': jax.__version__,
                   'jaxlib': jax.lib.__version__ if hasattr(jax.lib, '__version__') else None,
                   'flax': flax.__version__, 'numpy': np.__version__},
      'device': {'backend': jax.default_backend(), 'kind': devices[0].device_kind,
                 'count': len(devices), 'cpu': platform.processor() or platform.machine(),
                 'cpu_count': os.cpu_count()},
  }


def write_json(path: str, data: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(data, f, indent=2, default=str)
    f.write('\n')
