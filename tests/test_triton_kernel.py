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

from test_kernels import (  # pylint: disable=wrong-import-position
    SPLIT_CASES, assert_close, make_case, poison, poison_quantized, quantize, run, run_quant,
    split_args, split_case)

triton = pytest.importorskip('triton', reason='triton not installed (requirements-kernels.txt)')
pytest.importorskip('torch', reason='the interpreter runs on torch CPU tensors')
from kernels import triton as kt  # pylint: disable=g-import-not-at-top,wrong-import-position
from kernels import paged_attention  # pylint: disable=g-import-not-at-top,wrong-import-position


def interpreted():
  from triton.runtime.interpreter import InterpretedFunction  # pylint: disable=import-outside-toplevel
  return isinstance(kt._kernel, InterpretedFunction)  # pylint: disable=protected-access


def launch(case, **kwargs):
  """The interpreted kernel on `case`, with its scales when it has some."""
  if not interpreted():
    pytest.skip('kernel not interpreted: TRITON_INTERPRET was not 1 when kernels.triton was '
                'first imported')
  scales = {n: case[n] for n in ('k_scales', 'v_scales') if n in case}
  return kt.launch_torch(case['q'], case['k_pages'], case['v_pages'], case['block_tables'],
                         case['context_lens'], case['q_positions'], **scales, **kwargs)


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


# (block_size, group, num_q): the dot branch and the multiply-reduce branch, decode and prefill.
QUANT_CASES = [(16, 4, 1), (8, 3, 3)]


