"""Policies as plug-ins (pagedjax/host/policies.py): the registries resolve names and
'module:attr' with clear errors, config validation goes through them, a policy defined in this
test module runs in the engine and on the simulated device, every online eviction policy keeps
the EvictionQueue protocol, and docs/policies.md's example runs as written."""
import dataclasses
import os
import re

import pytest
from hypothesis import example, given, settings, strategies as st

from pagedjax.config import Config, ConfigError, PrefixCacheConfig, SchedulerConfig, TiersConfig
from pagedjax.engine import Engine
from pagedjax.host import policies
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.tiers.tier_index import TierIndex
from pagedjax.sim import simulated_device as sd
from pagedjax import sizing

import fakes
from tiny_models import engine_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONLINE = [name for name in policies.EVICTION.names()
          if not getattr(policies.EVICTION.get(name), 'offline', False)]


# ---- policies defined here, named by config as 'test_policies:...' ---------------------------

class MostRecentlyUsed(policies.HeapQueue):
  """The opposite of LRU: the block released last goes first. Counts its victims."""
  victims = 0

  def priority(self, key, tick, session):
    return (-tick,)

  def pop(self, can_evict=None):
    key = super().pop(can_evict)
    MostRecentlyUsed.victims += key is not None
    return key


VICTIM_CALLS = []


def oldest_candidate(scheduler, candidates):
  """Preempts the oldest sequence it may (never the oldest running: that one is not offered)."""
  VICTIM_CALLS.append(len(candidates))
  return candidates[0]


def longest_prompt_first(seq):
  return (-len(seq.prompt_ids),) + seq.order


# ---- registries and config ------------------------------------------------------------------

def test_registry_resolves_names_and_import_paths_and_explains_the_rest():
  assert policies.EVICTION.get('lru') is policies.LRU
  assert policies.EVICTION.get('pagedjax.host.policies:LFU') is policies.LFU
  assert policies.QUEUE_ORDER.get('test_policies:longest_prompt_first') is longest_prompt_first
  with pytest.raises(policies.PolicyError, match=r"'lru2' is not registered: one of \('lru', "):
    policies.EVICTION.get('lru2')
  with pytest.raises(policies.PolicyError, match="module 'no_such_module' does not import"):
    policies.EVICTION.get('no_such_module:X')
  with pytest.raises(policies.PolicyError, match="has no 'Nope'"):
    policies.EVICTION.get('pagedjax.host.policies:Nope')
  with pytest.raises(policies.PolicyError, match='not an EvictionQueue subclass'):
    policies.EVICTION.get('pagedjax.host.policies:fcfs')
  with pytest.raises(policies.PolicyError, match='without ":"'):
    policies.VICTIM.register('a:b', oldest_candidate)
  with pytest.raises(policies.PolicyError, match='already registered'):
    policies.EVICTION.register('lru', policies.LFU)


@pytest.mark.parametrize('section, field, value, message', [
    ('prefix_cache', 'eviction', 'lru2', r"prefix_cache.eviction='lru2' is not allowed: .*'lfu'"),
    ('prefix_cache', 'eviction', 'belady', 'an offline policy'),
    ('prefix_cache', 'eviction', 'test_policies:nothing', "has no 'nothing'"),
    ('tiers', 'eviction', 'mru', r"tiers.eviction='mru' is not allowed"),
    ('scheduler', 'victim', 'oldest', r"scheduler.victim='oldest' is not allowed: .*'newest'"),
    ('scheduler', 'admission', 'greedy', "scheduler.admission='greedy'"),
    ('scheduler', 'queue_order', 'lifo', r"scheduler.queue_order='lifo' is not allowed: .*'sjf'"),
])
def test_config_checks_policy_names_through_the_registries(section, field, value, message):
  base = Config(prefix_cache=PrefixCacheConfig(enabled=True))
  config = dataclasses.replace(base, **{section: dataclasses.replace(
      getattr(base, section), **{field: value})})
  with pytest.raises(ConfigError, match=message):
    config.validate()


def test_config_takes_policies_from_any_module():
  Config(prefix_cache=PrefixCacheConfig(enabled=True, eviction='test_policies:MostRecentlyUsed'),
         tiers=TiersConfig(eviction='test_policies:MostRecentlyUsed'),
         scheduler=SchedulerConfig(victim='test_policies:oldest_candidate',
                                   queue_order='test_policies:longest_prompt_first')).validate()


# ---- a test module's policies in the engine and the simulator -----------------------------------

FLAT = {'block_size': 4, 'num_blocks': 14, 'max_batch_size': 3, 'prefill_chunk': 8,
        'prefix_caching': True, 'prefix_cache_eviction': 'test_policies:MostRecentlyUsed'}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 30, 31], [40, 41, 42, 43, 44],
           [1, 2, 3, 4, 50, 51, 52, 53, 54], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def _with_scheduler_policies(config):
  return dataclasses.replace(config, scheduler=dataclasses.replace(
      config.scheduler, victim='test_policies:oldest_candidate',
      queue_order='test_policies:longest_prompt_first'))


