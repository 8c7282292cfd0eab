"""KV and weight sizing against hand-computed figures and the published parameter counts."""
import re
import subprocess
import sys

import jax
import numpy as np

import pytest

from pagedjax import sizing
from pagedjax.device import pool as pool_lib
from pagedjax.device.kv_schemes import KVQuantConfig
from pagedjax.model.llama import ModelConfig, init_params
from pagedjax.sim import simulated_device

OPT13, L8, L70, SMOL = (sizing.PRESETS[k] for k in
                        ('opt-13b', 'llama3-8b', 'llama3-70b', 'smollm2-135m'))


def test_kv_bytes_per_token_fp16():
  # 2 (K and V) * layers * kv_heads * head_dim * 2 bytes.
  assert sizing.kv_bytes_per_token(OPT13, 'fp16') == 2 * 40 * 5120 * 2 == 819200  # ~800 KiB, MHA
  assert sizing.kv_bytes_per_token(L8, 'fp16') == 2 * 32 * 8 * 128 * 2 == 131072  # GQA: 8 heads
  assert sizing.kv_bytes_per_token(L70, 'fp16') == 2 * 80 * 8 * 128 * 2 == 327680
  assert sizing.kv_bytes_per_token(SMOL, 'bf16') == 2 * 30 * 3 * 64 * 2 == 23040


