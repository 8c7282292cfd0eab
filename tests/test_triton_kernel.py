"""The `triton` path: its @triton.jit kernel under Triton's CPU interpreter, compiled for sm_90
from CPU, and (on a GPU with jax_triton) launched from JAX.

TRITON_INTERPRET must be set before the kernel is decorated, i.e. before kernels.triton is first
imported; this module sets it at import and checks that it took effect. Triton reads it when a
kernel is decorated or launched, so the Pallas paths (which do not use the triton package) are
unaffected.
"""
import os
import subprocess
import sys
import textwrap

os.environ.setdefault('TRITON_INTERPRET', '1')

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

from test_kernels import assert_close, make_case, poison, run  # pylint: disable=wrong-import-position

triton = pytest.importorskip('triton', reason='triton not installed (requirements-kernels.txt)')
pytest.importorskip('torch', reason='the interpreter runs on torch CPU tensors')
from kernels import triton as kt  # pylint: disable=g-import-not-at-top,wrong-import-position


def interpreted():
  from triton.runtime.interpreter import InterpretedFunction  # pylint: disable=import-outside-toplevel
  return isinstance(kt._kernel, InterpretedFunction)  # pylint: disable=protected-access


def launch(case):
  if not interpreted():
    pytest.skip('kernel not interpreted: TRITON_INTERPRET was not 1 when kernels.triton was '
                'first imported')
  return kt.launch_torch(case['q'], case['k_pages'], case['v_pages'], case['block_tables'],
                         case['context_lens'], case['q_positions'])


# (block_size, group, head_dim, num_q, dtype): the dot branch (bs >= 16) and the
# multiply-reduce branch (bs 8), decode and a prefill chunk, float32 and bfloat16.
CASES = [
    (16, 4, 64, 1, jnp.float32),
    (8, 3, 64, 3, jnp.float32),
    (32, 8, 128, 1, jnp.float32),
    (16, 1, 64, 4, jnp.bfloat16),
]


@pytest.mark.parametrize('block_size,group,head_dim,num_q,dtype', CASES)
def test_interpreted_kernel_matches_reference(block_size, group, head_dim, num_q, dtype):
  case = make_case(51, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
                   max_blocks=3, num_q=num_q, dtype=dtype)
  assert_close(launch(case), run(case, 'reference'), dtype)


def test_interpreted_kernel_isolation():
  case = make_case(52, num_kv_heads=2, group=4, head_dim=64, block_size=16, max_blocks=3)
  np.testing.assert_allclose(launch(poison(case, np.nan)), np.asarray(run(case, 'reference')),
                             atol=2e-5, rtol=0)


@pytest.mark.slow
def test_kernel_compiles_for_sm90():
  """Triton's own compiler (it ships ptxas) builds the kernel down to a cubin for the H200's
  sm_90 without a GPU: catches what the interpreter forgives (shapes, dot operands, types).
  In a subprocess: triton imported under TRITON_INTERPRET=1 cannot compile."""
  script = textwrap.dedent("""
      from kernels.triton import compile_ahead
      for block_size, rows, dtype in [(64, 16, 'fp32'), (16, 32, 'bf16'), (8, 16, 'fp32')]:
        kernel = compile_ahead(90, rows=rows, block_size=block_size, dtype=dtype)
        assert kernel.asm['cubin'], (block_size, rows, dtype)
      print('compiled')
  """)
  env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env['PYTHONPATH'] = os.pathsep.join([repo] + env.get('PYTHONPATH', '').split(os.pathsep))
  result = subprocess.run([sys.executable, '-c', script], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0 and 'compiled' in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != 'gpu', reason='jax_triton launches need a GPU')
@pytest.mark.parametrize('block_size,group,head_dim,num_q,dtype', CASES)
def test_jax_triton_launch_matches_reference(block_size, group, head_dim, num_q, dtype):
  pytest.importorskip('jax_triton')
  if interpreted():
    pytest.skip('TRITON_INTERPRET=1 in this process; run with TRITON_INTERPRET=0')
  case = make_case(53, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
                   max_blocks=3, num_q=num_q, dtype=dtype)
  assert_close(run(case, 'triton'), run(case, 'reference'), dtype)
