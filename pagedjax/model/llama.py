"""A Llama-family decoder in Flax: RMSNorm, RoPE, SwiGLU, MHA/GQA/MQA, tied or untied embeddings.

The layers are stacked with `nn.scan` (one compiled layer body, fast compiles for deep models),
so every parameter under `layers` has a leading [num_layers] axis. Attention either reads and
writes the paged KV pool (`pool` and `batch` given) or, with no cache at all, attends causally
within the tokens passed (the dense oracle the tests compare paging against).

Params tree (kernels are [in, out]):
  embed/embedding [V, D]; final_norm/scale [D]; lm_head/kernel [D, V] (untied only)
  layers/attn_norm/scale [L, D]; layers/mlp_norm/scale [L, D]
  layers/attn/{q_proj [L, D, Hq*Dh], k_proj [L, D, Hkv*Dh], v_proj [L, D, Hkv*Dh],
               o_proj [L, Hq*Dh, D]}/kernel   (+ q/k/v_proj/bias [L, H*Dh] when qkv_bias)
  layers/mlp/{gate_proj [L, D, F], up_proj [L, D, F], down_proj [L, F, D]}/kernel
RoPE uses the Hugging Face "rotate half" layout (first half of each head paired with the second).

With a device mesh (`mesh`, see pagedjax/model/sharding.py) the K/V write and paged attention run per
shard under shard_map, each device on its own query and KV heads; everything else is ordinary
JAX that GSPMD partitions from the parameters' shardings. `mesh=None` is the single-device path.
"""
import dataclasses
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np

from pagedjax.device import pool as pool_lib
from pagedjax.kernels import linear_cpu
from pagedjax.model import sharding

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}
LAYER_LOOPS = ('scan', 'unrolled')  # Llama.layer_loop
LINEAR_IMPLS = linear_cpu.LINEAR_IMPLS  # Llama.linear_impl
# Every decoder layer's Dense projections, as (module, name) in its params tree, in call order.
PROJECTIONS = (('attn', 'q_proj'), ('attn', 'k_proj'), ('attn', 'v_proj'), ('attn', 'o_proj'),
               ('mlp', 'gate_proj'), ('mlp', 'up_proj'), ('mlp', 'down_proj'))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  max_seq_len: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  qkv_bias: bool = False  # Qwen2-style checkpoints have biases on q/k/v
  dtype: str = 'float32'  # compute dtype; params stay float32


# ------------------------------------------------------------------------------------------------
# The linear layers' matmuls (linear_impl): 'xla' is XLA's dot; 'cpu' the native kernel
# (kernels/linear_cpu.py) for float32 calls of linear_cpu.MIN_ROWS to MAX_ROWS rows (decode
# steps of 2-64 rows), XLA's dot otherwise; 'cpu_fused' is 'cpu' with q/k/v and gate/up each in
# one kernel call (dense_group); 'cpu_packed' is 'cpu' with decode calls reading packed copies
# (per_layer_params(pack=True)); 'auto' is 'cpu_packed' on a CPU backend where the kernel builds,
# else 'xla'. Same params, same math; the kernel sums in its own fixed order (float32 rounding
# differences), the same order fused or not.
# ------------------------------------------------------------------------------------------------
def dense(features: int, name: Optional[str], dtype, linear_impl: str, use_bias: bool = False):
  """nn.Dense whose matmul runs as linear_impl says."""
  return nn.Dense(features, use_bias=use_bias, dtype=dtype, name=name,
                  dot_general=linear_cpu.dot_general(linear_impl),
                  promote_dtype=linear_cpu.promote_dtype)  # lets a packed kernel through


class DenseParams(nn.Module):
  """nn.Dense's parameters (kernel [in, out]; bias [out] with use_bias): the same names, shapes,
  dtype and initializers, returned instead of applied, for dense_group's one call."""
  features: int
  use_bias: bool = False

  @nn.compact
  def __call__(self, in_features: int):
    kernel = self.param('kernel', nn.linear.default_kernel_init, (in_features, self.features),
                        jnp.float32)
    bias = (self.param('bias', nn.initializers.zeros_init(), (self.features,), jnp.float32)
            if self.use_bias else None)
    return kernel, bias


