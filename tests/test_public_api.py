"""The public calls (submit, generate, step, run, summary, prefix_cache.pin) under what a user may
throw at them: any Python value is refused with a RequestError naming it or served as what it
is, without harming other requests; calls from several threads at once each get their own
results. One tiny random Llama engine (tiny_models.py) for the whole module, with prefix caching,
a pin budget and a byte-level tokenizer of 256 tokens (ids of printable ASCII fit the model's
97-token vocabulary; the rest, such as a space, are refused as out of vocabulary)."""
import concurrent.futures
import dataclasses
import math
import threading

import numpy as np
import pytest
import tokenizers
from hypothesis import event, given, settings, strategies as st
from hypothesis.extra import numpy as hnp
from tokenizers import decoders, models, pre_tokenizers

from pagedjax.engine import Engine
from pagedjax.host.requests.intake import RequestError
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.model.tokenizer import Tokenizer
from tiny_models import VOCAB, engine_config, prompts, tiny

BLOCK = 16
GREEDY = SamplingParams(max_new_tokens=3)
INNOCENT = prompts([21], seed=5)[0]  # submitted beside every value thrown at the engine


def byte_tokenizer() -> Tokenizer:
  """Byte-level BPE with no merges: one id per byte, printable ASCII first ('!' is 0)."""
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  tok = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)},
                                        merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  return Tokenizer(tok, bos_id=None, eos_id=None)


@pytest.fixture(scope='module')
def engine():
  cfg, params, step = tiny()
  config, rest = engine_config(cfg, block_size=BLOCK, num_blocks=64, max_batch_size=4,
                               prefill_chunk=16, max_seq_len=128, prefix_caching=True)
  config = dataclasses.replace(config, tiers=dataclasses.replace(config.tiers, pinned_blocks=4))
  return Engine(cfg, params, config, step_fn=step, tokenizer=byte_tokenizer(), **rest)


@pytest.fixture(scope='module')
def innocent_alone(engine):
  """The innocent request's greedy tokens on its own (which also warms the compiled shapes)."""
  (done,) = engine.generate([INNOCENT], GREEDY)
  return done.output_ids


def assert_idle_and_whole(engine):
  """Nothing left to do, nothing aborted, and every block free (or evictable) again."""
  assert not engine.has_work() and engine.stats['aborted'] == 0
  assert engine.allocator.num_free == engine.allocator.num_blocks - 1
  assert engine.prefix_cache.num_pinned_idle == 0


# ---- the reported cases ---------------------------------------------------------------------

REFUSED = [
    ('submit', ([True, False, True],), r'prompt=\[True, False, True\]: token id True \(bool, at '
                                       r'index 0\) is not allowed: ints in 0\.\.96 \(bools'),
    ('submit', (np.array([1, 0], bool),), r'prompt=array\(\[ True, False\]\) \(a 1-D bool array\)'
                                          r' is not allowed'),
    ('submit', (b'abc',), r"prompt=b'abc' \(bytes\) is not allowed: decode it to a str"),
    ('submit', (None,), r'prompt=None \(NoneType\) is not allowed: a str \(with a tokenizer\), '
                        r'or token ids'),
    ('submit', (5,), r'prompt=5 \(int\) is not allowed'),
    ('submit', ([[1, 2], [3]],), r'token id \[1, 2\] \(list, at index 0\) is not allowed'),
    ('submit', (np.arange(4.0),), r'prompt=array\(\[0., 1., 2., 3.\]\) \(a 1-D float64 array\)'),
    ('submit', ([1, 10**5000],), r'token ids \[<int of 16610 bits>\] out of vocabulary'),
    ('submit', ('a\ud800b',), r"prompt='a\\ud800b': text is not valid Unicode: lone surrogate "
                              r"'\\ud800' at index 1"),
    ('submit', ('hello world',), r"prompt='hello world' \(token ids \[71, 68, .*\): token ids "
                                 r'\[220\] out of vocabulary: allowed 0\.\.96'),
    ('submit', ([1, 2], {'max_new_token': 3}), r"params: \['max_new_token'\] not fields of "
                                               r'SamplingParams: allowed keys max_new_tokens,'),
    ('submit', ([1, 2], {'max_new_tokens': 0}), r'max_new_tokens=0 is not allowed'),
    ('submit', ([1, 2], 3), r'params=3 \(int\) is not allowed: a SamplingParams, a dict of its '
                            r'fields, or None'),
    ('submit', ([1, 2], {'temperature': 10**400}), r'temperature=1000.*\.\.\. is not allowed'),
    ('submit', ([1, 2], {'cache_salt': '\udc80'}), r"cache_salt='\\udc80' is not allowed"),
    ('submit', ([1, 2], None, 10**400), r'arrival_time=1000.*\.\.\. is not allowed'),
    ('generate', ('hello',), r"prompts='hello' is one prompt: generate takes a list of prompts, "
                             r"e\.g\. generate\(\['hello'\]\)"),
    ('generate', ([1, 2, 3],), r'prompts=\[1, 2, 3\] is one prompt'),
    ('generate', ({'a': 1},), r"prompts=\{'a': 1\} \(dict\) is not allowed: a list of prompts"),
    ('generate', ([[1, 2], 'a b'],), r"prompts\[1\]='a b' \(token ids \[64, 220, 65\]\): token "
                                       r'ids \[220\] out of vocabulary'),
    ('pin', ([999] * BLOCK * 4,), r'token_ids=\[999, 999, .*\.\.\.: token ids \[999, 999, 999, '
                                  r'999, 999\] out of vocabulary: allowed 0\.\.96'),
    ('pin', (list(range(BLOCK)), 1), r'salt=1 is not allowed: None or a string'),
    ('pin', ([],), r'token_ids=\[\]: empty prompt'),
    ('pin', ('abc',), r"token_ids='abc' \(str\) is not allowed: token ids .*\(encode text with "
                      r'the tokenizer first\)'),
]


