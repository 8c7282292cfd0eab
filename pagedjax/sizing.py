"""KV-cache and weight sizing: how many requests of a given context fit next to the weights.

    python -m pagedjax.sizing --preset llama3-8b --context 8192 --batch 1 --hbm-gb 80

Why this exists: the KV cache, not the weights, bounds decode batch size, and the per-token KV
figure is easy to get wrong. It depends on the *KV* heads, not the query heads
(2 * layers * kv_heads * head_dim * bytes: Llama-3-8B with GQA holds 8 KV heads, so 128 KiB/token
in fp16, not the 512 KiB that 32 heads would give), and memory sizes mix GB (1e9) and GiB (2**30),
a 7% gap at this scale. Every byte figure here is exact integer bytes; printing shows both units.

KV bytes are what pagedjax's pool stores: for fp32, bf16, fp8, int8 and int4 the figure comes
from the storage scheme itself (pagedjax/device/kv_schemes.py, `KVScheme.bytes_per_token`: codes,
scales and zero points of every per-block array), the same method the engine's pool and the
simulator count with, so the three cannot disagree. Llama-3-8B: int8 and fp8 store 66,560 B/token
(65,536 of codes + a float16 scale per token and KV head), int4 40,960 (32,768 of codes + a
float16 scale and zero point per 32 channels). fp16 has no pool format and counts as plain 2-byte
values. `kv_scale_bytes` sizes another system's layout instead: codes plus one scale of that many
bytes per `kv_group_size` channels (default head_dim).

Sizes are counted, not measured: activations, the runtime's workspace and allocator fragmentation
are not included (pass `reserve_gb` to set memory aside for them), and weight-quantization
scales are not counted.
"""
import dataclasses
import math
import numbers
import re
from typing import Optional, Union

GB = 10**9
GIB = 2**30

# Bits per stored element. int4 is packed two per byte, so it is counted as half a byte.
DTYPE_BITS = {'fp32': 32, 'fp16': 16, 'bf16': 16, 'fp8': 8, 'int8': 8, 'int4': 4}
_DTYPE_ALIASES = {'float32': 'fp32', 'f32': 'fp32', 'float16': 'fp16', 'f16': 'fp16',
                  'half': 'fp16', 'bfloat16': 'bf16', 'fp8_e4m3': 'fp8', 'fp8_e5m2': 'fp8',
                  'e4m3': 'fp8', 'e5m2': 'fp8', 's8': 'int8', 's4': 'int4'}
# Only these carry per-group scales; a float16 cache has nothing to scale.
_QUANTIZED = ('fp8', 'int8', 'int4')
# This calculator's KV dtypes -> the pool's kv_dtype that stores them (fp16 has no pool format).
POOL_KV_DTYPES = {'fp32': 'float32', 'bf16': 'bfloat16', 'fp8': 'fp8_e4m3', 'int8': 'int8',
                  'int4': 'int4'}
POOL_BLOCK_SIZE = 16  # config.PoolConfig.block_size's default; only block-wide scales need it
NORMS = ('rms', 'layer')


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """The architecture numbers that decide parameter count and KV size (a decoder-only LM)."""
  name: str
  num_layers: int
  d_model: int
  num_heads: int  # query heads
  num_kv_heads: int  # == num_heads for MHA, 1 for MQA, in between for GQA
  head_dim: int
  ffn_dim: int
  vocab_size: int
  tie_embeddings: bool
  max_seq_len: int = 0  # trained context; 0 = unknown (no warning is given)
  gated_mlp: bool = True  # SwiGLU has gate, up and down matrices; OPT's ReLU MLP has two
  norm: str = 'rms'  # 'rms' has a scale per channel; 'layer' adds a bias
  linear_bias: bool = False  # OPT: a bias on every projection
  qkv_bias: bool = False  # Qwen2: a bias on q/k/v only
  learned_positions: int = 0  # rows of a learned position table (OPT: 2048 + its offset of 2)

  def __post_init__(self):
    for field in ('num_layers', 'd_model', 'num_heads', 'num_kv_heads', 'head_dim', 'ffn_dim',
                  'vocab_size'):
      if getattr(self, field) <= 0:
        raise ValueError(f'{field} must be positive, got {getattr(self, field)}')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'num_heads={self.num_heads} is not a multiple of '
                       f'num_kv_heads={self.num_kv_heads}')
    if self.norm not in NORMS:
      raise ValueError(f'norm={self.norm!r}; allowed: {", ".join(NORMS)}')