@pytest.mark.parametrize('qdtype', [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize('block_size,group,num_q', QUANT_CASES)
def test_interpreted_kernel_quantized_matches_reference(qdtype, block_size, group, num_q):
  case = quantize(make_case(54, num_kv_heads=2, group=group, head_dim=64, block_size=block_size,
                            max_blocks=3, num_q=num_q), qdtype)
  assert_close(launch(case), run_quant(case, 'reference'), jnp.float32)


@pytest.mark.filterwarnings('ignore:invalid value:RuntimeWarning')  # NumPy meeting the poison
@pytest.mark.parametrize('qdtype,value', [(jnp.int8, np.nan), (jnp.float8_e4m3fn, np.inf)])
def test_interpreted_kernel_quantized_isolation(qdtype, value):
  case = quantize(make_case(55, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                            max_blocks=3, num_q=2), qdtype)
  poisoned = poison_quantized(case, value)
  assert not np.all(np.isfinite(np.asarray(poisoned['k_scales'])))  # the poison took
  np.testing.assert_allclose(launch(poisoned), np.asarray(run_quant(case, 'reference')),
                             atol=2e-5, rtol=0)


def stacked(case, other, layers=3, at=1):
  """`case`'s pages (and scales) as layer `at` of a pool whose other layers hold `other`'s."""
  names = [n for n in ('k_pages', 'v_pages', 'k_scales', 'v_scales') if n in case]
  return dict(case, **{n: jnp.stack([case[n] if i == at else other[n] for i in range(layers)])
                       for n in names})


@pytest.mark.parametrize('qdtype', [None, jnp.int8, jnp.float8_e4m3fn])
def test_interpreted_kernel_reads_the_right_layer(qdtype):
  """The model passes the whole [L, N, ...] pool and a layer index: the kernel must read that
  layer in place (first, middle and last, so a wrong stride shows) and match the one layer."""
  quant = (lambda c: quantize(c, qdtype)) if qdtype is not None else (lambda c: c)
  case = quant(make_case(56, num_kv_heads=2, group=2, head_dim=32, block_size=8, max_blocks=3))
  other = quant(make_case(57, num_kv_heads=2, group=2, head_dim=32, block_size=8, max_blocks=3))
  want = run_quant(case, 'reference') if qdtype is not None else run(case, 'reference')
  for at in range(3):
    assert_close(launch(stacked(case, other, at=at), layer=at), want, jnp.float32)


@pytest.mark.filterwarnings('ignore:invalid value:RuntimeWarning')  # NumPy meeting the poison
@pytest.mark.parametrize('splits,num_q,qdtype,layered', SPLIT_CASES)
def test_interpreted_kernel_context_split_matches_reference(splits, num_q, qdtype, layered):
  """Flash-decoding split (see test_kernels.split_case): short last split, splits that see
  nothing, a padded prefill query, poisoned unowned blocks and slots, quantized and stacked."""
  case, want = split_case(25, num_q, qdtype)
  args, kwargs = split_args(case, layered)
  scales = {n: kwargs.pop(n) for n in ('k_scales', 'v_scales') if n in kwargs}
  pooled = dict(case, k_pages=args[1], v_pages=args[2], **scales)
  assert_close(launch(pooled, context_splits=splits, **kwargs), want, jnp.float32)


def test_interpreted_kernel_rejects_bad_context_splits():
  case = make_case(60, num_kv_heads=2, group=2, head_dim=32, block_size=8, max_blocks=3)
  for bad in (0, -2):
    with pytest.raises(ValueError, match=f'got {bad}'):
      launch(case, context_splits=bad)


@pytest.mark.slow
def test_kernel_compiles_for_sm90():
  """Triton's own compiler (it ships ptxas) builds the kernel down to a cubin for the H200's
  sm_90 without a GPU: catches what the interpreter forgives (shapes, dot operands, types).
  In a subprocess: triton imported under TRITON_INTERPRET=1 cannot compile."""
  script = textwrap.dedent("""
      from kernels.triton import compile_ahead
      for block_size, rows, dtype, pages, splits in [
          (64, 16, 'fp32', None, 1), (16, 32, 'bf16', None, 1), (8, 16, 'fp32', None, 1),
          (16, 16, 'bf16', 'i8', 1), (8, 16, 'fp32', 'i8', 1), (64, 16, 'bf16', 'fp8e4nv', 1),
          (16, 16, 'bf16', None, 2), (8, 16, 'fp32', 'i8', 3), (64, 16, 'bf16', 'fp8e4nv', 4)]:
        kernel = compile_ahead(90, rows=rows, block_size=block_size, dtype=dtype,
                               page_dtype=pages, splits=splits)
        assert kernel.asm['cubin'], (block_size, rows, dtype, pages, splits)
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


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != 'gpu', reason='jax_triton launches need a GPU')
@pytest.mark.parametrize('qdtype', [None, jnp.int8, jnp.float8_e4m3fn])
def test_jax_triton_launch_quantized_layer_stacked(qdtype):
  """How the model calls it on GPU: a [L, N, ...] pool, a traced layer, optionally quantized."""
  pytest.importorskip('jax_triton')
  if interpreted():
    pytest.skip('TRITON_INTERPRET=1 in this process; run with TRITON_INTERPRET=0')
  quant = (lambda c: quantize(c, qdtype)) if qdtype is not None else (lambda c: c)
  case = quant(make_case(58, num_kv_heads=2, group=4, head_dim=64, block_size=16, max_blocks=3))
  other = quant(make_case(59, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                          max_blocks=3))
  pool = stacked(case, other, at=2)
  scales = {n: pool[n] for n in ('k_scales', 'v_scales') if n in pool}
  got = jax.jit(lambda layer: paged_attention(
      case['q'], pool['k_pages'], pool['v_pages'], case['block_tables'], case['context_lens'],
      case['q_positions'], impl='triton', layer=layer, **scales))(jnp.int32(2))
  want = run_quant(case, 'reference') if qdtype is not None else run(case, 'reference')
  assert_close(got, want, jnp.float32)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != 'gpu', reason='jax_triton launches need a GPU')
@pytest.mark.parametrize('splits,num_q,qdtype,layered', SPLIT_CASES + [(None, 1, None, True)])
def test_jax_triton_launch_context_split(splits, num_q, qdtype, layered):
  """The split kernel through jax_triton (partial outputs merged in JAX), under jit with a
  traced layer; None: the default heuristic, which splits this batch of 6 on any GPU."""
  pytest.importorskip('jax_triton')
  if interpreted():
    pytest.skip('TRITON_INTERPRET=1 in this process; run with TRITON_INTERPRET=0')
  case, want = split_case(25, num_q, qdtype)
  args, kwargs = split_args(case, layered)
  layer = kwargs.pop('layer', None)
  got = jax.jit(lambda args, kwargs, layer: kt.paged_attention_triton(
      *args, layer=layer, context_splits=splits, **kwargs))(args, kwargs, layer)
  assert_close(got, want, jnp.float32)
