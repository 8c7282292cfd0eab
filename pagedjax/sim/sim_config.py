"""`config.sim`: which model runs on which simulated device, checked like the engine's sections.

  config.sim = ConfigDict(dict(
      model='llama3-8b',        # a pagedjax.sizing preset, or 'config.model': the config's own
                                #   (random) model's shape, e.g. a calibrated tiny model
      hardware='h100-sxm',      # a hardware preset (pagedjax/sim/hardware.py) or a profile .json
      weight_dtype='bf16', activation_dtype='bf16',  # sizing dtype names (activation: the KV
                                #   dtype when pool.kv_dtype is 'auto')
      memory_fraction=0.9,      # of one device's HBM for weights, activations and the pool
      num_kv_heads=0,           # 0: the model's; else a GQA ablation's count
      num_blocks=0,             # 0: as many as fit (simulated_device.plan_pool); else this many
      count_padding=True))      # charge padded rows and whole prompt chunks

`check(config)` raises pagedjax.config.ConfigError naming the field, its value and what is
allowed; `model_shape(config)` and `hardware_of(config)` are what a simulation then uses.
"""
import dataclasses
import math
import os

from pagedjax import sizing
from pagedjax.config import ConfigError, ModelSection, RandomModelConfig
from pagedjax.sim import hardware

OWN_MODEL = 'config.model'  # sim.model naming the config's own model section
ACTIVATION_DTYPES = ('fp32', 'bf16', 'fp16')  # what a pool can store for kv_dtype='auto'
FIELDS = ('model', 'hardware', 'weight_dtype', 'activation_dtype', 'memory_fraction',
          'num_kv_heads', 'num_blocks', 'count_padding')


def _refuse(field: str, value, allowed: str):
  raise ConfigError(f'config.sim.{field}={value!r} is not allowed: {allowed}')


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def model_shape(config) -> sizing.ModelShape:
  """The simulated model: the sizing preset config.sim.model (or the shape of config.model for
  'config.model'), with num_kv_heads replaced when sim.num_kv_heads > 0 (GQA ablations: the k/v
  projections shrink or grow with it, so the parameter count follows)."""
  sim = config.sim
  if sim.model == OWN_MODEL:
    values = config.model.to_dict()
    typed = ModelSection(**{**values, 'random': RandomModelConfig(**values.get('random', {}))})
    if typed.source != 'random':
      _refuse('model', sim.model, f"'{OWN_MODEL}' only with model.source='random' (its shape "
              "is known without loading weights); a sizing preset otherwise, e.g. "
              "'smollm2-135m'")
    typed.validate()
    shape = dataclasses.replace(sizing.from_model_config(typed.random_model_config()),
                                name='tiny random Llama')
  else:
    try:
      shape = sizing.get_preset(sim.model)
    except (ValueError, AttributeError, TypeError):
      _refuse('model', sim.model, f"one of {', '.join(sizing.PRESETS)} (pagedjax.sizing "
              f"presets), or '{OWN_MODEL}' for the config's random model")
  kv_heads = sim.get('num_kv_heads', 0)
  if kv_heads and shape.num_heads % kv_heads:
    _refuse('num_kv_heads', kv_heads, f'0 (the model\'s {shape.num_kv_heads}), or a divisor of '
            f'the {shape.num_heads} query heads of {sim.model}')
  if kv_heads:
    shape = dataclasses.replace(shape, name=f'{shape.name} ({kv_heads} KV heads)',
                                num_kv_heads=kv_heads)
  return shape


def hardware_of(config) -> hardware.Hardware:
  """The simulated device: a preset, or a hardware profile that exists and loads whole."""
  name = config.sim.hardware
  allowed = (f"one of {', '.join(hardware.PRESETS)}, or a hardware-profile .json that exists "
             "(`python -m experiments.simulate --config=configs/simulate_cpu.py --calibrate "
             "--workdir=DIR` writes DIR/hardware_profile.json)")
  if not isinstance(name, str) or not name:
    _refuse('hardware', name, allowed)
  if name.endswith('.json') and not os.path.isfile(name):
    variant = config.get('variant', None)
    arg = f':{variant}' if variant and variant != 'full' else ''
    _refuse('hardware', name, f'{allowed}; this file does not exist: write it with `python -m '
            f'experiments.simulate --config=configs/simulate_cpu.py{arg} --calibrate '
            f'--workdir={os.path.dirname(name) or "."}`')
  try:
    return hardware.get_hardware(name)
  except ValueError as e:
    if name.endswith('.json'):
      _refuse('hardware', name, f'a hardware profile that loads: {e}')
    _refuse('hardware', name, allowed)


def check(config, check_hardware: bool = True) -> None:
  """Every field of config.sim (see the module docstring; sim.hardware unless check_hardware is
  False: a calibration writes the profile it names). ConfigError on the first bad one."""
  if 'sim' not in config:
    raise ConfigError('config.sim is missing: a section naming the simulated model and '
                      f'device ({", ".join(FIELDS)}; pagedjax/sim/sim_config.py)')
  sim = config.sim
  missing = [f for f in ('model', 'hardware') if f not in sim]
  if missing:
    raise ConfigError(f'config.sim has no field {missing[0]!r}: it needs model and hardware')
  unknown = sorted(set(sim.keys()) - set(FIELDS))
  if unknown:
    _refuse(unknown[0], sim[unknown[0]], f'a field of config.sim: {", ".join(FIELDS)}')
  for field in ('weight_dtype', 'activation_dtype'):
    value = sim.get(field, 'bf16')
    try:
      canonical = sizing.canonical_dtype(value)
    except (ValueError, AttributeError):
      canonical = None
    allowed = ACTIVATION_DTYPES if field == 'activation_dtype' else tuple(sizing.DTYPE_BITS)
    if canonical not in allowed:
      _refuse(field, value, f'one of {", ".join(allowed)} (or an alias: float32, bfloat16, ...)')
  fraction = sim.get('memory_fraction', 0.9)
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
      math.isfinite(fraction) and 0 < fraction <= 1):
    _refuse('memory_fraction', fraction, 'a share of one device\'s memory in (0, 1]')
  for field in ('num_kv_heads', 'num_blocks'):
    value = sim.get(field, 0)
    if not _is_int(value) or value < 0:
      what = ('the model\'s own' if field == 'num_kv_heads' else
              'as many as fit the device (plan_pool)')
      _refuse(field, value, f'an integer >= 0 (0: {what})')
  if not isinstance(sim.get('count_padding', True), bool):
    _refuse('count_padding', sim.count_padding, 'True or False')
  num_blocks = sim.get('num_blocks', 0)
  if num_blocks and num_blocks < config.engine.max_batch_size + 1:
    _refuse('num_blocks', num_blocks, f'0 (as many as fit), or at least engine.max_batch_size '
            f'+ 1 = {config.engine.max_batch_size + 1} (a block per row and the null block)')
  model_shape(config)
  if check_hardware:
    hardware_of(config)
