"""Prefix caching across requests: a hash chain over full blocks, with evictable cached blocks.

Each full block of a sequence gets a key: hash(parent block's key, its block_size token ids,
cache salt). The salt enters only the first block's key, and the chain carries it to every later
one, so requests with different salts (tenants that must not share) never match each other.
The key covers the whole prefix, so a hit on block i means blocks 0..i are equal too; only
full blocks are keyed, because a partly filled block is still being written. Keys are 64-bit
BLAKE2b digests of a canonical encoding of that content (`content_bytes`), so they are the same
in every process (a disk tier, host/tiers/disk_store.py, finds its blocks again after a restart; Python's
hash() of a str or None changes from one process to the next). 64 bits are not
collision-resistant (token ids can be chosen to collide), so every entry also keeps the content
it was keyed on (parent key, token ids, salt) and a hit counts only when that content equals the
query's: a collision costs a miss, never another prefix's K/V. Lookups walk a prompt's blocks in
order and stop at the first miss, so a hit on block i has had blocks 0..i-1 verified too.

Holders and reference counts (allocator.py): a block's ref count is the number of *sequences*
whose block table holds it. A cache entry is not a holder: when the last sequence drops a
cached block, the block is neither free nor held but *evictable*: its K/V stay valid, a later
prompt with the same prefix takes it back (ref count 0 -> 1), and the allocator evicts one
(dropping its entry) only when its free list is empty. Evictable blocks count as free space.

Eviction: the evictable blocks are an EvictionQueue (host/policies.py), the policy's order, told
of every admission, hit, release and eviction; config.prefix_cache.eviction names it ('lru',
'lfu', ... or 'package.module:Class'). 'lru' evicts the block released longest ago; 'lfu' the one
with the fewest hits, least recently used first among equals; a lazy heap keeps both O(log n)
per operation. Blocks of a session (sessions.py) go by their session instead: the whole session
at its last turn's end (lru), or with its turn count in place of hits (lfu).

Pinning: `pin(token_ids, salt)` keeps the full blocks of a prefix (a system prompt, a RAG
document, an agent scaffold) on the device: a pinned block no sequence holds is *pinned idle*,
neither free nor evictable, until `unpin`. A pin covers a whole prefix, so every pinned block's
ancestors are pinned too (the radix tree's leaves-first eviction stays possible). Pins are
counted in blocks against `pin_budget` (config tiers.pinned_blocks); a pin beyond it raises
PinError and pins nothing. A key pinned before its block is cached is pinned once it is. The ids
are checked as a prompt is (intake.prompt_ids: ints in the vocabulary, which the engine sets as
`vocab_size`; a prefix shorter than a block pins nothing); bad ones raise RequestError. Pins hold
`lock`, which the engine sets to its own, so they are safe beside other threads' engine calls.

Lower tiers (host/tiers/kv_tiers.py): a cache may have `lower` tiers attached (host RAM, disk). It then
tells them when it evicts a block (`lower.evicted`: write-back, the block is demoted instead of
dropped) and when it caches a newly filled one (`lower.cached`: write-through); the block
manager continues a prefix lookup past the device hits into them.
"""
import array
import hashlib
import struct
import threading
from typing import Dict, List, Optional, Sequence as Seq, Tuple

from pagedjax.host import kv_events
from pagedjax.host import policies
from pagedjax.host.requests.intake import RequestError, prompt_ids
from pagedjax.host.requests.sampling_params import brief, is_text
from pagedjax.host.cache import native_keys
from pagedjax.host.cache.sessions import Sessions

DESIGNS = ('hash', 'radix')  # radix: radix_cache.py


class PinError(ValueError):
  """A pin that would exceed the pinned budget (or an unpin of a prefix not pinned)."""


def block_content(parent: Optional[int], tokens: Seq[int], salt=None) -> Tuple:
  """What one full block's key stands for: its parent's key, its token ids and (first block
  only) the salt."""
  return (parent, tuple(tokens), salt if parent is None else None)


def content_bytes(parent: Optional[int], tokens: Seq[int], salt=None) -> bytes:
  """A canonical, injective byte encoding of block_content(parent, tokens, salt), the same in
  every process: the parent key, or for a first block its salt (length-prefixed, so no salt and
  token ids can spell another's), then the token ids as int64."""
  if parent is not None:
    head = b'P' + parent.to_bytes(8, 'little')
  elif salt is not None:
    encoded = salt.encode('utf-8')
    head = b'S' + len(encoded).to_bytes(4, 'little') + encoded
  else:
    head = b'N'
  return head + array.array('q', tokens).tobytes()