# Numbers from each model's published config.json.
PRESETS = {
    # facebook/opt-13b: MHA, ReLU MLP, LayerNorm, biases everywhere, learned positions, tied head.
    'opt-13b': ModelShape('OPT-13B', num_layers=40, d_model=5120, num_heads=40, num_kv_heads=40,
                          head_dim=128, ffn_dim=20480, vocab_size=50272, tie_embeddings=True,
                          max_seq_len=2048, gated_mlp=False, norm='layer', linear_bias=True,
                          learned_positions=2050),
    'llama3-8b': ModelShape('Llama-3-8B', num_layers=32, d_model=4096, num_heads=32,
                            num_kv_heads=8, head_dim=128, ffn_dim=14336, vocab_size=128256,
                            tie_embeddings=False, max_seq_len=8192),
    'llama3-70b': ModelShape('Llama-3-70B', num_layers=80, d_model=8192, num_heads=64,
                             num_kv_heads=8, head_dim=128, ffn_dim=28672, vocab_size=128256,
                             tie_embeddings=False, max_seq_len=8192),
    'smollm2-135m': ModelShape('SmolLM2-135M', num_layers=30, d_model=576, num_heads=9,
                               num_kv_heads=3, head_dim=64, ffn_dim=1536, vocab_size=49152,
                               tie_embeddings=True, max_seq_len=8192),
}


def _squash(name: str) -> str:
  return re.sub(r'[^a-z0-9]', '', name.lower())


def get_preset(name: str) -> ModelShape:
  """'llama3-8b', 'Llama-3-8B', 'llama_3_8b' all name the same preset."""
  by_squashed = {_squash(k): v for k, v in PRESETS.items()}
  if _squash(name) not in by_squashed:
    raise ValueError(f'unknown preset {name!r}; allowed: {", ".join(PRESETS)}')
  return by_squashed[_squash(name)]


def canonical_dtype(name: str) -> str:
  key = name.lower()
  key = _DTYPE_ALIASES.get(key, key)
  if key not in DTYPE_BITS:
    raise ValueError(f'unknown dtype {name!r}; allowed: {", ".join(DTYPE_BITS)} '
                     f'(aliases: {", ".join(_DTYPE_ALIASES)})')
  return key


def from_model_config(cfg) -> ModelShape:
  """A ModelShape from any config with the Llama-family attribute names (pagedjax ModelConfig)."""
  return ModelShape(
      name=getattr(cfg, 'name', type(cfg).__name__), num_layers=cfg.num_layers,
      d_model=cfg.d_model, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, ffn_dim=cfg.ffn_dim, vocab_size=cfg.vocab_size,
      tie_embeddings=cfg.tie_embeddings, max_seq_len=getattr(cfg, 'max_seq_len', 0),
      qkv_bias=getattr(cfg, 'qkv_bias', False))


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


def kv_heads_per_device(shape: ModelShape, tp: int) -> int:
  """KV heads one device holds under tensor parallelism of degree tp.

  Query heads split evenly. KV heads split evenly while tp <= kv_heads; past that each device
  still needs one whole KV head, so each head is replicated tp / kv_heads times.
  """
  if tp < 1:
    raise ValueError(f'tp must be >= 1, got {tp}')
  if shape.num_heads % tp:
    raise ValueError(f'tp={tp} does not divide num_heads={shape.num_heads}')
  if tp <= shape.num_kv_heads:
    if shape.num_kv_heads % tp:
      raise ValueError(f'tp={tp} does not divide num_kv_heads={shape.num_kv_heads}')
    return shape.num_kv_heads // tp
  if tp % shape.num_kv_heads:
    raise ValueError(f'tp={tp} > num_kv_heads={shape.num_kv_heads} needs tp to be a multiple '
                     f'of num_kv_heads so each head is replicated evenly')
  return 1


