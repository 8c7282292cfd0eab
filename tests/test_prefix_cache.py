"""Prefix caching: the hash chain, eviction order, config checks, and greedy outputs that are
token-identical with caching on and off (tiny random model, shared compiled step)."""
import dataclasses
import functools

import pytest

from configs import default
from pagedjax import config as config_lib
from pagedjax.studies import workloads
from pagedjax.host.scheduling.allocator import BlockAllocator
from pagedjax.host.cache import prefix_cache
from pagedjax.host.cache.prefix_cache import PrefixCache, block_content, chain_keys, make_prefix_cache
from pagedjax.host.cache.radix_cache import RadixCache
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.scheduling.offload_index import OffloadIndex
from pagedjax.host.scheduling.offload_store import OffloadIds

from fakes import check_blocks
from tiny_models import make_engine, prompts


def test_chain_keys_cover_the_whole_prefix_and_the_salt():
  a = chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
  b = chain_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, 2)
  assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
  assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2) == a
  assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2, salt='x')[1] != a[1]
  assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2, parent=a[0], start=1) == a[1:]


def test_lru_evicts_least_recently_released():
  cache = PrefixCache(4, 'lru')
  alloc = BlockAllocator(4, cache=cache)
  for i, b in enumerate(alloc.allocate(3)):
    cache.insert(i, b, block_content(None, [i]))
  alloc.free([2])
  alloc.free([3])
  alloc.free([1])
  assert alloc.allocate(2) == [2, 3]
  assert cache.lookup(0) == 1 and cache.is_evictable(1)
  alloc.take_cached(1)  # a hit takes it back: no longer evictable
  assert not cache.is_evictable(1) and alloc.num_free == 0


def test_lfu_keeps_the_most_hit_block():
  cache = PrefixCache(4, 'lfu')
  alloc = BlockAllocator(3, cache=cache)
  for i, b in enumerate(alloc.allocate(2)):
    cache.insert(i, b, block_content(None, [i]))
  alloc.take_cached(1)  # block 1: one hit
  alloc.free([1, 1])
  alloc.free([2])  # released later, but never hit
  assert alloc.allocate(1) == [2]
  assert cache.lookup(0) == 1


class _Seq:
  """The fields a cache reads from a Sequence."""

  def __init__(self, ids, table, salt=None):
    self.all_ids, self.block_table, self.block_keys, self.num_offered = ids, table, [], 0
    self.params = SamplingParams(cache_salt=salt)


def test_radix_evicts_leaves_first():
  """A two-block prefix released root-first: LRU alone would take its first block, leaving the
  second unreachable; the tree takes the leaf."""
  cache = RadixCache(2, 'lru')
  alloc = BlockAllocator(4, cache=cache)
  seq = _Seq([1, 2, 3, 4, 5], alloc.allocate(2))
  cache.offer(seq, 2)
  assert cache.match(_Seq([1, 2, 3, 4, 9], []), 2) == seq.block_table == [1, 2]
  assert cache.match(_Seq([1, 2, 3, 4], [], salt='x'), 2) == []
  assert cache.match(_Seq([1, 9, 3, 4], []), 2) == []
  alloc.free([1, 2])  # block 1 becomes evictable before block 2
  assert alloc.allocate(2) == [3, 2]  # the free block, then the leaf
  assert cache.match(_Seq([1, 2, 3, 4], []), 2) == [1]
  assert alloc.allocate(1) == [1] and len(cache) == 0


