"""The prefix cache's chain keys in C (csrc/chain_keys.c), compiled at first use; host code,
no jax.

`chain_keys_fn()` returns the C module's `chain_keys(token_ids, start, num_blocks, block_size,
head)`, or None where it cannot be built or loaded (`unavailable_reason()` says why); the
prefix cache then keeps its pure-Python loop, which computes the same keys
(tests/test_cluster_routing.py checks both against block_key). The C loop reads the ids as
int64 and hashes each block with BLAKE2b-64 without the interpreter's per-block work: on the
Mooncake trace's longest prompt (235 blocks of 64) it took half the Python loop's time
(docs/cluster.md, Routing cost).

Build: the C compiler (`$CC`, default cc) with the running Python's headers, into
`~/.cache/pagedjax/host/` (`$PAGEDJAX_HOST_CACHE` overrides the directory), named by a hash of the
source, the flags, the compiler's version and the Python build, written to a temporary file and
renamed, as the native kernels are (kernels/cpu.py). `PAGEDJAX_NATIVE_KEYS=0` turns it off.
"""
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig

from pagedjax import native_build

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'csrc', 'chain_keys.c')
CFLAGS = ('-O3', '-std=c99', '-fPIC', '-shared')
_BUILD_TIMEOUT_S = 120
_reason = None


def cache_dir() -> str:
  """$PAGEDJAX_HOST_CACHE, else ~/.cache/pagedjax/host."""
  return os.path.expanduser(os.environ.get('PAGEDJAX_HOST_CACHE', '~/.cache/pagedjax/host'))


def _compiler() -> str:
  return os.environ.get('CC', 'cc')


def module_path(cc: str) -> str:
  """The cached module's path for this source, flags, compiler and Python build."""
  done = subprocess.run([cc, '--version'], capture_output=True, text=True, timeout=60,
                        check=True)
  key = hashlib.sha256()
  with open(SOURCE, 'rb') as f:
    key.update(f.read())
  suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
  for part in (*CFLAGS, cc, done.stdout.splitlines()[0] if done.stdout else '', sys.version,
               suffix, sysconfig.get_paths()['include']):
    key.update(part.encode() + b'\0')
  return os.path.join(cache_dir(), f'_chain_keys-{key.hexdigest()[:16]}{suffix}')


def build() -> str:
  """Compiles the module into the cache unless it is there -> its path. RuntimeError naming the
  compiler and its last error lines when it cannot."""
  cc = _compiler()
  try:
    path = module_path(cc)
  except (OSError, subprocess.SubprocessError) as e:
    raise RuntimeError(f'no working C compiler {cc!r} ($CC): {e}') from None
  include = sysconfig.get_paths()['include']
  if not os.path.exists(path) and not os.path.exists(os.path.join(include, 'Python.h')):
    raise RuntimeError(f"this Python's headers are not installed (no Python.h in {include})")
  return native_build.compile_once([cc, *CFLAGS, '-I', include, SOURCE], path,
                                   f'the chain-key module with {cc!r}', _BUILD_TIMEOUT_S)


@functools.lru_cache(maxsize=None)
def chain_keys_fn():
  """The C chain_keys, built and loaded once per process; None where it is turned off or
  cannot be built (unavailable_reason)."""
  global _reason
  if os.environ.get('PAGEDJAX_NATIVE_KEYS', '1') == '0':
    _reason = 'turned off (PAGEDJAX_NATIVE_KEYS=0)'
    return None
  try:
    path = build()
    spec = importlib.util.spec_from_file_location('_chain_keys', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  except (RuntimeError, OSError, ImportError) as e:
    _reason = str(e)
    return None
  return module.chain_keys


def available() -> bool:
  return chain_keys_fn() is not None


def unavailable_reason():
  """Why available() is False (None when it is True)."""
  chain_keys_fn()
  return _reason
