"""Tensor parallelism (pagedjax/model/sharding.py): meshes of 1, 2, 4 and 8 devices against one device.

The mesh runs need 8 devices, so they run in one subprocess started with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (this file is its script, see `_worker`);
every other test keeps the single CPU device. The mesh runs use the reference kernel; the xla and
pallas_gpu (interpreted) kernels also run on a mesh of 4. The decode experiment runs on 4 fake
devices in one process, and across 2 processes of 2 devices joined by jax.distributed.

Tolerance: float32 logits within atol 1e-5 of the single-device run. The only numerical change is
summation order: o_proj and down_proj add per-device partial sums in an all-reduce, and the
vocab-sharded embedding lookup adds zeros (exact). Greedy outputs must be identical.
"""
import dataclasses
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import default
from pagedjax import factory, sizing
from pagedjax.model import sharding
from pagedjax.model.llama import ModelConfig, forward_dense, init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH_SIZES = (1, 2, 4, 8)
KERNELS = ('xla', 'pallas_gpu')  # also run on a mesh of 4 (the mesh runs use 'reference')
ATOL_F32 = 1e-5
# 8 query heads over 2 KV heads: mesh 2 splits KV heads, 4 and 8 replicate them (2x, 4x).
# vocab 100 divides by 2 and 4 (vocab-sharded) but not by 8 (replicated): both paths run.
MODEL = ModelConfig(vocab_size=100, d_model=32, num_layers=2, num_heads=8, num_kv_heads=2,
                    head_dim=8, ffn_dim=64, max_seq_len=128)
SMOLLM2 = ModelConfig(vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3,
                      head_dim=64, ffn_dim=1536, max_seq_len=8192)


def _cpu_env(**extra):
  """Subprocess environment on the CPU platform, also on a GPU/TPU host, so the fake devices
  are the default ones."""
  return dict(os.environ, JAX_PLATFORMS='cpu', **extra)


def _without_device_count(flags):
  """XLA_FLAGS less any device count (the test's own flags, such as tests/conftest.py's
  optimization level, stay)."""
  return ' '.join(f for f in flags.split() if 'xla_force_host_platform_device_count' not in f)


def _config(tp):
  config = default.get_config('tiny')
  config.pool.block_size = 8
  config.pool.num_blocks = 40
  config.engine.max_batch_size = 4
  config.engine.prefill_chunk = 16
  config.engine.max_seq_len = MODEL.max_seq_len
  config.mesh.model = tp
  # The config describes MODEL, so its mesh is checked against MODEL's heads.
  config.model.random.update(dict(vocab_size=MODEL.vocab_size, d_model=MODEL.d_model,
                                  num_layers=MODEL.num_layers, num_heads=MODEL.num_heads,
                                  num_kv_heads=MODEL.num_kv_heads, head_dim=MODEL.head_dim,
                                  ffn_dim=MODEL.ffn_dim, max_seq_len=MODEL.max_seq_len))
  return config


# ------------------------------------------------------------------------------------------------
# Validation (no devices needed)
# ------------------------------------------------------------------------------------------------
def test_validate_mesh_names_values_and_alternatives():
  tiny = ModelConfig(vocab_size=97, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, ffn_dim=128, max_seq_len=64)
  assert sharding.allowed_mesh_sizes(tiny) == [1, 2, 4]
  with pytest.raises(ValueError, match=r'config.mesh.model=3 does not split this model: '
                     r'num_heads=4 is not divisible by 3.*Allowed values .*: \[1, 2, 4\]'):
    sharding.validate_mesh(tiny, 3)
  # SmolLM2: 9 query heads, 3 KV heads, ffn 1536.
  assert sharding.allowed_mesh_sizes(SMOLLM2) == [1, 3]
  with pytest.raises(ValueError, match=r'num_heads=9 is not divisible by 2; num_kv_heads=3 is '
                     r'not divisible by 2.*\[1, 3\]'):
    sharding.validate_mesh(SMOLLM2, 2)
  with pytest.raises(ValueError, match=r'ffn_dim=1536 is not divisible by 9'):
    sharding.validate_mesh(SMOLLM2, 9)
  odd = dataclasses.replace(SMOLLM2, num_heads=12, ffn_dim=1536)
  with pytest.raises(ValueError, match=r'4 > num_kv_heads=3 but is not a multiple of it'):
    sharding.validate_mesh(odd, 4)
  assert sharding.validate_mesh(odd, 6) == 6  # replication: each KV head on 2 devices
  for bad in (0, -2, 1.5, True, '2'):
    for cfg in (tiny, None):  # None: a checkpoint whose shape is not known yet
      with pytest.raises(ValueError, match=r'an integer >= 1'):
        sharding.validate_mesh(cfg, bad)
  assert sharding.validate_mesh(None, 5) == 5


