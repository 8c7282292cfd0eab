"""pagedjax: LLM decoding in JAX with a paged KV cache (library `pagedjax`, kernels `pagedjax.kernels`).

The kernels live in the top-level kernels/ folder; pagedjax/kernels is a link to it, so they install
and import as `pagedjax.kernels` and never as a top-level `kernels` (a name other libraries use).

Experiments run from the repo root as `python -m experiments.NAME`; configs live in configs/.
"""
from setuptools import find_packages, setup

setup(
    name='pagedjax',
    version='0.1.0',
    description='A readable JAX decode loop with a paged KV cache, for ablations',
    # Every subpackage of the library, the kernels included (through the pagedjax/kernels link);
    # tests, experiments and configs run from the repo and are not installed
    # (tests/test_packaging.py builds a wheel and checks).
    packages=find_packages(include=['pagedjax', 'pagedjax.*']),
    # The native CPU kernel's C++ sources: kernels/cpu.py compiles them at first use (into
    # ~/.cache/pagedjax/kernels, against the installed jaxlib's FFI headers), not at install.
    # The prefix cache's C chain keys (pagedjax/host/cache/native_keys.py) build the same way,
    # into ~/.cache/pagedjax/host.
    package_data={'pagedjax.kernels': ['csrc/*.cc', 'csrc/*.inc'],
                  'pagedjax.host.cache': ['csrc/*.c']},
    python_requires='>=3.11',
    install_requires=[line.strip() for line in open('requirements.txt')
                      if line.strip() and not line.startswith('#')],
)
