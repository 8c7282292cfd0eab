"""The paged KV pool: device state carried through every jitted step.

Layout (chosen by measurement on CPU, see DESIGN notes in the README):
  k, v: [num_layers, num_blocks, num_kv_heads, block_size, head_dim]
One block holds `block_size` consecutive tokens of one sequence for every layer and KV head.
A token's *slot* is `block * block_size + offset`.

Block 0 is the null block. It is never handed out by the allocator: padding entries of block
tables point at it and the K/V of padded tokens are written into it, so its contents are garbage
by design and attention must never read it for a real token (the isolation tests fill it with NaN).
"""
import flax.struct
import jax.numpy as jnp

NULL_BLOCK = 0


@flax.struct.dataclass
class KVPool:
  k: jnp.ndarray  # [layers, blocks, kv_heads, block_size, head_dim]
  v: jnp.ndarray  # [layers, blocks, kv_heads, block_size, head_dim]

  @property
  def num_blocks(self) -> int:
    return self.k.shape[1]

  @property
  def block_size(self) -> int:
    return self.k.shape[3]

  @property
  def nbytes(self) -> int:
    return self.k.nbytes + self.v.nbytes

  @property
  def bytes_per_token(self) -> int:
    """K and V bytes one token slot takes, over all layers."""
    return self.nbytes // (self.num_blocks * self.block_size)


def init_pool(num_layers, num_blocks, num_kv_heads, block_size, head_dim, dtype=jnp.float32):
  shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
  return KVPool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def pool_bytes(num_layers, num_blocks, num_kv_heads, block_size, head_dim, dtype) -> int:
  return 2 * num_layers * num_blocks * num_kv_heads * block_size * head_dim * jnp.dtype(
      dtype).itemsize


def write_kv(pool: KVPool, layer, k, v, slot_mapping) -> KVPool:
  """Scatter new K/V [B, T, Hkv, Dh] of one layer into their slots [B, T] (in place when donated)."""
  block_size = pool.block_size
  blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
  return pool.replace(
      k=pool.k.at[layer, blocks, :, offsets].set(k.astype(pool.k.dtype)),
      v=pool.v.at[layer, blocks, :, offsets].set(v.astype(pool.v.dtype)))
