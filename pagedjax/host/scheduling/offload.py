"""Offload: one more placement a block can have, for contexts longer than the device.

A sequence served with offload (`seq.window` = W > 0, config.offload.device_blocks) holds at
most W device blocks: its newest logical blocks. Its older blocks live in host RAM, in logical
order (`seq.host_table`: host block i holds positions [i * bs, (i + 1) * bs)), and stream
through attention every step, C blocks per call (model/streamed_attention.py), inside the
engine's own iterations while its other requests run in the batched steps. Before a step would
write past the window, `make_room` moves the window's oldest blocks out: it lists (device
block, host block) pairs in `Plan.offload_out`, and the executor copies them out in one gather
before the iteration writes anything (as it does swap-outs), so the device block is free for
anyone from the moment it is planned. Only fully written blocks move: a prompt chunk is cut to
what the window holds from the first block not fully written on (`chunk_room`), so any W >= 1
works; a window smaller than a chunk's blocks just makes that prompt's chunks shorter.

Which sequences are offloaded (the policy, config.offload):
  at submit       a request whose blocks can never all fit the pool (host/requests/intake.py)
                  is served with a window instead of refused, up to what the offload store
                  holds, host RAM plus the disk tier (`refusal`: a RequestError beyond that).
  under pressure  with `instead_of_preempting`, a decode that finds the pool out of blocks
                  first shrinks the running sequence holding the most blocks beyond W to its
                  newest W (`relieve`), and preempts only when none can be shrunk.
A sequence with a window but no host block yet (a long prompt's first W blocks) runs in the
batched steps like any other; it moves to the streamed path with its first host block.

Host room. The store (host/scheduling/offload_store.py) holds `host_blocks` blocks in host RAM
and `disk_blocks` on the disk tier, the pool's per-block arrays in both, so codes and scales
exactly as the device stores them; `placement` says which tier a block moving out goes to
first. A sequence reserves, at admission, the host blocks it can come to need: its longest
length's blocks beyond W, plus, for each parallel sample it will fork, the blocks of
max_new_tokens and one (a fork shares the leader's host blocks; each block its window moves
out after the fork is its own). A beam group (one request id) holds one reservation for all
its beams: the leader's own blocks plus, per other beam, the larger of a fork's and the
leader's own (back from a recompute, beams share nothing), less the blocks its beams hold; a
dropped beam's blocks that no other beam holds go back to it. Admission waits for room, so a
running sequence never finds the store full. ("Host blocks" means the offloaded ones,
whichever tier holds them.)

Sharing. Forks and beams share their parent's host blocks (ref counts) and device blocks (the
block manager's copy-on-write). A beam group decodes together, each beam in up to W device
blocks, so `refusal` asks beam_width * W to fit the pool.

Prefix caching (prefix_cache.enabled with offload.cache_blocks; offload_index.py). Offloaded
blocks join the cache: each block moving out of a window is indexed by its chain key, and when
a sequence finishes, the full blocks its window still holds are copied out beside them
(`keep_window`, in the next plan's offload_out), as far as the store has room no reservation
needs. A sequence admitted with a window looks its prompt up there first: when the indexed
prefix is longer than the device cache's, it takes those blocks as its leading host blocks
(`adopt`: they count against its reservation) and prefills only the rest; a follow-up turn over
a long document, or a long sequence back from a recompute, prefills only its new tokens. Blocks
only the index holds are idle: free room for reservations, evicted in the prefix cache's
eviction order when a block moving out finds no free one. The device caches still see an
offloaded sequence's blocks only while it has no host block (both index a sequence's blocks
from its first one), and an ordinary (unwindowed) request does not look in the store.
Preemption: an offloaded sequence is never swapped; recompute frees its host blocks and, back
in the queue, it is offloaded again on readmission (a beam group with all its beams).
Lane state (KIVI key tails, recent-window rings; device/kv_schemes.py) stays in the sequence's
lane on the device: only full blocks move out, and they hold their final codes.
"""
import collections
import math
from typing import Dict, List, Optional, Sequence as Seq

import numpy as np

from pagedjax.host.scheduling.offload_index import OffloadIndex
from pagedjax.host.scheduling.offload_store import OffloadStore
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.requests.sequence import Sequence


