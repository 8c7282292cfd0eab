"""The policy lab (experiments/policy_lab.py): the offline optimum is never below an online
policy, an infinite cache hits exactly what the hash ids say, the tier replay through the real
tier code agrees with the plain one, the new policies (ARC, LRFU, the return predictors) do what
they say, and the :tiny studies (the lab, and policy_lab_sim on the simulator) run end to end."""
import json
import math
import os

import pytest
from hypothesis import given, settings, strategies as st

import numpy as np

from configs import policy_lab as lab_config
from configs import policy_lab_sim as sim_config
from experiments import policy_lab as lab
from experiments import policy_lab_sim as lab_sim
from pagedjax.host import policies
from pagedjax.host import predictive_policies as pp
from pagedjax.studies import retention_model
from pagedjax.studies import return_model
from pagedjax.studies.workloads import BlockTraceRecord

ONLINE_ROWS = [row for row in lab.ROWS if row not in lab.OFFLINE]


@st.composite
def traces(draw):
  """Conversations over a shared root block: each turn resends its history plus new blocks,
  turns interleaved across conversations, a partial last block or none."""
  n = draw(st.integers(2, 6))
  turns = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
  order = draw(st.permutations([c for c in range(n) for _ in range(turns[c])]))
  history, next_id, records = {}, 1, []
  for i, c in enumerate(order):
    grow = draw(st.integers(1, 3))
    history[c] = history.get(c, [0]) + list(range(next_id, next_id + grow))
    next_id += grow
    partial = draw(st.sampled_from([0, 100, 511]))
    blocks = len(history[c]) + (1 if partial else 0)
    ids = history[c] + ([next_id] if partial else [])
    next_id += 1 if partial else 0
    records.append(BlockTraceRecord(i, i, (blocks - (1 if partial else 0)) * 512 + partial,
                                    1, tuple(ids)))
  return records


@settings(max_examples=60, deadline=None)
@given(records=traces(), capacity_blocks=st.integers(3, 24),
       design=st.sampled_from(['hash', 'radix']))
def test_belady_is_never_below_an_online_policy(records, capacity_blocks, design):
  cap = capacity_blocks * 512
  best = lab.replay(lab.OPTIMUM, records, cap, {}, design)['hit_tokens']
  fitted = {lab.HOLD: retention_model.releases(records)}  # retention's holds, fitted in sample
  for row in ONLINE_ROWS + ['reuse_oracle']:
    assert lab.replay(row, records, cap, fitted, design)['hit_tokens'] <= best, row


@settings(max_examples=20, deadline=None)
@given(records=traces())
def test_an_infinite_cache_hits_what_the_hash_ids_count(records):
  counted = lab.counted_ceiling(records)
  exact = all(r.input_length % 512 for r in records)  # else the last-token rule withholds one
  for row in ('lru', 'belady'):
    replayed = lab.replay(row, records, math.inf, {}, 'hash')
    assert replayed['prompt_tokens'] == counted['prompt_tokens']
    if exact:
      assert replayed['hit_tokens'] == counted['hit_tokens']
    else:
      assert replayed['hit_tokens'] <= counted['hit_tokens']


@settings(max_examples=20, deadline=None)
@given(records=traces(), capacity_blocks=st.integers(2, 24))
def test_the_fluid_model_gains_with_information_and_counts_the_ceiling(records, capacity_blocks):
  """Finer classes never lower the fluid optimum (a refinement can hold as the coarse classes
  did); with room for everything it serves every read an infinite cache does."""
  rel = retention_model.releases(records)
  found = retention_model.bounds(rel, capacity_blocks, ('none', 'turns', 'oracle: returns or not'))
  assert found['none'] <= found['turns'] + 1e-12 <= found['oracle: returns or not'] + 2e-12
  counted = lab.counted_ceiling(records)
  if all(r.input_length % 512 for r in records):  # else the last-token rule withholds one
    assert retention_model.bound(rel, 10 ** 6, retention_model.turns_classes(rel)) == (
        pytest.approx(counted['hit_rate']))


