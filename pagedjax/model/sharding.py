"""Tensor parallelism over a 1-D JAX device mesh with one axis, 'model' (config.mesh.model).

What is split, and why this way (Megatron-style, so each layer needs two all-reduces):
  KV pool  [layers, blocks, kv_heads, block_size, head_dim] over kv_heads (axis 2). Every device
           holds every block for its own heads, so the host allocator, block tables and slots are
           unchanged and replicated: a block id means the same thing on every device.
  q/k/v_proj kernels [L, D, H*Dh] over the output axis (whole heads per device), o_proj
           [L, H*Dh, D] over axis 1; gate/up [L, D, F] over F, down [L, F, D] over axis 1. The
           partial sums of o_proj and down_proj are all-reduced (GSPMD inserts it).
  embedding [V, D] and lm_head [D, V] over the vocabulary when V divides by mesh.model, else
           replicated. For real models the vocabulary tables are a large share of the weights
           (2.1 GB of Llama-3-8B's 16 GB in fp16), and vocab sharding is exact: the embedding
           lookup sums one non-zero shard with zeros, and each logit is a whole local dot product.
           It is also what pagedjax/sizing.py counts per device.
  norms    replicated (one vector each).
Attention over the paged pool (the K/V write and the kernel) runs per shard under shard_map, so
every kernel (reference, xla, Pallas, Triton) sees plain local arrays; the rest of the step relies
on GSPMD propagating the input shardings.

KV-head replication: when mesh.model exceeds num_kv_heads and is a multiple of it, each KV head is
copied onto the mesh.model / num_kv_heads devices whose query heads read it. This is done by
repeating the k/v projection columns per head, which turns the model into an equivalent one with
num_kv_heads = mesh.model (the same function of the same weights), so the pool gets one KV head
per device. KV memory summed over devices is then `replication` times the model's own KV size;
per device it is one head.
"""
import dataclasses
import functools
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# The pool's split (over KV heads) lives with the pool, which the model builds on.
from pagedjax.device.pool_sharding import AXIS, POOL_SPEC, empty_pool_like, pool_sharding  # pylint: disable=unused-import
# Activations [B, T, heads, head_dim] inside attention: sharded over heads.
HEADS_SPEC = P(None, None, AXIS, None)
REPLICATED = P()


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------
def kv_head_replication(cfg, tp: int) -> int:
  """How many devices share each KV head: 1 while tp <= num_kv_heads."""
  return max(1, tp // cfg.num_kv_heads)


def _problems(cfg, tp: int):
  """What stops a tp-way split of this model; empty when it works."""
  out = []
  if cfg.num_heads % tp:
    out.append(f'num_heads={cfg.num_heads} is not divisible by {tp}')
  if tp <= cfg.num_kv_heads and cfg.num_kv_heads % tp:
    out.append(f'num_kv_heads={cfg.num_kv_heads} is not divisible by {tp}')
  if tp > cfg.num_kv_heads and tp % cfg.num_kv_heads:
    out.append(f'{tp} > num_kv_heads={cfg.num_kv_heads} but is not a multiple of it, so KV heads '
               'cannot be replicated evenly (replication needs mesh.model = k * num_kv_heads)')
  if cfg.ffn_dim % tp:
    out.append(f'ffn_dim={cfg.ffn_dim} is not divisible by {tp}')
  return out


def allowed_mesh_sizes(cfg, num_devices: Optional[int] = None):
  """Every mesh.model this model supports (at most num_heads), capped at num_devices if given."""
  top = cfg.num_heads if num_devices is None else min(cfg.num_heads, num_devices)
  return [t for t in range(1, top + 1) if not _problems(cfg, t)]


def validate_mesh(cfg, tp, num_devices: Optional[int] = None, field: str = 'mesh.model'):
  """Raises ValueError naming the values and the allowed alternatives; returns tp.

  cfg is any object with num_heads, num_kv_heads and ffn_dim (a ModelConfig), or None when the
  model's shape is not known yet (a checkpoint not loaded): then only tp itself is checked.
  num_devices=None skips the device check, so config validation can run before the JAX backend
  starts.
  """
  if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
    raise ValueError(f'config.{field}={tp!r} is not allowed: an integer >= 1')
  tp = int(tp)
  if cfg is None:
    return tp
  problems = _problems(cfg, tp)
  if problems:
    raise ValueError(
        f'config.{field}={tp} does not split this model: {"; ".join(problems)}. Allowed values '
        f'for num_heads={cfg.num_heads}, num_kv_heads={cfg.num_kv_heads}, ffn_dim={cfg.ffn_dim}: '
        f'{allowed_mesh_sizes(cfg)} (values above num_kv_heads replicate each KV head; '
        'uneven splits are not implemented)')
  if num_devices is not None and tp > num_devices:
    backend = jax.default_backend()
    hint = (' (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N fakes N devices)'
            if backend == 'cpu' else '')
    raise ValueError(
        f'config.{field}={tp} needs {tp} devices but only {num_devices} {backend} device(s) '
        f'are available{hint}; allowed here: {allowed_mesh_sizes(cfg, num_devices)}')
  return tp


# ------------------------------------------------------------------------------------------------
# Devices and mesh
# ------------------------------------------------------------------------------------------------
_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'


def request_cpu_devices(n: int) -> bool:
  """Ask for n CPU devices, so a mesh of n runs on a one-device CPU machine; True if set.

  Must run before the JAX backend starts (the first jax.devices() or array). It sets the
  `jax_num_cpu_devices` option, the supported form of XLA's device-count flag; it only affects
  the CPU platform, so on GPU/TPU hosts it costs nothing and the accelerators stay the default.
  Leaves things alone when n <= 1, when XLA_FLAGS already names a device count (the user's
  choice wins), when the option was set already, or when the backend has started (then
  validate_mesh reports the missing devices).
  """
  flags = os.environ.get('XLA_FLAGS', '')
  if n <= 1 or _DEVICE_COUNT_FLAG in flags:
    return False
  current = getattr(jax.config, 'jax_num_cpu_devices', None)
  if current is None:  # a jax without the option: XLA reads the flag when the CPU client starts
    os.environ['XLA_FLAGS'] = f'{flags} {_DEVICE_COUNT_FLAG}={n}'.strip()
    return True
  if current >= 0:
    return False
  try:
    jax.config.update('jax_num_cpu_devices', n)
  except RuntimeError:  # the backend has started: too late to add devices
    return False
  return True


def make_mesh(tp: int, devices=None) -> Mesh:
  """A ('model',) mesh over the first tp devices (jax.devices() spans every host's devices)."""
  devices = jax.devices() if devices is None else devices
  if tp > len(devices):
    raise ValueError(f'a mesh of {tp} devices needs {tp}, only {len(devices)} available')
  # Auto axes: GSPMD propagates shardings from the inputs (what everything outside shard_map
  # relies on). Said explicitly, in case a later jax changes the default to Explicit.
  axis_types = getattr(jax.sharding, 'AxisType', None)
  if axis_types is None:
    return Mesh(np.asarray(devices[:tp]), (AXIS,))
  return Mesh(np.asarray(devices[:tp]), (AXIS,), axis_types=(axis_types.Auto,))


# ------------------------------------------------------------------------------------------------
# Params
# ------------------------------------------------------------------------------------------------
def replicate_kv_heads(cfg, params, factor: int):
  """(cfg, params) of the equivalent model whose every KV head appears `factor` times in a row.

  k/v projection columns (and biases) are repeated per head, so expanded head j is a copy of
  original head j // factor: with tp = num_kv_heads * factor, device j's query heads
  (j*H/tp ... (j+1)*H/tp - 1) belong to exactly that original head.
  """
  if factor == 1:
    return cfg, params
  hkv, dh = cfg.num_kv_heads, cfg.head_dim

  def expand(path, x):
    names = _names(path)
    if len(names) >= 2 and names[-2] in ('k_proj', 'v_proj'):
      heads = x.reshape(*x.shape[:-1], hkv, dh)
      return jnp.repeat(heads, factor, axis=-2).reshape(*x.shape[:-1], hkv * factor * dh)
    return x

  params = jax.tree_util.tree_map_with_path(expand, params)
  return dataclasses.replace(cfg, num_kv_heads=hkv * factor), params


def _names(path):
  return tuple(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)


def param_spec(names, cfg, tp: int) -> P:
  """PartitionSpec of one parameter, from its path in the tree (see pagedjax/model/llama.py)."""
  module, leaf = (names[-2], names[-1]) if len(names) >= 2 else ('', names[-1])
  vocab = AXIS if cfg.vocab_size % tp == 0 else None
  if module in ('q_proj', 'k_proj', 'v_proj'):
    return P(None, None, AXIS) if leaf == 'kernel' else P(None, AXIS)  # kernel or bias
  if module in ('gate_proj', 'up_proj') and leaf == 'kernel':
    return P(None, None, AXIS)
  if module in ('o_proj', 'down_proj') and leaf == 'kernel':
    return P(None, AXIS, None)
  if module == 'embed' and leaf == 'embedding':
    return P(vocab, None)
  if module == 'lm_head' and leaf == 'kernel':
    return P(None, vocab)
  if leaf == 'scale':  # RMSNorm
    return REPLICATED
  raise ValueError(f'no tensor-parallel rule for parameter {"/".join(names)}; add one to '
                   'pagedjax/model/sharding.py:param_spec (replicate it with PartitionSpec())')


def param_shardings(params, cfg, mesh: Mesh):
  tp = mesh.shape[AXIS]
  return jax.tree_util.tree_map_with_path(
      lambda path, _: NamedSharding(mesh, param_spec(_names(path), cfg, tp)), params)


@dataclasses.dataclass(frozen=True)
class Layout:
  """What a tp-way split of one model looks like; figures per device."""
  tp: int
  kv_heads_per_device: int
  kv_head_replication: int
  query_heads_per_device: int
  vocab_sharded: bool

  @classmethod
  def of(cls, cfg, tp: int) -> 'Layout':
    """cfg is the model's own config (before KV-head replication)."""
    validate_mesh(cfg, tp)
    rep = kv_head_replication(cfg, tp)
    return cls(tp, cfg.num_kv_heads * rep // tp, rep, cfg.num_heads // tp,
               cfg.vocab_size % tp == 0)


def _place(x, target: NamedSharding):
  """x on the mesh. One process: a device-to-device copy. Several (jax.distributed): every
  process holds the same whole x (same checkpoint or seed) and fills its own shards from a host
  copy, the documented way to build an array that spans processes."""
  if jax.process_count() == 1:
    return jax.device_put(x, target)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, target, lambda index: host[index])


