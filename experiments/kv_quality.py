"""Sweep jobs for the KV-quantization and GQA ablations (`config.job` in their configs).

kv_quality: perplexity of the model on real text (KJV) scored *through the paged pool* stored as
  the point's kv_dtype, against the same run with a bfloat16 pool, at each context length; top-1
  agreement and mean logit error by position; KV bytes per token (scales included); how many
  sequences of the longest context fit a fixed pool budget; and warm decode tokens/s.
gqa: the same model shape with a different num_kv_heads: KV bytes per token, sequences that fit
  the budget, and decode step time (random weights: quality is not the question there).
"""
import json
import math
import os

import numpy as np

from pagedjax import factory
from pagedjax.studies import run_info
from pagedjax.studies import text_data
from pagedjax.studies import workloads
from pagedjax.device import kv_schemes
from pagedjax.device.kv_schemes import KVQuantConfig
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.model.llama import init_params
from pagedjax.studies.scoring import ChunkScorer, score

_CACHE = {}  # one model per process: every point of a sweep shares it and its compiled steps


def _byte_model(config) -> bool:
  """A random model with a byte vocabulary (model.random.vocab_size=256, as the `:tiny`
  variants): it reads the text's UTF-8 bytes (workloads.byte_encode), as the trace studies do,
  and no tokenizer is built (parsing SmolLM2's takes seconds)."""
  return config.model.source == 'random' and config.model.random.vocab_size == 256


def _model(config):
  key = json.dumps(config.model.to_dict(), sort_keys=True)
  if key not in _CACHE:
    # A sweep over model shapes (gqa) keeps the tokenizer: random models all borrow the same
    # one, and parsing its GGUF costs seconds per point.
    source = (config.model.source, config.model.path)
    kept = _CACHE.get('tokenizer') if _CACHE.get('tokenizer_source') == source else None
    _CACHE.clear()
    if _byte_model(config):
      model_cfg = factory.typed(config).model.random_model_config()
      factory.check_pool_fits(model_cfg, factory.typed(config))
      _CACHE[key] = (model_cfg, init_params(model_cfg, seed=config.model.random.seed), None)
    else:
      _CACHE[key] = factory.load_model_and_tokenizer(config, tokenizer=kept)
    _CACHE['tokenizer'], _CACHE['tokenizer_source'] = _CACHE[key][2], source
  return _CACHE[key]


def _texts(tokenizer, num_sequences: int, length: int):
  """Equal-length token sequences from spread-out parts of the KJV (deterministic): the
  tokenizer's ids, or the text's UTF-8 bytes without one (a byte-vocabulary model)."""
  encode = tokenizer.encode if tokenizer is not None else workloads.byte_encode
  verses = text_data.kjv_verses()
  stride = len(verses) // num_sequences
  sequences = []
  for i in range(num_sequences):
    ids, v = [], i * stride
    while len(ids) < length:
      ids += encode(' '.join(verses[v:v + 50]) + ' ')
      v += 50
    sequences.append(ids[:length])
  return sequences


def capacity(model_cfg, kv_quant, block_size: int, budget_bytes: int, seq_len: int) -> dict:
  """Sequences of seq_len tokens that fit budget_bytes of pool: the scheme's own per-token count
  (codes, scales, per-block bookkeeping) for their blocks plus each sequence's fixed lane (ring,
  KIVI key tail); the one null lane is not a per-sequence cost."""
  scheme = kv_schemes.scheme_for(kv_quant)
  dims = (model_cfg.num_layers, model_cfg.num_kv_heads, block_size, model_cfg.head_dim)
  per_token = scheme.bytes_per_token(*dims)
  per_sequence = math.ceil(seq_len / block_size) * block_size * per_token + scheme.bytes_per_lane(
      *dims)
  return {'kv_bytes_per_token': per_token, 'bytes_per_sequence': per_sequence,
          'max_concurrent_sequences': int(budget_bytes // per_sequence)}


def _decode_step_seconds(config, model_cfg, params, tokenizer) -> float:
  """Median time per output token of a batch decode (prompts of eval.decode_prompt_len tokens):
  with every request decoding together, that is the decode step time. Engine clock, so
  compilation is excluded; two passes, the first warms every shape."""
  engine = factory.make_engine(config, model_cfg, params, tokenizer)
  ev = config.eval
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, model_cfg.vocab_size, ev.decode_prompt_len).tolist()
             for _ in range(ev.decode_batch)]
  sampling = SamplingParams(max_new_tokens=ev.decode_tokens, stop_on_eos=False)
  engine.generate(prompts, sampling)
  engine.generate(prompts, sampling)
  return engine.summary()['tpot_p50_s']


def kv_quality(config, workdir: str) -> dict:
  model_cfg, params, tokenizer = _model(config)
  ev = config.eval
  kv_quant = factory.typed(config).pool.kv_quant(model_cfg.dtype)
  reference = KVQuantConfig(ev.reference_kv_dtype)
  longest = max(ev.contexts)
  sequences = _texts(tokenizer, ev.num_sequences, longest + 1)
  key = ('scorer', json.dumps(config.model.to_dict(), sort_keys=True), config.attention.impl)
  scorer = _CACHE.setdefault(key, ChunkScorer(model_cfg, config.attention.impl))
  result = score(model_cfg, params, sequences, kv_quant, reference,
                 block_size=config.pool.block_size, chunk=ev.chunk, scorer=scorer)
  row = capacity(model_cfg, kv_quant, config.pool.block_size, ev.pool_budget_mb * 2**20,
                 longest)
  for ctx in ev.contexts:
    row[f'perplexity_{ctx}'] = result.perplexity(ctx)
    row[f'reference_perplexity_{ctx}'] = result.perplexity(ctx, ref=True)
  row['perplexity'] = row[f'perplexity_{longest}']
  row['perplexity_delta_pct'] = 100 * (row['perplexity'] / row[f'reference_perplexity_{longest}']
                                       - 1)
  row['greedy_agreement'] = float(result.agree.mean())
  row['logit_error_mean'] = float(result.logit_err.mean())
  by_position = result.error_by_position()
  row['logit_error_first_bucket'], row['logit_error_last_bucket'] = (
      list(by_position.values())[0], list(by_position.values())[-1])
  step = _decode_step_seconds(config, model_cfg, params, tokenizer)
  row['decode_tokens_per_second'] = ev.decode_batch / step
  with run_info.atomic_write(os.path.join(workdir, 'logit_error_by_position.json')) as f:
    json.dump(by_position, f, indent=1)
  return row


def gqa(config, workdir: str) -> dict:
  del workdir
  model_cfg, params, tokenizer = _model(config)
  kv_quant = factory.typed(config).pool.kv_quant(model_cfg.dtype)
  ev = config.eval
  row = capacity(model_cfg, kv_quant, config.pool.block_size, ev.pool_budget_mb * 2**20,
                 max(ev.contexts))
  row['num_kv_heads'] = model_cfg.num_kv_heads
  step = _decode_step_seconds(config, model_cfg, params, tokenizer)
  row['decode_step_ms'] = 1000 * step
  row['decode_tokens_per_second'] = ev.decode_batch / step
  return row
