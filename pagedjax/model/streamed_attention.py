"""Attention over a context larger than the device holds: partial softmax states, merged.

An offloaded sequence (pagedjax/host/scheduling/offload.py) keeps its newest blocks in the
engine's pool, at most its window of them, and its older blocks in host RAM or on the disk tier
(host/scheduling/offload_store.py). Each layer's attention is then a sum over disjoint key
spans: the window's blocks in the pool, and the host blocks streamed to the device C blocks at
a time.
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
R = T * G of each KV head ordered (t, g), as contract.group_rows. A batch of B sequences maps
these over its rows (jax.vmap): states [B, Hkv, R(, Dh)].

`StreamedAttention` runs an engine iteration's offloaded rows through the model this way (the
executor calls it beside the batched steps, pagedjax/executor.py). Rows of one token bucket go
together, B of them padded to a row bucket (the engine's powers of two up to max_batch_size):

  embed        the rows' T tokens (prompt chunks padded to engine.prefill_chunk, or 1)
  per layer group (offload.layers_per_call layers; 1 by default), one program (`_layers`):
    in         each layer's host blocks of every row that has some, all its fold steps, put
               on the device in one transfer: [S, Bh * C] blocks, step i holding each such
               row's i-th chunk of C host blocks (host block 0 at positions -1 for a row with
               fewer chunks, and for the steps padding S to a power of two). Those rows come
               first, Bh of them padded to a row bucket; rows with no host blocks (ordinary
               decodes joining the batch, offload.join_decodes) come after and add nothing
    per layer of the group:
      begin    q/k/v; the new K/V written into the engine's pool at the rows' slots, in the
               pool's own scheme (donated: in place); each row's partial state over its window
               (`_window_state`)
      fold     a loop over the real fold steps (lax.fori_loop, its count a traced argument):
               step i's chunks dequantized as the pool would, merged into each row's running
               state (online softmax)
      end      normalise, o_proj, residual, MLP
    Where the engine's attention is the native CPU kernel (config.attention.impl 'cpu', or
    'auto' on a CPU where it builds) and the pool is one it reads natively (float, int8, fp8
    codes), begin's window state and the fold are two calls of that kernel instead, merged by
    their log-sum-exp (`native_layer_attention`): the same kernel as the all-device step.
  finish       each row's last real token; final norm, logits and the engine's own sampler
               (device/sampling.py: greedy, temperature, top-k, top-p, per-row seeds); with a
               beam row in the batch, also every row's top-K ids and log-probs, as the
               compiled step returns them (model/step.py)
Pools with per-sequence lane state (device/kv_schemes.py: KIVI keys keep a partial block's
keys in a bfloat16 tail per lane, a recent window its newest tokens in bfloat16 rings per lane)
stream the same way. Only full blocks leave a window, and a full block holds its final codes, so
host blocks are read as stored; the lane state stays on the device, and `begin` reads the window
through the scheme's per-query view as the all-device step does (pool.write_and_attend). A
recent window's ring may reach back past the window: those tokens are read from the ring there,
and the folds see host keys only up to each query's position - window.

So a batch costs ceil(L / layers_per_call) + 3 calls and as many transfers, whatever B and the
context are. Device memory holds, beyond the pool, one group's host K/V for the batch padded to
S steps (two groups while the next one is transferred): one layer's by default, which is what
keeps offload worth having on an accelerator; layers_per_call >= L holds every layer's (fewest
calls, for a CPU, where calls cost more than memory). The store's reads of a group are started
while the group before computes (`OffloadStore.start_read`: a disk placement reads
asynchronously). On a CPU device the reads go into reused, 64-byte-aligned host buffers that the
programs take as they are, with no copy and no device_put (the store's `read_buffer`,
host/scheduling/offload_store.aligned_array).

The weights are the engine's: on one CPU device each layer's params are views of the stacked
arrays (llama.per_layer_params, no copy); elsewhere the programs take the stacked arrays and
index the layer inside (a transient slice, no second copy kept). Shapes are static: the window
W, the chunk C, the row bucket B, the query length T (one of the engine's two token buckets),
the step bucket S (`step_bucket`: the longest row's chunks to a power of two), the row bucket
Bh <= B of the rows with host blocks, and the group's layers (at most two sizes: the last group
may be smaller). So an engine compiles, per (T, B) it meets, embed, the row selection of finish
and one layer program per (S, Bh, group size) met, and
the sampler's once per B (and once per (B, K) with beams): S grows with the log of the context,
so the programs are bounded for a bounded max_seq_len. The layer index is a traced argument.
Every one is counted in pagedjax/device/traces.py, and engines of one model and pool shape
share them (module-level jits, the model config and storage spec static).
"""
import collections
import functools
from typing import Dict, List, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import kernels
from pagedjax.kernels import contract
from pagedjax.device import pool as pool_lib
from pagedjax.device import traces
from pagedjax.device.sampling import sample, top_candidates
from pagedjax.model import llama


