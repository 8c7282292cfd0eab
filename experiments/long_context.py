"""Contexts longer than the device pool: the engine streams the oldest blocks from host RAM.

  python -m experiments.long_context --workdir=runs/long_context
  python -m experiments.long_context --config=configs/long_context.py:tiny --workdir=/tmp/lc

One greedy request whose context (prompt + new tokens) is `context_multiple` x the device pool
(configs/long_context.py), served four ways:
  refused      the normal engine with that pool, offload off: RequestError at submit (recorded)
  all_device   the normal engine with a pool just big enough (context_multiple x the memory):
               the reference tokens and logits
  streamed     the engine with that pool and offload on (config.offload, through
               pagedjax/long_context.py's thin loop) at each (window, chunk) point: the newest
               window blocks on the device, older blocks in host RAM streamed in chunks every
               step; its tokens must equal all_device's
  recompute    no cache: each step re-runs the whole context through the model (one layer's K/V
               alive at a time), its logits at the last position only
and two more figures:
  beside       `beside_requests` ordinary requests alone, then beside the long one (offloaded with
               a window of `beside_window` blocks) in the same engine: their TPOT both ways
  cost model   host/tiers/tier_cost.py's figures, measured on a streamed engine (pagedjax/tiering.py):
               per point, the modelled seconds to stream its host blocks once (one decode step),
               to recompute the whole context once, and their ratio, the break-even: the decode
               steps after which streaming has cost what one recomputation of the context costs
               (offloading beats preempting by recompute for fewer remaining steps than that)
Every timed figure is a warm run: the engine after a compiling pass, each streamed engine after
a warm-up that compiled its shapes (a prompt just long enough to offload and stream), recompute
after its one compile. Decode speed comes from per-step wall times: the fastest step (other
work on a shared machine only adds time, so it is the best estimate of a step's own cost) and
the median. Every point runs `repeats` times in rounds of alternating order, the engine timed
before each round and after the last, so drifting load spreads over all rows. Compare rows of
one run as ratios.

Writes to WORKDIR:
  results.jsonl, results.csv  one line per streamed point: window and chunk, bytes streamed per
                              decode step (padding included) and the useful part, decode
                              tokens/s, prefill seconds and bytes, device KV bytes, whether the
                              tokens match all_device and the largest logit difference, and the
                              cost model's break-even
  long_context.png            decode tokens/s (fastest and median step) against MB streamed
                              per step, with all_device and recompute as lines
  summary.json                the rows, the baselines, the refusal message, `beside`, the cost
                              model's figures, the goal (tokens identical at context_multiple x
                              the pool), config, versions, git
"""
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli
from experiments import plots
from pagedjax import factory, tiering
from pagedjax.studies import run_info
from pagedjax.studies import text_data
from pagedjax.studies import workloads
from pagedjax.config import Config, ConfigError
from pagedjax.model.step import CompiledStep
from pagedjax.host.requests.intake import RequestError
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.long_context import LongContextDecoder, LongContextSettings
from pagedjax.model.llama import Llama, init_params

COLUMNS = ('window_blocks', 'chunk_blocks', 'window_tokens', 'context_over_window',
           'host_blocks', 'mb_streamed_per_step', 'useful_mb_streamed_per_step',
           'decode_tokens_per_s_best', 'decode_tokens_per_s', 'decode_ms_per_token_best',
           'decode_ms_per_token', 'decode_ms_per_token_mean', 'streamed_gb_per_s', 'prefill_s',
           'prefill_mb_streamed', 'window_kv_mb', 'device_kv_mb', 'tokens_match',
           'max_abs_logit_diff', 'compilations', 'model_stream_s_per_step',
           'model_recompute_context_s', 'break_even_decode_steps')
TABLE = ('window_blocks', 'chunk_blocks', 'mb_streamed_per_step', 'decode_ms_per_token_best',
         'decode_ms_per_token', 'prefill_s', 'tokens_match', 'max_abs_logit_diff',
         'break_even_decode_steps')
MB = 1e6


