"""Bad requests are rejected at admission with a clear error and disturb nobody else."""
import pytest

from pagedjax.engine import RequestError
from pagedjax.host.requests.sampling_params import SamplingParams
from tiny_models import VOCAB, make_engine, prompts

BAD = [
    ([], SamplingParams(), 'empty prompt'),
    ([1, VOCAB, 3], SamplingParams(), rf'token ids \[{VOCAB}\] out of vocabulary: allowed '
                                      rf'0..{VOCAB - 1}'),
    ([1, -2], SamplingParams(), r'token ids \[-2\] out of vocabulary'),
    ([1, 2], SamplingParams(max_new_tokens=0), 'max_new_tokens=0 is not allowed'),
    ([1, 2], SamplingParams(temperature=-1.0), 'temperature=-1.0 is not allowed'),
    ([1, 2], SamplingParams(temperature=1e39), r'temperature=1e\+39 is not allowed: a number in '
                                               r'\[0, 3.402823e\+38\]'),
    (list(range(50)) * 11, SamplingParams(), 'prompt of 550 tokens: the maximum is 511'),
]


@pytest.mark.parametrize('prompt,params,message', BAD)
def test_bad_request_rejected_and_others_unaffected(prompt, params, message):
  good = prompts([7, 12], seed=2)
  reference = make_engine().generate(good, SamplingParams(max_new_tokens=5))
  engine = make_engine()
  first = engine.submit(good[0], SamplingParams(max_new_tokens=5))
  with pytest.raises(RequestError, match=message):
    engine.submit(prompt, params)
  second = engine.submit(good[1], SamplingParams(max_new_tokens=5))
  done = engine.run()
  assert [c.request_id for c in done] == [first, second]
  assert [c.output_ids for c in done] == [c.output_ids for c in reference]
  assert engine.allocator.num_free == engine.allocator.num_blocks - 1


def test_request_that_can_never_fit_the_pool_is_rejected():
  engine = make_engine(num_blocks=5)  # 4 usable blocks of 16 = 64 tokens
  with pytest.raises(RequestError, match=r'needs up to 5 blocks .* pool has only 4: it can '
                                         r'never fit'):
    engine.submit(prompts([60])[0], SamplingParams(max_new_tokens=10))
  engine.submit(prompts([30])[0], SamplingParams(max_new_tokens=10))
  assert len(engine.run()) == 1


def test_text_prompt_needs_a_tokenizer():
  with pytest.raises(RequestError, match='needs an engine built with a tokenizer'):
    make_engine().submit('hello')


def test_generation_stops_at_eos_and_max_seq_len():
  engine = make_engine()
  (c,) = engine.generate(prompts([6], seed=4), SamplingParams(max_new_tokens=8))
  eos = c.output_ids[2]
  stopping = make_engine(eos_id=eos)
  (d,) = stopping.generate(prompts([6], seed=4), SamplingParams(max_new_tokens=8))
  assert d.finish_reason == 'eos' and d.output_ids == c.output_ids[:c.output_ids.index(eos) + 1]
  short = make_engine(max_seq_len=10)
  (e,) = short.generate(prompts([6], seed=4), SamplingParams(max_new_tokens=8))
  assert e.finish_reason == 'max_seq_len' and len(e.output_ids) == 4



def test_decode_min_rows_1_gives_lone_sequences_one_row_calls():
  """engine.decode_min_rows=1: decode calls pad to the next power of two of their real rows
  (1, 2, 4), not to 8 (here max_batch_size=4: to 4), with the same tokens."""
  want = make_engine().generate(prompts([9, 20, 5], seed=4), SamplingParams(max_new_tokens=6))
  engine = make_engine(decode_min_rows=1)
  calls, run_call = [], engine.executor.step_fn

  def recording(params, pool, inputs):
    if inputs.tokens.shape[1] == 1:  # decode: (padded rows, real rows)
      calls.append((inputs.tokens.shape[0], int((inputs.positions[:, 0] >= 0).sum())))
    return run_call(params, pool, inputs)
  engine.executor.step_fn = recording
  got = engine.generate(prompts([9, 20, 5], seed=4), SamplingParams(max_new_tokens=6))
  assert [c.output_ids for c in got] == [c.output_ids for c in want]
  assert all(padded == 1 << (real - 1).bit_length() for padded, real in calls), calls
  assert {padded for padded, _ in calls} >= {1, 4}  # the 20-token prompt finishes last, alone
