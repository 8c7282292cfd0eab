"""Paged decoding against the dense, no-cache forward pass of the same model.

Tolerance: float32 logits within atol 1e-4 (differences come only from summation order:
blockwise attention and chunked prefill reorder the same float32 sums).
"""
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.model.step import CompiledStep
from tiny_models import dense_logits, make_engine, prompts, tiny

ATOL_F32 = 1e-4


LENGTHS = [1, 5, 16, 17, 40]
# Pools per block size: blocks of 16 use make_engine's default pool (64 blocks), so these
# engines share the compiled programs of every other engine in the file; blocks of 1 are read
# through tables no wider than the longest sequence here needs (64 tokens) instead of the
# model's 512, the same paths on an eighth of the gather.
POOLS = {1: dict(num_blocks=256, max_seq_len=64), 16: {}, 128: dict(num_blocks=24)}


@pytest.mark.parametrize('kind,block_size', [('gqa', 1), ('gqa', 16), ('gqa', 128),
                                             ('mha', 16), ('mqa', 16)])
def test_paged_logits_match_dense(kind, block_size):
  engine = make_engine(kind, block_size=block_size, shuffle_blocks_seed=block_size,
                       **POOLS[block_size])
  done = engine.generate(prompts(LENGTHS), SamplingParams(max_new_tokens=6))
  for c in done:
    assert len(c.output_ids) == 6
    want = dense_logits(kind, c)
    np.testing.assert_allclose(np.stack(c.logits), want, atol=ATOL_F32, rtol=0)
    assert c.output_ids == np.argmax(want, -1).tolist()


def test_greedy_identical_across_block_sizes_and_batches():
  params = SamplingParams(max_new_tokens=8)
  ps = prompts(LENGTHS, seed=3)
  outputs = []
  for block_size, batch in [(1, 4), (16, 4), (128, 4), (16, 1), (16, 2)]:
    engine = make_engine(block_size=block_size, max_batch_size=batch, **POOLS[block_size])
    outputs.append([c.output_ids for c in engine.generate(ps, params)])
  singles = [make_engine().generate([p], params)[0].output_ids for p in ps]
  for out in outputs:
    assert out == singles


def test_chunked_prefill_matches_single_chunk():
  # 45 tokens in chunks of 16 (make_engine's, compiled for the tests above: 3 chunks, the last
  # partial) against one chunk of 64.
  ps = prompts([45], seed=5)
  small = make_engine(prefill_chunk=16).generate(ps, SamplingParams(max_new_tokens=3))[0]
  large = make_engine(prefill_chunk=64).generate(ps, SamplingParams(max_new_tokens=3))[0]
  np.testing.assert_allclose(np.stack(small.logits), np.stack(large.logits), atol=ATOL_F32)
  assert small.output_ids == large.output_ids


def _poison(engine, value, keep_seq):
  """Fill every slot `keep_seq` does not own (null block included) with `value`."""
  pool = engine.pool
  owned = np.zeros(pool.k.shape[1:4:2], bool)  # [blocks, block_size]
  for i, b in enumerate(keep_seq.block_table):
    n = min(engine.block_size, keep_seq.num_cached - i * engine.block_size)
    owned[b, :max(n, 0)] = True
  mask = jnp.asarray(owned)[None, :, None, :, None]
  engine.pool = pool.replace(k=jnp.where(mask, pool.k, value), v=jnp.where(mask, pool.v, value))


@pytest.mark.parametrize('value', [np.nan, 1e30])
def test_unowned_blocks_do_not_leak(value):
  ps = prompts([21, 9, 30], seed=7)
  clean = make_engine().generate(ps[:1], SamplingParams(max_new_tokens=5))[0]
  engine = make_engine()
  for p in ps:  # neighbours fill other blocks with real K/V, then everything else is poisoned
    engine.submit(p, SamplingParams(max_new_tokens=5))
  target = None
  while engine.has_work():
    engine.step()
    target = target or engine.running[0] if engine.running else target
    if target is not None and target.block_table:
      _poison(engine, value, target)
  got = engine.finished[0]
  np.testing.assert_allclose(np.stack(got.logits), np.stack(clean.logits), atol=ATOL_F32)
  assert got.output_ids == clean.output_ids


def test_reused_block_does_not_leak_old_contents():
  first, second = prompts([40, 12], seed=9)
  fresh = make_engine().generate([second], SamplingParams(max_new_tokens=4))[0]
  engine = make_engine()
  engine.generate([first], SamplingParams(max_new_tokens=4))
  old_blocks_free = engine.allocator.num_free
  reused = engine.generate([second], SamplingParams(max_new_tokens=4))[0]
  assert engine.allocator.num_free == old_blocks_free
  np.testing.assert_allclose(np.stack(reused.logits), np.stack(fresh.logits), atol=ATOL_F32)


def test_preemption_by_recompute_keeps_greedy_outputs():
  ps = prompts([20, 25, 30, 35], seed=11)
  params = SamplingParams(max_new_tokens=20)
  roomy = make_engine(num_blocks=64).generate(ps, params)
  tight_engine = make_engine(num_blocks=9)  # 8 usable blocks of 16: not enough for all four
  tight = tight_engine.generate(ps, params)
  assert tight_engine.stats['preemptions'] > 0
  assert [c.output_ids for c in tight] == [c.output_ids for c in roomy]
  assert tight_engine.allocator.num_free == tight_engine.allocator.num_blocks - 1


def test_all_blocks_free_after_run_and_few_compilations():
  # A fresh compiled step, so the count is this run's alone.
  engine = make_engine(step_fn=CompiledStep(tiny('gqa')[0], return_logits=True))
  engine.generate(prompts([3, 9, 14, 30, 2, 7], seed=13), SamplingParams(max_new_tokens=40))
  assert engine.stats['decode_steps'] >= 40
  assert engine.allocator.num_free == engine.allocator.num_blocks - 1
  # Distinct shapes: prefill chunk buckets x batch buckets x block-count buckets, a handful.
  assert engine.num_compilations <= 8, engine.num_compilations
  compiled = engine.num_compilations
  engine.generate(prompts([3, 9, 14, 30, 2, 7], seed=14), SamplingParams(max_new_tokens=40))
  assert engine.num_compilations == compiled  # a second identical-shaped run compiles nothing
