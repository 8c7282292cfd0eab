"""Thrashing: how goodput collapses when preemption dominates, and what each mitigation saves.

  python -m experiments.thrashing --workdir=runs/thrashing
  python -m experiments.thrashing --config=configs/thrashing.py:tiny --workdir=DIR

Part A replays one ShareGPT-like trace open-loop (requests at their trace times, greedy, EOS
ignored) through the unmitigated engine for every pool size and arrival rate of the config;
Part B replays it at `overload` x the rate where the chosen pool's goodput peaks, through every
mitigation row (configs/thrashing.py lists them), with the peak point itself rerun among them
(`peak_reference`): each row's goodput is compared with that rerun, made under the same machine
load. All engines share the tiny random model's compiled steps (experiments/jobs.py). A
config with a `sim` section (`:sim`) runs every engine on the simulated device instead
(pagedjax/sim: the real host code, device time from a cost model), marked simulated. Every
run's outputs are compared with the first run's: the policies change when tokens are computed,
never which.

Figures per run (pagedjax/host/metrics.py): goodput (generated tokens of finished requests per
engine-clock second, first arrival to last finish), preemptions, preempted and re-preempted
requests (>= 1 and >= 2 preemptions), the recomputed-token fraction (positions fed again below
what their sequence had cached before a recompute preemption, over all positions fed), TTFT and
TPOT p50/p99. Each point's figure is the median of `repeats` runs, run round-robin.

Writes to WORKDIR:
  runs.jsonl             every run as it ends (part, pool, rate, row, repeat, figures)
  sweep.csv              Part A medians per (pool blocks, rate)
  mitigations.csv        Part B medians per row, with goodput / the rerun peak's
  requests/ROW.csv       Part B, the last repeat: per request, preemptions, TTFT, TPOT
  table.md               both tables in markdown
  sweep.png              Part A: goodput and recomputed fraction against rate, per pool
  mitigations.png        Part B: goodput / peak and recomputed fraction per row, goal lines
  summary.json           the tables, the peak, the goal and whether it was met (in words too),
                         the cost-model figures, the machine load, config, versions, git state
Times are the engine clock (engine.py: the measured time of the engine's iterations,
compilation excluded, idle gaps jumped), here by default this process's CPU time
(`thrashing.clock`): the machine is shared, and wall time would charge the engine for other
processes' load. The load average is recorded with the results.
"""
import hashlib
import json
import math
import os
import time

import numpy as np

from experiments import cli
from experiments import jobs
from experiments import plots
from experiments import sweep
from pagedjax import config as config_lib
from pagedjax.studies import run_info
from pagedjax.studies import workloads
from pagedjax.sim import sim_config, simulated_device
from pagedjax.host.requests.sampling_params import SamplingParams

# The engine's clock: this process's CPU seconds (its own threads and XLA's) or wall seconds.
# On a CPU shared with other work, wall time charges the engine for everyone's load (one point
# replayed four times at load 15 gave durations 3.8-29 s by wall time, 3.9-4.7 s by CPU time).
CLOCKS = {'cpu': time.process_time, 'wall': time.perf_counter}
REFERENCE = 'peak_reference'  # Part B's rerun of the peak: unmitigated at the peak rate
FIGURES = ('goodput_tokens_per_s', 'generated_tokens_per_s', 'recomputed_token_fraction',
           'recomputed_tokens', 'tokens_fed', 'preemptions', 'preemptions_recompute',
           'preemptions_swap', 'preempted_requests', 're_preempted_requests',
           'max_preemptions_per_request', 'finished_requests', 'ttft_p50_s', 'ttft_p99_s',
           'tpot_p50_s', 'tpot_p99_s', 'duration_s', 'iterations', 'swapped_out_blocks',
           'tiers_tier2_hit_blocks')
SWEEP_COLUMNS = ('pool_blocks', 'rate', 'goodput_tokens_per_s', 'recomputed_token_fraction',
                 'preemptions', 'preempted_requests', 're_preempted_requests',
                 'max_preemptions_per_request', 'ttft_p99_s', 'tpot_p99_s', 'duration_s')
ROW_COLUMNS = ('row', 'rate', 'goodput_tokens_per_s', 'goodput_vs_peak',
               'recomputed_token_fraction', 'preemptions', 'preemptions_swap',
               'preempted_requests', 're_preempted_requests', 'max_preemptions_per_request',
               'ttft_p99_s', 'tpot_p99_s', 'meets_goal')


