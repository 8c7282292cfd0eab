"""Reference paged attention: gather the block table to a dense cache, then masked softmax.

This is the oracle every other path is compared against. Simple beats fast here.

Shapes (one layer of the pool, see pagedjax/pool.py for the layout):
  q            [B, T, Hq, D]        T query tokens per sequence (T=1 for decode)
  k_pages      [N, Hkv, bs, D]      N physical blocks of bs token slots
  v_pages      [N, Hkv, bs, D]
  block_tables [B, MB] int32        logical block i of sequence b lives in block_tables[b, i]
  context_lens [B] int32            number of valid cached tokens (the chunk's own included)
  q_positions  [B, T] int32         absolute position of each query; -1 marks a padded query

Query t of sequence b attends to token positions p with p <= q_positions[b, t] and
p < context_lens[b]. A query that sees no token (padding, or an empty context) outputs zeros.
"""
import jax
import jax.numpy as jnp


def paged_attention_ref(q, k_pages, v_pages, block_tables, context_lens, q_positions, *,
                        scale=None, k_scales=None, v_scales=None, layer=None):
  """Optional: int8/fp8 pages with k_scales/v_scales [N, Hkv, bs] (dequantized after the
  gather); `layer` indexes layer-stacked pages [L, N, ...] (and scales) inside the gather."""
  batch, num_q, num_heads, head_dim = q.shape
  num_kv_heads, block_size = k_pages.shape[-3], k_pages.shape[-2]
  group = num_heads // num_kv_heads
  scale = head_dim ** -0.5 if scale is None else scale

  # [B, MB, Hkv, bs, D] -> [B, Hkv, MB*bs, D]: the dense cache of each sequence.
  def dense(pages, scales):
    gather = (lambda x: x[block_tables]) if layer is None else (lambda x: x[layer, block_tables])
    gathered = gather(pages).astype(jnp.float32)  # [B, MB, Hkv, bs, D]
    if scales is not None:
      gathered = gathered * gather(scales).astype(jnp.float32)[..., None]
    gathered = jnp.moveaxis(gathered, 2, 1)
    return gathered.reshape(batch, num_kv_heads, -1, head_dim)

  k, v = dense(k_pages, k_scales), dense(v_pages, v_scales)
  qg = q.astype(jnp.float32).reshape(batch, num_q, num_kv_heads, group, head_dim)
  scores = jnp.einsum('btkgd,bksd->bkgts', qg, k) * scale
  kv_pos = jnp.arange(k.shape[2])
  visible = ((kv_pos[None, None, :] <= q_positions[:, :, None])
             & (kv_pos[None, None, :] < context_lens[:, None, None]))  # [B, T, S]
  visible = visible[:, None, None]  # broadcast over kv heads and group
  scores = jnp.where(visible, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  # Mask the probabilities too, so NaN or inf in slots a query may not see cannot leak in.
  probs = jnp.where(visible, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(probs, axis=-1, keepdims=True)
  probs = probs / jnp.where(denom > 0, denom, 1.0)
  # 0 * NaN is NaN: zero the slots past each context so garbage there cannot reach the output.
  in_context = (kv_pos[None, :] < context_lens[:, None])[:, None, :, None]
  v = jnp.where(in_context, v, 0.0)
  out = jnp.einsum('bkgts,bksd->btkgd', probs, v)
  return out.reshape(batch, num_q, num_heads, head_dim).astype(q.dtype)
