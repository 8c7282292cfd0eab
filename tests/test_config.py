import jax
import pytest

from configs import default
from pagedjax import kernels
from pagedjax import factory
from pagedjax.config import Config, ConfigError
from pagedjax.engine import Engine
from pagedjax.model.llama import init_params
from pagedjax.studies.workloads import validate_config


def test_default_and_tiny_configs_are_valid():
  validate_config(default.get_config())
  validate_config(default.get_config('tiny'))
  with pytest.raises(ValueError, match="unknown variant 'huge'"):
    default.get_config('huge')


@pytest.mark.parametrize('field,value,message', [
    ('pool.block_size', 24, r'config.pool.block_size=24 is not allowed: a power of two'),
    ('pool.block_size', 0, r'pool.block_size=0'),
    ('model.random.num_kv_heads', 3, r'num_kv_heads=3 is not allowed: a divisor of '
                                      r'num_heads=4: one of \[1, 2, 4\]'),
    ('model.dtype', 'float8', r"model.dtype='float8' is not allowed: one of \('float32'"),
    ('pool.kv_dtype', 'int3', r"pool.kv_dtype='int3' is not allowed"),
    ('pool.num_blocks', 8, r'pool.num_blocks=8 is not allowed: at least engine.max_batch_size '
                           r'\+ 1 = 9'),
    ('model.source', 'hub', r"model.source='hub' is not allowed: one of \('smollm2'"),
    ('attention.impl', 'cuda', r"attention.impl='cuda' is not allowed"),
    ('engine.prefill_chunk', 100, r'engine.prefill_chunk=100 is not allowed: a power of two'),
    ('engine.prefill_chunk', 2**30, r'prefill_chunk=1073741824 is not allowed: a power of two at '
     r'most 1024'),
    ('engine.decode_min_rows', 3, r'engine.decode_min_rows=3 is not allowed: a power of two'),
    ('engine.linear_impl', 'mkl', r"engine.linear_impl='mkl' is not allowed: one of \('auto', "
                                  r"'xla'"),
    ('sampling.max_new_tokens', 0, r'config.sampling.max_new_tokens=0 is not allowed'),
    ('sampling.top_p', 1.5, r'config.sampling.top_p=1.5 is not allowed'),
])
def test_bad_values_name_field_value_and_allowed(field, value, message):
  config = default.get_config('tiny')
  section, *rest = field.split('.')
  target = config[section]
  for part in rest[:-1]:
    target = target[part]
  target[rest[-1]] = value
  with pytest.raises(ConfigError, match=message):
    validate_config(config)


def test_file_sources_need_a_path():
  config = default.get_config()
  config.model.source = 'gguf'
  with pytest.raises(ConfigError, match="model.path='' is not allowed: a file or directory"):
    validate_config(config)


def test_a_pool_larger_than_memory_is_refused_before_anything_loads():
  config = default.get_config('tiny')
  config.pool.num_blocks = 10**8
  with pytest.raises(ConfigError, match=r'pool.num_blocks=100000000 is not allowed: the pool would '
                     r'take .* GiB per device and 1.00 GiB are available; at most \d+ blocks fit'):
    factory.check_pool_fits(factory.typed(config).model.random_model_config(),
                            factory.typed(config), available=2**30)
  config.pool.num_blocks = 256
  assert factory.check_pool_fits(factory.typed(config).model.random_model_config(),
                                 factory.typed(config), available=2**30) < 2**30


def test_an_attention_path_this_machine_cannot_run_is_refused_before_loading():
  config = default.get_config('tiny')
  config.attention.impl = 'pallas_tpu'  # this CPU runs it only interpreted (tests), not in runs
  if kernels.runs_on('pallas_tpu'):
    pytest.skip('running on a TPU')
  with pytest.raises(ConfigError, match=r"attention.impl='pallas_tpu' is not allowed on this cpu "
                     r"machine: one of \['auto', 'reference', 'xla'(, 'cpu')?\]"):
    factory.load_model_and_tokenizer(config)
  assert kernels.runs_on('triton', 'tpu') is False and kernels.runs_on('xla', 'tpu')


def test_the_engine_multiplies_as_engine_linear_impl_says():
  """config.engine.linear_impl reaches the step the factory builds (and the one an engine builds
  for itself), nothing compiled."""
  config = default.get_config('tiny')
  config.engine.linear_impl = 'xla'
  typed = Config.from_configdict(config)
  cfg = typed.model.random_model_config()
  params = jax.eval_shape(lambda: init_params(cfg))
  assert factory.make_engine(typed, cfg, params, None).executor.step_fn.linear_impl == 'xla'
  assert Engine(cfg, params, typed).executor.step_fn.linear_impl == 'xla'
