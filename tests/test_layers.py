"""The layers the folders promise: host bookkeeping runs without jax; device code never imports
the host or model packages; the library never imports the studies' helpers; the two sides agree
on the null block."""
import ast
import pathlib
import subprocess
import sys

import pagedjax

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOST = sorted('.'.join(p.relative_to(ROOT / 'pagedjax' / 'host').with_suffix('').parts)
              for p in (ROOT / 'pagedjax' / 'host').rglob('*.py') if p.stem != '__init__')


def test_every_host_module_imports_with_jax_unimportable():
  # A meta-path finder that refuses jax, flax, the device/model packages and the kernels: a host
  # module that reaches any of them fails to import.
  code = f'''
import importlib, sys
BLOCKED = ('jax', 'jaxlib', 'flax', 'kernels', 'pagedjax.kernels', 'pagedjax.device',
           'pagedjax.model', 'torch')
class Refuse:
  def find_spec(self, name, path=None, target=None):
    if any(name == b or name.startswith(b + '.') for b in BLOCKED):
      raise ImportError(f'host code imported {{name}}')
sys.meta_path.insert(0, Refuse())
for name in {HOST!r}:
  importlib.import_module('pagedjax.host.' + name)
assert not any(m.split('.')[0] in ('jax', 'flax') for m in sys.modules), 'jax got imported'
print('ok', len({HOST!r}))
'''
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                       check=False)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == f'ok {len(HOST)}'
  assert {'scheduling.allocator', 'scheduling.scheduler', 'scheduling.block_manager',
          'requests.intake', 'scheduling.step_inputs', 'cache.prefix_cache', 'tiers.kv_tiers',
          'policies'} <= set(HOST)


def _imported_modules(path: pathlib.Path):
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      yield node.module
      yield from (f'{node.module}.{alias.name}' for alias in node.names)


def test_device_code_never_imports_host_or_model_code():
  # The model builds on the pool (device/); the pool never reaches back (no import cycle).
  for path in (ROOT / 'pagedjax' / 'device').glob('*.py'):
    imported = list(_imported_modules(path))
    assert imported or path.name in ('__init__.py', 'traces.py'), path.name
    assert not [m for m in imported if m.startswith(('pagedjax.host', 'pagedjax.model'))], (
        path.name)


def test_the_library_never_imports_the_studies_helpers():
  library = [p for p in (ROOT / 'pagedjax').rglob('*.py')
             if 'studies' not in p.relative_to(ROOT / 'pagedjax').parts[:1]
             and 'kernels' not in p.relative_to(ROOT / 'pagedjax').parts[:1]]
  assert len(library) > 40
  for path in library:
    bad = [m for m in _imported_modules(path) if m.startswith('pagedjax.studies')]
    assert not bad, (path.relative_to(ROOT), bad)


def test_host_and_device_agree_on_the_null_block():
  from pagedjax.device import pool  # pylint: disable=import-outside-toplevel
  from pagedjax.host.scheduling import allocator  # pylint: disable=import-outside-toplevel
  assert pool.NULL_BLOCK == allocator.NULL_BLOCK == 0


def test_import_pagedjax_is_light_and_names_the_api():
  """`import pagedjax` loads no jax until a name that needs it is used."""
  code = ('import sys, pagedjax; assert "jax" not in sys.modules; '
          'print(sorted(pagedjax.__all__))')
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                       check=False)
  assert out.returncode == 0, out.stderr
  for name in pagedjax.__all__:
    assert getattr(pagedjax, name) is not None
