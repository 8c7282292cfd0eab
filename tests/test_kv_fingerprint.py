"""The disk KV tier's fingerprint (pagedjax/tiering.py) names everything a block's K/V depend on:
one weight value, one model config field, one KV spec field or the block size changed gives
another fingerprint; equal inputs give the same one, whatever the arrays' identity. The
weights' digest is computed once per params tree, and a weight-cache load reuses the entry's
checksums (pagedjax/model/weights.py)."""
import dataclasses

import jax
import numpy as np

from pagedjax import tiering
from pagedjax.device.kv_schemes import KVQuantConfig
from pagedjax.device.pool import init_pool
from pagedjax.model import weights

from test_weights import write_tiny_gguf
from tiny_models import tiny

SPECS = [KVQuantConfig('float32'), KVQuantConfig('bfloat16'), KVQuantConfig('int8'),
         KVQuantConfig('fp8_e4m3'), KVQuantConfig('fp8_e5m2'),
         KVQuantConfig('int4', group_size=4), KVQuantConfig('int4', group_size=6),
         KVQuantConfig('int4', group_size=4, key_per_channel=True),
         KVQuantConfig('int8', recent_window=4)]


def _pool(cfg, spec=KVQuantConfig('float32'), block_size=16):
  return init_pool(cfg.num_layers, 3, cfg.num_kv_heads, block_size, cfg.head_dim, kv_quant=spec,
                   max_sequences=2)


def _changed(value):
  if isinstance(value, bool):
    return not value
  if isinstance(value, (int, float)):
    return value * 2 + 1
  return {'float32': 'bfloat16'}.get(value, 'float32')


def _one_value_changed(params, index: int):
  """params with the last value of leaf `index` changed by 1e-3."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  leaf = leaves[index]
  leaves[index] = leaf.reshape(-1).at[-1].add(1e-3).reshape(leaf.shape)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def test_fingerprint_changes_with_every_weight_config_field_spec_and_block_size():
  cfg, params, _ = tiny('gqa')
  base = tiering.fingerprint(cfg, params, _pool(cfg), 16)
  # Content, not identity: equal values in new arrays (another process's load) match.
  copy = jax.tree_util.tree_map(lambda x: jax.numpy.array(np.asarray(x)), params)
  assert tiering.fingerprint(cfg, copy, _pool(cfg), 16) == base
  variants = {}
  for i in range(len(jax.tree_util.tree_leaves(params))):
    variants[f'weight {i}'] = tiering.fingerprint(cfg, _one_value_changed(params, i),
                                                  _pool(cfg), 16)
  for field in dataclasses.fields(cfg):
    other = dataclasses.replace(cfg, **{field.name: _changed(getattr(cfg, field.name))})
    variants[f'config {field.name}'] = tiering.fingerprint(other, params, _pool(cfg), 16)
  for spec in SPECS[1:]:
    variants[f'spec {spec}'] = tiering.fingerprint(cfg, params, _pool(cfg, spec), 16)
  variants['block size'] = tiering.fingerprint(cfg, params, _pool(cfg, block_size=8), 8)
  assert len(variants) == len(jax.tree_util.tree_leaves(params)) + len(
      dataclasses.fields(cfg)) + len(SPECS)
  assert base not in variants.values()
  assert len(set(variants.values())) == len(variants), 'two variants share a fingerprint'


def test_weights_digest_is_computed_once_and_a_cached_load_reuses_the_entry(tmp_path,
                                                                          monkeypatch):
  path = str(tmp_path / 'tiny.gguf')
  write_tiny_gguf(path)
  cache = str(tmp_path / 'cache')
  hashed = []
  leaf_digest = weights._leaf_digest  # pylint: disable=protected-access
  monkeypatch.setattr(weights, '_leaf_digest', lambda leaf: hashed.append(1) or leaf_digest(leaf))
  _, converted = weights.load_model('gguf', path, cache)  # converts and writes the entry
  _, restored = weights.load_model('gguf', path, cache)  # restores and verifies it
  assert weights.params_digest(converted) == weights.params_digest(restored)
  assert not hashed  # both took the entry's checksums
  _, uncached = weights.load_model('gguf', path)
  raw = weights.params_digest(uncached)
  assert hashed and raw != weights.params_digest(restored)  # the other kind, prefixed apart
  count = len(hashed)
  assert weights.params_digest(uncached) == raw and len(hashed) == count  # remembered
  assert weights.params_digest(_one_value_changed(uncached, 0)) != raw