def test_hash_collisions_miss_instead_of_sharing(monkeypatch):
  """Every key collides (a forced hash): a hit must still require the same tokens, parent and
  salt, so another prefix's blocks are never returned."""
  monkeypatch.setattr(prefix_cache, 'chain_keys', lambda ids, bs, n, salt=None, parent=None,
                      start=0: [7] * (n - start))
  cache = PrefixCache(2, 'lru')
  alloc = BlockAllocator(6, cache=cache)
  seq = _Seq([1, 2, 3, 4], alloc.allocate(2))
  cache.offer(seq, 2)  # the second block's key is taken by the first: only block 0 is cached
  assert len(cache) == 1
  assert cache.match(_Seq([1, 2, 3, 4], []), 2) == seq.block_table[:1]
  assert cache.match(_Seq([5, 6, 3, 4], []), 2) == []  # same key, other tokens
  assert cache.match(_Seq([1, 2], [], salt='x'), 1) == []  # same key and tokens, other salt


def test_the_offload_index_holds_its_blocks_and_evicts_only_idle_ones():
  """Offloaded blocks (host/scheduling/offload_index.py): the index holds a reference on each,
  a block only it holds is idle (free room), a hit takes it back, eviction takes the policy's
  idle victim (deepest first: sequences release tail first) and frees its id."""
  ids = OffloadIds(4, 0, 'host')
  index = OffloadIndex(ids, 2, 'lru')
  seq = _Seq([1, 2, 3, 4, 5, 6, 7], [])
  blocks = ids.allocate(3)
  for logical, block in enumerate(blocks):
    assert index.store(seq, logical, block)
  assert not index.store(seq, 0, 4)  # its prefix is indexed already
  assert [ids.ref_count(b) for b in blocks] == [2, 2, 2] and index.num_idle == 0
  ids.free(blocks)
  index.released(blocks[::-1])
  assert index.num_idle == 3 and ids.num_free == 1
  again = _Seq([1, 2, 3, 4, 9, 9], [])
  hits = index.match(again, 3)
  assert hits == blocks[:2] and index.match(_Seq([1, 2, 3, 4], [], salt='x'), 2) == []
  index.take(hits)
  assert index.num_idle == 1 and index.evict() == blocks[2] and index.evict() is None
  assert ids.num_free == 2 and index.match(seq, 3) == blocks[:2] and len(index) == 2


def test_offload_index_collisions_miss_instead_of_sharing(monkeypatch):
  """Every key collides: a hit on an offloaded block still needs the same tokens and parent."""
  monkeypatch.setattr(prefix_cache, 'chain_keys', lambda ids, bs, n, salt=None, parent=None,
                      start=0: [7] * (n - start))
  ids = OffloadIds(4, 0, 'host')
  index = OffloadIndex(ids, 2, 'lru')
  (block,) = ids.allocate(1)
  assert index.store(_Seq([1, 2, 3, 4], []), 0, block)
  assert index.match(_Seq([5, 6, 3, 4], []), 1) == []
  assert index.match(_Seq([1, 2], [], salt='x'), 1) == []
  assert index.match(_Seq([1, 2, 3, 4], []), 2) == [block]  # the second block's key is taken


def test_radix_keeps_one_copy_of_a_prefix_computed_twice():
  cache = RadixCache(2, 'lru')
  alloc = BlockAllocator(6, cache=cache)
  a, b = _Seq([1, 2, 3, 4], alloc.allocate(2)), _Seq([1, 2, 3, 4], alloc.allocate(2))
  cache.offer(a, 1)
  cache.offer(b, 2)  # b's first block is a duplicate: b adds nothing under it
  cache.offer(a, 2)
  assert len(cache) == 2 and cache.match(b, 2) == a.block_table


def _config(**prefix):
  config = default.get_config('tiny')
  config.prefix_cache.update(prefix)
  return config


@pytest.mark.parametrize('field, value, message', [
    ('design', 'trie', "one of \\('hash', 'radix'\\)"),
    ('eviction', 'fifo', "one of \\('lru', 'lfu', ")])
def test_config_rejects(field, value, message):
  with pytest.raises(config_lib.ConfigError, match=f'prefix_cache.{field}.*{message}'):
    workloads.validate_config(_config(**{field: value}))


