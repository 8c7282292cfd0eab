"""pagedjax: a readable JAX decode loop with a paged KV cache.

The few names a library user needs:

  import pagedjax
  engine = pagedjax.build_engine(pagedjax.Config(
      prefix_cache=pagedjax.PrefixCacheConfig(enabled=True)))
  done = engine.generate(['The capital of France is'], pagedjax.SamplingParams(max_new_tokens=8))

Names load on first use, so `import pagedjax.host...` (plain Python bookkeeping) never pulls in
jax through this file.
"""
import importlib

_WHERE = {
    'Config': 'pagedjax.config', 'ModelSection': 'pagedjax.config',
    'RandomModelConfig': 'pagedjax.config', 'PoolConfig': 'pagedjax.config',
    'AttentionConfig': 'pagedjax.config', 'EngineConfig': 'pagedjax.config',
    'SchedulerConfig': 'pagedjax.config', 'PrefixCacheConfig': 'pagedjax.config',
    'MeshConfig': 'pagedjax.config', 'TiersConfig': 'pagedjax.config',
    'ConfigError': 'pagedjax.config',
    'Engine': 'pagedjax.engine', 'RequestError': 'pagedjax.host.requests.intake',
    'SamplingParams': 'pagedjax.host.requests.sampling_params', 'Completion': 'pagedjax.host.requests.sequence',
    'build_engine': 'pagedjax.factory', 'make_engine': 'pagedjax.factory',
    'load_model_and_tokenizer': 'pagedjax.factory',
}
__all__ = sorted(_WHERE)


def __getattr__(name):
  if name in _WHERE:
    return getattr(importlib.import_module(_WHERE[name]), name)
  raise AttributeError(f'module pagedjax has no attribute {name!r}')


def __dir__():
  return __all__
