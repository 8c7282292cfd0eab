"""Contexts longer than the device pool: the engine streams the oldest blocks from host RAM or disk.

  python -m experiments.long_context --workdir=runs/long_context
  python -m experiments.long_context --config=configs/long_context.py:tiny --workdir=/tmp/lc

One greedy request whose context (prompt + new tokens) is `context_multiple` x the device pool
(configs/long_context.py), served these ways:
  refused      the normal engine with that pool, offload off: RequestError at submit (recorded)
  all_device   the normal engine with a pool just big enough (context_multiple x the memory):
               the reference tokens and logits
  streamed     the engine with that pool and offload on (config.offload, through
               pagedjax/long_context.py's thin loop) at each (window, chunk[, layers per
               call]) point: the newest window blocks on the device, older blocks in host RAM
               streamed every step, one program per group of layers folding them in chunks;
               its tokens must equal all_device's. The `disk_points` run again with every
               offloaded block on the disk tier (offload.placement='disk', a tensorstore
               directory under WORKDIR, removed after)
  recompute    no cache: each step re-runs the whole context through the model (one layer's K/V
               alive at a time), its logits at the last position only
and more figures:
  beside       `beside_requests` ordinary requests alone, then beside the long one (offloaded with
               a window of `beside_window` blocks) in the same engine: their TPOT both ways,
               and with offload.join_decodes off (their decodes in the batched step, then the
               streamed call: two passes over the weights), in `repeats` interleaved rounds
               (every request's TPOT pooled); then once for each
               `beside_decode_every` (config.offload.decode_every: the long one decodes on
               one iteration in k while they run), with the long one's TPOT
  pair         in that engine, the long request's decode steps alone and with a second long
               request decoding at the same time (their rows batched in one streamed call)
  follow_up    prefix caching over offloaded blocks: in an offloaded engine with
               prefix_cache.enabled (the first point's window and chunk), the long document
               and its answer, then a follow-up turn (document, answer and a question of
               `follow_up_tokens` KJV tokens): its time to first token and prompt tokens
               computed with offload.cache_blocks (the offloaded blocks indexed) and without
               (only the device cache), after a warm-up pair of turns over another passage
  cost model   host/tiers/tier_cost.py's TierCosts, measured on a streamed engine
               (pagedjax/tiering.py): per point, the modelled seconds to stream its host blocks
               once (one decode step), to recompute the whole context once, and their ratio,
               the break-even: the decode steps after which streaming has cost what one
               recomputation of the context costs (offloading beats preempting by recompute for
               fewer remaining steps than that)
  projection   the same break-even, and decode time streamed over all-device, for contexts
               `project_contexts` with a device window of `project_window_fraction` of each, on
               this CPU (the measured TierCosts, for this study's model) and on the
               `project_hardware` presets (pagedjax/sim/hardware.py) for this model and the
               `project_models` presets (pagedjax/sizing.py). Analytic, from the simulator's
               cost model (pagedjax/sim/cost_model.py: prefill chunks and decode steps on the
               preset's FLOP/s and bandwidths) and the preset's host link for the stream; the
               simulated engine itself refuses offload, so no simulated run is involved, and the
               transfer is taken as not overlapped with compute (an upper bound on its cost)
Every timed figure is a warm run: the engine after a compiling pass, each streamed engine after
a warm-up that compiled its shapes (a prompt just long enough to offload and stream), recompute
after its one compile. Decode speed comes from per-step wall times: the fastest step (other
work on a shared machine only adds time, so it is the best estimate of a step's own cost) and
the median. Every point runs `repeats` times in rounds of alternating order, the engine timed
before each round and after the last, so drifting load spreads over all rows. Compare rows of
one run as ratios.

Writes to WORKDIR:
  results.jsonl, results.csv  one line per streamed point: placement, window, chunk and
                              layers per streamed program, bytes
                              streamed per decode step (padding included) and the useful part,
                              decode ms/token and tokens/s, prefill seconds and bytes, device KV
                              bytes, whether the tokens match all_device and the largest logit
                              difference, and the cost model's break-even
  projection.csv              one line per (machine, model, context): stream and recompute
                              seconds, break-even decode steps, decode ms all-device and
                              streamed, KV bytes against the device's memory
  long_context.png            decode ms/token per point against all_device, and MB streamed
                              per decode step
  beside.png                  ordinary requests' TPOT alone and beside the long one; the long
                              request's decode step alone and with a second one
  break_even.png              recompute-vs-stream break-even and streamed/all-device decode time
                              against context, per machine and model
  table.md                    the points, beside/pair, the projection (printed too)
  summary.json                the rows, the baselines, the refusal message, `beside`, `pair`,
                              the cost model's figures, the projection, the goals (tokens
                              identical; the issue's speed goals as measured), config, versions,
                              git
"""
import dataclasses
import json
import math
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli
from experiments import plots
from pagedjax import factory, sizing, tiering
from pagedjax.studies import run_info
from pagedjax.studies import text_data
from pagedjax.studies import workloads
from pagedjax.config import Config, ConfigError
from pagedjax.model.step import CompiledStep
from pagedjax.host.requests.intake import RequestError
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.long_context import LongContextDecoder, LongContextSettings
from pagedjax.model.llama import Llama, init_params
from pagedjax.sim import cost_model as sim_cost
from pagedjax.sim import hardware as sim_hardware

COLUMNS = ('placement', 'window_blocks', 'chunk_blocks', 'layers_per_call', 'window_tokens',
           'context_over_window',
           'host_blocks', 'mb_streamed_per_step', 'useful_mb_streamed_per_step',
           'decode_tokens_per_s_best', 'decode_tokens_per_s', 'decode_ms_per_token_best',
           'decode_ms_per_token', 'decode_ms_per_token_mean', 'over_all_device_best',
           'streamed_gb_per_s', 'prefill_s', 'prefill_mb_streamed', 'window_kv_mb',
           'device_kv_mb', 'tokens_match', 'max_abs_logit_diff', 'compilations',
           'model_stream_s_per_step', 'model_recompute_context_s', 'break_even_decode_steps')
TABLE = ('placement', 'window_blocks', 'chunk_blocks', 'layers_per_call', 'mb_streamed_per_step',
         'decode_ms_per_token_best', 'decode_ms_per_token', 'over_all_device_best', 'prefill_s',
         'tokens_match', 'max_abs_logit_diff', 'break_even_decode_steps')
PROJECTION_COLUMNS = ('machine', 'model', 'source', 'context_tokens', 'window_tokens',
                      'host_blocks', 'stream_mb_per_step', 'stream_s_per_step',
                      'recompute_context_s', 'break_even_decode_steps',
                      'decode_ms_all_device', 'decode_ms_streamed', 'streamed_over_all_device',
                      'kv_gb', 'device_gb', 'kv_fits_device')