def test_config_section_becomes_typed_and_builds_the_cache():
  typed = config_lib.Config.from_configdict(_config(enabled=True, eviction='lfu'))
  assert typed.prefix_cache == config_lib.PrefixCacheConfig(enabled=True, design='hash',
                                                            eviction='lfu')
  cache = make_prefix_cache(typed.prefix_cache, block_size=4)
  assert isinstance(cache, PrefixCache) and cache.eviction == 'lfu'
  radix = dataclasses.replace(typed.prefix_cache, design='radix')
  assert isinstance(make_prefix_cache(radix, block_size=4), RadixCache)
  assert make_prefix_cache(config_lib.PrefixCacheConfig(), block_size=4) is None  # off


# ---- engines on the tiny model -----------------------------------------------------------

SYSTEM = prompts([40], seed=5)[0]
USERS = prompts([5, 17, 9, 30, 12, 3], seed=1)


def _run(num_blocks, arrivals, **kw):
  engine = make_engine(num_blocks=num_blocks, **kw)
  for i, user in enumerate(USERS):
    engine.submit(SYSTEM + user, SamplingParams(max_new_tokens=8), arrival_time=arrivals[i])
  out = [c.output_ids for c in engine.run()]
  check_blocks(engine)
  return out, engine.summary()


@functools.lru_cache(maxsize=None)
def _plain_run(num_blocks, arrivals):
  return _run(num_blocks, arrivals)


@pytest.mark.parametrize('num_blocks, design, eviction', [
    (40, 'hash', 'lru'), (9, 'hash', 'lru'), (9, 'hash', 'lfu'), (40, 'radix', 'lru'),
    (9, 'radix', 'lfu')])
def test_greedy_outputs_identical_with_caching(num_blocks, design, eviction):
  """Staggered and simultaneous arrivals; 8 usable blocks force evictions and preemption."""
  arrivals = [0.0, 0.0, 50.0, 100.0, 100.0, 150.0]
  plain, s_plain = _plain_run(num_blocks, tuple(arrivals))
  cached, s = _run(num_blocks, arrivals, prefix_caching=True, prefix_cache_design=design,
                   prefix_cache_eviction=eviction)
  assert cached == plain
  assert s['prefix_hit_tokens'] > 0 and s['prefix_hit_rate_tokens'] > 0
  assert s['prompt_tokens_computed'] < s_plain['prompt_tokens_computed']
  assert s['prompt_tokens_submitted'] == s_plain['prompt_tokens_submitted'] == sum(
      len(SYSTEM) + len(u) for u in USERS)
  assert s['prefill_tokens_saved_fraction'] > 0 and s_plain['prefill_tokens_saved_fraction'] == 0
  if num_blocks == 9:
    assert s['prefix_cache_evictions'] > 0


@pytest.mark.parametrize('design', ['hash', 'radix'])
def test_whole_prompt_is_never_skipped(design):
  """A prompt of exactly two blocks seen before: one block is reused, the second computed so
  the last token has logits; a prompt of one block reuses nothing."""
  engine = make_engine(prefix_caching=True, prefix_cache_design=design)
  prompt = prompts([32], seed=9)[0]
  first = engine.generate([prompt, prompt[:16]], SamplingParams(max_new_tokens=4))
  again = engine.generate([prompt, prompt[:16]], SamplingParams(max_new_tokens=4))
  assert [c.output_ids for c in again] == [c.output_ids for c in first]
  s = engine.summary()
  assert s['prompt_tokens_computed'] == 32 + 16 + 16 + 16
  assert s['prefix_hit_blocks'] == 1


@pytest.mark.parametrize('design', ['hash', 'radix'])
def test_salts_keep_tenants_apart(design):
  engine = make_engine(prefix_caching=True, prefix_cache_design=design)
  prompt = prompts([50], seed=4)[0]
  for salt in ('a', 'b', 'a'):
    engine.submit(prompt, SamplingParams(max_new_tokens=2, cache_salt=salt))
    engine.run()
  assert engine.summary()['prefix_hit_blocks'] == 3  # only the second 'a' hits, 3 full blocks
