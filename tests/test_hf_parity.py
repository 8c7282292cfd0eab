"""Logit parity with Hugging Face transformers (torch, CPU) on tiny random Llama/Qwen2 models.

The models are saved with save_pretrained (safetensors) and loaded with load_safetensors_dir, so
these tests cover the HF name mapping, kernel transposes, tied/untied heads, q/k/v biases,
explicit head_dim, sharded checkpoints and bfloat16 files. Tolerance: float32 on both sides,
logits of order 1-10, atol = rtol = 1e-4 (observed differences are ~1e-6).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.model import llama as model
from pagedjax.model import weights

# Imported when the file's first test runs, not at collection: every xdist worker collects every
# file, and torch + transformers cost a few seconds of CPU to import.
torch = transformers = None


@pytest.fixture(autouse=True, scope='module')
def _hf_libraries():
  global torch, transformers  # pylint: disable=global-statement
  torch = pytest.importorskip('torch', reason='HF parity needs the test extra (torch CPU wheel)')
  transformers = pytest.importorskip('transformers', reason='HF parity needs transformers')

ATOL = RTOL = 1e-4
# One program per model shape: run op by op, the forward would compile each of its ~100
# operations on its own, again for every shape.
forward_dense = jax.jit(model.forward_dense, static_argnums=0)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rope_theta=10000.0, rms_norm_eps=1e-6)
VARIANTS = {
    'llama_tied': ('llama', dict(tie_word_embeddings=True)),
    'llama_untied': ('llama', dict(tie_word_embeddings=False)),
    'llama_mha_head_dim32': ('llama', dict(num_key_value_heads=4, head_dim=32,
                                           tie_word_embeddings=False, rope_theta=500000.0)),
    'llama_mqa_sharded': ('llama', dict(num_key_value_heads=1, tie_word_embeddings=True)),
    'qwen2_bias_untied': ('qwen2', dict(tie_word_embeddings=False)),
    'qwen2_bias_tied': ('qwen2', dict(tie_word_embeddings=True)),
}


def randomize(hf_model, seed):
  """Non-trivial weights everywhere: HF init leaves norms at 1 and biases at 0, which would let
  a mis-mapped norm or bias pass unnoticed."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in hf_model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1.0 + 0.1 * noise if name.endswith('norm.weight') else 0.2 * noise)


def tiny_hf_model(kind, overrides, seed=0):
  config_cls, model_cls = {
      'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM),
      'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
  }[kind]
  config = config_cls(**{**TINY, **overrides})
  hf_model = model_cls(config).float().eval()
  randomize(hf_model, seed)
  return hf_model


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
  kind, overrides = VARIANTS[variant]
  hf_model = tiny_hf_model(kind, overrides)
  shard = '20KB' if variant.endswith('sharded') else '1GB'
  hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size=shard)
  if variant.endswith('sharded'):
    assert os.path.exists(tmp_path / 'model.safetensors.index.json')

  cfg, params = weights.load_safetensors_dir(str(tmp_path))
  assert cfg.qkv_bias == (kind == 'qwen2')
  assert cfg.tie_embeddings == overrides['tie_word_embeddings']
  assert cfg.head_dim == overrides.get('head_dim', TINY['hidden_size'] // 4)

  tokens = np.random.default_rng(0).integers(0, TINY['vocab_size'], (2, 12))
  with torch.no_grad():
    want = hf_model(torch.as_tensor(tokens)).logits.numpy()
  got = np.asarray(forward_dense(cfg, params, jnp.asarray(tokens, jnp.int32)))
  assert np.abs(want).max() > 1.0  # the comparison is not between near-zero logits
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_bfloat16_safetensors_read_as_float32(tmp_path):
  from safetensors.torch import save_file
  tensors = {'a': torch.randn(3, 5, dtype=torch.bfloat16),
             'b': torch.randn(4, dtype=torch.float16), 'c': torch.randn(2, 2)}
  save_file(tensors, str(tmp_path / 'x.safetensors'))
  got = weights.read_safetensors(str(tmp_path / 'x.safetensors'))
  for name, t in tensors.items():
    assert got[name].dtype == np.float32
    np.testing.assert_array_equal(got[name], t.float().numpy())


def test_missing_tensor_is_named(tmp_path):
  from safetensors.torch import save_file
  hf_model = tiny_hf_model('llama', dict(tie_word_embeddings=False))
  hf_model.save_pretrained(tmp_path, safe_serialization=True)
  state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != 'lm_head.weight'}
  save_file(state, str(tmp_path / 'model.safetensors'))
  with pytest.raises(ValueError, match="'lm_head.weight'"):
    weights.load_safetensors_dir(str(tmp_path))


@pytest.mark.slow  # ~15 s: transformers parses and dequantizes the GGUF itself
def test_smollm2_logits_match_transformers_gguf_loader(smollm2, monkeypatch):
  """Real weights: transformers' own GGUF dequantize + q/k unpermute gives the same logits."""
  import functools
  import gguf
  from transformers import modeling_gguf_pytorch_utils as hf_gguf
  load_gguf_checkpoint = hf_gguf.load_gguf_checkpoint
  # transformers parses the file once per call below, converts every metadata field to Python
  # values once per call (the tokenizer's 49k tokens and merges among them) and builds the same
  # tensor-name map once per module (~400 times): each is a function of its arguments alone, so
  # they are memoized for this test (transformers imports the first and last from gguf at each
  # call). Its parse, field values, name mapping and dequantization are still what runs.
  monkeypatch.setattr(gguf, 'GGUFReader', functools.lru_cache(gguf.GGUFReader))
  monkeypatch.setattr(gguf, 'get_tensor_name_map', functools.lru_cache(gguf.get_tensor_name_map))
  parse, parsed = hf_gguf._gguf_parse_value, {}  # pylint: disable=protected-access

  def parse_once(part, types):  # part: an array of the one cached reader, alive all test long
    key = (id(part), repr(types))
    if key not in parsed:
      parsed[key] = (part, parse(part, types))
    return parsed[key][1]
  monkeypatch.setattr(hf_gguf, '_gguf_parse_value', parse_once)
  cfg, params, tok = smollm2
  path = weights.smollm2_gguf_path()
  hf_config = load_gguf_checkpoint(path)['config']
  hf_config = transformers.LlamaConfig(
      **{k: v for k, v in hf_config.items() if k not in ('model_type', 'architectures')})
  from transformers import initialization  # pylint: disable=import-outside-toplevel
  with initialization.no_init_weights():  # (every weight is loaded below: ~2 s)
    hf_model = transformers.LlamaForCausalLM(hf_config).float().eval()
  tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf_model)['tensors']
  hf_model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()},
                           strict=False)
  hf_model.tie_weights()  # the GGUF has no output head: SmolLM2's is its embedding
  tokens = np.array([tok.encode('The capital of France is Paris. It is a city of')])
  with torch.no_grad():
    want = hf_model(torch.as_tensor(tokens)).logits.numpy()
  got = np.asarray(forward_dense(cfg, params, jnp.asarray(tokens, jnp.int32)))
  np.testing.assert_allclose(got, want, atol=1e-3, rtol=1e-4)  # logits ~30, 30 layers deep