def make_trace(config, rate: float) -> list:
  """The trace at `rate`: the same prompts and lengths at every rate (workloads' length, arrival
  and text streams are independent), ShareGPT's length laws with scaled means."""
  t = config.workload
  laws = workloads.get_dataset(t.dataset)
  scaled = tuple(workloads.LengthDist(d.mean * t.length_scale, d.sigma) for d in laws)
  return workloads.synthetic_trace(t.num_requests, scaled, rate=rate, seed=t.seed,
                                   max_input_len=t.max_input_len,
                                   max_output_len=t.max_output_len)


def check(config) -> None:
  """The workload and study fields, before anything runs: ConfigError naming the first bad one."""
  w, c = config.workload, config.thrashing
  max_seq_len = config.engine.max_seq_len
  def fail(name, value, allowed):
    raise config_lib.ConfigError(f'config.{name}={value!r} is not allowed: {allowed}')
  if w.dataset not in workloads.DATASETS:
    fail('workload.dataset', w.dataset, f'one of {tuple(workloads.DATASETS)}')
  for name in ('num_requests', 'max_input_len', 'max_output_len'):
    if not isinstance(w[name], int) or w[name] < 1:
      fail(f'workload.{name}', w[name], 'an integer >= 1')
  if w.max_input_len + w.max_output_len > max_seq_len:
    fail('workload.max_output_len', w.max_output_len,
         f'at most engine.max_seq_len={max_seq_len} - workload.max_input_len={w.max_input_len}')
  if not isinstance(w.length_scale, (int, float)) or not w.length_scale > 0:
    fail('workload.length_scale', w.length_scale, 'a number > 0 (multiplies the means)')
  laws = workloads.get_dataset(w.dataset)
  for law, limit in zip(laws, ('max_input_len', 'max_output_len')):
    if not law.mean * w.length_scale < w[limit]:  # the clipped law must keep its mean
      fail('workload.length_scale', w.length_scale,
           f'at most {w[limit] / law.mean:.3g}: {w.dataset} means x length_scale below '
           f'workload.{limit}={w[limit]} (mean {law.mean})')
  longest = math.ceil(max_seq_len / config.pool.block_size)
  for pool in c.pool_blocks:
    if not isinstance(pool, int) or pool < longest:
      fail('thrashing.pool_blocks', list(c.pool_blocks),
           f'integers >= {longest} (usable blocks; one engine.max_seq_len request)')
  if c.chosen_pool not in c.pool_blocks:
    fail('thrashing.chosen_pool', c.chosen_pool,
         f'one of thrashing.pool_blocks={list(c.pool_blocks)}')
  if not c.rates or any(not isinstance(r, (int, float)) or not 0 < r < math.inf for r in c.rates):
    fail('thrashing.rates', list(c.rates), 'finite requests/s > 0')
  for name in ('repeats', 'priority_classes'):
    if not isinstance(c[name], int) or c[name] < 1:
      fail(f'thrashing.{name}', c[name], 'an integer >= 1')
  if not isinstance(c.overload, (int, float)) or not c.overload > 0:
    fail('thrashing.overload', c.overload, 'a number > 0 (times the peak rate)')
  if c.clock not in CLOCKS:
    fail('thrashing.clock', c.clock, f'one of {tuple(CLOCKS)}')
  names = [name for name, _ in c.rows]
  if len(set(names)) != len(names) or 'unmitigated' not in names or REFERENCE in names:
    fail('thrashing.rows', names, f"distinct names, one of them 'unmitigated', none {REFERENCE!r}")
  tiered = [name for name, overrides in c.rows if any(k.startswith('tiers.') for k in overrides)]
  if 'sim' in config and tiered:
    fail('thrashing.rows', tiered, 'rows without tiers.* overrides on a simulated device (its '
         'pool holds no block contents for a host tier to copy)')
  if 'sim' in config:
    sim_config.check(config)
  # Every run sets its own pool (thrashing.pool_blocks) and its row's fields.
  swept = ['pool.num_blocks'] + sorted({k for _, overrides in c.rows for k in overrides})
  cli.refuse_swept_overrides({'sweep': [{k: '(per run)' for k in swept}]})


