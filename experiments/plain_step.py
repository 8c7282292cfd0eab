"""The decode step written as plain, unrolled JAX: the yardstick between the engine and the floor.

experiments/bench_decode.py times three things per batch: the engine's decode step (Flax, layers
under `nn.scan`, paged attention over the layer-stacked pool), the step's matmuls alone (the
floor), and this: the same decode step with none of the engine's structure. No Flax, a Python
loop over layers (each layer's weights sliced out of the params tree once, up front, so the
compiled program sees 30 separate weight arrays), and a dense contiguous KV cache per layer
[B, Hkv, S, Dh] that the step writes at each row's position and attends over with one masked
softmax. The math is pagedjax/model/llama.py's (RMSNorm, HF rotate-half RoPE, SwiGLU, GQA,
tied or untied head, compute in the model's dtype with float32 norms and RoPE), so
  - plain / floor says what attention, norms and the rest cost on top of the matmuls when XLA
    compiles the step as simply as it can be written;
  - step / plain says what paging, Flax and the layer scan cost on top of that.
tests/test_bench_decode.py checks its logits and greedy tokens against the engine's.
"""
from typing import List, NamedTuple

import jax
import jax.numpy as jnp

from pagedjax.model.llama import DTYPES, ModelConfig


class LayerWeights(NamedTuple):
  attn_norm: jax.Array  # [D]
  q: jax.Array  # [D, Hq*Dh]
  k: jax.Array  # [D, Hkv*Dh]
  v: jax.Array
  q_bias: jax.Array  # [Hq*Dh], or a zero-size array without biases
  k_bias: jax.Array
  v_bias: jax.Array
  o: jax.Array  # [Hq*Dh, D]
  mlp_norm: jax.Array  # [D]
  gate: jax.Array  # [D, F]
  up: jax.Array
  down: jax.Array  # [F, D]


class Weights(NamedTuple):
  embed: jax.Array  # [V, D]
  layers: List[LayerWeights]
  final_norm: jax.Array  # [D]
  head: jax.Array  # [D, V]: the transposed embedding when tied (transposed once, here)


def split_weights(cfg: ModelConfig, params) -> Weights:
  """Per-layer arrays out of llama.py's layer-stacked params tree, copied once (no slicing left
  for the step to do)."""
  p = params['params']
  lay = p['layers']
  attn, mlp = lay['attn'], lay['mlp']
  empty = jnp.zeros((0,), jnp.float32)
  bias = lambda name, i: attn[name]['bias'][i] if cfg.qkv_bias else empty
  layers = []
  for i in range(cfg.num_layers):
    layers.append(LayerWeights(
        attn_norm=lay['attn_norm']['scale'][i],
        q=attn['q_proj']['kernel'][i], k=attn['k_proj']['kernel'][i],
        v=attn['v_proj']['kernel'][i],
        q_bias=bias('q_proj', i), k_bias=bias('k_proj', i), v_bias=bias('v_proj', i),
        o=attn['o_proj']['kernel'][i],
        mlp_norm=lay['mlp_norm']['scale'][i],
        gate=mlp['gate_proj']['kernel'][i], up=mlp['up_proj']['kernel'][i],
        down=mlp['down_proj']['kernel'][i]))
  embed = p['embed']['embedding']
  head = embed.T if cfg.tie_embeddings else p['lm_head']['kernel']
  weights = Weights(embed, layers, p['final_norm']['scale'], head)
  return jax.tree.map(lambda x: jnp.array(x, copy=True), weights)


def init_cache(cfg: ModelConfig, batch: int, length: int):
  """An all-zero dense cache: per layer (k, v), each [batch, Hkv, length, Dh] in the model's
  dtype."""
  shape = (batch, cfg.num_kv_heads, length, cfg.head_dim)
  dtype = DTYPES[cfg.dtype]
  return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]


def _rms_norm(x, scale, eps):
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (normed * scale).astype(x.dtype)


