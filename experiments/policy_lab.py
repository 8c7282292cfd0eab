"""Prefix-cache policy lab on Mooncake's conversation trace: each eviction policy's hit rate.

Hit rate against cache capacity for every eviction policy, against the offline optimum.

  python -m experiments.policy_lab --workdir=runs/policy_lab
  python -m experiments.policy_lab --config=configs/policy_lab.py:tiny --workdir=DIR

The trace (config.lab.trace, pagedjax.studies.workloads.read_block_trace) names each prompt's 512-token
blocks by hash id. Each request is replayed, in trace order and one at a time, through the real
host-side cache code: the BlockManager admits it (the prefix cache's lookup, then allocation,
evicting by the row's policy when the pool is full), its full blocks are offered to the cache,
its turn ends (sessions.py, for rows that keep sessions) and its blocks are released. No model
runs: a cache block stands for one trace block (the cache's block size is 1 and a prompt's
"tokens" are its hash ids, so the hash chain is taken over the block ids), and the pool holds
`capacity / 512` blocks. Hit rate = prompt tokens served from the cache (hit blocks x 512) /
prompt tokens (the trace's input lengths). A prompt's partial last block is held while it runs
and never cached, as in the engine; the engine's rule that the last prompt token always runs
withholds one block of a prompt that ends on a block boundary. A prompt longer than the pool is
cached up to the pool's size. Outputs are not cached: the trace names no block of them.

Rows (config.lab.rows; experiments/policy_lab.ROWS): a registered eviction policy
(pagedjax/host/policies.py) with or without sessions (a request's session is its inferred
conversation, workloads.BlockTraceRecord.conversation), or any 'package.module:Class' (run with
sessions: the policy sees them and may ignore them). 'belady' is the offline optimum, given the
trace's future (policies.Belady: what it guarantees and what it does not); 'reuse_oracle' knows
whether a block is read again but not when (policies.ReuseOracle), which splits the optimum's
advantage into knowing which conversations return and knowing when. Every row at every
capacity is also compared with LRU: regret = optimum - policy, gap closed = (policy - LRU) /
(optimum - LRU).

Tuning (config.lab.tune): each tunable policy's parameter is chosen on the first half of the
requests (the best hit rate at lab.gap_capacity), then both halves are replayed with it: the
gain over LRU on the second half, against the first half's, says whether the tuning carries
over to requests it never saw. The full-trace rows use the first half's choice. The rows in
FITTED (host/predictive_policies.py) fit their return model on the first half as well (a
Recorder's replay through an infinite cache; studies/return_model.py), and are checked the same
way; so are the rows in HOLD_FITTED (policies.Retention), whose hold time per conversation class is
fitted on the first half at each capacity replayed (studies/retention_model.py; the curves record
it as hold_ticks).

Tier arrangements (config.lab.tiers; TierReplay below): the replay with host-RAM and disk tiers
under the device cache, through the real tier code, hit rate by the tier that served each block.

Writes to WORKDIR:
  curves.csv      one line per (row, capacity): hit rate, regret, gap closed, evictions, host
                  seconds and microseconds per request
  table.md        hit rate per row and capacity; gap closed at lab.gap_capacity
  tuning.csv      per tuned policy and parameter value: hit rate on each half at gap_capacity
  hit_rate.png    hit rate against capacity (log x), the infinite-capacity ceiling dashed
  regret.png      regret against capacity, and LRU's gap closed
  reuse.png       the trace's LRU stack distances (first / later turns) and hits by block depth
                  at gap_capacity (LRU, the best online row, the oracles)
  tiers.csv, tiers.png  hit rate by tier per arrangement (lab.tiers), sizes in tokens
  bound.csv, bound.png  per classing of releases (lab.bound): the fluid model's optimum and the
                  real cache's hit rate with its holds, both in hindsight (bound_study)
  summary.json    the curves, the ceiling (replayed, and counted from the hash ids), the goals
                  and whether each was met, the tuning, host time per request, config, versions
Host time is this process's wall time around the replay of each point (summary.json also has it
per row, per phase, and per request replayed); on a shared machine it is a figure under load
(summary.json records the load average at the start and the end).
"""
import bisect
import itertools
import math
import os
import time

import numpy as np
import tensorstore as ts

from experiments import cli
from pagedjax import config as config_lib
from pagedjax.studies import run_info
from pagedjax.studies import workloads
from pagedjax.host import policies
from pagedjax.host import predictive_policies
from pagedjax.studies import return_model
from pagedjax.studies import retention_model
from pagedjax.host.scheduling.allocator import BlockAllocator
from pagedjax.host.tiers import disk_store as disk_store_lib
from pagedjax.host.tiers.disk_store import DiskStore
from pagedjax.host.tiers.kv_tiers import BlockLayout, KVTiers
from pagedjax.host.scheduling.block_manager import BlockManager
from pagedjax.host.cache.prefix_cache import PrefixCache, chain_keys
from pagedjax.host.cache.radix_cache import RadixCache
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.requests.sequence import Sequence
from pagedjax.host.cache.sessions import Sessions

