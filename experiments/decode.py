"""Main job: decode the config's prompts through the paged KV pool and report.

  python -m experiments.decode --config=configs/default.py --workdir=runs/default
  python -m experiments.decode --config=configs/default.py:tiny --workdir=runs/tiny
  python -m experiments.decode --workdir=runs/default --profile_dir=runs/default/profile

Runs the prompts twice on the same engine: the first pass compiles every bucketed step shape,
the second is timed for tokens_per_second (and must not compile again). Prints each completion
and a table of figures; writes WORKDIR/summary.json (figures, completions, config, versions,
git state, machine load), results.csv (the figures, one column each), completions.csv and
decode.png (the timed pass: each request's wait, prefill and decode on the engine clock, and the
KV pool's slots over the same clock).
--profile_dir traces the second pass and prints where the trace is and the command that opens
it (xprof: `pip install -r requirements-profile.txt`).

Tensor parallelism: `--config.mesh.model=4` splits the pool over KV heads and the weights over
heads and MLP columns (pagedjax/model/sharding.py). On a CPU-only machine the run asks JAX for that
many CPU devices before the backend starts, so it works on one physical CPU device; the summary gets
`mesh` and the per-device KV figures measured from the pool's shards.

Several hosts (or processes): start the same command on every one with `--distributed` (see
docs/tensor_parallel.md): jax.distributed.initialize joins them into one set of devices, the mesh
spans them, and every process runs the same host logic on the same inputs; only process 0 writes
summary.json.

Before anything loads, the config is validated and the workdir created and checked writable;
the prompts are checked against the engine (length, pool) once the tokenizer is there, before
anything compiles. Each refuses the run with one line (experiments/cli.py).
"""
import os
import time

from absl import flags
import jax
import numpy as np

from experiments import cli, plots
from pagedjax import factory, sizing
from pagedjax.studies import run_info
from pagedjax.config import Config, ConfigError
from pagedjax.host.requests.intake import RequestError
from pagedjax.model import sharding

_DISTRIBUTED = flags.DEFINE_bool(
    'distributed', False, 'Call jax.distributed.initialize first, to run one program over the '
    'devices of several processes or hosts (the three flags below, or auto-detection on Cloud '
    'TPU, SLURM, Open MPI and other clusters JAX knows).')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None,
                                   'host:port of process 0, with --distributed.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes, with --distributed.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, 0-based, with --distributed.')
_PROFILE_DIR = cli.profile_dir_flag()  # traces the timed second pass


def run_pass(engine, prompts, params):
  """Submit everything, step to completion; returns (completions, seconds, generated tokens)."""
  before = engine.stats['generated_tokens']
  start = time.perf_counter()
  completions = engine.generate(prompts, params)
  return completions, time.perf_counter() - start, engine.stats['generated_tokens'] - before


def mesh_summary(engine, model_cfg, tp: int) -> dict:
  """Per-device KV figures measured from the pool's shards, with sizing.py's count beside them
  (float pools; a quantized pool's scale layout is beyond sizing.pool_per_device, so None)."""
  per_device = sharding.bytes_per_device(engine.pool)
  if len(set(per_device.values())) != 1:
    raise RuntimeError(f'pool shards differ in size across devices: {per_device}')
  pool_bytes = next(iter(per_device.values()))
  slots = engine.pool.num_blocks * engine.pool.block_size
  layout = sharding.Layout.of(model_cfg, tp)
  scheme = getattr(engine.pool, 'scheme', None)
  sized = None
  if scheme is None or not scheme.is_quantized:
    sized = sizing.pool_per_device(sizing.from_model_config(model_cfg), engine.pool.num_blocks,
                                   engine.pool.block_size, engine.pool.k.dtype.name, tp)
  return {
      # devices: the whole mesh; the byte figures are measured on this process's devices.
      'mesh': {'model': tp, 'processes': jax.process_count(),
               'devices': sorted(f'{d.platform}:{d.id}' for d in engine.pool.k.sharding.device_set),
               'pool_partition_spec': str(getattr(engine.pool.k.sharding, 'spec', None)),
               'query_heads_per_device': layout.query_heads_per_device,
               'kv_heads_per_device': layout.kv_heads_per_device,
               'kv_head_replication': layout.kv_head_replication,
               'vocab_sharded': tp > 1 and layout.vocab_sharded},
      'kv_bytes_per_token_per_device': pool_bytes / slots,  # scales included; may be fractional
      'kv_pool_bytes_per_device': pool_bytes,
      'kv_capacity_tokens': (engine.pool.num_blocks - 1) * engine.pool.block_size,
      'kv_sizing_per_device': sized,
  }


