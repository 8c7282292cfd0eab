"""Progress and request isolation: no request the engine accepts can wedge it, and no bad request
can break the others. Model-free engines (fakes.py), so hypothesis can run many traces."""
import math

import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

from pagedjax import engine as engine_lib
from pagedjax.host.requests.intake import RequestError
from pagedjax.host.requests.sampling_params import SamplingParams

from fakes import FakeClock, check_blocks, expected_outputs, fake_engine

OK_PROMPT = [5, 6, 7, 8, 9]


@pytest.mark.parametrize('preemption', ['recompute', 'swap'])
def test_beam_group_that_can_never_fit_is_refused_and_the_engine_keeps_serving(preemption):
  """The reported wedge: two beams of up to 32 tokens need 2 x 8 blocks of 4 once preemption has
  split them; a 10-block pool has 9. Refused at submit, and the engine still serves."""
  engine = fake_engine(block_size=4, num_blocks=10, max_batch_size=4, max_seq_len=64,
                       preemption=preemption)
  with pytest.raises(RequestError, match='needs up to 16 blocks of 4 tokens for 2 beams'):
    engine.submit(list(range(20)), SamplingParams(max_new_tokens=12, beam_width=2))
  done = engine.generate([OK_PROMPT], SamplingParams(max_new_tokens=6))
  assert done[0].output_ids == expected_outputs(OK_PROMPT, 6, 64)
  assert engine.allocator.num_free == 9


@pytest.mark.parametrize('preemption', ['recompute', 'swap'])
@settings(max_examples=25, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([2, 4]), num_blocks=st.sampled_from([9, 12, 17]),
       max_batch_size=st.integers(3, 6), caching=st.booleans())
def test_every_accepted_request_finishes(preemption, data, block_size, num_blocks,
                                         max_batch_size, caching):
  """Random traces mixing beams, parallel samples, salts and plain requests in tiny pools: every
  request is refused at submit or finishes (never aborted), and no block leaks."""
  engine = fake_engine(FakeClock(0.5), block_size=block_size, num_blocks=num_blocks,
                       max_batch_size=max_batch_size, prefill_chunk=4, max_seq_len=32,
                       preemption=preemption, prefix_caching=caching, swap_blocks=4)
  requests = data.draw(st.lists(st.tuples(
      st.integers(1, 12), st.integers(4, 20), st.sampled_from([0, 0, 2, 3]),
      st.sampled_from([1, 1, 2, 3]), st.sampled_from([None, 'a'])), min_size=4, max_size=10))
  rng = np.random.default_rng(len(requests))
  accepted = {}
  for prompt_len, max_new, beams, n, salt in requests:
    prompt = rng.integers(0, 97, prompt_len).tolist()
    params = SamplingParams(max_new_tokens=max_new, beam_width=beams, n=1 if beams else n,
                            temperature=0.0, cache_salt=salt)
    try:
      rid = engine.submit(prompt, params, arrival_time=float(rng.integers(0, 2)))
    except RequestError:
      event('refused')
      continue
    accepted[rid] = beams
  for _ in range(3000):
    if not engine.has_work():
      break
    engine.step()
    check_blocks(engine)
  assert not engine.has_work(), 'the engine stopped making progress'
  assert engine.stats['aborted'] == 0
  for rid in accepted:
    assert engine.finished[rid].finish_reason in ('length', 'max_seq_len', 'eos')
  assert engine.allocator.num_used == 0
  assert engine.swap_store is None or engine.swap_store.allocator.num_used == 0
  event(f'preempted: {engine.stats["preemptions"] > 0}')
  event(f'beams preempted: {any(c.beams and c.num_preemptions for c in engine.finished.values())}')


def test_a_stalled_request_fails_alone_and_releases_its_blocks(monkeypatch):
  """Should the engine ever stop progressing, run() fails the stuck request (here: one that
  admission refuses forever) and serves the rest."""
  monkeypatch.setattr(engine_lib, 'MAX_IDLE_ITERATIONS', 20)
  engine = fake_engine()
  stuck = engine.submit(list(range(30, 40)), SamplingParams(max_new_tokens=4))
  others = [engine.submit(OK_PROMPT, SamplingParams(max_new_tokens=5)) for _ in range(2)]
  can_allocate = engine.block_manager.can_allocate_waiting
  monkeypatch.setattr(engine.block_manager, 'can_allocate_waiting',
                      lambda seq, **kw: seq.request_id != stuck and can_allocate(seq, **kw))
  done = {c.request_id: c for c in engine.run()}
  assert done[stuck].finish_reason == 'aborted' and done[stuck].output_ids == []
  for rid in others:
    assert done[rid].output_ids == expected_outputs(OK_PROMPT, 5, 4096)
  assert engine.stats['aborted'] == 1 and engine.allocator.num_used == 0


# Values of every type and range a caller might pass, good and bad.
ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
                st.lists(st.integers(0, 3), max_size=2), st.sampled_from([0, 1, 2, 2**31 - 1]))
FIELDS = ('max_new_tokens', 'temperature', 'top_k', 'top_p', 'seed', 'stop_on_eos', 'n',
          'cache_salt', 'beam_width', 'length_penalty')


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(FIELDS + ('arrival_time',)), value=ANY, caching=st.booleans())
def test_any_field_value_is_refused_or_served_without_harming_others(field, value, caching):
  engine = fake_engine(prefix_caching=caching, max_seq_len=64)
  good = [engine.submit(OK_PROMPT, SamplingParams(max_new_tokens=4)) for _ in range(2)]
  params, arrival = SamplingParams(max_new_tokens=3), None
  if field == 'arrival_time':
    arrival = value
  else:
    params = SamplingParams(**{**_fields(params), field: value})
  try:
    engine.submit([1, 2, 3], params, arrival_time=arrival)
    event('accepted')
  except RequestError as e:
    assert str(e)  # names what is wrong
    event('refused')
  done = {c.request_id: c for c in engine.run()}
  for rid in good:
    assert done[rid].output_ids == expected_outputs(OK_PROMPT, 4, 64)
  assert engine.allocator.num_used == 0


def _fields(params):
  return {name: getattr(params, name) for name in FIELDS}


def test_generate_checks_the_whole_batch_before_queuing_any():
  engine = fake_engine()
  with pytest.raises(RequestError, match='seed='):
    engine.generate([OK_PROMPT, OK_PROMPT, OK_PROMPT], SamplingParams(seed=2**31))
  with pytest.raises(RequestError, match='out of vocabulary'):
    engine.generate([OK_PROMPT, [1, 10**6]], SamplingParams(max_new_tokens=2))
  assert not engine.has_work()
  assert len(engine.generate([OK_PROMPT], SamplingParams(max_new_tokens=2))) == 1


@pytest.mark.parametrize('value', [-1.0, math.nan, math.inf, '1', True])
def test_bad_arrival_times_are_refused(value):
  with pytest.raises(RequestError, match='arrival_time='):
    fake_engine().submit(OK_PROMPT, SamplingParams(max_new_tokens=2), arrival_time=value)