PROJECTION_TABLE = ('machine', 'model', 'context_tokens', 'stream_s_per_step',
                    'recompute_context_s', 'break_even_decode_steps',
                    'streamed_over_all_device', 'kv_fits_device')
MB = 1e6


# ------------------------------------------------------------------------------------------------
# Settings
# ------------------------------------------------------------------------------------------------
def _pairs(lc, name: str, typed) -> list:
  """config.long_context.<name> as settings, or ConfigError: (window_blocks, chunk_blocks),
  or (window_blocks, chunk_blocks, layers_per_call) (config.offload.layers_per_call; 1 when
  not given)."""
  out, pool_blocks = [], typed.pool.num_blocks - 1
  for i, point in enumerate(lc[name]):
    try:
      window, chunk, *rest = point
      (layers,) = rest or (1,)
      out.append(LongContextSettings(typed.pool.block_size, pool_blocks, window, chunk,
                                     lc.prefill_chunk, layers_per_call=layers).validate())
    except (TypeError, ValueError) as e:
      raise ConfigError(f'config.long_context.{name}[{i}]={point!r} is not allowed: '
                        f'(window_blocks, chunk_blocks) or (window_blocks, chunk_blocks, '
                        f'layers_per_call) with {e}') from None
  return out


def check(config):
  """(typed engine Config, [LongContextSettings] of the points, [those of the disk points],
  context tokens) or ConfigError naming the field, before anything loads."""
  typed = Config.from_configdict(config)
  lc = config.long_context
  for name, least in (('context_multiple', 1), ('recompute_tokens', 1), ('repeats', 1),
                      ('prompt_verse', 0), ('beside_requests', 0), ('beside_window', 1),
                      ('beside_prompt_tokens', 1), ('beside_new_tokens', 2),
                      ('follow_up_tokens', 1), ('follow_up_new_tokens', 1),
                      ('project_chunk_tokens', 1)):
    value = lc[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise ConfigError(f'config.long_context.{name}={value!r} is not allowed: an integer '
                        f'>= {least}')
  pool_tokens = (typed.pool.num_blocks - 1) * typed.pool.block_size
  context = lc.context_multiple * pool_tokens
  new = typed.sampling.max_new_tokens
  if new < 2:
    raise ConfigError(f'config.sampling.max_new_tokens={new} is not allowed: at least 2 (the '
                      'first token ends the prefill; decode steps are the ones after it)')
  if new >= context or context > typed.engine.max_seq_len:
    raise ConfigError(
        f'config.long_context.context_multiple={lc.context_multiple} is not allowed with a pool '
        f'of {pool_tokens} tokens: the context ({context}) must exceed sampling.max_new_tokens '
        f'({new}) and be at most engine.max_seq_len={typed.engine.max_seq_len}')
  if not lc.points:
    raise ConfigError(f'config.long_context.points={lc.points!r} is not allowed: '
                      '(window_blocks, chunk_blocks) pairs')
  settings, disk = _pairs(lc, 'points', typed), _pairs(lc, 'disk_points', typed)
  if not isinstance(lc.disk_kvstore, str):
    raise ConfigError(f'config.long_context.disk_kvstore={lc.disk_kvstore!r} is not allowed: a '
                      "directory or tensorstore kvstore URL ('' = WORKDIR/offload_disk)")
  pool_blocks = typed.pool.num_blocks - 1
  room = (pool_blocks - lc.beside_window) * typed.pool.block_size
  if lc.beside_requests and lc.beside_prompt_tokens + lc.beside_new_tokens > room:
    raise ConfigError(
        f'config.long_context.beside_window={lc.beside_window} is not allowed with '
        f'beside_prompt_tokens + beside_new_tokens = '
        f'{lc.beside_prompt_tokens + lc.beside_new_tokens}: the pool ({pool_blocks} blocks of '
        f'{typed.pool.block_size}) must hold the window and one ordinary request beside it')
  if 2 * lc.beside_window > pool_blocks:
    raise ConfigError(
        f'config.long_context.beside_window={lc.beside_window} is not allowed: at most '
        f'{pool_blocks // 2}, half the pool (the pair runs two long requests, a window each)')
  every = lc.beside_decode_every
  if not isinstance(every, tuple) or not all(
      isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in every):
    raise ConfigError(f'config.long_context.beside_decode_every={every!r} is not allowed: a '
                      'tuple of integers >= 1 (config.offload.decode_every values)')
  for name in lc.project_hardware:
    try:
      sim_hardware.get_hardware(name)
    except ValueError as e:
      raise ConfigError(f'config.long_context.project_hardware: {e}') from None
  for name in lc.project_models:
    try:
      sizing.get_preset(name)
    except ValueError as e:
      raise ConfigError(f'config.long_context.project_models: {e}') from None
  contexts = lc.project_contexts
  if not contexts or any(isinstance(c, bool) or not isinstance(c, int) or
                         c < 2 * typed.pool.block_size for c in contexts):
    raise ConfigError(f'config.long_context.project_contexts={contexts!r} is not allowed: '
                      f'integers >= {2 * typed.pool.block_size} (two blocks)')
  fraction = lc.project_window_fraction
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
      0 < fraction < 1):
    raise ConfigError(f'config.long_context.project_window_fraction={fraction!r} is not '
                      'allowed: a share of the context in (0, 1)')
  return typed, settings, disk, context


def load_model(config) -> tuple:
  """(model config, params, tokenizer or None, encode). A random model with a byte vocabulary
  (model.random.vocab_size=256, as in `:tiny`) reads the UTF-8 bytes of the text, as the trace
  studies do: no tokenizer to build (parsing SmolLM2's takes seconds)."""
  typed = Config.from_configdict(config)
  if typed.model.source == 'random' and typed.model.random.vocab_size == 256:
    model_cfg = typed.model.random_model_config()
    return model_cfg, init_params(model_cfg, seed=typed.model.random.seed), None, (
        workloads.byte_encode)
  model_cfg, params, tokenizer = factory.load_model_and_tokenizer(config)
  return model_cfg, params, tokenizer, tokenizer.encode


def prompt_ids(encode, length: int, verse: int) -> list:
  """`length` tokens of KJV text from `verse` on."""
  chars = 8 * length
  while True:
    ids = encode(text_data.passage(verse, chars))
    if len(ids) >= length:
      return ids[:length]
    chars *= 2


