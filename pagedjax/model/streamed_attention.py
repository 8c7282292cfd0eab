"""Attention over a context larger than the device holds: partial softmax states, merged.

An offloaded sequence (pagedjax/host/scheduling/offload.py) keeps its newest blocks in the engine's pool,
at most its window of them, and its older blocks in host RAM. Each layer's attention is then a
sum over disjoint key spans: the window's blocks in the pool, and the host blocks streamed to
the device C blocks at a time.
Each span gives an unnormalised online-softmax state (m: running max, l: sum of exp, acc: sum of
exp-weighted values), and states of disjoint spans merge exactly (`combine`): the pairwise,
unnormalised form of the kernels' split merge (kernels/contract.merge_split_states), which lets
a span be folded in as soon as it arrives instead of stacking a growing number of them.

Which keys a query sees is said by positions alone: every key slot carries its token's absolute
position, -1 for an empty slot, and query t (position p >= 0) sees the slots with
0 <= position <= p. So the window can be a ring (slots in any order), a prompt chunk sees itself
causally, and padded queries (position -1) see nothing and output zeros.

Layouts, one sequence (no batch axis): q [T, Hq, Dh]; K/V spans in the pool's block layout
[N, Hkv, bs, Dh] (pagedjax/device/pool.py) with positions [N, bs]; states hold the rows
R = T * G of each KV head ordered (t, g), as contract.group_rows.

`StreamedAttention` runs one offloaded row of an engine iteration through the model this way
(the executor calls it beside the batched steps, pagedjax/executor.py):

  embed        the row's T tokens (a prompt chunk padded to engine.prefill_chunk, or 1)
  per layer:
    begin      q/k/v; the new K/V written into the engine's pool at the row's slots, in the
               pool's own scheme (donated: in place); the partial state over its window blocks
    fold       per chunk of C host blocks: the layer's chunk put on the device, dequantized as
               the pool would, its partial state merged into the running one (online softmax)
    end        normalise, o_proj, residual, MLP
  finish       final norm, logits of the last real row, and the engine's own sampler
               (device/sampling.py: greedy, temperature, top-k, top-p, per-row seeds)

The weights are the engine's: on one CPU device each layer's params are views of the stacked
arrays (llama.per_layer_params, no copy); elsewhere the programs take the stacked arrays and
index the layer inside (a transient slice, no second copy kept). Shapes are static: the window
W, the chunk C and the query length T, one of the engine's two token buckets. So an engine
compiles 10 programs here, 5 per query length, whatever the context; the layer is a traced
argument. Every one is counted in pagedjax/device/traces.py, and engines of one model and pool
shape share them (module-level jits, the model config and storage spec static).
"""
import functools
from typing import Dict, List, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.kernels import contract
from pagedjax.device import pool as pool_lib
from pagedjax.device import traces
from pagedjax.device.sampling import sample
from pagedjax.model import llama


# ------------------------------------------------------------------------------------------------
# Partial states
# ------------------------------------------------------------------------------------------------
class State(NamedTuple):
  """An unnormalised online-softmax state over some key span, float32."""
  m: jax.Array  # [Hkv, R] running max of the scores seen (-inf: nothing seen yet)
  l: jax.Array  # [Hkv, R] sum of exp(score - m)
  acc: jax.Array  # [Hkv, R, Dh] sum of exp(score - m) * value


def partial_state(q, q_positions, k_blocks, v_blocks, kv_positions, scale=None) -> State:
  """The state of queries q [T, Hq, Dh] (positions [T], -1 = padding) over one span of keys:
  k/v [N, Hkv, bs, Dh] with positions [N, bs] (-1 = empty slot). scale: 1/sqrt(Dh) unless
  given. Masking uses `where` (never a multiply): an empty slot may hold anything."""
  num_heads, head_dim = q.shape[1:]
  num_blocks, num_kv_heads, block_size, _ = k_blocks.shape
  group = num_heads // num_kv_heads
  f32 = jnp.float32
  scale = contract.softmax_scale(scale, head_dim)
  rows = contract.group_rows(q[None].astype(f32) * scale, num_kv_heads)[0]  # [Hkv, R, Dh]
  keys = num_blocks * block_size
  kv_pos = kv_positions.reshape(keys)
  row_pos = jnp.repeat(q_positions, group)  # [R], rows ordered (t, g)
  visible = (kv_pos[None, :] >= 0) & (kv_pos[None, :] <= row_pos[:, None])  # [R, S]
  scores = jnp.einsum('hrd,nhbd->hrnb', rows, k_blocks.astype(f32)).reshape(
      num_kv_heads, -1, keys)
  scores = jnp.where(visible[None], scores, -jnp.inf)
  m = jnp.max(scores, axis=-1)
  shift = jnp.where(m == -jnp.inf, 0.0, m)  # a row that sees nothing keeps m = -inf, NaN-free
  p = jnp.where(visible[None], jnp.exp(scores - shift[..., None]), 0.0)
  v = jnp.where((kv_positions >= 0)[:, None, :, None], v_blocks.astype(f32), 0.0)
  acc = jnp.einsum('hrnb,nhbd->hrd', p.reshape(num_kv_heads, -1, num_blocks, block_size), v)
  return State(m, jnp.sum(p, axis=-1), acc)


