"""Attention over a context larger than the device holds: partial softmax states, merged.

A long-context decoder (pagedjax/long_context.py) keeps a sequence's newest blocks in a small
device window and its older blocks in host RAM. Each layer's attention is then a sum over
disjoint key spans: the window, and the host blocks streamed to the device C blocks at a time.
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

`LayerPrograms` holds the jitted programs the decoder calls between host steps, each counted in
pagedjax/device/traces.py when it compiles.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels import contract
from pagedjax.device import traces
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
# The decoder's jitted programs
# ------------------------------------------------------------------------------------------------
class StepInputs(NamedTuple):
  """Where one step's T new tokens are and go (device arrays, the same for every layer)."""
  positions: jax.Array  # [T] int32, -1 = padding
  blocks: jax.Array  # [T] int32: the window slot each token's K/V is written to
  offsets: jax.Array  # [T] int32: its offset in that slot's block
  window_positions: jax.Array  # [W + 1, bs] int32: every window slot's positions, these included


class LayerPrograms:
  """The model run one decoder layer per call, with attention split into spans in between:

    embed(params, tokens [T]) -> x [T, D]
    begin_layer(lp, x, inputs, window_k, window_v, layer) -> (q, state, window_k, window_v)
        q/k/v of the layer; the new K/V written into the window (layer-stacked
        [L, W + 1, Hkv, bs, Dh], donated: updated in place) at (inputs.blocks, inputs.offsets);
        the window's partial state
    fold(state, q, positions, k_chunk, v_chunk, chunk_positions [C, bs]) -> state
        one streamed span folded in
    end_layer(lp, x, state) -> x      normalised attention, o_proj, residual, MLP
    next_token(params, x, index) -> (greedy token id, logits [V]) of row `index` of x
    window_block(window_k, window_v, slot) -> one window block of every layer (the eviction)

  `lp` is one layer's params (`cut_layers`). Shapes are static per decoder (window, chunk) and
  per query length (a prompt chunk, or 1), so a decoder compiles 11 programs: 5 per query
  length and the eviction. (Fusing one layer's end with the next one's begin would save a call
  per layer, but compiles begin and end twice each per query length: measured on the 2-core
  CPU, a tiny model's first request took 13.8 s fused and 9.2 s like this, both under load ~9.5.)
  """

  def __init__(self, cfg: llama.ModelConfig):
    self.cfg = cfg
    self.num_compilations = 0

    def counted(fn, **jit_kwargs):
      def traced(*args):
        self.num_compilations += 1  # runs at trace time only
        traces.record()
        return fn(*args)
      return jax.jit(traced, **jit_kwargs)

    self.embed = counted(lambda params, tokens: llama.embed_tokens(cfg, params, tokens))
    self.begin_layer = counted(self._begin_layer, donate_argnums=(3, 4))
    self.fold = counted(self._fold)
    self.end_layer = counted(self._end_layer)
    self.next_token = counted(self._next_token)
    # A traced slot, so one program serves every slot.
    self.window_block = counted(lambda k, v, slot: (k[:, slot], v[:, slot]))

  def cut_layers(self, params) -> list:
    """Every layer's own params, cut once (llama.per_layer_params: views of the stacked
    buffers on one CPU device, no copy): slicing the stacked weights inside each layer's call
    would copy that layer's weights on every call."""
    split = llama.per_layer_params(params)['params']
    return [split[f'layer_{i}'] for i in range(self.cfg.num_layers)]

  def _begin_layer(self, lp, x, inputs: StepInputs, window_k, window_v, layer):
    positions = inputs.positions
    q, k, v = llama.layer_qkv(self.cfg, lp, x[None], positions[None])
    at = (layer, inputs.blocks, slice(None), inputs.offsets)
    window_k = window_k.at[at].set(k[0].astype(window_k.dtype))
    window_v = window_v.at[at].set(v[0].astype(window_v.dtype))
    state = partial_state(q[0], positions, window_k[layer], window_v[layer],
                          inputs.window_positions)
    return q[0], state, window_k, window_v

  @staticmethod
  def _fold(state, q, positions, k_chunk, v_chunk, chunk_positions):
    return combine(state, partial_state(q, positions, k_chunk, v_chunk, chunk_positions))

  def _end_layer(self, lp, x, state):
    attn = normalise(state, self.cfg.num_heads).astype(x.dtype)
    return llama.layer_output(self.cfg, lp, x[None], attn[None])[0]

  def _next_token(self, params, x, index):
    logits = llama.final_logits(self.cfg, params, x[index])
    return jnp.argmax(logits).astype(jnp.int32), logits