# ------------------------------------------------------------------------------------------------
# Settings
# ------------------------------------------------------------------------------------------------
def check(config):
  """(typed engine Config, [LongContextSettings], context tokens) or ConfigError naming the
  field, before anything loads."""
  typed = Config.from_configdict(config)
  lc = config.long_context
  for name, least in (('context_multiple', 1), ('recompute_tokens', 1), ('repeats', 1),
                      ('prompt_verse', 0), ('beside_requests', 0), ('beside_window', 1),
                      ('beside_prompt_tokens', 1), ('beside_new_tokens', 2)):
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
  settings, pool_blocks = [], typed.pool.num_blocks - 1
  for i, point in enumerate(lc.points):
    try:
      window, chunk = point
      settings.append(LongContextSettings(typed.pool.block_size, pool_blocks, window, chunk,
                                          lc.prefill_chunk).validate())
    except (TypeError, ValueError) as e:
      raise ConfigError(f'config.long_context.points[{i}]={point!r} is not allowed: '
                        f'(window_blocks, chunk_blocks) with {e}') from None
  room = (pool_blocks - lc.beside_window) * typed.pool.block_size
  if lc.beside_requests and lc.beside_prompt_tokens + lc.beside_new_tokens > room:
    raise ConfigError(
        f'config.long_context.beside_window={lc.beside_window} is not allowed with '
        f'beside_prompt_tokens + beside_new_tokens = '
        f'{lc.beside_prompt_tokens + lc.beside_new_tokens}: the pool ({pool_blocks} blocks of '
        f'{typed.pool.block_size}) must hold the window and one ordinary request beside it')
  return typed, settings, context


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
# The four ways
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
  block_mb = decoder.model_cfg.num_layers * decoder.block_bytes / MB  # one block: K and V, all layers
  steps = [t for r in runs for t in r.step_seconds]
  logits = np.stack(first.logits)
  n = min(len(logits), len(reference['logits']))
  step_mb = np.mean(first.step_bytes_streamed) / MB
  return {
      'window_blocks': s.window_blocks, 'chunk_blocks': s.chunk_blocks,
      'window_tokens': window_tokens, 'context_over_window': context / window_tokens,
      'host_blocks': first.host_blocks, 'mb_streamed_per_step': step_mb,
      'useful_mb_streamed_per_step': np.mean(first.step_host_blocks) * block_mb,
      **decode_figures(steps),
      'streamed_gb_per_s': step_mb / min(steps) / 1e3,  # over the whole fastest step
      'prefill_s': float(np.median([r.prompt_seconds for r in runs])),
      'prefill_mb_streamed': first.prompt_bytes_streamed / MB,
      'window_kv_mb': first.window_bytes / MB,
      'device_kv_mb': (decoder.engine.pool.nbytes + first.chunk_bytes) / MB,  # + one chunk
      'tokens_match': all(r.output_ids == reference['tokens'] for r in runs),
      'max_abs_logit_diff': float(np.abs(logits[:n] - reference['logits'][:n]).max()),
      'compilations': sum(r.compilations for r in runs), 'tokens': first.output_ids,
      **break_even(cost, first.host_blocks, context)}


def break_even(cost, host_blocks: int, context: int) -> dict:
  """The cost model's seconds to stream host_blocks once (tier 2, host RAM: one latency and
  the bytes at its bandwidth) and to recompute a context of that many tokens, and their
  ratio."""
  stream = cost.load_s([2] * host_blocks) if host_blocks else 0.0
  recompute_s = cost.recompute_tokens_s(context)
  return {'model_stream_s_per_step': stream, 'model_recompute_context_s': recompute_s,
          'break_even_decode_steps': recompute_s / stream if stream else None}