def dense_group(x, features, names, dtype, linear_impl: str, use_bias: bool = False) -> list:
  """[dense(f, name, ...)(x) for each feature count and name]: several Dense layers of one input
  (q/k/v, gate/up). Where linear_impl fuses ('cpu_fused', kernels/linear_cpu.py) and the
  kernel runs for x, one linear_many call multiplies them all, each kernel read in place: the
  same params, each output bit for bit its own call's."""
  shapes = [jax.ShapeDtypeStruct((x.shape[-1], f), jnp.float32) for f in features]
  if not (linear_cpu.fuses(linear_impl) and dtype == jnp.float32
          and all(linear_cpu.runs_kernel(x, w) for w in shapes)):
    return [dense(f, name, dtype, linear_impl, use_bias)(x) for f, name in zip(features, names)]
  params = [DenseParams(f, use_bias, name=name)(x.shape[-1]) for f, name in zip(features, names)]
  ys = linear_cpu.linear_many(x, [kernel for kernel, _ in params], impl=linear_impl)
  return [y if bias is None else y + bias for y, (_, bias) in zip(ys, params)]


def tied_logits(x, embedding, linear_impl: str):
  """The tied head x [..., D] @ embedding.T (nn.Embed.attend for float32 x and embedding [V, D])
  through linear_impl: the kernel reads the embedding in place as the transposed operand. A
  linear_cpu.Packed `embedding` is that transpose already packed ([D, V], per_layer_params
  with pack=True): the kernel reads its strips."""
  if isinstance(embedding, linear_cpu.Packed):
    return linear_cpu.linear(x, embedding)
  if linear_cpu.resolve(linear_impl) in linear_cpu.KERNEL_IMPLS and linear_cpu.runs_kernel(
      x, embedding):
    return linear_cpu.linear(x, embedding, transposed=True)
  return jnp.dot(x, embedding.T)


def rope(x, positions, theta):
  """x [B, T, H, Dh], positions [B, T] -> x rotated by its absolute position."""
  head_dim = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def dense_causal_attention(q, k, v):
  """No-cache attention within the chunk: q [B, T, Hq, Dh], k/v [B, T, Hkv, Dh]."""
  batch, length, num_heads, head_dim = q.shape
  group = num_heads // k.shape[2]
  qg = q.astype(jnp.float32).reshape(batch, length, k.shape[2], group, head_dim)
  scores = jnp.einsum('btkgd,bskd->bkgts', qg, k.astype(jnp.float32)) * head_dim ** -0.5
  causal = jnp.tril(jnp.ones((length, length), bool))
  scores = jnp.where(causal, scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum('bkgts,bskd->btkgd', probs, v.astype(jnp.float32))
  return out.reshape(batch, length, num_heads, head_dim).astype(q.dtype)


def write_and_attend(pool, layer, q, k, v, positions, batch, impl: str,
                     mesh: Optional[Mesh] = None):
  """Write this chunk's K/V [B, T, Hkv, Dh] into the pool, then attend q [B, T, Hq, Dh] over it.

  With a mesh both run per shard: q, k, v and the pool's KV-head axis are split, the paging
  metadata (slots, block tables, lengths, positions) is replicated, so each device writes and
  reads only its own heads of the same blocks, in place, with no communication.
  """
  def local(pool, layer, q, k, v, positions, batch):
    return pool_lib.write_and_attend(pool, layer, q, k, v, positions, batch, impl)

  if mesh is None:
    return local(pool, layer, q, k, v, positions, batch)
  heads, rep = sharding.HEADS_SPEC, sharding.REPLICATED
  return sharding.per_shard(local, mesh, in_specs=(sharding.POOL_SPEC, rep, heads, heads, heads,
                                                   rep, rep),
                            out_specs=(heads, sharding.POOL_SPEC))(
                                pool, layer, q, k, v, positions, batch)


class RMSNorm(nn.Module):
  eps: float

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],))
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * scale).astype(x.dtype)