def _run(engine):
  for i, prompt in enumerate(PROMPTS):
    engine.submit(prompt, SamplingParams(max_new_tokens=12, stop_on_eos=False),
                  arrival_time=0.5 * i)
  return engine.run()


def test_a_policy_from_a_test_module_runs_in_the_engine_and_the_simulator():
  MostRecentlyUsed.victims = 0
  VICTIM_CALLS.clear()
  clock = fakes.FakeClock()
  config, rest = engine_config(fakes.CFG, step_fn=fakes.FakeStep(clock.tick), timer=clock, **FLAT)
  engine = Engine(fakes.CFG, None, _with_scheduler_policies(config), **rest)
  assert isinstance(engine.prefix_cache.queue, MostRecentlyUsed)
  done = _run(engine)
  for c in done:  # a policy changes when tokens are computed, never which
    assert c.output_ids == fakes.expected_outputs(c.prompt_ids, 12, fakes.CFG.max_seq_len)
  assert MostRecentlyUsed.victims > 0 and engine.prefix_cache.evictions > 0
  assert VICTIM_CALLS, 'the pool is tight enough to preempt, through the custom victim'
  fakes.check_blocks(engine)

  MostRecentlyUsed.victims = 0
  config, _ = engine_config(fakes.CFG, **FLAT)
  backend = sd.SimulatedBackend(sizing.from_model_config(fakes.CFG), 'h100-sxm',
                                activation_dtype='fp32', weight_dtype='fp32')
  sim = Engine(fakes.CFG, None, _with_scheduler_policies(config), timer=backend.clock,
               backend=backend)
  assert isinstance(sim.prefix_cache.queue, MostRecentlyUsed)
  assert len(_run(sim)) == len(PROMPTS)
  assert MostRecentlyUsed.victims > 0


@pytest.mark.parametrize('design', ['hash', 'radix'])
@pytest.mark.parametrize('eviction', ONLINE)
def test_every_online_eviction_policy_serves_the_engine(eviction, design):
  """Each registered online policy as the device prefix cache's eviction (both designs): the
  outputs are the model's, and every block is free, evictable or held exactly once."""
  clock = fakes.FakeClock()
  flat = {**FLAT, 'prefix_cache_eviction': eviction, 'prefix_cache_design': design}
  config, rest = engine_config(fakes.CFG, step_fn=fakes.FakeStep(clock.tick), timer=clock, **flat)
  engine = Engine(fakes.CFG, None, config, **rest)
  assert type(engine.prefix_cache.queue) is policies.EVICTION.get(eviction)
  for c in _run(engine):
    assert c.output_ids == fakes.expected_outputs(c.prompt_ids, 12, fakes.CFG.max_seq_len)
  assert engine.prefix_cache.evictions > 0
  fakes.check_blocks(engine)


@pytest.mark.parametrize('order, finished', [('fcfs', [0, 1, 2, 3]), ('sjf', [3, 1, 2, 0])])
def test_queue_order_decides_who_is_served_first(order, finished):
  """One batch row: requests are served one after another in the waiting queue's order (sjf:
  prompt plus tokens to generate, fewest first)."""
  clock = fakes.FakeClock()
  config, rest = engine_config(fakes.CFG, step_fn=fakes.FakeStep(clock.tick), timer=clock,
                               block_size=4, num_blocks=17, max_batch_size=1, prefill_chunk=16)
  config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler,
                                                                     queue_order=order))
  engine = Engine(fakes.CFG, None, config, **rest)
  for n, new in ((9, 4), (3, 2), (5, 1), (3, 1)):
    engine.submit(list(range(1, n + 1)), SamplingParams(max_new_tokens=new, stop_on_eos=False))
  done = sorted(engine.run(), key=lambda c: c.finish_time)
  assert [c.request_id for c in done] == finished


# ---- the EvictionQueue protocol, for every online policy ---------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(['admit', 'push', 'hit', 'discard', 'pop', 'requeue',
                                          'remove']), st.integers(0, 7), st.booleans()),
               max_size=60)


