"""Paper reproduction (vLLM, Kwon et al. SOSP 2023, Fig. 2 and the throughput claim) on CPU.

  python -m experiments.reproduce_memory --workdir=runs/reproduce_memory
  python -m experiments.reproduce_memory --config=configs/reproduce_memory.py:tiny --workdir=DIR

Replays one ShareGPT-like trace through the contiguous and the paged pool at the same KV memory
budget (configs/reproduce_memory.py: everything else equal), through the sweep runner, so a
rerun skips a finished design (its results.jsonl and results.csv: one row per design). Writes
WORKDIR/summary.json with the figures below, table.md (printed too) and WORKDIR/memory.png: KV
utilization and concurrent sequences over time, the waste breakdown, and throughput. Published references: prior systems kept 20.4-38.2% of their KV memory for token
states, vLLM ~96%, for 2-4x the throughput. summary.json is written before the figure, so a
failed plot costs only the plot; a point whose timeline.json is missing or damaged is left out
of the timeline panels with a warning.
"""
import json
import os

from absl import logging

from experiments import cli
from experiments import plots
from experiments import sweep
from pagedjax.studies import run_info
from pagedjax.config import ConfigError
from pagedjax.host import metrics

PUBLISHED = {'prior_kv_utilization': [0.204, 0.382], 'paged_kv_utilization': 0.96,
             'throughput_ratio': [2.0, 4.0]}
KINDS = ('contiguous', 'paged')


def summarize(rows) -> dict:
  by_kind = {r['pool.kind']: r for r in rows}
  missing = [k for k in KINDS if k not in by_kind]
  if missing:
    raise ValueError(f'config.sweep lacks a point with pool.kind in {missing}')
  c, p = by_kind['contiguous'], by_kind['paged']
  out = {}
  for kind, row in by_kind.items():
    out.update({
        f'{kind}_kv_utilization': row['kv_utilization'],
        f'{kind}_peak_sequences': row['peak_concurrent_sequences'],
        f'{kind}_mean_sequences': row['mean_concurrent_sequences'],
        f'{kind}_generated_tokens_per_s': row['generated_tokens_per_s'],
        f'{kind}_requests_per_s': row['requests_per_s'],
        f'{kind}_preemptions': row['preemptions'],
        f'{kind}_num_compilations': row['num_compilations'],
        f'{kind}_waste': {k: row[f'kv_{k}'] for k in metrics.WASTE},
    })
  out['throughput_ratio'] = p['generated_tokens_per_s'] / c['generated_tokens_per_s']
  out['requests_per_s_ratio'] = p['requests_per_s'] / c['requests_per_s']
  out['peak_sequences_ratio'] = p['peak_concurrent_sequences'] / c['peak_concurrent_sequences']
  out['same_kv_pool_bytes'] = c['kv_pool_bytes'] == p['kv_pool_bytes']
  out['kv_pool_bytes'] = p['kv_pool_bytes']
  return out


def plot(path: str, rows, workdir: str, title: str = 'vLLM memory study on CPU') -> None:
  plt = plots.pyplot()
  fig, axes = plt.subplots(1, 4, figsize=(19, 4.2), layout='constrained')
  for row in rows:
    kind = row['pool.kind']
    name = sweep.point_name({k: row[k] for k in json.loads(row['point'])})
    timeline_path = os.path.join(workdir, 'points', name, 'timeline.json')
    try:
      with open(timeline_path) as f:
        timeline = json.load(f)['timeline']
      t, utilization, running = timeline['t'], timeline['kv_utilization'], timeline['running']
    except (OSError, ValueError, KeyError, TypeError) as e:
      logging.warning('%s is unreadable (%s): memory.png leaves out its timeline',
                      timeline_path, type(e).__name__)
      continue
    axes[0].plot(t, utilization, label=kind)
    axes[1].plot(t, running, label=kind)
  axes[0].set(title='KV utilization (token states / slots reserved)', xlabel='engine clock (s)',
              ylabel='share', ylim=(0, 1.05))
  axes[1].set(title='concurrent sequences', xlabel='engine clock (s)', ylabel='sequences',
              ylim=(0, None))
  bottom = [0.0] * len(rows)
  for key in metrics.WASTE:
    values = [r[f'kv_{key}'] for r in rows]
    axes[2].bar([r['pool.kind'] for r in rows], values, bottom=bottom,
                label=key.replace('_', ' '))
    bottom = [b + v for b, v in zip(bottom, values)]
  axes[2].set(title='KV pool slots by use (iteration average)', ylabel='share of pool',
              ylim=(0, 1.02))
  axes[3].bar([r['pool.kind'] for r in rows], [r['generated_tokens_per_s'] for r in rows])
  axes[3].set(title='throughput', ylabel='generated tokens/s')
  for ax in axes[:2]:
    plots.legend_below(ax, ncol=2)
  plots.legend_outside(axes[2])  # beside the stacked bars, never over them
  fig.suptitle(title, fontsize=10)
  plots.save(fig, path)


def check_kinds(config) -> None:
  """Both designs among the sweep's points: found out before the runs, not after them."""
  kinds = {dict(p).get('pool.kind') for p in config.get('sweep') or ()}
  missing = [k for k in KINDS if k not in kinds]
  if missing:
    raise ConfigError(f'config.sweep={list(config.get("sweep") or ())} is not allowed: one '
                      f'point with pool.kind={missing[0]!r} is missing (one per {KINDS})')


def check(config) -> None:
  """Both designs among the points, no command-line override of a swept field."""
  check_kinds(config)
  cli.refuse_swept_overrides(config)


def study(config, workdir: str) -> dict:
  """The sweep's rows (resumed), then this study's figures, table, summary and plot."""
  rows = sweep.run_sweep(config, workdir)
  figures = summarize(rows)
  summary = {**figures, 'published': PUBLISHED, 'trace': config.trace.to_dict(), 'rows': rows,
             **run_info.summary_fields(config)}
  # The sweep runner's summary.json lists the rows; this one, the study's figures.
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  table = run_info.markdown_table(rows, TABLE, digits=4)
  cli.write_table(workdir, table)
  print(f"paged / contiguous throughput: {figures['throughput_ratio']:.2f}x (published "
        f"{PUBLISHED['throughput_ratio'][0]:g}-{PUBLISHED['throughput_ratio'][1]:g}x); KV "
        f"utilization {figures['paged_kv_utilization']:.1%} paged, "
        f"{figures['contiguous_kv_utilization']:.1%} contiguous (published ~96%, 20.4-38.2%)")
  plot(os.path.join(workdir, 'memory.png'), rows, workdir,
       'vLLM memory study on CPU: contiguous vs paged at one KV budget (tiny random Llama; '
       'engine clock)' + cli.variant_note(config))
  return summary


TABLE = ('pool.kind', 'kv_utilization', 'peak_concurrent_sequences', 'mean_concurrent_sequences',
         'generated_tokens_per_s', 'requests_per_s', 'preemptions', 'num_compilations')


if __name__ == '__main__':
  cli.run_study('configs/reproduce_memory.py', 'Config with one contiguous and one paged point.',
                study, check=check)