def beside(model_cfg, params, typed, step_fn, tokenizer, eos_id, ids, lc) -> dict:
  """Ordinary requests' TPOT (engine clock, compilation left out) alone, then beside the long
  request's decode steps, in one offloaded engine with a window of lc.beside_window blocks."""
  # The chunk of a point with this window, if there is one: its programs are compiled already.
  chunk = next((c for w, c in lc.points if w == lc.beside_window), 8)
  settings = LongContextSettings(typed.pool.block_size, typed.pool.num_blocks - 1,
                                 lc.beside_window, chunk, lc.prefill_chunk)
  engine = streamed_engine(model_cfg, params, settings, typed, step_fn, tokenizer, eos_id,
                           max_batch_size=1 + lc.beside_requests).engine
  ordinary = [ids[i * lc.beside_prompt_tokens:(i + 1) * lc.beside_prompt_tokens]
              for i in range(lc.beside_requests)]
  short = SamplingParams(max_new_tokens=lc.beside_new_tokens, stop_on_eos=False)

  def tpot_ms(completions):
    return [1e3 * (c.finish_time - c.first_token_time) / (len(c.output_ids) - 1)
            for c in completions]

  def together():  # the long request to its first token, then the ordinary ones beside it
    long_id = engine.submit(ids, typed.sampling)
    while not engine.finished.get(long_id) and not any(
        s.request_id == long_id and s.output_ids for s in engine.running):
      engine.step()
    out = tpot_ms(engine.generate(ordinary, short))
    engine.run()
    return out, engine.finished[long_id].output_ids

  together()  # compiles every shape the timed runs meet
  compiled = engine.num_compilations
  alone = tpot_ms(engine.generate(ordinary, short))
  beside_long, long_tokens = together()
  return {'requests': lc.beside_requests, 'window_blocks': lc.beside_window,
          'prompt_tokens': lc.beside_prompt_tokens, 'new_tokens': lc.beside_new_tokens,
          'tpot_ms_alone': alone, 'tpot_ms_beside_long': beside_long,
          'tpot_ms_alone_median': float(np.median(alone)),
          'tpot_ms_beside_long_median': float(np.median(beside_long)),
          'long_tokens': long_tokens,
          'compilations_while_timed': engine.num_compilations - compiled}


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------
def write_rows(rows: list, workdir: str) -> None:
  with run_info.atomic_write(os.path.join(workdir, 'results.jsonl')) as f:
    f.writelines(json.dumps(row) + '\n' for row in rows)
  run_info.write_csv(os.path.join(workdir, 'results.csv'), rows, COLUMNS)


def plot(rows: list, baselines: dict, title: str, workdir: str) -> None:
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(7.5, 5), layout='constrained')
  mb = [r['mb_streamed_per_step'] for r in rows]
  ax.scatter(mb, [r['decode_tokens_per_s_best'] for r in rows], label='fastest step')
  ax.scatter(mb, [r['decode_tokens_per_s'] for r in rows], facecolors='none',
             edgecolors='tab:blue', label='median step')
  for r in rows:
    ax.annotate(f"W={r['window_blocks']} C={r['chunk_blocks']}",
                (r['mb_streamed_per_step'], r['decode_tokens_per_s_best']), fontsize=8,
                textcoords='offset points', xytext=(4, 4))
  for (name, figures), style in zip(baselines.items(), ('--', ':')):
    value = figures['decode_tokens_per_s_best']
    ax.axhline(value, linestyle=style, color='gray')
    ax.annotate(f'{name} (fastest step)', (0, value), fontsize=8, textcoords='offset points',
                xytext=(2, 3))
  plots.legend_below(ax, ncol=2)
  ax.set_xlabel('MB of K/V streamed host -> device per decode step (padding included)')
  ax.set_ylabel('decode tokens/s (greedy, batch 1)')
  ax.set_ylim(bottom=0)
  ax.set_xlim(left=0)
  ax.set_title(title, fontsize=10)
  plots.save(fig, os.path.join(workdir, 'long_context.png'), dpi=100)


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
      cli.say(f'round {round_index}: W={points[i].window_blocks:3d} C={points[i].chunk_blocks:3d} '
            f'{np.mean(r.step_bytes_streamed) / MB:7.2f} MB/step '
            f'{1e3 * np.median(r.step_seconds):7.1f} ms/token')
  bar.close()
  passes.append(timed_pass(engine, ids, sampling))
  return passes, [(d, r) for d, r in zip(decoders, runs)]


