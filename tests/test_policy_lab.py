"""The policy lab (experiments/policy_lab.py): the offline optimum is never below an online
policy, an infinite cache hits exactly what the hash ids say, and the :tiny study runs end to
end (replay, tuning, tables, plots, summary)."""
import json
import math
import os

import pytest
from hypothesis import given, settings, strategies as st

from configs import policy_lab as lab_config
from experiments import policy_lab as lab
from pagedjax.host import policies
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
  for row in ONLINE_ROWS + ['reuse_oracle']:
    assert lab.replay(row, records, cap, {}, design)['hit_tokens'] <= best, row


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


def test_tiny_study(tmp_path):
  config = lab_config.get_config('tiny')
  config.lab.limit = 200
  config.lab.capacities = [1e5, 1e6]
  config.lab.gap_capacity = 1e6
  lab.check(config)
  summary = lab.study(config, str(tmp_path))
  for name in ('curves.csv', 'table.md', 'tuning.csv', 'hit_rate.png', 'regret.png',
               'summary.json'):
    assert os.path.getsize(tmp_path / name) > 0, name
  with open(tmp_path / 'summary.json', encoding='utf-8') as f:
    assert json.load(f)['variant'] == 'tiny'
  assert summary['ceiling']['relative_difference'] < 1e-3  # replayed vs counted
  curves = summary['curves']
  assert len(curves) == len(config.lab.rows) * 2
  assert all(c['regret'] >= 0 for c in curves)
  assert any(c['regret'] > 0 for c in curves if c['row'] == lab.REFERENCE)  # a gap to study
  assert all(0 <= c['hit_rate'] <= summary['ceiling']['replayed'] + 1e-12 for c in curves)
  assert set(summary['goals']) == set(config.lab.rows) - {lab.REFERENCE, *lab.OFFLINE}
  assert summary['continuation_by_turn'][0]['turns'] > 0
  assert set(summary['tuned']) == set(config.lab.tune)


@pytest.mark.parametrize('field, value, message', [
    ('rows', ['lfu', 'belady'], "distinct names including 'lru'"),
    ('rows', ['lru', 'belady', 'nope'], "one of .* or an eviction policy"),
    ('capacities', [1e6, 1e5], 'increasing, distinct'),
    ('gap_capacity', 7.0, 'one of lab.capacities'),
    ('trace', '/no/such/trace.jsonl', 'a block-hash trace file that exists'),
])
def test_check_names_the_bad_field(field, value, message):
  config = lab_config.get_config('tiny')
  config.lab[field] = value
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