def test_quantized_kv_counts_the_pools_scales_and_zero_points():
  elements = 2 * 32 * 8 * 128
  fp16 = sizing.kv_bytes_per_token(L8, 'fp16')
  assert fp16 == 2 * elements and sizing.kv_bytes_per_token(L8, 'float32') == 2 * fp16
  assert sizing.kv_bytes_per_token(L8, 'bf16') == fp16
  # int8 / fp8: codes + one float16 scale per token and KV head (a group of head_dim).
  for dtype in ('int8', 'fp8', 'fp8_e5m2'):
    assert sizing.kv_bytes_per_token(L8, dtype) == elements + elements // 128 * 2 == 66_560
  assert sizing.kv_bytes_per_token(L8, 'int8', kv_group_size=128) == 66_560
  # int4: packed codes + a float16 scale and zero point per 32 channels (the pool's default).
  assert sizing.kv_bytes_per_token(L8, 'int4') == elements // 2 + elements // 32 * 4 == 40_960
  assert sizing.kv_bytes_per_token(L8, 'int4', kv_group_size=64) == (
      elements // 2 + elements // 64 * 4)
  # Another system's layout: codes + kv_scale_bytes per kv_group_size channels.
  assert sizing.kv_bytes_per_token(L8, 'int8', kv_scale_bytes=4) == (
      elements + elements // 128 * 4)
  assert sizing.kv_bytes_per_token(L8, 'int4', kv_group_size=32, kv_scale_bytes=2) == (
      elements // 2 + elements // 32 * 2)


POOL_SPECS = [KVQuantConfig('float32'), KVQuantConfig('bfloat16'), KVQuantConfig('int8'),
              KVQuantConfig('fp8_e4m3'), KVQuantConfig('fp8_e5m2'),
              KVQuantConfig('int4', group_size=4), KVQuantConfig('int4', group_size=12),
              KVQuantConfig('int4', group_size=4, key_per_channel=True),
              KVQuantConfig('int8', recent_window=4)]
SIZING_DTYPE = {'float32': 'fp32', 'bfloat16': 'bf16', 'int8': 'int8', 'fp8_e4m3': 'fp8',
                'fp8_e5m2': 'fp8', 'int4': 'int4'}


@pytest.mark.parametrize('spec', POOL_SPECS, ids=str)
def test_sizing_the_engine_and_the_simulator_count_what_the_pool_stores(spec):
  """One figure for bytes per token: the real pool's arrays of a tiny model, the scheme's
  bytes_per_token (what sizing counts with) and the simulator's pool agree for every scheme;
  sizing gives the same for every scheme its dtypes name."""
  cfg = ModelConfig(vocab_size=97, d_model=48, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=12, ffn_dim=80, max_seq_len=64)
  block_size = 8
  pool = pool_lib.init_pool(cfg.num_layers, 5, cfg.num_kv_heads, block_size, cfg.head_dim,
                            kv_quant=spec, max_sequences=3)
  measured = pool.bytes_per_token
  assert measured == pool.scheme.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, block_size,
                                                 cfg.head_dim)
  assert measured == simulated_device.SimulatedPool(cfg, 5, block_size, spec, 3).bytes_per_token
  if not (spec.key_per_channel or spec.recent_window):  # formats sizing's dtypes name
    group = spec.group_size if spec.kv_dtype == 'int4' else None
    assert sizing.kv_bytes_per_token(sizing.from_model_config(cfg), SIZING_DTYPE[spec.kv_dtype],
                                     kv_group_size=group, block_size=block_size) == measured


@pytest.mark.parametrize('shape, published', [
    (L8, 8.03e9), (L70, 70.6e9), (SMOL, 134.5e6),
    # OPT-13B is "13B" by name; its real count is 12.85B (1.1% under the name).
    (OPT13, 12.85e9)])
def test_param_counts_match_published(shape, published):
  assert sizing.param_count(shape) == pytest.approx(published, rel=0.01)


def test_param_counts_exact():
  # The totals Hugging Face reports for these checkpoints.
  assert sizing.param_count(L8) == 8_030_261_248
  assert sizing.param_count(L70) == 70_553_706_496
  assert sizing.param_count(SMOL) == 134_515_008
  assert sizing.param_count(OPT13) == pytest.approx(13e9, rel=0.015)


@pytest.mark.parametrize('tie, kv_heads', [(True, 2), (False, 1), (False, 4)])
def test_param_count_matches_pagedjax_model(tie, kv_heads):
  cfg = ModelConfig(vocab_size=97, d_model=48, num_layers=3, num_heads=4, num_kv_heads=kv_heads,
                    head_dim=12, ffn_dim=80, max_seq_len=64, tie_embeddings=tie)
  shapes = jax.eval_shape(lambda: init_params(cfg))
  actual = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
  shape = sizing.from_model_config(cfg)
  assert sizing.param_count(shape) == actual
  pool_slot = pool_lib.pool_bytes(cfg.num_layers, 1, cfg.num_kv_heads, 1, cfg.head_dim,
                                  KVQuantConfig('float32'))  # one block of one token
  assert sizing.kv_bytes_per_token(shape, 'fp32') == pool_slot


def test_plan_fits():
  p = sizing.plan(L8, context=8192, batch=1, kv_dtype='fp16', tp=1, hbm_gb=80)
  weights = 8_030_261_248 * 2
  per_request = 131072 * 8192
  assert p['weight_bytes_per_device'] == weights
  assert p['kv_bytes_per_request_per_device'] == per_request == 2**30
  assert p['max_concurrent_requests'] == (80 * 10**9 - weights) // per_request == 59
  assert p['batch_fits'] and p['notes'] == []
  assert not sizing.plan(L8, 8192, batch=60, hbm_gb=80)['batch_fits']
  # The reserve comes out of the KV budget.
  assert sizing.plan(L8, 8192, hbm_gb=80, reserve_gb=10)['max_concurrent_requests'] == (
      (70 * 10**9 - weights) // per_request) == 50


def test_plan_weights_do_not_fit():
  p = sizing.plan(L70, context=4096, hbm_gb=80)
  assert p['max_concurrent_requests'] == 0 and not p['batch_fits']
  assert any('do not fit' in n for n in p['notes'])


def test_plan_block_rounding_and_context_warning():
  p = sizing.plan(OPT13, context=2049, block_size=16)
  assert p['kv_bytes_per_request_per_device'] == 819200 * 2064
  assert any('exceeds the trained context 2048' in n for n in p['notes'])


def test_tensor_parallel_split_and_replication():
  p8 = sizing.plan(L70, context=8192, tp=8, hbm_gb=80)
  assert p8['kv_heads_per_device'] == 1 and p8['kv_head_replication'] == 1
  assert p8['kv_bytes_per_token_per_device'] == 327680 // 8
  assert p8['params_per_device'] == pytest.approx(sizing.param_count(L70) / 8, rel=1e-3)
  assert p8['notes'] == []
  p16 = sizing.plan(L70, context=8192, tp=16, hbm_gb=80)
  assert p16['kv_heads_per_device'] == 1 and p16['kv_head_replication'] == 2
  assert p16['kv_bytes_per_token_per_device'] == 327680 // 8  # one whole head, not half
  assert any('replicated on 2 devices' in n for n in p16['notes'])
  # k/v weights stop shrinking past kv_heads, so the per-device count exceeds total / 16.
  assert p16['params_per_device'] > sizing.param_count(L70) / 16
  with pytest.raises(ValueError, match='tp=3 does not divide num_heads=32'):
    sizing.plan(L8, context=128, tp=3)
  with pytest.raises(ValueError, match='multiple of num_kv_heads'):
    shape = sizing.ModelShape('x', num_layers=1, d_model=64, num_heads=24, num_kv_heads=8,
                              head_dim=8, ffn_dim=8, vocab_size=8, tie_embeddings=True)
    sizing.kv_heads_per_device(shape, 12)  # 12 > 8 kv heads but not a multiple of 8


@pytest.mark.parametrize('name', ['Llama-3-8B', 'llama3_8b', 'LLAMA38B'])
def test_preset_aliases(name):
  assert sizing.get_preset(name) is L8


def test_bad_names_list_allowed_values():
  with pytest.raises(ValueError, match=r"unknown preset 'gpt2'; allowed: opt-13b, llama3-8b"):
    sizing.get_preset('gpt2')
  with pytest.raises(ValueError, match=r"unknown dtype 'fp4'; allowed: fp32, fp16, bf16, fp8"):
    sizing.kv_bytes_per_token(L8, 'fp4')
  with pytest.raises(ValueError, match='only to quantized KV dtypes'):
    sizing.kv_bytes_per_token(L8, 'fp16', kv_group_size=32)
  with pytest.raises(ValueError, match='divide head_dim=128'):
    sizing.kv_bytes_per_token(L8, 'int4', kv_group_size=48)
  with pytest.raises(ValueError, match='not a multiple of num_kv_heads'):
    sizing.ModelShape('bad', 1, 64, num_heads=6, num_kv_heads=4, head_dim=8, ffn_dim=8,
                      vocab_size=8, tie_embeddings=True)


@pytest.mark.parametrize('dtype, per_token', [('int8', '66,560 B'), ('fp8', '66,560 B'),
                                              ('int4', '40,960 B')])
def test_cli_counts_the_scales_the_pool_stores(capsys, dtype, per_token):
  sizing.main(['--preset', 'llama3-8b', '--kv-dtype', dtype])
  assert f'KV per token:        {per_token}' in capsys.readouterr().out


@pytest.mark.parametrize('argv, message', [
    (['--context', '0'], "--context=0 is not allowed: an integer >= 1"),
    (['--batch', '-2'], '--batch=-2 is not allowed: an integer >= 1'),
    (['--kv-dtype', 'int8', '--kv-scale-bytes', '-1000'],
     '--kv-scale-bytes=-1000 is not allowed: an integer >= 1'),
    (['--kv-dtype', 'int4', '--kv-group-size', '0'], '--kv-group-size=0 is not allowed'),
    (['--kv-dtype', 'int4', '--kv-group-size', '48'],
     '--kv-group-size=48 is not allowed: .*divide head_dim=128'),
    (['--kv-dtype', 'int8', '--kv-group-size', '32'],
     '--kv-group-size=32 is not allowed: .*one scale per token and KV head'),
    (['--block-size', '0'], '--block-size=0 is not allowed'),
    (['--tp', '0'], '--tp=0 is not allowed: an integer >= 1'),
    (['--tp', '3'], '--tp=3 is not allowed: tp=3 does not divide num_heads=32'),
    (['--hbm-gb', 'nan'], '--hbm-gb=nan is not allowed: a finite number of GB'),
    (['--hbm-gb', 'inf'], '--hbm-gb=inf is not allowed: a finite number of GB'),
    (['--hbm-gb', '0'], '--hbm-gb=0.0 is not allowed: a finite number of GB .* > 0'),
    (['--reserve-gb', 'inf'], '--reserve-gb=inf is not allowed: a finite number of GB'),
    (['--reserve-gb', '-1'], '--reserve-gb=-1.0 is not allowed'),
    (['--kv-dtype', 'fp4'], "--kv-dtype='fp4' is not allowed: one of fp32, fp16"),
    (['--weight-dtype', 'q4'], "--weight-dtype='q4' is not allowed"),
    (['--hbm-gb', 'lots'], "argument --hbm-gb/--hbm_gb: invalid float value: 'lots'"),
])
def test_every_flag_is_checked_before_any_work(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    sizing.main(['--preset', 'llama3-8b'] + argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  (line,) = [l for l in err.splitlines() if 'error:' in l]
  assert re.search(message, line), line
  assert 'Traceback' not in err


def test_cli(capsys):
  sizing.main(['--preset', 'llama3-8b', '--context', '8192', '--batch', '1', '--hbm-gb', '80'])
  out = capsys.readouterr().out
  assert '131,072 B (131.1 kB = 128.0 KiB)' in out
  assert 'concurrent requests: 59 at this context' in out
  with pytest.raises(SystemExit) as e:
    sizing.main(['--preset', 'gpt2'])
  assert e.value.code == 2
  assert "--preset='gpt2' is not allowed: one of opt-13b" in capsys.readouterr().err


def test_runs_as_module():
  out = subprocess.run([sys.executable, '-m', 'pagedjax.sizing', '--preset', 'opt-13b',
                        '--kv-dtype', 'int8', '--json'], capture_output=True, text=True,
                       check=True).stdout
  assert '"kv_bytes_per_token": 416000' in out  # 409,600 of codes + 6,400 of scales