def block_key(parent: Optional[int], tokens: Seq[int], salt=None) -> int:
  """The chain key of one full block: a 64-bit BLAKE2b digest of its content_bytes."""
  digest = hashlib.blake2b(content_bytes(parent, tokens, salt), digest_size=8).digest()
  return int.from_bytes(digest, 'little')


def chain_keys(token_ids: Seq[int], block_size: int, num_full_blocks: int, salt=None,
               parent: Optional[int] = None, start: int = 0) -> List[int]:
  """Keys of full blocks start..num_full_blocks-1 of token_ids, continuing from `parent`:
  block_key of each block in turn, by the C module where it builds (native_keys.py), else by
  chain_keys_python; tests/test_cluster_routing.py checks both against block_key."""
  if num_full_blocks <= start:
    return []
  native = native_keys.chain_keys_fn()
  if native is None:
    return chain_keys_python(token_ids, block_size, num_full_blocks, salt, parent, start)
  return native(token_ids, start * block_size, num_full_blocks - start, block_size,
                content_bytes(parent, (), salt))


def chain_keys_python(token_ids: Seq[int], block_size: int, num_full_blocks: int, salt=None,
                      parent: Optional[int] = None, start: int = 0) -> List[int]:
  """chain_keys in one Python pass: the blocks' token ids packed as native int64s at once
  (array.array('q')'s bytes), each key's 8 digest bytes reused as its child's parent encoding;
  2-3x faster than block_key per block."""
  if num_full_blocks <= start:
    return []
  ids = token_ids[start * block_size:num_full_blocks * block_size]
  raw = memoryview(struct.pack(f'{len(ids)}q', *ids))  # content_bytes' int64s, all at once
  step, blake2b, from_bytes = block_size * 8, hashlib.blake2b, int.from_bytes
  head = content_bytes(parent, (), salt)  # the first block's parent (or salt) encoding
  keys = []
  for i in range(0, (num_full_blocks - start) * step, step):
    digest = blake2b(head + raw[i:i + step], digest_size=8).digest()
    keys.append(from_bytes(digest, 'little'))
    head = b'P' + digest  # content_bytes' parent encoding: the key's 8 little-endian bytes
  return keys


def sequence_keys(seq, n: int, block_size: int) -> List[int]:
  """Chain keys of a sequence's first n full blocks, kept on it (Sequence.block_keys: its
  tokens only ever grow), so every cache and index of an engine computes each key once."""
  have = len(seq.block_keys)
  if have < n:
    parent = seq.block_keys[-1] if have else None
    seq.block_keys += chain_keys(seq.all_ids, block_size, n, seq.params.cache_salt, parent,
                                 have)
  return seq.block_keys[:n]


def sequence_block_content(seq, keys: List[int], i: int, block_size: int) -> Tuple:
  """block_content() of a sequence's full block i, given the chain keys of its blocks 0..i-1."""
  tokens = seq.all_ids[i * block_size:(i + 1) * block_size]
  return block_content(keys[i - 1] if i else None, tokens, seq.params.cache_salt)


