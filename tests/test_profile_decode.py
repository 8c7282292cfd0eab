"""The decode-step profile (experiments/profile_decode.py): its attribution of a step's time on
hand-made events (nested ops, ops of two threads at once, gaps, dispatch), its reading of
optimized HLO text, and the `:tiny` study end to end: every category non-negative, the
categories summing to the traced step, the ops all found in the step's HLO, its files."""
import csv
import glob
import os

import jax
import pytest

from configs import profile_decode as profile_config
from experiments import profile_decode
from pagedjax.config import ConfigError
from pagedjax.kernels import linear_cpu
from study_outputs import check_outputs, run_tiny


def _op(name, ts, dur, tid=1):
  return {'name': name, 'ts': ts, 'dur': dur, 'tid': tid, 'ph': 'X', 'args': {'hlo_op': name}}


def test_attribute_gives_every_microsecond_to_one_category():
  """Window 0-100 µs, first op at 10: a holds b (nested, b wins inside it), c on another thread
  overlaps a for 5 µs (split evenly), nothing runs 50-60, d runs past the window's end."""
  window = {'start': 0.0, 'first_op': 10.0, 'end': 100.0,
            'ops': [_op('a', 10, 30), _op('b', 20, 10), _op('c', 35, 15, tid=2),
                    _op('d', 60, 45)]}
  by_category, by_op = profile_decode.attribute(window, lambda e: f"cat_{e['args']['hlo_op']}")
  assert by_op == pytest.approx({'a': 17.5, 'b': 10.0, 'c': 12.5, 'd': 40.0})
  assert by_category == pytest.approx({'dispatch': 10.0, 'gaps': 10.0, 'cat_a': 17.5,
                                       'cat_b': 10.0, 'cat_c': 12.5, 'cat_d': 40.0})
  assert sum(by_category.values()) == pytest.approx(100.0)


def test_step_windows_take_the_whole_execution():
  """An iteration whose program's execution the executor split: the first part returns at once,
  the rest runs on a pool thread while the caller waits. The window runs from the call's
  dispatch to the last part's end and holds the ops of both threads; an op outside it is not
  the step's."""
  ev = lambda name, ts, dur, tid=1, **args: {'name': name, 'ts': ts, 'dur': dur, 'tid': tid,
                                             'ph': 'X', 'args': args}
  events = [ev('decode_iteration', 0, 100), ev('PjitFunction(jit(step))', 5, 10),
            ev('ThunkExecutor::Execute', 20, 2, tid=2),
            ev('ThunkExecutor::Execute (wait for completion)', 22, 60, tid=2),
            ev('ThunkExecutor::Execute', 23, 58, tid=3), _op('a', 20.5, 1, tid=2),
            _op('b', 25, 50, tid=3), _op('late', 90, 5, tid=3)]
  (window,) = profile_decode.step_windows(sorted(events, key=lambda e: e['ts']))
  assert (window['start'], window['first_op'], window['end']) == (5, 20, 82)
  assert [e['args']['hlo_op'] for e in window['ops']] == ['a', 'b']
  by_category, _ = profile_decode.attribute(window, lambda e: 'op')
  assert by_category == pytest.approx({'dispatch': 15, 'op': 51, 'gaps': 11})


HLO = """HloModule jit_step, entry_computation_layout={()->f32[2]{0}}

%fused_gather (p0: f32[97,8], p1: s32[2]) -> f32[2,8] {
  %p0 = f32[97,8]{1,0} parameter(0)
  %g = f32[2,8]{1,0} gather(%p0, %p1), offset_dims={1}
}

%fused_dot (p0: f32[2,8], p1: f32[8,16]) -> f32[2,16] {
  %d = f32[2,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_norm (p0: f32[2,8]) -> f32[2,8] {
  %m = f32[2,8]{1,0} multiply(%p0, %p0)
}

ENTRY %main.9 (a: f32[2,8]) -> f32[2] {
  %gather_fusion = f32[2,8]{1,0} fusion(%e, %t), kind=kLoop, calls=%fused_gather, metadata={op_name="jit(step)/Llama/embed/jit(_take)/gather"}
  %ffi_call.1 = f32[2,16]{1,0} custom-call(%x, %w), custom_call_target="pagedjax_linear_cpu", metadata={op_name="jit(step)/Llama/layer_0/attn/q_proj/ffi_call"}
  %ffi_call.2 = f32[2,97]{1,0} custom-call(%x, %e), custom_call_target="pagedjax_linear_cpu", metadata={op_name="jit(step)/Llama/ffi_call"}
  %ffi_call.3 = f32[2,1,4,16]{3,2,1,0} custom-call(%q, %k, /*index=2*/%v), custom_call_target="pagedjax_paged_attention_cpu", metadata={op_name="jit(step)/Llama/layer_0/attn/ffi_call"}
  %dot_fusion = f32[2,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/Llama/layer_0/mlp/up_proj/dot_general"}
  %norm_fusion = f32[2,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(step)/Llama/layer_0/attn_norm/mul"}
  %wrapped_scatter = f32[4,16,2,8]{3,2,1,0} scatter(%pool, %slots, %kv), metadata={op_name="jit(step)/Llama/layer_0/attn/scatter"}
  %reduce_fusion = (f32[2]{0}, s32[2]{0}) fusion(%ffi_call.2), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(step)/reduce"}
  ROOT %cond.1 = f32[2]{0} conditional(%p, %a, %b), branch_computations={%b0, %b1}
}
"""


