"""Block sharing reproduction: prefix caching on a shared system prompt, parallel sampling.

  python -m experiments.reproduce_sharing --workdir=runs/reproduce_sharing
  python -m experiments.reproduce_sharing --config=configs/reproduce_sharing.py:tiny --workdir=DIR

Writes to WORKDIR: one line per run to results.jsonl (streamed to results.jsonl.partial during
the run and renamed at its end, so a failed or killed run leaves the previous run's
results.jsonl whole), the same as results.csv and table.md (printed too), sharing.png (prompt
tokens computed and TTFT with caching off and on; KV memory saved by sharing per n and beam
width, the paper's ranges beside it) and summary.json (replaced atomically):
  shared_prompt      the shared-system-prompt trace (pagedjax.studies.workloads.shared_system_prompt)
                     replayed with prefix caching off and on: `prefix_hit_rate` (prompt tokens
                     found cached / prompt tokens at admission), `prefill_tokens_saved_fraction`
                     (1 - prompt tokens computed / submitted), `prefill_reduction` (computed
                     uncached / cached), `ttft_speedup` (p50 TTFT uncached / cached); goals:
                     prefill tokens computed drop >= 10x, TTFT >= 5x.
  parallel_sampling  per dataset and n, `kv_sharing_saved_fraction`: the share of the KV slots
                     the block tables name that sharing spared (1 - physical / logical, summed
                     over iterations), the vLLM paper's "memory saving" (published: 6.1-9.8%
                     Alpaca, 16.2-30.5% ShareGPT for parallel sampling).
  beam_search        (when config.beam_search.beam_widths is not empty) the same figure per
                     dataset and beam width, each request decoded by beam search (beam.py;
                     published: 37.6-55.2% Alpaca, 44.3-66.3% ShareGPT for widths 2-6).
  multi_turn         the multi-turn chat trace (workloads.multi_turn_chat), caching off and on,
                     with the shared_prompt figures.
Times are the engine clock (engine.py: measured iteration time, compilation excluded).
"""
import copy
import json
import os

from experiments import cli
from experiments import jobs
from experiments import plots
from pagedjax import config as config_lib
from pagedjax.studies import run_info
from pagedjax.studies import workloads
from pagedjax.engine import RequestError
from pagedjax.host.requests.sampling_params import SamplingParams

PUBLISHED = {'parallel_sampling_saved': {'alpaca': [0.061, 0.098], 'sharegpt': [0.162, 0.305]},
             'beam_search_saved': {'alpaca': [0.376, 0.552], 'sharegpt': [0.443, 0.663]}}
GOALS = {'prefill_reduction': 10.0, 'ttft_speedup': 5.0}
KEEP = ('prefix_caching', 'prefix_hit_rate_tokens', 'prefix_hit_rate_blocks',
        'prefix_cache_evictions', 'prompt_tokens_submitted', 'prompt_tokens_computed',
        'prefill_tokens_saved_fraction', 'ttft_p50_s', 'ttft_p99_s', 'tpot_p50_s',
        'generated_tokens_per_s', 'kv_sharing_saved_fraction', 'forks', 'cow_copies',
        'peak_blocks_used', 'preemptions', 'finished_requests', 'num_compilations', 'duration_s')


def replay(config, requests, n=1, temperature=0.0, seed=0, beam_width=0) -> dict:
  """One engine from config; every request (n samples each, or beam_width beams) at its trace
  time, EOS ignored."""
  engine, _ = jobs.make_engine(config)
  rejected = 0
  for r in requests:
    params = SamplingParams(max_new_tokens=r.max_new_tokens, stop_on_eos=False, n=n,
                            temperature=temperature, seed=seed + r.request_id * n,
                            beam_width=beam_width)
    try:
      engine.submit(r.prompt_ids, params, arrival_time=r.arrival_time)
    except RequestError:
      rejected += 1
  engine.run()
  s = engine.summary()
  return dict({k: s.get(k) for k in KEEP}, rejected_requests=rejected)


