"""A recomputation storm and its mitigations: the shared system prompt changes version mid-run.

  python -m experiments.recompute_storm --workdir=runs/storm
  python -m experiments.recompute_storm --config=configs/recompute_storm.py:tiny --workdir=DIR

Every row (configs/recompute_storm.py: none, prewarm, throttle, prewarm_throttle) is one engine
(pagedjax.engine) replaying the same trace open-loop (requests at their trace times, greedy, EOS
ignored), `storm.repeats` times (each figure: the median). Until a request has computed and
cached the new system prompt, every request that arrives misses it and prefills it in full: the
windowed prefix hit rate collapses, the hit-rate alert fires (pagedjax/host/alerts.py), TTFT
spikes. Pre-warming computes the new prompt before the switch, once, and pins it; throttling caps
the prompt tokens per iteration while the alert is active.

Writes to WORKDIR:
  results.csv, table.md   one line per row: TTFT p50/p99 of the requests arriving in steady
                          state and across the switch (windows: configs/recompute_storm.py), the
                          p99 ratio, the hit rate in steady state, the lowest windowed hit rate
                          in the after_switch_s after the switch, alerts fired (in all, and from
                          the switch on: a pre-warm's own lookup misses too, and may fire one)
                          and cleared, prompt tokens computed (the pre-warm's included)
  timelines/ROW.csv       per iteration: engine clock, prefix tokens queried and hit, windowed hit
                          rate, alert active, prompt and decode tokens, running and waiting,
                          host, device and (excluded from the clock) compile seconds
  requests/ROW.csv        per request: arrival, system prompt version, TTFT, prompt tokens
  storm.png               per row: windowed hit rate over the run and around the switch, TTFT
                          by arrival; the switch, the pre-warm and the alerts marked
  summary.json            the rows (with their alert records), the goal and whether it was met,
                          whether outputs were token-identical across rows, the trace's figures,
                          the config, versions and the git revision
Goal: with pre-warming, TTFT p99 across the switch at most `storm.goal_ttft_p99_ratio` (1.5) x
the steady state's. Times are the engine clock (measured wall time of the engine's iterations,
compilation excluded) on this CPU: a shared machine's load moves them, so compare rows of one
run, and read p99 of a few dozen requests as what it is (about the worst one or two).
"""
import copy
import csv
import os

import numpy as np

from experiments import cli
from experiments import jobs
from experiments import plots
from pagedjax import config as config_lib
from pagedjax.studies import run_info
from pagedjax.studies import workloads
from pagedjax.config import ConfigError
from pagedjax.host.metrics import percentile
from pagedjax.host.requests.sampling_params import SamplingParams

ROWS = ('none', 'prewarm', 'throttle', 'prewarm_throttle')
COLUMNS = ('row', 'ttft_p50_steady_s', 'ttft_p99_steady_s', 'ttft_p50_across_s',
           'ttft_p99_across_s', 'ttft_p99_ratio', 'requests_steady', 'requests_across',
           'hit_rate_steady', 'min_windowed_hit_rate_after_switch', 'alerts_fired',
           'alerts_fired_after_switch', 'alerts_cleared', 'alert_iterations',
           'prompt_tokens_computed', 'prompt_tokens_submitted',
           'preemptions', 'prefix_cache_evictions', 'duration_s')
TIMELINE = ('t', 'prefix_queried_tokens', 'prefix_hit_tokens', 'prefix_hit_rate_windowed',
            'hit_rate_alert', 'prefill_tokens', 'decode_tokens', 'running', 'waiting', 'host_s',
            'device_s', 'compile_s')


def _refuse(field: str, value, allowed: str) -> None:
  raise ConfigError(f'config.{field}={value!r} is not allowed: {allowed}')