class Attention(nn.Module):
  cfg: ModelConfig
  attention_impl: str
  mesh: Optional[Mesh] = None
  linear_impl: str = 'auto'

  @nn.compact
  def __call__(self, x, positions, pool, batch, layer):
    cfg = self.cfg
    proj = lambda n, name, bias=False: dense(n, name, DTYPES[cfg.dtype], self.linear_impl, bias)
    b, t, _ = x.shape
    q, k, v = dense_group(
        x, (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim), ('q_proj', 'k_proj', 'v_proj'),
        DTYPES[cfg.dtype], self.linear_impl, cfg.qkv_bias)
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    # Padded queries carry position -1 (see step_inputs.py); rotate them as position 0.
    rope_positions = jnp.maximum(positions, 0)
    q = rope(q, rope_positions, cfg.rope_theta)
    k = rope(k, rope_positions, cfg.rope_theta)
    if pool is None:
      out = dense_causal_attention(q, k, v)
    else:
      out, pool = write_and_attend(pool, layer, q, k, v, positions, batch,
                                   self.attention_impl, self.mesh)
    out = proj(cfg.d_model, 'o_proj')(out.reshape(b, t, -1))
    return out, pool


class Mlp(nn.Module):
  cfg: ModelConfig
  linear_impl: str = 'auto'

  @nn.compact
  def __call__(self, x):
    dtype = DTYPES[self.cfg.dtype]
    gate, up = dense_group(x, (self.cfg.ffn_dim, self.cfg.ffn_dim), ('gate_proj', 'up_proj'),
                           dtype, self.linear_impl)
    return dense(self.cfg.d_model, 'down_proj', dtype, self.linear_impl)(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
  cfg: ModelConfig
  attention_impl: str
  mesh: Optional[Mesh] = None
  linear_impl: str = 'auto'

  @nn.compact
  def __call__(self, carry, positions, batch):
    x, pool, layer = carry
    attn_out, pool = Attention(self.cfg, self.attention_impl, self.mesh, self.linear_impl,
                               name='attn')(
        RMSNorm(self.cfg.norm_eps, name='attn_norm')(x), positions, pool, batch, layer)
    x = x + attn_out
    x = x + Mlp(self.cfg, self.linear_impl, name='mlp')(
        RMSNorm(self.cfg.norm_eps, name='mlp_norm')(x))
    return (x, pool, layer + 1), None


class Llama(nn.Module):
  """tokens [B, T], positions [B, T] (-1 = padding) -> logits, updated pool.

  `batch` carries the paging metadata (slot_mapping, block_tables, context_lens; see
  pagedjax/host/scheduling/step_inputs.py); with `pool=None` attention is dense and causal within `tokens`.

  logits_index [B] (optional) picks one position per row, so prefill computes the vocabulary
  projection only where a token is sampled: logits are then [B, V], else [B, T, V].

  layer_loop picks how the layers run (LAYER_LOOPS). 'scan': `nn.scan`, params under `layers`
  with a leading [num_layers] axis (the params tree every loader and tool uses). 'unrolled': a
  Python loop, params under `layer_0` ... `layer_{L-1}` without that axis (per_layer_params
  makes them from the stacked tree). Same math, same order of operations, same results. Why
  both: inside the scan XLA:CPU copies each layer's weights out of the stacked arrays on every
  call (a dynamic-slice it does not fuse into the dot), the whole model's weights per decode
  step; unrolled, every dot reads its own weight array in place. The scan compiles several
  times faster, so it stays the default (prefill chunks, accelerators, the mesh path).

  linear_impl picks how the linear layers and the output head multiply (LINEAR_IMPLS, see
  `dense` above); with a mesh they are XLA's dots (GSPMD partitions those, not the kernel).
  """
  cfg: ModelConfig
  attention_impl: str = 'reference'
  mesh: Optional[Mesh] = None  # tensor-parallel mesh with axis 'model' (pagedjax/model/sharding.py)
  layer_loop: str = 'scan'  # 'scan' | 'unrolled' (LAYER_LOOPS)
  linear_impl: str = 'auto'  # 'auto' | 'xla' | 'cpu' (LINEAR_IMPLS)

  @nn.compact
  def __call__(self, tokens, positions, pool=None, batch=None,
               logits_index: Optional[jax.Array] = None):
    cfg = self.cfg
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, name='embed',
                     embedding_init=nn.initializers.normal(0.02))
    x = embed(tokens).astype(DTYPES[cfg.dtype])
    linear_impl = 'xla' if self.mesh is not None else self.linear_impl
    if self.layer_loop == 'scan':
      layers = nn.scan(DecoderLayer, variable_axes={'params': 0}, split_rngs={'params': True},
                       in_axes=(nn.broadcast, nn.broadcast), length=cfg.num_layers)
      (x, pool, _), _ = layers(cfg, self.attention_impl, self.mesh, linear_impl, name='layers')(
          (x, pool, jnp.int32(0)), positions, batch)
    elif self.layer_loop == 'unrolled':
      for i in range(cfg.num_layers):
        (x, pool, _), _ = DecoderLayer(cfg, self.attention_impl, self.mesh, linear_impl,
                                       name=f'layer_{i}')((x, pool, jnp.int32(i)), positions, batch)
    else:
      raise ValueError(f'layer_loop={self.layer_loop!r} is not allowed: one of {LAYER_LOOPS}')
    x = RMSNorm(cfg.norm_eps, name='final_norm')(x)
    if logits_index is not None:
      x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
    if cfg.tie_embeddings:
      head = self.get_variable('params', 'packed_head')  # per_layer_params(pack=True)'s
      head = embed.embedding.astype(jnp.float32) if head is None else head
      logits = tied_logits(x.astype(jnp.float32), head, linear_impl)
    else:
      logits = dense(cfg.vocab_size, 'lm_head', None, linear_impl)(x.astype(jnp.float32))
    return logits.astype(jnp.float32), pool


