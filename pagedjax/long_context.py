"""Decoding one sequence whose context is several times the device's KV memory.

The engine (engine.py) refuses a request whose blocks cannot all be in its device pool at once
(host/intake.py). This decoder serves such a request with a device *window* of W blocks holding
the sequence's newest tokens, for every layer; the older blocks live in host RAM (numpy), and
each layer's attention streams them to the device C blocks at a time:

  per step (T new tokens: one prompt chunk, or 1 when decoding), per layer:
    begin   q/k/v of the T tokens; their K/V written into the window; the window's partial
            softmax state (device/streamed_attention.py)
    fold    for each chunk of C host blocks: device_put of that layer's K/V chunk, its partial
            state merged into the running one (online softmax)
    end     the normalised output, o_proj, residual, MLP
  then the greedy token of the last real row.

When the T new tokens need a window slot and none is free, the window's oldest block (always a
full one) moves to host RAM first, all layers at once. Host blocks keep logical order, so host
block b holds positions [b*bs, (b+1)*bs) and a chunk's positions are known without a table.

Shapes are static: the window, the chunk (the last one padded with empty slots), and the query
length (a whole prompt chunk, padded, or 1), so a decoder compiles 11 small programs
(LayerPrograms; counted in device/traces.py), and decoders of one model can share them. Greedy
decoding only; one sequence at a time.

Cost, read from the loop: every step moves the host blocks' K/V, all layers, padded to whole
chunks, from host to device (`bytes_streamed`; about context - W * bs tokens), and makes about
L * (2 + chunks) jitted calls from Python. Device KV memory is the window (W + 1 blocks, the
+1 a slot padded tokens write into) plus the chunks in flight.
"""
import collections
import dataclasses
import numbers
import time
from typing import List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.device import traces
from pagedjax.device.streamed_attention import LayerPrograms, StepInputs
from pagedjax.host import intake
from pagedjax.host.intake import RequestError
from pagedjax.model.llama import ModelConfig


def _positive_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f'{name}={value!r} is not allowed: an integer >= 1')
  return int(value)


@dataclasses.dataclass(frozen=True)
class LongContextSettings:
  """block_size: tokens per block. window_blocks (W): device blocks of the newest tokens.
  chunk_blocks (C): host blocks streamed per device call. prefill_chunk: prompt tokens per
  step, a multiple of block_size (so a chunk starts on a block) that fits the window."""
  block_size: int = 16
  window_blocks: int = 16
  chunk_blocks: int = 8
  prefill_chunk: int = 64

  def validate(self) -> 'LongContextSettings':
    for field in dataclasses.fields(self):
      _positive_int(field.name, getattr(self, field.name))
    if self.prefill_chunk % self.block_size:
      raise ValueError(f'prefill_chunk={self.prefill_chunk} is not allowed: a multiple of '
                       f'block_size={self.block_size}, so every prompt chunk starts on a block')
    if self.prefill_chunk > self.window_blocks * self.block_size:
      raise ValueError(
          f'window_blocks={self.window_blocks} is not allowed with prefill_chunk='
          f'{self.prefill_chunk} and block_size={self.block_size}: at least '
          f'{self.prefill_chunk // self.block_size}, so a prompt chunk\'s blocks fit the window')
    return self