BLOCK = workloads.TRACE_BLOCK_TOKENS
TAIL = -1  # the "token" standing for a prompt's partial last block (never cached)
DEPTH_EDGES = (0, 1, 2, 4, 8, 16, 32, 64)  # hit blocks counted by depth: [0, 1), [1, 2), ...
DISTANCE_EDGES_TOKENS = tuple(10 ** (4 + k / 4) for k in range(21))  # 1e4 .. 1e9, 4 per decade
# name -> (eviction policy, keep sessions)
ROWS = {
    'lru': ('lru', False),
    'lfu': ('lfu', False),
    'session_lru': ('lru', True),
    'session_lfu': ('lfu', True),
    'leaves_first': ('leaves_first', False),
    'gdsf': ('gdsf', False),
    's3fifo': ('s3fifo', False),
    'session_recency': ('session_recency', True),
    'hit_density': ('hit_density', True),
    'arc': ('arc', False),
    'lrfu': ('lrfu', False),
    'return_predictor': ('pagedjax.host.predictive_policies:ReturnPredictor', True),
    'reuse_distance': ('pagedjax.host.predictive_policies:LearnedReuseDistance', True),
    'retention': ('retention', True),
    'reuse_oracle': ('reuse_oracle', False),
    'belady': ('belady', False),
}
OFFLINE = ('reuse_oracle', 'belady')
REFERENCE, OPTIMUM = 'lru', 'belady'
# Tunable policies: row -> the attribute its values set. An attribute named '..._capacities'
# is given in cache capacities: the policy's attribute without the suffix is set to the value
# times the capacity in blocks, so one value means the same at any size.
TUNABLE = {
    'session_recency': 'turn_bonus_capacities',
    's3fifo': 'small_share',
    'gdsf': 'attention_weight',
    'hit_density': 'prior_weight',
    'lrfu': 'half_life_capacities',
    'return_predictor': 'horizon_capacities',
}
# Rows whose return model (host/predictive_policies.py) is fitted on the first half of the
# requests (studies/return_model.py), from a Recorder's replay of it with an infinite cache.
FITTED = ('return_predictor', 'reuse_distance')
FIT = 'return_model'  # the key of the fitted weights in a replay's params
# Rows whose hold times per conversation class (policies.Retention) are fitted on the first half
# at each capacity (studies/retention_model.py: a fluid model of the cache, from the first half's
# return times); HOLD is the key of the first half's releases in a replay's params.
HOLD_FITTED = ('retention',)
HOLD = 'retention_releases'
CURVE_COLUMNS = ('row', 'capacity_tokens', 'hit_rate', 'regret', 'gap_closed', 'hit_tokens',
                 'prompt_tokens', 'evictions', 'host_s', 'host_us_per_request')


# ---- the trace -------------------------------------------------------------------------------


def load(config) -> list:
  """The records of config.lab's slice of the trace (checked as read)."""
  lab = config.lab
  return list(workloads.read_block_trace(lab.trace, lab.start, lab.limit or None))


def prompt_of(record: workloads.BlockTraceRecord) -> list:
  """A record's prompt in cache blocks: the ids of its full blocks, then TAIL for a partial
  last block (held while the request runs, never cached)."""
  ids = list(record.hash_ids[:record.full_blocks])
  return ids + [TAIL] if record.input_length % BLOCK else ids


def counted_ceiling(records) -> dict:
  """The infinite-capacity hit rate counted from the hash ids alone (no cache code): each
  request's leading full blocks that an earlier request had, x 512 tokens."""
  seen, hit = set(), 0
  for r in records:
    full = r.hash_ids[:r.full_blocks]
    for h in full:
      if h not in seen:
        break
      hit += BLOCK
    seen.update(full)
  prompt = sum(r.input_length for r in records)
  return {'hit_tokens': hit, 'prompt_tokens': prompt, 'hit_rate': hit / prompt if prompt else 0}


def continuation(records) -> list:
  """Per turn of an inferred conversation (BlockTraceRecord.conversation; the last bucket
  holds that turn and later ones): how many turns there were and the share followed by another
  turn of the same conversation. What an online policy can learn about who comes back."""
  turns = {}
  for r in records:
    if r.conversation is not None:
      turns[r.conversation] = turns.get(r.conversation, 0) + 1
  last = 5
  counts, followed = [0] * (last + 1), [0] * (last + 1)
  for n in turns.values():
    for t in range(n):
      counts[min(t, last)] += 1
      followed[min(t, last)] += t < n - 1
  return [{'turn': t + 1 if t < last else f'{last + 1}+', 'turns': counts[t],
           'followed_by_another': followed[t] / counts[t] if counts[t] else None}
          for t in range(last + 1)]


def future_uses(records, capacity_blocks: float = math.inf) -> dict:
  """chain key -> sorted positions of the requests that can read it: what the Belady oracle
  knows. A lookup may match all of a prompt's blocks but its last "token" (the tail, or the block
  holding a prompt's last token, which always runs), and no more than a pool of capacity_blocks
  lets it keep (Replay.serve cuts longer prompts)."""
  uses = {}
  for i, r in enumerate(records):
    prompt = prompt_of(r)
    for key in chain_keys(prompt, 1, int(min(len(prompt), capacity_blocks) - 1)):
      uses.setdefault(key, []).append(i)
  return uses


def reuse_distances(records) -> dict:
  """LRU stack distances of the reads an infinite cache serves: for each hit block (a request's
  leading full blocks an earlier request had), the distinct blocks used since its last use, in
  tokens (x 512). An LRU cache of C tokens serves a read about when its distance is below C (the
  running request's own blocks and the last-token rule aside), so this histogram says how much
  of the trace's reuse each capacity can reach by recency alone. Counted per request of the
  reading (first turns of a conversation, later turns). A Fenwick tree over use times: O(n log n)."""
  uses = sum(r.full_blocks for r in records)
  tree = [0] * (uses + 1)

  def add(i, v):
    i += 1
    while i <= uses:
      tree[i] += v
      i += i & -i

  def prefix(i):  # sum of marks at times < i
    total = 0
    while i > 0:
      total += tree[i]
      i -= i & -i
    return total

  last, now, seen_conv = {}, 0, set()
  counts = {'first_turn': [0] * (len(DISTANCE_EDGES_TOKENS) + 1),
            'later_turn': [0] * (len(DISTANCE_EDGES_TOKENS) + 1)}
  for r in records:
    kind = 'later_turn' if r.conversation in seen_conv else 'first_turn'
    if r.conversation is not None:
      seen_conv.add(r.conversation)
    reading = True
    for h in r.hash_ids[:r.full_blocks]:
      previous = last.get(h)
      if reading and previous is not None:
        distance = (prefix(now) - prefix(previous + 1)) * BLOCK  # distinct blocks used since
        counts[kind][bisect.bisect_right(DISTANCE_EDGES_TOKENS, distance)] += 1
      else:
        reading = False  # past the first miss, nothing of this prompt is a hit
      if previous is not None:
        add(previous, -1)
      add(now, 1)
      last[h] = now
      now += 1
  return {'edges_tokens': list(DISTANCE_EDGES_TOKENS), **counts}


# ---- one replay ------------------------------------------------------------------------------