def param_breakdown(shape: ModelShape, tp: int = 1) -> dict:
  """Parameter count by part, for one device of a tp-way tensor-parallel split (tp=1: whole model).

  Megatron-style split: embeddings, head, q/o and MLP matrices and their column-parallel biases
  divide by tp; norms, the position table and row-parallel biases (o, down) are replicated;
  k/v divide by tp until tp passes num_kv_heads, then each device keeps one KV head's weights.
  """
  d, f, dh = shape.d_model, shape.ffn_dim, shape.head_dim
  hq = shape.num_heads // tp
  hkv = kv_heads_per_device(shape, tp)
  attn = d * hq * dh * 2 + d * hkv * dh * 2  # q, o; k, v
  if shape.linear_bias or shape.qkv_bias:
    attn += (hq + 2 * hkv) * dh
  if shape.linear_bias:
    attn += d  # o bias, replicated
  mlp_mats = 3 if shape.gated_mlp else 2
  mlp = mlp_mats * d * f // tp
  if shape.linear_bias:
    mlp += (mlp_mats - 1) * f // tp + d  # column-parallel biases split, the down bias replicated
  norm_size = d if shape.norm == 'rms' else 2 * d
  vocab_shard = math.ceil(shape.vocab_size / tp)
  parts = {
      'embedding': vocab_shard * d,
      'positions': shape.learned_positions * d,
      'attention': shape.num_layers * attn,
      'mlp': shape.num_layers * mlp,
      'norms': (2 * shape.num_layers + 1) * norm_size,
      'lm_head': 0 if shape.tie_embeddings else vocab_shard * d,
  }
  parts['total'] = sum(parts.values())
  return parts


def param_count(shape: ModelShape) -> int:
  return param_breakdown(shape)['total']


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------


def _kv_elements_per_token(shape: ModelShape, kv_heads: int) -> int:
  return 2 * shape.num_layers * kv_heads * shape.head_dim  # K and V