def _rope(x, positions, theta):
  """x [B, H, Dh] at positions [B], HF rotate-half pairs, in float32."""
  head_dim = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [B, Dh/2]
  cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _dense(x, kernel, dtype, bias=None):
  out = jnp.dot(x.astype(dtype), kernel.astype(dtype))
  return out if bias is None or bias.size == 0 else out + bias.astype(dtype)


def decode_step(cfg: ModelConfig, weights: Weights, cache, tokens, positions):
  """One token per row: tokens [B] at positions [B] (each row's cache holds positions
  0..position-1 already) -> (cache with this token's K/V written, logits [B, V] float32)."""
  dtype = DTYPES[cfg.dtype]
  batch = tokens.shape[0]
  heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  group = heads // kv_heads
  rows = jnp.arange(batch)
  length = cache[0][0].shape[2]
  visible = jnp.arange(length)[None, :] <= positions[:, None]  # [B, S]
  x = weights.embed[tokens].astype(dtype)  # [B, D]
  new_cache = []
  for w, (k_cache, v_cache) in zip(weights.layers, cache):
    h = _rms_norm(x, w.attn_norm, cfg.norm_eps)
    q = _rope(_dense(h, w.q, dtype, w.q_bias).reshape(batch, heads, head_dim), positions,
              cfg.rope_theta)
    k = _rope(_dense(h, w.k, dtype, w.k_bias).reshape(batch, kv_heads, head_dim), positions,
              cfg.rope_theta)
    v = _dense(h, w.v, dtype, w.v_bias).reshape(batch, kv_heads, head_dim)
    k_cache = k_cache.at[rows, :, positions].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[rows, :, positions].set(v.astype(v_cache.dtype))
    new_cache.append((k_cache, v_cache))
    qg = q.astype(jnp.float32).reshape(batch, kv_heads, group, head_dim) * head_dim ** -0.5
    scores = jnp.einsum('bkgd,bksd->bkgs', qg, k_cache.astype(jnp.float32))
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    attn = jnp.einsum('bkgs,bksd->bkgd', probs, v_cache.astype(jnp.float32))
    x = x + _dense(attn.reshape(batch, heads * head_dim).astype(dtype), w.o, dtype)
    h = _rms_norm(x, w.mlp_norm, cfg.norm_eps)
    x = x + _dense(jax.nn.silu(_dense(h, w.gate, dtype)) * _dense(h, w.up, dtype), w.down,
                   dtype)
  x = _rms_norm(x, weights.final_norm, cfg.norm_eps)
  logits = jnp.dot(x.astype(jnp.float32), weights.head.astype(jnp.float32))
  return new_cache, logits


def jitted_decode_step(cfg: ModelConfig, return_logits: bool = False):
  """decode_step jitted for cfg, the cache donated (written in place, like the engine's pool):
  (weights, cache, tokens, positions) -> (cache, greedy tokens [B] int32[, logits [B, V]]).
  Without logits only the tokens leave the step, as in the engine's default step."""
  def step(weights, cache, tokens, positions):
    cache, logits = decode_step(cfg, weights, cache, tokens, positions)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return (cache, greedy, logits) if return_logits else (cache, greedy)
  return jax.jit(step, donate_argnums=(1,))


def timed_step_fn(cfg: ModelConfig, params, batch: int, context: int):
  """A zero-arg callable running one plain decode step at `batch` rows, each attending over
  `context` cached tokens (the new one included), for bench_decode's timing. Each call writes
  the same positions again, so every call does the same work."""
  if context < 1:
    raise ValueError(f'context={context} is not allowed: at least 1 token')
  weights = split_weights(cfg, params)
  step = jitted_decode_step(cfg)
  state = {'cache': init_cache(cfg, batch, context)}
  tokens = jnp.zeros((batch,), jnp.int32)
  positions = jnp.full((batch,), context - 1, jnp.int32)

  def call():
    state['cache'], next_tokens = step(weights, state['cache'], tokens, positions)
    return next_tokens
  return call
