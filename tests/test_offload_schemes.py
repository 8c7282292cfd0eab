"""Offload with the pools that keep per-sequence lane state: KIVI keys (int4 with
key_per_channel: a partial block's keys in a bfloat16 tail per lane) and recent windows
(bfloat16 rings of each sequence's newest tokens per lane). The blocks that leave a device
window are full, so they stream as the codes and scales the pool holds; the lane state stays on
the device with the window, and the streamed path reads it as the all-device step does
(pagedjax/model/streamed_attention.py, `_window_state`).

Here, one layer's attention for each scheme: a sequence's history written by the all-device
step's own path (pool.write_and_attend over its whole block table), then a prompt chunk and a
decode read both ways. The streamed path's output is within 1e-5 of the all-device step's, and
it leaves every block and lane array as that step does, bit for bit. The recent window (20
tokens) is longer than the device window's newest full blocks, so some of its ring tokens are
in host blocks. tests/test_long_context.py runs the engine with both at once (int4 KIVI keys
and a recent window): greedy tokens of a prompt 4x the device pool identical to an engine whose
pool holds everything.
"""
import dataclasses

import jax
import numpy as np
import pytest

from pagedjax.config import OffloadConfig
from pagedjax.device import pool as pool_lib
from pagedjax.device.kv_schemes import KVQuantConfig
from pagedjax.engine import Engine
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.scheduling.step_inputs import RowSpec, build_step_inputs
from pagedjax.model import llama
from pagedjax.model import streamed_attention as sa
from tiny_models import engine_config, prompts, tiny

GROUP = 6  # int4 groups dividing the tiny model's head_dim of 12
KIVI = KVQuantConfig('int4', GROUP, key_per_channel=True)


def _stream_one_layer(cfg, lp, pool, x, start, count, host_blocks, window_blocks, chunk_blocks,
                      lane):
  """Layer 0's attention for one row of x [1, T, D] (count tokens at start.., the rest
  padding) through the streamed path: its window's state, then its host blocks (physical
  blocks of the same pool here) folded in chunks. -> (attention output [T, Hq, Dh], pool)."""
  bs = pool.block_size
  streamed = sa.StreamedAttention(cfg, bs, len(window_blocks), chunk_blocks, [x.shape[1]])
  row = sa.StreamedRow([0] * count, start, host_blocks, window_blocks, 0.0, 0, 1.0, 0, 0, lane)
  inputs = sa.RowInputs(*streamed.row_inputs([row], 1, x.shape[1]))
  q, state, pool = sa._begin_layer(cfg, False, lp, np.int32(0), x, pool, inputs)
  layer0 = {name: a[0] for name, a in pool.block_arrays().items()}
  for ids, positions in sa.batch_chunks([host_blocks], 1, chunk_blocks, bs):
    chunk = {name: a[ids] for name, a in layer0.items()}  # as the offload store holds them
    state = sa._fold(pool.spec, state, q, inputs.positions, chunk, positions)
  return sa.normalise(jax.tree_util.tree_map(lambda a: a[0], state), cfg.num_heads), pool


@pytest.mark.parametrize('spec', [KIVI, KVQuantConfig('int8', recent_window=20)],
                         ids=['kivi', 'int8_recent_window'])
def test_one_layer_reads_what_the_all_device_step_reads(spec):
  cfg, params, _ = tiny('gqa')
  lp = llama.per_layer_params(params)['params']['layer_0']
  bs, lane, num_tokens = 8, 1, 16
  table = list(range(1, 11))  # logical block i in physical block i + 1: 80 tokens
  pool = pool_lib.init_pool(cfg.num_layers, 12, cfg.num_kv_heads, bs, cfg.head_dim,
                            kv_quant=spec, max_sequences=2)
  rng = np.random.default_rng(0)

  def inputs(start, count):
    return build_step_inputs([RowSpec([0] * count, start, table, lane=lane)], bs, [1],
                             [num_tokens], [len(table)])

  @jax.jit  # one program for every step here (all of one shape)
  def all_device(pool, x, batch):
    q, k, v = llama.layer_qkv(cfg, lp, x, batch.positions)
    return pool_lib.write_and_attend(pool, 0, q, k, v, batch.positions, batch, 'reference')

  x_of = lambda: rng.normal(size=(1, num_tokens, cfg.d_model)).astype(np.float32)
  for start, count in ((0, 16), (16, 16), (32, 16), (48, 13)):  # the history, 61 tokens
    pool = all_device(pool, x_of(), inputs(start, count))[1]
  # A chunk of 11 (61..71: blocks 7 and 8 fill) with logical blocks 0..5 (0..47) on the
  # host, the window 6..8; then a decode starting block 9, the window 7..9. A recent window
  # of 20 reaches back to 42 (query 61) and 53 (query 72): into host blocks too.
  for start, count, on_host in ((61, 11, 6), (72, 1, 7)):
    x = x_of()
    x[:, count:] = 0.0
    want, want_pool = all_device(pool, x, inputs(start, count))
    got, got_pool = _stream_one_layer(cfg, lp, pool, x, start, count, table[:on_host],
                                      table[on_host:on_host + 3], 4, lane)
    np.testing.assert_allclose(np.asarray(got)[:count], np.asarray(want)[0, :count],
                               atol=1e-5, rtol=1e-5)
    for name in ('k', 'v', 'k_scale', 'v_scale', 'k_zero', 'v_zero', 'recent_k', 'recent_v',
                 'k_tail', 'k_tail_block'):
      a, b = getattr(got_pool, name), getattr(want_pool, name)
      if a is not None:  # block 0 (the null block) and lane 0 take padding: not compared
        keep = (slice(None), slice(1, None))
        assert np.asarray(a)[keep].tobytes() == np.asarray(b)[keep].tobytes(), name
    pool = want_pool
