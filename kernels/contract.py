"""The contract every paged-attention path implements, and the helpers their wrappers share.

Arguments (the pool layout is pagedjax/device/pool.py's):
  q            [B, T, Hq, D]         T query tokens per sequence (T=1 for decode)
  k_blocks     [N, Hkv, bs, D]       N physical blocks of bs token slots each, one layer; with
               [L, N, Hkv, bs, D]    `layer`, the whole layer-stacked pool, read at that layer
  v_blocks     same as k_blocks
  block_tables [B, MB] int32         logical block i of sequence b is physical block
                                     block_tables[b, i]; padding entries point at the null block 0
  context_lens [B] int32             valid cached tokens per sequence (the chunk's own included)
  q_positions  [B, T] int32          absolute position of each query; -1 marks a padded query
  k_scales,    [N, Hkv, bs]          int8 / float8_e4m3fn blocks only: one scale per (token, KV
  v_scales     ([L, N, Hkv, bs])     head), float16 as the engine's pool stores them (bfloat16 and
                                     float32 are accepted too); the value is code * scale, and
                                     every path widens both to float32 inside its kernel
  layer        int or traced int32 scalar, or None (single-layer blocks)

Query t of sequence b attends to token positions p with p <= q_positions[b, t] and
p < context_lens[b]; Hq = G * Hkv and query head h reads KV head h // G. A query that sees no
token (padding, an empty context) outputs zeros. The output is [B, T, Hq, D] in q's dtype. Slots
past a sequence's length and blocks it does not own (the null block included) may hold NaN or
inf: no path may let them reach the output.

Row grouping. The G query heads of one KV head, for all T query tokens, share every K/V block
they read, so the kernels treat them as the R = T * G rows of one [R, D] matrix per (sequence,
KV head), ordered (t, g): `group_rows` builds it, `ungroup_rows` undoes it. The GPU kernels pad
R to `gpu_rows(R)` (a power of two >= 16, Triton's smallest dot), padded rows seeing no token.

Context splits (flash-decoding). Paths that split a sequence's blocks over several programs or
loops combine their unnormalised softmax states with `merge_split_states`. The GPU paths
(pallas_gpu, triton) pick their static split count with `split_count`.
"""
import numbers

import jax
import jax.numpy as jnp

# Block dtypes the kernels dequantize themselves (code * scale per token and KV head).
QUANT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
# Scale dtypes every path widens to float32; the engine stores float16.
SCALE_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Triton's dot needs every dimension >= 16: the GPU kernels pad their rows to at least this.
MIN_DOT = 16


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------
def as_layer_stacked(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales,
                     v_scales, layer):
  """What every wrapper starts with: checks the contract (ValueError naming the bad value and
  what is allowed) and returns (k_blocks, v_blocks, k_scales, v_scales, layer) layer-stacked.
  Given `layer`, the blocks must already be stacked; without, one layer's blocks are viewed as a
  stack of one (a free reshape) read at layer 0, and None scales stay None."""
  if layer is None:
    stack = lambda x: None if x is None else x[None]
    k_blocks, v_blocks, k_scales, v_scales = map(stack, (k_blocks, v_blocks, k_scales, v_scales))
    layer = 0
  elif k_blocks.ndim != 5:
    raise ValueError(f'with layer=, k_blocks must be a layer-stacked pool [L, N, Hkv, bs, D], '
                     f'got shape {k_blocks.shape}')
  if k_blocks.ndim != 5 or k_blocks.shape != v_blocks.shape:
    raise ValueError(f'k_blocks and v_blocks must both be [N, Hkv, bs, D] (or [L, N, Hkv, bs, '
                     f'D] with layer=), got {k_blocks.shape} and {v_blocks.shape}')
  if jnp.ndim(layer) != 0:
    raise ValueError(f'layer must be a scalar, got shape {jnp.shape(layer)}')
  _check_layer(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales,
               v_scales)
  return k_blocks, v_blocks, k_scales, v_scales, layer