# ------------------------------------------------------------------------------------------------
# Partial states
# ------------------------------------------------------------------------------------------------
class State(NamedTuple):
  """An unnormalised online-softmax state over some key span, float32."""
  m: jax.Array  # [Hkv, R] running max of the scores seen (-inf: nothing seen yet)
  l: jax.Array  # [Hkv, R] sum of exp(score - m)
  acc: jax.Array  # [Hkv, R, Dh] sum of exp(score - m) * value


def _scaled_rows(q, num_kv_heads, scale):
  """q [T, Hq, Dh] -> the rows [Hkv, R, Dh] float32, scaled by 1/sqrt(Dh) unless given."""
  scale = contract.softmax_scale(scale, q.shape[-1])
  return contract.group_rows(q[None].astype(jnp.float32) * scale, num_kv_heads)[0]


def _visible(q_positions, kv_positions, group, after=None):
  """[R, S]: row r (query t, rows ordered (t, g)) sees slot s when 0 <= kv_positions[s] <=
  q_positions[t], and kv_positions[s] > after[t] where given."""
  row_pos = jnp.repeat(q_positions, group)  # [R]
  visible = (kv_positions[None, :] >= 0) & (kv_positions[None, :] <= row_pos[:, None])
  if after is not None:
    visible &= kv_positions[None, :] > jnp.repeat(after, group)[:, None]
  return visible


def _exp_scores(scores, visible):
  """(m [Hkv, R], p [Hkv, R, S]): the visible scores' max and their exp(score - m), 0 where not
  visible. A row that sees nothing keeps m = -inf, NaN-free."""
  scores = jnp.where(visible[None], scores, -jnp.inf)
  m = jnp.max(scores, axis=-1)
  shift = jnp.where(m == -jnp.inf, 0.0, m)
  return m, jnp.where(visible[None], jnp.exp(scores - shift[..., None]), 0.0)


def partial_state(q, q_positions, k_blocks, v_blocks, kv_positions, scale=None,
                  after=None) -> State:
  """The state of queries q [T, Hq, Dh] (positions [T], -1 = padding) over one span of keys:
  k/v [N, Hkv, bs, Dh] with positions [N, bs] (-1 = empty slot). scale: 1/sqrt(Dh) unless
  given. after [T] (optional): query t sees only keys at positions > after[t] (the newest
  tokens a recent window reads from its rings, `_ring_span`). Masking uses `where` (never a
  multiply): an empty slot may hold anything."""
  num_blocks, num_kv_heads, block_size, _ = k_blocks.shape
  group = q.shape[1] // num_kv_heads
  rows = _scaled_rows(q, num_kv_heads, scale)  # [Hkv, R, Dh]
  keys = num_blocks * block_size
  visible = _visible(q_positions, kv_positions.reshape(keys), group, after)  # [R, S]
  scores = jnp.einsum('hrd,nhbd->hrnb', rows, k_blocks.astype(jnp.float32)).reshape(
      num_kv_heads, -1, keys)
  m, p = _exp_scores(scores, visible)
  v = jnp.where((kv_positions >= 0)[:, None, :, None], v_blocks.astype(jnp.float32), 0.0)
  acc = jnp.einsum('hrnb,nhbd->hrd', p.reshape(num_kv_heads, -1, num_blocks, block_size), v)
  return State(m, jnp.sum(p, axis=-1), acc)


def view_state(q, q_positions, k_lo, v_lo, k_hi, v_hi, key_hi, value_hi, kv_positions,
               scale=None) -> State:
  """partial_state over flat keys k/v [S, Hkv, Dh] (positions [S]) read per query as
  pool.view_attention reads them: query t takes slot s's key from k_hi where key_hi[t, s], else
  from k_lo, and its value from v_hi where value_hi[t, s], else from v_lo (masks [T, S]; the
  per-query view of KIVI keys and recent windows, KVScheme.write_view)."""
  num_kv_heads = k_lo.shape[1]
  group = q.shape[1] // num_kv_heads
  rows = _scaled_rows(q, num_kv_heads, scale)
  per_row = lambda mask: jnp.repeat(mask, group, axis=0)[None]  # [T, S] -> [1, R, S]
  score = lambda keys: jnp.einsum('hrd,shd->hrs', rows, keys.astype(jnp.float32))
  m, p = _exp_scores(jnp.where(per_row(key_hi), score(k_hi), score(k_lo)),
                     _visible(q_positions, kv_positions, group))
  real = (kv_positions >= 0)[:, None, None]
  v_lo, v_hi = (jnp.where(real, x.astype(jnp.float32), 0.0) for x in (v_lo, v_hi))
  acc = (jnp.einsum('hrs,shd->hrd', p, v_lo) +
         jnp.einsum('hrs,shd->hrd', p * per_row(value_hi), v_hi - v_lo))
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
# The offloaded rows of an engine iteration, batched
# ------------------------------------------------------------------------------------------------
class RowInputs(NamedTuple):
  """Where a batch's new tokens are and go: B rows of T tokens (device arrays, the same for
  every layer). A padding row has positions -1, writes into the null block and has an empty
  window."""
  positions: jax.Array  # [B, T] int32, -1 = padding
  slots: jax.Array  # [B, T] int32: the pool slot each token's K/V is written to (padding: 0)
  window_table: jax.Array  # [B, W] int32: each row's device blocks, oldest first (null pads)
  window_positions: jax.Array  # [B, W, bs] int32: their tokens' positions, new ones included
  window_start: jax.Array  # [B] int32: the position of the window's first slot (padding: 0)
  lanes: jax.Array  # [B] int32: each row's lane (KIVI key tails, recent-window rings; padding:
  # the null lane 0)


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
  lane: int = 0  # the sequence's lane in per-sequence device state (Sequence.lane)


