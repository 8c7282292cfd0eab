"""Recomputation storms: the shared system prompt changes version mid-run.

The windowed prefix hit rate and its alert (pagedjax/host/alerts.py), the mitigations (pre-warm:
the new prompt computed once before the switch and pinned; throttle: prompt tokens per iteration
capped while the alert is active), provoked at tiny scale on the model-free engine (tests/fakes.py)
and once on a tiny real model for token identity.
"""
import dataclasses
import functools

import pytest

from configs import default
from fakes import CFG, FakeClock, FakeStep, expected_outputs
from pagedjax.studies import workloads
from pagedjax.config import AlertsConfig, ConfigError
from pagedjax.studies.workloads import validate_config
from pagedjax.engine import Engine
from pagedjax.host.alerts import HitRateMonitor
from pagedjax.host.requests.sampling_params import SamplingParams
from tiny_models import engine_config, prompts, tiny

SWITCH_S, SYSTEM, LEAD_S, CAP = 40.0, 32, 5.0, 8


def fake_encode(text):
  return [b % CFG.vocab_size for b in text.encode()]  # byte tokens folded into the fake vocab


@functools.lru_cache(maxsize=None)
def trace():
  return workloads.system_prompt_switch(
      40, SYSTEM, SWITCH_S, (workloads.LengthDist(8, 0.5), workloads.LengthDist(4, 0.5)),
      encode=fake_encode, rate=0.5, seed=0, max_input_len=12, max_output_len=6)


def new_prefix():
  first = next(r for r in trace() if r.arrival_time >= SWITCH_S)
  return first.prompt_ids[:first.shared_prefix_len]


def engine_for(model_cfg, params, prewarm: bool, throttle: bool, window: int, **flat):
  config, rest = engine_config(model_cfg, prefix_caching=True, **flat)
  blocks = SYSTEM // config.pool.block_size  # the full blocks a pin keeps
  config = dataclasses.replace(
      config, alerts=AlertsConfig(window, 0.3, CAP if throttle else 0),
      tiers=dataclasses.replace(config.tiers, pinned_blocks=blocks if prewarm else 0))
  return Engine(model_cfg, params, config, **rest)


def replay(engine, requests, prefix, prewarm: bool, lead_s: float):
  """Submits the trace (and the pre-warm request, pinned, lead_s before the switch); runs it;
  returns the trace requests' completions."""
  if prewarm:
    engine.prefix_cache.pin(prefix)
    engine.submit(prefix, SamplingParams(max_new_tokens=1), arrival_time=SWITCH_S - lead_s)
  ids = [engine.submit(r.prompt_ids, SamplingParams(max_new_tokens=r.max_new_tokens,
                                                    stop_on_eos=False),
                       arrival_time=r.arrival_time) for r in requests]
  engine.run()
  return [engine.finished[i] for i in ids]


@functools.lru_cache(maxsize=None)
def fake_run(prewarm=False, throttle=False):
  """(engine, completions) of the fake engine replaying the switch trace: 1 s per step call."""
  clock = FakeClock(1.0)
  engine = engine_for(CFG, None, prewarm, throttle, window=8, block_size=4, num_blocks=65,
                      max_batch_size=4, prefill_chunk=8, max_seq_len=64,
                      step_fn=FakeStep(clock.tick), timer=clock)
  return engine, replay(engine, trace(), new_prefix(), prewarm, LEAD_S)


def missed_after_switch(engine) -> int:
  """Prompt tokens queried at admission but not found in the cache, from the switch on."""
  tl = engine.metrics.timeline()
  return sum(q - h for t, q, h in zip(tl['t'], tl['prefix_queried_tokens'],
                                      tl['prefix_hit_tokens']) if t >= SWITCH_S)


# ---- the alert itself --------------------------------------------------------------------

def test_alert_fires_on_a_drop_below_the_window_before_and_clears_on_recovery():
  monitor = HitRateMonitor(window=4, drop=0.5)
  feed = [(100, 80)] * 8 + [(100, 0)] * 3 + [(0, 0)] * 2 + [(100, 80)] * 6
  rates = []
  for i, (queried, hit) in enumerate(feed):
    monitor.observe(i, i * 0.5, queried, hit)
    rates.append(monitor.rate)
  # Windows of 4 iterations: 0.8 steady, then one, two, three misses; iterations without
  # lookups add no weight; the hits return.
  assert rates[7:14] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0, 0.0, 0.4])
  alert, = monitor.alerts
  # 0.4 is not below (1 - 0.5) x 0.8: it fires at 0.2, and clears back at 0.4.
  assert (alert.fired_iteration, alert.fired_t) == (10, 5.0)
  assert alert.hit_rate_before == pytest.approx(0.8)
  assert alert.hit_rate_after == pytest.approx(0.2) and alert.min_hit_rate == 0.0
  assert (alert.cleared_iteration, alert.cleared_t) == (13, 6.5)
  assert alert.hit_rate_cleared == pytest.approx(0.4)
  figures = monitor.figures()
  assert figures['hit_rate_alerts_fired'] == figures['hit_rate_alerts_cleared'] == 1
  assert figures['hit_rate_alert_iterations'] == 3  # iterations 10, 11, 12 ended active
  assert figures['hit_rate_alerts'][0]['cleared_iteration'] == 13
  assert monitor.prefill_cap is None  # no throttle configured