def test_retention_fit_holds_conversations_that_return_and_not_the_others():
  """Three-turn conversations come back 40 ticks after each turn; one-turn ones never do. In a
  small cache the fit holds second turns (which return) longer than first turns (most of which
  do not); with room for everything, every class is held alike (LRU)."""
  records, next_id, pending = [], 1, []
  for i in range(300):
    if i % 3 == 0:  # a conversation that will have three turns: its first
      ids = [0] + list(range(next_id, next_id + 3))
      next_id += 3
      pending.append((i + 4, ids, 2))
    else:  # one-turn conversations, or a due turn of a three-turn one
      due = [p for p in pending if p[0] <= i]
      if due:
        pending.remove(due[0])
        _, history, left = due[0]
        ids = history + [next_id]
        next_id += 1
        if left > 1:
          pending.append((i + 4, ids, left - 1))
      else:
        ids = [0] + list(range(next_id, next_id + 3))
        next_id += 3
    records.append(BlockTraceRecord(i, i, len(ids) * 512 + 100, 1, tuple(ids + [next_id])))
    next_id += 1
  rel = retention_model.releases(records)
  hold = retention_model.fit_hold(rel, 4)
  assert hold[1] > hold[0] and hold[2] == 0  # third turns never come back
  big = retention_model.fit_hold(rel, 10 ** 6)
  assert len(set(big[:2])) == 1  # held until every return: alike


def test_tiny_study(tmp_path):
  config = lab_config.get_config('tiny')
  config.lab.limit = 200
  config.lab.capacities = [1e5, 1e6]
  config.lab.gap_capacity = 1e6
  config.lab.rows = ['lru', 'arc', 'return_predictor', 'retention', 'reuse_oracle', 'belady']
  config.lab.tune = {'return_predictor': [1.0, 2.0]}
  config.lab.tiers.capacities = [1e5]
  config.lab.bound.capacities = [1e6]
  config.lab.bound.classings = ['none', 'oracle: returns or not']
  lab.check(config)
  summary = lab.study(config, str(tmp_path))
  for name in ('curves.csv', 'table.md', 'tuning.csv', 'hit_rate.png', 'regret.png',
               'reuse.png', 'tiers.csv', 'tiers.png', 'bound.csv', 'bound.png', 'summary.json'):
    assert os.path.getsize(tmp_path / name) > 0, name
  with open(tmp_path / 'summary.json', encoding='utf-8') as f:
    assert json.load(f)['variant'] == 'tiny'
  assert summary['ceiling']['relative_difference'] < 1e-3  # replayed vs counted
  curves = summary['curves']
  assert len(curves) == len(config.lab.rows) * 2
  assert all(c['regret'] >= 0 for c in curves)
  assert any(c['regret'] > 0 for c in curves if c['row'] == lab.REFERENCE)  # a gap to study
  assert all(0 <= c['hit_rate'] <= summary['ceiling']['replayed'] + 1e-12 for c in curves)
  assert all(sum(c['hits_by_depth']) * 512 == c['hit_tokens'] for c in curves)
  assert set(summary['goals']) == {'arc', 'return_predictor', 'retention'}
  assert summary['continuation_by_turn'][0]['turns'] > 0
  assert set(summary['tuned']) == {'return_predictor'}
  assert set(summary['tuning_checks']) == {'return_predictor', 'retention'}  # first half fits
  assert all(len(c['hold_ticks']) == 6 for c in curves if c['row'] == 'retention')
  # the bound: hindsight holds of the oracle classing beat those of no classing (LRU's)
  bound = {b['classing']: b for b in summary['bound']}
  assert bound['none']['cache_hit_rate'] == next(
      c['hit_rate'] for c in curves if c['row'] == 'lru' and c['capacity_tokens'] == 1e6)
  assert bound['oracle: returns or not']['fluid_hit_rate'] >= bound['none']['fluid_hit_rate']
  assert summary['return_model']['held_out']['releases'] > 0
  # the reuse distances count every read an infinite cache serves
  d = summary['reuse_distances']
  assert (sum(d['first_turn']) + sum(d['later_turn'])) * 512 == round(
      summary['ceiling']['counted_from_hash_ids'] * summary['prompt_tokens'])
  # tiers: the device-only arrangement is the plain replay; tiers add hits, never lose any
  tiers = {t['arrangement']: t for t in summary['tiers']}
  lru = next(c for c in curves if c['row'] == 'lru' and c['capacity_tokens'] == 1e5)
  assert tiers['device']['hit_rate'] == lru['hit_rate']
  for t in tiers.values():
    assert t['hit_rate'] == pytest.approx(
        t['device_hit_rate'] + t['host_hit_rate'] + t['disk_hit_rate'])
  assert tiers['device']['hit_rate'] <= tiers['device_host']['hit_rate'] <= tiers[
      'device_host_disk']['hit_rate']
  assert tiers['device_host_disk']['disk_hit_rate'] > 0
  assert summary['host_us_per_request'] > 0 and set(summary['phase_s']) == {
      'ceiling_and_reuse_distances', 'fit', 'tune', 'curves', 'tiers', 'bound'}


