"""Block sharing: forks and copy-on-write (parallel sampling), and block bookkeeping under random
workloads with prefix caching, forks, preemption and eviction (model-free fake step)."""
import csv
import json

import hypothesis
import hypothesis.strategies as st
import pytest

from pagedjax.config import ConfigError
from pagedjax.engine import RequestError
from pagedjax.host.requests.sampling_params import SamplingParams

from fakes import FakeClock, FakeStep, check_blocks, expected_outputs, fake_engine, written_blocks
from study_outputs import check_outputs, run_tiny
from tiny_models import make_engine, prompts


# ---- parallel sampling on a real (tiny) model ----------------------------------------------

@pytest.mark.parametrize('prompt_len', [37, 33])  # last block partly filled at the fork / not
def test_parallel_samples_equal_independent_requests(prompt_len):
  """Sample i of a group is the request with seed + i: forks share blocks, copy-on-write keeps
  each sample's K/V its own, so nothing else may change."""
  prompt = prompts([prompt_len], seed=3)[0]
  params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11)
  group = make_engine(num_blocks=32)
  first = group.submit(prompt, SamplingParams(**{**params.__dict__, 'n': 3}))
  together = group.run()
  alone = make_engine(num_blocks=32)
  for i in range(3):
    alone.submit(prompt, SamplingParams(**{**params.__dict__, 'seed': 11 + i}))
  separate = alone.run()
  assert [c.output_ids for c in together] == [c.output_ids for c in separate]
  assert [c.request_id for c in together] == [first, first + 1, first + 2]
  assert {c.group_id for c in together} == {first}
  assert len({tuple(c.output_ids) for c in together}) > 1  # they are different samples
  s, s_alone = group.summary(), alone.summary()
  assert s['forks'] == 2
  # A partly filled last prompt block is copied by all but the last writer; a full one is not.
  assert s['cow_copies'] == (2 if prompt_len % 16 != 1 else 0)
  assert s['prompt_tokens_computed'] == prompt_len - 1 + 3
  assert s['kv_sharing_saved_fraction'] > 0 and s_alone['kv_sharing_saved_fraction'] == 0
  assert s['peak_blocks_used'] < s_alone['peak_blocks_used']


def test_parallel_samples_rejected_beyond_batch():
  engine = make_engine(max_batch_size=4)
  with pytest.raises(RequestError, match='n=5'):
    engine.submit([1, 2, 3], SamplingParams(n=5))
  with pytest.raises(RequestError, match='n=0'):
    engine.submit([1, 2, 3], SamplingParams(n=0))


# ---- fake-step engines: every write goes to a private block --------------------------------

def _engine(**kw):
  clock = FakeClock()
  engine = None

  def no_shared_writes(inputs):
    for b in written_blocks(inputs, engine.block_size) - {0}:
      assert engine.allocator.ref_count(b) == 1, f'step writes into shared block {b}'

  engine = fake_engine(clock, step_fn=FakeStep(clock.tick, no_shared_writes), **kw)
  return engine


def test_fork_copies_once_per_extra_holder():
  engine = _engine()
  engine.submit(list(range(1, 11)), SamplingParams(max_new_tokens=6, n=4))  # 10 tokens, bs 4
  out = engine.run()
  assert [c.output_ids for c in out] == [expected_outputs(list(range(1, 11)), 6, 4096)] * 4
  assert engine.stats['cow_copies'] == 3
  check_blocks(engine)


OPS = st.lists(st.one_of(
    st.tuples(st.just('submit'), st.integers(0, 2), st.integers(1, 14), st.integers(1, 3),
              st.integers(1, 10), st.integers(0, 1)),
    st.tuples(st.just('step'), st.integers(1, 4))), min_size=1, max_size=14)


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(ops=OPS, preemption=st.sampled_from(['recompute', 'swap']),
                  caching=st.sampled_from([None, 'hash', 'radix']),
                  eviction=st.sampled_from(['lru', 'lfu']))