def plot_pass(path: str, completions, timeline: dict, title: str) -> None:
  """The timed pass on the engine clock (compilation excluded), from its first arrival: left,
  one row per request from arrival to first token (waiting and prefill: TTFT) and on to its last
  token (decode: TPOT per token); right, the KV pool's slots per iteration, those holding token
  states and all those held by running sequences (the pool's capacity in the title)."""
  plt = plots.pyplot()
  start = min(c.arrival_time for c in completions)
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.35 * len(completions) + 3.2),
                                    gridspec_kw={'width_ratios': [1.3, 1]})
  for row, c in enumerate(completions):
    first = c.first_token_time if c.first_token_time is not None else c.finish_time
    left.barh(row, first - c.arrival_time, left=c.arrival_time - start, color='tab:orange',
              label='arrival to first token (TTFT)' if row == 0 else None)
    left.barh(row, c.finish_time - first, left=first - start, color='tab:blue',
              label='decode' if row == 0 else None)
    decoded = len(c.output_ids) - 1
    tpot = f', TPOT {1e3 * (c.finish_time - first) / decoded:.1f} ms' if decoded > 0 else ''
    left.text(c.finish_time - start, row, f'  TTFT {1e3 * (first - c.arrival_time):.0f} ms{tpot}',
              va='center', fontsize=7)
  left.set_yticks(range(len(completions)),
                  [f'request {c.request_id} ({len(c.prompt_ids)}+{len(c.output_ids)} tokens)'
                   for c in completions], fontsize=8)
  left.invert_yaxis()
  end = max(c.finish_time for c in completions) - start
  left.set_xlim(0, 1.45 * end)  # room for the TTFT / TPOT labels right of each bar
  left.set_xlabel('engine time since the first arrival (s)')
  left.set_title('Requests: waiting + prefill, then decode')
  plots.legend_below(left, ncol=2)
  t = np.asarray(timeline['t'])
  timed = t > start  # samples are taken after each iteration: the pass's first is past start
  held = sum(np.asarray(timeline[k]) for k in ('token_states', 'internal_fragmentation',
                                                'reservation'))
  capacity = held[0] + timeline['free_unusable'][0] + timeline['free_idle'][0] + timeline[
      'pinned'][0]
  right.step(t[timed] - start, held[timed], where='post', label='slots held by running sequences')
  right.step(t[timed] - start, np.asarray(timeline['token_states'])[timed], where='post',
             label='slots holding token states')
  right.set_ylim(0, 1.15 * max(held[timed].max(), 1))
  right.set_xlim(left=0)
  right.set_xlabel('engine time since the first arrival (s)')
  right.set_ylabel('KV slots (tokens)')
  right.set_title(f'KV pool per iteration (capacity {capacity:,} slots)')
  plots.legend_below(right, ncol=2)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  plots.save(fig, path)


def check_prompts(engine, prompts, sampling) -> None:
  """Every prompt through the engine's own submit checks (tokens, length against
  engine.max_seq_len, pool fit) without queuing it, so a bad one refuses the run before the
  first pass compiles anything, naming which prompt."""
  for i, prompt in enumerate(prompts):
    try:
      engine.intake.check(engine.intake.tokens(prompt), sampling)
    except RequestError as e:
      shown = repr(prompt) if len(repr(prompt)) <= 50 else repr(prompt)[:50] + '...'
      raise RequestError(f'config.prompts[{i}]={shown}: {e}') from None


