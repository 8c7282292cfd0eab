"""Continuous batching: pool and budget limits, FCFS, admission, rejection, and the block-table and
allocator invariants after random traces. Model-free (tests/fakes.py), so these run in seconds;
tests/test_preemption.py checks the same engine with a real model."""
import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

from fakes import FakeClock, expected_outputs, fake_engine
from pagedjax.engine import RequestError
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.requests.sequence import Status


def check_invariants(engine):
  """Everything that must hold between any two iterations."""
  alloc, bm = engine.allocator, engine.block_manager
  held = [b for s in engine.running for b in s.block_table]
  assert len(held) == len(set(held)), 'a block is in two tables'
  assert 0 not in held, 'the null block was handed out'
  assert alloc.num_used == len(held) <= alloc.num_blocks - 1
  assert all(alloc.ref_count(b) == 1 for b in held)
  assert len(engine.running) <= engine.config.engine.max_batch_size
  for s in engine.running:
    assert s.status is Status.RUNNING
    if bm.kind == 'contiguous':
      assert len(s.block_table) == bm.reserve_blocks
    else:  # blocks for what is cached, at most for every token it has
      assert bm.blocks_for(s.num_cached) <= len(s.block_table) <= bm.blocks_for(s.num_tokens)
  lanes = [s.lane for s in engine.running]  # recent-window rings, one per running sequence
  assert 0 not in lanes and len(set(lanes)) == len(lanes) <= engine.config.engine.max_batch_size
  for s in engine.scheduler.waiting + engine.scheduler.swapped:
    assert not s.block_table and not s.lane
  for s in engine.scheduler.waiting:
    assert s.status is Status.WAITING and s.num_cached == 0 and not s.host_blocks
  host = [b for s in engine.scheduler.swapped for b in s.host_blocks]
  for s in engine.scheduler.swapped:
    assert s.status is Status.SWAPPED
    assert len(s.host_blocks) == bm.blocks_for(s.num_cached)
  if engine.swap_store:
    assert engine.swap_store.allocator.num_used == len(host) == len(set(host))
  for queue in (engine.scheduler.waiting, engine.running, engine.scheduler.swapped):
    assert queue == sorted(queue, key=lambda s: s.order), 'a queue lost FCFS order'


# Stated cost-model figures (no calibration against a fake step): preemption 'auto' and victim
# 'cost' then swap a victim of up to 1000 blocks rather than recompute 3 of its tokens.
COST_FIGURES = {'prefill_s_per_token': 1e-3, 'host_bytes_per_s': 1e9, 'host_latency_s': 1e-6}


@pytest.mark.parametrize('kind', ['paged', 'contiguous'])
@settings(max_examples=30, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([2, 4, 8]),
       num_blocks=st.sampled_from([7, 12, 20]), max_batch_size=st.integers(1, 6),
       prefill_chunk=st.sampled_from([1, 4, 16]), extra_budget=st.integers(0, 20),
       swap_blocks=st.sampled_from([None, 2]),
       victim=st.sampled_from(['newest', 'least_progress', 'priority', 'cost']),
       admission=st.sampled_from(['watermark', 'projected']), horizon=st.sampled_from([0, 4]))