def test_block_invariants_under_random_workloads(ops, preemption, caching, eviction):
  """Random submit (shared prefixes, n samples, salts) and steps; a 16-block pool forces
  preemption and eviction. After every iteration: ref counts equal holders, free / evictable /
  held partition the pool, no step writes a shared block; at the end only evictable cached
  blocks are off the free list; outputs are what the fake model gives without any sharing."""
  engine = _engine(preemption=preemption, prefix_caching=bool(caching),
                   prefix_cache_design=caching or 'hash', prefix_cache_eviction=eviction,
                   swap_blocks=8, max_seq_len=64)
  prefixes = [list(range(1, 13)), list(range(50, 59)), [7, 7, 7, 7, 7]]
  expected = {}
  for op in ops:
    if op[0] == 'submit':
      _, which, suffix, n, max_new, salt = op
      prompt = prefixes[which] + [(which * 13 + i) % 97 for i in range(suffix)]
      first = engine.submit(prompt, SamplingParams(max_new_tokens=max_new, n=n,
                                                   cache_salt=str(salt)))
      for i in range(n):
        expected[first + i] = expected_outputs(prompt, max_new, 64)
    else:
      for _ in range(op[1]):
        engine.step()
        check_blocks(engine)
  while engine.has_work():
    engine.step()
    check_blocks(engine)
  assert {i: engine.finished[i].output_ids for i in expected} == expected
  held = set(range(1, engine.allocator.num_blocks)) - set(engine.allocator.free_blocks())
  evictable = set(engine.prefix_cache.evictable_blocks()) if caching else set()
  assert held == evictable
  if not caching:
    assert engine.allocator.num_free == engine.allocator.num_blocks - 1


def test_reproduce_sharing_tiny(tmp_path):
  """The experiment end to end on its :tiny_beam config (:tiny and the beam study), in this
  process (cli.run_config, as the command line runs it): table, CSV, plot and summary. Figures
  are checked for sense, not for the goals, which need the full-size trace; beams share blocks
  on both traces."""
  from configs import reproduce_sharing as sharing_config  # pylint: disable=import-outside-toplevel
  from experiments import reproduce_sharing  # pylint: disable=import-outside-toplevel
  config = sharing_config.get_config('tiny_beam')
  assert sharing_config.get_config('tiny').beam_search.beam_widths == []  # else the same
  s, stdout = run_tiny(reproduce_sharing.study, config, tmp_path, check=reproduce_sharing.check)
  check_outputs(tmp_path, stdout, variant='tiny_beam')
  assert s == json.loads((tmp_path / 'summary.json').read_text())
  sp, mt, ps = s['shared_prompt'], s['multi_turn'], s['parallel_sampling']
  assert s['prefix_hit_rate'] == sp['prefix_hit_rate'] and 0 < sp['prefix_hit_rate'] < 1
  assert 0 < s['prefill_tokens_saved_fraction'] < 1 and s['ttft_speedup'] > 0
  assert sp['prefill_reduction'] > 1 and mt['prefill_reduction'] > 1
  assert sp['runs']['uncached']['prefix_hit_rate_tokens'] is None
  assert 0 < ps['alpaca']['n2'] < 1 and 0 < ps['sharegpt']['n2'] < 1
  assert set(s['goals']) == {'prefill_reduction', 'ttft_speedup'}
  assert 0 < s['beam_search']['alpaca']['beam2'] < 1
  assert 0 < s['beam_search']['sharegpt']['beam2'] < 1
  with open(tmp_path / 'results.jsonl') as f:
    rows = [json.loads(line) for line in f]
  assert [r['study'] for r in rows] == (['shared_prompt'] * 2 + ['multi_turn'] * 2 +
                                        ['parallel_sampling'] * 2 + ['beam_search'] * 2)
  beams = [r for r in rows if r['study'] == 'beam_search']
  assert [(r['dataset'], r['beam_width']) for r in beams] == [('alpaca', 2), ('sharegpt', 2)]
  assert all(r['rejected_requests'] == 0 and r['finished_requests'] == 3 for r in beams)
  with open(tmp_path / 'results.csv') as f:
    rows = list(csv.DictReader(f))
  assert [(r['study'], r['dataset'], r['prefix_caching']) for r in rows[:2]] == [
      ('shared_prompt', '', 'False'), ('shared_prompt', '', 'True')]
  assert (tmp_path / 'sharing.png').stat().st_size > 0 and 'goal shared_prompt' in stdout
  config.parallel_sampling.sample_n = [2, 0]
  with pytest.raises(ConfigError, match=r'config.parallel_sampling.sample_n=\[2, 0\] is not '
                     r'allowed: a non-empty list, each an integer >= 1'):
    reproduce_sharing.check(config)
