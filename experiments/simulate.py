"""Simulated serving runs: the engine's real host code on a cost-modelled device (pagedjax/sim).

  python -m experiments.simulate --config=configs/simulate_vllm.py --workdir=runs/sim_vllm
  python -m experiments.simulate --config=configs/simulate_ablations.py --workdir=runs/sim_ablations
  python -m experiments.simulate --config=configs/simulate_scale.py --workdir=runs/sim_scale
  python -m experiments.simulate --config=configs/simulate_cpu.py --workdir=runs/sim_cpu --calibrate

Without --calibrate, every point of config.sweep (dotted overrides of the config, as in
experiments.sweep) replays config.trace through `simulated_engine`: a model preset of
pagedjax.sizing (config.sim.model) on `config.mesh.model` devices of a hardware preset or profile
(config.sim.hardware), its KV pool (pool.num_blocks) sized per point from the device memory
(simulated_device.plan_pool) unless config.sim.num_blocks fixes it. Rows go to
WORKDIR/results.jsonl as each point ends (a rerun skips finished points), then results.csv,
summary.json, table.md and plot.png.
`config.study='vllm'` adds the paged / contiguous comparison at matched normalized latency.

With --calibrate (configs/simulate_cpu.py): profiles the real jitted step of config.model on this
machine (pagedjax/sim/calibrate.py), fits the cost model, writes WORKDIR/hardware_profile.json,
and validates it: real engine runs of config.trace, interleaved with the profiling rounds so both
see the same machine load, against the cost model's prediction of each of their iterations and
against a free simulation of the same trace (throughput, TTFT p50).

Every row, file and plot says it is simulated (`simulated: true`, "(simulated)" in titles); in
--calibrate output the measured figures are named `measured` and the model's `simulated`.
"""
import dataclasses
import json
import math
import os
import time

from absl import flags
import numpy as np

from experiments import cli
from experiments import plots
from experiments import sweep
from pagedjax import sizing
from pagedjax.studies import run_info
from pagedjax.studies import workloads
from pagedjax.config import Config, ConfigError, PoolConfig
from pagedjax.studies.workloads import validate_config
from pagedjax.host.requests.intake import RequestError
from pagedjax.sim import calibrate, hardware, sim_config, simulated_device

SCALAR = (int, float, str, bool, type(None))


# ---- one simulated point --------------------------------------------------------------------

def model_shape(config) -> sizing.ModelShape:
  """The simulated model (pagedjax/sim/sim_config.py: a sizing preset or the config's own
  random model, num_kv_heads replaced by sim.num_kv_heads > 0)."""
  return sim_config.model_shape(config)


def trace_of(config, encode=workloads.byte_encode):
  t = config.trace
  return workloads.synthetic_trace(
      t.num_requests, t.dataset, encode=encode, rate=t.rate, seed=t.seed,
      max_input_len=t.max_input_len, max_output_len=t.max_output_len,
      calibrate=t.get('calibrate', True))


def size_pool(config) -> dict:
  """The point's pool from its device's memory (simulated_device.plan_pool), written into
  config.pool.num_blocks unless config.sim.num_blocks fixes it; returns the plan."""
  sim, eng = config.sim, config.engine
  shape, hw = model_shape(config), sim_config.hardware_of(config)
  spec = PoolConfig(**config.pool.to_dict()).kv_quant(
      simulated_device.activation_dtype_name(sim.activation_dtype))
  plan = simulated_device.plan_pool(
      shape, hw, block_size=config.pool.block_size, kv_quant=spec, tp=config.mesh.model,
      max_tokens=config.scheduler.max_num_batched_tokens or eng.max_batch_size * eng.prefill_chunk,
      max_rows=eng.max_batch_size, weight_dtype=sim.weight_dtype,
      activation_dtype=sim.activation_dtype, memory_fraction=sim.memory_fraction)
  num_blocks = sim.get('num_blocks') or plan['num_blocks']
  if num_blocks < eng.max_batch_size + 1:
    raise ConfigError(
        f'config.sim.hardware={sim.hardware!r} is not allowed for {shape.name} on '
        f'{config.mesh.model} device(s): after the weights ({plan["weight_bytes_per_device"]:.3g} '
        f'B per device) only {num_blocks} blocks fit; raise config.mesh.model or pick a device '
        'with more memory')
  config.pool.num_blocks = num_blocks
  return plan