def _is_count(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _check_group(shape: ModelShape, kv_dtype: str, group_size: Optional[int]):
  if group_size is None:
    return
  if kv_dtype not in _QUANTIZED:
    raise ValueError(f'kv_group_size={group_size} given for kv_dtype={kv_dtype!r}; scales apply '
                     f'only to quantized KV dtypes: {", ".join(_QUANTIZED)}')
  if not _is_count(group_size) or shape.head_dim % group_size:
    raise ValueError(f'kv_group_size={group_size} must be positive and divide '
                     f'head_dim={shape.head_dim} (scale groups run along head_dim)')


def pool_kv_spec(shape: ModelShape, kv_dtype: str, kv_group_size: Optional[int] = None):
  """The pool's storage spec (kv_schemes.KVQuantConfig) for one of POOL_KV_DTYPES; ValueError
  for a group size the pool does not store that way."""
  from pagedjax.device.kv_schemes import KVQuantConfig  # pylint: disable=g-import-not-at-top
  kv_dtype = canonical_dtype(kv_dtype)
  _check_group(shape, kv_dtype, kv_group_size)
  if kv_dtype == 'int4':
    spec = KVQuantConfig('int4', **({} if kv_group_size is None else
                                    {'group_size': kv_group_size}))
  else:
    if kv_group_size not in (None, shape.head_dim):
      raise ValueError(
          f'kv_group_size={kv_group_size} is not how the pool stores {kv_dtype}: one scale per '
          f'token and KV head, a group of head_dim={shape.head_dim} channels; give '
          'kv_scale_bytes to size another layout')
    spec = KVQuantConfig(POOL_KV_DTYPES[kv_dtype])
  spec.validate(shape.head_dim)
  return spec


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str = 'fp16', *,
                       kv_group_size: Optional[int] = None,
                       kv_scale_bytes: Optional[int] = None,
                       kv_heads: Optional[int] = None,
                       block_size: int = POOL_BLOCK_SIZE) -> Union[int, float]:
  """Bytes of K and V for one token over all layers and kv_heads (default: all of them; one
  device's share under tensor parallelism).

  Without kv_scale_bytes: what pagedjax's pool stores (module docstring), counted by the
    storage scheme (kv_schemes.KVScheme.bytes_per_token) for kv_group_size (int4: channels per
    scale, default the pool's 32) and block_size (which only block-wide scales depend on); fp16,
    which the pool has no format for, is 2 * layers * kv_heads * head_dim * 2.
  With kv_scale_bytes: another layout, codes plus one scale of kv_scale_bytes bytes (2 = an fp16
    scale; 4 = fp16 scale + zero point) per kv_group_size channels (default head_dim).
  An int, except where a scheme's block-wide arrays do not divide evenly over block_size tokens.
  """
  kv_dtype = canonical_dtype(kv_dtype)
  heads = shape.num_kv_heads if kv_heads is None else kv_heads
  if kv_scale_bytes is not None:
    if not _is_count(kv_scale_bytes):
      raise ValueError(f'kv_scale_bytes={kv_scale_bytes!r} must be an integer >= 1')
    if kv_dtype not in _QUANTIZED:
      raise ValueError(f'kv_scale_bytes={kv_scale_bytes} given for kv_dtype={kv_dtype!r}; '
                       f'scales apply only to quantized KV dtypes: {", ".join(_QUANTIZED)}')
    group = shape.head_dim if kv_group_size is None else kv_group_size
    _check_group(shape, kv_dtype, group)
    elements = _kv_elements_per_token(shape, heads)
    return math.ceil(elements * DTYPE_BITS[kv_dtype] / 8) + elements // group * kv_scale_bytes
  if kv_dtype not in POOL_KV_DTYPES:
    _check_group(shape, kv_dtype, kv_group_size)
    return math.ceil(_kv_elements_per_token(shape, heads) * DTYPE_BITS[kv_dtype] / 8)
  if not _is_count(block_size):
    raise ValueError(f'block_size={block_size!r} must be an integer >= 1')
  # The scheme classes import jax: only a pool format's figure needs them.
  from pagedjax.device.kv_schemes import scheme_for  # pylint: disable=g-import-not-at-top
  scheme = scheme_for(pool_kv_spec(shape, kv_dtype, kv_group_size))
  per_token = scheme.bytes_per_token(shape.num_layers, heads, block_size, shape.head_dim)
  return int(per_token) if float(per_token).is_integer() else per_token