def test_random_traces_keep_invariants_and_outputs(kind, data, block_size, num_blocks,
                                                   max_batch_size, prefill_chunk, extra_budget,
                                                   swap_blocks, victim, admission, horizon):
  """Every preemption, victim and admission policy, on random traces."""
  preemption = data.draw(st.sampled_from(['recompute', 'swap', 'auto'] if kind == 'paged'
                                         else ['swap']))
  usable = (num_blocks - 1) * block_size
  max_seq_len = min(40, usable) if kind == 'contiguous' else 40
  budget = max_batch_size + extra_budget
  engine = fake_engine(FakeClock(0.5), block_size=block_size, num_blocks=num_blocks,
                       max_batch_size=max_batch_size, prefill_chunk=prefill_chunk,
                       max_seq_len=max_seq_len, pool_kind=kind, preemption=preemption,
                       max_num_batched_tokens=budget, swap_blocks=swap_blocks,
                       shuffle_blocks_seed=block_size, victim=victim, admission=admission,
                       admission_horizon=horizon, **COST_FIGURES)
  requests = data.draw(st.lists(st.tuples(
      st.integers(1, 24), st.integers(4, 25), st.sampled_from([0.0, 0.0, 2.0, 7.5]),
      st.integers(-2, 2)), min_size=3, max_size=12))
  rng = np.random.default_rng(len(requests))
  accepted, rejected = {}, 0
  for prompt_len, max_new, arrival, priority in requests:
    prompt = rng.integers(0, 97, prompt_len).tolist()
    params = SamplingParams(max_new_tokens=max_new, priority=priority)
    longest = min(prompt_len + max_new, max_seq_len)
    fits = prompt_len < max_seq_len and -(-longest // block_size) <= num_blocks - 1
    try:
      rid = engine.submit(prompt, params, arrival_time=arrival)
    except RequestError:
      assert not fits
      rejected += 1
      continue
    assert fits
    accepted[rid] = expected_outputs(prompt, max_new, max_seq_len)

  steps = 0
  while engine.has_work():
    engine.step()
    check_invariants(engine)
    steps += 1
    assert steps < 5000, 'no progress'
  tokens = np.add(engine.metrics.steps['prefill_tokens'], engine.metrics.steps['decode_tokens'])
  assert tokens.max(initial=0) <= budget
  assert sorted(engine.finished) == sorted(accepted)  # every admitted request finished
  for rid, want in accepted.items():
    assert engine.finished[rid].output_ids == want, rid
  assert engine.allocator.num_free == num_blocks - 1
  if engine.swap_store:
    assert engine.swap_store.allocator.num_used == 0
  if kind == 'contiguous':
    assert engine.stats['preemptions'] == 0  # a reservation never grows
  for key in ('preemptions_recompute', 'preemptions_swap', 'swapped_in_blocks'):
    event(f'{key} > 0: {engine.stats[key] > 0}')
  event(f'rejected > 0: {rejected > 0}')



def test_prefill_and_decode_share_an_iteration():
  engine = fake_engine(prefill_chunk=8)
  engine.submit([1, 2, 3], SamplingParams(max_new_tokens=5))
  engine.step()  # prompt of 3: one chunk, first token sampled
  engine.submit(list(range(20)), SamplingParams(max_new_tokens=5))
  engine.step()
  # One chunk call (the new prompt's first 8 tokens), then one decode call.
  assert engine.executor.step_fn.calls[-2:] == [(1, 8), (1, 1)]
  assert len(engine.finished) == 0 and len(engine.running) == 2
  assert len(engine.running[0].output_ids) == 2 and engine.running[1].num_cached == 8


def test_token_budget_limits_prompt_chunks():
  engine = fake_engine(max_batch_size=4, prefill_chunk=16, max_num_batched_tokens=10)
  for n in (12, 12, 12):
    engine.submit(list(range(n)), SamplingParams(max_new_tokens=2))
  engine.step()
  assert engine.executor.step_fn.calls[-1] == (1, 10)  # FCFS: the first prompt takes the whole budget
  engine.step()  # its last 2 tokens, then the next prompt's first 8
  assert engine.executor.step_fn.calls[-1] == (2, 10)


def test_fcfs_completion_order_with_one_row():
  engine = fake_engine(max_batch_size=1)
  for n, new in ((5, 9), (2, 1), (7, 3)):
    engine.submit(list(range(n)), SamplingParams(max_new_tokens=new))
  order = [c.request_id for _ in range(100) for c in engine.step()]
  assert order == [0, 1, 2]


def test_waiting_head_is_not_overtaken():
  # 8 usable blocks of 4. Request 0 holds 6; request 1 needs 5 and must wait; request 2 needs 1
  # and would fit, but may not skip ahead of request 1.
  engine = fake_engine(num_blocks=9, watermark=0.0, max_batch_size=4)
  engine.submit(list(range(22)), SamplingParams(max_new_tokens=3))
  engine.submit(list(range(18)), SamplingParams(max_new_tokens=2))
  engine.submit([5], SamplingParams(max_new_tokens=2))
  engine.step()
  assert [s.request_id for s in engine.running] == [0]
  assert [s.request_id for s in engine.scheduler.waiting] == [1, 2]
  assert engine.metrics.steps['free_unusable'][-1] == 2 * 4  # free, but too few for request 1
  engine.run()
  assert sorted(engine.finished) == [0, 1, 2]


def test_watermark_keeps_blocks_free_at_admission():
  # 16 usable blocks, watermark 25% = 4 blocks: a second 12-block prompt may not take the rest.
  engine = fake_engine(num_blocks=17, watermark=0.25)
  engine.submit(list(range(16)), SamplingParams(max_new_tokens=1))  # 4 blocks
  engine.submit(list(range(33)), SamplingParams(max_new_tokens=1))  # 9 blocks: 4 + 9 + 4 > 16
  engine.step()
  assert [s.request_id for s in engine.running] == [0]
  engine.run()  # once alone, the watermark does not apply: nothing deadlocks
  assert sorted(engine.finished) == [0, 1]


def test_contiguous_reserves_max_seq_len_per_request():
  engine = fake_engine(pool_kind='contiguous', num_blocks=17, max_seq_len=32)  # 8 blocks each
  for _ in range(3):
    engine.submit(list(range(5)), SamplingParams(max_new_tokens=4))
  engine.step()
  assert len(engine.running) == 2 and all(len(s.block_table) == 8 for s in engine.running)
  with pytest.raises(ValueError, match='pool.num_blocks=9 is not allowed: at least 10 .*contiguous'):
    fake_engine(pool_kind='contiguous', num_blocks=9, max_seq_len=33)


def test_oversized_request_is_rejected_and_others_finish():
  engine = fake_engine(num_blocks=5)  # 4 blocks of 4 tokens
  engine.submit([1, 2, 3], SamplingParams(max_new_tokens=4))
  with pytest.raises(RequestError, match=r'needs up to 5 blocks of 4 tokens \(18 tokens\) but '
                     r'the pool has only 4: it can never fit'):
    engine.submit(list(range(10)), SamplingParams(max_new_tokens=8))
  engine.submit([4, 5], SamplingParams(max_new_tokens=3))
  done = engine.run()
  assert [c.request_id for c in done] == [0, 1]  # a rejected request takes no id
  assert done[0].output_ids == expected_outputs([1, 2, 3], 4, 4096)


def test_arrivals_become_visible_when_the_clock_passes_them():
  clock = FakeClock(1.0)  # every device call takes 1 s
  engine = fake_engine(clock)
  engine.submit([1, 2], SamplingParams(max_new_tokens=3), arrival_time=0.0)
  engine.submit([3, 4], SamplingParams(max_new_tokens=2), arrival_time=10.0)
  assert [s.request_id for s in engine.scheduler.waiting] == [0]
  engine.step()
  assert engine.clock == 1.0 and [s.request_id for s in engine.running] == [0]
  engine.step()
  engine.step()  # request 0 finishes at t=3
  assert engine.has_work() and not engine.running and not engine.scheduler.waiting
  engine.step()  # idle: the clock jumps to t=10, request 1 prefills
  assert engine.clock == 11.0
  engine.run()
  done = [engine.finished[i] for i in (0, 1)]
  assert [(c.arrival_time, c.first_token_time, c.finish_time) for c in done] == [
      (0.0, 1.0, 3.0), (10.0, 11.0, 12.0)]