def priorities(requests, classes: int) -> dict:
  """request id -> priority class by total length (prompt + max_new_tokens): the longest
  class is the largest value, the least important (ties broken by request id)."""
  ranked = sorted(requests, key=lambda r: (len(r.prompt_ids) + r.max_new_tokens, r.request_id))
  return {r.request_id: i * classes // len(ranked) for i, r in enumerate(ranked)}


def point_config(config, pool_blocks: int, overrides: dict, cost: dict):
  """The validated config of one run: the pool (usable blocks + the null block), the row's
  dotted overrides and, for rows that weigh costs, the measured cost-model figures."""
  point = {'pool.num_blocks': pool_blocks + 1, **overrides}
  if needs_cost(overrides):
    point.update({f'tiers.{k}': v for k, v in cost.items()})
  return workloads.validate_config(sweep.apply_point(config, point))


def needs_cost(overrides: dict) -> bool:
  return (overrides.get('scheduler.preemption') == 'auto' or
          overrides.get('scheduler.victim') == 'cost')


def make_engine(config, clock: str):
  """An engine for the config whose clock is `clock` (CLOCKS), sharing the model's params and
  compiled steps with every other run of the process (experiments/jobs.py). With a `sim`
  section: the real host code on a simulated device (pagedjax/sim), its clock the cost
  model's."""
  if 'sim' in config:
    sim = config.sim
    return simulated_device.simulated_engine(
        sim_config.model_shape(config), sim_config.hardware_of(config),
        config_lib.Config.from_configdict(config), weight_dtype=sim.weight_dtype,
        activation_dtype=sim.activation_dtype, count_padding=sim.count_padding)
  return jobs.make_engine(config, timer=CLOCKS[clock])[0]


def replay(config, requests, priority: dict, clock: str) -> tuple:
  """One engine replaying the trace: (figures, outputs digest, per-request rows)."""
  engine = make_engine(config, clock)
  for r in requests:
    engine.submit(r.prompt_ids, SamplingParams(max_new_tokens=r.max_new_tokens, stop_on_eos=False,
                                               priority=priority[r.request_id]),
                  arrival_time=r.arrival_time)
  done = engine.run()
  s = engine.summary()
  figures = {k: s.get(k) for k in FIGURES}
  digest = hashlib.sha256(json.dumps([c.output_ids for c in done]).encode()).hexdigest()[:16]
  per_request = [dict(request_id=c.request_id, prompt_len=len(c.prompt_ids),
                      output_len=len(c.output_ids), priority=priority[c.request_id],
                      preemptions=c.num_preemptions,
                      ttft_s=c.first_token_time - c.arrival_time,
                      tpot_s=((c.finish_time - c.first_token_time) / (len(c.output_ids) - 1)
                              if len(c.output_ids) > 1 else None),
                      finish_reason=c.finish_reason) for c in done]
  return figures, digest, per_request


def measure_cost(config, pool_blocks: int) -> dict:
  """The cost model's figures (host/tiers/tier_cost.py) as config.tiers fields: measured once on this
  machine by an engine of the chosen pool (simulated: the device cost model's)."""
  engine = make_engine(point_config(config, pool_blocks, {'scheduler.victim': 'cost'}, {}),
                       'wall')
  model = engine.scheduler.cost
  return {'prefill_s_per_token': model.prefill_s_per_token,
          'host_bytes_per_s': model.bytes_per_s[2], 'host_latency_s': model.latency_s[2]}


def median(runs: list) -> dict:
  """Each figure's median over repeated runs (None where a run has none)."""
  out = {}
  for key in runs[0]:
    values = [r[key] for r in runs]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    out[key] = float(np.median(values)) if numeric else values[0]
  return out


class Runs:
  """Runs points round-robin over repeats, logging each to runs.jsonl; checks outputs."""

  def __init__(self, workdir: str, clock: str):
    self.clock = clock
    self.path = os.path.join(workdir, 'runs.jsonl')
    self.log = open(self.path, 'w')
    self.digests = {}  # digest -> first run that produced it

  def warm_up(self, points: list) -> None:
    """Replays each point once, unrecorded: a process's first runs are slower by more than the
    compilations the clock leaves out (one measured twice as long as the runs after it)."""
    for _, config, requests, priority in points:
      replay(config, requests, priority, self.clock)

  def run(self, points: list, repeats: int) -> list:
    """points: (label dict, config, requests, priorities); returns [(label, median, last
    per-request rows)] in the points' order."""
    figures = [[] for _ in points]
    last = [None] * len(points)
    bar = cli.progress(total=repeats * len(points), desc=f'part {points[0][0]["part"]}',
                       unit='run')
    for repeat in range(repeats):
      for i, (label, config, requests, priority) in enumerate(points):
        bar.update()
        row, digest, per_request = replay(config, requests, priority, self.clock)
        self.digests.setdefault(digest, dict(label, repeat=repeat))
        record = dict(label, repeat=repeat, outputs_digest=digest, **row)
        self.log.write(json.dumps(record) + '\n')
        self.log.flush()
        figures[i].append(row)
        last[i] = per_request
        cli.say(f'  {_label_text(label)} repeat {repeat}: goodput '
                f'{row["goodput_tokens_per_s"]:.0f} tok/s, recomputed '
                f'{row["recomputed_token_fraction"]:.3f}, preemptions {row["preemptions"]}')
    bar.close()
    return [(label, median(f), p) for (label, *_), f, p in zip(points, figures, last)]

  @property
  def outputs_identical(self) -> bool:
    return len(self.digests) == 1


def _label_text(label: dict) -> str:
  return ' '.join(f'{k}={v}' for k, v in label.items())


def load_average() -> list:
  return list(os.getloadavg())


def part_a(config, runs: Runs) -> list:
  c = config.thrashing
  traces = {rate: make_trace(config, rate) for rate in c.rates}
  priority = priorities(traces[c.rates[0]], c.priority_classes)
  points = [({'part': 'A', 'pool_blocks': pool, 'rate': rate},
             point_config(config, pool, {}, {}), traces[rate], priority)
            for pool in c.pool_blocks for rate in c.rates]
  runs.warm_up(points[-1:])  # the busiest point
  return [dict(pool_blocks=label['pool_blocks'], rate=label['rate'], **fig)
          for label, fig, _ in runs.run(points, c.repeats)]


def peak(sweep_rows: list, pool_blocks: int) -> dict:
  mine = [r for r in sweep_rows if r['pool_blocks'] == pool_blocks]
  if not mine:
    raise config_lib.ConfigError(f'config.thrashing.chosen_pool={pool_blocks} is not allowed: '
                                 'one of config.thrashing.pool_blocks')
  best = max(mine, key=lambda r: r['goodput_tokens_per_s'])
  top_rate = max(r['rate'] for r in mine)
  return {'pool_blocks': pool_blocks, 'rate': best['rate'],
          'goodput_tokens_per_s': best['goodput_tokens_per_s'],
          'at_sweep_edge': best['rate'] == top_rate}


def part_b(config, runs: Runs, top: dict, workdir: str) -> tuple:
  c = config.thrashing
  rate = c.overload * top['rate']
  requests = make_trace(config, rate)
  priority = priorities(requests, c.priority_classes)
  rows = [(name, dict(overrides)) for name, overrides in c.rows]
  cost = (measure_cost(config, c.chosen_pool) if any(needs_cost(o) for _, o in rows)
          else {})
  # The peak remeasured beside the rows (round-robin with them), so that goodput / peak
  # compares runs made under the same machine load.
  reference = make_trace(config, top['rate'])
  points = [({'part': 'B', 'row': REFERENCE, 'rate': top['rate']},
             point_config(config, c.chosen_pool, {}, {}), reference,
             priorities(reference, c.priority_classes))]
  points += [({'part': 'B', 'row': name, 'rate': rate},
              point_config(config, c.chosen_pool, overrides, cost), requests, priority)
             for name, overrides in rows]
  out = []
  os.makedirs(os.path.join(workdir, 'requests'), exist_ok=True)
  results = runs.run(points, c.repeats)
  top['reference_goodput_tokens_per_s'] = results[0][1]['goodput_tokens_per_s']
  for label, fig, per_request in results[1:]:
    ratio = fig['goodput_tokens_per_s'] / top['reference_goodput_tokens_per_s']
    meets = (ratio >= c.goal_goodput_ratio and
             fig['recomputed_token_fraction'] <= c.goal_recomputed_fraction)
    out.append(dict(row=label['row'], rate=rate, goodput_vs_peak=ratio, meets_goal=meets,
                    **fig))
    run_info.write_csv(os.path.join(workdir, 'requests', f'{label["row"]}.csv'), per_request,
              list(per_request[0]))
  return out, cost


def goal(rows: list, top: dict, config) -> dict:
  """The issue's goal at overload: the best mitigation keeps goodput >= goal_goodput_ratio of
  the peak (as rerun beside the rows) and recomputes at most goal_recomputed_fraction of the
  positions it feeds."""
  c = config.thrashing
  mitigations = [r for r in rows if r['row'] != 'unmitigated']
  meeting = [r for r in mitigations if r['meets_goal']]
  low_recompute = [r for r in mitigations
                   if r['recomputed_token_fraction'] <= c.goal_recomputed_fraction]
  pool = meeting or low_recompute or mitigations
  best = max(pool, key=lambda r: r['goodput_tokens_per_s']) if pool else None
  unmitigated = next((r for r in rows if r['row'] == 'unmitigated'), None)
  met = bool(meeting)
  words = (f"goal {'MET' if met else 'NOT MET'}: at {c.overload:g}x the peak rate "
           f"({top['rate']:g} req/s, pool {top['pool_blocks']} blocks; peak goodput "
           f"{top['goodput_tokens_per_s']:.0f} tok/s in Part A, "
           f"{top['reference_goodput_tokens_per_s']:.0f} rerun beside the rows)")
  if best:
    words += (f", the best mitigation '{best['row']}' keeps {best['goodput_vs_peak']:.1%} of the"
              f" peak goodput (goal >= {c.goal_goodput_ratio:.0%}) recomputing "
              f"{best['recomputed_token_fraction']:.1%} of the positions fed (goal <= "
              f"{c.goal_recomputed_fraction:.0%})")
  if unmitigated:
    words += (f"; unmitigated: {unmitigated['goodput_vs_peak']:.1%} of the peak, "
              f"{unmitigated['recomputed_token_fraction']:.1%} recomputed")
  if top['at_sweep_edge']:
    words += '; the peak is at the sweep\'s highest rate (goodput may rise further)'
  return {'met': met, 'in_words': words, 'best_mitigation': best and best['row'],
          'rows_meeting_goal': [r['row'] for r in meeting],
          'goodput_ratio_goal': c.goal_goodput_ratio,
          'recomputed_fraction_goal': c.goal_recomputed_fraction}


def setting(config) -> str:
  """What the runs ran on, for titles and the summary."""
  if 'sim' in config:
    shape = sim_config.model_shape(config)
    return f'{shape.name} on {sim_config.hardware_of(config).name} (simulated)'
  return f'tiny random Llama, CPU, engine clock = {config.thrashing.clock} time'


def plot(sweep_rows: list, rows: list, top: dict, config, workdir: str) -> None:
  plt = plots.pyplot()
  c = config.thrashing
  note = cli.variant_note(config)
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), layout='constrained')
  for pool in c.pool_blocks:
    mine = sorted((r for r in sweep_rows if r['pool_blocks'] == pool), key=lambda r: r['rate'])
    rates = [r['rate'] for r in mine]
    for ax, key in zip(axes, ('goodput_tokens_per_s', 'recomputed_token_fraction',
                              're_preempted_requests')):
      ax.plot(rates, [r[key] for r in mine], 'o-', label=f'pool of {pool} blocks')
  axes[0].axvline(top['rate'], color='gray', ls=':', label='peak (chosen pool)')
  axes[0].axvline(c.overload * top['rate'], color='red', ls=':', label='Part B rate')
  for ax, title, unit in zip(axes, ('goodput', 'recomputed-token fraction',
                                    're-preempted requests (2+ preemptions)'),
                             ('generated tokens/s of finished requests',
                              'share of positions fed', 'requests')):
    ax.set_xscale('log')
    ax.minorticks_off()
    ax.set_xticks(list(c.rates), [f'{r:g}' for r in c.rates])
    ax.set(xlabel='arrival rate (requests/s)', ylabel=unit, title=title, ylim=(0, None))
  # A count: whole requests, from 0 to at least 1 (all zeros would otherwise span +-0.05).
  axes[2].set_ylim(0, 1.15 * max([1] + [r['re_preempted_requests'] for r in sweep_rows]))
  axes[2].yaxis.get_major_locator().set_params(integer=True)
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc='outside lower center', ncol=len(labels), fontsize=8,
             frameon=False)
  fig.suptitle('Part A, unmitigated (newest victim, recompute, watermark admission); '
               f'{setting(config)}{note}', fontsize=10)
  plots.save(fig, os.path.join(workdir, 'sweep.png'), dpi=100)

  fig, axes = plt.subplots(1, 2, figsize=(13, 5), layout='constrained')
  names = [r['row'] for r in rows]
  colors = ['tab:red' if n == 'unmitigated' else 'tab:blue' for n in names]
  axes[0].bar(names, [r['goodput_vs_peak'] for r in rows], color=colors)
  axes[0].axhline(c.goal_goodput_ratio, color='k', ls='--', label='goal')
  axes[0].set(title=f'goodput / peak goodput at {c.overload:g}x the peak rate',
              ylabel='share of the rerun peak\'s goodput', ylim=(0, None))
  axes[1].bar(names, [r['recomputed_token_fraction'] for r in rows], color=colors)
  axes[1].axhline(c.goal_recomputed_fraction, color='k', ls='--', label='goal')
  axes[1].set(title='recomputed-token fraction', ylabel='share of positions fed', ylim=(0, None))
  for ax in axes:
    plt.setp(ax.get_xticklabels(), rotation=45, ha='right', rotation_mode='anchor')
  handles, labels = axes[0].get_legend_handles_labels()
  handles += [plt.Rectangle((0, 0), 1, 1, color=c_) for c_ in ('tab:red', 'tab:blue')]
  labels += ['unmitigated', 'a mitigation']
  fig.legend(handles, labels, loc='outside lower center', ncol=3, fontsize=8, frameon=False)
  fig.suptitle(f'Part B: pool {c.chosen_pool} blocks, {c.overload * top["rate"]:g} req/s; '
               f'{setting(config)}{note}', fontsize=10)
  plots.save(fig, os.path.join(workdir, 'mitigations.png'), dpi=100)


