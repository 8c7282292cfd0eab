"""How the KV pool is split over a tensor-parallel mesh (axis 'model'): over KV heads, axis 2 of
every pool array, so a block id means the same thing on every device. The rest of tensor
parallelism (weights, activations, validation) is pagedjax/model/sharding.py."""
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = 'model'

# Every pool array carries KV heads on axis 2: k/v, quantization scales and zero points, recent
# rings (pool.py). A new pool field must too, or get its own spec; empty_pool_like checks.
POOL_SPEC = P(None, None, AXIS)


def pool_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, POOL_SPEC)


def empty_pool_like(pool, mesh: Mesh, num_kv_heads: int):
  """An all-zero pool of `pool`'s structure, shapes and dtypes, created already split over KV
  heads (axis 2): each device allocates only its shard, and nothing crosses devices or hosts."""
  for path, x in jax.tree_util.tree_flatten_with_path(pool)[0]:
    if x.ndim < 3 or x.shape[2] != num_kv_heads:
      raise ValueError(f'pool array {jax.tree_util.keystr(path)} of shape {x.shape} does not '
                       f'hold the {num_kv_heads} KV heads on axis 2, which tensor parallelism '
                       'splits; give it its own spec in pagedjax/device/pool_sharding.py')
  shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pool)
  zeros = lambda: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  return jax.jit(zeros, out_shardings=pool_sharding(mesh))()