class Replay:
  """The trace served one request at a time through a BlockManager over a pool of
  `capacity_blocks` blocks and a prefix cache (design 'hash' or 'radix') with `queue` as its
  eviction policy; `position` is the request being served (the oracle's clock)."""

  def __init__(self, capacity_blocks: int, queue: policies.EvictionQueue, sessions: bool,
               design: str = 'hash'):
    self.capacity = capacity_blocks
    self.cache = {'hash': PrefixCache, 'radix': RadixCache}[design](1, queue)
    if sessions:
      self.cache.sessions = Sessions()
    self.sessions = sessions
    allocator = BlockAllocator(capacity_blocks + 1, cache=self.cache)  # + the null block
    self.blocks = BlockManager(allocator, 1, 'paged', max_seq_len=capacity_blocks)
    self.position = -1
    self.hits_by_depth = [0] * len(DEPTH_EDGES)  # hit blocks per DEPTH_EDGES bucket

  def serve(self, records) -> None:
    for record in records:
      self.position += 1
      prompt = prompt_of(record)
      if len(prompt) > self.capacity:  # cached up to the pool's size
        prompt = prompt[:self.capacity - 1] + [TAIL]
      session = None
      if self.sessions and record.conversation is not None:
        session = str(record.conversation)
      seq = Sequence(self.position, prompt, SamplingParams(max_new_tokens=1,
                                                           session_id=session))
      self.blocks.allocate_waiting(seq)
      self._count_depths(seq.num_cached)  # block size 1: the cached tokens are the hit blocks
      self.after_admission()
      seq.num_cached = min(record.full_blocks, len(prompt))  # the full blocks are computed
      self.blocks.offer_full_blocks(seq)
      self.blocks.end_turn(seq, float(self.position))
      self.blocks.deallocate(seq)
      self.after_request()

  def _count_depths(self, hits: int) -> None:
    """Blocks 0..hits-1 of a prompt were hits: count them per depth bucket."""
    for b, lo in enumerate(DEPTH_EDGES):
      hi = DEPTH_EDGES[b + 1] if b + 1 < len(DEPTH_EDGES) else math.inf
      if hits <= lo:
        break
      self.hits_by_depth[b] += min(hits, hi) - lo

  def after_admission(self) -> None:
    """A hook (TierReplay moves blocks between tiers here)."""

  def after_request(self) -> None:
    """A hook (TierReplay ends its iteration here)."""


def make_queue(row: str, capacity_blocks: int, records, params: dict
               ) -> policies.EvictionQueue:
  """A fresh policy instance for one replay: the row's policy, with its tuned parameter set
  (params: row -> value); the oracle is given the future of `records`."""
  spec = ROWS[row][0] if row in ROWS else row
  queue = policies.EVICTION.get(spec)()
  if row in FITTED and FIT in params:  # else the class's prior (predictive_policies.py)
    queue.weights = tuple(params[FIT]['weights'])
    queue.delay_weights = tuple(params[FIT]['delay_weights'])
  if row in HOLD_FITTED and HOLD in params:  # else the class's default (LRU)
    queue.hold = retention_model.fit_hold(params[HOLD], capacity_blocks)
  if row in params:
    attribute, value = TUNABLE[row], params[row]
    if attribute.endswith('_capacities'):
      setattr(queue, attribute[:-len('_capacities')], value * capacity_blocks)
    else:
      setattr(queue, attribute, value)
  return queue


def _infinite_blocks(records) -> int:
  """A pool with room for every block ever cached, and the longest prompt."""
  longest = max((len(prompt_of(r)) for r in records), default=1)
  return sum(r.full_blocks for r in records) + longest + 1