def study(config, workdir: str) -> dict:
  runs = Runs(workdir, config.thrashing.clock)
  load_before = load_average()
  print('Part A: pool size x arrival rate, unmitigated', flush=True)
  sweep_rows = part_a(config, runs)
  top = peak(sweep_rows, config.thrashing.chosen_pool)
  print(f"peak: {top['goodput_tokens_per_s']:.0f} tok/s at {top['rate']:g} req/s "
        f"(pool {top['pool_blocks']} blocks)", flush=True)
  print(f'Part B: mitigations at {config.thrashing.overload:g}x that rate', flush=True)
  rows, cost = part_b(config, runs, top, workdir)
  runs.log.close()
  run_info.write_csv(os.path.join(workdir, 'sweep.csv'), sweep_rows, SWEEP_COLUMNS)
  run_info.write_csv(os.path.join(workdir, 'mitigations.csv'), rows,
                     list(dict.fromkeys(ROW_COLUMNS + FIGURES)))
  outcome = goal(rows, top, config)
  table = (f'{setting(config)}\n\nPart A (unmitigated)\n\n'
           f'{run_info.markdown_table(sweep_rows, SWEEP_COLUMNS)}\n\n'
           f'Part B ({config.thrashing.overload:g}x the peak rate)\n\n'
           f'{run_info.markdown_table(rows, ROW_COLUMNS)}\n')
  with run_info.atomic_write(os.path.join(workdir, 'table.md')) as f:
    f.write(table)
  print(table)
  summary = {'setting': setting(config), 'simulated': 'sim' in config,
             'goal': outcome, 'outputs_identical': runs.outputs_identical,
             'distinct_outputs': runs.digests, 'peak': top, 'part_b_rate':
             config.thrashing.overload * top['rate'], 'mitigations': rows, 'sweep': sweep_rows,
             'cost_model': cost, 'load_average': {'start': load_before, 'end': load_average()},
             **run_info.summary_fields(config)}
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  plot(sweep_rows, rows, top, config, workdir)
  print(outcome['in_words'])
  print(f"outputs token-identical across every run: {runs.outputs_identical}")
  return summary


if __name__ == '__main__':
  cli.run_study('configs/thrashing.py', 'Thrashing study config.', study, check=check)