def main(argv):
  del argv
  config = flags.FLAGS.config
  typed = Config.from_configdict(config)  # validated before anything loads
  cli.check_model_path(typed)
  prompts = config.get('prompts')
  if not isinstance(prompts, (list, tuple)) or not prompts:
    raise ConfigError(f'config.prompts={prompts!r} is not allowed: a non-empty list of prompts')
  tp = typed.mesh.model
  # Both before anything starts the JAX backend (the workdir check does not start it).
  if _DISTRIBUTED.value:
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    writer = jax.process_index() == 0  # the only process that writes
  else:
    writer = True
  workdir = cli.prepare_workdir(flags.FLAGS.workdir) if writer else None
  if not _DISTRIBUTED.value:  # one process: on a CPU-only machine, fake tp CPU devices
    sharding.request_cpu_devices(tp)
  t0 = time.perf_counter()
  model_cfg, params, tokenizer = factory.load_model_and_tokenizer(config)
  load_seconds = time.perf_counter() - t0
  engine = factory.make_engine(config, model_cfg, params, tokenizer)
  del params  # on a mesh the engine holds sharded copies; let the whole ones on device 0 go
  sampling = typed.sampling
  check_prompts(engine, prompts, sampling)

  print(f'pass 1 of 2 ({len(prompts)} prompts): compiles every step shape', flush=True)
  _, first_seconds, _ = run_pass(engine, prompts, sampling)
  print(f'pass 2 of 2: timed ({first_seconds:.1f} s for the first)', flush=True)
  compilations_first = engine.num_compilations
  if _PROFILE_DIR.value:
    jax.profiler.start_trace(_PROFILE_DIR.value)
  try:
    completions, seconds, generated = run_pass(engine, prompts, sampling)
  finally:
    if _PROFILE_DIR.value:
      jax.profiler.stop_trace()
      if writer:
        cli.report_trace(_PROFILE_DIR.value)

  print(f'\n{config.model.source} model, {len(completions)} prompts{cli.variant_note(config)}')
  for c in completions:
    prompt = tokenizer.decode(c.prompt_ids)
    print(f'[{c.request_id}] {prompt!r} -> {c.text!r}  ({c.finish_reason})')
  util = engine.metrics.utilization_at_peak()
  per_device = mesh_summary(engine, model_cfg, tp)
  rows = [('model', config.model.source), ('requests', len(completions)),
          ('generated tokens', generated), ('tokens/s (warm)', f'{generated / seconds:.1f}'),
          ('first pass s (compiles)', f'{first_seconds:.1f}'),
          ('KV blocks total', config.pool.num_blocks), ('KV blocks peak', engine.metrics.peak_blocks_used()),
          ('KV utilization', f'{util:.1%}'), ('compilations', engine.num_compilations),
          ('mesh.model', tp),
          ('KV bytes/token/device', per_device['kv_bytes_per_token_per_device']),
          ('KV pool bytes/device', per_device['kv_pool_bytes_per_device'])]
  print()
  for name, value in rows:
    print(f'  {name:<26} {value}')

  summary = {
      'model': config.model.source if config.model.source != 'random' else 'random-tiny',
      'model_config': model_cfg.__dict__,
      'num_requests': len(completions),
      'generated_tokens': generated,
      'tokens_per_second': generated / seconds,
      'decode_seconds': seconds,
      'first_pass_seconds': first_seconds,
      'load_seconds': load_seconds,
      'kv_blocks_total': config.pool.num_blocks,
      'kv_blocks_peak_used': engine.metrics.peak_blocks_used(),
      'kv_utilization': util,
      'kv_utilization_mean': engine.metrics.mean_utilization(),
      # The whole pool, summed over a mesh's devices (KV-head replicas included).
      'kv_bytes_per_token': engine.kv_bytes_per_token,
      'kv_pool_bytes': engine.pool.nbytes,
      **per_device,
      'num_compilations': engine.num_compilations,
      'num_compilations_first_pass': compilations_first,
      'preemptions': engine.stats['preemptions'],
      'outputs': [{'prompt': tokenizer.decode(c.prompt_ids), 'completion': c.text,
                   'finish_reason': c.finish_reason} for c in completions],
      **run_info.summary_fields(config),
  }
  if writer:  # every process computed the same figures
    path = os.path.join(workdir, 'summary.json')
    run_info.write_json(path, summary)
    figures = {k: v for k, v in summary.items() if k not in ('config', 'outputs')}
    run_info.write_csv(os.path.join(workdir, 'results.csv'), [figures])
    run_info.write_csv(os.path.join(workdir, 'completions.csv'), summary['outputs'])
    plot_pass(os.path.join(workdir, 'decode.png'), completions, engine.metrics.timeline(),
              f'Main job, timed pass: {config.model.source} model, {len(completions)} prompts, '
              f'{generated / seconds:.1f} tokens/s{cli.variant_note(config)}')
    print(f'\nwrote {path}, results.csv, completions.csv, decode.png')


if __name__ == '__main__':
  cli.define_flags('configs/default.py', 'Experiment config.')
  cli.run(main)