class CacheBase:
  """What both designs share: the evictable set under a policy, and the hit figures.

  A design implements match(seq, n) (blocks of seq's longest cached prefix among its first n
  full blocks), offer(seq, n) (cache seq's blocks num_offered..n-1, just filled), __len__,
  is_cached(block), entry(block) (its key and content), block_of(key) (the cached block of a
  chain key, or None), _can_evict(block) and _drop(block) (forget a victim's entry), and calls
  _cached(block, key, content, depth) for each new entry.

  eviction: a policy name or 'module:Class' (policies.EVICTION), or an EvictionQueue instance."""

  def __init__(self, block_size: int, eviction='lru'):
    self.block_size = block_size
    self.eviction = policies.eviction_name(eviction)
    self.queue = policies.eviction_queue(eviction)  # the evictable blocks, in the policy's order
    # Figures (metrics): per admission lookup, and evictions.
    self.queried_blocks = self.hit_blocks = 0
    self.queried_tokens = self.hit_tokens = 0
    self.evictions = 0
    self.lower = None  # the lower tiers (kv_tiers.KVTiers), when attached
    self.pin_budget = 0  # most blocks pinned at once
    self._pins: Dict[int, int] = {}  # chain key -> pins holding it
    self._pinned_idle: set = set()  # cached blocks no sequence holds, kept by a pin
    self.vocab_size: Optional[int] = None  # token ids pin() takes: 0..vocab_size-1 (None: >= 0)
    self.lock = threading.RLock()  # pins hold it (the engine's, in an engine)
    self.sessions = None  # sessions.Sessions, when the engine keeps them
    self.events = kv_events.KVEvents(block_size)  # what is stored and dropped (kv_events.py)

  @property
  def num_evictable(self) -> int:
    return len(self.queue)

  @property
  def num_pinned_idle(self) -> int:
    return len(self._pinned_idle)

  def is_evictable(self, block: int) -> bool:
    return block in self.queue

  def is_idle(self, block: int) -> bool:
    """Cached and held by no sequence: evictable, or kept by a pin."""
    return block in self.queue or block in self._pinned_idle

  def pin(self, token_ids, salt=None) -> List[int]:
    """Pins the full blocks of token_ids (with this cache salt); returns their chain keys."""
    with self.lock:
      return self._pin(self._pin_keys(token_ids, salt))

  def _pin_keys(self, token_ids, salt) -> List[int]:
    """Chain keys of a pin's full blocks, or RequestError naming what is wrong."""
    ids = prompt_ids(token_ids, self.vocab_size, 'token_ids')
    if salt is not None and not is_text(salt):
      raise RequestError(f'salt={brief(salt)} is not allowed: None or a string (the cache_salt '
                         'of the requests the prefix serves)')
    return chain_keys(ids, self.block_size, len(ids) // self.block_size, salt)

  def _pin(self, keys: List[int]) -> List[int]:
    new = {k for k in keys if k not in self._pins}
    if len(self._pins) + len(new) > self.pin_budget:
      raise PinError(f'pinning {len(keys)} blocks ({len(new)} not pinned yet) would exceed the '
                     f'pinned budget: {len(self._pins)} of {self.pin_budget} blocks are pinned '
                     '(config tiers.pinned_blocks); unpin a prefix first')
    for key in keys:
      self._pins[key] = self._pins.get(key, 0) + 1
      block = self.block_of(key)
      if block is not None and self.queue.discard(block):
        self._pinned_idle.add(block)
    return keys

  def unpin(self, token_ids, salt=None) -> None:
    """Undoes one pin(token_ids, salt); blocks no other pin keeps become evictable."""
    with self.lock:
      self._unpin(self._pin_keys(token_ids, salt))

  def _unpin(self, keys: List[int]) -> None:
    if any(k not in self._pins for k in keys):
      raise PinError('unpin of a prefix that is not pinned')
    for key in reversed(keys):  # tail first, as deallocate releases blocks
      self._pins[key] -= 1
      if not self._pins[key]:
        del self._pins[key]
        block = self.block_of(key)
        if block in self._pinned_idle:
          self._pinned_idle.discard(block)
          self.release(block)

  def evictable_blocks(self) -> List[int]:
    return self.queue.keys()

  def record_lookup(self, queried_blocks: int, hit_blocks: int, queried_tokens: int) -> None:
    self.queried_blocks += queried_blocks
    self.hit_blocks += hit_blocks
    self.queried_tokens += queried_tokens
    self.hit_tokens += hit_blocks * self.block_size

  def keys(self, seq, n: int) -> List[int]:
    return sequence_keys(seq, n, self.block_size)

  def content(self, seq, keys: List[int], i: int) -> Tuple:
    return sequence_block_content(seq, keys, i, self.block_size)

  def _cached(self, block: int, key: int, content: Tuple, depth: int) -> None:
    """A new entry, at block index `depth` of its prompt: the eviction policy learns of it, and
    the lower tiers may copy it down now (write-through)."""
    self.queue.add(block, depth, key)
    if self.events:  # someone listens (kv_events.py)
      self.events.stored(kv_events.MEDIUM_GPU, key, content)
    if self.lower is not None:
      self.lower.cached(block, key, content)

  def touch(self, block: int) -> None:
    """A hit: the block is taken by a sequence (leaving the evictable set if it was there)."""
    self.queue.hit(block)
    self.queue.discard(block)
    self._pinned_idle.discard(block)

  def release(self, block: int) -> None:
    """The last sequence dropped this cached block: it becomes evictable (pinned idle if a pin
    keeps it)."""
    if self._pins and self.entry(block)[0] in self._pins:
      self._pinned_idle.add(block)
      return
    self.queue.push(block, self.sessions.order(block) if self.sessions is not None else None)

  def end_turn(self, session: str, blocks: List[int], now: float) -> None:
    """A turn of `session` finished holding `blocks`: its cached ones become the session's
    (called before they are released, so they are queued by the session's order)."""
    self.sessions.end_turn(session, [b for b in blocks if self.is_cached(b)], self.queue.tick(),
                           now)

  def idle_session_blocks(self, now: float) -> List[Tuple[str, List[int]]]:
    """(session, its evictable blocks in eviction order) for each session idle too long."""
    if self.sessions is None:
      return []
    return [(session, self.queue.ranked(self.sessions.blocks(session)))
            for session in self.sessions.idle(now)]

  def _requeue(self, block: int) -> None:
    """An evictable block the policy passed over (_can_evict) may go now."""
    self.queue.requeue(block)

  def evict(self) -> int:
    """Drops the policy's victim from the cache and returns its block (now free to reuse)."""
    block = self.queue.pop(self._can_evict)
    if block is None:
      raise RuntimeError('no evictable block')
    self._evict_entry(block)
    return block

  def evict_block(self, block: int) -> bool:
    """Drops an evictable block's entry now (demoting it when lower tiers exist); False when
    the design must keep it for now (radix: it still has children)."""
    if block not in self.queue:
      raise KeyError(f'block {block} is not evictable')
    if not self._can_evict(block):
      return False
    self._evict_entry(block)
    return True

  def _evict_entry(self, block: int) -> None:
    """Drops an evictable block's entry (one pop() just took, or evict_block's)."""
    self.queue.remove(block)
    if self.lower is not None:  # write-back: demoted (copied down) rather than dropped
      self.lower.evicted(block, *self.entry(block))
    if self.sessions is not None:
      self.sessions.forget(block)
    if self.events:
      self.events.removed(kv_events.MEDIUM_GPU, self.entry(block)[0])
    self._drop(block)
    self.evictions += 1

  def figures(self) -> dict:
    return {
        'prefix_hit_rate_tokens': self.hit_tokens / self.queried_tokens
                                  if self.queried_tokens else None,
        'prefix_hit_rate_blocks': self.hit_blocks / self.queried_blocks
                                  if self.queried_blocks else None,
        'prefix_hit_tokens': self.hit_tokens, 'prefix_queried_tokens': self.queried_tokens,
        'prefix_hit_blocks': self.hit_blocks, 'prefix_queried_blocks': self.queried_blocks,
        'prefix_cache_evictions': self.evictions, 'prefix_cached_blocks': len(self),
        'prefix_pinned_blocks': len(self._pins),
        **(self.sessions.figures() if self.sessions is not None else {}),
        **(self.lower.figures() if self.lower is not None else {}),
    }


class PrefixCache(CacheBase):
  """The hash-chain design: key -> block for full blocks whose K/V are in the pool."""

  def __init__(self, block_size: int, eviction='lru'):
    super().__init__(block_size, eviction)
    self._block_of: Dict[int, int] = {}  # key -> block
    self._key_of: Dict[int, int] = {}  # block -> key
    self._content_of: Dict[int, Tuple] = {}  # block -> block_content() it was keyed on

  def __len__(self) -> int:
    return len(self._block_of)

  def is_cached(self, block: int) -> bool:
    return block in self._key_of

  def lookup(self, key: int) -> Optional[int]:
    return self._block_of.get(key)

  block_of = lookup  # the cached block of a chain key, or None

  def entry(self, block: int) -> Tuple[int, Tuple]:
    return self._key_of[block], self._content_of[block]

  def match(self, seq, n: int) -> List[int]:
    blocks = []
    keys = self.keys(seq, n)
    for i, key in enumerate(keys):
      block = self._block_of.get(key)
      # A miss, or a hash collision with another prefix, ends the prefix.
      if block is None or self._content_of[block] != self.content(seq, keys, i):
        break
      blocks.append(block)
    return blocks

  def offer(self, seq, n: int) -> None:
    keys = self.keys(seq, n)
    for i in range(seq.num_offered, n):
      self.insert(keys[i], seq.block_table[i], self.content(seq, keys, i), i)

  def insert(self, key: int, block: int, content: Tuple, depth: int = 0) -> bool:
    """Caches a held, just-filled block keyed on `content` (block_content()), block `depth` of
    its prompt; False when the
    key already names another block (two sequences computed the same prefix at once: the first
    one keeps the entry; or a collision: the first content keeps it)."""
    if key in self._block_of or block in self._key_of:
      return False
    self._block_of[key] = block
    self._key_of[block] = key
    self._content_of[block] = content
    self._cached(block, key, content, depth)
    return True

  def _can_evict(self, block: int) -> bool:
    return True  # a key covers its whole prefix: an entry stays valid after its parent goes

  def _drop(self, block: int) -> None:
    del self._block_of[self._key_of.pop(block)]
    del self._content_of[block]


def make_prefix_cache(config, block_size: int) -> Optional[CacheBase]:
  """The cache a PrefixCacheConfig asks for (design 'hash' here, 'radix' radix_cache.py), with
  its sessions (sessions.py), or None when prefix caching is off."""
  if not config.enabled:
    return None
  from pagedjax.host.cache.radix_cache import RadixCache  # pylint: disable=import-outside-toplevel
  design = {'hash': PrefixCache, 'radix': RadixCache}[config.design]
  cache = design(block_size, config.eviction)
  cache.sessions = Sessions(config.session_idle_s)
  return cache
