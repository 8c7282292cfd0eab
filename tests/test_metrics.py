"""Run metrics against hand-computed cases (model-free engine and a fake clock, tests/fakes.py)."""
import pytest

from fakes import FakeClock, fake_engine
from pagedjax.host.metrics import WASTE
from pagedjax.host.requests.sampling_params import SamplingParams


def one_request(kind):
  """bs 4, 8 usable blocks (32 slots); a 6-token prompt generating 3 tokens: three iterations
  with 6, 7 and 8 tokens cached."""
  engine = fake_engine(block_size=4, num_blocks=9, max_seq_len=16, pool_kind=kind)
  engine.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(max_new_tokens=3))
  return engine.metrics


@pytest.mark.parametrize('kind,reserved', [('contiguous', [16, 16, 16]), ('paged', [8, 8, 8])])
def test_one_request_slot_accounting(kind, reserved):
  m = one_request(kind)
  steps = m.steps
  assert steps['token_states'] == [6, 7, 8]
  assert steps['internal_fragmentation'] == [2, 1, 0]  # tail of the last written block
  assert steps['reservation'] == [r - 8 for r in reserved]  # contiguous: 2 blocks unwritten
  assert steps['free_idle'] == [32 - r for r in reserved] and steps['free_unusable'] == [0] * 3
  s = m.summary()
  assert s['kv_utilization'] == pytest.approx(21 / sum(reserved))
  assert s['kv_token_states'] == pytest.approx(21 / 96)
  assert sum(s[f'kv_{k}'] for k in WASTE) == pytest.approx(1.0)
  assert m.timeline()['kv_utilization'] == pytest.approx([6 / reserved[0], 7 / reserved[1],
                                                          8 / reserved[2]])


def test_peak_and_mean_utilization():
  """Contiguous: 4 blocks held throughout, 6/7/8 of their 16 slots holding tokens; the peak is
  the last iteration holding the most blocks. Paged: 2 blocks, 6/8, 7/8, 8/8."""
  engine = fake_engine(block_size=4, num_blocks=9, max_seq_len=16, pool_kind='contiguous')
  engine.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(max_new_tokens=3))
  assert engine.metrics.peak_blocks_used() == 4
  assert engine.metrics.utilization_at_peak() == pytest.approx(8 / 16)
  assert engine.metrics.mean_utilization() == pytest.approx((6 + 7 + 8) / 3 / 16)
  engine = fake_engine(block_size=4, num_blocks=9, max_seq_len=16, pool_kind='paged')
  assert engine.metrics.peak_blocks_used() == 0 and engine.metrics.mean_utilization() == 0.0  # nothing ran yet
  engine.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(max_new_tokens=3))
  assert engine.metrics.peak_blocks_used() == 2 and engine.metrics.utilization_at_peak() == 1.0
  assert engine.metrics.mean_utilization() == pytest.approx((6 / 8 + 7 / 8 + 1) / 3)


def test_free_but_unusable_while_a_reservation_does_not_fit():
  # 6 usable blocks, reservations of 4: the second request waits while 2 blocks sit free.
  engine = fake_engine(block_size=4, num_blocks=7, max_seq_len=16, pool_kind='contiguous')
  engine.generate([[1, 2], [3, 4]], SamplingParams(max_new_tokens=2))
  steps = engine.metrics.steps
  assert steps['running'] == [1, 1, 1, 1]
  assert steps['free_unusable'] == [8, 8, 0, 0]  # blocked, blocked, then nothing waits
  assert steps['free_idle'] == [0, 0, 8, 8]


def test_latency_throughput_and_timing():
  clock = FakeClock(1.0)  # each device call takes 1 s; host work takes none
  engine = fake_engine(clock, max_batch_size=2)
  engine.submit([1, 2, 3], SamplingParams(max_new_tokens=4))
  engine.submit([4, 5, 6], SamplingParams(max_new_tokens=2))
  engine.run()  # t=1: both prompts, first tokens; t=2: both decode, #1 done; t=3, t=4: #0
  s = engine.summary()
  assert s['iterations'] == 4 and s['duration_s'] == 4.0
  assert s['generated_tokens'] == 6 and s['finished_requests'] == 2
  assert s['generated_tokens_per_s'] == 1.5 and s['requests_per_s'] == 0.5
  assert s['ttft_p50_s'] == s['ttft_p99_s'] == 1.0
  assert s['tpot_p50_s'] == s['tpot_p99_s'] == 1.0  # (4 - 1) / 3 and (2 - 1) / 1
  assert s['normalized_latency_s'] == 1.0
  assert s['device_s_per_step'] == 1.0 and s['host_s_per_step'] == 0.0 and s['compile_s'] == 0
  assert s['peak_concurrent_sequences'] == 2 and s['mean_concurrent_sequences'] == 1.5
  assert s['preemptions'] == 0 and s['pool_kind'] == 'paged'


def test_ttft_counts_queueing_from_arrival():
  clock = FakeClock(1.0)
  engine = fake_engine(clock, max_batch_size=1)
  engine.submit([1, 2], SamplingParams(max_new_tokens=3))  # runs t=0..3
  engine.submit([3, 4], SamplingParams(max_new_tokens=1), arrival_time=0.5)
  engine.run()
  late = engine.finished[1]
  assert late.arrival_time == 0.5 and late.first_token_time == 4.0
  assert engine.summary()['ttft_p50_s'] == pytest.approx((1.0 + 3.5) / 2)


def test_goodput_leaves_out_aborted_requests_and_preemptions_are_counted_per_request():
  """Goodput: tokens of requests that finished, over first arrival to last finish; an aborted
  request's tokens count in throughput only. Re-preempted: preempted at least twice."""
  from pagedjax.host.metrics import Metrics  # pylint: disable=import-outside-toplevel
  from pagedjax.host.requests.sequence import Completion  # pylint: disable=import-outside-toplevel
  m = Metrics(block_size=4, num_blocks=9)
  for request_id, outputs, reason, preemptions in ((0, 6, 'length', 0), (1, 4, 'length', 2),
                                                   (2, 2, 'aborted', 1)):
    m.record_finish(Completion(request_id, [1, 2], list(range(outputs)), reason, preemptions,
                               arrival_time=1.0, first_token_time=2.0, finish_time=5.0))
  s = m.summary()
  assert s['duration_s'] == 4.0
  assert s['generated_tokens_per_s'] == 12 / 4 and s['goodput_tokens_per_s'] == 10 / 4
  assert s['preempted_requests'] == 2 and s['re_preempted_requests'] == 1
  assert s['max_preemptions_per_request'] == 2
  # A request aborted before its first token counts in neither goodput nor the latencies.
  m.record_finish(Completion(3, [1, 2], [], 'aborted', 3, arrival_time=1.0,
                             first_token_time=None, finish_time=5.0))
  s = m.summary()
  assert s['goodput_tokens_per_s'] == 10 / 4 and s['finished_requests'] == 4
  assert s['ttft_p50_s'] == 1.0 and s['normalized_latency_s'] == pytest.approx(
      (4 / 6 + 4 / 4 + 4 / 2) / 3)