def test_throttle_follows_the_alert():
  monitor = HitRateMonitor(window=1, drop=0.5, throttle_prefill_tokens=16)
  caps = []
  for i, hit in enumerate([90, 90, 0, 0, 90, 90]):
    monitor.observe(i, float(i), 100, hit)
    caps.append(monitor.prefill_cap)
  assert caps == [None, None, 16, 16, None, None]
  with pytest.raises(ValueError, match='throttle_prefill_tokens=16 needs drop > 0'):
    HitRateMonitor(window=1, drop=0.0, throttle_prefill_tokens=16)
  with pytest.raises(ValueError, match=r'drop=1.5 is not allowed: a fraction in \[0, 1\)'):
    HitRateMonitor(drop=1.5)


def test_no_alert_without_a_recent_level_or_with_drop_zero():
  cold = HitRateMonitor(window=4, drop=0.5)
  for i in range(6):  # a cold start: misses with no window before holding lookups
    cold.observe(i, float(i), 100 if i >= 4 else 0, 0)
  assert not cold.alerts
  off = HitRateMonitor(window=2, drop=0.0)
  for i, hit in enumerate([90] * 4 + [0] * 4):
    off.observe(i, float(i), 100, hit)
  assert not off.alerts and off.min_rate == 0.0


# ---- storms on the model-free engine -----------------------------------------------------

def test_storm_alert_fires_at_the_switch_and_clears():
  engine, _ = fake_run()
  s, tl = engine.summary(), engine.metrics.timeline()
  alert, = s['hit_rate_alerts']
  assert SWITCH_S <= alert['fired_t'] < alert['cleared_t'] < SWITCH_S + 40
  assert alert['hit_rate_after'] < 0.7 * alert['hit_rate_before']
  assert alert['hit_rate_cleared'] >= 0.7 * alert['hit_rate_before']
  active = [i for i, on in enumerate(tl['hit_rate_alert']) if on]
  assert active == list(range(alert['fired_iteration'], alert['cleared_iteration']))
  assert s['prefix_hit_rate_windowed_min'] == alert['min_hit_rate'] < 0.2
  assert engine.scheduler.prefill_cap is None  # the alert alone throttles nothing


def test_prewarm_avoids_the_collapse():
  plain, _ = fake_run()
  warm, _ = fake_run(prewarm=True)
  s_plain, s_warm = plain.summary(), warm.summary()
  # Pre-warmed, requests after the switch miss only their own messages; unmitigated, the
  # first ones also miss the new system prompt, several of them at once.
  own = sum(len(r.prompt_ids) - SYSTEM for r in trace() if r.arrival_time >= SWITCH_S)
  assert missed_after_switch(warm) <= own
  assert missed_after_switch(plain) >= own + 2 * SYSTEM
  assert s_warm['hit_rate_alerts_fired'] == 0
  assert s_warm['prefix_hit_rate_windowed_min'] > 2 * s_plain['prefix_hit_rate_windowed_min']
  assert s_warm['prefix_pinned_blocks'] == SYSTEM // 4
  # The pre-warm computes the new prompt once: fewer prompt tokens than the crowd that missed it.
  assert s_warm['prompt_tokens_computed'] < s_plain['prompt_tokens_computed']


def test_throttle_caps_prefill_tokens_while_the_alert_is_active():
  engine, _ = fake_run(throttle=True)
  tl, s = engine.metrics.timeline(), engine.summary()
  assert s['hit_rate_alerts_fired'] >= 1 and s['hit_rate_alerts_cleared'] == s[
      'hit_rate_alerts_fired']
  # The cap set after an iteration whose alert was active governs the next one.
  after_alert = [bool(on) for on in tl['hit_rate_alert'][:-1]]
  capped = [n for n, on in zip(tl['prefill_tokens'][1:], after_alert) if on]
  free = [n for n, on in zip(tl['prefill_tokens'][1:], after_alert) if not on]
  assert capped and max(capped) <= CAP
  assert max(free) > CAP  # unthrottled iterations do take more
  assert engine.scheduler.prefill_cap is None  # lifted when the alert cleared


def test_outputs_are_the_fake_models_under_every_mitigation():
  for prewarm in (False, True):
    for throttle in (False, True):
      _, done = fake_run(prewarm, throttle)
      assert [c.output_ids for c in done] == [
          expected_outputs(r.prompt_ids, r.max_new_tokens, 64) for r in trace()]