def plan(shape: ModelShape, context: int, batch: int = 1, kv_dtype: str = 'fp16', tp: int = 1,
         hbm_gb: float = 80.0, *, weight_dtype: str = 'fp16', kv_group_size: Optional[int] = None,
         kv_scale_bytes: Optional[int] = None, block_size: Optional[int] = None,
         reserve_gb: float = 0.0) -> dict:
  """Memory plan for one device of a tp-way split; every figure is in bytes unless named otherwise.

  hbm_gb is per device, in GB of 1e9 bytes (an '80 GB' A100/H100 holds ~80 GiB, ~85.5e9 bytes).
  block_size, if given, rounds each request's KV up to whole paged blocks. KV bytes per token:
  kv_bytes_per_token (the pool's layout unless kv_scale_bytes is given).
  """
  if not _is_count(context) or not _is_count(batch):
    raise ValueError(f'context and batch must be integers >= 1, got context={context!r}, '
                     f'batch={batch!r}')
  if not (_is_finite(hbm_gb) and hbm_gb > 0) or not (_is_finite(reserve_gb) and reserve_gb >= 0):
    raise ValueError(f'hbm_gb must be a finite number > 0 and reserve_gb a finite number >= 0, '
                     f'got {hbm_gb!r}, {reserve_gb!r}')
  if block_size is not None and not _is_count(block_size):
    raise ValueError(f'block_size must be an integer >= 1, got {block_size!r}')
  kv_dtype, weight_dtype = canonical_dtype(kv_dtype), canonical_dtype(weight_dtype)
  notes = []
  hkv = kv_heads_per_device(shape, tp)
  replication = max(1, tp // shape.num_kv_heads)
  if replication > 1:
    notes.append(f'tp={tp} > num_kv_heads={shape.num_kv_heads}: each KV head is replicated on '
                 f'{replication} devices, so KV memory summed over devices is {replication}x the '
                 f'model\'s own KV size')
  if shape.max_seq_len and context > shape.max_seq_len:
    notes.append(f'context={context} exceeds the trained context {shape.max_seq_len}')

  params = param_count(shape)
  params_dev = param_breakdown(shape, tp)['total']
  weight_bytes = math.ceil(params_dev * DTYPE_BITS[weight_dtype] / 8)
  layout = dict(kv_group_size=kv_group_size, kv_scale_bytes=kv_scale_bytes,
                block_size=block_size or POOL_BLOCK_SIZE)
  kv_token = kv_bytes_per_token(shape, kv_dtype, **layout)
  kv_token_dev = kv_bytes_per_token(shape, kv_dtype, kv_heads=hkv, **layout)
  tokens_held = context if block_size is None else math.ceil(context / block_size) * block_size
  kv_request = kv_token_dev * tokens_held
  hbm = int(hbm_gb * GB)
  free = hbm - int(reserve_gb * GB) - weight_bytes
  if free <= 0:
    notes.append('the weights (plus reserve) alone do not fit in this HBM')
  max_requests = max(0, free) // kv_request
  return {
      'model': shape.name, 'context': context, 'batch': batch, 'tp': tp,
      'kv_dtype': kv_dtype, 'weight_dtype': weight_dtype, 'kv_group_size': kv_group_size,
      'kv_layout': kv_layout(shape, kv_dtype, kv_group_size, kv_scale_bytes),
      'params': params, 'params_per_device': params_dev,
      'weight_bytes_per_device': weight_bytes,
      'kv_heads_per_device': hkv, 'kv_head_replication': replication,
      'kv_bytes_per_token': kv_token, 'kv_bytes_per_token_per_device': kv_token_dev,
      'kv_bytes_per_request_per_device': kv_request,
      'kv_bytes_batch_per_device': kv_request * batch,
      'hbm_bytes_per_device': hbm, 'kv_budget_bytes_per_device': max(0, free),
      'max_concurrent_requests': max_requests,
      'max_kv_tokens_per_device': max(0, free) // kv_token_dev,
      'batch_fits': batch <= max_requests,
      'notes': notes,
  }


def _is_finite(value) -> bool:
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))


def kv_layout(shape: ModelShape, kv_dtype: str, kv_group_size: Optional[int] = None,
              kv_scale_bytes: Optional[int] = None) -> str:
  """What the KV figures count, in words."""
  kv_dtype = canonical_dtype(kv_dtype)
  if kv_scale_bytes is not None:
    return (f'another layout: {kv_dtype} codes + {kv_scale_bytes} B per '
            f'{kv_group_size or shape.head_dim} channels')
  if kv_dtype not in POOL_KV_DTYPES:
    return f'plain {kv_dtype} values (no pool format)'
  from pagedjax.device.kv_schemes import scheme_for  # pylint: disable=g-import-not-at-top
  return f'as the pool stores it: {scheme_for(pool_kv_spec(shape, kv_dtype, kv_group_size))!r}'