def combine(a: State, b: State) -> State:
  """The state of two disjoint spans: both rescaled to the larger max, then added. A span that
  saw nothing (m = -inf) weighs exp(-inf) = 0."""
  m = jnp.maximum(a.m, b.m)
  shift = jnp.where(m == -jnp.inf, 0.0, m)
  wa, wb = jnp.exp(a.m - shift), jnp.exp(b.m - shift)
  return State(m, a.l * wa + b.l * wb, a.acc * wa[..., None] + b.acc * wb[..., None])


def normalise(state: State, num_heads: int):
  """A state -> attention output [T, Hq, Dh] float32; a row that saw nothing gets zeros."""
  out = state.acc / jnp.where(state.l > 0, state.l, 1.0)[..., None]
  num_q = state.m.shape[1] // (num_heads // state.m.shape[0])
  return contract.ungroup_rows(out[None], num_q, num_heads)[0]


# ------------------------------------------------------------------------------------------------
# One offloaded row of an engine iteration
# ------------------------------------------------------------------------------------------------
class RowInputs(NamedTuple):
  """Where one row's T new tokens are and go (device arrays, the same for every layer)."""
  positions: jax.Array  # [T] int32, -1 = padding
  slots: jax.Array  # [T] int32: the pool slot each token's K/V is written to (padding: slot 0)
  window_table: jax.Array  # [W] int32: the row's device blocks, oldest first (padding: null)
  window_positions: jax.Array  # [W, bs] int32: their tokens' positions, new ones included


class StreamedRow(NamedTuple):
  """What the executor hands over for one offloaded row (host values)."""
  tokens: List[int]  # the tokens to feed
  start: int  # position of the first
  host_table: List[int]  # host blocks of logical blocks 0.. (Sequence.host_table)
  window_table: List[int]  # device blocks of the logical blocks after them
  temperature: float
  top_k: int
  top_p: float
  seed: int
  counter: int  # tokens generated so far (the sampler's stream position)


class _Slots(NamedTuple):
  slot_mapping: jax.Array  # [1, T]: what the pool's schemes write through (KVPool.at_slots)


def _layer(lp, layer, stacked: bool):
  return jax.tree_util.tree_map(lambda a: a[layer], lp) if stacked else lp


@functools.partial(jax.jit, static_argnums=(0,))
def _embed(cfg, params, tokens):
  traces.record()  # trace time only
  return llama.embed_tokens(cfg, params, tokens)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(5,))
def _begin_layer(cfg, stacked, lp, layer, x, pool, row: RowInputs):
  traces.record()
  q, k, v = llama.layer_qkv(cfg, _layer(lp, layer, stacked), x[None], row.positions[None])
  pool = pool_lib.write_kv(pool, layer, k, v, _Slots(row.slots[None]))
  window_k, window_v = pool.scheme.read_blocks(pool, layer, row.window_table)
  state = partial_state(q[0], row.positions, window_k, window_v, row.window_positions)
  return q[0], state, pool


@functools.partial(jax.jit, static_argnums=(0,))
def _fold(spec, state, q, positions, chunk: Dict[str, jax.Array], chunk_positions):
  traces.record()
  # The chunk as a one-layer pool of its C blocks, read (dequantized) by the pool's scheme.
  blocks = pool_lib.KVPool(**{name: a[None] for name, a in chunk.items()}, spec=spec)
  k, v = blocks.scheme.read_blocks(blocks, 0, jnp.arange(chunk_positions.shape[0]))
  return combine(state, partial_state(q, positions, k, v, chunk_positions))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _end_layer(cfg, stacked, lp, layer, x, state):
  traces.record()
  attn = normalise(state, cfg.num_heads).astype(x.dtype)
  return llama.layer_output(cfg, _layer(lp, layer, stacked), x[None], attn[None])[0]


@functools.partial(jax.jit, static_argnums=(0,))
def _finish(cfg, params, x, index, temperature, top_k, top_p, seed, counter):
  traces.record()
  logits = llama.final_logits(cfg, params, x[index])
  token = sample(logits[None], temperature[None], top_k[None], top_p[None], seed[None],
                 counter[None])[0]
  return token, logits