@settings(max_examples=10, deadline=None)
@given(records=traces(), capacity_blocks=st.integers(3, 12))
def test_lower_tiers_serve_what_the_device_evicted(records, capacity_blocks):
  """With a disk tier that holds everything, the arrangement hits what an infinite cache does;
  a host tier alone never hits less than the device alone, and a tier never serves a block the
  device did (tier hits add up). The device holds the longest prompt (a longer one is cut)."""
  cap = max(capacity_blocks, max(len(lab.prompt_of(r)) for r in records) + 1) * 512
  ceiling = lab.replay('lru', records, math.inf, {}, 'hash')['hit_rate']
  device = lab.replay('lru', records, cap, {}, 'hash')['hit_rate']
  total = sum(r.full_blocks for r in records) * 512
  host = lab.tier_replay('lru', records, {'device_tokens': cap, 'host_tokens': cap,
                                          'disk_tokens': 0}, {}, 'hash')
  full = lab.tier_replay('lru', records, {'device_tokens': cap, 'host_tokens': cap,
                                          'disk_tokens': total}, {}, 'hash')
  assert host['device_hit_rate'] == device  # write-back changes nothing on the device
  assert device <= host['hit_rate'] <= full['hit_rate']
  assert full['hit_rate'] == pytest.approx(ceiling)


def test_lrfu_spans_lru_and_lfu():
  """a is referenced four times early, b once later: a short half-life evicts a first (older),
  a long one b (fewer references)."""
  def order(half_life):
    q = policies.LRFU()
    q.half_life = half_life
    q.add('a')
    for _ in range(3):
      q.hit('a')
    for _ in range(10):
      q.tick()
    q.add('b')
    q.push('a')
    q.push('b')
    return q.ranked(['a', 'b'])
  assert order(1.0) == ['a', 'b']
  assert order(1e9) == ['b', 'a']


def test_arc_keeps_blocks_read_again_through_a_scan():
  """Entries hit once are in T2; a scan of new entries passes through T1 (p = 0 until a ghost
  says otherwise), so its entries go first and the reused ones stay."""
  q = policies.ARC()
  for k in range(4):
    q.add(k, chain_key=k)
    q.hit(k)
    q.push(k)
  for k in range(100, 110):
    q.add(k, chain_key=k)
    q.push(k)
    assert q.pop() == k  # the scan's own entry goes, the reused ones never
    q.remove(k)
  assert sorted(q.keys()) == [0, 1, 2, 3]
  q.add(109, chain_key=109)  # the scan's last content comes back: a B1 ghost grows T1's target
  assert q.p >= 1


def test_return_predictor_sees_turns_think_time_and_new_blocks():
  """Its features of a release come from the event stream alone: a second turn that hit two
  blocks of the first, 30 releases after it, and computed three new ones."""
  q = pp.Recorder()
  for k in range(3):
    q.add(k, depth=k, chain_key=k)
  tick = first_end = q.tick()  # the first turn ends
  for k in (2, 1, 0):
    q.push(k, session=(1, tick))
  for _ in range(30):
    q.tick()
  q.hit(0)
  q.hit(1)
  for k in range(10, 13):
    q.add(k, depth=k - 8, chain_key=k)
  tick = q.tick()
  for k in (12, 11, 10, 1, 0):  # tail first
    q.discard(k)
    q.push(k, session=(2, tick))
  first, second = q.releases[0]['x'], q.releases[3]['x']
  f = {name: i for i, name in enumerate(pp.FEATURES)}
  assert first[f['first']] == 1 and first[f['log1p_think']] == 0
  assert second[f['first']] == 0 and round(math.exp(second[f['log_turns']])) == 2
  assert round(math.expm1(second[f['log1p_think']])) == tick - first_end  # block 1's
  assert round(math.expm1(second[f['log1p_prompt']])) == 5
  assert round(math.expm1(second[f['log1p_new']])) == 3
  assert q.releases[1]['read_at'] is not None and q.releases[0]['read_at'] is None  # 1 read