class _Slots(NamedTuple):
  slot_mapping: jax.Array  # [B, T]: what the pool's schemes write through (KVPool.at_slots)


class _WindowBatch(NamedTuple):
  """What a scheme's write and write_view read of a step (the fields of StepInputs they use),
  for the rows' windows."""
  positions: jax.Array  # [B, T]
  block_tables: jax.Array  # [B, W]
  context_lens: jax.Array  # [B]
  lanes: jax.Array  # [B]
  slot_mapping: jax.Array  # [B, T]


_partial_states = jax.vmap(partial_state)  # one state per row: [B, Hkv, R(, Dh)]
_view_states = jax.vmap(view_state)


def _window_state(pool, layer, q, k, v, rows: RowInputs):
  """Writes the rows' new K/V into the pool in its scheme; returns (pool, each row's state
  over what it reads from the device: its window, and with a recent window the ring tokens
  older than the window).

  Schemes that read one view per row (float, int8, fp8, int4 groups) read the window's blocks
  dequantized. Schemes with a per-query view (KVScheme.per_query_view: KIVI keys read a query's
  own block unquantized, a recent window its newest tokens) are read as the all-device step
  reads them (pool.write_and_attend): their write_view over the window, as if the window were
  the whole table. The window starts at a whole block (window_start), so relative positions
  give KIVI the same blocks, tails and masks; a recent window's rings are indexed by absolute
  position (`_recent_window_view`)."""
  scheme = pool.scheme
  if not scheme.per_query_view:
    pool = pool_lib.write_kv(pool, layer, k, v, _Slots(rows.slots))
    window_k, window_v = scheme.read_blocks(pool, layer, rows.window_table)
    return pool, _partial_states(q, rows.positions, window_k, window_v, rows.window_positions)
  num_rows, width = rows.window_table.shape
  bs, pos = pool.block_size, rows.positions
  start = rows.window_start[:, None]
  absolute = _WindowBatch(pos, rows.window_table, jnp.max(pos, axis=1) + 1, rows.lanes,
                          rows.slots)
  in_window = absolute._replace(positions=jnp.where(pos >= 0, pos - start, -1),
                                context_lens=jnp.maximum(absolute.context_lens - start[:, 0], 0))
  if scheme.recent_window:
    pool, view, older = _recent_window_view(scheme, pool, layer, q, k, v, absolute, in_window,
                                            rows.window_start)
  else:
    pool, view = scheme.write_view(pool, layer, k, v, in_window)
  masks = scheme.recent_masks(in_window.positions, width * bs, bs)  # shift-invariant
  state = _view_states(q, pos, *view, *masks,
                       rows.window_positions.reshape(num_rows, width * bs))
  return pool, (combine(state, older) if scheme.recent_window else state)


def _recent_window_view(scheme, pool, layer, q, k, v, absolute, in_window, window_start):
  """RecentWindow.write_view over the rows' windows: the rings are written and read at absolute
  positions (`absolute`), the inner format over the window (`in_window`). Returns (pool, the
  window's view (k_lo, v_lo, k_hi, v_hi) [B, W * bs, H, D], the rows' state over the ring
  tokens before the window). Those tokens are in host blocks too, quantized; a query reads its
  newest `window` tokens from the rings, so the host chunks are folded in only up to
  position - window (`_fold`) and this state covers the rest."""
  n, pos, start = scheme.window, absolute.positions, window_start[:, None]
  pool, view, ring_pos, rings = scheme.write_window_view(pool, layer, k, v, absolute, in_window,
                                                         window_start)
  before = jnp.where((ring_pos >= 0) & (ring_pos < start), ring_pos, -1)  # [B, n]
  # The ring as one block of n slots per row, seen by the queries it is among the newest n of.
  as_block = lambda ring: jnp.swapaxes(ring, 1, 2)[:, None]  # [B, 1, H, n, D]
  older = _partial_states(q, pos, as_block(rings[0]), as_block(rings[1]), before[:, None],
                          after=pos - n)
  return pool, view, older


