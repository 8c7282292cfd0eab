"""Paged attention in plain JAX: a blockwise online-softmax loop (flash-decoding) for CPU.

Why this shape (what each choice was measured against: docs/attention.md, "How the xla kernel
is built"):
- Gathering the whole block table to a dense [B, MB*bs, ...] cache first (the reference) writes
  a fresh buffer as large as every visible context on every call, and writing it costs more
  than the attention that reads it. Here one loop step gathers a few consecutive logical blocks
  of every sequence (_TOKENS_PER_STEP tokens, straight into token order [B, Hkv, C*bs, D]: see
  _gather_tokens), which stay in cache while they are used, and folds them into a running
  (max, sum, accumulator) per query row.
- What paging still costs against a contiguous cache, at short contexts, is the gathers
  (XLA:CPU emits them element by element, where a contiguous read is a slice) and the loop's
  fixed cost per step. Gathering the whole bucketed table once and attending densely trades
  that for a buffer that leaves the cache; it pays off nowhere.
- The loop runs only as many steps as the longest visible context needs (a while loop with a
  traced trip count), so a bucketed block table with many padding entries costs nothing.
- All query heads of a KV group (and, in chunked prefill, all T query tokens) are rows of one
  [R = T*G, D] matrix per (sequence, KV head): each K/V block is read once for the group.
- With few rows (decode), scores are an explicit multiply-and-reduce, which XLA CPU fuses with the
  block's conversion; with many rows (prefill chunks) a dot is far cheaper. `_DOT_ROWS` splits.
- Masking uses `where`, never multiply-by-zero: slots past a sequence's length and blocks it does
  not own (the null block 0 included) may hold NaN or inf, and 0 * NaN is NaN.

Quantized blocks (int8 / float8_e4m3fn) with per-(token, KV head) scales (float16 from the
engine's pool) are dequantized here: the K scale multiplies the [R, bs] scores instead of the
[bs, D] block, the V scale the probabilities, so the block itself is only converted. Contract:
kernels/contract.py.
"""
import functools

import jax
import jax.numpy as jnp

from . import contract, xla_loops

# Rows (query tokens x heads per KV group) from which scores and outputs use dot_general rather
# than multiply-and-reduce. Decode has G (1-8) rows; prefill chunks have T*G.
_DOT_ROWS = 16
# Independent loops over slices of the batch (or of the context, for fewer sequences), and how
# many rows a decode loop needs: kernels/xla_loops.py (the simulator's cost model reads it too).
_SEQ_SPLITS = xla_loops.SEQ_SPLITS
# Context tokens one loop step reads (rounded down to whole blocks, at least one block). A loop
# step has a fixed cost far above reading one small block, so a step takes several blocks (four
# at block_size 16, a quarter of the steps); much larger steps gather more than stays in cache.
_TOKENS_PER_STEP = 64


# ------------------------------------------------------------------------------------------------
# Wrapper
# ------------------------------------------------------------------------------------------------
def paged_attention_xla(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, *,
                        scale=None, k_scales=None, v_scales=None, layer=None,
                        context_splits=None):
  """The contract's paged attention (kernels/contract.py). layer: index into a layer-stacked
  pool [L, N, ...] (and scales), read in place block by block. context_splits: split every
  sequence's context over that many loops (default: only when there are fewer sequences than
  loops, see _paged_attention)."""
  k_blocks, v_blocks, k_scales, v_scales, layer = contract.as_layer_stacked(
      q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales, v_scales, layer)
  return _paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, q_positions,
                          k_scales, v_scales, layer, contract.softmax_scale(scale, q.shape[-1]),
                          contract.check_context_splits(context_splits))