def _check_layer(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales,
                 v_scales):
  """The shape and dtype contract, blocks and scales layer-stacked."""
  if q.ndim != 4:
    raise ValueError(f'q must be [B, T, Hq, D], got shape {q.shape}')
  batch, num_q, num_heads, head_dim = q.shape
  _, _, num_kv_heads, _, block_dim = k_blocks.shape
  if block_dim != head_dim:
    raise ValueError(f'q head_dim {head_dim} != the blocks\' head_dim {block_dim}')
  if num_heads % num_kv_heads:
    raise ValueError(f'{num_heads} query heads are not a multiple of {num_kv_heads} KV heads')
  if block_tables.ndim != 2 or block_tables.shape[0] != batch:
    raise ValueError(f'block_tables must be [B={batch}, MB], got {block_tables.shape}')
  if context_lens.shape != (batch,):
    raise ValueError(f'context_lens must be [B={batch}], got {context_lens.shape}')
  if q_positions.shape != (batch, num_q):
    raise ValueError(f'q_positions must be [B={batch}, T={num_q}], got {q_positions.shape}')
  for name, x in (('block_tables', block_tables), ('context_lens', context_lens),
                  ('q_positions', q_positions)):
    if x.dtype != jnp.int32:
      raise ValueError(f'{name} must be int32, got {x.dtype}')
  if (k_scales is None) != (v_scales is None):
    raise ValueError('pass both k_scales and v_scales or neither')
  dtype = jnp.dtype(k_blocks.dtype)
  if dtype != v_blocks.dtype:
    raise ValueError(f'k_blocks and v_blocks must share a dtype, got {dtype} and '
                     f'{v_blocks.dtype}')
  quantized = dtype in QUANT_DTYPES
  if k_scales is None:
    if quantized:
      raise ValueError(f'{dtype} blocks need k_scales and v_scales')
    return
  if not quantized:
    raise ValueError(f'scales given but the blocks are {dtype}, not one of '
                     f'{[str(d) for d in QUANT_DTYPES]}')
  want = k_blocks.shape[:4]
  if k_scales.shape != want or v_scales.shape != want:
    raise ValueError(f'k_scales/v_scales must be one per (token, KV head), {want}, got '
                     f'{k_scales.shape} and {v_scales.shape}')
  for scales in (k_scales, v_scales):
    if jnp.dtype(scales.dtype) not in SCALE_DTYPES:
      raise ValueError(f'scales must be one of {[str(d) for d in SCALE_DTYPES]}, got '
                       f'{scales.dtype}')


def require_pow2(impl, block_size, head_dim):
  """The GPU kernels' block shapes are Triton tiles: powers of two."""
  if not (pow2(block_size) and pow2(head_dim)):
    raise ValueError(f'{impl} needs block_size and head_dim to be powers of two (Triton block '
                     f'shapes), got block_size={block_size}, head_dim={head_dim}')


def check_context_splits(context_splits):
  """None (the path's default) or a Python int >= 1: a split count sets a grid or a number of
  loops, so it is static."""
  if context_splits is None:
    return None
  if (isinstance(context_splits, bool) or not isinstance(context_splits, numbers.Integral)
      or context_splits < 1):
    raise ValueError(f'context_splits must be None or an int >= 1, got {context_splits!r}')
  return int(context_splits)


def pow2(n):
  return n > 0 and n & (n - 1) == 0


def softmax_scale(scale, head_dim):
  """The score scale as a Python float (a static argument of every kernel): 1/sqrt(D) unless
  given."""
  return float(head_dim ** -0.5 if scale is None else scale)


def layer_index(layer):
  """`layer` (a Python or traced int) as the 1-element int32 array the kernels read."""
  return jnp.asarray(layer, jnp.int32).reshape(1)


# ------------------------------------------------------------------------------------------------
# Row grouping
# ------------------------------------------------------------------------------------------------
def group_rows(q, num_kv_heads, rows_to=None):
  """q [B, T, Hq, D] -> [B, Hkv, R, D], the rows of a KV group ordered (t, g); zero-padded to
  `rows_to` rows when given."""
  batch, num_q, num_heads, head_dim = q.shape
  group = num_heads // num_kv_heads
  rows = q.reshape(batch, num_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
  rows = rows.reshape(batch, num_kv_heads, num_q * group, head_dim)
  if rows_to is not None and rows_to > num_q * group:
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, rows_to - num_q * group), (0, 0)))
  return rows


def ungroup_rows(out, num_q, num_heads):
  """[B, Hkv, R(padded), D] -> [B, T, Hq, D]: the inverse of group_rows (padded rows dropped)."""
  batch, num_kv_heads, _, head_dim = out.shape
  group = num_heads // num_kv_heads
  out = out[:, :, :num_q * group].reshape(batch, num_kv_heads, num_q, group, head_dim)
  return out.transpose(0, 2, 1, 3, 4).reshape(batch, num_q, num_heads, head_dim)