def _fold(spec, state, q, positions, chunk: Dict[str, jax.Array], chunk_positions) -> State:
  """state merged with one fold step: the chunk of C blocks of each of the first Bh rows (the
  rows with host blocks come first; the rest have none), chunk field -> [Bh * C, ...] as the
  pool stores blocks, at positions [Bh, C, bs]."""
  # The chunk as a one-layer pool of its Bh * C blocks, read (dequantized) by the pool's scheme.
  blocks = pool_lib.KVPool(**{name: a[None] for name, a in chunk.items()}, spec=spec)
  rows, chunk_blocks = chunk_positions.shape[:2]
  k, v = blocks.scheme.read_blocks(blocks, 0,
                                   jnp.arange(rows * chunk_blocks).reshape(rows, chunk_blocks))
  # A recent window's newest tokens are read from its rings (_recent_window_view), not here.
  upto = positions[:rows] - blocks.scheme.recent_window  # padding (-1) stays below 0
  merged = combine(State(*(a[:rows] for a in state)),
                   _partial_states(q[:rows], upto, k, v, chunk_positions))
  if rows == q.shape[0]:
    return merged
  return State(*(jnp.concatenate([m, a[rows:]]) for m, a in zip(merged, state)))


def layer_attention(pool, layer, q, k, v, rows: RowInputs, chunks: Dict[str, jax.Array],
                    chunk_positions, num_steps):
  """One layer's attention state for the rows (inside a program): the new K/V written into the
  pool, each row's window state, then the fold steps 0..num_steps - 1 merged in order (a loop,
  not unrolled: one program whatever the count). chunks: field -> [S, B * C, ...], step i's
  blocks (S >= num_steps, the steps' bucket: steps from num_steps on are never read);
  chunk_positions [S, B, C, bs]. -> (pool, state [B, Hkv, R(, Dh)])."""
  pool, state = _window_state(pool, layer, q, k, v, rows)
  chunk_positions = jnp.asarray(chunk_positions)

  def step(i, state):
    return _fold(pool.spec, state, q, rows.positions, {name: a[i] for name, a in chunks.items()},
                 chunk_positions[i])
  return pool, jax.lax.fori_loop(0, num_steps, step, state)


def native_layer_attention(pool, layer, q, k, v, rows: RowInputs, chunks: Dict[str, jax.Array],
                           host_rows: Optional[int] = None, host_table=None):
  """layer_attention through the native CPU kernel (kernels/cpu.py), for pools it reads
  natively (KVScheme.kernel_native): the rows' new K/V written into the pool, then two kernel
  calls, each returning its output with every query row's log-sum-exp (lse), merged as two
  disjoint spans' softmaxes:
    window  the pool's blocks of each row's window read in place through window_table, at
            positions relative to the window's start (it starts on a block);
    host    every fold step's chunks at once as a one-layer pool of S * Bh * C blocks (the
            first Bh = host_rows rows, default all B: the rows with host blocks come first),
            row b's host blocks in order through a static table (step i, chunk c -> i * Bh *
            C + b * C + c), and window_start (the host tokens) as its context: every query
            sees them all, the steps past the real ones (padding to S) never, nor a padding
            row, or a row past Bh (no host tokens), anything.
  With host_table ([Bh, S * C] host ids, each row's host blocks in order, zeros after), chunks
  are the offload store's host arrays themselves ([layers, H + 1, ...], read in place: the
  store's `in_place`), and row b reads its blocks through host_table at `layer`.
  -> (pool, attention output [B, T, Hq, Dh] float32). The same arithmetic as the all-device
  step's kernel, over the same blocks, in two spans."""
  from pagedjax.kernels import cpu as native  # pylint: disable=import-outside-toplevel
  pool = pool_lib.write_kv(pool, layer, k, v, _Slots(rows.slots))
  start = rows.window_start
  in_window = jnp.where(rows.positions >= 0, rows.positions - start[:, None], -1)
  window_len = jnp.maximum(jnp.max(rows.positions, axis=1) + 1 - start, 0)
  out_w, lse_w = native.paged_attention_cpu_lse(
      q, pool.k, pool.v, rows.window_table, window_len, in_window, k_scales=pool.k_scale,
      v_scales=pool.v_scale, layer=layer)
  # The chunks hold the first Bh rows' blocks (the rows with host blocks come first): a later
  # row's table is block 0 at context 0 (it has no host tokens), never read.
  num_rows = rows.positions.shape[0]
  if host_table is not None:  # the store's arrays in place, read through the rows' host ids
    host, host_layer = chunks, layer
    table = jnp.asarray(host_table, jnp.int32)
    host_rows = table.shape[0]
  else:  # the fold steps' chunks: [S, Bh * C] blocks, step-major
    steps = chunks['k'].shape[0]
    host_rows = num_rows if host_rows is None else host_rows
    chunk_blocks = chunks['k'].shape[1] // host_rows
    host, host_layer = {name: a.reshape((1, -1) + a.shape[2:]) for name, a in chunks.items()}, 0
    table = (jnp.arange(steps)[None, :, None] * (host_rows * chunk_blocks) +
             jnp.arange(host_rows)[:, None, None] * chunk_blocks +
             jnp.arange(chunk_blocks)[None, None, :]).reshape(host_rows, -1).astype(jnp.int32)
  table = jnp.pad(table, ((0, num_rows - host_rows), (0, 0)))
  out_h, lse_h = native.paged_attention_cpu_lse(
      q, host['k'], host['v'], table, start, rows.positions, k_scales=host.get('k_scale'),
      v_scales=host.get('v_scale'), layer=host_layer)
  m = jnp.maximum(lse_w, lse_h)
  shift = jnp.where(m == -jnp.inf, 0.0, m)  # a row that sees nothing: both weights 0
  w_w, w_h = jnp.exp(lse_w - shift), jnp.exp(lse_h - shift)
  total = w_w + w_h
  out = (out_w * w_w[..., None] + out_h * w_h[..., None]) / jnp.where(total > 0, total,
                                                                         1.0)[..., None]
  return pool, out


