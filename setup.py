"""pagedjax: LLM decoding in JAX with a paged KV cache (library `pagedjax`, kernels `kernels`).

Experiments run from the repo root as `python -m experiments.NAME`; configs live in configs/.
"""
from setuptools import setup

setup(
    name='pagedjax',
    version='0.1.0',
    description='A readable JAX decode loop with a paged KV cache, for ablations',
    packages=['pagedjax', 'pagedjax.host', 'pagedjax.device', 'pagedjax.model', 'kernels'],
    python_requires='>=3.11',
    install_requires=[line.strip() for line in open('requirements.txt')
                      if line.strip() and not line.startswith('#')],
)