def tokens_seen(q_positions, context_lens):
  """[B, T] int32: how many leading tokens each query sees, min(position + 1, length), and 0
  for a padded query (position -1)."""
  return jnp.clip(jnp.minimum(q_positions + 1, context_lens[:, None]), 0, None)


def masked_softmax(scores, visible):
  """Softmax over the last axis among the `visible` entries (a mask broadcastable to scores).
  The probabilities are masked too, so NaN or inf in slots a query may not see cannot leak in;
  a row that sees nothing is all zeros, not NaN."""
  scores = jnp.where(visible, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(visible, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(probs, axis=-1, keepdims=True)
  return probs / jnp.where(denom > 0, denom, 1.0)


def rows_seen(seen, group, rows_to=None):
  """tokens_seen [B, T] -> [B, R] per row (ordered (t, g) as in group_rows); rows padded to
  `rows_to` see nothing."""
  per_row = jnp.repeat(seen, group, axis=1)
  if rows_to is not None and rows_to > per_row.shape[1]:
    per_row = jnp.pad(per_row, ((0, 0), (0, rows_to - per_row.shape[1])))
  return per_row.astype(jnp.int32)


def visible_blocks(seen, block_size, max_blocks):
  """tokens_seen [B, T] -> [B] int32: the logical blocks a sequence's queries see at all (the
  kernels never read past them: padding entries and the null block stay untouched)."""
  counts = (jnp.max(seen, axis=1) + block_size - 1) // block_size
  return jnp.minimum(max_blocks, counts).astype(jnp.int32)


def gpu_rows(rows):
  """Rows of a GPU kernel's tile: a power of two (Triton tiles), at least MIN_DOT."""
  return max(MIN_DOT, 1 << (rows - 1).bit_length())


# ------------------------------------------------------------------------------------------------
# Context splits
# ------------------------------------------------------------------------------------------------
def merge_split_states(acc, m, l):
  """Online-softmax states of disjoint key ranges (flash-decoding splits) -> the normalised
  output. acc [..., S, R, D] unnormalised, m (running max) and l (sum) [..., S, R], float32;
  returns [..., R, D] float32. A split that saw nothing (m = -inf) weighs exp(-inf) = 0; a row
  that saw nothing anywhere gets 0."""
  m_max = jnp.max(m, axis=-2, keepdims=True)
  weight = jnp.exp(m - jnp.where(m_max == -jnp.inf, 0.0, m_max))  # [..., S, R]
  total = jnp.sum(weight * l, axis=-2)
  out = jnp.sum(weight[..., None] * acc, axis=-3)
  return out / jnp.where(total > 0, total, 1.0)[..., None]


# Fallback SM count (H100 / H200) when the device does not report one (e.g. interpreting on CPU).
_DEFAULT_SMS = 132
# Fewest tokens worth a split of their own: below this the partial writes and the merge cost
# more than the extra parallelism buys.
_MIN_SPLIT_TOKENS = 256


def default_gpu_splits(batch, num_kv_heads, max_blocks, block_size):
  """Context splits for a GPU launch, from shapes only (the count sets the grid, so it is
  static; block_tables.shape[1] is the bucketed max blocks): about two programs per SM, so one
  slow program does not leave the GPU idle, but at least ~256 tokens a split, since shorter
  splits add partial writes and merge work for little parallelism; at most one split per block.
  Both constants are unmeasured guesses (vLLM's paged attention v2 partitions at 512 tokens).
  SMs: the GPU device's `core_count` when it reports one, else 132 (H100 / H200)."""
  device = jax.devices()[0]
  sms = getattr(device, 'core_count', None) if device.platform == 'gpu' else None
  sms = sms or _DEFAULT_SMS
  wanted = -(-2 * sms // max(1, batch * num_kv_heads))
  min_blocks = max(1, _MIN_SPLIT_TOKENS // block_size)
  return max(1, min(wanted, -(-max_blocks // min_blocks)))


def split_count(context_splits, batch, num_kv_heads, max_blocks, block_size):
  """The static split count a GPU launch uses: `context_splits` (None: default_gpu_splits),
  validated, then trimmed so that no split starts past the last block (7 blocks in 5 splits
  would give per = 2 and an empty fifth split: 4 splits of 2, 2, 2, 1 instead)."""
  context_splits = check_context_splits(context_splits)
  if context_splits is None:
    context_splits = default_gpu_splits(batch, num_kv_heads, max_blocks, block_size)
  if max_blocks <= 1:
    return 1
  per = -(-max_blocks // min(context_splits, max_blocks))
  return -(-max_blocks // per)
