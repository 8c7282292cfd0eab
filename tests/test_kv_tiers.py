"""KV tiers (pagedjax/host/tiers/kv_tiers.py, tier_index.py, disk_store.py, tier_cost.py) without a
model: the pieces on hand-made cases, then random traces through a model-free engine whose fake
step writes each token's identity into its K/V slot, so every block in every tier can be checked
to hold exactly the tokens its key names."""
import dataclasses
import math
import os
import subprocess
import sys
import uuid

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

from configs import default
from pagedjax import config as config_lib
from pagedjax.studies import workloads
from pagedjax.config import TiersConfig
from pagedjax.engine import Engine
from pagedjax.host.tiers import disk_store
from pagedjax.host.tiers.disk_store import DiskStore
from pagedjax.host.tiers.kv_tiers import BlockLayout, content_digest
from pagedjax.host.cache.prefix_cache import PinError, block_content, block_key, chain_keys
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.tiers.tier_cost import TierCosts
from pagedjax.host.tiers.tier_index import TierIndex

import fakes
from fakes import FakeClock, FakeStep, check_blocks, expected_outputs
from tiny_models import engine_config

# ---- the pieces --------------------------------------------------------------------------


def test_chain_keys_are_the_same_in_every_process():
  """Disk entries are found again after a restart only if keys do not depend on the process
  (Python's hash of a str or None does) or on which implementation computed them (the C
  module, or the Python loop where it is turned off): these values are fixed."""
  code = ('from pagedjax.host.cache.prefix_cache import chain_keys; '
          'print(chain_keys([5, 6, 7, 8, 9, 10], 3, 2, salt="tenant"))')
  outs = {subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         check=True, env={**os.environ, 'PYTHONHASHSEED': seed,
                                          'PAGEDJAX_NATIVE_KEYS': native}).stdout
          for seed, native in (('1', '1'), ('2', '0'))}
  assert outs == {f'{chain_keys([5, 6, 7, 8, 9, 10], 3, 2, salt="tenant")}\n'}
  # A salt cannot be spelled by another salt plus token ids (length-prefixed encoding).
  assert block_key(None, [0], 'a') != block_key(None, [], 'a\0\0\0\0\0\0\0\0')


def test_tier_index_evicts_by_policy_and_never_a_busy_entry():
  index = TierIndex(3, 'lru')
  for key in (1, 2, 3):
    index.reserve(key, ('c', key))
  assert index.reserve(4, 'x') is None  # all pending: nothing can go
  for key in (1, 2, 3):
    index.commit(key)
  index.touch(1)
  index.pin(2)
  slot, victim = index.reserve(4, ('c', 4))
  assert victim == (3, ('c', 3), slot)  # 2 is pinned, 1 was used after 3
  assert index.find(4, ('c', 4)) is None  # pending: not matchable yet
  index.commit(4)
  assert index.find(4, ('c', 4)) == slot and index.find(4, 'other content') is None
  index.unpin(2)
  assert index.reserve(5, 'y')[1][0] == 2
  index.check()
  lfu = TierIndex(2, 'lfu')
  for key in (1, 2):
    lfu.reserve(key, key)
    lfu.commit(key)
  lfu.touch(1)
  lfu.touch(1)
  lfu.touch(2)  # used last, but fewer hits
  assert lfu.reserve(3, 3)[1][0] == 2


def test_cost_model_picks_the_cheaper_prefix():
  # 16-token blocks of 1 MB; recompute 1 ms per token = 16 ms per block.
  cost = TierCosts.for_tiers(16, 10**6, 1e-3, host=(1e9, 1e-3), disk=(1e8, 5e-3))
  assert cost.recompute_s(2) == pytest.approx(0.032)
  assert cost.load_s([2, 2]) == pytest.approx(1e-3 + 2e-3)
  # tier 3: 1/bw = 1/1e8 + 1/1e9 -> 11 ms per block; latency 6 ms
  assert cost.load_s([3]) == pytest.approx(6e-3 + 11e-3)
  assert cost.blocks_to_load([2, 2, 3, 3], 'auto') == 4
  slow_disk = TierCosts.for_tiers(16, 10**6, 1e-3, host=(1e9, 1e-3), disk=(1e7, 0.05))
  # Loading the disk blocks costs 50 ms + 101 ms each; recomputing them 16 ms each.
  assert slow_disk.blocks_to_load([2, 2, 3, 3], 'auto') == 2
  assert slow_disk.blocks_to_load([2, 2, 3, 3], 'load') == 4
  assert slow_disk.blocks_to_load([2, 2, 3, 3], 'recompute') == 0
  tiny_blocks = TierCosts.for_tiers(16, 10**6, 1e-6, host=(1e9, 1e-3), disk=(1e8, 5e-3))
  assert tiny_blocks.blocks_to_load([2], 'auto') == 0  # 1 ms latency > 16 us of prefill
  with pytest.raises(ValueError, match='promotion rule'):
    cost.blocks_to_load([2], 'sometimes')