# ------------------------------------------------------------------------------------------------
# The ways a long request is served
# ------------------------------------------------------------------------------------------------
def refused(config, model_cfg, params, tokenizer, ids, sampling) -> str:
  """The normal engine with the configured pool: what submit says."""
  engine = factory.make_engine(config, model_cfg, params, tokenizer)
  try:
    engine.submit(ids, sampling)
  except RequestError as e:
    return str(e)
  raise RuntimeError(f'the engine accepted a {len(ids)}-token prompt with a pool of '
                     f'{config.pool.num_blocks} blocks: the study needs a pool it cannot fit')


def decode_figures(step_seconds) -> dict:
  """Decode speed from per-step times. On a shared machine other work only ever adds time, so
  the fastest step is the best estimate of a step's own cost (`_best`); the median is what a
  user of this machine saw (the mean and every step's time are kept too)."""
  ms = 1e3 * np.asarray(step_seconds)
  return {'decode_tokens_per_s_best': 1e3 / ms.min(), 'decode_tokens_per_s': 1e3 / np.median(ms),
          'decode_ms_per_token_best': ms.min(), 'decode_ms_per_token': np.median(ms),
          'decode_ms_per_token_mean': ms.mean(), 'decode_steps_timed': len(ms),
          'step_ms': [round(float(t), 3) for t in ms]}


