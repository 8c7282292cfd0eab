"""Sessions (host/cache/sessions.py): a conversation's cached blocks are evicted as one unit, in session
LRU/LFU order, an idle session is demoted to the lower tiers as a unit, and multi-turn greedy
outputs stay token-identical to an all-device run (tiny random model, shared compiled step)."""
import dataclasses

import pytest

from pagedjax.config import TiersConfig
from pagedjax.engine import Engine, RequestError
from pagedjax.host.scheduling.allocator import BlockAllocator
from pagedjax.host.cache.prefix_cache import PrefixCache, block_content
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.cache.sessions import Sessions

from fakes import check_blocks
from tiny_models import engine_config, make_engine, prompts, tiny


def _cache_with_blocks(eviction, n):
  cache = PrefixCache(4, eviction)
  cache.sessions = Sessions()
  alloc = BlockAllocator(n + 1, cache=cache)
  blocks = alloc.allocate(n)
  for i, b in enumerate(blocks):
    cache.insert(i, b, block_content(None, [i]))
  return cache, alloc, blocks


@pytest.mark.parametrize('eviction', ['lru', 'lfu'])
def test_a_session_is_evicted_as_a_unit_in_session_order(eviction):
  """Sessions a (blocks 1-3) and b (4-6) end turns; a plain block (7) is released between them.
  LRU: all of a (the session idle longest, deepest block first), then 7, then b. LFU: b has two
  turns, a one, the unhit block 7 none: 7, then a, then b."""
  cache, alloc, (a1, a2, a3, b1, b2, b3, plain) = _cache_with_blocks(eviction, 7)
  if eviction == 'lfu':
    cache.end_turn('b', [b1, b2, b3], now=0.0)
  cache.end_turn('a', [a1, a2, a3], now=1.0)
  alloc.free([a3, a2, a1])  # a turn releases its blocks tail first
  alloc.free([plain])
  cache.end_turn('b', [b1, b2, b3], now=2.0)
  alloc.free([b3, b2, b1])
  a, b = [a3, a2, a1], [b3, b2, b1]
  assert alloc.allocate(7) == (a + [plain] + b if eviction == 'lru' else [plain] + a + b)
  assert cache.sessions.figures()['session_turns'] == (3 if eviction == 'lfu' else 2)


def test_lfu_keeps_the_session_with_more_turns_over_a_newer_one():
  cache, alloc, (a1, a2, b1, b2) = _cache_with_blocks('lfu', 4)
  for now in (0.0, 1.0):
    cache.end_turn('a', [a1, a2], now=now)
  alloc.free([a2, a1])
  cache.end_turn('b', [b1, b2], now=2.0)  # newer, but one turn
  alloc.free([b2, b1])
  assert alloc.allocate(2) == [b2, b1]


def test_idle_sessions_are_listed_once_per_idle_spell():
  cache, alloc, (a1, b1) = _cache_with_blocks('lru', 2)
  cache.sessions.idle_timeout_s = 5.0
  cache.end_turn('a', [a1], now=0.0)
  cache.end_turn('b', [b1], now=3.0)
  alloc.free([a1, b1])
  assert cache.idle_session_blocks(4.0) == []
  assert cache.idle_session_blocks(8.5) == [('a', [a1]), ('b', [b1])]
  assert alloc.evict_now([a1]) == 1 and a1 in alloc.free_blocks()
  cache.sessions.demoted('a', 1)
  assert [s for s, _ in cache.idle_session_blocks(9.0)] == ['b']
  assert cache.sessions.figures()['session_idle_demoted_blocks'] == 1


# ---- with a real model -----------------------------------------------------------------------

TURN = SamplingParams(max_new_tokens=6)


def chat(engine, conversations=4, turns=3, session=True):
  """Each turn resends the conversation so far plus a new user message, a second of think time
  after the last turn (the engine clock jumps it); returns all outputs."""
  history = prompts([40, 33, 47, 36][:conversations], seed=7)
  news = prompts([9] * (conversations * turns), seed=8)
  outputs = []
  for t in range(turns):
    params = [dataclasses.replace(TURN, session_id=f'chat{c}' if session else None)
              for c in range(conversations)]
    ids = [engine.submit(history[c], params[c], arrival_time=engine.clock + 1.0)
           for c in range(conversations)]
    engine.run()
    for c, rid in enumerate(ids):
      out = engine.finished[rid].output_ids
      outputs.append(out)
      history[c] = history[c] + out + news[t * conversations + c]
    check_blocks(engine)
    if engine.tiers is not None:
      engine.tiers.check()
  return outputs


def _engine(num_blocks, tiers=None, **flat):
  cfg, params, step = tiny('gqa')
  config, rest = engine_config(cfg, block_size=16, num_blocks=num_blocks, max_batch_size=4,
                               prefill_chunk=16, prefix_caching=True, **flat)
  if tiers is not None:
    config = dataclasses.replace(config, tiers=tiers)
  return Engine(cfg, params, config, step_fn=step, **rest)


def test_idle_sessions_demote_to_host_and_come_back_token_identical():
  """Every session goes idle during its think time (timeout 0.5 s of 1 s) and is demoted to
  host RAM as a unit; the next turn promotes it back. Tokens equal an all-device run's, which keeps
  everything on the device."""
  want = chat(_engine(64), session=False)
  engine = _engine(20, TiersConfig(host_blocks=48, promotion='load'), session_idle_s=0.5)
  assert chat(engine) == want
  figures = engine.summary()
  assert figures['sessions'] == 4 and figures['session_turns'] == 12
  assert figures['session_idle_demotions'] == 8  # after turns 1 and 2
  assert figures['session_idle_demoted_blocks'] > 0
  assert figures['tiers_tier2_hit_blocks'] > 0  # later turns found their history in host RAM


def test_session_id_needs_prefix_caching():
  engine = make_engine()
  with pytest.raises(RequestError, match=r"session_id='s' needs prefix_cache.enabled=True"):
    engine.submit([1, 2, 3], SamplingParams(session_id='s'))
  with pytest.raises(RequestError, match=r"session_id='' is not allowed: None or a non-empty"):
    engine.submit([1, 2, 3], SamplingParams(session_id=''))
  assert not engine.has_work()
