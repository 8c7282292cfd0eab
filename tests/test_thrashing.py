"""Thrashing at tiny scale: a pool too small for the requests it admits preempts the same
requests again and again; the metrics that show it (re-preempted requests, recomputed tokens)
count exactly, and projected admission, write-through to host and swap cut the recomputation
without changing a token. Model-free engines (tests/fakes.py) run the real host code in
milliseconds; write-through moves real (tiny) block arrays. The experiment's pipeline runs in
process on its `:sim` variant here, and on its `:tiny` variant (a real tiny model) in
tests/test_study_smoke.py."""
import dataclasses

import numpy as np
import pytest

from fakes import CFG, FakeClock, FakeStep, check_blocks, expected_outputs
from pagedjax.config import ConfigError, TiersConfig
from pagedjax.engine import Engine
from pagedjax.host.requests.sampling_params import SamplingParams
from tiny_models import engine_config

MAX_SEQ_LEN = 64


def trace():
  """16 requests, one every 0.5 s (one fake device call), of 4-19 prompt tokens growing by
  8-29: far more than 12 blocks of 4 tokens hold once they grow."""
  rng = np.random.default_rng(0)
  return [(rng.integers(0, 97, int(rng.integers(4, 20))).tolist(), int(rng.integers(8, 30)),
           0.5 * i) for i in range(16)]


def serve(num_blocks=13, tiers=None, **flat):
  clock = FakeClock(0.5)
  config, rest = engine_config(CFG, block_size=4, num_blocks=num_blocks, max_batch_size=6,
                               prefill_chunk=8, max_seq_len=MAX_SEQ_LEN, **flat)
  if tiers is not None:
    config = dataclasses.replace(config, tiers=tiers)
  engine = Engine(CFG, None, config, step_fn=FakeStep(clock.tick), timer=clock, **rest)
  requests = trace()
  for prompt, n, t in requests:
    engine.submit(prompt, SamplingParams(max_new_tokens=n, stop_on_eos=False), arrival_time=t)
  done = engine.run()
  assert [c.output_ids for c in done] == [expected_outputs(p, n, MAX_SEQ_LEN)
                                          for p, n, _ in requests]
  check_blocks(engine)
  return engine, done


def fed_once():
  """Positions a run feeds with nothing recomputed: each prompt, then every generated token
  but the last (never fed back)."""
  return sum(len(p) + n - 1 for p, n, _ in trace())


def test_a_small_pool_thrashes_and_the_metrics_count_it_exactly():
  engine, done = serve()
  s = engine.summary()
  assert s['preemptions'] == s['preemptions_recompute'] > len(done) // 2
  per_request = [c.num_preemptions for c in done]
  assert s['preempted_requests'] == sum(p >= 1 for p in per_request)
  assert s['re_preempted_requests'] == sum(p >= 2 for p in per_request) > 0
  assert s['max_preemptions_per_request'] == max(per_request) >= 2
  # Every position fed beyond the first pass is one a preemption threw away.
  assert s['recomputed_tokens'] > 0
  assert s['tokens_fed'] == fed_once() + s['recomputed_tokens']
  assert s['recomputed_token_fraction'] == s['recomputed_tokens'] / s['tokens_fed'] > 0.2
  # No finished request was aborted, so goodput is every generated token per second.
  assert s['goodput_tokens_per_s'] == s['generated_tokens_per_s'] > 0


def test_a_pool_that_holds_everything_recomputes_nothing():
  s = serve(num_blocks=128)[0].summary()
  assert s['preemptions'] == s['re_preempted_requests'] == s['recomputed_tokens'] == 0
  assert s['tokens_fed'] == fed_once() and s['recomputed_token_fraction'] == 0.0


@pytest.fixture(scope='module')
def unmitigated():
  return serve()[0].summary()


@pytest.mark.parametrize('name,kw', [
    ('projected to completion', dict(admission='projected')),
    ('projected 8 tokens ahead', dict(admission='projected', admission_horizon=8)),
    ('write-through to host', dict(prefix_caching=True, tiers=TiersConfig(
        host_blocks=64, write_through=True, promotion='load'))),
    ('swap', dict(preemption='swap')),
])
def test_mitigations_cut_the_recomputed_fraction(unmitigated, name, kw):
  s = serve(**kw)[0].summary()
  assert s['tokens_fed'] == fed_once() + s['recomputed_tokens'], name
  assert s['recomputed_token_fraction'] < unmitigated['recomputed_token_fraction'] / 2, name
  if name == 'projected to completion':  # admits only what fits grown: nothing to preempt
    assert s['preemptions'] == 0
  if name == 'write-through to host':  # as many preemptions, but the blocks come back loaded
    assert s['preemptions_recompute'] > 0 and s['tiers_tier2_hit_blocks'] > 0
  if name == 'swap':
    assert s['preemptions_swap'] > 0 and s['recomputed_tokens'] == 0


def test_a_chosen_pool_outside_the_sweep_is_refused_by_name():
  from configs import thrashing as thrashing_config  # pylint: disable=import-outside-toplevel
  from experiments import thrashing  # pylint: disable=import-outside-toplevel
  config = thrashing_config.get_config('tiny')
  config.thrashing.chosen_pool = 9
  with pytest.raises(ConfigError, match=r'config.thrashing.chosen_pool=9 .*one of'):
    thrashing.check(config)


def test_the_simulated_variant_marks_itself_and_skips_no_row(tmp_path):
  """`:sim` at a few requests, in this process (no compilation: the device is a cost model)."""
  from configs import thrashing as thrashing_config  # pylint: disable=import-outside-toplevel
  from experiments import thrashing  # pylint: disable=import-outside-toplevel
  config = thrashing_config.get_config('sim')
  config.sim.model = 'smollm2-135m'
  config.engine.update(dict(max_seq_len=256, max_batch_size=8, prefill_chunk=32))
  config.scheduler.max_num_batched_tokens = 64
  config.workload.update(dict(num_requests=12, length_scale=0.1, max_input_len=64,
                              max_output_len=64))
  config.thrashing.update(dict(pool_blocks=(16,), rates=(50.0, 200.0), chosen_pool=16))
  thrashing.check(config)
  summary = thrashing.study(config, str(tmp_path))
  assert summary['simulated'] is True and '(simulated)' in summary['setting']
  assert summary['outputs_identical'] is True
  assert [r['row'] for r in summary['mitigations']] == [name for name, _ in config.thrashing.rows]
  # One run per point on a deterministic clock: the rerun peak is the peak.
  assert summary['peak']['reference_goodput_tokens_per_s'] == summary['peak'][
      'goodput_tokens_per_s']
  by_row = {r['row']: r for r in summary['mitigations']}
  assert by_row['unmitigated']['preemptions'] > 0
  assert by_row['swap']['recomputed_token_fraction'] == 0.0