def _with_cache(config, enabled):
  config = copy.deepcopy(config)
  config.prefix_cache.enabled = enabled
  return workloads.validate_config(config)


def prefix_study(config, requests, study, log) -> dict:
  """The trace replayed with prefix caching off, then on; the cached run's figures."""
  runs = {}
  for enabled in (False, True):
    runs[enabled] = replay(_with_cache(config, enabled), requests)
    log(dict(study=study, **runs[enabled]))
  off, on = runs[False], runs[True]
  return {
      'prefix_hit_rate': on['prefix_hit_rate_tokens'],
      'prefix_hit_rate_blocks': on['prefix_hit_rate_blocks'],
      'prefill_tokens_saved_fraction': on['prefill_tokens_saved_fraction'],
      'prefill_tokens_computed': {'uncached': off['prompt_tokens_computed'],
                                  'cached': on['prompt_tokens_computed']},
      'prefill_reduction': off['prompt_tokens_computed'] / on['prompt_tokens_computed'],
      'ttft_p50_s': {'uncached': off['ttft_p50_s'], 'cached': on['ttft_p50_s']},
      'ttft_speedup': off['ttft_p50_s'] / on['ttft_p50_s'],
      'evictions': on['prefix_cache_evictions'],
      'runs': {'uncached': off, 'cached': on},
  }


def shared_prompt(config, log) -> dict:
  t = config.shared_prompt
  requests = workloads.shared_system_prompt(
      t.num_requests, t.system_tokens, t.dataset, encode=workloads.byte_encode, rate=t.rate,
      seed=t.seed, max_input_len=t.max_input_len, max_output_len=t.max_output_len,
      calibrate=t.calibrate)
  return prefix_study(config, requests, 'shared_prompt', log)


def multi_turn(config, log) -> dict:
  """Chats resending their whole history each turn: a turn finds its previous turn's prompt
  blocks cached (the trace's stand-in replies differ from what the model generated, so the
  generated blocks do not match)."""
  t = config.multi_turn
  requests = workloads.multi_turn_chat(
      t.num_conversations, t.turns, t.dataset, encode=workloads.byte_encode, rate=t.rate,
      turn_gap_s=t.turn_gap_s, seed=t.seed, max_input_len=t.max_input_len,
      max_output_len=t.max_output_len, max_context=config.engine.max_seq_len,
      calibrate=t.calibrate)
  return prefix_study(config, requests, 'multi_turn', log)


def _dataset_trace(p, dataset):
  """The seeded Alpaca- or ShareGPT-like trace a fork study (section `p`) replays."""
  return workloads.synthetic_trace(
      p.num_requests, dataset, encode=workloads.byte_encode, seed=p.seed,
      max_input_len=p.max_input_len, max_output_len=p.max_output_len, calibrate=p.calibrate)


def parallel_sampling(config, log) -> dict:
  p = config.parallel_sampling
  config = _with_cache(config, False)  # sharing here comes from forks alone
  out = {}
  for dataset in p.datasets:
    requests = _dataset_trace(p, dataset)
    out[dataset] = {}
    for n in p.sample_n:
      row = replay(config, requests, n=n, temperature=p.temperature, seed=p.seed)
      log(dict(study='parallel_sampling', dataset=dataset, n=n, **row))
      out[dataset][f'n{n}'] = row['kv_sharing_saved_fraction']
    summary = workloads.summarize(requests)
    out[dataset]['trace_mean_input_len'] = summary['mean_input_len']
    out[dataset]['trace_mean_output_len'] = summary['mean_output_len']
  return out