def per_layer_params(params, pack: bool = False):
  """The stacked params tree (layer_loop='scan') as Llama(layer_loop='unrolled') takes it: the
  `layers` subtree replaced by `layer_0` ... `layer_{L-1}`, each leaf without its leading
  [num_layers] axis; every other leaf is the same array object. pack (linear_impl='cpu_packed'):
  each layer's Dense kernels and an untied head's as linear_cpu.pack_kernels copies them, and a
  tied embedding's packed transpose added as `packed_head` (the head reads it; the embedding
  stays for the lookup), the rest as above.

  Arrays on one CPU device are split without copying: each layer's leaf is a view of the
  stacked buffer (a numpy view handed to XLA, which keeps it alive and aliases it, as it does any
  host buffer it can), so the unrolled model costs no weight memory. Each view is committed to a
  device exactly when its stacked array is: a committed leaf commits the step's outputs (the
  pool), and a program fed a pool committed differently from before compiles again. Elsewhere
  (accelerators, sharded arrays) each layer is sliced out on its device, a copy."""
  p = dict(params['params'])
  stacked = p.pop('layers')
  num_layers = jax.tree_util.tree_leaves(stacked)[0].shape[0]

  def layer(x, i):
    if isinstance(x, jax.Array) and len(x.devices()) == 1 and x.is_fully_addressable:
      (device,) = x.devices()
      if device.platform == 'cpu':
        view = np.asarray(x)[i]
        return jax.device_put(view, device) if x.committed else jax.device_put(view)
    return x[i]

  for i in range(num_layers):
    p[f'layer_{i}'] = jax.tree_util.tree_map(lambda x, i=i: layer(x, i), stacked)
    if pack:
      p[f'layer_{i}'] = linear_cpu.pack_kernels(p[f'layer_{i}'])
  if pack and 'lm_head' in p:
    p['lm_head'] = linear_cpu.pack_kernels(p['lm_head'])
  elif pack and p['embed']['embedding'].dtype == jnp.float32:
    p['packed_head'] = linear_cpu.pack(p['embed']['embedding'], transposed=True)
  return {**params, 'params': p}