def all_device_engine(config, model_cfg, params, tokenizer, context):
  """The normal engine with a pool just big enough for the whole context."""
  config = config.copy_and_resolve_references()
  config.pool.num_blocks = -(-context // config.pool.block_size) + 1  # + the null block
  return factory.make_engine(config, model_cfg, params, tokenizer, record_logits=True)


def all_device(engine, passes: list) -> dict:
  """The engine's reference tokens and logits, and its figures over its timed passes."""
  steps = [t for p in passes for t in p['step_seconds']]
  tokens = {tuple(p['tokens']) for p in passes}
  if len(tokens) != 1:
    raise RuntimeError(f'the all-device engine gave different tokens on its passes: {tokens}')
  return {'tokens': passes[0]['tokens'], 'logits': passes[0]['logits'],
          'num_blocks': engine.pool.num_blocks, 'kv_pool_mb': engine.pool.nbytes / MB,
          'prefill_s': float(np.median([p['prefill_s'] for p in passes])),
          **decode_figures(steps)}


def timed_pass(engine, ids, sampling) -> dict:
  """One request through the engine, step by step: the steps up to its first token are the
  prefill, each later one a decode step."""
  request = engine.submit(ids, sampling)
  step_seconds, prefill_seconds, start = [], None, time.perf_counter()
  while request not in engine.finished:
    t0 = time.perf_counter()
    engine.step()
    if prefill_seconds is None:
      if engine.running and engine.running[0].output_ids or request in engine.finished:
        prefill_seconds = time.perf_counter() - start
    else:
      step_seconds.append(time.perf_counter() - t0)
  done = engine.finished[request]
  return {'tokens': done.output_ids, 'logits': np.stack(done.logits), 'prefill_s': prefill_seconds,
          'step_seconds': step_seconds}


def recompute(model_cfg, params, ids, num_tokens: int, context: int) -> dict:
  """Greedy tokens by re-running the whole sequence each step, no cache: the tokens are padded
  to the full context (one compilation; padding after the last real token cannot change it)."""
  model = Llama(model_cfg)

  @jax.jit
  def next_token(params, tokens, last):
    positions = jnp.arange(context, dtype=jnp.int32)[None]
    logits, _ = model.apply(params, tokens, positions, logits_index=last)
    return jnp.argmax(logits[0]).astype(jnp.int32)

  tokens, out, seconds = np.zeros((1, context), np.int32), [], []
  tokens[0, :len(ids)] = ids
  next_token(params, tokens, np.int32([len(ids) - 1])).block_until_ready()  # compiles
  for _ in range(num_tokens):
    length = len(ids) + len(out)
    start = time.perf_counter()
    out.append(int(next_token(params, tokens, np.int32([length - 1]))))
    seconds.append(time.perf_counter() - start)
    tokens[0, length] = out[-1]
  return {'tokens': out, 'padded_tokens': context, **decode_figures(seconds)}


def streamed_engine(model_cfg, params, settings: LongContextSettings, typed: Config, step_fn,
                    tokenizer, eos_id, **engine) -> LongContextDecoder:
  """The engine with the configured pool and offload at this point (engine: other
  config.engine fields to replace, such as max_batch_size)."""
  base = dataclasses.replace(typed, engine=dataclasses.replace(typed.engine, **engine))
  return LongContextDecoder(model_cfg, params, settings, base=base, record_logits=True,
                            step_fn=step_fn, tokenizer=tokenizer, eos_id=eos_id)


def warm_up(decoder: LongContextDecoder, ids) -> None:
  """Compiles a point's shapes: the whole prompt, offloaded, moves blocks out (every transfer
  bucket the timed runs meet) and streams them in prompt chunks, and its second token in a
  decode step."""
  decoder.generate(ids, SamplingParams(max_new_tokens=2))


def streamed_row(decoder: LongContextDecoder, runs: list, reference: dict, context,
                 cost) -> dict:
  """One (window, chunk) point's row from its timed runs (decode steps pooled), with the cost
  model's stream-vs-recompute figures (module docstring)."""
  s, first = decoder.settings, runs[0]
  window_tokens = s.window_blocks * s.block_size
  # One block: K and V, all layers.
  block_mb = decoder.model_cfg.num_layers * decoder.block_bytes / MB
  steps = [t for r in runs for t in r.step_seconds]
  logits = np.stack(first.logits)
  n = min(len(logits), len(reference['logits']))
  step_mb = np.mean(first.step_bytes_streamed) / MB
  figures = decode_figures(steps)
  return {
      'placement': s.placement, 'window_blocks': s.window_blocks, 'chunk_blocks': s.chunk_blocks,
      # the layers each streamed program runs (more than the model's: all of them)
      'layers_per_call': min(s.layers_per_call, decoder.model_cfg.num_layers),
      'window_tokens': window_tokens, 'context_over_window': context / window_tokens,
      'host_blocks': first.host_blocks, 'mb_streamed_per_step': step_mb,
      'useful_mb_streamed_per_step': np.mean(first.step_host_blocks) * block_mb,
      **figures,
      'over_all_device_best': (figures['decode_ms_per_token_best'] /
                               reference['decode_ms_per_token_best']),
      'streamed_gb_per_s': step_mb / min(steps) / 1e3,  # over the whole fastest step
      'prefill_s': float(np.median([r.prompt_seconds for r in runs])),
      'prefill_mb_streamed': first.prompt_bytes_streamed / MB,
      'window_kv_mb': first.window_bytes / MB,
      'device_kv_mb': (decoder.engine.pool.nbytes + first.chunk_bytes) / MB,  # + one chunk
      'tokens_match': all(r.output_ids == reference['tokens'] for r in runs),
      'max_abs_logit_diff': float(np.abs(logits[:n] - reference['logits'][:n]).max()),
      'compilations': sum(r.compilations for r in runs), 'tokens': first.output_ids,
      **break_even(cost, first.host_blocks, context)}


def break_even(cost, host_blocks: int, context: int, tier: int = 2) -> dict:
  """The cost model's seconds to stream host_blocks once from `tier` (2: host RAM, 3: the disk
  tier then the host link; one latency and the bytes at the tier's bandwidth) and to
  recompute a context of that many tokens, and their ratio."""
  stream = cost.load_s([tier] * host_blocks) if host_blocks else 0.0
  recompute_s = cost.recompute_tokens_s(context)
  return {'model_stream_s_per_step': stream, 'model_recompute_context_s': recompute_s,
          'break_even_decode_steps': recompute_s / stream if stream else None}


def disk_cost(typed, executor, disk_kvstore: str):
  """TierCosts with the disk tier's read figures too: host/tiers/disk_store.py's calibration
  (scratch records in a temporary store of the kvstore's kind) of a store at disk_kvstore."""
  from pagedjax.host.tiers.disk_store import DiskStore  # pylint: disable=import-outside-toplevel
  from pagedjax.host.tiers.kv_tiers import BlockLayout  # pylint: disable=import-outside-toplevel
  layout = BlockLayout(executor.pool.block_array_shapes())
  store = DiskStore(disk_kvstore, tiering.CALIBRATION_BLOCKS, layout.nbytes, b'long-context-cal')
  return tiering.calibrated_cost(typed.tiers, executor, layout, store)


# ------------------------------------------------------------------------------------------------
# Beside the long request: ordinary requests, and a second long one
# ------------------------------------------------------------------------------------------------
def beside(model_cfg, params, typed, step_fn, tokenizer, eos_id, ids, second_ids, lc) -> dict:
  """Ordinary requests' TPOT (engine clock, compilation left out) alone, then beside the long
  request's decode steps, in one offloaded engine with a window of lc.beside_window blocks;
  then the long request's decode steps alone and beside a second long request (`pair`)."""
  # The chunk of a point with this window, if there is one: its programs are compiled already.
  chunk = next((c for w, c in lc.points if w == lc.beside_window), 8)
  settings = LongContextSettings(typed.pool.block_size, typed.pool.num_blocks - 1,
                                 lc.beside_window, chunk, lc.prefill_chunk)
  engine = streamed_engine(model_cfg, params, settings, typed, step_fn, tokenizer, eos_id,
                           max_batch_size=max(2, 1 + lc.beside_requests)).engine
  ordinary = [ids[i * lc.beside_prompt_tokens:(i + 1) * lc.beside_prompt_tokens]
              for i in range(lc.beside_requests)]
  short = SamplingParams(max_new_tokens=lc.beside_new_tokens, stop_on_eos=False)

  def tpot_ms(completions):
    return [1e3 * (c.finish_time - c.first_token_time) / (len(c.output_ids) - 1)
            for c in completions]

  def until_first_token(request):
    while not engine.finished.get(request) and not any(
        s.request_id == request and s.output_ids for s in engine.running):
      engine.step()

  def together():  # the long request to its first token, then the ordinary ones beside it
    long_id = engine.submit(ids, typed.sampling)
    until_first_token(long_id)
    out = tpot_ms(engine.generate(ordinary, short)) if ordinary else []
    engine.run()
    return out, engine.finished[long_id].output_ids, tpot_ms([engine.finished[long_id]])[0]

  def decode_steps(prompts):
    """Wall ms of each iteration in which every one of these long requests decodes."""
    requests = [engine.submit(p, typed.sampling) for p in prompts]
    for r in requests:
      until_first_token(r)
    steps = []
    while not any(r in engine.finished for r in requests):
      start = time.perf_counter()
      engine.step()
      steps.append(1e3 * (time.perf_counter() - start))
    engine.run()
    return steps, engine.finished[requests[0]].output_ids

  together()  # compiles every shape the timed runs meet
  decode_steps([ids, second_ids])  # and those of two long rows in one streamed batch
  compiled = engine.num_compilations
  # Alone, beside the long one (offload.join_decodes on, the default) and beside it with
  # join_decodes off (their decodes in the batched step, then the streamed call: two passes
  # over the weights), in `repeats` interleaved rounds, every request's TPOT pooled.
  alone, beside_long, separate, separate_tokens = [], [], [], []
  for _ in range(lc.repeats):
    alone += tpot_ms(engine.generate(ordinary, short)) if ordinary else []
    tpots, long_tokens, _ = together()
    beside_long += tpots
    engine.offload.join_decodes = False
    tpots, tokens, _ = together()
    engine.offload.join_decodes = True
    separate += tpots
    separate_tokens.append(tokens)

  def rise(tpots):  # median TPOT over the median alone, less one (None without ordinary ones)
    return float(np.median(tpots) / np.median(alone) - 1) if alone else None

  spread = []  # offload.decode_every: the long request decodes on one iteration in k
  for every in lc.beside_decode_every:
    engine.offload.decode_every = every
    tpots, tokens, long_tpot = together()
    spread.append({'decode_every': every, 'tpot_ms_median': float(np.median(tpots)) if tpots
                   else None,
                   'tpot_rise': rise(tpots),
                   'long_tpot_ms': long_tpot, 'long_tokens_identical': tokens == long_tokens})
  engine.offload.decode_every = 1
  one, _ = decode_steps([ids])
  two, pair_tokens = decode_steps([ids, second_ids])
  side = {'requests': lc.beside_requests, 'window_blocks': lc.beside_window,
          'prompt_tokens': lc.beside_prompt_tokens, 'new_tokens': lc.beside_new_tokens,
          'tpot_ms_alone': alone, 'tpot_ms_beside_long': beside_long,
          'tpot_ms_alone_median': float(np.median(alone)) if alone else None,
          'tpot_ms_beside_long_median': float(np.median(beside_long)) if alone else None,
          'tpot_rise': rise(beside_long),
          'long_tokens': long_tokens, 'decode_every': spread,
          'join_decodes': engine.offload.join_decodes,
          'tpot_ms_separate_pass': separate,
          'tpot_ms_separate_pass_median': float(np.median(separate)) if separate else None,
          'tpot_rise_separate_pass': rise(separate),
          'separate_pass_tokens_identical': all(t == long_tokens for t in separate_tokens),
          'rounds': lc.repeats}
  pair = {'window_blocks': lc.beside_window, 'step_ms_one_long': one,
          'step_ms_two_long': two, 'step_ms_one_long_best': min(one),
          'step_ms_two_long_best': min(two),
          'ms_per_token_two_long_best': min(two) / 2,  # two rows' tokens per step
          'two_over_one_best': min(two) / min(one), 'long_tokens': pair_tokens,
          'streamed_batches': dict(engine.executor.streamed.counters),
          'compilations_while_timed': engine.num_compilations - compiled}
  side['compilations_while_timed'] = pair['compilations_while_timed']
  return side, pair


# ------------------------------------------------------------------------------------------------
# Projection: recompute vs stream, on this CPU and on accelerator presets
# ------------------------------------------------------------------------------------------------
# ------------------------------------------------------------------------------------------------
# A follow-up turn over the long document: prefix caching over offloaded blocks
# ------------------------------------------------------------------------------------------------
def follow_up(model_cfg, params, typed, step_fn, tokenizer, eos_id, ids, other_ids, question,
              lc) -> dict:
  """The long document and its answer, then a follow-up turn over both and `question`, in an
  offloaded engine with prefix caching, its offloaded blocks indexed (offload.cache_blocks) or
  not (the device cache alone): the follow-up's time to first token (wall, warm: a pair of
  turns over `other_ids` first compiles every shape) and its prompt tokens computed."""
  window, chunk = lc.points[0][:2]
  cached = dataclasses.replace(typed, prefix_cache=dataclasses.replace(typed.prefix_cache,
                                                                       enabled=True))
  answer = SamplingParams(max_new_tokens=lc.follow_up_new_tokens, stop_on_eos=False)
  out = {'window_blocks': window, 'chunk_blocks': chunk}
  for name, index in (('indexed', True), ('device_cache_only', False)):
    settings = LongContextSettings(typed.pool.block_size, typed.pool.num_blocks - 1, window,
                                   chunk, lc.prefill_chunk, cache_blocks=index)
    decoder = streamed_engine(model_cfg, params, settings, cached, step_fn, tokenizer, eos_id)
    try:
      for doc in (other_ids, ids):  # the warm-up pair, then the timed one
        first = decoder.generate(doc, answer)
        turn_ids = doc + first.output_ids + question
        before = decoder.engine.stats['prompt_tokens_computed']
        hits = decoder.engine.offload.figures().get('offload_prefix_hit_blocks', 0)
        turn = decoder.generate(turn_ids, answer)
      figures = decoder.engine.offload.figures()
      out[name] = {'ttft_s': turn.prompt_seconds,
                   'prompt_tokens_computed': (decoder.engine.stats['prompt_tokens_computed'] -
                                              before),
                   'prompt_mb_streamed': turn.prompt_bytes_streamed / MB,
                   'offload_prefix_hit_blocks': (figures.get('offload_prefix_hit_blocks', 0) -
                                                 hits),
                   'compilations_while_timed': turn.compilations, 'tokens': turn.output_ids}
    finally:
      decoder.close()
  out['prompt_tokens'] = len(turn_ids)
  out['tokens_identical'] = out['indexed']['tokens'] == out['device_cache_only']['tokens']
  out['ttft_speedup'] = out['device_cache_only']['ttft_s'] / out['indexed']['ttft_s']
  return out


def _blocks(tokens: int, block_size: int) -> int:
  return -(-tokens // block_size)


def _window(context: int, fraction: float, block_size: int) -> int:
  """Device window blocks for a context: `fraction` of its blocks, at least one."""
  return max(1, int(fraction * _blocks(context, block_size)))


def project_cpu(cost, model_name: str, contexts, fraction: float, block_size: int) -> list:
  """This CPU from the measured TierCosts (this study's model and pool dtype): streaming is
  linear in the host blocks, recompute linear in the tokens (the model's assumption)."""
  rows = []
  for context in contexts:
    host = _blocks(context, block_size) - _window(context, fraction, block_size)
    figures = break_even(cost, host, context)
    rows.append({'machine': f'this CPU ({jax.default_backend()})', 'model': model_name,
                 'source': 'measured TierCosts (host/tiers/tier_cost.py)',
                 'context_tokens': context,
                 'window_tokens': _window(context, fraction, block_size) * block_size,
                 'host_blocks': host, 'stream_mb_per_step': host * cost.block_bytes / MB,
                 'stream_s_per_step': figures['model_stream_s_per_step'],
                 'recompute_context_s': figures['model_recompute_context_s'],
                 'break_even_decode_steps': figures['break_even_decode_steps'],
                 'decode_ms_all_device': None, 'decode_ms_streamed': None,
                 'streamed_over_all_device': None, 'kv_gb': None, 'device_gb': None,
                 'kv_fits_device': None})
  return rows


def project_hardware(hw_name: str, shape: sizing.ModelShape, contexts, fraction: float,
                     block_size: int, chunk: int) -> list:
  """One preset and model shape, bf16 weights and K/V, analytically (module docstring):
  recompute = the prefill chunks of the whole context (sim/cost_model.py step times), stream
  = the host blocks over the preset's host link once per decode step (swap_time: one call
  overhead plus bytes / bandwidth), decode streamed = decode all-device + the stream (no
  overlap)."""
  hw = sim_hardware.get_hardware(hw_name)
  kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2  # bf16 K and V
  model = sim_cost.CostModel(shape, hw, kv_bytes_per_token=kv_per_token, block_size=block_size,
                             count_padding=False)
  rows = []
  for context in contexts:
    window = _window(context, fraction, block_size)
    host = _blocks(context, block_size) - window
    recompute_s = sum(
        model.step_time(sim_cost.StepShape.from_rows([(min(chunk, context - start),
                                                       min(start + chunk, context))], 1, chunk))
        for start in range(0, context, chunk))
    stream_s = model.swap_time(host)
    decode_s = model.step_time(sim_cost.decode_step(1, context))
    kv_gb = context * kv_per_token / 1e9
    rows.append({'machine': hw.name, 'model': shape.name,
                 'source': 'sim/cost_model.py on the sim/hardware.py preset, analytic',
                 'context_tokens': context, 'window_tokens': window * block_size,
                 'host_blocks': host, 'stream_mb_per_step': host * model.block_bytes / MB,
                 'stream_s_per_step': stream_s, 'recompute_context_s': recompute_s,
                 'break_even_decode_steps': recompute_s / stream_s if stream_s else None,
                 'decode_ms_all_device': 1e3 * decode_s,
                 'decode_ms_streamed': 1e3 * (decode_s + stream_s),
                 'streamed_over_all_device': (decode_s + stream_s) / decode_s,
                 'kv_gb': kv_gb, 'device_gb': hw.hbm_bytes / 1e9,
                 'kv_fits_device': bool(kv_gb + model.weights_per_device / 1e9 <=
                                        hw.hbm_bytes / 1e9)})
  return rows


def projection(cost, model_cfg, model_name: str, lc, block_size: int) -> list:
  shapes = [dataclasses.replace(sizing.from_model_config(model_cfg), name=model_name)]
  shapes += [sizing.get_preset(name) for name in lc.project_models
             if sizing.get_preset(name).name != model_name]
  rows = project_cpu(cost, model_name, lc.project_contexts, lc.project_window_fraction,
                     block_size)
  for hw_name in lc.project_hardware:
    for shape in shapes:
      rows += project_hardware(hw_name, shape, lc.project_contexts, lc.project_window_fraction,
                               block_size, lc.project_chunk_tokens)
  return rows


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------
def write_rows(rows: list, projected: list, workdir: str) -> None:
  with run_info.atomic_write(os.path.join(workdir, 'results.jsonl')) as f:
    f.writelines(json.dumps(row) + '\n' for row in rows)
  run_info.write_csv(os.path.join(workdir, 'results.csv'), rows, COLUMNS)
  run_info.write_csv(os.path.join(workdir, 'projection.csv'), projected, PROJECTION_COLUMNS)


def point_label(row: dict) -> str:
  return (f"W={row['window_blocks']} C={row['chunk_blocks']}" +
          (f"\n{row['layers_per_call']} layers/call" if row['layers_per_call'] > 1 else '') +
          ('\ndisk' if row['placement'] == 'disk' else ''))


def plot_points(rows: list, reference: dict, slow: dict, title: str, workdir: str) -> None:
  """Decode ms/token per point against all_device, and MB streamed per step (one bar each:
  every point is visible whatever its value, none sits on an axis limit)."""
  plt = plots.pyplot()
  fig, (speed, moved) = plt.subplots(1, 2, figsize=(12, 4.8), layout='constrained')
  x = np.arange(len(rows))
  labels = [point_label(r) for r in rows]
  colors = ['tab:orange' if r['placement'] == 'disk' else 'tab:blue' for r in rows]
  speed.bar(x, [r['decode_ms_per_token_best'] for r in rows], color=colors, width=0.6,
            label='streamed, fastest step (orange: disk placement)')
  speed.scatter(x, [r['decode_ms_per_token'] for r in rows], color='black', marker='_', s=300,
                zorder=3, label='streamed, median step')
  speed.axhline(reference['decode_ms_per_token_best'], color='gray', linestyle='--',
                label=f"all-device engine, fastest step "
                      f"({reference['decode_ms_per_token_best']:.1f} ms)")
  speed.plot([], [], ' ', label=f"recompute: {slow['decode_ms_per_token_best']:,.0f} ms/token "
                                f"(off the scale)")
  speed.set_xticks(x, labels, fontsize=8)
  speed.set_ylabel('decode time per token (ms, greedy, batch 1)')
  speed.set_xlabel('device window W and chunk C (blocks)')
  speed.set_ylim(bottom=0)
  speed.set_title('decode ms/token', fontsize=10)
  plots.legend_below(speed, ncol=2)
  moved.bar(x - 0.17, [r['mb_streamed_per_step'] for r in rows], width=0.34, color=colors,
            label='streamed (padding included)')
  moved.bar(x + 0.17, [r['useful_mb_streamed_per_step'] for r in rows], width=0.34,
            color='white', edgecolor=colors, hatch='//', label='useful (host blocks held)')
  moved.set_xticks(x, labels, fontsize=8)
  moved.set_ylabel('K/V moved host -> device per decode step (MB)')
  moved.set_xlabel('device window W and chunk C (blocks)')
  moved.set_ylim(bottom=0)
  moved.set_title('bytes streamed per decode step', fontsize=10)
  plots.legend_below(moved, ncol=2)
  fig.suptitle(title, fontsize=10)
  plots.save(fig, os.path.join(workdir, 'long_context.png'), dpi=100)


def plot_beside(side: dict, pair: dict, title: str, workdir: str) -> None:
  plt = plots.pyplot()
  fig, (tpot, steps) = plt.subplots(1, 2, figsize=(11, 4.5), layout='constrained')
  cases = [('alone', side['tpot_ms_alone']),
           ('beside the long request\n(one weight pass)', side['tpot_ms_beside_long']),
           ('beside it, join_decodes off\n(two weight passes)', side['tpot_ms_separate_pass'])]
  colours = ('tab:blue', 'tab:orange', 'tab:red')
  for i, (name, values) in enumerate(cases):
    if values:
      label = name.replace('\n', ' ')
      tpot.bar(i, np.median(values), width=0.5, color=colours[i],
               label=f'{label}, median ({np.median(values):.2f} ms)')
      tpot.scatter([i] * len(values), values, color='black', s=12, zorder=3)
  tpot.scatter([], [], color='black', s=12, label='each request')
  tpot.set_xticks(range(len(cases)), [name for name, _ in cases])
  tpot.set_ylabel('TPOT of the ordinary requests (ms/token, engine clock)')
  tpot.set_ylim(bottom=0)
  tpot.set_title(f"{side['requests']} ordinary requests, {side['prompt_tokens']} + "
                 f"{side['new_tokens']} tokens", fontsize=10)
  plots.legend_below(tpot, ncol=1)
  for i, (name, values) in enumerate([('one long request', pair['step_ms_one_long']),
                                      ('two long requests', pair['step_ms_two_long'])]):
    steps.bar(i, min(values), width=0.5, color='tab:blue' if i == 0 else 'tab:green',
              label=f'{name}: fastest step {min(values):.1f} ms '
                    f'({min(values) / (i + 1):.1f} ms per token)')
    steps.scatter([i] * len(values), values, color='black', s=8, zorder=3)
  steps.set_xticks([0, 1], ['one long request', 'two at once (one streamed batch)'])
  steps.set_ylabel('decode iteration wall time (ms)')
  steps.set_ylim(bottom=0)
  steps.set_title(f"long requests decoding, window {pair['window_blocks']} blocks", fontsize=10)
  plots.legend_below(steps, ncol=1)
  fig.suptitle(title, fontsize=10)
  plots.save(fig, os.path.join(workdir, 'beside.png'), dpi=100)


def plot_break_even(projected: list, rows: list, reference: dict, context: int, title: str,
                    workdir: str) -> None:
  plt = plots.pyplot()
  fig, (even, ratio) = plt.subplots(1, 2, figsize=(12, 4.8), layout='constrained')
  series = {}
  for r in projected:
    series.setdefault((r['machine'], r['model']), []).append(r)
  machines = list(dict.fromkeys(r['machine'] for r in projected))  # one colour per machine,
  models = list(dict.fromkeys(r['model'] for r in projected))  # one line style per model
  for (machine, model), points in series.items():
    xs = [p['context_tokens'] for p in points]
    style = dict(color=f'C{machines.index(machine)}', marker='o',
                 linestyle=('-', '--', ':', '-.')[models.index(model) % 4])
    even.plot(xs, [p['break_even_decode_steps'] for p in points], label=f'{machine}, {model}',
              **style)
    if points[0]['streamed_over_all_device'] is not None:
      ratio.plot(xs, [p['streamed_over_all_device'] for p in points],
                 label=f'{machine}, {model} (projected)', **style)
  host = [r for r in rows if r['placement'] == 'host']
  ratio.scatter([context] * len(host), [r['over_all_device_best'] for r in host], color='black',
                marker='x', zorder=3, label='this CPU, measured (each host point of the sweep)')
  window = projected[0]['window_tokens'] / projected[0]['context_tokens']
  even.set_xscale('log', base=2)
  even.set_yscale('log')
  even.set_xlabel('context (tokens)')
  even.set_ylabel('break-even decode steps (recompute s / stream s per step)')
  even.set_title(f'recompute vs stream: streaming is cheaper below the line\n'
                 f'(device window ~{window:.0%} of the context)', fontsize=10)
  plots.legend_below(even, ncol=2)
  ratio.set_xscale('log', base=2)
  ratio.set_xlabel('context (tokens)')
  ratio.set_ylabel('decode time streamed / all-device')
  ratio.set_ylim(bottom=0)
  ratio.axhline(1, color='gray', linestyle=':')
  ratio.set_title('decode slowdown of streaming (projected: transfer not overlapped)',
                  fontsize=10)
  plots.legend_below(ratio, ncol=2)
  fig.suptitle(title, fontsize=10)
  plots.save(fig, os.path.join(workdir, 'break_even.png'), dpi=100)


def sweep(decoders, ids, sampling, engine, repeats: int):
  """Every point's engine `repeats` times, rounds in alternating order, the all-device engine
  timed before each round and after the last (load on a shared machine drifts: interleaving
  spreads it over all rows). Returns (the engine's timed passes, each point's runs)."""
  points = [d.settings for d in decoders]
  for decoder in decoders:
    warm_up(decoder, ids)
  passes, runs = [], [[] for _ in points]
  bar = cli.progress(total=repeats * len(points), desc='streamed points', unit='run')
  for round_index in range(repeats):
    passes.append(timed_pass(engine, ids, sampling))
    order = range(len(points)) if round_index % 2 == 0 else reversed(range(len(points)))
    for i in order:
      bar.update()
      r = decoders[i].generate(ids, sampling)
      runs[i].append(r)
      p = points[i]
      cli.say(f'round {round_index}: {p.placement:4s} W={p.window_blocks:3d} '
              f'C={p.chunk_blocks:3d} G={p.layers_per_call:3d} '
              f'{np.mean(r.step_bytes_streamed) / MB:7.2f} MB/step '
              f'{1e3 * np.median(r.step_seconds):7.1f} ms/token')
  bar.close()
  passes.append(timed_pass(engine, ids, sampling))
  return passes, [(d, r) for d, r in zip(decoders, runs)]


def goals(rows: list, side: dict, pair: dict, reference: dict, slow: dict, pool_tokens: int,
          context: int) -> dict:
  """Tokens identical everywhere; the issue's speed goals as measured (fastest steps):
  streamed within 1.5x all-device at a window of a quarter of the context, the ordinary
  requests' TPOT up at most 25% beside the long one."""
  host = [r for r in rows if r['placement'] == 'host']
  quarter = [r for r in host if r['window_tokens'] * 4 == context]
  at_pool = [r for r in host if r['window_tokens'] == pool_tokens]
  return {
      'tokens_identical_at_pool_window': bool(at_pool) and all(r['tokens_match'] for r in at_pool),
      'tokens_identical_everywhere': all(r['tokens_match'] for r in rows) and (
          side['long_tokens_match'] and pair['long_tokens_match'] and slow['tokens_match']),
      'quarter_window_over_all_device_best': (min(r['over_all_device_best'] for r in quarter)
                                              if quarter else None),
      'quarter_window_within_1_5x': (bool(min(r['over_all_device_best'] for r in quarter) <= 1.5)
                                     if quarter else None),
      'ordinary_tpot_rise': side['tpot_rise'],
      'ordinary_tpot_within_25pct': (bool(side['tpot_rise'] <= 0.25)
                                     if side['tpot_rise'] is not None else None),
      'ordinary_tpot_rise_join_decodes_off': side['tpot_rise_separate_pass'],
      # the smallest offload.decode_every that keeps the ordinary requests within +25%
      'decode_every_within_25pct': next((p['decode_every'] for p in side['decode_every']
                                         if p['tpot_rise'] is not None and
                                         p['tpot_rise'] <= 0.25), None),
      'all_device_ms_per_token_best': reference['decode_ms_per_token_best']}


def study(config, workdir: str) -> dict:
  typed, points, disk_points, context = check(config)
  lc = config.long_context
  load = {'start': os.getloadavg()}
  model_cfg, params, tokenizer, encode = load_model(config)
  model_name = MODEL_NAMES.get(config.model.source, config.model.source)
  sampling, eos_id = typed.sampling, tokenizer.eos_id if tokenizer is not None else None
  ids = prompt_ids(encode, context - sampling.max_new_tokens, lc.prompt_verse)
  second_ids = prompt_ids(encode, len(ids), lc.prompt_verse + 500)  # the pair's other request
  refusal = refused(config, model_cfg, params, tokenizer, ids, sampling)
  print(f'refused with the {typed.pool.num_blocks - 1}-block pool: {refusal}', flush=True)
  engine = all_device_engine(config, model_cfg, params, tokenizer, context)
  timed_pass(engine, ids, sampling)  # compiles
  compiled = engine.num_compilations
  # The streamed engines share one compiled step (one pool shape): only the streamed path's
  # programs compile per (window, chunk).
  step_fn = CompiledStep(model_cfg, typed.attention.impl, return_logits=True)
  disk_dir = lc.disk_kvstore or os.path.join(workdir, 'offload_disk')
  made_disk_dir = not lc.disk_kvstore and disk_points
  disk_settings = [dataclasses.replace(s, placement='disk', disk_kvstore=disk_dir)
                   for s in disk_points]
  decoders = [streamed_engine(model_cfg, params, s, typed, step_fn, tokenizer, eos_id)
              for s in points + disk_settings]
  try:
    passes, runs = sweep(decoders, ids, sampling, engine, lc.repeats)
    if engine.num_compilations != compiled:
      raise RuntimeError('the all-device engine compiled during its timed passes')
    reference = all_device(engine, passes)
    print(f"all_device ({reference['num_blocks'] - 1} blocks): "
          f"{reference['decode_ms_per_token_best']:.1f} ms/token fastest, "
          f"{reference['decode_ms_per_token']:.1f} median", flush=True)
    # The cost model (host/tiers/tier_cost.py) measured on a streamed engine: its prefill
    # seconds per token, host-copy bandwidth and latency, and (with disk points) the disk
    # tier's read figures (config.tiers figures, when set, win).
    executor = decoders[0].engine.executor
    cost = (disk_cost(typed, executor, disk_dir) if disk_points else
            tiering.preemption_cost(typed.tiers, executor))
    rows = [streamed_row(decoder, point_runs, reference, context, cost)
            for decoder, point_runs in runs]
    for row in rows:
      if row['placement'] == 'disk':
        row.update(break_even(cost, row['host_blocks'], context, tier=3))
  finally:
    for decoder in decoders:
      decoder.close()
    if made_disk_dir:
      shutil.rmtree(disk_dir, ignore_errors=True)
  side, pair = beside(model_cfg, params, typed, step_fn, tokenizer, eos_id, ids, second_ids, lc)
  question = prompt_ids(encode, lc.follow_up_tokens, lc.prompt_verse + 900)
  turn = follow_up(model_cfg, params, typed, step_fn, tokenizer, eos_id, ids, second_ids,
                   question, lc)
  print(f"follow-up turn ({turn['prompt_tokens']} tokens): time to first token "
        f"{turn['indexed']['ttft_s']:.2f} s with the offloaded blocks indexed "
        f"({turn['indexed']['prompt_tokens_computed']} prompt tokens computed), "
        f"{turn['device_cache_only']['ttft_s']:.2f} s without "
        f"({turn['device_cache_only']['prompt_tokens_computed']}); "
        f"{turn['ttft_speedup']:.1f}x", flush=True)
  side['long_tokens_match'] = (side.pop('long_tokens') == reference['tokens'] and
                               side['separate_pass_tokens_identical'] and
                               all(p['long_tokens_identical'] for p in side['decode_every']))
  pair['long_tokens_match'] = pair.pop('long_tokens') == reference['tokens']
  if side['tpot_ms_alone']:
    print(f"ordinary requests' TPOT: {side['tpot_ms_alone_median']:.2f} ms alone, "
          f"{side['tpot_ms_beside_long_median']:.2f} ms beside the long one "
          f"({100 * side['tpot_rise']:+.0f}%; "
          f"{side['tpot_ms_separate_pass_median']:.2f} ms, "
          f"{100 * side['tpot_rise_separate_pass']:+.0f}%, with offload.join_decodes off)",
          flush=True)
  for point in side['decode_every']:
    if point['tpot_rise'] is not None:
      print(f"offload.decode_every={point['decode_every']}: ordinary TPOT "
            f"{100 * point['tpot_rise']:+.0f}% beside the long one, whose TPOT is "
            f"{point['long_tpot_ms']:.1f} ms", flush=True)
  print(f"long request decode step: {pair['step_ms_one_long_best']:.1f} ms alone, "
        f"{pair['step_ms_two_long_best']:.1f} ms with a second one (fastest steps)", flush=True)
  slow = recompute(model_cfg, params, ids, lc.recompute_tokens, context)
  slow['tokens_match'] = slow['tokens'] == reference['tokens'][:len(slow['tokens'])]
  print(f"recompute: {slow['decode_ms_per_token_best']:.1f} ms/token fastest", flush=True)
  projected = projection(cost, model_cfg, model_name, lc, typed.pool.block_size)
  pool_tokens = (typed.pool.num_blocks - 1) * typed.pool.block_size
  reference.pop('logits')
  summary = {
      'context_tokens': context, 'prompt_tokens': len(ids), 'pool_tokens': pool_tokens,
      'kv_bytes_per_token': 2 * model_cfg.num_layers * model_cfg.num_kv_heads *
                            model_cfg.head_dim * jnp.dtype(model_cfg.dtype).itemsize,
      'refused': refusal, 'all_device': reference, 'recompute': slow, 'rows': rows,
      'beside': side, 'pair': pair, 'follow_up': turn, 'cost_model': cost.figures(),
      'disk_kvstore': disk_dir if disk_points else None, 'projection': projected,
      'goal': {**goals(rows, side, pair, reference, slow, pool_tokens, context),
               'follow_up_tokens_identical': turn['tokens_identical']},
      'load_average': {**load, 'end': os.getloadavg()},
      **run_info.summary_fields(config)}
  write_rows(rows, projected, workdir)
  title = (f'{model_name}: {context}-token context, {pool_tokens}-token device pool '
           f'({jax.default_backend()})' + cli.variant_note(config))
  plot_points(rows, reference, slow, title, workdir)
  plot_beside(side, pair, title, workdir)
  plot_break_even(projected, rows, reference, context, title, workdir)
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  beside_line = (f"ordinary TPOT {side['tpot_ms_alone_median']:.2f} ms alone, "
                 f"{side['tpot_ms_beside_long_median']:.2f} ms beside the long request; "
                 if side['tpot_ms_alone'] else '')
  cli.write_table(workdir, '\n\n'.join([
      run_info.markdown_table(rows, TABLE),
      f"all-device: {reference['decode_ms_per_token_best']:.2f} ms/token fastest; " + beside_line +
      f"long decode step {pair['step_ms_one_long_best']:.1f} ms alone, "
      f"{pair['step_ms_two_long_best']:.1f} ms for two at once",
      f"follow-up turn ({turn['prompt_tokens']} tokens): time to first token "
      f"{turn['indexed']['ttft_s']:.2f} s with the offloaded blocks indexed, "
      f"{turn['device_cache_only']['ttft_s']:.2f} s with the device cache only "
      f"({turn['ttft_speedup']:.1f}x)",
      run_info.markdown_table(projected, PROJECTION_TABLE)]))
  print(f"tokens identical to all_device at a window of the pool: "
        f"{summary['goal']['tokens_identical_at_pool_window']}; everywhere: "
        f"{summary['goal']['tokens_identical_everywhere']}")
  return summary


MODEL_NAMES = {'smollm2': 'SmolLM2-135M', 'random': 'tiny random Llama'}


def check_run(config) -> None:
  """check, and a gguf/safetensors model path that exists, before the workdir or any model."""
  check(config)
  cli.check_model_path(Config.from_configdict(config))


if __name__ == '__main__':
  cli.run_study('configs/long_context.py', 'Long-context config.', study, check=check_run)