def test_parse_and_classify_hlo():
  ops = profile_decode.parse_hlo(HLO)
  got = {name: profile_decode.classify(info, vocab_size=97, pool_dims={(4, 16, 2, 8)})
         for name, info in ops.items() if name in (
             'gather_fusion', 'ffi_call.1', 'ffi_call.2', 'ffi_call.3', 'dot_fusion',
             'norm_fusion', 'wrapped_scatter', 'reduce_fusion', 'cond.1')}
  assert got == {'gather_fusion': 'copies', 'ffi_call.1': 'linear_kernel', 'ffi_call.2': 'head',
                 'ffi_call.3': 'attention', 'dot_fusion': 'linear_xla',
                 'norm_fusion': 'elementwise', 'wrapped_scatter': 'kv_write',
                 'reduce_fusion': 'sampling', 'cond.1': 'other_ops'}
  assert ops['dot_fusion']['opcodes'] == {'fusion', 'dot'}
  assert ops['ffi_call.2']['dims'] == [(2, 97)]


def test_config_errors_name_the_field():
  config = profile_config.get_config('tiny')
  config.profile.steps = 0
  with pytest.raises(ConfigError, match=r'config\.profile\.steps=0 is not allowed'):
    profile_decode.check(config)
  config = profile_config.get_config('tiny')
  config.profile.batches = (4,)
  with pytest.raises(ConfigError, match=r'config\.profile\.batches=\(4,\) is not allowed'):
    profile_decode.check(config)


def test_tiny_profile(tmp_path):
  """The :tiny study: per batch, every category >= 0 and their sum the traced step (to 1e-6:
  each microsecond of the window goes to one category), the per-op times plus gaps and
  dispatch the same, the step inside its iteration, every traced op found in the HLO, the
  linear kernel, attention, head and sampling all seen; the files it writes."""
  config = profile_config.get_config('tiny')
  _, stdout = run_tiny(profile_decode.study, config, tmp_path, check=profile_decode.check)
  summary = check_outputs(tmp_path, stdout)
  names = [c for c, _ in profile_decode.CATEGORIES]
  assert list(summary['categories']) == names
  with open(tmp_path / 'ops.csv') as f:
    ops = list(csv.DictReader(f))
  for row in summary['rows']:
    assert row['decomposition'] == 'traced' and row['unmatched_ops'] == []
    assert row['traced_steps'] == config.profile.steps and row['compilations_in_trace'] == 0
    parts = [row[f'{c}_ms'] for c in names]
    assert min(parts) >= 0
    assert sum(parts) == pytest.approx(row['step_ms'], rel=1e-6)
    assert sum(row[f'{c}_share'] for c in names) == pytest.approx(1.0, rel=1e-6)
    per_op = sum(float(o['us_per_step']) for o in ops if int(o['batch']) == row['batch'])
    assert (per_op / 1e3 + row['gaps_ms'] + row['dispatch_ms'] == pytest.approx(
        row['step_ms'], rel=1e-6))
    assert 0 < row['step_ms'] <= row['iteration_ms'] and row['floor_ms'] > 0
    assert row['attention_ms'] > 0 and row['head_ms'] > 0 and row['sampling_ms'] > 0
    kernel = jax.default_backend() == 'cpu' and linear_cpu.available()
    assert (row['linear_kernel_ms'] > 0) == kernel and (row['linear_xla_ms'] > 0) != kernel
    assert row['matmuls_gb_per_s'] > 0 and row['linear_gflop_per_s'] > 0
    projections = row['projections']  # q/k/v/o, gate/up/down: once per layer, all the linear time
    assert all(p['calls'] == config.model.random.num_layers for p in projections.values())
    assert sum(p['ms'] for p in projections.values()) == pytest.approx(
        row['linear_kernel_ms'] + row['linear_xla_ms'], rel=1e-6)
    matmuls = sum(row[f'{c}_ms'] for c in profile_decode.MATMULS)
    assert row['step_ms_if_matmuls_at_copy_rate'] == pytest.approx(
        row['step_ms'] - matmuls + row['weight_mb'] / summary['copy_gb_per_s'], rel=1e-6)
  assert summary['copy_gb_per_s'] > 0
  assert (tmp_path / 'profile_decode.png').read_bytes()[:4] == b'\x89PNG'
  assert glob.glob(os.path.join(tmp_path, 'trace', 'B2', 'plugins', 'profile', '*',
                                '*.json.gz'))
  assert '| ms per step (share) | batch 2 |' in (tmp_path / 'table.md').read_text()