def beam_search(config, log) -> dict:
  """Per dataset and beam width, the KV memory beams' sharing saves (no prefix cache)."""
  p = config.beam_search
  config = _with_cache(config, False)
  out = {}
  for dataset in p.datasets:
    requests = _dataset_trace(p, dataset)
    out[dataset] = {}
    for width in p.beam_widths:
      row = replay(config, requests, beam_width=width)
      log(dict(study='beam_search', dataset=dataset, beam_width=width, **row))
      out[dataset][f'beam{width}'] = row['kv_sharing_saved_fraction']
  return out


RUN_COLUMNS = ('study', 'dataset', 'n', 'beam_width') + KEEP + ('rejected_requests',)
TABLE = ('study', 'dataset', 'n', 'beam_width', 'prefix_caching', 'prompt_tokens_computed',
         'prefix_hit_rate_tokens', 'ttft_p50_s', 'kv_sharing_saved_fraction', 'cow_copies')


def runs_total(config) -> int:
  """How many engine runs the study makes (for its progress bar)."""
  total = 4 + len(config.parallel_sampling.datasets) * len(config.parallel_sampling.sample_n)
  if 'beam_search' in config:
    total += len(config.beam_search.datasets) * len(config.beam_search.beam_widths)
  return total


def study(config, workdir: str) -> dict:
  """Every study, its runs' lines to results.jsonl, then the table, CSV, plot and summary."""
  path = os.path.join(workdir, 'results.jsonl')
  runs = []
  bar = cli.progress(total=runs_total(config), desc='sharing', unit='run')
  with open(path + '.partial', 'w') as results:

    def log(row):
      row = {'dataset': None, 'n': 1, 'beam_width': 0, **row}
      runs.append(row)
      results.write(json.dumps(row) + '\n')
      results.flush()
      os.fsync(results.fileno())
      bar.update()

    figures = {'shared_prompt': shared_prompt(config, log),
               'multi_turn': multi_turn(config, log),
               'parallel_sampling': parallel_sampling(config, log)}
    if 'beam_search' in config and config.beam_search.beam_widths:
      figures['beam_search'] = beam_search(config, log)
  bar.close()
  os.replace(path + '.partial', path)  # this run's lines whole, or the previous run's
  sp = figures['shared_prompt']
  figures['goals'] = {k: {'goal': v, 'value': sp[k], 'met': sp[k] >= v} for k, v in GOALS.items()}
  summary = {**figures, 'prefix_hit_rate': sp['prefix_hit_rate'],
             'prefill_tokens_saved_fraction': sp['prefill_tokens_saved_fraction'],
             'ttft_speedup': sp['ttft_speedup'], 'published': PUBLISHED, 'runs': runs,
             **run_info.summary_fields(config)}
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  run_info.write_csv(os.path.join(workdir, 'results.csv'), runs, RUN_COLUMNS)
  table = run_info.markdown_table(runs, TABLE)
  cli.write_table(workdir, table)
  for name, g in figures['goals'].items():
    print(f"goal shared_prompt {name} >= {g['goal']:g}: {g['value']:.3g}, "
          f"{'MET' if g['met'] else 'NOT MET'}")
  plot(figures, config, os.path.join(workdir, 'sharing.png'))
  return summary