def shard_model(cfg, params, mesh: Mesh):
  """(cfg, params) placed on the mesh: KV heads replicated if needed, weights split.

  The returned cfg has num_kv_heads = the pool's global KV-head count (the model's own times the
  replication), which is what the engine must size its pool with.
  """
  tp = mesh.shape[AXIS]
  cfg, params = replicate_kv_heads(cfg, params, kv_head_replication(cfg, tp))
  return cfg, jax.tree_util.tree_map(_place, params, param_shardings(params, cfg, mesh))


def bytes_per_device(tree) -> dict:
  """Measured: bytes of the tree's arrays held by each device, from their actual shards."""
  out = {}
  for x in jax.tree_util.tree_leaves(tree):
    for shard in x.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


# ------------------------------------------------------------------------------------------------
# Per-shard functions
# ------------------------------------------------------------------------------------------------
def _shard_map():
  """jax.shard_map where it exists (jax 0.10 has it), else the experimental one.

  The replication check is off: custom kernels (Pallas, triton_call) carry no replication
  rules, and every output here is sharded, so there is nothing for it to verify.
  """
  if hasattr(jax, 'shard_map'):
    return functools.partial(jax.shard_map, check_vma=False)
  from jax.experimental.shard_map import shard_map  # pylint: disable=import-outside-toplevel
  return functools.partial(shard_map, check_rep=False)


def per_shard(fn, mesh: Mesh, in_specs, out_specs):
  """fn run on each device's local blocks (shard_map): see pagedjax/model/llama.py for its use."""
  return _shard_map()(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
