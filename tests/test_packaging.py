"""A non-editable install holds the whole library: a wheel built from setup.py has every package
under pagedjax/, the kernels/ folder as `pagedjax.kernels` (never a top-level `kernels`, a name
other libraries use), none of tests/, experiments/, configs/, and the installed tree alone runs an engine
(a tiny random Llama decoding) and the simulator.

CI installs the repo editable, where a package setup.py forgot still imports (from the source
tree), so this builds a real wheel: from a copy of the repo (setuptools writes build/ and
*.egg-info beside setup.py), offline (`--no-index --no-build-isolation`: the venv's own
setuptools), then installs it into a folder and imports from there in a fresh interpreter that
neither sees the repo nor runs the venv's .pth files (the editable install's import hook would
otherwise serve a missing subpackage from the source tree).
"""
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOT_INSTALLED = ('tests', 'experiments', 'configs')
# Outputs and environments that never belong in a build (see .gitignore).
NOT_COPIED = ('.git', '.venv', 'runs', 'build', '*.egg-info', '__pycache__', '.hypothesis',
              '.pytest_cache', '.cache', 'workdir*', '.whl')


def installed_path(path: pathlib.Path) -> pathlib.PurePosixPath:
  """Where a source file lands in the wheel: kernels/ installs as pagedjax/kernels/ (the link
  pagedjax/kernels -> ../kernels; rglob does not follow it, so kernels/ is walked itself)."""
  rel = pathlib.PurePosixPath(path.relative_to(ROOT))
  return pathlib.PurePosixPath('pagedjax') / rel if rel.parts[0] == 'kernels' else rel


def source_files(pattern):
  return sorted(installed_path(p) for top in ('pagedjax', 'kernels')
                for p in (ROOT / top).rglob(pattern) if '__pycache__' not in p.parts)


def source_packages():
  """Every package of the library and the kernels: each folder holding an __init__.py."""
  return sorted('.'.join(init.parent.parts) for init in source_files('__init__.py'))


def run(cmd, cwd, **kwargs):
  done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, check=False,
                        **kwargs)
  assert done.returncode == 0, f'{cmd}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}'
  return done.stdout


@pytest.mark.slow
def test_wheel_holds_every_package_and_runs_the_engine_and_the_simulator(tmp_path):
  packages = source_packages()
  assert {'pagedjax', 'pagedjax.sim', 'pagedjax.kernels'} <= set(packages), packages
  source = tmp_path / 'source'
  shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_COPIED))
  pip = [sys.executable, '-m', 'pip', '--disable-pip-version-check', '--no-input', '-q']
  run(pip + ['wheel', '--no-deps', '--no-build-isolation', '--no-index',
             '--wheel-dir', str(tmp_path / 'wheels'), str(source)], cwd=tmp_path)
  (wheel,) = (tmp_path / 'wheels').glob('pagedjax-*.whl')

  names = zipfile.ZipFile(wheel).namelist()
  in_wheel = sorted(n[:-len('/__init__.py')].replace('/', '.') for n in names
                    if n.endswith('/__init__.py'))
  assert in_wheel == packages, f'wheel packages {in_wheel}, source packages {packages}'
  for top in NOT_INSTALLED + ('kernels',):
    assert not any(n.startswith(top + '/') for n in names), f'{top}/ is in the wheel'
  # Every module of the source tree is in the wheel, not only each package's __init__.
  modules = [str(p) for p in source_files('*.py')]
  assert sorted(set(modules) - set(names)) == []
  # and the C sources built at first use (the kernels, the prefix cache's chain keys)
  assert {'pagedjax/kernels/csrc/linear_cpu.cc',
          'pagedjax/host/cache/csrc/chain_keys.c'} <= set(names), names

  site = tmp_path / 'site'
  run(pip + ['install', '--no-deps', '--no-index', '--target', str(site), str(wheel)],
      cwd=tmp_path)
  # -S: no site module, so no .pth files (the editable hook); -P: the cwd is not on sys.path.
  # The venv's site-packages is appended by hand for numpy and the other dependencies.
  probe = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {str(site)!r})
      sys.path.append({sysconfig.get_paths()['purelib']!r})
      sys.path.append({sysconfig.get_paths()['platlib']!r})
      assert not any(p.rstrip('/') == {str(ROOT)!r} for p in sys.path), sys.path
      import importlib
      for name in {packages!r}:
        module = importlib.import_module(name)
        assert module.__file__.startswith({str(site)!r}), (name, module.__file__)
      from pagedjax.sim import cost_model, hardware
      assert cost_model.__file__.startswith({str(site)!r}), cost_model.__file__
      # The installed library runs: a decode on a tiny random Llama (the main job's engine with
      # :tiny's model), and a simulated engine of a preset on a preset accelerator.
      import pagedjax
      from pagedjax import sizing
      from pagedjax.sim import simulated_device
      config = pagedjax.Config(model=pagedjax.ModelSection(source='random'),
                               pool=pagedjax.PoolConfig(num_blocks=32, block_size=16))
      engine = pagedjax.build_engine(config)
      (done,) = engine.generate(['The capital of France is'],
                                pagedjax.SamplingParams(max_new_tokens=4))
      assert len(done.output_ids) == 4, done
      sim = simulated_device.simulated_engine(
          sizing.get_preset('llama3-8b'), hardware.get_hardware('h100-sxm'),
          pagedjax.Config(pool=pagedjax.PoolConfig(num_blocks=256, block_size=16)))
      finished = sim.generate([list(range(1, 200))] * 3, pagedjax.SamplingParams(max_new_tokens=8))
      assert [len(c.output_ids) for c in finished] == [8, 8, 8] and sim.clock > 0
      print('ok', len({packages!r}))
      """)
  out = run([sys.executable, '-S', '-P', '-c', probe], cwd=tmp_path)
  assert out.strip() == f'ok {len(packages)}'