@functools.partial(jax.jit, static_argnums=(0,))
def _embed(cfg, params, tokens):
  traces.record()  # trace time only
  return llama.embed_tokens(cfg, params, tokens)


IN_PLACE = 2  # _layers' `native`: the native kernel over the offload store's arrays in place


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(7,))
def _layers(cfg, stacked, native, linear_impl, lps, first, x, pool, rows: RowInputs, chunks,
            chunk_positions, host_ids, num_steps):
  """x [B, T, D] through the layers first, first + 1, .. (one per entry of chunks, that layer's
  fold steps as `layer_attention` takes them): q/k/v, attention over the window and the host
  blocks, o_proj, residual, MLP. lps: the stacked layer params (stacked) or each layer's own.
  native: attention through the native CPU kernel (native_layer_attention), else the fold;
  IN_PLACE: that kernel reading the offload store's host arrays in place (each entry of chunks
  is them, host_ids the rows' host ids [Bh, S * C]; chunk_positions None). Otherwise
  chunk_positions are the fold steps' positions [S, Bh, C, bs] and host_ids None.
  linear_impl: the projections' matmuls (llama.LINEAR_IMPLS; StreamedAttention.linear_impl).
  -> (x, pool); the pool is donated (written in place)."""
  traces.record()
  for i, layer_chunks in enumerate(chunks):
    layer = first + i
    lp = jax.tree_util.tree_map(lambda a, at=layer: a[at], lps) if stacked else lps[i]
    q, k, v = llama.layer_qkv(cfg, lp, x, rows.positions, linear_impl)
    if native == IN_PLACE:
      pool, attn = native_layer_attention(pool, layer, q, k, v, rows, layer_chunks,
                                          host_table=host_ids)
    elif native:
      pool, attn = native_layer_attention(pool, layer, q, k, v, rows, layer_chunks,
                                          chunk_positions.shape[1])
    else:
      pool, state = layer_attention(pool, layer, q, k, v, rows, layer_chunks, chunk_positions,
                                    num_steps)
      attn = jax.vmap(lambda s: normalise(s, cfg.num_heads))(state)
    x = llama.layer_output(cfg, lp, x, attn.astype(x.dtype), linear_impl)
  return x, pool


@jax.jit
def _last_tokens(x, index):
  traces.record()
  return x[jnp.arange(x.shape[0]), index]  # [B, T, D] -> [B, D]: each row's last real token


@functools.partial(jax.jit, static_argnums=(0, 1))
def _finish(cfg, topk, params, x, temperature, top_k, top_p, seed, counter):
  # Takes [B, D], not [B, T, D]: the sampler (a vocabulary sort) compiles once per row bucket.
  # topk K > 0 (a batch holding a beam row) also returns each row's K best ids and log-probs,
  # as the compiled step does (model/step.py).
  traces.record()
  logits = llama.final_logits(cfg, params, x)
  tokens = sample(logits, temperature, top_k, top_p, seed, counter)
  if not topk:
    return tokens, logits, ()
  return tokens, logits, top_candidates(logits, topk)


def step_bucket(steps: int) -> int:
  """The fold steps a program is compiled for: the next power of two (1, 2, 4, ...)."""
  return 1 << max(steps - 1, 0).bit_length()


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


