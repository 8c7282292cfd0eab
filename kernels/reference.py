"""Reference paged attention: gather the block table to a dense cache, then masked softmax.

This is the oracle every other path is compared against (the tests also check it against a
float64 NumPy oracle and a hand-computed case). Simple beats fast here: it writes the whole
gathered [B, Hkv, MB * bs, D] cache. Contract: kernels/contract.py.
"""
import functools

import jax
import jax.numpy as jnp

from . import contract


def paged_attention_reference(q, k_blocks, v_blocks, block_tables, context_lens, q_positions,
                              *, scale=None, k_scales=None, v_scales=None, layer=None):
  """The contract's paged attention; int8/fp8 blocks are dequantized (code * scale, in float32)
  after the gather; `layer` indexes a layer-stacked pool inside the gather."""
  k_blocks, v_blocks, k_scales, v_scales, layer = contract.as_layer_stacked(
      q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales, v_scales, layer)
  return _paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, q_positions,
                          k_scales, v_scales, layer,
                          scale=contract.softmax_scale(scale, q.shape[-1]))


@functools.partial(jax.jit, static_argnames=('scale',))
def _paged_attention(q, k_blocks, v_blocks, block_tables, context_lens, q_positions, k_scales,
                     v_scales, layer, *, scale):
  """Blocks (and scales) layer-stacked [L, N, ...]."""
  batch, num_q, num_heads, head_dim = q.shape
  num_kv_heads = k_blocks.shape[2]
  f32 = jnp.float32

  def dense(blocks, scales):  # -> [B, Hkv, MB * bs, D] float32: each sequence's dense cache
    gathered = blocks[layer, block_tables].astype(f32)  # [B, MB, Hkv, bs, D]
    if scales is not None:
      gathered = gathered * scales[layer, block_tables].astype(f32)[..., None]
    return jnp.moveaxis(gathered, 2, 1).reshape(batch, num_kv_heads, -1, head_dim)

  k, v = dense(k_blocks, k_scales), dense(v_blocks, v_scales)
  qg = q.astype(f32).reshape(batch, num_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
  scores = jnp.einsum('btkgd,bksd->bkgts', qg, k) * scale
  kv_pos = jnp.arange(k.shape[2])
  seen = contract.tokens_seen(q_positions, context_lens)  # [B, T]
  visible = (kv_pos[None, None, :] < seen[:, :, None])[:, None, None]  # [B, 1, 1, T, S]
  probs = contract.masked_softmax(scores, visible)
  # 0 * NaN is NaN: zero the slots past each context so garbage there cannot reach the output.
  in_context = (kv_pos[None, :] < context_lens[:, None])[:, None, :, None]
  v = jnp.where(in_context, v, 0.0)
  out = jnp.einsum('bkgts,bksd->btkgd', probs, v)
  return out.reshape(batch, num_q, num_heads, head_dim).astype(q.dtype)