def study(config, workdir: str) -> dict:
  typed, points, context = check(config)
  load = {'start': os.getloadavg()}
  model_cfg, params, tokenizer, encode = load_model(config)
  sampling, eos_id = typed.sampling, tokenizer.eos_id if tokenizer is not None else None
  ids = prompt_ids(encode, context - sampling.max_new_tokens, config.long_context.prompt_verse)
  refusal = refused(config, model_cfg, params, tokenizer, ids, sampling)
  print(f'refused with the {typed.pool.num_blocks - 1}-block pool: {refusal}', flush=True)
  engine = all_device_engine(config, model_cfg, params, tokenizer, context)
  timed_pass(engine, ids, sampling)  # compiles
  compiled = engine.num_compilations
  # The streamed engines share one compiled step (one pool shape): only the streamed path's
  # programs compile per (window, chunk).
  step_fn = CompiledStep(model_cfg, typed.attention.impl, return_logits=True)
  decoders = [streamed_engine(model_cfg, params, s, typed, step_fn, tokenizer, eos_id)
              for s in points]
  passes, runs = sweep(decoders, ids, sampling, engine, config.long_context.repeats)
  if engine.num_compilations != compiled:
    raise RuntimeError('the all-device engine compiled during its timed passes')
  reference = all_device(engine, passes)
  print(f"all_device ({reference['num_blocks'] - 1} blocks): "
        f"{reference['decode_ms_per_token_best']:.1f} ms/token fastest, "
        f"{reference['decode_ms_per_token']:.1f} median", flush=True)
  # The cost model (host/tiers/tier_cost.py) measured on a streamed engine: its prefill seconds per
  # token and host-copy bandwidth and latency (config.tiers figures, when set, win).
  cost = tiering.preemption_cost(typed.tiers, decoders[0].engine.executor)
  rows = [streamed_row(decoder, point_runs, reference, context, cost)
          for decoder, point_runs in runs]
  side = beside(model_cfg, params, typed, step_fn, tokenizer, eos_id, ids, config.long_context)
  side['long_tokens_match'] = side.pop('long_tokens') == reference['tokens']
  print(f"ordinary requests' TPOT: {side['tpot_ms_alone_median']:.1f} ms alone, "
        f"{side['tpot_ms_beside_long_median']:.1f} ms beside the long one", flush=True)
  slow = recompute(model_cfg, params, ids, config.long_context.recompute_tokens, context)
  slow['tokens_match'] = slow['tokens'] == reference['tokens'][:len(slow['tokens'])]
  print(f"recompute: {slow['decode_ms_per_token_best']:.1f} ms/token fastest", flush=True)
  print(run_info.markdown_table(rows, TABLE))
  pool_tokens = (typed.pool.num_blocks - 1) * typed.pool.block_size
  at_pool = [r for r in rows if r['window_tokens'] == pool_tokens]
  reference.pop('logits')
  summary = {
      'context_tokens': context, 'prompt_tokens': len(ids), 'pool_tokens': pool_tokens,
      'kv_bytes_per_token': 2 * model_cfg.num_layers * model_cfg.num_kv_heads *
                            model_cfg.head_dim * jnp.dtype(model_cfg.dtype).itemsize,
      'refused': refusal, 'all_device': reference, 'recompute': slow, 'rows': rows,
      'beside': side, 'cost_model': cost.figures(),
      'goal': {'tokens_identical_at_pool_window': bool(at_pool) and all(
          r['tokens_match'] for r in at_pool),
               'tokens_identical_everywhere': all(r['tokens_match'] for r in rows) and (
                   side['long_tokens_match'])},
      'load_average': {**load, 'end': os.getloadavg()},
      **run_info.summary_fields(config)}
  write_rows(rows, workdir)
  plot(rows, {'all_device': reference, 'recompute': slow},
       f'{MODEL_NAMES.get(config.model.source, config.model.source)}: {context}-token '
       f'context, {pool_tokens}-token device pool ({jax.default_backend()})'
       + cli.variant_note(config), workdir)
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  print(f"tokens identical to all_device at a window of the pool: "
        f"{summary['goal']['tokens_identical_at_pool_window']}; at every point: "
        f"{summary['goal']['tokens_identical_everywhere']}")
  return summary


MODEL_NAMES = {'smollm2': 'SmolLM2-135M', 'random': 'tiny random Llama'}


def check_run(config) -> None:
  """check, and a gguf/safetensors model path that exists, before the workdir or any model."""
  check(config)
  cli.check_model_path(Config.from_configdict(config))


if __name__ == '__main__':
  cli.run_study('configs/long_context.py', 'Long-context config.', study, check=check_run)