def test_validate_mesh_counts_devices():
  with pytest.raises(ValueError, match=r'config.mesh.model=4 needs 4 devices but only 2 .* '
                     r'device\(s\) are available.*allowed here: \[1, 2\]'):
    sharding.validate_mesh(MODEL, 4, num_devices=2)


def test_make_engine_rejects_a_mesh_larger_than_the_devices():
  if jax.device_count() >= 2:
    pytest.skip('this process has several devices')
  params = jax.eval_shape(lambda: init_params(MODEL))
  with pytest.raises(ValueError, match=r'mesh.model=2 needs 2 devices but only 1'):
    factory.make_engine(_config(2), MODEL, params, None)


def test_cpu_devices_cannot_be_added_once_the_backend_runs():
  jax.devices()  # the backend has started
  assert not sharding.request_cpu_devices(4)
  assert not sharding.request_cpu_devices(1)


def test_layout_and_sizing_per_device():
  layout = sharding.Layout.of(MODEL, 8)
  assert (layout.query_heads_per_device, layout.kv_heads_per_device,
          layout.kv_head_replication, layout.vocab_sharded) == (1, 1, 4, False)
  shape = sizing.from_model_config(MODEL)
  for tp, heads in ((1, 2), (2, 1), (4, 1), (8, 1)):
    got = sizing.pool_per_device(shape, num_blocks=40, block_size=8, kv_dtype='float32', tp=tp)
    per_token = 2 * MODEL.num_layers * heads * MODEL.head_dim * 4
    assert got['kv_heads_per_device'] == heads
    assert got['kv_bytes_per_token_per_device'] == per_token
    assert got['kv_pool_bytes_per_device'] == per_token * 40 * 8
    assert got['kv_capacity_tokens'] == 39 * 8


def test_param_specs_follow_the_megatron_split():
  untied = dataclasses.replace(MODEL, tie_embeddings=False, qkv_bias=True)
  shapes = jax.eval_shape(lambda: init_params(untied))
  specs = {'/'.join(sharding._names(path)): sharding.param_spec(sharding._names(path), untied, 4)
           for path, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]}
  assert specs['params/layers/attn/q_proj/kernel'] == P(None, None, 'model')
  assert specs['params/layers/attn/k_proj/bias'] == P(None, 'model')
  assert specs['params/layers/attn/o_proj/kernel'] == P(None, 'model', None)
  assert specs['params/layers/mlp/up_proj/kernel'] == P(None, None, 'model')
  assert specs['params/layers/mlp/down_proj/kernel'] == P(None, 'model', None)
  assert specs['params/embed/embedding'] == P('model', None)
  assert specs['params/lm_head/kernel'] == P(None, 'model')
  assert specs['params/final_norm/scale'] == P()
  assert sharding.param_spec(('params', 'embed', 'embedding'), untied, 8) == P(None, None)
  with pytest.raises(ValueError, match=r'no tensor-parallel rule for parameter params/x/w'):
    sharding.param_spec(('params', 'x', 'w'), untied, 2)


def test_pool_arrays_must_hold_kv_heads_on_axis_2():
  mesh = sharding.make_mesh(1)
  good = {'k': np.zeros((2, 4, 3, 8, 2), np.float32), 'scale': np.zeros((2, 4, 3, 8), np.float16)}
  pool = sharding.empty_pool_like(good, mesh, num_kv_heads=3)
  assert pool['scale'].dtype == np.float16 and not np.asarray(pool['k']).any()
  with pytest.raises(ValueError, match=r"pool array \['lanes'\] of shape \(2, 5\) does not hold "
                     r'the 3 KV heads on axis 2'):
    sharding.empty_pool_like({**good, 'lanes': np.zeros((2, 5))}, mesh, num_kv_heads=3)