def init_params(cfg: ModelConfig, seed: int = 0):
  """Random params (normal 0.02 projections): the tiny test models and random-weight runs.
  Jitted: one compiled program (cached across processes) instead of ~80 ops compiled one by
  one, which cost every test and experiment process seconds."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  return jax.jit(lambda key: Llama(cfg).init(key, tokens, tokens))(jax.random.PRNGKey(seed))


def forward_dense(cfg: ModelConfig, params, tokens):
  """No-cache forward over whole sequences: tokens [B, T] -> logits [B, T, V]."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  logits, _ = Llama(cfg).apply(params, tokens, positions)
  return logits


# ------------------------------------------------------------------------------------------------
# One layer at a time (model/streamed_attention.py): the same modules and the same params tree as
# Llama, applied piece by piece, so a caller can run attention its own way between the pieces.
# ------------------------------------------------------------------------------------------------
def embed_tokens(cfg: ModelConfig, params, tokens):
  """tokens [..., T] -> x [..., T, D] in the compute dtype, as Llama's first line."""
  embed = nn.Embed(cfg.vocab_size, cfg.d_model)
  return embed.apply({'params': params['params']['embed']}, tokens).astype(DTYPES[cfg.dtype])


def layer_qkv(cfg: ModelConfig, lp, x, positions, linear_impl: str = 'auto'):
  """lp: one decoder layer's params (params['params']['layers'] at one index); x [B, T, D],
  positions [B, T] (-1 = padding) -> q [B, T, Hq, Dh], k, v [B, T, Hkv, Dh]: attn_norm, the
  projections and RoPE, as Attention computes them (linear_impl as Llama's)."""
  dtype = DTYPES[cfg.dtype]
  h = RMSNorm(cfg.norm_eps).apply({'params': lp['attn_norm']}, x)
  b, t, _ = x.shape

  def project(name, heads):
    proj = dense(heads * cfg.head_dim, None, dtype, linear_impl, cfg.qkv_bias)
    return proj.apply({'params': lp['attn'][name]}, h).reshape(b, t, heads, cfg.head_dim)

  q, k, v = (project('q_proj', cfg.num_heads), project('k_proj', cfg.num_kv_heads),
             project('v_proj', cfg.num_kv_heads))
  rope_positions = jnp.maximum(positions, 0)  # padded queries rotate as position 0
  return rope(q, rope_positions, cfg.rope_theta), rope(k, rope_positions, cfg.rope_theta), v


def layer_output(cfg: ModelConfig, lp, x, attn, linear_impl: str = 'auto'):
  """The rest of a decoder layer after attention: attn [B, T, Hq, Dh] -> o_proj, residual,
  mlp_norm, MLP, residual -> x [B, T, D]."""
  b, t, _ = x.shape
  o_proj = dense(cfg.d_model, None, DTYPES[cfg.dtype], linear_impl)
  x = x + o_proj.apply({'params': lp['attn']['o_proj']}, attn.reshape(b, t, -1))
  h = RMSNorm(cfg.norm_eps).apply({'params': lp['mlp_norm']}, x)
  return x + Mlp(cfg, linear_impl).apply({'params': lp['mlp']}, h)


def final_logits(cfg: ModelConfig, params, x, linear_impl: str = 'auto'):
  """x [..., D] after the last layer -> logits [..., V] float32: final_norm and the vocabulary
  projection (tied or lm_head), as Llama's last lines."""
  p = params['params']
  x = RMSNorm(cfg.norm_eps).apply({'params': p['final_norm']}, x)
  if cfg.tie_embeddings:
    logits = tied_logits(x.astype(jnp.float32),
                         jnp.asarray(p['embed']['embedding'], jnp.float32), linear_impl)
  else:
    lm_head = dense(cfg.vocab_size, None, None, linear_impl)
    logits = lm_head.apply({'params': p['lm_head']}, x.astype(jnp.float32))
  return logits.astype(jnp.float32)