def test_return_model_fits_a_signal_and_says_how_well():
  rng = np.random.default_rng(0)
  x = [pp.design(int(t), 0, t == 1, 10, 10, 0, 3) for t in rng.integers(1, 6, 2000)]
  releases = [{'major': i, 'x': xi, 'read_at': i + 50 if rng.random() < xi[1] / 2 else None}
              for i, xi in enumerate(x)]
  model = return_model.fit(releases)
  assert model['weights'][1] > 0.5 and model['auc'] > 0.6
  assert return_model.evaluate(releases, model['weights'])['auc'] == pytest.approx(model['auc'])


def test_tiny_simulated_node(tmp_path):
  config = sim_config.get_config('tiny')
  config.sim_lab.limit = 20
  config.sim_lab.rows = ['no_cache', 'lru']
  lab_sim.check(config)
  summary = lab_sim.study(config, str(tmp_path))
  for name in ('results.csv', 'table.md', 'summary.json', 'ttft.png'):
    assert os.path.getsize(tmp_path / name) > 0, name
  none, lru = summary['rows']
  assert none['hit_rate'] == 0 and 0 < lru['hit_rate'] < 1
  assert lru['prefill_gpu_s_saved'] > 0 and lru['ttft_p50_s'] <= none['ttft_p50_s']
  assert lru['device_hit_rate'] + lru['host_hit_rate'] > 0 and summary['simulated']


@pytest.mark.parametrize('field, value, message', [
    ('rows', ['lfu', 'belady'], "distinct names including 'lru'"),
    ('rows', ['lru', 'belady', 'nope'], "one of .* or an eviction policy"),
    ('capacities', [1e6, 1e5], 'increasing, distinct'),
    ('gap_capacity', 7.0, 'one of lab.capacities'),
    ('trace', '/no/such/trace.jsonl', 'a block-hash trace file that exists'),
    ('tiers.rows', ['belady'], 'online rows'),
    ('tiers.arrangements.device_host', [4], r'\[host, disk\]'),
])
def test_check_names_the_bad_field(field, value, message):
  config = lab_config.get_config('tiny')
  section, _, name = field.rpartition('.')
  target = config.lab
  for part in section.split('.') if section else ():
    target = target[part]
  target[name] = value
  with pytest.raises(lab.config_lib.ConfigError, match=f'config.lab.{field}=.*{message}'):
    lab.check(config)


def test_hit_density_learns_when_blocks_come_back():
  """Every block is read again exactly 150 releases after its own (a think time), one never
  is: the learned density rises with age up to the reuse and is zero past it, so the block
  past any reuse goes first, then the newest (furthest from its reuse), and the blocks about to
  be read go last; LRU would evict those first."""
  queue = policies.HitDensity()
  queue.refit_every = 64
  queue.add('stale', depth=0, chain_key=-1)
  queue.push('stale')
  for step in range(2000):
    queue.add(step, depth=0, chain_key=step)
    queue.push(step)
    if step >= 150:  # read again: taken by a sequence, and held from then on
      queue.hit(step - 150)
      assert queue.discard(step - 150)
  density = queue.density[0]
  young, due, past = (queue._bin(a) for a in (5, 140, 400))  # pylint: disable=protected-access
  assert density[young] < density[due] and density[past] == 0
  idle = sorted(queue.keys(), key=str)
  order = queue.ranked(idle)
  assert order[0] == 'stale' and order[1] == 1999
  bins = [queue._bin(1999 - k) for k in order[1:]]  # pylint: disable=protected-access
  assert bins == sorted(bins) and bins[-1] == due  # the youngest bins go first
  assert queue.pop() == 'stale' and queue.pop() == 1999