def pool_per_device(shape: ModelShape, num_blocks: int, block_size: int, kv_dtype: str = 'fp16',
                    tp: int = 1) -> dict:
  """A paged pool of num_blocks blocks (the null block 0 included) split tp ways over KV heads.

  Every device holds every block, for its own KV heads only, so capacity in tokens is the same
  on each device as on one: (num_blocks - 1) * block_size. pagedjax's run summary measures the
  same two byte figures from the pool's actual shards (experiments/decode.py).
  """
  if num_blocks < 2 or block_size < 1:
    raise ValueError(f'num_blocks must be >= 2 (block 0 is the null block) and block_size >= 1, '
                     f'got num_blocks={num_blocks}, block_size={block_size}')
  hkv = kv_heads_per_device(shape, tp)
  per_token = kv_bytes_per_token(shape, kv_dtype, kv_heads=hkv)
  return {'tp': tp, 'kv_heads_per_device': hkv,
          'kv_head_replication': max(1, tp // shape.num_kv_heads),
          'kv_bytes_per_token_per_device': per_token,
          'kv_pool_bytes_per_device': per_token * num_blocks * block_size,
          'kv_capacity_tokens': (num_blocks - 1) * block_size}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def format_bytes(n: int) -> str:
  """Both units, because quoted figures mix them: '819,200 B (819.2 kB = 800.0 KiB)'."""
  for dec, dec_name, binary, bin_name in ((GB, 'GB', GIB, 'GiB'), (10**6, 'MB', 2**20, 'MiB'),
                                          (10**3, 'kB', 2**10, 'KiB')):
    if n >= dec:
      return f'{n:,} B ({n / dec:.1f} {dec_name} = {n / binary:.1f} {bin_name})'
  return f'{n:,} B'


def format_plan(p: dict) -> str:
  dev = ' per device' if p['tp'] > 1 else ''
  kv_desc = p['kv_dtype'] + (f" (group {p['kv_group_size']})" if p['kv_group_size'] else '')
  params = f"{p['params']:,} ({p['params'] / 1e9:.3f} B)"
  if p['tp'] > 1:
    params += f"; {p['params_per_device']:,}{dev}"
  rows = [('parameters', params),
          (f'weights{dev}', format_bytes(p['weight_bytes_per_device'])),
          ('KV per token', format_bytes(p['kv_bytes_per_token']))]
  if p['tp'] > 1:
    rows.append((f'KV per token{dev}', f"{format_bytes(p['kv_bytes_per_token_per_device'])}, "
                 f"{p['kv_heads_per_device']} KV head(s)"))
  rows += [(f'KV per request{dev}', format_bytes(p['kv_bytes_per_request_per_device'])),
           (f'KV for the batch{dev}', format_bytes(p['kv_bytes_batch_per_device'])),
           (f'HBM{dev}', format_bytes(p['hbm_bytes_per_device'])),
           (f'left for KV{dev}', format_bytes(p['kv_budget_bytes_per_device'])),
           ('concurrent requests', f"{p['max_concurrent_requests']:,} at this context "
            f"({p['max_kv_tokens_per_device']:,} KV tokens); batch {p['batch']} "
            + ('fits' if p['batch_fits'] else 'does NOT fit'))]
  width = max(len(label) for label, _ in rows) + 1
  lines = [f"{p['model']}: context {p['context']}, batch {p['batch']}, tp {p['tp']}, "
           f"KV {kv_desc}, weights {p['weight_dtype']}", f"  KV layout: {p['kv_layout']}"]
  lines += [f'  {label + ":":<{width}} {value}' for label, value in rows]
  lines += [f'  note: {n}' for n in p['notes']]
  lines.append('  (not counted: activations, workspace, fragmentation, weight-quant scales)')
  return '\n'.join(lines)


def _parser():
  """argparse rather than absl: the documented flags are dashed (--hbm-gb), and nothing is
  registered globally, so experiments can import this module next to their own absl flags."""
  import argparse  # pylint: disable=g-import-not-at-top
  ap = argparse.ArgumentParser(prog='python -m pagedjax.sizing', description=__doc__.split('\n')[0])

  def add(name, **kw):  # accept --kv-dtype and --kv_dtype alike
    spellings = dict.fromkeys([f'--{name}', f'--{name.replace("-", "_")}'])
    ap.add_argument(*spellings, **kw)

  add('preset', required=True, help=f'model preset: {", ".join(PRESETS)}')
  add('context', type=int, help="tokens per request (default: the preset's trained context)")
  add('batch', type=int, default=1, help='concurrent requests to check')
  add('kv-dtype', default='fp16', help=f'KV cache dtype: {", ".join(DTYPE_BITS)}')
  add('weight-dtype', default='fp16', help=f'weight dtype: {", ".join(DTYPE_BITS)}')
  add('kv-group-size', type=int,
      help="int4: channels per scale (the pool's default 32); with --kv-scale-bytes: the group "
           'of another layout (default head_dim)')
  add('kv-scale-bytes', type=int,
      help="bytes per scale of another layout than the pool's (4 = fp16 scale + zero point); "
           'default: the pool\'s own layout (pagedjax/device/kv_schemes.py)')
  add('tp', type=int, default=1, help='tensor-parallel degree')
  add('hbm-gb', type=float, default=80.0,
      help='HBM per device in GB of 1e9 bytes (an "80 GB" A100/H100 holds ~80 GiB, ~85.5 GB)')
  add('reserve-gb', type=float, default=0.0, help='GB per device kept for activations etc.')
  add('block-size', type=int, help='round each request up to whole paged blocks')
  add('json', action='store_true', help='print the plan as JSON')
  return ap


class FlagError(ValueError):
  """A flag with a value that is not allowed; the message names both and what is allowed."""

  def __init__(self, flag: str, value, allowed: str):
    super().__init__(f'--{flag}={value!r} is not allowed: {allowed}')


def check_flags(a) -> ModelShape:
  """Every flag's value, before any work; returns the preset's shape. FlagError names the first
  bad one (argparse has already refused values that are not numbers)."""
  try:
    shape = get_preset(a.preset)
  except ValueError:
    raise FlagError('preset', a.preset, f'one of {", ".join(PRESETS)}') from None
  for flag in ('kv-dtype', 'weight-dtype'):
    value = getattr(a, flag.replace('-', '_'))
    try:
      canonical_dtype(value)
    except ValueError:
      raise FlagError(flag, value, f'one of {", ".join(DTYPE_BITS)} (aliases: '
                      f'{", ".join(_DTYPE_ALIASES)})') from None
  counts = {'context': "tokens per request; omit the flag for the preset's trained context",
            'batch': 'concurrent requests', 'tp': 'the tensor-parallel degree',
            'kv-group-size': 'channels per scale', 'kv-scale-bytes': 'bytes per scale',
            'block-size': 'tokens per paged block'}
  for flag, what in counts.items():
    value = getattr(a, flag.replace('-', '_'))
    if value is not None and value < 1:
      raise FlagError(flag, value, f'an integer >= 1 ({what})')
  for flag, lowest in (('hbm-gb', '> 0'), ('reserve-gb', '>= 0')):
    value = getattr(a, flag.replace('-', '_'))
    if not math.isfinite(value) or not (value > 0 if flag == 'hbm-gb' else value >= 0):
      raise FlagError(flag, value, f'a finite number of GB (10^9 bytes) {lowest}')
  try:
    kv_heads_per_device(shape, a.tp)
  except ValueError as e:
    raise FlagError('tp', a.tp, f'{e} ({shape.name})') from None
  try:
    kv_bytes_per_token(shape, a.kv_dtype, kv_group_size=a.kv_group_size,
                       kv_scale_bytes=a.kv_scale_bytes)
  except ValueError as e:
    flag = 'kv-group-size' if a.kv_group_size is not None else 'kv-scale-bytes'
    raise FlagError(flag, getattr(a, flag.replace('-', '_')), str(e)) from None
  return shape


def main(argv=None):
  import json  # pylint: disable=g-import-not-at-top
  ap = _parser()
  a = ap.parse_args(argv)
  try:
    shape = check_flags(a)
  except FlagError as e:
    ap.error(str(e))  # usage line + one error line, exit status 2, no traceback
  p = plan(shape, shape.max_seq_len if a.context is None else a.context, a.batch, a.kv_dtype,
           a.tp, a.hbm_gb, weight_dtype=a.weight_dtype, kv_group_size=a.kv_group_size,
           kv_scale_bytes=a.kv_scale_bytes, block_size=a.block_size, reserve_gb=a.reserve_gb)
  print(json.dumps(p, indent=2) if a.json else format_plan(p))


if __name__ == '__main__':
  main()