def simulate_point(config, plan: dict) -> dict:
  """One simulated replay of config.trace (config.pool sized by size_pool): the engine's
  summary, in simulated seconds, and how the pool was sized."""
  typed = Config.from_configdict(config)
  sim = config.sim
  shape = model_shape(config)
  hw = sim_config.hardware_of(config)
  engine = simulated_device.simulated_engine(shape, hw, typed, weight_dtype=sim.weight_dtype,
                                             activation_dtype=sim.activation_dtype,
                                             count_padding=sim.get('count_padding', True))
  trace = trace_of(config)
  rejected = 0
  for r in trace:
    try:
      calibrate.submit(engine, [r])
    except RequestError:
      rejected += 1
  t0 = time.perf_counter()
  engine.run()
  wall = time.perf_counter() - t0
  figures = {k: v for k, v in engine.summary().items() if isinstance(v, SCALAR)}
  t = workloads.summarize(trace)
  mean_len = t['mean_input_len'] + t['mean_output_len']
  capacity = (typed.pool.num_blocks - 1) * typed.pool.block_size
  return {
      'simulated': True, 'model': shape.name, 'hardware': hw.name,
      'hardware_calibrated': hw.calibrated, 'tp': typed.mesh.model,
      'count_padding': sim.get('count_padding', True),
      'num_kv_heads': shape.num_kv_heads, 'kv_dtype': engine.pool.spec.kv_dtype,
      **{k: v for k, v in plan.items() if k != 'num_blocks'}, **figures,
      'kv_capacity_tokens': capacity,
      'requests_fit_at_mean_len': int(capacity // mean_len),
      'requests_fit_at_max_seq_len': capacity // engine.max_seq_len,
      'rejected_requests': rejected, 'trace_requests': len(trace), 'trace_rate': config.trace.rate,
      'trace_mean_input_len': t['mean_input_len'], 'trace_mean_output_len': t['mean_output_len'],
      'simulator_wall_s': wall}


def run_points(config, workdir: str):
  """Every point of config.sweep, resuming from results.jsonl (experiments.sweep's helpers)."""
  points = [dict(p) for p in config.sweep] or [{}]
  configs, plans = [], []
  for p in points:  # every point sized and checked before any runs
    cfg = sweep.apply_point(config, p)
    sim_config.check(cfg)
    plans.append(size_pool(cfg))
    configs.append(validate_config(cfg))
  results = os.path.join(workdir, 'results.jsonl')
  stored, rewrite = sweep.load_rows(results)
  if rewrite:
    sweep.write_rows(results, stored)
  digest = sweep.config_hash(config)
  done = {r['point']: r for r in stored if r['config_hash'] == digest}
  todo = [(p, c) for p, c in zip(points, configs) if sweep.point_key(p) not in done]
  if len(todo) < len(points):
    print(f'{len(points) - len(todo)} of {len(points)} points already in {results}: skipped')
  plan_of = {sweep.point_key(p): plan for p, plan in zip(points, plans)}
  for point, cfg in cli.progress(todo, desc='simulate', unit='point'):
    row = {'point': sweep.point_key(point), 'config_hash': digest, **point,
           **simulate_point(cfg, plan_of[sweep.point_key(point)])}
    sweep.append_row(results, row)
    done[row['point']] = row
  return [done[sweep.point_key(p)] for p in points]


# ---- the vLLM study: paged vs contiguous at matched normalized latency ----------------------

def rate_at_latency(rows, threshold: float):
  """(highest request rate whose mean normalized latency stays under threshold, its
  throughput), interpolated between sweep points in log latency; None when the sweep never
  crosses (below: every rate meets it, so the figure is at least the highest rate; above: none
  does)."""
  rows = sorted(rows, key=lambda r: r['trace_rate'])
  lat = [r['normalized_latency_s'] for r in rows]
  if lat[0] > threshold:
    return {'rate': None, 'throughput': None, 'note': 'over the threshold at every rate'}
  for a, b in zip(rows, rows[1:]):
    if b['normalized_latency_s'] > threshold:
      la, lb = math.log(a['normalized_latency_s']), math.log(b['normalized_latency_s'])
      f = (math.log(threshold) - la) / (lb - la)
      lerp = lambda k: a[k] + f * (b[k] - a[k])
      return {'rate': lerp('trace_rate'), 'throughput': lerp('generated_tokens_per_s'),
              'note': ''}
  last = rows[-1]
  return {'rate': last['trace_rate'], 'throughput': last['generated_tokens_per_s'],
          'note': 'under the threshold at every rate: a lower bound'}


def vllm_figures(rows, thresholds) -> dict:
  kinds = {}
  for r in rows:
    kinds.setdefault(r['pool.kind'], []).append(r)
  missing = {'paged', 'contiguous'} - set(kinds)
  if missing:
    raise ConfigError(f'config.study=vllm needs points with pool.kind in {sorted(missing)}')
  out = {'simulated': True, 'thresholds': {}}
  for t in thresholds:
    p, c = rate_at_latency(kinds['paged'], t), rate_at_latency(kinds['contiguous'], t)
    ratio = lambda k: p[k] / c[k] if p[k] and c[k] else None
    out['thresholds'][str(t)] = {'paged': p, 'contiguous': c, 'rate_ratio': ratio('rate'),
                                 'throughput_ratio': ratio('throughput')}
  top = {k: max(v, key=lambda r: r['trace_rate']) for k, v in kinds.items()}
  out['at_highest_rate'] = {k: {f: r[f] for f in (
      'trace_rate', 'generated_tokens_per_s', 'mean_concurrent_sequences',
      'peak_concurrent_sequences', 'kv_utilization', 'preemptions', 'normalized_latency_s')}
                            for k, r in top.items()}
  out['batch_ratio_at_highest_rate'] = (top['paged']['mean_concurrent_sequences'] /
                                        top['contiguous']['mean_concurrent_sequences'])
  return out


# ---- plots and tables -----------------------------------------------------------------------

def plot(path: str, rows, spec, title: str, thresholds=()) -> None:
  """One panel per figure in spec.y: lines over spec.x per spec.group, or bars per point."""
  plt = plots.pyplot()
  ys = list(spec.y)
  fig, axes = plt.subplots(1, len(ys), figsize=(4.4 * len(ys), 4.0), squeeze=False,
                           layout='constrained')
  handles = {}
  for ax, y in zip(axes[0], ys):
    if spec.get('kind', 'line') == 'bar':  # one bar per point, named by spec.label's fields
      labels = ['\n'.join(plots.value_text(k, r.get(k)) for k in spec.label)
                if spec.get('label') else
                sweep.point_name(json.loads(r['point'])) or 'base' for r in rows]
      ax.bar(range(len(rows)), [r.get(y) or 0 for r in rows])
      ax.set_xticks(range(len(rows)), labels, fontsize=7)
    else:
      group = spec.get('group')
      for g in sorted({r.get(group) for r in rows}, key=str) if group else [None]:
        pts = sorted((r[spec.x], r[y]) for r in rows
                     if (group is None or r.get(group) == g) and r.get(y) is not None)
        if pts:
          (line,) = ax.plot(*zip(*pts), marker='o',
                            label=None if g is None else plots.value_text(group, g))
          handles.setdefault(line.get_label(), line)
      ax.set_xlabel(plots.axis(spec.x))
      xs = [r[spec.x] for r in rows]
      if len(set(xs)) <= 12:
        plots.plain_ticks(ax, xs)
      if y == 'normalized_latency_s':
        plots.log_y(ax, [r.get(y) for r in rows] + list(thresholds))
        for t in thresholds:
          ax.axhline(t, ls='--', lw=0.8, color='gray')
    if ax.get_yscale() != 'log':
      ax.set_ylim(bottom=0)
    ax.set_title(f'{plots.words(y)} (simulated)', fontsize=9)
    ax.set_ylabel(plots.unit(y))
    ax.grid(alpha=0.3)
  if handles and spec.get('group'):
    fig.legend(list(handles.values()), list(handles), loc='outside lower center',
               ncol=len(handles), fontsize=8, frameon=False, title=plots.words(spec.group),
               title_fontsize=8)
  fig.suptitle(f'{title} (simulated)', fontsize=10)
  plots.save(fig, path)


def run_study(config, workdir: str) -> dict:
  rows = run_points(config, workdir)
  run_info.write_csv(os.path.join(workdir, 'results.csv'), rows,
                     sweep.csv_columns(rows, [dict(p) for p in config.sweep]))
  study = config.get('study', '')
  thresholds = list(config.get('latency_thresholds', ()))
  figures = vllm_figures(rows, thresholds) if study == 'vllm' else {}
  title = config.get('title', 'simulation') + cli.variant_note(config)
  summary = {'simulated': True, 'study': study, 'title': title, 'figures': figures,
             'rows': rows, 'hardware': hardware.to_dict(sim_config.hardware_of(config)),
             **run_info.summary_fields(config)}
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  if config.get('plot'):
    plot(os.path.join(workdir, 'plot.png'), rows, config.plot, title, thresholds)
  table = run_info.markdown_table(rows, list(config.get('table_columns', ('point',))), digits=4)
  cli.write_table(workdir, f'{title} (simulated)\n\n{table}')
  if figures:
    print(f'\n{vllm_table(figures)}')
  return summary


def vllm_table(figures: dict) -> str:
  """The vLLM study's result: per latency threshold, the highest rate each design sustains."""
  rows = []
  for threshold, t in figures['thresholds'].items():
    rows.append({'latency threshold (s/token)': float(threshold),
                 'paged rate (req/s)': t['paged']['rate'],
                 'contiguous rate (req/s)': t['contiguous']['rate'],
                 'rate ratio': t['rate_ratio'], 'throughput ratio': t['throughput_ratio'],
                 'note': '; '.join(n for n in (t['paged']['note'], t['contiguous']['note']) if n)})
  table = run_info.markdown_table(rows, list(rows[0]) if rows else [], digits=3)
  return (f'{table}\nmean running sequences at the highest rate, paged / contiguous: '
          f'{figures["batch_ratio_at_highest_rate"]:.2f}')


# ---- calibration and validation on this machine ---------------------------------------------

def calibrate_and_validate(config, workdir: str, progress=print) -> dict:
  """Profiles the real step of config.model on this machine, fits the cost model, validates it
  (see the module docstring). Returns the summary it writes."""
  import jax  # pylint: disable=g-import-not-at-top
  from pagedjax import factory  # pylint: disable=g-import-not-at-top  (loads the model code)
  from pagedjax.model.step import CompiledStep  # pylint: disable=g-import-not-at-top
  from pagedjax.model.llama import init_params  # pylint: disable=g-import-not-at-top
  cal = config.calibration
  typed = Config.from_configdict(validate_config(config))
  load_before = os.getloadavg()
  if typed.model.source == 'random':  # byte prompts: no tokenizer to load
    model_cfg = typed.model.random_model_config()
    seed = typed.model.random.seed
    # Jitted: the same values, in a third of the time flax's eager init takes here.
    params, tokenizer = jax.jit(lambda: init_params(model_cfg, seed=seed))(), None
    encode = workloads.byte_encode
  else:
    model_cfg, params, tokenizer = factory.load_model_and_tokenizer(typed)
    encode = tokenizer.encode
  # shared: compiled once for every run
  step = CompiledStep(model_cfg, typed.attention.impl, linear_impl=typed.engine.linear_impl)
  make = lambda step_fn=step: factory.make_engine(typed, model_cfg, params, tokenizer,
                                                  step_fn=step_fn)
  trace = trace_of(config, encode)
  shape = dataclasses.replace(sizing.from_model_config(model_cfg), name={
      'smollm2': 'SmolLM2-135M-Instruct', 'random': 'tiny random Llama'}.get(typed.model.source, f'{typed.model.source} model'))
  # pagedjax keeps params in float32 whatever the compute dtype (model/llama.py).
  weight_dtype, act_dtype = 'fp32', sizing.canonical_dtype(model_cfg.dtype)

  progress('measuring this machine\'s matmul and memory peaks')
  peaks = calibrate.measure_peaks(rounds=cal.peak_rounds, copy_mb=cal.get('copy_mb', 256))
  progress('host time per iteration (the real engine with a step that computes nothing)')
  host = calibrate.profile_host(lambda s: make(s), trace)
  engine = make()
  points = calibrate.step_grid(engine.executor, typed.scheduler.max_num_batched_tokens or
                               typed.engine.max_batch_size * typed.engine.prefill_chunk,
                               typed.engine.prefill_chunk, tuple(cal.fills))
  runs = []
  # Validation runs spread evenly over the profiling rounds, so both sample the same load.
  after_rounds = set(np.linspace(0, cal.rounds - 1, cal.validation_runs).round().astype(int))
  if len(after_rounds) < cal.validation_runs:
    raise ConfigError(f'config.calibration.validation_runs={cal.validation_runs} is not '
                      f'allowed: at most calibration.rounds={cal.rounds} (one after a round)')

  def validation_run(r):
    if r in after_rounds:
      progress(f'validation run {len(runs) + 1}/{cal.validation_runs}: real engine, '
               f'{len(trace)} requests')
      run = calibrate.run_recorded(make(), trace)
      run['load_average'] = os.getloadavg()
      runs.append(run)

  samples = calibrate.profile_steps(engine.executor, points, model_cfg.vocab_size,
                                    rounds=cal.rounds, progress=progress,
                                    between_rounds=validation_run)
  kv_bytes = engine.kv_bytes_per_token
  base = calibrate.cpu_hardware(peaks).with_efficiency(
      iteration_overhead_s=host['iteration_overhead_s'], row_overhead_s=host['row_overhead_s'])
  fitted, fit_report = calibrate.fit(shape, base, samples, kv_bytes_per_token=kv_bytes,
                                     block_size=typed.pool.block_size,
                                     weight_dtype=weight_dtype, activation_dtype=act_dtype)
  # The profiled calls with the fit's prediction of each, for analysis offline.
  run_info.write_csv(os.path.join(workdir, 'grid.csv'), [
      {'kind': p['kind'], 'rows': p['shape'].rows, 'tokens_per_row': p['shape'].tokens_per_row,
       'real_rows': int((p['shape'].context_lens > 0).sum()),
       'q_lens': ' '.join(map(str, p['shape'].q_lens[p['shape'].context_lens > 0])),
       'context_lens': ' '.join(map(str, p['shape'].context_lens[p['shape'].context_lens > 0])),
       'measured_s': p['seconds'], 'predicted_s': p['seconds'] * (1 + e),
       'repeat_mad': p['repeat_mad']} for p, e in zip(samples, fit_report['errors'])])
  profile_path = os.path.join(workdir, 'hardware_profile.json')
  hardware.save_profile(profile_path, fitted, {
      'model': shape.name, 'fit': {k: v for k, v in fit_report.items() if k != 'errors'},
      'host': host, 'peaks': peaks})
  # The cost model the simulated engine uses (the backend builds it with its pool).
  backend = simulated_device.SimulatedBackend(shape, fitted, weight_dtype=weight_dtype,
                                              activation_dtype=act_dtype)
  backend.init_model_pool(model_cfg, typed.pool.num_blocks, typed.pool.block_size,
                          typed.pool.kv_quant(model_cfg.dtype), typed.engine.max_batch_size)
  progress('simulating the same trace with the fitted profile')
  sim = calibrate.simulate_trace(shape, fitted, typed, trace, weight_dtype=weight_dtype,
                                 activation_dtype=act_dtype)
  validations = []
  for i, run in enumerate(runs):
    it = calibrate.iteration_errors(backend.cost, run['iterations'])
    validations.append({
        'run': i, 'real_wall_s': run['wall_s'], 'load_average_after': run['load_average'],
        'per_iteration': {k: v for k, v in it.items()
                          if k not in ('predicted', 'measured', 'records')},
        'iterations_csv': os.path.join(workdir, f'iterations_run{i}.csv'),
        'end_to_end': calibrate.compare_runs(run['summary'], sim['summary']),
        'num_compilations': run['summary']['num_compilations']})
    run_info.write_csv(validations[-1]['iterations_csv'], it['records'])
    plot_iterations(os.path.join(workdir, f'iterations_run{i}.png'), it, shape.name)
  noise = float(np.median([s['repeat_mad'] for s in samples]))
  # How far the real runs of one trace differ from each other: the floor under any error.
  real_spread = {}
  for key in calibrate.END_TO_END:
    values = [run['summary'].get(key) for run in runs]
    if all(isinstance(x, (int, float)) and x > 0 for x in values):
      real_spread[key] = float(max(values) / min(values) - 1)
  summary = {
      'simulated_and_measured': True, 'model': shape.name, 'hardware': hardware.to_dict(fitted),
      'profile': profile_path, 'fit': fit_report, 'repeat_noise_median_mad': noise,
      'real_runs_spread': real_spread,
      'host': host, 'peaks': peaks, 'grid_points': len(samples), 'rounds': cal.rounds,
      'trace': workloads.summarize(trace), 'validation': validations,
      'simulator_wall_s': sim['wall_s'], 'load_average_before': load_before,
      'load_average_after': os.getloadavg(), **run_info.summary_fields(config)}
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  print_validation(summary)
  arg = '' if cli.variant(config) == 'full' else f':{cli.variant(config)}'
  print(f'replay a trace on this profile: python -m experiments.simulate '
        f'--config=configs/simulate_cpu.py{arg} --config.sim.hardware={profile_path} '
        '--workdir=DIR')
  return summary


def plot_iterations(path: str, it: dict, model: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  m, p = np.asarray(it['measured']) * 1e3, np.asarray(it['predicted']) * 1e3
  axes[0].scatter(m, p, s=6)
  top = max(m.max(), p.max())
  axes[0].plot([0, top], [0, top], color='gray', lw=0.8)
  axes[0].set(xlabel='measured iteration ms', ylabel='simulated iteration ms',
              title=f'{model}: per iteration (simulated vs measured)')
  axes[1].plot(m, lw=0.7, label='measured')
  axes[1].plot(p, lw=0.7, label='simulated')
  axes[1].set(xlabel='iteration', ylabel='ms', title='iteration time (simulated vs measured)')
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  with run_info.atomic_write(path, 'wb') as f:
    fig.savefig(f, format='png', dpi=120)
  plt.close(fig)


def print_validation(summary: dict) -> None:
  print(f"fit over {summary['grid_points']} step shapes: median |error| "
        f"{summary['fit']['median_abs_error']:.1%}; repeat noise (median MAD of repeated "
        f"identical calls) {summary['repeat_noise_median_mad']:.1%}")
  print('real runs of the same trace differ by (max / min - 1): ' + ', '.join(
      f'{k} {v:.1%}' for k, v in summary['real_runs_spread'].items()))
  for v in summary['validation']:
    pi = v['per_iteration']
    print(f"run {v['run']}: per-iteration median |error| {pi['median_abs_error']:.1%}, mean "
          f"signed error {pi['mean_signed_error']:+.1%} over {pi['iterations_compared']} "
          f"iterations (device only {pi['device_median_abs_error']:.1%}); {v['iterations_csv']}")
    for key, e in v['end_to_end'].items():
      if e['error'] is not None:
        print(f"  {key:<28} measured {e['measured']:.4g}  simulated {e['simulated']:.4g}  "
              f"error {e['error']:+.1%}")


def study(config, workdir: str, calibrate: bool = False) -> dict:
  """--calibrate: calibrate_and_validate; else run_study (the config's simulated sweep)."""
  if calibrate:
    return calibrate_and_validate(config, workdir)
  return run_study(config, workdir)


def check(config, calibrate: bool = False) -> None:
  """config.sim (pagedjax/sim/sim_config.py; with --calibrate, all but sim.hardware: the
  profile it names is what a calibration writes) and no command-line override of a swept field,
  before the workdir; every point's own sim fields are checked again before any point runs."""
  sim_config.check(config, check_hardware=not calibrate)
  cli.refuse_swept_overrides(config)
  if calibrate:
    validate_config(config)  # the real engine's config
  else:  # each point's pool is sized from its device, then the point validated
    for point in [dict(p) for p in config.sweep] or [{}]:
      cfg = sweep.apply_point(config, point)
      sim_config.check(cfg)
      size_pool(cfg)
      validate_config(cfg)


if __name__ == '__main__':
  cli.study_flag(flags.DEFINE_bool, 'calibrate', False,
                 'Profile the real step on this machine, fit the cost model, write '
                 'WORKDIR/hardware_profile.json and validate it against real runs.')
  cli.run_study('configs/simulate_vllm.py', 'Simulation config.', study, check=check,
                validate=False)