# ------------------------------------------------------------------------------------------------
# Host bookkeeping (numpy): which block is where
# ------------------------------------------------------------------------------------------------
class WindowSlots:
  """The W device window slots of one sequence: which logical block each holds, oldest first,
  and the position of every slot's tokens (-1 = empty), which is all attention needs to know.
  Row W of `positions` is the padding slot: padded tokens write there and it stays empty."""

  def __init__(self, num_slots: int, block_size: int):
    self.num_slots, self.block_size = num_slots, block_size
    self.positions = np.full((num_slots + 1, block_size), -1, np.int32)
    self.slot_of = {}  # logical block -> slot
    self.order = collections.deque()  # logical blocks in the window, oldest first
    self.free = list(range(num_slots - 1, -1, -1))

  def place(self, start: int, count: int, padded: int):
    """Slots for `count` new tokens at positions start.. (padded to `padded` rows) ->
    (evicted [(slot, logical block)] to move to host RAM before anything is written,
    blocks [padded], offsets [padded]): where each row's K/V goes."""
    bs = self.block_size
    needed = range(start // bs, (start + count - 1) // bs + 1)
    evicted = []
    for logical in needed:
      if logical in self.slot_of:
        continue
      if not self.free:
        oldest = self.order.popleft()
        if oldest in needed:  # settings.validate rules this out
          raise RuntimeError(f'{len(needed)} blocks do not fit a window of {self.num_slots}')
        slot = self.slot_of.pop(oldest)
        evicted.append((slot, oldest))
        self.free.append(slot)
      slot = self.free.pop()
      self.slot_of[logical] = slot
      self.order.append(logical)
      self.positions[slot] = -1
    blocks = np.full(padded, self.num_slots, np.int32)  # padding rows: the padding slot
    offsets = np.zeros(padded, np.int32)
    pos = np.arange(start, start + count)
    blocks[:count] = [self.slot_of[b] for b in pos // bs]
    offsets[:count] = pos % bs
    self.positions[blocks[:count], offsets[:count]] = pos
    return evicted, blocks, offsets


class HostBlocks:
  """A sequence's oldest blocks in host RAM, in logical order: k, v [L, capacity, Hkv, bs, Dh]
  (the pool's block layout, pagedjax/device/pool.py), capacity a whole number of chunks."""

  def __init__(self, cfg: ModelConfig, capacity: int, block_size: int, dtype):
    shape = (cfg.num_layers, capacity, cfg.num_kv_heads, block_size, cfg.head_dim)
    self.k, self.v = np.zeros(shape, dtype), np.zeros(shape, dtype)
    self.num_blocks = 0
    all_positions = np.arange(capacity * block_size, dtype=np.int32)
    self._positions = all_positions.reshape(capacity, block_size)

  def append(self, logical: int, k: np.ndarray, v: np.ndarray) -> None:
    """Block `logical` ([L, Hkv, bs, Dh] each), which must be the next in order."""
    if logical != self.num_blocks:
      raise RuntimeError(f'host blocks are kept in order: got block {logical}, expected '
                         f'{self.num_blocks}')
    self.k[:, logical], self.v[:, logical] = k, v
    self.num_blocks += 1

  def chunks(self, chunk_blocks: int) -> list:
    """(first block, positions [C, bs]) of every chunk holding host blocks; the last chunk's
    blocks past num_blocks are empty (-1)."""
    out = []
    for first in range(0, self.num_blocks, chunk_blocks):
      positions = self._positions[first:first + chunk_blocks].copy()
      positions[max(0, self.num_blocks - first):] = -1
      out.append((first, positions))
    return out


# ------------------------------------------------------------------------------------------------
# The decoder
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LongContextResult:
  """One request's tokens and what serving it cost."""
  prompt_ids: List[int]
  output_ids: List[int]
  finish_reason: str  # 'length' | 'eos'
  prompt_seconds: float  # prefill up to the first token (compilation included if any)
  step_seconds: List[float]  # each decode step after the first token
  step_bytes_streamed: List[int]  # host -> device K/V bytes of each of those steps
  step_host_blocks: List[int]  # blocks in host RAM at each of those steps (the rest padding)
  prompt_bytes_streamed: int
  host_blocks: int  # blocks moved from the window to host RAM
  window_bytes: int  # device K/V the window holds (padding slot included)
  chunk_bytes: int  # one streamed chunk's K and V (one layer)
  compilations: int  # programs traced while serving this request
  logits: Optional[List[np.ndarray]] = None  # per output token [V], when asked for


class LongContextDecoder:
  """Greedy decoding of one sequence at a time with a device window of the newest blocks and
  the rest streamed from host RAM (module docstring). Decoders of one model can share
  `programs` (a LayerPrograms): a new window or chunk shape compiles only what it changes."""

  def __init__(self, model_cfg: ModelConfig, params, settings: LongContextSettings, *,
               programs: Optional[LayerPrograms] = None, layers: Optional[list] = None):
    """layers: every layer's params, already cut (programs.cut_layers), to share between
    decoders; cut here otherwise."""
    self.cfg, self.params, self.settings = model_cfg, params, settings.validate()
    self.programs = programs or LayerPrograms(model_cfg)
    self.layers = layers if layers is not None else self.programs.cut_layers(params)
    self._layer_ids = [jnp.int32(i) for i in range(model_cfg.num_layers)]  # on the device
    self.dtype = np.dtype(jnp.dtype(model_cfg.dtype))
    s, c = settings, model_cfg
    self.block_bytes = c.num_kv_heads * s.block_size * c.head_dim * self.dtype.itemsize

  def check(self, prompt_ids: Sequence[int], max_new_tokens: int) -> List[int]:
    """The prompt as a list of ints, or RequestError naming what is wrong."""
    ids = intake.prompt_ids(prompt_ids, self.cfg.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
        or max_new_tokens < 1:
      raise RequestError(f'max_new_tokens={max_new_tokens!r} is not allowed: an integer >= 1')
    if len(ids) + max_new_tokens > self.cfg.max_seq_len:
      raise RequestError(f'{len(ids)} prompt + {max_new_tokens} new tokens exceed the model\'s '
                         f'max_seq_len={self.cfg.max_seq_len}')
    return ids

  def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
               eos_id: Optional[int] = None, record_logits: bool = False) -> LongContextResult:
    """Greedy tokens after `prompt_ids`, up to max_new_tokens or eos_id (included)."""
    ids = self.check(prompt_ids, max_new_tokens)
    compiled_before = traces.count()
    seq = self._new_sequence(len(ids) + max_new_tokens)
    start = time.perf_counter()
    out, logits = self._prefill(seq, ids)
    prompt_seconds, prompt_bytes = time.perf_counter() - start, seq.bytes_streamed
    steps = collections.defaultdict(list)
    while len(out) < max_new_tokens and out[-1] != eos_id:
      start, before = time.perf_counter(), seq.bytes_streamed
      token, step_logits = self._forward(seq, out[-1:], len(ids) + len(out) - 1, 1)
      out.append(int(token))
      logits.append(step_logits)
      steps['seconds'].append(time.perf_counter() - start)
      steps['bytes'].append(seq.bytes_streamed - before)
      steps['host_blocks'].append(seq.host.num_blocks)
    return LongContextResult(
        prompt_ids=ids, output_ids=out, finish_reason='eos' if out[-1] == eos_id else 'length',
        prompt_seconds=prompt_seconds, step_seconds=steps['seconds'],
        step_bytes_streamed=steps['bytes'], step_host_blocks=steps['host_blocks'],
        prompt_bytes_streamed=prompt_bytes, host_blocks=seq.host.num_blocks,
        window_bytes=2 * seq.window[0].nbytes,
        chunk_bytes=2 * self.settings.chunk_blocks * self.block_bytes,
        compilations=traces.count() - compiled_before,
        logits=[np.asarray(x) for x in logits] if record_logits else None)

  def _new_sequence(self, max_tokens: int) -> '_SequenceState':
    """An empty window on the device and host room for max_tokens, in whole chunks."""
    s, cfg = self.settings, self.cfg
    capacity = -(-max_tokens // s.block_size)
    capacity = -(-capacity // s.chunk_blocks) * s.chunk_blocks
    window_shape = (cfg.num_layers, s.window_blocks + 1, cfg.num_kv_heads, s.block_size,
                    cfg.head_dim)
    return _SequenceState(window=[jnp.zeros(window_shape, self.dtype) for _ in 'kv'],
                          slots=WindowSlots(s.window_blocks, s.block_size),
                          host=HostBlocks(cfg, capacity, s.block_size, self.dtype))

  def _prefill(self, seq: '_SequenceState', ids: List[int]):
    """The prompt in chunks of prefill_chunk tokens (the last one padded) -> ([first token],
    [its logits (device)])."""
    chunk_len = self.settings.prefill_chunk
    for first in range(0, len(ids), chunk_len):
      token, logits = self._forward(seq, ids[first:first + chunk_len], first, chunk_len)
    return [int(token)], [logits]

  def _forward(self, seq: '_SequenceState', tokens: List[int], start: int, padded: int):
    """Runs `tokens` (at positions start..) through every layer, padded to `padded` rows;
    their K/V end up in the window. Returns the greedy token after the last real row and its
    logits (device arrays)."""
    p, c = self.programs, self.settings.chunk_blocks
    count = len(tokens)
    evicted, blocks, offsets = seq.slots.place(start, count, padded)
    for slot, logical in evicted:
      k, v = p.window_block(seq.window[0], seq.window[1], np.int32(slot))
      seq.host.append(logical, np.asarray(k), np.asarray(v))
    positions = np.full(padded, -1, np.int32)
    positions[:count] = np.arange(start, start + count)
    tokens = np.pad(np.asarray(tokens, np.int32), (0, padded - count))
    # The step's inputs go to the device once, not once per layer call. The window positions
    # from a copy: a transfer may still be reading its numpy source after device_put returns,
    # and the next step's place() rewrites them in place.
    inputs = StepInputs(*jax.device_put((positions, blocks, offsets,
                                         seq.slots.positions.copy())))
    chunks = [(first, jax.device_put(chunk_positions))
              for first, chunk_positions in seq.host.chunks(c)]
    x = p.embed(self.params, tokens)
    window_k, window_v = seq.window
    for layer, lp in enumerate(self.layers):
      q, state, window_k, window_v = p.begin_layer(lp, x, inputs, window_k, window_v,
                                                   self._layer_ids[layer])
      for first, chunk_positions in chunks:
        # Copies, never aliases of the host arrays. Evictions write only blocks past every
        # chunk streamed so far, or into a padded chunk's empty (masked) blocks.
        k, v = jax.device_put((seq.host.k[layer, first:first + c],
                               seq.host.v[layer, first:first + c]), may_alias=False)
        state = p.fold(state, q, inputs.positions, k, v, chunk_positions)
        seq.bytes_streamed += k.nbytes + v.nbytes
      x = p.end_layer(lp, x, state)
    seq.window = [window_k, window_v]
    return p.next_token(self.params, x, np.int32(count - 1))


@dataclasses.dataclass
class _SequenceState:
  window: list  # [k, v], each [L, W + 1, Hkv, bs, Dh] on the device
  slots: WindowSlots
  host: HostBlocks
  bytes_streamed: int = 0