@pytest.mark.parametrize('name', ONLINE)
@settings(max_examples=25, deadline=None)
@given(ops=OPS)
# a session tick ahead of the queue's clock (hit_density once skipped such a block: negative age)
@example(ops=[('admit', 1, False), ('push', 1, True), ('pop', 0, False)])
def test_every_online_policy_keeps_the_protocol(name, ops):
  """Against a model of the evictable set: pop takes an evictable key that was not passed over
  (None only when there is none), a passed-over key waits for requeue, and len/keys/ranked
  agree with the model."""
  queue = policies.EVICTION.get(name)()
  # parked: passed over for sure (a pop that found nothing passed every kept key); maybe: kept
  # keys of a pop that found a victim (passed over only if the policy reached them first)
  cached, evictable, parked, maybe = set(), set(), set(), set()
  for op, key, flag in ops:
    if op == 'admit' and key not in cached:
      queue.add(key, depth=key % 3, chain_key=1000 + key)
      cached.add(key)
    elif op == 'push' and key in cached:
      queue.push(key, (1 + key % 2, key) if flag else None)
      evictable.add(key)
      parked.discard(key)
      maybe.discard(key)
    elif op == 'hit' and key in cached:
      queue.hit(key)
    elif op == 'discard' and key in cached:
      assert queue.discard(key) == (key in evictable)
      evictable.discard(key)
      parked.discard(key)
      maybe.discard(key)
    elif op == 'requeue' and key in cached:
      queue.requeue(key)
      parked.discard(key)
      maybe.discard(key)
    elif op == 'remove' and key in cached:
      queue.remove(key)
      cached.discard(key)
      evictable.discard(key)
      parked.discard(key)
      maybe.discard(key)
    elif op == 'pop':
      keep = {k for k in evictable - parked if (k + key) % 3 == 0} if flag else set()
      victim = queue.pop(lambda k: k not in keep)
      if victim is None:
        assert not evictable - parked - maybe - keep
      else:
        assert victim in evictable - parked - keep
        evictable.discard(victim)
        queue.remove(victim)
        cached.discard(victim)
      if victim is None:
        parked |= keep & evictable | maybe & evictable
        maybe = set()
      else:
        maybe |= keep
    assert len(queue) == len(evictable)
    assert set(queue.keys()) == evictable
    assert all((k in queue) == (k in evictable) for k in range(8))
  assert sorted(queue.ranked(range(8))) == sorted(evictable)


def test_s3fifo_evicts_one_hit_wonders_before_blocks_hit_while_queued():
  queue = policies.S3FIFO()
  for key in (1, 2, 3):
    queue.add(key, chain_key=10 + key)
  queue.hit(1)
  for key in (1, 2, 3):
    queue.push(key)
  assert queue.pop() == 2  # 1 was hit in the small FIFO: it moves to main instead
  queue.remove(2)
  queue.add(4, chain_key=12)  # 2's content back while its ghost is remembered: to main
  queue.push(4)
  assert queue.pop() == 3 and queue.pop() in (1, 4)


def test_retention_holds_later_turns_and_lets_first_turns_go_first():
  """A second turn's blocks are held 100 ticks: a first turn's block released 50 ticks after
  them goes first; one released 150 ticks after, after them (deepest of the release first)."""
  queue = policies.Retention()
  queue.hold = (0.0,) + (100.0,) * 5
  for key, depth in (('root', 0), ('deep', 1), ('early', 1), ('late', 1)):
    queue.add(key, depth=depth)
  ended = queue.tick()  # the second turn ends: tail first
  queue.push('deep', session=(2, ended))
  queue.push('root', session=(2, ended))
  for _ in range(50):
    queue.tick()
  queue.push('early', session=(1, queue.tick()))
  for _ in range(100):
    queue.tick()
  queue.push('late', session=(1, queue.tick()))
  assert queue.ranked(['late', 'root', 'deep', 'early']) == ['early', 'deep', 'root', 'late']
  queue.hold = (0.0,) * 6  # the default: LRU
  queue.push('early', session=(1, queue.tick()))
  assert queue.ranked(['early', 'root', 'deep', 'late']) == ['deep', 'root', 'late', 'early']


def test_gdsf_ages_and_weighs_depth():
  queue = policies.GDSF()
  queue.add('shallow', depth=0)
  queue.add('deep', depth=20)
  queue.push('shallow')
  queue.push('deep')
  assert queue.pop() == 'shallow' and queue.inflation == 1.0  # deep costs 2x to recompute
  queue.remove('shallow')
  queue.add('new', depth=0)
  queue.push('new')  # H = inflation + 1 = 2.0, the same as deep's: the older entry goes first
  assert queue.pop() == 'deep'


def test_a_tier_passes_over_a_pinned_entry_and_takes_it_again_once_unpinned():
  tier = TierIndex(2, 'lru')
  for key in (1, 2):
    tier.reserve(key, ('c', key))
    tier.commit(key)
  tier.pin(1)
  _, victim = tier.reserve(3, ('c', 3))
  assert victim[0] == 2  # 1, the least recently used, is being read
  tier.commit(3)
  tier.unpin(1)
  _, victim = tier.reserve(4, ('c', 4))
  assert victim[0] == 1  # back in the running, in its old place
  tier.check()


# ---- docs/policies.md -----------------------------------------------------------------------

def test_the_docs_example_runs_as_written():
  with open(os.path.join(ROOT, 'docs', 'policies.md'), encoding='utf-8') as f:
    blocks = re.findall(r'```python\n(.*?)```', f.read(), flags=re.S)
  assert len(blocks) >= 3
  namespace = {}
  try:
    for block in blocks:
      exec(compile(block, 'docs/policies.md', 'exec'), namespace)  # pylint: disable=exec-used
    fifo = policies.EVICTION.get('first_in')
    assert fifo.__name__ == 'FIFO' and namespace['config'].prefix_cache.eviction == 'first_in'
    assert policies.VICTIM.get('longest_first') is namespace['longest_first']
  finally:
    for registry, name in ((policies.EVICTION, 'first_in'), (policies.VICTIM, 'longest_first')):
      if name in registry:
        registry.unregister(name)