def padded_chunks(host_table: List[int], chunk_blocks: int, block_size: int):
  """(host ids [C], positions [C, bs]) of every chunk of a sequence's host blocks, in order;
  the last chunk is padded with host block 0 at positions -1 (nothing sees them)."""
  out = []
  for first in range(0, len(host_table), chunk_blocks):
    ids = np.zeros(chunk_blocks, np.int64)
    real = host_table[first:first + chunk_blocks]
    ids[:len(real)] = real
    positions = np.full((chunk_blocks, block_size), -1, np.int32)
    logical = np.arange(first, first + len(real))
    positions[:len(real)] = logical[:, None] * block_size + np.arange(block_size)
    out.append((ids, positions))
  return out


class StreamedAttention:
  """The engine's streamed path (module docstring): `run` feeds one offloaded row."""

  def __init__(self, cfg: llama.ModelConfig, block_size: int, window_blocks: int,
               chunk_blocks: int, token_buckets):
    self.cfg, self.block_size = cfg, block_size
    self.window_blocks, self.chunk_blocks = window_blocks, chunk_blocks
    self.token_buckets = sorted(token_buckets)
    self._layers = None  # (params, [per-layer params], stacked), for the params last seen
    self._layer_ids = [np.int32(i) for i in range(cfg.num_layers)]

  def layers(self, params):
    """Each layer's params as the programs take them (module docstring: views, or stacked)."""
    if self._layers is None or self._layers[0] is not params:
      stacked_tree = params['params']['layers']
      leaf = jax.tree_util.tree_leaves(stacked_tree)[0]
      on_one_cpu = (isinstance(leaf, jax.Array) and len(leaf.devices()) == 1 and
                    next(iter(leaf.devices())).platform == 'cpu')
      if on_one_cpu:
        split = llama.per_layer_params(params)['params']
        self._layers = (params, [split[f'layer_{i}'] for i in range(self.cfg.num_layers)],
                        False)
      else:
        self._layers = (params, [stacked_tree] * self.cfg.num_layers, True)
    return self._layers[1], self._layers[2]

  def row_inputs(self, row: StreamedRow) -> RowInputs:
    """The row's positions, slots and window as numpy arrays (host arithmetic)."""
    bs, count = self.block_size, len(row.tokens)
    padded = next(t for t in self.token_buckets if t >= count)
    first = len(row.host_table)  # the window's first logical block
    positions = np.full(padded, -1, np.int32)
    positions[:count] = np.arange(row.start, row.start + count)
    table = np.zeros(self.window_blocks, np.int32)  # the null block pads the window
    table[:len(row.window_table)] = row.window_table
    slots = np.zeros(padded, np.int32)  # padded rows write into the null block's slot 0
    real = positions[:count]
    slots[:count] = table[real // bs - first] * bs + real % bs
    end = row.start + count  # tokens cached once this row's K/V are written
    window_positions = ((first + np.arange(self.window_blocks))[:, None] * bs +
                        np.arange(bs)).astype(np.int32)
    window_positions[len(row.window_table):] = -1
    window_positions[window_positions >= end] = -1
    return RowInputs(positions, slots, table, window_positions)

  def run(self, params, pool, store, row: StreamedRow):
    """Feeds one row; returns (pool, sampled token, logits [V] as numpy, host -> device bytes
    streamed). `store` is the offload store (host/offload.OffloadStore)."""
    cfg, count = self.cfg, len(row.tokens)
    host = self.row_inputs(row)
    tokens = np.zeros(len(host.positions), np.int32)
    tokens[:count] = row.tokens
    # The row's inputs go to the device once, not once per layer call.
    inputs = RowInputs(*jax.device_put(tuple(host)))
    chunks = [(ids, jax.device_put(positions))
              for ids, positions in padded_chunks(row.host_table, self.chunk_blocks,
                                                  self.block_size)]
    layers, stacked = self.layers(params)
    streamed = 0
    x = _embed(cfg, params, tokens)
    for layer, lp in enumerate(layers):
      layer_id = self._layer_ids[layer]
      q, state, pool = _begin_layer(cfg, stacked, lp, layer_id, x, pool, inputs)
      for ids, chunk_positions in chunks:
        data = jax.device_put(store.layer_chunk(layer, ids))
        streamed += sum(a.nbytes for a in data.values())
        state = _fold(pool.spec, state, q, inputs.positions, data, chunk_positions)
      x = _end_layer(cfg, stacked, lp, layer_id, x, state)
    token, logits = _finish(cfg, params, x, np.int32(count - 1), np.float32(row.temperature),
                            np.int32(row.top_k), np.float32(row.top_p), np.int32(row.seed),
                            np.int32(row.counter))
    return pool, int(token), np.asarray(logits), streamed
