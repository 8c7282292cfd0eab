"""Preemption under memory pressure keeps outputs token-identical, by recompute and by swap, with
a real (tiny, random) model; the contiguous pool gives the same tokens too; the host tier copies
blocks faithfully. Every engine here has the same pool shape and buckets, so they share one
compiled step."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.device import pool as pool_lib
from pagedjax.model.llama import ModelConfig, init_params
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.model.step import CompiledStep
from pagedjax.device import block_transfer
from pagedjax.host.scheduling.step_inputs import padded_ids, power_of_two_buckets
from pagedjax.host.scheduling.swap_store import SwapStore
from tiny_models import build_engine

GREEDY = SamplingParams(max_new_tokens=24)
SAMPLED = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=20, seed=5)


@functools.lru_cache(maxsize=None)
def tiny():
  cfg = ModelConfig(vocab_size=97, d_model=48, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=12, ffn_dim=96, max_seq_len=512)
  return cfg, init_params(cfg, seed=1), CompiledStep(cfg)


def make_engine(**kw):
  """8 usable blocks of 16 tokens: four prompts of 20-35 tokens growing by 24 do not fit."""
  cfg, params, step = tiny()
  kw = {'block_size': 16, 'num_blocks': 9, 'max_batch_size': 4, 'prefill_chunk': 16,
        'max_seq_len': 64, 'step_fn': step, **kw}
  return build_engine(cfg, params, **kw)


def prompts():
  rng = np.random.default_rng(11)
  return [rng.integers(0, 97, n).tolist() for n in (20, 25, 30, 35, 9)]


@functools.lru_cache(maxsize=None)
def alone(params):
  """Each prompt on its own: nothing to compete with, so no preemption."""
  engine = make_engine()
  outputs = [engine.generate([p], params)[0].output_ids for p in prompts()]
  assert engine.stats['preemptions'] == 0
  return outputs


@pytest.mark.parametrize('params', [GREEDY, SAMPLED], ids=['greedy', 'sampled'])
@pytest.mark.parametrize('kw,policy', [
    ({'preemption': 'recompute'}, 'recompute'),
    ({'preemption': 'swap'}, 'swap'),
    ({'preemption': 'swap', 'swap_blocks': 2}, 'both'),  # a full host tier falls back
    ({'pool_kind': 'contiguous'}, None),  # 2 reservations of 64 tokens: never preempts
], ids=['recompute', 'swap', 'swap_tier_full', 'contiguous'])
def test_outputs_identical_under_preemption(kw, policy, params):
  engine = make_engine(**kw)
  done = engine.generate(prompts(), params)
  assert [c.output_ids for c in done] == list(alone(params))
  stats = engine.stats
  if policy in ('recompute', 'both'):
    assert stats['preemptions_recompute'] > 0
  if policy in ('swap', 'both'):
    assert stats['preemptions_swap'] > 0
    assert stats['swapped_out_blocks'] == stats['swapped_in_blocks'] > 0
  if policy is None:
    assert stats['preemptions'] == 0 and engine.metrics.summary()['peak_concurrent_sequences'] == 2
  assert sum(c.num_preemptions for c in done) == stats['preemptions']
  assert engine.allocator.num_free == engine.allocator.num_blocks - 1
  if engine.swap_store:
    assert engine.swap_store.allocator.num_used == 0


# Cost-model figures that make one choice certain (no calibration: the test states them).
SWAP_IS_CHEAP = {'prefill_s_per_token': 1.0, 'host_bytes_per_s': 1e12, 'host_latency_s': 1e-9}
RECOMPUTE_IS_CHEAP = {'prefill_s_per_token': 1e-12, 'host_bytes_per_s': 1.0,
                      'host_latency_s': 1.0}


@pytest.mark.parametrize('kw,swaps,recomputes', [
    ({'preemption': 'auto', **SWAP_IS_CHEAP}, True, False),
    ({'preemption': 'auto', **RECOMPUTE_IS_CHEAP}, False, True),
    ({'victim': 'least_progress'}, False, True),
    ({'victim': 'priority'}, False, True),
    ({'victim': 'cost', 'preemption': 'swap', **SWAP_IS_CHEAP}, True, False),
], ids=['auto_swaps', 'auto_recomputes', 'least_progress', 'priority', 'cost'])
def test_preemption_policies_keep_greedy_outputs(kw, swaps, recomputes):
  """preemption='auto' follows the cost model's figures; every victim policy still preempts
  (this trace needs it) and leaves greedy tokens as they are alone."""
  engine = make_engine(**kw)
  done = engine.generate(prompts(), GREEDY)
  assert [c.output_ids for c in done] == list(alone(GREEDY))
  assert (engine.stats['preemptions_swap'] > 0) == swaps
  assert (engine.stats['preemptions_recompute'] > 0) == recomputes
  assert engine.allocator.num_free == engine.allocator.num_blocks - 1


def test_projected_admission_avoids_the_preemptions_of_watermark_admission():
  """Admission 'projected' (to each request's max_new_tokens) admits only what fits as it
  grows: no preemption where watermark admission preempts, same tokens."""
  engine = make_engine(admission='projected')
  done = engine.generate(prompts(), GREEDY)
  assert [c.output_ids for c in done] == list(alone(GREEDY))
  assert engine.stats['preemptions'] == 0


def test_host_tier_round_trip_moves_exactly_the_blocks():
  """Device blocks -> host tier -> other device blocks, through the jitted gather and scatter
  (device/block_transfer.py) with ids padded by the null block, as the executor does."""
  shape = (2, 12, 2, 4, 3)  # [layers, blocks, kv_heads, block_size, head_dim]
  keys = jax.random.split(jax.random.PRNGKey(0))
  k, v = (jax.random.normal(key, shape) for key in keys)
  pool = pool_lib.KVPool(k=k, v=v)
  want_k, want_v = np.asarray(k), np.asarray(v)
  tier = SwapStore(pool.block_array_shapes(), num_blocks=6)
  host = tier.allocator.allocate(3)
  buckets = power_of_two_buckets(11)
  data = block_transfer.gather_blocks(pool, padded_ids([3, 5, 9], buckets))
  tier.store(host, jax.device_get(data))
  pool = pool.replace(k=jnp.zeros(shape), v=jnp.zeros(shape))  # the device copies are gone
  ids = padded_ids([7, 2, 11], buckets)
  pool = block_transfer.scatter_blocks(pool, ids, tier.load(host, len(ids)))
  got_k, got_v = np.asarray(pool.k), np.asarray(pool.v)
  for src, dst in ((3, 7), (5, 2), (9, 11)):
    np.testing.assert_array_equal(got_k[:, dst], want_k[:, src])
    np.testing.assert_array_equal(got_v[:, dst], want_v[:, src])
  untouched = [b for b in range(1, 12) if b not in (7, 2, 11)]  # padding lands in block 0 only
  assert not got_k[:, untouched].any() and not got_v[:, untouched].any()
