"""KV events (pagedjax/host/kv_events.py): replaying what an engine announced reproduces what its
device cache and host-RAM tier hold, block for block, under forced evictions in both tiers and
both prefix-cache designs; events name their chain (parent hash, tokens); nothing is built when
nobody listens; vLLM's wire layout round-trips and bad input is refused by name."""
import collections
import dataclasses

import pytest

from pagedjax.config import TiersConfig
from pagedjax.engine import Engine
from pagedjax.host import kv_events
from pagedjax.host.cache.prefix_cache import block_key
from pagedjax.host.requests.sampling_params import SamplingParams

from fakes import CFG, FakeClock, FakeStep, check_blocks
from tiny_models import engine_config, prompts

BLOCK = 4
DOCS = prompts([13 + 2 * i for i in range(6)], seed=5)  # 3-4 full blocks each


def tiered_engine(design='hash'):
  """The fake step's 17-block pool under a 6-block host tier: serving DOCS evicts from both."""
  config, _ = engine_config(CFG, block_size=BLOCK, num_blocks=17, max_batch_size=4,
                            prefill_chunk=8, prefix_caching=True, prefix_cache_design=design)
  config = dataclasses.replace(config, tiers=TiersConfig(host_blocks=6, promotion='load'))
  clock = FakeClock()
  return Engine(CFG, None, config, step_fn=FakeStep(clock.tick), timer=clock)


def held(log_events):
  """medium -> set of hashes, replaying events in order."""
  media = collections.defaultdict(set)
  for e in log_events:
    if isinstance(e, kv_events.BlockStored):
      media[e.medium].update(e.block_hashes)
    elif isinstance(e, kv_events.BlockRemoved):
      media[e.medium].difference_update(e.block_hashes)
    else:
      for medium in ([e.medium] if e.medium else list(media)):
        media[medium].clear()
  return media


def device_keys(engine):
  cache = engine.prefix_cache
  return {cache.entry(b)[0] for b in range(1, engine.allocator.num_blocks) if cache.is_cached(b)}


def host_keys(engine):
  index = engine.tiers.host.index
  return {k for k in index.keys() if not index.is_pending(k)}


@pytest.mark.parametrize('design', ['hash', 'radix'])
def test_replayed_events_equal_what_each_tier_holds(design):
  engine = tiered_engine(design)
  log = kv_events.EventLog(engine.prefix_cache.events)
  seen = []
  params = SamplingParams(max_new_tokens=3)
  for round_ in range(2):
    for i in range(0, len(DOCS), 2):
      engine.generate([DOCS[i] + [round_], DOCS[i + 1] + [round_ + 1]], params)
      batch = log.drain(engine.clock)
      seen += batch.events if batch else []
      check_blocks(engine)
      media = held(seen)
      assert media['GPU'] == device_keys(engine)
      assert media['CPU'] == host_keys(engine)
  kinds = collections.Counter((type(e).__name__, e.medium) for e in seen)
  # Both tiers filled and evicted, and hits below the device were promoted back.
  assert kinds[('BlockRemoved', 'GPU')] > 0 and kinds[('BlockRemoved', 'CPU')] > 0, kinds
  assert engine.summary()['tiers_tier2_hit_blocks'] > 0
  for e in seen:
    if isinstance(e, kv_events.BlockStored) and e.medium == 'GPU':
      assert len(e.token_ids) == BLOCK == e.block_size
      assert e.block_hashes == (block_key(e.parent_block_hash, e.token_ids),)


def test_no_subscriber_no_event_built(monkeypatch):
  built = []  # every call into the hub: the emitting sites call nothing while nobody listens
  for name in ('stored', 'removed', 'emit'):
    original = getattr(kv_events.KVEvents, name)
    monkeypatch.setattr(kv_events.KVEvents, name,
                        lambda self, *a, _f=original, _n=name: built.append(_n) or _f(self, *a))
  engine = tiered_engine()
  engine.generate(DOCS, SamplingParams(max_new_tokens=2))
  assert engine.summary()['prefix_cache_evictions'] > 0 and not built
  log = kv_events.EventLog(engine.prefix_cache.events)
  engine.generate(DOCS[:2], SamplingParams(max_new_tokens=2))
  assert log.pending and built.count('emit') == len(log.pending)
  engine.prefix_cache.events.unsubscribe(log)
  assert not engine.prefix_cache.events


def test_wire_round_trip_and_refusals():
  events = (kv_events.BlockStored((7,), None, (1, 2, 3, 4), 4, None, 'GPU'),
            kv_events.BlockStored((9,), 7, (), 4, None, 'DISK'),
            kv_events.BlockRemoved((7,), 'CPU'), kv_events.AllBlocksCleared(),
            kv_events.AllBlocksCleared('DISK'))
  batch = kv_events.KVEventBatch(1.5, events, 3)
  wire = kv_events.batch_to_wire(batch)
  assert wire[1][0] == ['BlockStored', [7], None, [1, 2, 3, 4], 4, None, 'GPU']
  assert wire[1][3] == ['AllBlocksCleared', None]
  assert kv_events.batch_from_wire(wire) == batch
  # msgspec's omit_defaults drops trailing defaults: vLLM's AllBlocksCleared is just the tag.
  assert kv_events.from_wire(['AllBlocksCleared']) == kv_events.AllBlocksCleared()
  with pytest.raises(ValueError, match="'BlockMoved'.*BlockStored"):
    kv_events.from_wire(['BlockMoved', [1]])
  with pytest.raises(ValueError, match="medium='HBM'"):
    kv_events.from_wire(['BlockRemoved', [1], 'HBM'])
  with pytest.raises(ValueError, match='at most 2 fields'):
    kv_events.from_wire(['BlockRemoved', [1], 'GPU', 5])
  with pytest.raises(TypeError, match='a callable'):
    kv_events.KVEvents(4).subscribe('not callable')
  assert kv_events.EventLog().drain(0.0) is None