@pytest.mark.parametrize('dtype', [np.float32, np.int8, ml_dtypes.bfloat16,
                                   ml_dtypes.float8_e4m3fn])
def test_block_layout_packs_codes_and_scales_bit_exactly(dtype):
  shapes = {'k': ((2, 5, 3, 4, 6), dtype), 'v': ((2, 5, 3, 4, 6), dtype),
            'k_scale': ((2, 5, 3, 4), np.float16), 'v_scale': ((2, 5, 3, 4), np.float16)}
  layout = BlockLayout(shapes)
  rng = np.random.default_rng(0)
  block = {}
  for name, (shape, dt) in shapes.items():
    shape = (shape[0],) + shape[2:]
    block[name] = (rng.integers(0, 256, shape, np.uint8).view(dt) if np.dtype(dt).itemsize == 1
                   else rng.standard_normal(shape).astype(dt))
  record = layout.pack(block)
  assert record.dtype == np.uint8 and record.size == layout.nbytes
  back = layout.unpack(record)
  for name, array in block.items():
    assert back[name].dtype == array.dtype
    np.testing.assert_array_equal(back[name].view(np.uint8), array.view(np.uint8))


def _store(url, capacity=4, fp=b'f' * 16, nbytes=32):
  return DiskStore(url, capacity, nbytes, fp)


def test_disk_store_round_trip_restart_and_verification():
  url = f'memory://{uuid.uuid4().hex}/'
  store = _store(url)
  record = np.arange(32, dtype=np.uint8)
  content = block_content(None, [1, 2], 'salt')
  assert store.reserve(7, content_digest(content))
  store.write(7, record)
  assert not store.find(7, content_digest(content))  # a write in flight is not served
  store.flush()
  read = store.read(7, content_digest(content))
  np.testing.assert_array_equal(store.finish(read), record)
  assert store.read(7, content_digest(block_content(None, [1, 2], 'other'))) is None
  again = _store(url)  # a restart finds it; another fingerprint does not
  assert again.restored == 1 and again.find(7, content_digest(content))
  assert _store(url, fp=b'g' * 16).restored == 0
  # A record rewritten behind the store's back fails its checksum: a miss, entry dropped.
  blocks = again._blocks  # pylint: disable=protected-access
  blocks[again.index.slot(7)].write(record[::-1].copy()).result()
  assert again.finish(again.read(7, content_digest(content))) is None
  assert again.read_failures == 1 and not again.find(7, content_digest(content))