def check_storm(config) -> None:
  """config.storm's fields, refused before any model loads."""
  s = config.storm
  for row in s.rows:
    if row not in ROWS:
      _refuse('storm.rows', list(s.rows), f'a list of rows from {ROWS}')
  if not s.rows:
    _refuse('storm.rows', list(s.rows), f'a non-empty list of rows from {ROWS}')
  for name in ('requests', 'system_tokens', 'max_input_len', 'max_output_len',
               'throttle_prefill_tokens', 'repeats'):
    if not isinstance(s[name], int) or isinstance(s[name], bool) or s[name] < 1:
      _refuse(f'storm.{name}', s[name], 'an integer >= 1')
  for name in ('rate', 'switch_time_s', 'prewarm_lead_s', 'after_switch_s',
               'goal_ttft_p99_ratio'):
    value = s[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e12:
      _refuse(f'storm.{name}', value, 'a finite number > 0')
  if not 0 <= s.steady_start_s < s.switch_time_s - s.prewarm_lead_s:
    _refuse('storm.steady_start_s', s.steady_start_s,
            f'a number of seconds in [0, storm.switch_time_s - storm.prewarm_lead_s = '
            f'{s.switch_time_s - s.prewarm_lead_s}): the steady state must end before the '
            'pre-warm starts')
  longest = s.system_tokens + s.max_input_len + s.max_output_len
  if longest > config.engine.max_seq_len:
    _refuse('storm.system_tokens', s.system_tokens,
            f'at most engine.max_seq_len={config.engine.max_seq_len} - storm.max_input_len - '
            'storm.max_output_len (the longest request)')


def make_trace(config) -> list:
  s = config.storm
  return workloads.system_prompt_switch(
      s.requests, s.system_tokens, s.switch_time_s, s.dataset, rate=s.rate, seed=s.seed,
      max_input_len=s.max_input_len, max_output_len=s.max_output_len, calibrate=False)


def new_prefix(requests, switch_time_s: float) -> list:
  """The system prompt requests arriving from the switch on start with."""
  after = [r for r in requests if r.arrival_time >= switch_time_s]
  if not after:
    raise ConfigError(f'config.storm.switch_time_s={switch_time_s} is not allowed: before the '
                      f'last arrival ({requests[-1].arrival_time:.2f} s with these storm.requests '
                      'and storm.rate), so that requests meet the new system prompt')
  return after[0].prompt_ids[:after[0].shared_prefix_len]


def row_config(base, row: str):
  """The config of one row (configs/recompute_storm.py lists them)."""
  c = copy.deepcopy(base)
  s = c.storm
  c.tiers.pinned_blocks = s.system_tokens // c.pool.block_size if 'prewarm' in row else 0
  c.alerts.throttle_prefill_tokens = s.throttle_prefill_tokens if 'throttle' in row else 0
  return workloads.validate_config(c)


def replay(config, row: str, requests, prefix: list) -> tuple:
  """One engine replaying the trace; (engine, the trace's request ids in engine ids).
  Pre-warming rows pin the new prefix and submit it alone, one output token, prewarm_lead_s
  before the switch (its completion is not one of the trace's)."""
  s = config.storm
  engine, _ = jobs.make_engine(config)
  if 'prewarm' in row:
    engine.prefix_cache.pin(prefix)
    engine.submit(prefix, SamplingParams(max_new_tokens=1, stop_on_eos=False),
                  arrival_time=s.switch_time_s - s.prewarm_lead_s)
  ids = [engine.submit(r.prompt_ids, SamplingParams(max_new_tokens=r.max_new_tokens,
                                                    stop_on_eos=False),
                       arrival_time=r.arrival_time) for r in requests]
  engine.run()
  return engine, ids


def figures(config, engine, ids, requests) -> dict:
  """The row's figures (COLUMNS): TTFT by window, hit rates, alerts, tokens computed."""
  s, summary = config.storm, engine.summary()
  start = s.switch_time_s - s.prewarm_lead_s
  end = s.switch_time_s + s.after_switch_s
  ttft = np.array([engine.finished[i].first_token_time - engine.finished[i].arrival_time
                   for i in ids])
  arrival = np.array([r.arrival_time for r in requests])
  steady = ttft[(arrival >= s.steady_start_s) & (arrival < start)]
  across = ttft[(arrival >= start) & (arrival < end)]
  tl = engine.metrics.timeline()
  t = np.array(tl['t'])
  in_steady = (t >= s.steady_start_s) & (t < start)
  after = (t >= s.switch_time_s) & (t < end)
  queried = np.array(tl['prefix_queried_tokens'])
  hit = np.array(tl['prefix_hit_tokens'])
  windowed = [r for r, keep in zip(tl['prefix_hit_rate_windowed'], after)
              if keep and r is not None]
  p99_steady, p99_across = percentile(steady, 99), percentile(across, 99)
  return dict(
      ttft_p50_steady_s=percentile(steady, 50), ttft_p99_steady_s=p99_steady,
      ttft_p50_across_s=percentile(across, 50), ttft_p99_across_s=p99_across,
      ttft_p99_ratio=p99_across / p99_steady if p99_steady and p99_across else None,
      requests_steady=len(steady), requests_across=len(across),
      hit_rate_steady=(float(hit[in_steady].sum() / queried[in_steady].sum())
                       if queried[in_steady].sum() else None),
      min_windowed_hit_rate_after_switch=min(windowed) if windowed else None,
      alerts_fired=summary['hit_rate_alerts_fired'],
      alerts_fired_after_switch=sum(a['fired_t'] >= s.switch_time_s
                                    for a in summary['hit_rate_alerts']),
      alerts_cleared=summary['hit_rate_alerts_cleared'],
      alert_iterations=summary['hit_rate_alert_iterations'],
      prompt_tokens_computed=summary['prompt_tokens_computed'],
      prompt_tokens_submitted=summary['prompt_tokens_submitted'],
      preemptions=summary['preemptions'],
      prefix_cache_evictions=summary['prefix_cache_evictions'],
      duration_s=summary['duration_s'], alerts=summary['hit_rate_alerts'])


def write_row_files(workdir: str, row: str, engine, ids, requests, switch_time_s) -> None:
  """timelines/ROW.csv and requests/ROW.csv of the row's last run."""
  tl = engine.metrics.timeline()
  os.makedirs(os.path.join(workdir, 'timelines'), exist_ok=True)
  with run_info.atomic_write(os.path.join(workdir, 'timelines', f'{row}.csv'), newline='') as f:
    writer = csv.writer(f)
    writer.writerow(('iteration',) + TIMELINE)
    writer.writerows([i] + [tl[k][i] for k in TIMELINE] for i in range(len(tl['t'])))
  os.makedirs(os.path.join(workdir, 'requests'), exist_ok=True)
  with run_info.atomic_write(os.path.join(workdir, 'requests', f'{row}.csv'), newline='') as f:
    writer = csv.writer(f)
    writer.writerow(('request_id', 'arrival_time', 'system_prompt', 'ttft_s', 'prompt_tokens',
                     'output_tokens'))
    for r, i in zip(requests, ids):
      done = engine.finished[i]
      writer.writerow((r.request_id, r.arrival_time,
                       'v2' if r.arrival_time >= switch_time_s else 'v1',
                       done.first_token_time - done.arrival_time, len(r.prompt_ids),
                       len(done.output_ids)))


def median_row(runs: list) -> dict:
  """Each numeric figure's median over repeated runs; the others (alert records, lists) from the
  last run."""
  out = dict(runs[-1])
  for key in runs[0]:
    values = [run[key] for run in runs]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if numeric and len(set(values)) > 1:  # equal counts stay integers
      out[key] = float(np.median(values))
  return out


def goal(config, rows: list) -> dict:
  """The issue's goal on the prewarm row (None when the row was not run)."""
  by = {r['row']: r for r in rows}
  target = config.storm.goal_ttft_p99_ratio
  out = {'goal': f'prewarm ttft_p99_ratio <= {target}', 'target': target}
  prewarm = by.get('prewarm')
  value = prewarm and prewarm['ttft_p99_ratio']
  out.update(value=value, met=None if value is None else value <= target)
  return out


def write_tables(rows: list, workdir: str) -> None:
  run_info.write_csv(os.path.join(workdir, 'results.csv'), rows, COLUMNS)
  shown = ('row', 'ttft_p50_steady_s', 'ttft_p99_steady_s', 'ttft_p50_across_s',
           'ttft_p99_across_s', 'ttft_p99_ratio', 'hit_rate_steady',
           'min_windowed_hit_rate_after_switch', 'alerts_fired', 'alerts_fired_after_switch',
           'alerts_cleared', 'prompt_tokens_computed')
  table = run_info.markdown_table(rows, shown)
  cli.write_table(workdir, table)


def plot(rows: list, config, workdir: str) -> None:
  """Per row: windowed hit rate over the run (top) and around the switch (middle), TTFT by
  arrival (bottom), over the engine clock; one legend for all panels, under them."""
  plt = plots.pyplot()
  s = config.storm
  fig, axes = plt.subplots(3, len(rows), figsize=(4.2 * len(rows), 9), squeeze=False,
                           layout='constrained')
  zoom = (s.switch_time_s - s.prewarm_lead_s - 0.5, s.switch_time_s + s.after_switch_s)
  handles = {}
  for col, row in enumerate(rows):
    name = row['row']
    with open(os.path.join(workdir, 'timelines', f'{name}.csv')) as f:
      tl = list(csv.DictReader(f))
    with open(os.path.join(workdir, 'requests', f'{name}.csv')) as f:
      reqs = list(csv.DictReader(f))
    # Iterations without a lookup in their window have no rate: the line joins the others.
    defined = [x for x in tl if x['prefix_hit_rate_windowed']]
    top, middle, bottom = axes[0][col], axes[1][col], axes[2][col]
    for ax in (top, middle):
      (line,) = ax.plot([float(x['t']) for x in defined],
                        [float(x['prefix_hit_rate_windowed']) for x in defined], lw=1,
                        label='windowed prefix hit rate')
      handles.setdefault(line.get_label(), line)
      ax.set(ylim=(-0.02, 1.02), ylabel='hit rate (share of tokens)')
      for alert in row['alerts']:
        end = alert['cleared_t'] if alert['cleared_t'] is not None else float(tl[-1]['t'])
        # An alert lasts a fraction of a second here: a line marks it, a band its length.
        band = ax.axvspan(alert['fired_t'], end, color='tab:red', alpha=0.25,
                          label='alert active')
        mark = ax.axvline(alert['fired_t'], color='tab:red', lw=1, label='alert fired')
        handles.setdefault('alert active', band)
        handles.setdefault('alert fired', mark)
    top.set_title(f'{name}: windowed prefix hit rate', fontsize=9)
    middle.set_title(f'{name}: the same around the switch', fontsize=9)
    middle.set_xlim(zoom)
    for v in ('v1', 'v2'):
      mine = [x for x in reqs if x['system_prompt'] == v]
      dots = bottom.scatter([float(x['arrival_time']) for x in mine],
                            [1e3 * float(x['ttft_s']) for x in mine], s=6,
                            label=f'request with system prompt {v}')
      handles.setdefault(dots.get_label(), dots)
    bottom.set_title(f'{name}: TTFT by arrival', fontsize=9)
    bottom.set(ylabel='TTFT (ms)', ylim=(0, None))
    for ax in (top, middle, bottom):
      ax.set_xlabel('engine clock (s)')
      handles.setdefault('switch', ax.axvline(s.switch_time_s, color='k', ls='--', lw=1,
                                              label='switch'))
      if 'prewarm' in name:
        handles.setdefault('pre-warm', ax.axvline(
            s.switch_time_s - s.prewarm_lead_s, color='tab:green', ls=':', lw=1,
            label='pre-warm'))
  fig.legend(list(handles.values()), list(handles), loc='outside lower center',
             ncol=len(handles), fontsize=8, frameon=False)
  fig.suptitle('Recomputation storm (CPU, tiny random Llama; measured engine clock)'
               + cli.variant_note(config), fontsize=10)
  plots.save(fig, os.path.join(workdir, 'storm.png'), dpi=100)


def study(config, workdir: str) -> dict:
  s = config.storm
  requests = make_trace(config)
  prefix = new_prefix(requests, s.switch_time_s)
  configs = {row: row_config(config, row) for row in s.rows}  # all refused before any run
  rows, outputs = [], {}
  bar = cli.progress(total=len(s.rows) * s.repeats, desc='storm', unit='run')
  for row in s.rows:
    runs = []
    for _ in range(s.repeats):
      bar.update()
      engine, ids = replay(configs[row], row, requests, prefix)
      runs.append(figures(configs[row], engine, ids, requests))
      run_outputs = [engine.finished[i].output_ids for i in ids]
      outputs.setdefault(row, run_outputs)
      if run_outputs != outputs[row]:
        outputs[row] = None  # a repeat of the same row differs
    write_row_files(workdir, row, engine, ids, requests, s.switch_time_s)
    rows.append(dict(row=row, **median_row(runs)))
    r = rows[-1]
    cli.say(f"  {row:17s} ttft_p99 steady={r['ttft_p99_steady_s']:.4f}s "
            f"across={r['ttft_p99_across_s']:.4f}s alerts={r['alerts_fired']} "
            f"computed={r['prompt_tokens_computed']}")
  bar.close()
  reference = outputs[s.rows[0]]
  identical = reference is not None and all(o == reference for o in outputs.values())
  differing = [row for row, o in outputs.items() if o != reference]
  write_tables(rows, workdir)
  summary = {'rows': rows, 'goal': goal(config, rows), 'outputs_token_identical': identical,
             'rows_with_other_outputs': differing, 'trace': workloads.summarize(requests),
             **run_info.summary_fields(config)}
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  plot(rows, config, workdir)
  g = summary['goal']
  verdict = 'not run' if g['met'] is None else 'MET' if g['met'] else 'NOT MET'
  value = 'n/a' if g['value'] is None else f"{g['value']:.3g}"
  print(f"goal {g['goal']}: {value}, {verdict}; outputs token-identical across rows: "
        f"{identical}")
  return summary


if __name__ == '__main__':
  cli.run_study('configs/recompute_storm.py', 'Recomputation storm config.', study,
                check=check_storm)
