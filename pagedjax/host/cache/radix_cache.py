"""Prefix caching, radix-tree design: a tree over token sequences, one edge per full block.

A path from a root spells a prefix block by block; each node holds the block with those
tokens' K/V. There is one root per cache salt, so tenants with different salts never share.
Lookup walks the prompt's full blocks down from the root; a missing child ends the prefix.

Compared with the hash chain (prefix_cache.py), the tree knows each block's children, so
eviction takes leaves only: a cached prefix is always reachable whole, and no entry outlives
its parent as an unreachable one. That is safe because a block's holders also hold its
parent's block (a sequence takes a cached prefix whole, a fork copies a whole table, and
copy-on-write only ever replaces a partly filled block, which is never cached), so an
evictable node's children are evictable too and a leaf to evict always exists. To keep that
so, a sequence extends the tree only along nodes that hold its own blocks: one whose prefix
was computed twice at once (another block already in the tree) leaves its later blocks out.

Holders, reference counts, evictable blocks and the eviction policies are as in
prefix_cache.py (CacheBase). Each node also keeps its block's chain key and content
(prefix_cache.block_content): the tree itself needs neither, but lower tiers (kv_tiers.py) name a
demoted block by them, the same names the hash design uses, so both designs share the tiers.
"""
from typing import Dict, List, Optional, Tuple

from pagedjax.host.cache.prefix_cache import CacheBase


class _Node:
  __slots__ = ('block', 'parent', 'tokens', 'children', 'key', 'content')

  def __init__(self, block: Optional[int], parent: Optional['_Node'], tokens: Tuple[int, ...],
               key: Optional[int] = None, content: Optional[Tuple] = None):
    self.block, self.parent, self.tokens = block, parent, tokens
    self.key, self.content = key, content  # chain key and block_content() (lower tiers)
    self.children: Dict[Tuple[int, ...], '_Node'] = {}


class RadixCache(CacheBase):

  def __init__(self, block_size: int, eviction='lru'):
    super().__init__(block_size, eviction)
    self._roots: Dict[object, _Node] = {}  # cache salt -> root (holds no block)
    self._node_of: Dict[int, _Node] = {}  # block -> its node
    self._block_of_key: Dict[int, int] = {}  # chain key -> block (pins, lower tiers)

  def __len__(self) -> int:
    return len(self._node_of)

  def is_cached(self, block: int) -> bool:
    return block in self._node_of

  def entry(self, block: int) -> Tuple[int, Tuple]:
    node = self._node_of[block]
    return node.key, node.content

  def block_of(self, key: int) -> Optional[int]:
    return self._block_of_key.get(key)

  def _edges(self, seq, n: int):
    ids, bs = seq.all_ids, self.block_size
    return (tuple(ids[i * bs:(i + 1) * bs]) for i in range(n))

  def match(self, seq, n: int) -> List[int]:
    node, blocks = self._roots.get(seq.params.cache_salt), []
    if node is None:
      return blocks
    for tokens in self._edges(seq, n):
      node = node.children.get(tokens)
      if node is None:
        break
      blocks.append(node.block)
    return blocks

  def offer(self, seq, n: int) -> None:
    node = self._roots.setdefault(seq.params.cache_salt, _Node(None, None, ()))
    keys = self.keys(seq, n)
    for i, tokens in enumerate(self._edges(seq, n)):
      block = seq.block_table[i]
      child = node.children.get(tokens)
      if child is None:
        if block in self._node_of:
          return  # cannot happen for a consistent table; never index a block twice
        content = self.content(seq, keys, i)
        child = node.children[tokens] = _Node(block, node, tokens, keys[i], content)
        self._node_of[block] = child
        self._block_of_key.setdefault(keys[i], block)
        self._cached(block, keys[i], content, i)
      elif child.block != block:
        return  # this prefix was cached from another sequence's blocks: stop (see above)
      node = child

  def _can_evict(self, block: int) -> bool:
    return not self._node_of[block].children

  def _drop(self, block: int) -> None:
    node = self._node_of.pop(block)
    if self._block_of_key.get(node.key) == block:
      del self._block_of_key[node.key]
    parent = node.parent
    del parent.children[node.tokens]
    if parent.block is not None and not parent.children:
      self._requeue(parent.block)  # now a leaf: it may go if it was passed over