class FoldSteps(NamedTuple):
  """A batch's fold steps (host arrays): step i holds every row's i-th chunk."""
  ids: np.ndarray  # [S * B * C] host ids, step-major (what the store reads for a layer)
  positions: np.ndarray  # [S, B, C, bs] int32, -1 = padding
  num_steps: int  # the real steps: the longest row's chunks; S = step_bucket(num_steps)


def fold_steps(host_tables: List[List[int]], rows: int, chunk_blocks: int,
               block_size: int) -> FoldSteps:
  """The fold steps of a batch of `rows` rows (the first len(host_tables) real), padded to
  step_bucket(the longest row's chunks) steps: a row with fewer chunks, a padding row, and a
  padding step get host block 0 at positions -1."""
  per_row = [padded_chunks(t, chunk_blocks, block_size) for t in host_tables]
  num_steps = max((len(c) for c in per_row), default=0)
  steps = step_bucket(num_steps)
  ids = np.zeros((steps, rows, chunk_blocks), np.int64)
  positions = np.full((steps, rows, chunk_blocks, block_size), -1, np.int32)
  for r, chunks in enumerate(per_row):
    for i, (chunk_ids, chunk_positions) in enumerate(chunks):
      ids[i, r], positions[i, r] = chunk_ids, chunk_positions
  return FoldSteps(ids.reshape(-1), positions, num_steps)