# ------------------------------------------------------------------------------------------------
# Kernel body
# ------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=('scale', 'context_splits'))
def _paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales,
                     v_scales, layer, scale, context_splits=None):
  """The work runs as independent loops. With enough sequences they take slices of the batch,
  each stopping at its own longest context; with fewer sequences than loops (long-context decode
  of one or two sequences) they take slices of the context instead, flash-decoding style, and
  their partial softmax states are merged (contract.merge_split_states). `context_splits` forces
  the latter. The loops are not there for parallelism (XLA already spreads one loop's gathers and
  reductions over the cores): each batch loop stops at its own slice's longest context, so a
  long sequence does not make every other sequence's loop run long. Every loop pays the loop
  step's fixed cost, so decode batches of fewer than SEQ_SPLITS * MIN_LOOP_ROWS sequences run
  as one loop (xla_loops.py)."""
  batch = q.shape[0]
  args = (k_blocks, v_blocks, k_scales, v_scales, layer, scale)
  if context_splits is None and batch >= _SEQ_SPLITS:
    bounds = xla_loops.batch_bounds(batch, q.shape[1])
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
      _, l, acc = _attend(q[a:b], block_tables[a:b], context_lens[a:b], q_positions[a:b], *args)
      outs.append(_layout(q[a:b], acc / jnp.where(l > 0, l, 1.0)[..., None]))  # 0 if unseen
    return jnp.concatenate(outs, axis=0)
  splits = context_splits or _SEQ_SPLITS
  parts = [_attend(q, block_tables, context_lens, q_positions, *args, part=(i, splits))
           for i in range(splits)]
  m, l, acc = (jnp.stack(x, axis=2) for x in zip(*parts))  # [B, Hkv, S, R(, D)]
  return _layout(q, contract.merge_split_states(acc, m, l))


def _layout(q, out):
  """[B, Hkv, R, D] rows back out as [B, T, Hq, D] in q's dtype."""
  return contract.ungroup_rows(out, q.shape[1], q.shape[2]).astype(q.dtype)


_BITS = {1: jnp.uint8, 2: jnp.uint16}


def _as_bits(blocks):
  """Float blocks narrower than 32 bits reinterpreted as unsigned ints. XLA CPU gathers integers
  natively, but upcasts a bfloat16/fp8 operand of a gather to float32 first, and being
  loop-invariant that conversion is hoisted out of the loop: the whole pool (every layer's, in
  the model's layer scan) converted on every call. The bitcast is not free either: when the
  loop's trip count is traced, XLA materialises the bitcast pool once per call as a copy in the
  entry computation (a copy of a narrow pool, where the conversion writes a float32 one and
  reads it back). (float16 scales are gathered as they are: no whole-array conversion shows in the compiled
  loop.)"""
  if jnp.issubdtype(blocks.dtype, jnp.floating) and blocks.dtype.itemsize < 4:
    return jax.lax.bitcast_convert_type(blocks, _BITS[blocks.dtype.itemsize])
  return blocks


def _widen(x, dtype):
  """Gathered raw values (`bits` from _as_bits) of a `dtype` pool as float32."""
  if dtype == jnp.bfloat16:  # bfloat16 is the top half of a float32: shift, no convert
    return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
  if x.dtype != dtype:
    x = jax.lax.bitcast_convert_type(x, dtype)
  return x.astype(jnp.float32)


def _gather_block(bits, layer, block, dtype):
  """Blocks `block` (any index shape, e.g. [B] or [B, C]) of every sequence, [..., Hkv, bs, D],
  as float32 (`bits` from _as_bits, layer-stacked: the gather indexes the layer itself, so no
  layer is ever sliced out). experiments/bench_attention.py's contiguous loop reads with it."""
  return _widen(bits[layer, block], dtype)


def _gather_tokens(x, layer, block):
  """Blocks `block` [B, C] of layer-stacked `x` [L, N, Hkv, bs, ...] straight into token order,
  [B, Hkv, C*bs, ...], raw (not widened).

  The pool is viewed (a free reshape) as one row per (layer, block, KV head) and the gather
  picks row (layer * N + block) * Hkv + h for output [b, h, c]: its output is already in token
  order. Gathering whole [Hkv, bs, D] blocks and then moving the KV-head axis in front costs
  more: XLA:CPU fuses that transpose into the gather's loop, element by element."""
  num_layers, num_blocks, num_kv_heads, block_size = x.shape[:4]
  rows = x.reshape(num_layers * num_blocks * num_kv_heads, -1)
  heads = jnp.arange(num_kv_heads, dtype=block.dtype)
  index = (layer * num_blocks + block)[:, None, :] * num_kv_heads + heads[None, :, None]
  out = rows[index]  # [B, Hkv, C, bs * ...]
  return out.reshape(block.shape[0], num_kv_heads, block.shape[1] * block_size, *x.shape[4:])