def call(engine, target, args):
  if target == 'pin':
    return engine.prefix_cache.pin(*args)
  return getattr(engine, target)(*args)


@pytest.mark.parametrize('target,args,message', REFUSED)
def test_bad_argument_is_a_request_error_naming_it(engine, innocent_alone, target, args,
                                                   message):
  innocent = engine.submit(INNOCENT, GREEDY)
  with pytest.raises(RequestError, match=message):
    call(engine, target, args)
  (done,) = engine.run()
  assert done.request_id == innocent and done.output_ids == innocent_alone
  assert_idle_and_whole(engine)


def test_numpy_ids_and_dict_params_are_served(engine, innocent_alone):
  """numpy integer arrays and numpy ints are token ids; a dict of fields is SamplingParams(**d);
  None is the defaults."""
  ids = np.asarray(INNOCENT, np.uint8)
  as_list = [np.int64(t) for t in INNOCENT]
  done = engine.generate([ids, as_list, tuple(INNOCENT)], {'max_new_tokens': 3})
  assert [c.output_ids for c in done] == [innocent_alone] * 3
  (two_d,) = engine.generate(np.asarray([INNOCENT]), dict(max_new_tokens=3))  # one per row
  assert two_d.output_ids == innocent_alone and two_d.prompt_ids == INNOCENT
  rid = engine.submit(ids, None)
  assert len(engine.run()[0].output_ids) == SamplingParams().max_new_tokens
  assert engine.finished[rid].prompt_ids == INNOCENT
  assert_idle_and_whole(engine)


def test_generate_returns_its_own_batch_and_finishes_earlier_requests(engine, innocent_alone):
  other = prompts([9], seed=6)[0]
  (other_alone,) = engine.generate([other], GREEDY)
  earlier = engine.submit(INNOCENT, GREEDY)
  samples = SamplingParams(max_new_tokens=3, n=2, temperature=1.0)
  done = engine.generate([other, INNOCENT], GREEDY)
  assert [c.prompt_ids for c in done] == [other, INNOCENT]
  assert [c.output_ids for c in done] == [other_alone.output_ids, innocent_alone]
  assert engine.finished[earlier].output_ids == innocent_alone  # finished, kept in `finished`
  forked = engine.generate([other], samples)  # n samples: n completions of the prompt
  assert len(forked) == 2 and {c.group_id for c in forked} == {forked[0].request_id}
  assert engine.generate([]) == []
  assert_idle_and_whole(engine)


# ---- any value --------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70), st.integers(-3, VOCAB + 3),
    st.floats(allow_nan=True, allow_infinity=True), st.binary(max_size=6), st.text(max_size=6),
    st.text('abcXYZ!?', min_size=1, max_size=12),  # printable ASCII: in the model's vocabulary
    st.sampled_from(['\ud800', 'a\udfffb', '', ' ', 2**31, 2**63, -1, VOCAB, math.nan]),
    st.builds(np.int64, st.integers(-2, VOCAB + 2)), st.builds(np.float32, st.floats(0, 99)))
ARRAYS = st.one_of(
    hnp.arrays(st.sampled_from([np.int8, np.uint8, np.int32, np.int64, np.uint64, np.float32,
                                np.float64, np.bool_]),
               hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=5)),
    hnp.arrays(st.sampled_from([np.int16, np.int64]), st.integers(1, 20),
               elements=st.integers(0, VOCAB - 1)))  # valid token ids
IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
VALUES = st.recursive(
    st.one_of(SCALARS, ARRAYS, IDS, st.tuples(st.integers(0, VOCAB - 1)),
              st.builds(range, st.integers(0, 30))),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=4), inner, max_size=2)),
    max_leaves=6)
PARAMS = st.one_of(VALUES, st.fixed_dictionaries({}, optional={
    'max_new_tokens': st.sampled_from([0, 1, 3, 2**40, 'x', None]),
    'temperature': st.sampled_from([0.0, math.nan, -1.0, True]),
    'seed': st.integers(), 'cache_salt': st.sampled_from([None, 's', '\ud800', 3]),
    'n': st.sampled_from([0, 1, 2, 9]), 'bogus': st.none()}))
CALLS = st.one_of(
    st.tuples(st.just('submit'), VALUES.map(lambda v: (v, GREEDY))),
    st.tuples(st.just('submit'), PARAMS.map(lambda p: ([7, 8, 9], p))),
    st.tuples(st.just('submit'), SCALARS.map(lambda t: ([7, 8, 9], GREEDY, t))),
    st.tuples(st.just('generate'), VALUES.map(lambda v: (v, GREEDY))),
    st.tuples(st.just('generate'), st.lists(VALUES, max_size=3).map(lambda v: (v, GREEDY))),
    st.tuples(st.just('generate'), PARAMS.map(lambda p: ([[7, 8, 9]], p))),
    st.tuples(st.just('pin'), st.one_of(VALUES, st.lists(st.integers(0, VOCAB - 1), min_size=16,
                                                        max_size=40)).map(lambda v: (v,))),
    st.tuples(st.just('pin'), SCALARS.map(lambda s: (list(range(BLOCK)), s))))


@settings(max_examples=40, deadline=None)
@given(target_args=CALLS)
def test_any_value_is_refused_or_served_without_harming_others(engine, innocent_alone,
                                                               target_args):
  target, args = target_args
  innocent = engine.submit(INNOCENT, GREEDY)
  try:
    result = call(engine, target, args)
  except RequestError as e:
    assert str(e)
    event(f'{target}: refused')
    engine.run()
  else:
    event(f'{target}: served')
    served_as_what_it_is(engine, target, args, result)
  assert engine.finished[innocent].output_ids == innocent_alone
  assert_idle_and_whole(engine)


def served_as_what_it_is(engine, target, args, result):
  """An accepted call did what its arguments say (and leaves the engine idle again)."""
  if target == 'pin':
    ids = [int(t) for t in np.asarray(args[0]).tolist()]
    assert len(result) == len(ids) // BLOCK
    engine.run()
    engine.prefix_cache.unpin(*args)
    return
  params = args[1] if isinstance(args[1], SamplingParams) else SamplingParams(**(args[1] or {}))
  if target == 'submit':
    engine.run()
    done = [engine.finished[result + i] for i in range(params.n)]
    batch = [args[0]]
  else:
    done, batch = result, list(args[0])
  assert len(done) == len(batch) * params.n
  for i, c in enumerate(done):
    assert c.prompt_ids == as_ids(engine, batch[i // params.n])
    assert c.finish_reason == 'length' and len(c.output_ids) == params.max_new_tokens


def as_ids(engine, prompt):
  if isinstance(prompt, str):
    return engine.tokenizer.encode(prompt)
  return [int(t) for t in (np.asarray(prompt).tolist() if hasattr(prompt, '__array__') else
                           prompt)]


# ---- threads --------------------------------------------------------------------------------

def test_threads_each_get_their_own_completions(engine):
  """Three threads generate their own batches at once while a fourth pins, unpins, steps and
  reads the summary: each batch comes back whole, as served one after another."""
  batches = [prompts([5, 20], seed=30 + i) for i in range(3)]
  params = SamplingParams(max_new_tokens=6)
  serial = [[c.output_ids for c in engine.generate(b, params)] for b in batches]
  start, stop = threading.Barrier(4), threading.Event()

  def generate(batch):
    start.wait()
    return [engine.generate(batch, params) for _ in range(2)]

  def meddle():
    start.wait()
    prefix = prompts([BLOCK], seed=40)[0]
    while not stop.is_set():
      engine.prefix_cache.pin(prefix)
      engine.step()
      assert engine.summary()['num_blocks'] == 64
      engine.prefix_cache.unpin(prefix)

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    meddler = pool.submit(meddle)
    results = [pool.submit(generate, b) for b in batches]
    got = [r.result(timeout=120) for r in results]
    stop.set()
    meddler.result(timeout=60)
  for batch, want, rounds in zip(batches, serial, got):
    for done in rounds:
      assert [c.prompt_ids for c in done] == batch
      assert [c.output_ids for c in done] == want
  assert_idle_and_whole(engine)