def test_disk_store_that_cannot_open_switches_off_with_one_warning(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a directory')
  with pytest.warns(RuntimeWarning, match='disk KV tier switched off') as caught:
    store = _store(str(blocker / 'store'))
  assert len(caught) == 1 and not store.enabled and not store.reserve(1, b'x' * 16)


def test_a_plain_path_is_a_path_and_only_a_url_is_percent_decoded(tmp_path):
  assert disk_store.kvstore_spec('/tmp/x/kv%20store').to_json()['path'] == '/tmp/x/kv%20store/'
  assert disk_store.kvstore_spec('file:///tmp/x/kv%20store').to_json()['path'] == (
      '/tmp/x/kv store/')
  store = _store(str(tmp_path / 'kv%20store'))
  assert store.reserve(1, b'd' * 16)
  store.write(1, np.zeros(32, np.uint8))
  store.flush()
  assert [p.name for p in tmp_path.iterdir()] == ['kv%20store']


def test_a_huge_capacity_costs_nothing_until_used_and_restores_only_written_slots(tmp_path):
  """10^8 slots: the index keeps no per-slot list, and a restart reads the headers of the
  slots written, not 10^8 of them (7.2 GB of headers)."""
  store = _store(str(tmp_path), capacity=10**8)
  for key in range(3):
    assert store.reserve(key, bytes([key]) * 16)
    store.write(key, np.full(32, key, np.uint8))
  store.flush()
  again = _store(str(tmp_path), capacity=10**8)
  free = again.index._free  # pylint: disable=protected-access
  assert again.restored == 3 and len(free) == 10**8 - 3
  assert again.reserve(9, b'n' * 16) and again.index.slot(9) == 3  # the next never-used slot


@pytest.mark.parametrize('url, medium', [('{tmp}', 'disk'), ('memory://huge/', 'host RAM')])
def test_a_disk_tier_larger_than_its_medium_is_refused_naming_the_field(tmp_path, url, medium):
  with pytest.raises(config_lib.ConfigError,
                     match=rf'config.tiers.disk_blocks=2000000000 is not allowed: '
                           rf'2,000,000,000 blocks of 1,080 B need .* GiB of {medium}.* at '
                           r'most [\d,]+ blocks fit'):
    DiskStore(url.format(tmp=tmp_path), 2_000_000_000, 1000, b'f' * 16)
  with pytest.raises(config_lib.ConfigError, match=r'disk_blocks=3000000000 is not allowed: at '
                                                   r'most 2,147,483,648 slots'):
    DiskStore(url.format(tmp=tmp_path), 3_000_000_000, 1000, b'f' * 16)


def test_tier_sizes_beyond_host_ram_are_config_errors_at_build():
  """What the command line's --config.tiers.host_blocks=100000000000 and
  --config.scheduler.swap_blocks=... reach: one ConfigError naming the field, value and the
  most blocks that fit, before anything is allocated."""
  for tiers, flat, field in ((TiersConfig(host_blocks=10**11), {}, 'tiers.host_blocks'),
                             (TiersConfig(), {'preemption': 'swap', 'swap_blocks': 10**11},
                              'scheduler.swap_blocks')):
    with pytest.raises(config_lib.ConfigError,
                       match=rf'config.{field}=100000000000 is not allowed: .* GiB of host RAM'
                             r'.* at most [\d,]+ blocks fit'):
      tiered_fake_engine(tiers, **flat)


# ---- config ------------------------------------------------------------------------------

@pytest.mark.parametrize('fields, message', [
    ({'host_blocks': -1}, r'tiers.host_blocks=-1 is not allowed: an integer >= 0'),
    ({'pinned_blocks': 200}, r'tiers.pinned_blocks=200 is not allowed: at most 191'),
    ({'disk_blocks': 8}, r"tiers.disk_kvstore='' is not allowed: a directory or tensorstore"),
    ({'promotion': 'always'}, r"tiers.promotion='always' is not allowed: one of \('auto'"),
    ({'eviction': 'fifo'}, r"tiers.eviction='fifo'"),
    ({'host_latency_s': -1.0}, r'tiers.host_latency_s=-1.0 is not allowed: a finite number'),
    ({'disk_blocks': 2**31 + 1, 'disk_kvstore': 'memory://x/'},
     r'tiers.disk_blocks=2147483649 is not allowed: at most 2,147,483,648'),
    ({'host_blocks': 4, 'enabled': False}, r'tiers.host_blocks=4 is not allowed: 0 unless '
                                           r'prefix_cache.enabled=True'),
])
def test_config_rejects(fields, message):
  config = default.get_config('tiny')
  config.prefix_cache.enabled = fields.pop('enabled', True)
  config.tiers.update(fields)
  with pytest.raises(config_lib.ConfigError, match=message):
    workloads.validate_config(config)


def test_config_section_is_typed():
  config = default.get_config('tiny')
  config.prefix_cache.enabled = True
  config.tiers.update(host_blocks=16, disk_blocks=32, disk_kvstore='memory://x/',
                      write_through=True)
  typed = config_lib.Config.from_configdict(config)
  assert typed.tiers == TiersConfig(host_blocks=16, disk_blocks=32, disk_kvstore='memory://x/',
                                    write_through=True)
  assert config_lib.Config().to_configdict().tiers.promotion == 'auto'


# ---- random traces through a model-free engine ------------------------------------------


class KVWritingStep(FakeStep):
  """FakeStep that also writes, for every fed token, k = (token id, offset in block) and
  v = (token id + 1000, position) into its slot: a block's contents name its tokens."""

  def __call__(self, params, pool, inputs):
    out = super().__call__(params, pool, inputs)
    real = inputs.positions >= 0
    slots, tokens = inputs.slot_mapping[real], inputs.tokens[real]
    bs = pool.block_size
    k, v = np.array(out[0].k), np.array(out[0].v)
    k[0, slots // bs, 0, slots % bs] = np.stack([tokens, slots % bs], -1)
    v[0, slots // bs, 0, slots % bs] = np.stack([tokens + 1000, inputs.positions[real]], -1)
    return (out[0].replace(k=jnp.asarray(k), v=jnp.asarray(v)),) + tuple(out[1:])


def tiered_fake_engine(tiers: TiersConfig, **kw) -> Engine:
  clock = FakeClock()
  flat = {'block_size': 4, 'num_blocks': 11, 'max_batch_size': 3, 'prefill_chunk': 8,
          'max_seq_len': 64, 'prefix_caching': True, **kw}
  config, rest = engine_config(fakes.CFG, **flat)
  config = dataclasses.replace(config, tiers=tiers)
  return Engine(fakes.CFG, None, config, step_fn=KVWritingStep(clock.tick), timer=clock, **rest)


def _check_block_data(name, k, tokens):
  """k [bs, 2] of a block that should hold `tokens` (KVWritingStep's pattern)."""
  want = np.stack([np.asarray(tokens), np.arange(len(tokens))], -1)
  np.testing.assert_array_equal(k, want, err_msg=name)


def check_tiers(engine, tokens_of) -> None:
  """Every tier's index is consistent and within capacity; every cached block, in every tier,
  holds exactly the tokens its key names; a key in several tiers has one content."""
  tiers, cache = engine.tiers, engine.prefix_cache
  tiers.check()
  k = np.asarray(engine.pool.k)
  contents = {}
  for block in range(1, engine.allocator.num_blocks):
    if cache.is_cached(block):
      key, content = cache.entry(block)
      contents[key] = content
      _check_block_data(f'device block {block}', k[0, block, 0], tokens_of[key])
  for seq in engine.running:  # the cached tokens of running sequences (promoted ones too)
    for i in range(seq.num_cached // engine.block_size):
      _check_block_data(f'seq {seq.request_id} block {i}', k[0, seq.block_table[i], 0],
                        seq.all_ids[i * engine.block_size:(i + 1) * engine.block_size])
  if tiers.host:
    for key in tiers.host.index.keys():
      if not tiers.host.index.is_pending(key):
        assert contents.setdefault(key, tiers.host.index.content(key)) == \
            tiers.host.index.content(key)
        _check_block_data('host', tiers.host.arrays['k'][0, tiers.host.index.slot(key), 0],
                          tokens_of[key])
  disk = tiers.disk
  if disk and disk.enabled:
    for key in disk.index.keys():
      if key in contents:
        assert content_digest(contents[key]) == disk.index.content(key)
      if not disk.index.is_pending(key):
        blocks = disk._blocks  # pylint: disable=protected-access
        record = blocks[disk.index.slot(key)].read().result()
        _check_block_data('disk', tiers.layout.unpack(record)['k'][0, 0], tokens_of[key])


PREFIXES = [list(range(10, 22)), list(range(30, 39)), list(range(50, 64))]


@settings(max_examples=30, deadline=None)
@given(data=st.data(), design=st.sampled_from(['hash', 'radix']), write_through=st.booleans(),
       host_blocks=st.sampled_from([0, 2, 5]), disk_blocks=st.sampled_from([0, 3, 12]),
       eviction=st.sampled_from(['lru', 'lfu']), preemption=st.sampled_from(['recompute', 'swap']))
def test_random_traces_keep_every_tier_consistent(data, design, write_through, host_blocks,
                                                  disk_blocks, eviction, preemption):
  """Random traces (shared prefixes, salts, parallel samples, staggered arrivals, preemption by
  recompute or swap) in a pool that evicts all the time: after every iteration, reference counts
  equal holders, every tier is consistent and within capacity and holds the right tokens, and
  outputs are the fake model's."""
  if not host_blocks and not disk_blocks:
    host_blocks = 3
  tiers = TiersConfig(host_blocks=host_blocks, disk_blocks=disk_blocks,
                      disk_kvstore=f'memory://{uuid.uuid4().hex}/', write_through=write_through,
                      promotion='load', eviction=eviction)
  engine = tiered_fake_engine(tiers, prefix_cache_design=design, num_blocks=8,
                              preemption=preemption, swap_blocks=4)
  requests = data.draw(st.lists(st.tuples(
      st.integers(0, 2), st.integers(1, 6), st.integers(2, 8), st.sampled_from([None, 'b']),
      st.integers(0, 5), st.sampled_from([1, 1, 2])), min_size=6, max_size=12))
  rng = np.random.default_rng(len(requests))
  tokens_of, wanted = {}, {}
  for prefix, suffix, max_new, salt, arrival, n in requests:
    prompt = PREFIXES[prefix] + rng.integers(0, 97, suffix).tolist()
    want = expected_outputs(prompt, max_new, 64)
    ids = prompt + want
    keys = chain_keys(ids, 4, len(ids) // 4, salt)
    tokens_of.update({key: ids[i * 4:(i + 1) * 4] for i, key in enumerate(keys)})
    rid = engine.submit(prompt, SamplingParams(max_new_tokens=max_new, cache_salt=salt, n=n),
                        arrival_time=float(arrival))
    wanted.update({rid + i: want for i in range(n)})  # greedy samples: all the same
  for _ in range(400):
    if not engine.has_work():
      break
    engine.step()
    check_blocks(engine)
    check_tiers(engine, tokens_of)
  assert not engine.has_work()
  assert {rid: engine.finished[rid].output_ids for rid in wanted} == wanted
  s = engine.summary()
  lower_hits = s['tiers_tier2_hit_blocks'] + s['tiers_tier3_hit_blocks']
  event(f'lower-tier hits: {lower_hits > 0}')
  event(f'tier-3 evictions: {s["tiers_tier3_evictions"] > 0}')
  event(f'copied on the device after eviction: {s["tiers_evicted_now_hit_blocks"] > 0}')
  event(f'swapped: {engine.stats["preemptions_swap"] > 0}')


def test_a_trace_reaches_every_tier_and_the_checks_can_fail():
  """The property test's workload does promote from tiers 2 and 3 and evict in all three (so it
  exercises them), and its data check catches a promotion that puts the wrong bytes in."""
  def run(sabotage=False):
    tiers = TiersConfig(host_blocks=2, disk_blocks=4, disk_kvstore=f'memory://{uuid.uuid4()}/',
                        promotion='load')
    engine = tiered_fake_engine(tiers, num_blocks=7)
    if sabotage:
      load = engine.tiers.load
      engine.tiers.load = lambda promotions: {n: a[:, ::-1] for n, a in load(promotions).items()}
    tokens_of = {}
    for rep in range(3):
      for prefix in PREFIXES:
        prompt = prefix + [rep]
        ids = prompt + expected_outputs(prompt, 3, 64)
        tokens_of.update(zip(chain_keys(ids, 4, len(ids) // 4),
                             [ids[i * 4:(i + 1) * 4] for i in range(len(ids) // 4)]))
        engine.submit(prompt, SamplingParams(max_new_tokens=3))
        while engine.has_work():
          engine.step()
          check_tiers(engine, tokens_of)
    return engine.summary()

  s = run()
  assert s['tiers_tier2_hit_blocks'] > 0 and s['tiers_tier3_hit_blocks'] > 0
  assert s['tiers_tier1_evictions'] > 0 and s['tiers_tier2_evictions'] > 0
  assert s['tiers_tier3_evictions'] > 0
  with pytest.raises(AssertionError):
    run(sabotage=True)


def test_cost_model_calibrates_at_start_and_decides():
  """promotion='auto' without figures measures them at engine start; with figures that make a
  load dearer than recomputing, the engine recomputes (declines the hits), and outputs hold."""
  engine = tiered_fake_engine(TiersConfig(host_blocks=8))
  figures = engine.summary()
  for name in ('cost_prefill_s_per_token', 'cost_tier2_bytes_per_s', 'cost_tier2_latency_s'):
    assert 0 < figures[name] < math.inf, name
  for latency, lower_hits in ((1e-9, True), (10.0, False)):
    engine = tiered_fake_engine(TiersConfig(host_blocks=8, prefill_s_per_token=1e-3,
                                            host_bytes_per_s=1e9, host_latency_s=latency),
                                num_blocks=8)
    for rep in range(2):
      for prefix in PREFIXES:
        done = engine.generate([prefix + [rep]], SamplingParams(max_new_tokens=2))
        assert done[0].output_ids == expected_outputs(prefix + [rep], 2, 64)
    s = engine.summary()
    assert (s['tiers_tier2_hit_blocks'] > 0) == lower_hits
    assert (s['tiers_declined_blocks'] > 0) == (not lower_hits)


def test_a_block_evicted_and_found_in_one_iteration_is_copied_on_the_device():
  """Request A's admission evicts prefix P's last block; request B, admitted in the same
  iteration, finds it pending in tier 2 (its gather has not run): B gets it by a device copy,
  and B's blocks hold exactly P's tokens."""
  engine = tiered_fake_engine(TiersConfig(host_blocks=4, promotion='load'), num_blocks=11)
  p, q = PREFIXES[0] + [0], PREFIXES[1][:8] + [1, 2, 3, 4, 0]
  a, b = list(range(70, 88)), PREFIXES[0] + [96]  # A needs one block more than is free
  tokens_of = {}
  for prompt in (p, q, a, b):
    ids = prompt + expected_outputs(prompt, 2, 64)
    tokens_of.update(zip(chain_keys(ids, 4, len(ids) // 4),
                         [ids[i * 4:(i + 1) * 4] for i in range(len(ids) // 4)]))
  for prompt in (p, q):  # P's blocks become evictable before Q's: LRU takes P's first
    engine.generate([prompt], SamplingParams(max_new_tokens=2))
  rid = [engine.submit(prompt, SamplingParams(max_new_tokens=2)) for prompt in (a, b)][1]
  engine.step()
  assert engine.summary()['tiers_evicted_now_hit_blocks'] == 1
  assert next(s for s in engine.running if s.request_id == rid).num_cached >= 12
  check_tiers(engine, tokens_of)
  engine.run()
  assert engine.finished[rid].output_ids == expected_outputs(b, 2, 64)


# ---- pinning -----------------------------------------------------------------------------


def _check_pinned_blocks(engine) -> None:
  """fakes.check_blocks with pinned idle blocks: held, free, evictable and pinned idle
  partition the pool; pinned idle blocks are cached and no sequence holds them."""
  cache, alloc = engine.prefix_cache, engine.allocator
  held = set(fakes.block_holders(engine))
  idle = {b for b in range(1, alloc.num_blocks) if cache.is_idle(b)}
  pinned = idle - set(cache.evictable_blocks())
  assert len(pinned) == cache.num_pinned_idle and all(cache.is_cached(b) for b in pinned)
  assert not pinned & held and not set(alloc.free_blocks()) & (held | idle)
  assert set(alloc.free_blocks()) | held | idle == set(range(1, alloc.num_blocks))


@pytest.mark.parametrize('design', ['hash', 'radix'])
def test_a_pinned_prefix_stays_on_the_device_through_a_flood(design):
  system = PREFIXES[0]  # 3 full blocks of 4
  engine = tiered_fake_engine(TiersConfig(pinned_blocks=3), num_blocks=9, max_seq_len=20,
                              prefix_cache_design=design)
  cache = engine.prefix_cache
  with pytest.raises(PinError, match="pinned budget"):
    cache.pin(system + PREFIXES[1][:4])  # 4 blocks > budget 3: nothing pinned
  assert engine.summary()['prefix_pinned_blocks'] == 0
  cache.pin(system)  # before it is cached: pinned once it is

  def ask(prompt):
    before = cache.hit_blocks
    done = engine.generate([prompt], SamplingParams(max_new_tokens=2))
    assert done[0].output_ids == expected_outputs(prompt, 2, 20)
    _check_pinned_blocks(engine)
    return cache.hit_blocks - before

  ask(system + [1])
  for i in range(6):  # distinct prompts that need the whole pool, pinned blocks aside
    ask([60 + i] * 12 + [i])
  assert cache.num_pinned_idle == 3 and engine.summary()['kv_pinned'] > 0
  assert ask(system + [2]) == 3  # all three blocks still on the device
  cache.unpin(system)
  assert cache.num_pinned_idle == 0
  for i in range(6):
    ask([70 + i] * 12 + [i])
  assert ask(system + [3]) == 0  # unpinned: the flood evicted it
  with pytest.raises(PinError, match='not pinned'):
    cache.unpin(system)