def test_real_model_outputs_token_identical_across_mitigations():
  """The tiny real Llama, greedy: pinned pre-warmed blocks and throttled (shorter) prefill chunks
  give the same tokens as the unmitigated run. The clock moves only by idle jumps to arrivals,
  so the schedule is the same in every run."""
  cfg, params, step = tiny('gqa')
  v1, v2 = prompts([SYSTEM, SYSTEM], seed=7)
  users = prompts([5, 17, 9, 12, 3, 20, 7, 11], seed=8)
  # One at a time (prompt chunks of one row, decodes of four: two compiled shapes in all).
  arrivals = [0.0, 10.0, 20.0, 30.0, SWITCH_S, SWITCH_S + 5, SWITCH_S + 10, SWITCH_S + 15]
  requests = [workloads.TraceRequest(i, t, (v1 if t < SWITCH_S else v2) + u, 4,
                                     shared_prefix_len=SYSTEM)
              for i, (t, u) in enumerate(zip(arrivals, users))]
  outputs, summaries = {}, {}
  for prewarm, throttle in ((False, False), (False, True), (True, True)):
    # tiny_models.make_engine's shapes, which other test files compile too.
    engine = engine_for(cfg, params, prewarm, throttle, window=2, block_size=16, num_blocks=64,
                        max_batch_size=4, prefill_chunk=16, step_fn=step, timer=FakeClock())
    outputs[prewarm, throttle] = [c.output_ids for c in replay(engine, requests, v2, prewarm,
                                                                lead_s=5.0)]
    summaries[prewarm, throttle] = engine.summary()
  assert outputs[False, True] == outputs[False, False] == outputs[True, True]
  # The throttle did engage: shorter prompt chunks, so more iterations.
  assert summaries[False, True]['hit_rate_alerts_fired'] >= 1
  assert summaries[False, True]['iterations'] > summaries[False, False]['iterations']
  assert summaries[True, True]['prefix_hit_tokens'] > summaries[False, False]['prefix_hit_tokens']


# ---- config and trace errors -------------------------------------------------------------

@pytest.mark.parametrize('fields, message', [
    (dict(hit_rate_window=0), r'config.alerts.hit_rate_window=0 is not allowed: an integer >= 1'),
    (dict(hit_rate_drop=1.0), r'config.alerts.hit_rate_drop=1.0 is not allowed: a fraction in '
                              r'\[0, 1\)'),
    (dict(hit_rate_drop=-0.1), r'config.alerts.hit_rate_drop=-0.1 is not allowed'),
    (dict(throttle_prefill_tokens=-1), r'throttle_prefill_tokens=-1 is not allowed: an integer'),
    (dict(throttle_prefill_tokens=32), r'throttle_prefill_tokens=32 is not allowed: 0 unless '
                                       r'alerts.hit_rate_drop > 0'),
])
def test_config_errors_name_field_value_and_allowed(fields, message):
  config = default.get_config('tiny')
  config.prefix_cache.enabled = True
  config.alerts.update(fields)
  with pytest.raises(ConfigError, match=message):
    validate_config(config)


def test_alert_needs_prefix_caching():
  config = default.get_config('tiny')
  config.alerts.hit_rate_drop = 0.3
  with pytest.raises(ConfigError, match=r'config.alerts.hit_rate_drop=0.3 is not allowed: 0 '
                     r'unless prefix_cache.enabled=True'):
    validate_config(config)
  config.prefix_cache.enabled = True
  validate_config(config)


def test_switch_trace_has_two_versions_and_refuses_bad_input():
  requests = trace()
  before = {tuple(r.prompt_ids[:SYSTEM]) for r in requests if r.arrival_time < SWITCH_S}
  after = {tuple(r.prompt_ids[:SYSTEM]) for r in requests if r.arrival_time >= SWITCH_S}
  assert len(before) == len(after) == 1 and before != after
  assert all(r.shared_prefix_len == SYSTEM for r in requests)
  with pytest.raises(ValueError, match='rate=inf is not allowed: a finite number'):
    workloads.system_prompt_switch(4, 8, 1.0, rate=float('inf'))
  with pytest.raises(ValueError, match='switch_time_s=0.0 is not allowed'):
    workloads.system_prompt_switch(4, 8, 0.0)


def test_experiment_configs_and_their_checks():
  from configs import recompute_storm as storm_configs  # pylint: disable=import-outside-toplevel
  from experiments import recompute_storm  # pylint: disable=import-outside-toplevel
  for arg in (None, 'tiny'):
    config = storm_configs.get_config(arg)
    recompute_storm.check_storm(config)
    prewarm = recompute_storm.row_config(config, 'prewarm_throttle')
    assert prewarm.tiers.pinned_blocks * prewarm.pool.block_size == config.storm.system_tokens
    assert prewarm.alerts.throttle_prefill_tokens == config.storm.throttle_prefill_tokens
    assert recompute_storm.row_config(config, 'none').alerts.throttle_prefill_tokens == 0
  config.storm.steady_start_s = 3.0  # tiny: the pre-warm starts at 3.0 - 0.5
  with pytest.raises(ConfigError, match=r'config.storm.steady_start_s=3.0 is not allowed: a '
                     r'number of seconds in \[0, storm.switch_time_s - storm.prewarm_lead_s'):
    recompute_storm.check_storm(config)
  config.storm.steady_start_s, config.storm.rows = 0.5, ['none', 'cache']
  with pytest.raises(ConfigError, match=r"config.storm.rows=\['none', 'cache'\] is not allowed"):
    recompute_storm.check_storm(config)