def test_replicated_kv_heads_are_the_same_model():
  params = init_params(MODEL, seed=3)
  wide_cfg, wide = sharding.replicate_kv_heads(MODEL, params, 4)
  assert wide_cfg.num_kv_heads == 8
  tokens = jax.numpy.asarray(np.random.default_rng(0).integers(0, MODEL.vocab_size, (2, 11)))
  forward = jax.jit(forward_dense, static_argnums=0)
  np.testing.assert_allclose(forward(wide_cfg, wide, tokens), forward(MODEL, params, tokens),
                             atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------------
# Meshes of 1, 2, 4, 8 fake CPU devices (one subprocess)
# ------------------------------------------------------------------------------------------------
def _worker():
  """Runs in the 8-device subprocess; prints one JSON line of findings for the test to check."""
  import warnings  # pylint: disable=import-outside-toplevel
  from pagedjax.host.requests.sampling_params import SamplingParams  # pylint: disable=import-outside-toplevel
  params = init_params(MODEL, seed=1)
  rng = np.random.default_rng(0)
  # Lengths cross blocks of 8; all fit one prefill chunk, so each mesh compiles only two step
  # shapes (prefill, decode): chunked prefill is the same per-shard code, tested on one device.
  prompts = [rng.integers(0, MODEL.vocab_size, n).tolist() for n in (3, 8, 9, 16)]
  greedy = SamplingParams(max_new_tokens=6)
  report = {'device_count': jax.device_count()}
  base = None
  for tp in MESH_SIZES:
    engine = factory.make_engine(_config(tp), MODEL, params, None, record_logits=True)
    start_pool = engine.pool
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      done = engine.generate(prompts, greedy)
      compiled = engine.num_compilations
      engine.generate(prompts, greedy)  # same shapes: must not compile again
    logits = [np.stack(c.logits) for c in done]
    base = base or (done, logits)
    leaves = jax.tree_util.tree_leaves(engine.pool)
    report[tp] = {
        'outputs_equal': [c.output_ids for c in done] == [c.output_ids for c in base[0]],
        'max_logit_diff': max(float(np.abs(a - b).max()) for a, b in zip(logits, base[1])),
        'compilations': compiled,
        'recompilations': engine.num_compilations - compiled,
        'specs': [list(s) if s is not None else None for s in
                  {getattr(x.sharding, 'spec', None) for x in leaves}],
        'mesh_devices': sorted({len(x.sharding.device_set) for x in leaves}),
        'shard_shapes': sorted({str(s.data.shape) for x in leaves for s in x.addressable_shards}),
        'bytes_per_device': sorted(set(sharding.bytes_per_device(engine.pool).values())),
        'start_pool_donated': all(x.is_deleted() for x in jax.tree_util.tree_leaves(start_pool)),
        'warnings': [str(w.message) for w in caught],
    }
  # Kernels under shard_map: the plain-JAX path and the Pallas GPU kernel (interpreted on CPU).
  for impl in KERNELS:
    config = _config(4)
    config.attention.impl = impl
    done = factory.make_engine(config, MODEL, params, None, record_logits=True).generate(
        prompts, greedy)
    report[impl] = {
        'outputs_equal': [c.output_ids for c in done] == [c.output_ids for c in base[0]],
        'max_logit_diff': max(float(np.abs(np.stack(c.logits) - b).max())
                              for c, b in zip(done, base[1]))}
  print(json.dumps(report))


@pytest.fixture(scope='module')
def mesh_report():
  env = _cpu_env(XLA_FLAGS=(os.environ.get('XLA_FLAGS', '') +
                            ' --xla_force_host_platform_device_count=8').strip(),
                 PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')])))
  run = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads(run.stdout.strip().splitlines()[-1])
  assert report['device_count'] == 8
  return report


@pytest.mark.slow
@pytest.mark.parametrize('tp', MESH_SIZES)
def test_mesh_matches_single_device(mesh_report, tp):
  got = mesh_report[str(tp)]
  assert got['outputs_equal']
  assert got['max_logit_diff'] <= ATOL_F32, got['max_logit_diff']
  assert got['compilations'] == mesh_report['1']['compilations']
  assert got['recompilations'] == 0


@pytest.mark.slow
@pytest.mark.parametrize('tp', MESH_SIZES)
def test_pool_is_split_over_kv_heads_and_stays_split(mesh_report, tp):
  got = mesh_report[str(tp)]
  heads = max(MODEL.num_kv_heads // tp, 1)  # past 2 devices each holds one (replicated) head
  assert got['specs'] == ([[None, None, 'model']] if tp > 1 else [None])
  assert got['mesh_devices'] == [tp]
  assert got['shard_shapes'] == [str((MODEL.num_layers, 40, heads, 8, MODEL.head_dim))]
  assert got['bytes_per_device'] == [2 * MODEL.num_layers * 40 * heads * 8 * MODEL.head_dim * 4]
  # Every step donated the pool and got it back with the same sharding: the first pool's
  # buffers were consumed in place, no warning about unusable donations.
  assert got['start_pool_donated']
  assert not [w for w in got['warnings'] if 'donat' in w.lower()], got['warnings']


@pytest.mark.slow
@pytest.mark.parametrize('impl', KERNELS)
def test_kernels_run_per_shard(mesh_report, impl):
  got = mesh_report[impl]
  assert got['outputs_equal']
  assert got['max_logit_diff'] <= ATOL_F32, got['max_logit_diff']


DECODE_FLAGS = ['--config=configs/default.py:tiny', '--config.mesh.model=4',
                '--config.sampling.max_new_tokens=3', '--config.pool.num_blocks=64']


@pytest.fixture(scope='module')
def decode_on_four_fake_devices(tmp_path_factory):
  """The issue's command: mesh 4 on a one-device CPU (the run asks JAX for 4 CPU devices)."""
  workdir = tmp_path_factory.mktemp('decode_mesh4')
  env = _cpu_env(XLA_FLAGS=_without_device_count(os.environ.get('XLA_FLAGS', '')))
  run = subprocess.run([sys.executable, '-m', 'experiments.decode', *DECODE_FLAGS,
                        f'--workdir={workdir}'], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads((workdir / 'summary.json').read_text())


@pytest.mark.slow
def test_decode_experiment_reports_per_device_kv(decode_on_four_fake_devices):
  summary = decode_on_four_fake_devices
  assert summary['mesh']['model'] == 4 and len(summary['mesh']['devices']) == 4
  # Tiny config: 2 layers, 2 KV heads of 16 float32 -> 512 B/token on one device; mesh 4 keeps
  # one KV head per device (each head on 2 devices).
  assert summary['mesh']['kv_head_replication'] == 2
  assert summary['kv_bytes_per_token_per_device'] == 2 * 2 * 1 * 16 * 4
  assert summary['kv_pool_bytes_per_device'] == 256 * 64 * 16
  sized = summary['kv_sizing_per_device']
  assert sized['kv_pool_bytes_per_device'] == summary['kv_pool_bytes_per_device']
  assert sized['kv_bytes_per_token_per_device'] == summary['kv_bytes_per_token_per_device']


@pytest.mark.slow
def test_decode_experiment_across_two_processes(tmp_path, decode_on_four_fake_devices):
  """jax.distributed on one machine: 2 processes x 2 CPU devices (gloo collectives) form one
  mesh of 4 that spans both; it decodes exactly as the one-process mesh of 4 does."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  env = _cpu_env(XLA_FLAGS=_without_device_count(os.environ.get('XLA_FLAGS', '')) +
                 ' --xla_force_host_platform_device_count=2')
  runs = [subprocess.Popen(
      [sys.executable, '-m', 'experiments.decode', *DECODE_FLAGS, f'--workdir={tmp_path}',
       '--distributed', f'--coordinator_address=localhost:{port}', '--num_processes=2',
       f'--process_id={i}'], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True) for i in range(2)]
  for run in runs:
    _, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
  multi = json.loads((tmp_path / 'summary.json').read_text())
  one = decode_on_four_fake_devices
  assert multi['mesh']['processes'] == 2 and len(multi['mesh']['devices']) == 4
  assert multi['kv_pool_bytes_per_device'] == one['kv_pool_bytes_per_device']
  assert multi['outputs'] == one['outputs']


if __name__ == '__main__':
  _worker()