def _blocks_per_step(block_size: int, max_blocks: int) -> int:
  """Logical blocks one loop step folds in: about _TOKENS_PER_STEP tokens, at most the table."""
  return max(1, min(max_blocks, _TOKENS_PER_STEP // block_size))


def _attend(q, block_tables, context_lens, q_positions, k_blocks, v_blocks, k_scales, v_scales,
            layer, scale, part=(0, 1)):
  """Online softmax over the blocks of context slice `part` = (index, count) -> the unnormalised
  state (m running max, l sum [B, Hkv, R]; acc [B, Hkv, R, D]) as (m, l, acc).

  One loop step takes C = _blocks_per_step consecutive logical blocks of every sequence
  ([B, C, Hkv, bs, D], C*bs tokens). Entries past the table's width are clamped to its last
  column and, like every slot at or past a sequence's length, masked out with `where`."""
  batch, num_q, num_heads, head_dim = q.shape
  _, _, num_kv_heads, block_size, _ = k_blocks.shape
  max_blocks = block_tables.shape[1]
  group = num_heads // num_kv_heads
  rows = num_q * group
  use_dot = rows >= _DOT_ROWS
  f32 = jnp.float32
  per_step = _blocks_per_step(block_size, max_blocks)
  span = per_step * block_size  # tokens per loop step

  qg = contract.group_rows(q.astype(f32) * scale, num_kv_heads)  # [B, Hkv, R, D], pre-scaled
  seen = contract.tokens_seen(q_positions, context_lens)  # [B, T]
  if num_q == 1:  # decode: every row of a group sees the same tokens; keep the mask narrow
    row_seen = seen[:, None, :, None]  # [B, 1, 1, 1]
  else:
    row_seen = contract.rows_seen(seen, group)[:, None, :, None]  # [B, 1, R, 1]
  num_blocks = jnp.max(contract.visible_blocks(seen, block_size, max_blocks))
  num_steps = (num_blocks + per_step - 1) // per_step
  index, count = part
  per_part = (num_steps + count - 1) // count
  first, last = index * per_part, jnp.minimum((index + 1) * per_part, num_steps)

  k_bits, v_bits = _as_bits(k_blocks), _as_bits(v_blocks)

  def step(j, carry):
    m, l, acc = carry  # [B, Hkv, R], [B, Hkv, R], [B, Hkv, R, D]
    logical = j * per_step + jnp.arange(per_step)
    block = jnp.take(block_tables, logical, axis=1, mode='clip')  # [B, C]
    pos = j * span + jnp.arange(span)
    visible = pos[None, None, None, :] < row_seen  # [B, 1, R, C*bs]
    in_context = (pos[None, :] < context_lens[:, None])[:, None, :, None]  # [B, 1, C*bs, 1]

    k = _widen(_gather_tokens(k_bits, layer, block), k_blocks.dtype)  # [B, Hkv, C*bs, D]
    if use_dot:
      s = jnp.einsum('bhrd,bhsd->bhrs', qg, k)
    else:
      s = jnp.sum(qg[:, :, :, None, :] * k[:, :, None, :, :], axis=-1)  # [B, Hkv, R, C*bs]
    if k_scales is not None:  # k = code * scale per token: scale the score columns
      s = s * _gather_tokens(k_scales, layer, block).astype(f32)[:, :, None, :]
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    # A row that has seen nothing yet keeps m = -inf; shift by 0 so exp() stays NaN-free.
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.where(visible, jnp.exp(s - m_shift[..., None]), 0.0)
    alpha = jnp.exp(m - m_shift)
    l = l * alpha + jnp.sum(p, axis=-1)  # the denominator takes the unscaled probabilities
    if v_scales is not None:  # v = code * scale: fold it into p; `where` again, a scale may be NaN
      p = jnp.where(visible, p * _gather_tokens(v_scales, layer, block).astype(f32)[:, :, None, :],
                    0.0)

    v = jnp.where(in_context, _widen(_gather_tokens(v_bits, layer, block), v_blocks.dtype), 0.0)
    if use_dot:
      pv = jnp.einsum('bhrs,bhsd->bhrd', p, v)
    else:
      pv = jnp.sum(p[..., None] * v[:, :, None, :, :], axis=-2)  # [B, Hkv, R, D]
    return m_new, l, acc * alpha[..., None] + pv

  init = (jnp.full((batch, num_kv_heads, rows), -jnp.inf, f32),
          jnp.zeros((batch, num_kv_heads, rows), f32),
          jnp.zeros((batch, num_kv_heads, rows, head_dim), f32))
  return jax.lax.fori_loop(first, jnp.maximum(first, last), step, init)