class Offload:
  """The offload policy and its bookkeeping (module docstring). `blocks` is the engine's
  BlockManager: device blocks moved out are freed through its allocator."""

  def __init__(self, block_array_shapes, blocks, *, host_blocks: int, device_blocks: int,
               chunk_blocks: int, instead_of_preempting: bool, max_seq_len: int,
               disk_blocks: int = 0, disk_kvstore: str = '', placement: str = 'host',
               decode_every: int = 1, prefix_cache_eviction: Optional[str] = None,
               join_decodes: bool = True):
    """prefix_cache_eviction: the prefix cache's eviction policy when the engine caches
    prefixes and offloaded blocks join them (offload.cache_blocks): their index's idle blocks
    go in its order (offload_index.py); None = no index."""
    self.store = OffloadStore(block_array_shapes, host_blocks, disk_blocks, disk_kvstore,
                              placement)
    self.allocator = self.store.allocator  # offload block ids (both tiers) and ref counts
    self.index = (OffloadIndex(self.allocator, blocks.block_size, prefix_cache_eviction)
                  if prefix_cache_eviction is not None else None)
    # (device block, host block) copies of finished windows' blocks (keep_window), for the
    # next plan's offload_out
    self.pending_out: List[tuple] = []
    self.blocks, self.block_size = blocks, blocks.block_size
    self.host_blocks, self.disk_blocks, self.placement = host_blocks, disk_blocks, placement
    self.capacity = host_blocks + disk_blocks
    self.window, self.chunk_blocks = device_blocks, chunk_blocks
    self.instead_of_preempting, self.max_seq_len = instead_of_preempting, max_seq_len
    # config.offload.decode_every; a caller may change it between iterations (resting)
    self.decode_every = decode_every
    # config.offload.join_decodes: ordinary decode rows join the streamed decode batch
    # (executor.py `_joining`); a caller may change it between iterations
    self.join_decodes = join_decodes
    self._owed: Dict[int, int] = {}  # request id -> host blocks reserved, not yet taken
    self._beams: Dict[int, int] = {}  # a beam group's request id -> its members holding it
    self.counters = collections.Counter()

  @classmethod
  def from_config(cls, block_array_shapes, blocks, off, max_seq_len: int,
                  prefix_cache=None) -> 'Offload':
    """From config.offload (pagedjax/config.py OffloadConfig), validated; prefix_cache: the
    config's PrefixCacheConfig (offloaded blocks are indexed when it and cache_blocks are on)."""
    cached = prefix_cache is not None and prefix_cache.enabled and off.cache_blocks
    return cls(block_array_shapes, blocks, host_blocks=off.host_blocks,
               device_blocks=off.device_blocks, chunk_blocks=off.chunk_blocks,
               instead_of_preempting=off.instead_of_preempting, max_seq_len=max_seq_len,
               disk_blocks=off.disk_blocks, disk_kvstore=off.disk_kvstore,
               placement=off.placement, decode_every=off.decode_every,
               prefix_cache_eviction=prefix_cache.eviction if cached else None,
               join_decodes=off.join_decodes)

  def resting(self, running: List[Sequence], iteration: int) -> List[Sequence]:
    """The offloaded sequences that sit this iteration out (`decode_every`): every one that
    streams, on all iterations but one in decode_every, so that they stream together in one
    call (beams and forks in step); none while nothing else runs."""
    if self.decode_every == 1 or iteration % self.decode_every == 0:
      return []
    streaming = [s for s in running if s.host_table]
    return streaming if len(streaming) < len(running) else []

  # ---- what a request needs --------------------------------------------------------------

  def _longest(self, prompt_len: int, params: SamplingParams) -> int:
    return min(prompt_len + params.max_new_tokens, self.max_seq_len)

  def host_need(self, prompt_len: int, params: SamplingParams) -> int:
    """Host blocks a request of this prompt length can come to hold, its forks included. A
    beam group's k beams hold at most the leader's own blocks plus, for each other beam, those
    its window moves out after it forks, or, back from a recompute (when the beams share
    nothing), k copies of their own."""
    own = max(0, math.ceil(self._longest(prompt_len, params) / self.block_size) - self.window)
    if params.beam_width > 1:
      return own + (params.beam_width - 1) * max(own, self._fork_need(params))
    return own + (params.n - 1) * self._fork_need(params)

  def _fork_need(self, params: SamplingParams) -> int:
    return math.ceil(params.max_new_tokens / self.block_size) + 1

  def refusal(self, prompt_len: int, params: SamplingParams) -> Optional[str]:
    """Why a request that can never fit the pool cannot be offloaded either, or None."""
    pool = self.blocks.allocator.num_blocks - 1
    if params.beam_width * self.window > pool:  # beams run together, each with its window
      return (f'beam_width={params.beam_width}: a beam group decodes together, each beam '
              f'holding up to offload.device_blocks={self.window} device blocks, but '
              f'{params.beam_width} x {self.window} is more than the pool\'s {pool}: it can '
              'never fit')
    need = self.host_need(prompt_len, params)
    if need > self.capacity:
      samples = (f' for beam_width={params.beam_width} beams' if params.beam_width > 1 else
                 f' for n={params.n} samples' if params.n > 1 else '')
      room = (f'offload.host_blocks is {self.capacity}' if not self.disk_blocks else
              f'offload.host_blocks + offload.disk_blocks is {self.host_blocks} + '
              f'{self.disk_blocks} = {self.capacity} (host RAM and the disk tier)')
      return (f'request needs up to {need} host blocks of {self.block_size} tokens{samples} '
              f'beyond the {self.window} it keeps on the device (offload.device_blocks; '
              f'{self._longest(prompt_len, params)} tokens), but {room}: it can never fit')
    return None

  # ---- reservations ----------------------------------------------------------------------

  @property
  def _room(self) -> int:
    """Host blocks no sequence holds: free, or idle in the prefix index (evictable)."""
    return self.allocator.num_free + (self.index.num_idle if self.index is not None else 0)

  @property
  def available(self) -> int:
    """Host blocks neither held by a sequence nor reserved."""
    return self._room - sum(self._owed.values())

  def _allocate(self) -> int:
    """One host block for a block moving out: a free one, else the index's idle victim's."""
    if not self.allocator.num_free:
      victim = self.index.evict() if self.index is not None else None
      if victim is None:  # reservations rule this out
        raise RuntimeError(f'offload store full ({self.capacity} blocks)')
      # a copy into it not made yet is void
      self.pending_out = [(d, h) for d, h in self.pending_out if h != victim]
    (host,) = self.allocator.allocate(1)
    return host

  def _need_now(self, seq: Sequence) -> int:
    if seq.beam is not None:  # the whole group's, whichever beams it has now
      return self.host_need(len(seq.prompt_ids), seq.params)
    own = max(0, self.blocks.blocks_for(
        self._longest(len(seq.prompt_ids), seq.params)) - seq.window)
    return own + len(seq.forks) * self._fork_need(seq.params)

  def can_reserve(self, seq: Sequence) -> bool:
    if seq.beam is not None and seq.request_id in self._beams:
      return True  # its group holds the reservation already
    return self._need_now(seq) <= self.available

  def reserve(self, seq: Sequence) -> None:
    """seq, admitted now, reserves the host blocks it (and its pending forks) can come to need.
    The beams of a group (one request id) share one reservation: the group's need less the
    blocks its beams hold, kept so as beams fork, move blocks out and are dropped."""
    if seq.beam is not None:
      if seq.request_id not in self._beams:
        self._owed[seq.request_id] = self._need_now(seq)
      self._beams[seq.request_id] = self._beams.get(seq.request_id, 0) + 1
      return
    self._owed[seq.request_id] = self._need_now(seq)

  def fork(self, parent: Sequence, child: Sequence) -> None:
    """child (a parallel sample or a beam, just forked by the block manager) shares parent's
    host blocks; a sample takes its share of parent's reservation, a beam shares its group's."""
    for b in parent.host_table:
      self.allocator.share(b)
    child.host_table, child.window = list(parent.host_table), parent.window
    if parent.beam is not None:
      self._beams[parent.request_id] += 1
      return
    share = min(self._fork_need(parent.params), self._owed.get(parent.request_id, 0))
    self._owed[parent.request_id] = self._owed.get(parent.request_id, 0) - share
    self._owed[child.request_id] = share

  def release(self, seq: Sequence, plan=None) -> None:
    """seq finished or was preempted: its host blocks and reservation go (a beam's blocks
    that no other beam holds go back to its group's reservation, which goes with the group's
    last beam). With the plan of this iteration, moves into blocks freed now are dropped
    (nothing will read them)."""
    room_before = self._room
    self.allocator.free(seq.host_table)
    if self.index is not None:  # tail first: a prefix's later blocks become idle first
      self.index.released(seq.host_table[::-1])
    seq.host_table = []
    if seq.beam is not None and self._beams.get(seq.request_id, 0) > 1:
      self._beams[seq.request_id] -= 1
      self._owed[seq.request_id] += self._room - room_before
    else:
      self._owed.pop(seq.request_id, None)
      self._beams.pop(seq.request_id, None)
    if plan is not None and plan.offload_out:
      plan.offload_out = [(d, h) for d, h in plan.offload_out if self.allocator.ref_count(h)]

  # ---- moving blocks out -----------------------------------------------------------------

  def chunk_room(self, seq: Sequence) -> int:
    """Tokens seq's next step may feed: what its window holds from its first block not fully
    written on (all older blocks can move out)."""
    bs = self.block_size
    return (seq.num_cached // bs + seq.window) * bs - seq.num_cached

  def make_room(self, seq: Sequence, num_tokens: int, plan) -> None:
    """Moves seq's oldest device blocks to host RAM until the blocks holding its first
    num_tokens tokens, the ones not on the host, fit its window."""
    bs = self.block_size
    last = (num_tokens - 1) // bs  # logical block of the last token written
    have = len(seq.host_table) + len(seq.block_table)  # logical blocks placed so far
    excess = len(seq.block_table) + max(0, last + 1 - have) - seq.window
    for _ in range(excess):
      self._move_out(seq, plan)

  def _move_out(self, seq: Sequence, plan) -> None:
    logical = len(seq.host_table)
    if logical >= seq.num_cached // self.block_size:  # config validation rules this out
      raise RuntimeError(f'request {seq.request_id}: block {logical} is not fully written yet '
                         f'({seq.num_cached} tokens cached) and cannot move out of a window '
                         f'of {seq.window} blocks')
    host = self._allocate()
    owed = self._owed.get(seq.request_id, 0)
    if owed:
      self._owed[seq.request_id] = owed - 1
    device = seq.block_table.pop(0)
    seq.host_table.append(host)
    # The caches index a sequence's blocks from its first: no more offers (module docstring).
    seq.num_offered = 0
    plan.offload_out.append((device, host))
    self.blocks.allocator.free([device])  # copied out before this iteration writes anything
    self.counters['offloaded_blocks'] += 1
    if self.index is not None:
      self.index.store(seq, logical, host)

  # ---- prefix caching over offloaded blocks (offload_index.py) ---------------------------

  def take_pending(self, plan) -> None:
    """The finished windows' copies (keep_window) not voided since (a block the index
    evicted to make room drops its copy) go into this plan's offload_out, at the end of
    scheduling: read before anything writes, like every move out."""
    plan.offload_out += self.pending_out
    self.pending_out = []

  def prefix_hits(self, seq: Sequence, n: int) -> List[int]:
    """The offload blocks of seq's longest indexed prefix among its first n full blocks: for
    a sequence that will be offloaded (a window) and holds nothing yet; else none."""
    if self.index is None or not seq.window or seq.host_table or seq.block_table:
      return []
    return self.index.match(seq, n)

  def adopt(self, seq: Sequence, hits: List[int]) -> None:
    """seq, admitted now with its reservation, takes the matched blocks as its leading host
    blocks: they count against what it reserved (they are blocks it would have moved out)."""
    self.index.take(hits)
    seq.host_table = list(hits)
    self._owed[seq.request_id] = max(0, self._owed.get(seq.request_id, 0) - len(hits))

  def keep_window(self, seq: Sequence) -> None:
    """seq finished: the full blocks its window holds on the device are copied out into
    blocks the index keeps (as far as the store has room no reservation needs), so a later
    prompt over its whole context finds them (the copies go in the next plan's offload_out,
    read before anything writes; the device blocks are freed now)."""
    if self.index is None or not seq.host_table:
      return
    first = len(seq.host_table)
    for i, device in enumerate(seq.block_table[:seq.num_cached // self.block_size - first]):
      if self.available <= 0:
        return
      if self.index.indexed(seq, first + i):
        continue
      host = self._allocate()
      self.index.store(seq, first + i, host)
      self.allocator.free([host])  # only the index holds it
      self.index.released([host])
      self.pending_out.append((device, host))
      self.counters['kept_blocks'] += 1

  def relieve(self, running: Seq[Sequence], plan) -> bool:
    """instead_of_preempting: the decoding sequence that would hold the most device blocks
    beyond the window once its next token has a slot becomes offloaded, its window the newest
    W of them, if its host blocks can be reserved; False when none can be (the caller
    preempts then)."""
    if not self.instead_of_preempting:
      return False

    def device_blocks(s):  # what it holds, and the block its pending token may still need
      return max(len(s.block_table), self.blocks.blocks_for(s.num_tokens))

    candidates = [s for s in running if device_blocks(s) > self.window and not s.window
                  and s.num_pending == 1 and not s.forks and s.beam is None]
    for seq in sorted(candidates, key=device_blocks, reverse=True):
      seq.window = self.window
      if not self.can_reserve(seq):
        seq.window = 0
        continue
      self.reserve(seq)
      self.make_room(seq, seq.num_tokens, plan)
      self.counters['offloaded_under_pressure'] += 1
      return True
    return False

  def figures(self) -> dict:
    """The engine summary's offload figures."""
    return {'offload_host_blocks': self.host_blocks, 'offload_disk_blocks': self.disk_blocks,
            'offload_placement': self.placement, 'offload_device_blocks': self.window,
            'offload_chunk_blocks': self.chunk_blocks,
            'offload_host_blocks_used': self.allocator.used('host'),
            'offload_disk_blocks_used': self.allocator.used('disk'),
            'offload_host_bytes_read': self.store.bytes_read['host'],
            'offload_disk_bytes_read': self.store.bytes_read['disk'],
            **(self.index.figures() if self.index is not None else {}), **self.counters}