def replay(row: str, records, capacity_tokens: float, params: dict, design: str) -> dict:
  """Hit figures of one row at one capacity over records (infinite: math.inf)."""
  if math.isinf(capacity_tokens):
    blocks = _infinite_blocks(records)
  else:
    blocks = max(2, int(capacity_tokens // BLOCK))
  queue = make_queue(row, blocks, records, params)
  sessions = ROWS[row][1] if row in ROWS else True
  run = Replay(blocks, queue, sessions, design)
  if isinstance(queue, policies.Belady):  # an oracle (Belady, ReuseOracle) sees the future
    queue.see(future_uses(records, blocks), lambda: run.position)
  start = time.perf_counter()
  run.serve(records)
  host_s = time.perf_counter() - start
  prompt = sum(r.input_length for r in records)
  hit = run.cache.hit_blocks * BLOCK
  return {'row': row, 'capacity_tokens': capacity_tokens, 'hit_tokens': hit,
          'prompt_tokens': prompt, 'hit_rate': hit / prompt if prompt else 0.0,
          'evictions': run.cache.evictions, 'host_s': host_s,
          'host_us_per_request': 1e6 * host_s / max(len(records), 1),
          'hits_by_depth': list(run.hits_by_depth),
          **({'hold_ticks': list(queue.hold)} if row in HOLD_FITTED else {})}


# ---- what the classes can tell: the fluid model, and hindsight holds through the cache -------
# studies/retention_model.py: per classing of the releases (what a policy deciding by a release's
# class and age could know), the fluid optimum on the whole trace, and the hit rate of the real
# cache when Retention is given that optimum's holds and told each request's class. Both use the
# trace they are scored on (hindsight): what the information is worth at best, not a policy.
BOUND_COLUMNS = ('classing', 'capacity_tokens', 'classes', 'fluid_hit_rate', 'cache_hit_rate',
                 'cache_gap_closed', 'held_out_hit_rate', 'held_out_lru_hit_rate', 'host_s')


class HindsightRetention(policies.Retention):
  """Retention with a hold per class label, told the label of the request being served
  (labels: request position -> label; a request without a release holds 0)."""

  def __init__(self, table: dict, labels: dict, clock):
    super().__init__()
    self.table, self.labels, self.clock = table, labels, clock

  def priority(self, key, tick, session):
    major = session[1] if session is not None else tick
    return (major + self.table.get(self.labels.get(self.clock()), 0.0), tick)


def _hindsight_replay(records, rel, table, classes, blocks: int, design: str) -> float:
  """Hit rate of records through the cache, Retention told each request's class."""
  labels = dict(zip(rel['request'].astype(int).tolist(), classes.tolist()))
  served = []  # the replay, once made: the queue's clock is its position
  run = Replay(blocks, HindsightRetention(table, labels, lambda: served[0].position), True,
               design)
  served.append(run)
  run.serve(records)
  return run.cache.hit_blocks * BLOCK / sum(r.input_length for r in records)


def bound_study(config, records, curves: list) -> list:
  """Per lab.bound capacity and classing: the fluid optimum over records and the real cache's
  hit rate with its holds (both fitted on records), its gap closed against the curves' LRU; and
  held out: the holds fitted on the first half, the cache on the second (with LRU's there)."""
  lab, rel = config.lab, retention_model.releases(records)
  half = len(records) // 2
  first, second = retention_model.releases(records[:half]), records[half:]
  second_rel = retention_model.releases(second)
  by = {(c['row'], c['capacity_tokens']): c['hit_rate'] for c in curves}
  points = []
  for cap in lab.bound.capacities:
    blocks = max(2, int(cap // BLOCK))
    lru_second = replay(REFERENCE, second, cap, {}, lab.design)['hit_rate']
    for name in lab.bound.classings:
      start = time.perf_counter()
      classes = retention_model.CLASSINGS[name](rel)
      table = retention_model.fit_holds(rel, blocks, classes)
      hit = _hindsight_replay(records, rel, table, classes, blocks, lab.design)
      held_out = _hindsight_replay(
          second, second_rel, retention_model.fit_holds(
              first, blocks, retention_model.CLASSINGS[name](first)),
          retention_model.CLASSINGS[name](second_rel), blocks, lab.design)
      lru, best = by.get((REFERENCE, cap)), by.get((OPTIMUM, cap))
      points.append({'classing': name, 'capacity_tokens': cap, 'classes': len(table),
                     'fluid_hit_rate': retention_model.bound(rel, blocks, classes),
                     'cache_hit_rate': hit,
                     'cache_gap_closed': (hit - lru) / (best - lru)
                                         if lru is not None and best - lru > 1e-12 else None,
                     'held_out_hit_rate': held_out, 'held_out_lru_hit_rate': lru_second,
                     'host_s': time.perf_counter() - start})
      cli.say(f"bound {name} at {cap:.0e}: fluid {points[-1]['fluid_hit_rate']:.4f}, "
              f"cache {hit:.4f} ({len(table)} classes); held out {held_out:.4f} "
              f"(LRU {lru_second:.4f})")
  return points


def plot_bound(config, points: list, curves: list, workdir: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  caps = list(config.lab.bound.capacities)
  names = list(config.lab.bound.classings)
  by = {(c['row'], c['capacity_tokens']): c['hit_rate'] for c in curves}
  fig, axes = plt.subplots(1, len(caps), figsize=(5.5 * len(caps), 4.8), squeeze=False)
  for ax, cap in zip(axes[0], caps):
    pts = {p['classing']: p for p in points if p['capacity_tokens'] == cap}
    xs = np.arange(len(names))
    ax.bar(xs - 0.2, [pts[n]['fluid_hit_rate'] for n in names], 0.4, label='fluid model')
    ax.bar(xs + 0.2, [pts[n]['cache_hit_rate'] for n in names], 0.4,
           label='real cache, hindsight holds')
    lru, best = by.get((REFERENCE, cap)), by.get((OPTIMUM, cap))
    if lru is not None and best is not None:
      ax.axhline(lru, color='grey', label=f'LRU {lru:.3f}')
      ax.axhline(best, color='black', label=f'Belady {best:.3f}')
      ax.axhline((lru + best) / 2, color='red', linestyle='--',
                 label=f'goal: half the gap {(lru + best) / 2:.3f}')
    ax.set_xticks(xs)
    ax.set_xticklabels([n.replace(' x ', ' x\n').replace(': ', ':\n') for n in names],
                       fontsize=7)
    ax.set_ylabel('hit rate')
    ax.set_title(f'Classes of a release and what they are worth, {cap:.0e} tokens', fontsize=9)
    ax.grid(True, axis='y', alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'bound.png'), dpi=120)
  plt.close(fig)


# ---- tier arrangements -----------------------------------------------------------------------
# The same replay with host-RAM (tier 2) and disk (tier 3) tiers under the device cache, through
# the real tier code (host/tiers/kv_tiers.py): write-back demotion of what the device evicts,
# tier 2 demoting to tier 3, promotion of every block found below (promotion='load'), inclusive
# tiers, each with its own LRU order. The executor's part is played here: after each admission,
# one "gather" stores the blocks demoted since the last one (their bytes: one zero byte per
# block, the replay moves no K/V), then the promoted blocks are loaded (disk reads issued and
# waited for, as the executor's scatter does); disk writes are waited for before the next
# request (in an engine, a request's many decode iterations give them the time).
TIER_NAMES = {1: 'device', 2: 'host', 3: 'disk'}
TIER_COLUMNS = ('arrangement', 'row', 'capacity_tokens', 'device_tokens', 'host_tokens',
                'disk_tokens', 'hit_rate', 'device_hit_rate', 'host_hit_rate', 'disk_hit_rate',
                'lower_tier_share_of_hits', 'demoted_blocks', 'promoted_blocks', 'host_s',
                'host_us_per_request')
_LAYOUT = BlockLayout({'kv': ((1, 1, 1), 'uint8')})  # one byte per block: bookkeeping only
_stores = itertools.count()


class TierReplay(Replay):
  """Replay with lower tiers of host_blocks and disk_blocks (0: none) under the device cache;
  the disk tier is a tensorstore 'memory://' store, deleted by close()."""

  def __init__(self, capacity_blocks: int, queue, sessions: bool, design: str,
               host_blocks: int, disk_blocks: int, eviction: str = 'lru'):
    super().__init__(capacity_blocks, queue, sessions, design)
    self.url = None
    disk = None
    if disk_blocks:
      self.url = f'memory://policy_lab_{os.getpid()}_{next(_stores)}/'
      disk = DiskStore(self.url, disk_blocks, _LAYOUT.nbytes, b'policy-lab-trace', eviction)
    self.tiers = KVTiers(_LAYOUT, 1, host_blocks=host_blocks, disk=disk, eviction=eviction,
                         promotion='load').attach(self.cache)

  def _move_blocks(self) -> None:
    """The executor's block movement after an admission (executor._move_blocks)."""
    demoted = self.tiers.take_demotions()
    if demoted:
      self.tiers.store_demotions(demoted, {'kv': np.zeros((1, len(demoted), 1), np.uint8)})
    self.tiers.take_copies()  # device-to-device copies of blocks evicted now: nothing to move
    promoted = self.tiers.take_promotions()
    if promoted:
      self.tiers.load(promoted)

  def after_admission(self) -> None:
    self._move_blocks()

  def after_request(self) -> None:
    self.tiers.flush()
    self.tiers.end_iteration()

  def close(self) -> None:
    if self.url is not None:  # the memory store lives as long as the process: free it now
      store = ts.KvStore.open(self.url, context=disk_store_lib._CONTEXT).result()  # pylint: disable=protected-access
      store.delete_range(ts.KvStore.KeyRange()).result()


def arrangement_sizes(config, capacity_tokens: float) -> dict:
  """Tokens per tier of each arrangement at this device capacity (lab.tiers.arrangements:
  name -> multiples of the device capacity for host and disk)."""
  return {name: {'device_tokens': capacity_tokens, 'host_tokens': capacity_tokens * m[0],
                 'disk_tokens': capacity_tokens * m[1]}
          for name, m in config.lab.tiers.arrangements.items()}


def tier_replay(row: str, records, sizes: dict, params: dict, design: str,
                eviction: str = 'lru') -> dict:
  """Hit figures by tier of one row (the device cache's policy) over one arrangement."""
  blocks = {k: int(v // BLOCK) for k, v in sizes.items()}
  device = max(2, blocks['device_tokens'])
  queue = make_queue(row, device, records, params)
  if getattr(queue, 'offline', False):
    raise ValueError(f'tier rows are online policies; {row!r} is an oracle')
  sessions = ROWS[row][1] if row in ROWS else True
  run = TierReplay(device, queue, sessions, design, blocks['host_tokens'],
                   blocks['disk_tokens'], eviction)
  start = time.perf_counter()
  try:
    run.serve(records)
  finally:
    host_s = time.perf_counter() - start
    run.close()
  prompt = sum(r.input_length for r in records)
  f = run.tiers.figures()
  hit = {t: f[f'tiers_tier{t}_hit_blocks'] * BLOCK / prompt for t in (1, 2, 3)}
  total = sum(hit.values())
  return {'row': row, 'capacity_tokens': sizes['device_tokens'], **sizes,
          'hit_rate': total, 'device_hit_rate': hit[1], 'host_hit_rate': hit[2],
          'disk_hit_rate': hit[3],
          'lower_tier_share_of_hits': (hit[2] + hit[3]) / total if total else 0.0,
          'demoted_blocks': f['tiers_tier2_demoted_blocks'] + f['tiers_tier3_demoted_blocks'],
          'promoted_blocks': f['tiers_promoted_blocks'], 'host_s': host_s,
          'host_us_per_request': 1e6 * host_s / max(len(records), 1)}


def tier_study(config, records, params: dict) -> list:
  """Every (arrangement, row, capacity) of lab.tiers; an arrangement without lower tiers is the
  device-only replay."""
  t = config.lab.tiers
  points = [(name, row, sizes) for cap in t.capacities
            for name, sizes in arrangement_sizes(config, cap).items() for row in t.rows]
  out = []
  for name, row, sizes in cli.progress(points, desc='tier arrangements', unit='point'):
    out.append({'arrangement': name,
                **tier_replay(row, records, sizes, params, config.lab.design, t.eviction)})
  return out


def plot_tiers(config, points: list, workdir: str) -> None:
  """tiers.png: per arrangement, hit rate by tier (stacked) against device capacity."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  names = list(config.lab.tiers.arrangements)
  rows = list(config.lab.tiers.rows)
  fig, axes = plt.subplots(len(rows), len(names), figsize=(4.2 * len(names), 3.6 * len(rows)),
                           squeeze=False, sharey=True)
  for i, row in enumerate(rows):
    for j, name in enumerate(names):
      ax = axes[i][j]
      pts = sorted((p for p in points if p['arrangement'] == name and p['row'] == row),
                   key=lambda p: p['capacity_tokens'])
      xs = [p['capacity_tokens'] for p in pts]
      stack = [[p[f'{t}_hit_rate'] for p in pts] for t in ('device', 'host', 'disk')]
      ax.stackplot(xs, *stack, labels=('device', 'host RAM', 'disk'), alpha=0.8)
      ax.plot(xs, [p['hit_rate'] for p in pts], color='black', marker='o', markersize=3,
              label='all tiers')
      m = config.lab.tiers.arrangements[name]
      ax.set_title(f'{name}: host {m[0]:g}x, disk {m[1]:g}x the device\n'
                   f'device policy {row}, lower tiers {config.lab.tiers.eviction}', fontsize=9)
      ax.set_xscale('log')
      ax.set_xlabel('device cache capacity (tokens, log scale)')
      ax.set_ylabel('hit rate (prompt tokens served / prompt tokens)')
      ax.grid(True, which='both', alpha=0.3)
      ax.legend(fontsize=7, loc='upper left')
  fig.suptitle('Hit rate by tier, Mooncake conversation trace' + cli.variant_note(config),
               fontsize=9)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'tiers.png'), dpi=120)
  plt.close(fig)


# ---- the study -------------------------------------------------------------------------------


def check(config) -> None:
  """config.lab's fields, before anything runs: ConfigError naming the first bad one."""
  lab = config.lab

  def fail(name, value, allowed):
    raise config_lib.ConfigError(f'config.lab.{name}={value!r} is not allowed: {allowed}')
  if not isinstance(lab.trace, str) or not os.path.isfile(lab.trace):
    fail('trace', lab.trace, 'a block-hash trace file that exists (JSON lines)')
  if not isinstance(lab.start, int) or lab.start < 0:
    fail('start', lab.start, 'an integer >= 0 (requests skipped)')
  if not isinstance(lab.limit, int) or lab.limit < 0:
    fail('limit', lab.limit, 'an integer >= 0 (requests replayed; 0 = to the end)')
  caps = list(lab.capacities)
  if not caps or any(not isinstance(c, (int, float)) or not BLOCK * 2 <= c < math.inf
                     for c in caps) or caps != sorted(set(caps)):
    fail('capacities', caps, f'increasing, distinct token counts >= {2 * BLOCK}')
  if lab.gap_capacity not in caps:
    fail('gap_capacity', lab.gap_capacity, f'one of lab.capacities={caps}')
  if lab.design not in ('hash', 'radix'):
    fail('design', lab.design, "'hash' or 'radix' (the prefix cache design replayed)")
  rows = list(lab.rows)
  if REFERENCE not in rows or OPTIMUM not in rows or len(set(rows)) != len(rows):
    fail('rows', rows, f'distinct names including {REFERENCE!r} and {OPTIMUM!r}')
  for row in rows:
    if row not in ROWS:
      try:
        policies.EVICTION.get(row)
      except policies.PolicyError as e:
        fail('rows', row, f'one of {tuple(ROWS)} or an eviction policy: {e}')
  t = lab.tiers
  tcaps = list(t.capacities)
  if any(not isinstance(c, (int, float)) or not BLOCK * 2 <= c < math.inf for c in tcaps):
    fail('tiers.capacities', tcaps, f'device token counts >= {2 * BLOCK} ([]: no tier study)')
  for name, multiples in t.arrangements.items():
    m = list(multiples)
    if len(m) != 2 or any(not isinstance(v, (int, float)) or v < 0 for v in m):
      fail(f'tiers.arrangements.{name}', m, '[host, disk]: capacities as multiples >= 0 of the '
           "device's (0: no such tier)")
  for row in t.rows:
    if row not in ROWS or row in OFFLINE:
      fail('tiers.rows', row, f'online rows of ROWS: {tuple(r for r in ROWS if r not in OFFLINE)}')
  if t.eviction not in policies.EVICTION or getattr(policies.EVICTION.get(t.eviction),
                                                    'offline', False):
    fail('tiers.eviction', t.eviction, f'an online registered policy: {policies.EVICTION.names()}')
  bcaps = list(lab.bound.capacities)
  if any(c not in caps for c in bcaps):
    fail('bound.capacities', bcaps, f'some of lab.capacities={caps} ([]: no bound study)')
  for name in lab.bound.classings:
    if name not in retention_model.CLASSINGS:
      fail('bound.classings', name, f'one of {tuple(retention_model.CLASSINGS)}')
  for row, values in lab.tune.items():
    if row not in TUNABLE or row not in rows:
      fail('tune', row, f'a tunable row of lab.rows: one of {tuple(TUNABLE)}')
    if not values or any(not isinstance(v, (int, float)) or v < 0 for v in values):
      fail(f'tune.{row}', list(values), f'numbers >= 0 (values of {TUNABLE[row]})')


def fit_return_model(records) -> dict:
  """The predictive rows' return model, fitted on `records` (the first half): a Recorder
  replays them through an infinite cache with sessions and notes, per block released, its
  features and whether it is read again (return_model.py fits the weights)."""
  recorder = predictive_policies.Recorder()
  Replay(_infinite_blocks(records), recorder, True).serve(records)
  return return_model.fit(recorder.releases)


def evaluate_return_model(records, model: dict) -> dict:
  """The fitted model's AUC and calibration on other requests (the second half)."""
  recorder = predictive_policies.Recorder()
  Replay(_infinite_blocks(records), recorder, True).serve(records)
  return return_model.evaluate(recorder.releases, model['weights'])


def tune(config, records, base: dict) -> tuple:
  """(chosen value per tuned row, tuning rows, per-row check on the second half). base: params
  every replay gets (the fitted return model). A fitted row without values to tune is checked
  the same way: its gain over LRU on the first half (where it was fitted) and the second."""
  lab, half = config.lab, len(records) // 2
  first, second = records[:half], records[half:]
  cap = lab.gap_capacity
  base_hits = {name: replay(REFERENCE, part, cap, {}, lab.design)['hit_rate']
               for name, part in (('first', first), ('second', second))}
  chosen, table, checks = {}, [], {}
  candidates = dict(lab.tune)
  for row in FITTED + HOLD_FITTED:
    if row in lab.rows and row not in candidates:
      candidates[row] = [None]  # nothing to tune: the fit alone
  for row, values in candidates.items():
    results = []
    for value in values:
      params = dict(base, **({row: value} if value is not None else {}))
      hits = {name: replay(row, part, cap, params, lab.design)['hit_rate']
              for name, part in (('first', first), ('second', second))}
      results.append((value, hits))
      table.append({'row': row, 'parameter': TUNABLE.get(row, 'fit only'), 'value': value,
                    'hit_rate_first_half': hits['first'], 'hit_rate_second_half': hits['second'],
                    'lru_first_half': base_hits['first'], 'lru_second_half': base_hits['second']})
    value, hits = max(results, key=lambda vh: vh[1]['first'])
    if value is not None:
      chosen[row] = value
    gain_first = hits['first'] - base_hits['first']
    gain_second = hits['second'] - base_hits['second']
    checks[row] = {'value': value, 'gain_first_half': gain_first,
                   'gain_second_half': gain_second,
                   'kept_share': gain_second / gain_first if gain_first > 0 else None,
                   'keeps_half': gain_first > 0 and gain_second >= 0.5 * gain_first}
  return chosen, table, checks


def add_comparisons(curves: list) -> None:
  """Regret against the optimum and the share of LRU's gap closed, per (row, capacity)."""
  by = {(c['row'], c['capacity_tokens']): c for c in curves}
  for c in curves:
    best = by[(OPTIMUM, c['capacity_tokens'])]['hit_rate']
    lru = by[(REFERENCE, c['capacity_tokens'])]['hit_rate']
    c['regret'] = best - c['hit_rate']
    c['gap_closed'] = (c['hit_rate'] - lru) / (best - lru) if best - lru > 1e-12 else None


def goals(config, curves: list, checks: dict) -> dict:
  """The lab's goals per online row: half of LRU's gap closed at gap_capacity, never below LRU
  at any capacity, and the tuning kept on the second half (tuned rows)."""
  cap = config.lab.gap_capacity
  by = {(c['row'], c['capacity_tokens']): c for c in curves}
  caps = sorted({c['capacity_tokens'] for c in curves})
  out = {}
  for row in dict.fromkeys(c['row'] for c in curves):
    if row == REFERENCE or row in OFFLINE:
      continue
    closed = by[(row, cap)]['gap_closed']
    never_worse = all(by[(row, k)]['hit_rate'] >= by[(REFERENCE, k)]['hit_rate'] - 1e-12
                      for k in caps)
    kept = checks.get(row, {}).get('keeps_half')
    met = closed is not None and closed >= 0.5 and never_worse and kept is not False
    out[row] = {'gap_closed_at_gap_capacity': closed, 'never_worse_than_lru': never_worse,
                'tuning_keeps_half': kept, 'met': met}
  return out


def write_tables(config, curves: list, workdir: str, tiers: list = ()) -> None:
  run_info.write_csv(os.path.join(workdir, 'curves.csv'), curves, CURVE_COLUMNS)
  if tiers:
    run_info.write_csv(os.path.join(workdir, 'tiers.csv'), tiers, TIER_COLUMNS)
  caps = sorted({c['capacity_tokens'] for c in curves})
  by = {(c['row'], c['capacity_tokens']): c for c in curves}
  rows = []
  for row in dict.fromkeys(c['row'] for c in curves):
    line = {'row': row}
    for k in caps:
      line[f'{k:.0e}'] = by[(row, k)]['hit_rate']
    line['gap_closed'] = by[(row, config.lab.gap_capacity)]['gap_closed']
    rows.append(line)
  columns = ['row'] + [f'{k:.0e}' for k in caps] + ['gap_closed']
  text = (f'Hit rate (prompt tokens served from cache / prompt tokens) by cache capacity '
          f'(tokens); gap_closed: share of LRU\'s gap to the optimum closed at '
          f'{config.lab.gap_capacity:.0e} tokens.\n\n' + run_info.markdown_table(rows, columns))
  if tiers:
    columns = ('arrangement', 'row', 'device_tokens', 'host_tokens', 'disk_tokens', 'hit_rate',
               'device_hit_rate', 'host_hit_rate', 'disk_hit_rate')
    text += ('\n\nTier arrangements (hit rate by the tier that served the block; sizes in '
             'tokens):\n\n' + run_info.markdown_table(tiers, columns))
  cli.write_table(workdir, text, echo=False)


def plot(config, curves: list, ceiling: float, workdir: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  rows = list(dict.fromkeys(c['row'] for c in curves))
  note = cli.variant_note(config) if hasattr(cli, 'variant_note') else ''
  palette = plt.get_cmap('tab10')
  colors = {row: 'black' if row == OPTIMUM else palette(i % 10) for i, row in enumerate(rows)}
  fig, ax = plt.subplots(figsize=(8, 5))
  for row in rows:
    pts = [c for c in curves if c['row'] == row]
    style = {'color': 'black', 'linewidth': 2.5} if row == OPTIMUM else {'color': colors[row]}
    ax.plot([c['capacity_tokens'] for c in pts], [c['hit_rate'] for c in pts], marker='o',
            markersize=3, label=row, **style)
  ax.axhline(ceiling, linestyle='--', color='grey', label='infinite cache')
  ax.set_xscale('log')
  ax.set_xlabel('cache capacity (tokens, log scale)')
  ax.set_ylabel('hit rate (prompt tokens served from cache / prompt tokens)')
  ax.set_title(f'Prefix-cache hit rate against capacity, Mooncake conversation trace{note}',
               fontsize=9)
  ax.grid(True, which='both', alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'hit_rate.png'), dpi=120)
  plt.close(fig)
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for row in rows:
    if row == OPTIMUM:
      continue
    pts = [c for c in curves if c['row'] == row]
    xs = [c['capacity_tokens'] for c in pts]
    a1.plot(xs, [c['regret'] for c in pts], marker='o', markersize=3, label=row,
            color=colors[row])
    if row != REFERENCE:
      a2.plot(xs, [c['gap_closed'] if c['gap_closed'] is not None else math.nan for c in pts],
              marker='o', markersize=3, label=row, color=colors[row])
  a1.set_ylabel('regret (optimum hit rate - policy hit rate)')
  a1.set_title(f'Regret against the offline optimum (Belady){note}', fontsize=9)
  a2.axhline(0.5, linestyle='--', color='grey', label='goal: half the gap')
  a2.axhline(0.0, color='black', linewidth=0.8)
  a2.set_ylim(-1.05, 1.05)  # far below LRU (a gap of a few tenths of a percent) is off the axis
  a2.set_ylabel("share of LRU's gap to the optimum closed (axis cut at -1)")
  a2.set_title(f"LRU's gap closed (1 = optimal, < 0 = worse than LRU){note}", fontsize=9)
  caps = [c['capacity_tokens'] for c in curves]
  if all(c['gap_closed'] is None for c in curves):  # the optimum is LRU at every capacity
    a2.text(0.5, 0.5, 'no gap: LRU is optimal at every capacity', ha='center',
            transform=a2.transAxes)
  for a in (a1, a2):
    a.set_xscale('log')
    a.set_xlim(min(caps) / 1.5, max(caps) * 1.5)
    a.set_xlabel('cache capacity (tokens, log scale)')
    a.grid(True, which='both', alpha=0.3)
    a.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'regret.png'), dpi=120)
  plt.close(fig)


def study(config, workdir: str) -> dict:
  lab = config.lab
  records = load(config)
  start, load_start = time.perf_counter(), os.getloadavg()
  phase_s, replays = {}, {}  # wall seconds and requests replayed, per phase

  def phase(name, began, requests):
    phase_s[name] = time.perf_counter() - began
    replays[name] = requests

  t0 = time.perf_counter()
  counted = counted_ceiling(records)
  replayed = replay(REFERENCE, records, math.inf, {}, lab.design)
  ceiling = {'counted_from_hash_ids': counted['hit_rate'], 'replayed': replayed['hit_rate'],
             'relative_difference': abs(replayed['hit_rate'] - counted['hit_rate']) /
                                    counted['hit_rate'] if counted['hit_rate'] else 0.0}
  distances = reuse_distances(records)
  phase('ceiling_and_reuse_distances', t0, len(records))
  cli.say(f"ceiling: counted {counted['hit_rate']:.4f}, replayed {replayed['hit_rate']:.4f}")
  half = len(records) // 2
  base, model = {}, None
  t0 = time.perf_counter()
  if any(row in FITTED for row in lab.rows):
    model = fit_return_model(records[:half])
    model['held_out'] = evaluate_return_model(records[half:], model)
    base[FIT] = model
    cli.say(f"return model: AUC {model['auc']:.3f} on the first half (fitted), "
            f"{model['held_out']['auc']:.3f} on the second")
  if any(row in HOLD_FITTED for row in lab.rows):
    base[HOLD] = retention_model.releases(records[:half])
  phase('fit', t0, len(records) if model else 0)
  t0 = time.perf_counter()
  tuned = lab.tune or any(row in FITTED + HOLD_FITTED for row in lab.rows)
  chosen, tuning, checks = tune(config, records, base) if tuned else ({}, [], {})
  phase('tune', t0, len(records) * (len(tuning) + 1))
  if tuning:
    run_info.write_csv(os.path.join(workdir, 'tuning.csv'), tuning)
    for row, c in checks.items():
      cli.say(f"tuned {row}: {TUNABLE.get(row, 'fit only')}={c['value']} gain first half "
              f"{c['gain_first_half']:+.4f}, second half {c['gain_second_half']:+.4f}")
  curves = []
  points = [(row, cap) for row in lab.rows for cap in lab.capacities]
  params = dict(base, **chosen)
  t0 = time.perf_counter()
  for row, cap in cli.progress(points, desc='policy lab', unit='point'):
    curves.append(replay(row, records, cap, params, lab.design))
  phase('curves', t0, len(records) * len(points))
  add_comparisons(curves)
  t0 = time.perf_counter()
  tiers = tier_study(config, records, params) if lab.tiers.capacities else []
  phase('tiers', t0, len(records) * len(tiers))
  t0 = time.perf_counter()
  bound = bound_study(config, records, curves) if lab.bound.capacities else []
  phase('bound', t0, len(records) * len(bound))
  if bound:
    run_info.write_csv(os.path.join(workdir, 'bound.csv'), bound, BOUND_COLUMNS)
    plot_bound(config, bound, curves, workdir)
  for row in lab.rows:
    line = ' '.join(f"{c['hit_rate']:.3f}" for c in curves if c['row'] == row)
    cli.say(f'  {row:16s} {line}')
  write_tables(config, curves, workdir, tiers)
  wall_s = time.perf_counter() - start
  replayed_points = curves + tiers
  summary = {
      'curves': curves, 'ceiling': ceiling, 'tuned': chosen, 'tuning': tuning,
      'return_model': model, 'tiers': tiers, 'bound': bound, 'reuse_distances': distances,
      'depth_edges_blocks': list(DEPTH_EDGES),
      'tuning_checks': checks, 'goals': goals(config, curves, checks),
      'continuation_by_turn': continuation(records),
      'requests': len(records), 'prompt_tokens': counted['prompt_tokens'],
      # host time inside the replays of the curves and tier points, per request replayed
      'host_us_per_request': 1e6 * sum(c['host_s'] for c in replayed_points) / (
          len(records) * len(replayed_points)) if records and replayed_points else None,
      'host_us_per_request_by_row': {
          row: 1e6 * sum(c['host_s'] for c in curves if c['row'] == row) / (
              len(records) * len(lab.capacities)) for row in lab.rows} if records else {},
      'phase_s': phase_s, 'requests_replayed_by_phase': replays,
      'wall_s': wall_s, 'requests_replayed': sum(replays.values()),
      'wall_us_per_request_replayed': 1e6 * wall_s / max(sum(replays.values()), 1),
      'load_average_start': load_start, 'load_average_end': os.getloadavg(),
      'timing_note': 'wall time of this process on a shared machine: a figure under load',
      **run_info.summary_fields(config)}
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  plot(config, curves, ceiling['replayed'], workdir)
  plot_explanations(config, curves, distances, workdir)
  if tiers:
    plot_tiers(config, tiers, workdir)
  met = [row for row, g in summary['goals'].items() if g['met']]
  print(f"{len(records)} requests, {summary['requests_replayed']} replayed in {wall_s:.1f} s "
        f"({summary['wall_us_per_request_replayed']:.0f} us wall per request replayed, "
        f"{summary['host_us_per_request']:.0f} us host time per request inside the replays; "
        + ', '.join(f'{k} {v:.0f} s' for k, v in phase_s.items()) +
        f"); goal met by: {', '.join(met) or 'none'}")
  return summary


def plot_explanations(config, curves: list, distances: dict, workdir: str) -> None:
  """reuse.png: the LRU stack distance of the trace's reusable reads (first / later turns),
  cumulative, with the study's capacities; and hits by block depth at gap_capacity for LRU,
  the best online row there and the optimum."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  note = cli.variant_note(config)
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
  edges = distances['edges_tokens']
  for kind in ('first_turn', 'later_turn'):
    counts = distances[kind]
    total = sum(counts)
    if not total:
      continue
    cum = list(itertools.accumulate(counts[:-1]))
    a1.plot(edges, [c / total for c in cum], marker='o', markersize=3,
            label=f"{kind.replace('_', ' ')} reads ({total:,} blocks)")
  for cap in config.lab.capacities:
    a1.axvline(cap, color='grey', linewidth=0.6, linestyle=':')
  a1.set_xscale('log')
  a1.set_xlabel('LRU stack distance (distinct tokens used since the last use, log scale)')
  a1.set_ylabel('share of reusable reads within that distance')
  a1.set_title(f'Reuse distance of the trace (dotted: capacities studied){note}', fontsize=9)
  a1.grid(True, which='both', alpha=0.3)
  a1.legend(fontsize=8)
  cap = config.lab.gap_capacity
  at = {c['row']: c for c in curves if c['capacity_tokens'] == cap}
  online = [r for r in at if r not in OFFLINE and r != REFERENCE]
  best = max(online, key=lambda r: at[r]['hit_rate']) if online else None
  shown = [r for r in (REFERENCE, best, 'reuse_oracle', OPTIMUM) if r in at]
  labels = [f'{lo}' if hi - lo == 1 else f'{lo}-{hi - 1}' for lo, hi in
            zip(DEPTH_EDGES, DEPTH_EDGES[1:])] + [f'{DEPTH_EDGES[-1]}+']
  width = 0.8 / max(len(shown), 1)
  for k, row in enumerate(shown):
    prompt = at[row]['prompt_tokens']
    a2.bar([x + k * width for x in range(len(labels))],
           [h * BLOCK / prompt for h in at[row]['hits_by_depth']], width, label=row)
  a2.set_xticks([x + width * (len(shown) - 1) / 2 for x in range(len(labels))])
  a2.set_xticklabels(labels)
  a2.set_xlabel('block depth in the prompt (512-token blocks)')
  a2.set_ylabel('hit tokens at that depth / prompt tokens')
  a2.set_title(f'Hits by block depth at {cap:.0e} tokens{note}', fontsize=9)
  a2.grid(True, axis='y', alpha=0.3)
  a2.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'reuse.png'), dpi=120)
  plt.close(fig)


if __name__ == '__main__':
  cli.run_study('configs/policy_lab.py', 'Policy lab config.', study, check=check)