class StreamedAttention:
  """The engine's streamed path (module docstring): `run` feeds an iteration's offloaded rows.

  Rows are batched: those of one token bucket (prompt chunks, or decode tokens) go through one
  set of calls, padded to a row bucket (`row_buckets`, the engine's powers of two up to
  max_batch_size), so two long requests decoding together cost one call per layer group, not
  two. `layers_per_call` layers run in one program with their host blocks (offload.
  layers_per_call; more than the model's layers = all of them). Compiled shapes are counted
  (device/traces.py). `counters`: batches run (and of how many real rows), their padding rows,
  layer programs called, fold steps run and padding steps (to the step bucket) transferred."""

  def __init__(self, cfg: llama.ModelConfig, block_size: int, window_blocks: int,
               chunk_blocks: int, token_buckets, row_buckets=(1,), layers_per_call: int = 1,
               attention_impl: str = 'auto', linear_impl: str = 'xla'):
    self.cfg, self.block_size = cfg, block_size
    # The engine's attention path (config.attention.impl): where it is the native CPU kernel,
    # pools that kernel reads natively are attended through it here too (native_layer_attention).
    self.native = (attention_impl if attention_impl != 'auto' else kernels.best_impl()) == 'cpu'
    self.window_blocks, self.chunk_blocks = window_blocks, chunk_blocks
    # The layer programs' projections multiply with XLA's dot by default, not the engine's
    # linear_impl: in a program of one layer the native kernel's custom calls cost more than
    # they save on this CPU (SmolLM2, a long row and two ordinary decodes joined at 4 rows: an
    # iteration of 44 ms with XLA's dot, 56 ms with the kernel; the long row alone 33 / 35 ms).
    self.linear_impl = linear_impl
    # On a CPU device, the native kernel reads host-RAM blocks in the store's own arrays
    # (OffloadStore.in_place) instead of a gathered copy; False gathers them (a comparison).
    self.read_in_place = True
    self.token_buckets, self.row_buckets = sorted(token_buckets), sorted(row_buckets)
    per_call = min(layers_per_call, cfg.num_layers)
    # (first layer, layers): at most two sizes, so at most two programs per shape.
    self.groups = [(first, min(per_call, cfg.num_layers - first))
                   for first in range(0, cfg.num_layers, per_call)]
    self._layers = None  # (params, [each group's layer params], stacked), for the last params
    # On a CPU device the programs take the host buffers themselves, aligned (store.read_buffer),
    # without a copy or a device_put (which costs more than the call on this CPU).
    self._host_is_device = jax.default_backend() == 'cpu'
    self._layer_ids = [np.int32(i) for i in range(cfg.num_layers)]
    self._buffers = {}  # (layer of a group, blocks) -> field -> host array: what reads fill
    self.counters = collections.Counter()

  def layers(self, params):
    """Each layer group's params as the programs take them (module docstring: a tuple of
    per-layer views, or the stacked arrays), and whether they are stacked."""
    if self._layers is None or self._layers[0] is not params:
      stacked_tree = params['params']['layers']
      leaf = jax.tree_util.tree_leaves(stacked_tree)[0]
      on_one_cpu = (isinstance(leaf, jax.Array) and len(leaf.devices()) == 1 and
                    next(iter(leaf.devices())).platform == 'cpu')
      if on_one_cpu:
        split = llama.per_layer_params(params)['params']
        self._layers = (params, [tuple(split[f'layer_{i}'] for i in range(first, first + n))
                                 for first, n in self.groups], False)
      else:
        self._layers = (params, [stacked_tree] * len(self.groups), True)
    return self._layers[1], self._layers[2]

  def row_inputs(self, rows: List[StreamedRow], num_rows: int, num_tokens: int) -> RowInputs:
    """The batch's positions, slots and windows as numpy arrays (host arithmetic): `rows`
    padded to num_rows rows of num_tokens tokens."""
    bs, w = self.block_size, self.window_blocks
    positions = np.full((num_rows, num_tokens), -1, np.int32)
    slots = np.zeros((num_rows, num_tokens), np.int32)  # padding writes the null block's slot 0
    table = np.zeros((num_rows, w), np.int32)  # the null block pads a window
    window_positions = np.full((num_rows, w, bs), -1, np.int32)
    window_start, lanes = np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32)
    for r, row in enumerate(rows):
      count, first = len(row.tokens), len(row.host_table)  # first: the window's logical block
      real = np.arange(row.start, row.start + count)
      positions[r, :count] = real
      table[r, :len(row.window_table)] = row.window_table
      slots[r, :count] = table[r, real // bs - first] * bs + real % bs
      held = ((first + np.arange(len(row.window_table)))[:, None] * bs + np.arange(bs))
      held[held >= row.start + count] = -1  # not cached even once this row's K/V are written
      window_positions[r, :len(row.window_table)] = held
      window_start[r], lanes[r] = first * bs, row.lane
    return RowInputs(positions, slots, table, window_positions, window_start, lanes)

  def run(self, params, pool, store, rows: List[StreamedRow], topk: int = 0):
    """Feeds the rows; returns (pool, sampled tokens [len(rows)], logits [len(rows), V] as
    numpy, host -> device bytes streamed, candidates). `store` is the offload store
    (host/scheduling/offload.OffloadStore). Rows are grouped by token bucket and cut into
    batches of at most the largest row bucket. topk K > 0 (beam rows among them): candidates
    are each row's K best (ids, log-probs), [len(rows), K] each; else None."""
    def token_bucket(row):
      return next(t for t in self.token_buckets if t >= len(row.tokens))

    tokens, logits, streamed = [None] * len(rows), [None] * len(rows), 0
    ids, logprobs = np.zeros((len(rows), topk), np.int32), np.zeros((len(rows), topk), np.float32)
    largest = self.row_buckets[-1]
    for bucket in sorted({token_bucket(r) for r in rows}):
      # Rows with host blocks first: a batch's chunks hold only theirs (_run_batch).
      members = sorted((i for i, r in enumerate(rows) if token_bucket(r) == bucket),
                       key=lambda i: not rows[i].host_table)
      for first in range(0, len(members), largest):
        part = members[first:first + largest]
        pool, got, got_logits, nbytes, cands = self._run_batch(
            params, pool, store, [rows[i] for i in part], bucket, topk)
        streamed += nbytes
        for j, i in enumerate(part):
          tokens[i], logits[i] = int(got[j]), got_logits[j]
          if topk:
            ids[i], logprobs[i] = cands[0][j], cands[1][j]
    return pool, tokens, np.stack(logits), streamed, (ids, logprobs) if topk else None

  def _buffer(self, store, parity: int, index: int, num_blocks: int):
    """The host arrays the `index`-th layer of a group is read into, num_blocks blocks as the
    pool stores them, in one of two sets (`parity`: groups alternate, so a group's reads fill
    one set while the program reading the other's transfer may still run). Made once per
    (parity, index, num_blocks) and reused: a fresh array per read would cost its page faults
    every time, more than the copy on this CPU. So host memory of about 2 x layers_per_call
    layers' reads per (step bucket, row bucket) met. Each array starts on a 64-byte boundary
    (`store.read_buffer`): XLA:CPU then takes it as a device buffer without copying it."""
    key = (parity, index, num_blocks)
    if key not in self._buffers:
      self._buffers[key] = store.read_buffer(num_blocks)
    return self._buffers[key]

  def _run_batch(self, params, pool, store, rows: List[StreamedRow], num_tokens: int,
                 topk: int = 0):
    """One batch of rows of at most num_tokens tokens through every layer (module docstring)."""
    cfg = self.cfg
    num_rows = next(b for b in self.row_buckets if b >= len(rows))
    host = self.row_inputs(rows, num_rows, num_tokens)
    token_ids = np.zeros((num_rows, num_tokens), np.int32)
    for r, row in enumerate(rows):
      token_ids[r, :len(row.tokens)] = row.tokens
    # The chunks hold the blocks of the rows with host blocks (they come first, `run`), in a
    # row bucket of their own: rows without (ordinary decodes joining, offload.join_decodes)
    # add no padding blocks to read and transfer.
    with_host = sum(bool(r.host_table) for r in rows)
    host_rows = next(b for b in self.row_buckets if b >= max(with_host, 1))
    steps = fold_steps([r.host_table for r in rows[:with_host]], host_rows, self.chunk_blocks,
                       self.block_size)
    bucket = len(steps.positions)
    native = self.native and pool.scheme.kernel_native
    # On a CPU device the native kernel reads host-RAM blocks where the store keeps them (its
    # arrays are aligned, so the programs take them without a copy): nothing to gather. The
    # programs then take each row's host ids in order, [Bh, S * C], for the fold steps'
    # positions.
    in_place = (store.in_place(steps.ids, cfg.num_layers)
                if native and self._host_is_device and self.read_in_place else None)
    if in_place is not None:
      mode, positions, host_ids = IN_PLACE, None, np.ascontiguousarray(np.transpose(
          steps.ids.reshape(bucket, host_rows, self.chunk_blocks), (1, 0, 2)).reshape(
              host_rows, -1).astype(np.int32))
    else:
      mode, positions, host_ids = native, steps.positions, None
    # The batch's inputs go to the device once, not once per layer group.
    inputs, step_positions, host_ids, num_steps = jax.device_put(
        (RowInputs(*host), positions, host_ids, np.int32(steps.num_steps)))
    self.counters['batches_read_in_place'] += in_place is not None
    self.counters['batches'] += 1
    self.counters[f'batches_of_{len(rows)}_rows'] += 1
    self.counters['padding_rows'] += num_rows - len(rows)
    self.counters['rows_without_host_blocks'] += len(rows) - with_host
    self.counters['layer_calls'] += len(self.groups)
    self.counters['fold_steps'] += cfg.num_layers * steps.num_steps
    self.counters['padding_steps'] += cfg.num_layers * (bucket - steps.num_steps)
    group_params, stacked = self.layers(params)

    # Only the real steps' blocks are read: the padding steps (to the step bucket) are never
    # read by a program, so their part of a buffer keeps whatever it held.
    real = steps.num_steps * (len(steps.ids) // bucket)

    def start_reads(group):  # a disk store's reads run while the group before computes
      first, count = self.groups[group]
      buffers = [self._buffer(store, group % 2, i, len(steps.ids)) for i in range(count)]
      return [(store.start_read(first + i, steps.ids[:real],
                                {name: a[:real] for name, a in buffer.items()}), buffer)
              for i, buffer in enumerate(buffers)]

    def as_steps(data):  # field -> [S * Bh * C, ...] -> [S, Bh * C, ...] (a view)
      return {name: a.reshape((bucket, -1) + a.shape[1:]) for name, a in data.items()}

    streamed, pending = 0, start_reads(0) if in_place is None else []
    used = [None, None]  # the output of the program that last read each set of buffers
    x = _embed(cfg, params, token_ids)
    for group, (first, count) in enumerate(self.groups):
      if in_place is not None:  # the store's arrays, read in place: as many bytes, no copy
        streamed += count * len(steps.ids) * store.layer_block_bytes
        x, pool = _layers(cfg, stacked, mode, self.linear_impl, group_params[group],
                          self._layer_ids[first], x, pool, inputs, (in_place,) * count,
                          step_positions, host_ids, num_steps)
        continue
      # Programs run asynchronously, and the program two groups back may still read the
      # buffers these reads fill: on a CPU device they are its input arrays themselves (the
      # transfer aliases them, store.read_buffer). It must be done first. (Waiting only for that
      # transfer is not enough: greedy tokens of a 7-layer model came out wrong,
      # test_layer_groups_stream_every_layer_as_the_dense_model.)
      jax.block_until_ready(used[group % 2])
      for read, _ in pending:
        read()
      chunks = tuple(as_steps(buffer) for _, buffer in pending)
      if not self._host_is_device:  # (a CPU program takes the host arrays as they are)
        chunks = jax.device_put(chunks)
      streamed += sum(a.nbytes for layer in chunks for a in layer.values())
      pending = start_reads(group + 1) if group + 1 < len(self.groups) else []
      x, pool = _layers(cfg, stacked, mode, self.linear_impl, group_params[group],
                        self._layer_ids[first], x, pool, inputs, chunks, step_positions,
                        host_ids, num_steps)
      used[group % 2] = x
    index = np.zeros(num_rows, np.int32)  # each row's last real token (padding rows: 0)
    index[:len(rows)] = [len(r.tokens) - 1 for r in rows]

    def per_row(field, dtype, padding=0):
      values = np.full(num_rows, padding, dtype)
      values[:len(rows)] = [getattr(r, field) for r in rows]
      return values

    token, logits, cands = _finish(cfg, topk, params, _last_tokens(x, index),
                                   per_row('temperature', np.float32),
                                   per_row('top_k', np.int32), per_row('top_p', np.float32, 1.0),
                                   per_row('seed', np.int32), per_row('counter', np.int32))
    cands = tuple(np.asarray(a)[:len(rows)] for a in cands)
    return (pool, np.asarray(token)[:len(rows)], np.asarray(logits)[:len(rows)], streamed,
            cands)