def plot(figures: dict, config, path: str) -> None:
  """Caching off and on (prompt tokens computed, TTFT p50) for the prefix studies; KV memory
  saved by sharing per n (and beam width), with the paper's published range beside each."""
  plt = plots.pyplot()
  fork_studies = [k for k in ('parallel_sampling', 'beam_search') if k in figures]
  fig, axes = plt.subplots(1, 2 + len(fork_studies), figsize=(4.4 * (2 + len(fork_studies)), 4),
                           squeeze=False, layout='constrained')
  axes = axes[0]
  prefix = ('shared_prompt', 'multi_turn')
  for ax, (key, what, factor) in zip(axes, (('prompt_tokens_computed', 'tokens', 1),
                                            ('ttft_p50_s', 'ms', 1e3))):
    for i, cached in enumerate(('uncached', 'cached')):
      values = [factor * (figures[p]['runs'][cached][key] or 0) for p in prefix]
      ax.bar([j + 0.4 * i for j in range(len(prefix))], values, width=0.4,
             label=f'prefix caching {"on" if cached == "cached" else "off"}')
    ax.set_xticks([j + 0.2 for j in range(len(prefix))], [p.replace('_', ' ') for p in prefix])
    ax.set_title('prompt tokens computed' if key == 'prompt_tokens_computed' else 'TTFT p50',
                 fontsize=9)
    ax.set_ylabel(what)
    plots.legend_below(ax, ncol=2)
  for ax, name in zip(axes[2:], fork_studies):
    published = PUBLISHED['parallel_sampling_saved' if name == 'parallel_sampling' else
                          'beam_search_saved']
    tag = 'n' if name == 'parallel_sampling' else 'beam'
    datasets = [d for d in figures[name] if isinstance(figures[name][d], dict)]
    keys = sorted({k for d in datasets for k in figures[name][d] if k.startswith(tag)},
                  key=lambda k: int(k[len(tag):]))
    width = 0.8 / max(1, len(datasets))
    for i, dataset in enumerate(datasets):
      xs = [j + width * i for j in range(len(keys))]
      ax.bar(xs, [figures[name][dataset].get(k) or 0 for k in keys], width=width,
             label=f'{dataset} (measured)', color=f'C{i}')
      low, high = published.get(dataset, (None, None))
      if low is not None:
        ax.axhspan(low, high, color=f'C{i}', alpha=0.15, label=f'{dataset}: paper\'s range')
    ax.set_xticks([j + width * (len(datasets) - 1) / 2 for j in range(len(keys))],
                  [f'{"n" if tag == "n" else "width"} = {k[len(tag):]}' for k in keys])
    tops = [figures[name][d].get(k) or 0 for d in datasets for k in keys]
    tops += [published[d][1] for d in datasets if d in published]
    ax.set_ylim(0, min(1.0, 1.25 * max(tops + [0.05])))
    ax.set_title(('parallel sampling' if tag == 'n' else 'beam search') +
                 ': KV slots saved by sharing', fontsize=9)
    ax.set_ylabel('share of logical KV slots')
    plots.legend_below(ax, ncol=2)
  fig.suptitle('Block sharing (CPU, tiny random Llama; engine clock)' + cli.variant_note(config),
               fontsize=10)
  plots.save(fig, path)


def check(config) -> None:
  """The four studies' sections, before any engine starts."""
  datasets = cli.one_of(workloads.DATASETS)
  length = dict(max_input_len=cli.POSITIVE_INT, max_output_len=cli.POSITIVE_INT,
                seed=cli.INT, calibrate=cli.BOOL)
  cli.check_fields(config, 'shared_prompt', num_requests=cli.POSITIVE_INT,
                   system_tokens=cli.POSITIVE_INT, dataset=datasets, rate=cli.POSITIVE, **length)
  cli.check_fields(config, 'multi_turn', num_conversations=cli.POSITIVE_INT,
                   turns=cli.POSITIVE_INT, dataset=datasets, rate=cli.POSITIVE,
                   turn_gap_s=cli.NON_NEGATIVE, **length)
  cli.check_fields(config, 'parallel_sampling', datasets=cli.list_of(datasets),
                   sample_n=cli.list_of(cli.POSITIVE_INT), num_requests=cli.POSITIVE_INT,
                   temperature=cli.NON_NEGATIVE, **length)
  if 'beam_search' in config:
    cli.check_fields(config, 'beam_search', datasets=cli.list_of(datasets),
                     beam_widths=cli.list_of(cli.POSITIVE_INT, non_empty=False),
                     num_requests=cli.POSITIVE_INT, **length)


if __name__ == '__main__':
  cli.run_study('configs/reproduce_sharing.py', 'Sharing study config.', study, check=check)
