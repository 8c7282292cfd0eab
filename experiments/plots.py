"""What the studies' figures share: the words and units of each plotted field, labels of sweep
points, and writing a PNG atomically.

  plt = plots.pyplot()                      # matplotlib on the Agg backend
  ax.set_title(plots.words('attention_s'))  # 'attention kernel time, one call'
  ax.set_ylabel(plots.axis('attention_s'))  # 'attention kernel time, one call (s)'
  plots.save(fig, path)

A field missing from FIELDS is shown as its name with underscores as spaces, so a new figure
plots before anyone describes it; add it here (words, unit) to read well in a paper draft.
"""
from typing import Optional

from pagedjax.studies import run_info

# field (a row key, or a dotted config field of a sweep point) -> (words, unit or '').
FIELDS = {
    # pool and model (swept fields)
    'pool.block_size': ('block size', 'tokens'),
    'block_size': ('block size', 'tokens'),
    'pool.num_blocks': ('pool blocks', 'blocks'),
    'pool.kind': ('pool', ''),
    'pool.kv_dtype': ('KV dtype', ''),
    'pool.kv_group_size': ('group', 'channels'),
    'pool.kv_key_per_channel': ('per-channel keys', ''),
    'pool.kv_recent_window': ('recent window', 'tokens'),
    'model.random.num_kv_heads': ('KV heads', ''),
    'sim.num_kv_heads': ('KV heads', ''),
    'num_kv_heads': ('KV heads', ''),
    'kv_dtype': ('KV dtype', ''),
    'engine.max_batch_size': ('batch cap', 'sequences'),
    'trace.rate': ('arrival rate', 'requests/s'),
    'trace_rate': ('arrival rate', 'requests/s'),
    # memory and serving
    'kv_utilization': ('KV utilization (token states / slots held)', 'share'),
    'kv_internal_fragmentation': ('KV slots lost in last blocks', 'share of pool'),
    'generated_tokens_per_s': ('throughput', 'generated tokens/s'),
    'mean_concurrent_sequences': ('running sequences, mean', 'sequences'),
    'normalized_latency_s': ('normalized latency (end-to-end / output tokens)', 's/token'),
    'kv_bytes_per_token': ('KV bytes per token, scales included', 'B/token'),
    'requests_fit_at_max_seq_len': ('requests of max_seq_len that fit', 'requests'),
    'max_concurrent_sequences': ('longest-context sequences that fit the budget', 'sequences'),
    'decode_step_ms': ('warm decode step', 'ms'),
    'perplexity_delta_pct': ('perplexity vs bfloat16 pool', '% change'),
    'greedy_agreement': ('greedy top-1 agreement with bfloat16 pool', 'share'),
    # what block tables cost
    'block_table_entries_mean': ('block-table entries per row of a step call', 'entries'),
    'block_table_bytes_per_iteration': ('block-table bytes sent per iteration', 'B'),
    'step_input_s_per_iteration': ('host time building step inputs, per iteration', 's'),
    'step_inputs_call_s': ('host time building one call\'s inputs', 's'),
    'attention_s': ('attention kernel time, one call', 's'),
}


def pyplot():
  """matplotlib.pyplot on the Agg backend (no display needed)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def words(field: str) -> str:
  return FIELDS.get(field, (field.replace('_', ' '), ''))[0]


def unit(field: str) -> str:
  return FIELDS.get(field, ('', ''))[1]


def axis(field: str) -> str:
  """An axis label: the field in words and its unit."""
  u = unit(field)
  return f'{words(field)} ({u})' if u else words(field)


def scaled(field: str, values) -> tuple:
  """(factor, unit) to plot `field` in: seconds below one as ms or µs, so that axes read 0.14 ms
  rather than 0.00014 or 1e-5 offsets; other units as they are."""
  u = unit(field)
  top = max((abs(v) for v in values if v is not None), default=0)
  if u == 's' and 0 < top < 1e-3:
    return 1e6, 'µs'
  if u == 's' and 0 < top < 1:
    return 1e3, 'ms'
  return 1, u


def value_text(field: str, value) -> str:
  """One swept value in words: 'int4', 'group 8', 'per-channel keys', 'recent window 16'."""
  if isinstance(value, bool):
    return words(field) if value else f'no {words(field)}'
  if field in ('pool.kv_dtype', 'kv_dtype', 'pool.kind'):
    return str(value)
  if isinstance(value, float) and value == int(value):
    value = int(value)
  return f'{words(field)} {value}'


def varying(rows: list, fields) -> list:
  """The fields (in order) whose value is not the same in every row."""
  return [f for f in fields if len({repr(r.get(f)) for r in rows}) > 1]


def determined_by(rows: list, field: str, by: str) -> bool:
  """Whether each value of `by` comes with one value of `field` (e.g. num_blocks of a block-size
  sweep at one budget): such a field names no series of its own."""
  seen = {}
  for r in rows:
    if seen.setdefault(repr(r.get(by)), repr(r.get(field))) != repr(r.get(field)):
      return False
  return True


def series_label(row: dict, fields) -> str:
  return ', '.join(value_text(f, row.get(f)) for f in fields)


def plain_ticks(ax, values, axis_name: str = 'x') -> None:
  """Ticks at exactly `values`, written as plain numbers (16, not 2^4) on any scale."""
  import matplotlib.ticker as ticker  # pylint: disable=import-outside-toplevel
  values = sorted(set(values))
  target = ax.xaxis if axis_name == 'x' else ax.yaxis
  target.set_major_locator(ticker.FixedLocator(values))
  target.set_major_formatter(ticker.FixedFormatter([f'{v:g}' for v in values]))
  target.set_minor_locator(ticker.NullLocator())


def _log_scale(ax, axis: str, values) -> bool:
  """Puts `axis` ('x' or 'y') on a log scale labelled with plain numbers (300, not 3x10^2) when
  `values` span a decade or more; a decade has no major log tick to label. True if it did."""
  import matplotlib.ticker as ticker  # pylint: disable=import-outside-toplevel
  values = [v for v in values if v is not None]
  if not (values and min(values) > 0 and max(values) / min(values) >= 10):
    return False
  getattr(ax, f'set_{axis}scale')('log')
  target = getattr(ax, f'{axis}axis')
  if max(values) / min(values) < 1000:  # few decades: label 1, 2 and 5 of each, not 1 alone
    target.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
  target.set_major_formatter(ticker.FuncFormatter(lambda v, _: f'{v:.4g}'))
  target.set_minor_formatter(ticker.NullFormatter())
  return True


def log_x(ax, values) -> None:
  """A log x axis where `values` span a decade or more; a linear one from 0 otherwise."""
  if not _log_scale(ax, 'x', values):
    ax.set_xlim(left=0, right=1.05 * max((v for v in values if v is not None), default=1))


def log_y(ax, values) -> None:
  """A log y axis where `values` span a decade or more; a linear one from 0 otherwise (a log
  scale over less than a decade shows nothing more, and its minor labels repeat)."""
  if not _log_scale(ax, 'y', values):
    ax.set_ylim(bottom=0)


def legend_outside(ax, title: Optional[str] = None, fontsize: int = 8) -> None:
  """The legend to the right of the axes, where it hides no data."""
  ax.legend(loc='upper left', bbox_to_anchor=(1.01, 1.0), fontsize=fontsize, title=title,
            title_fontsize=fontsize, borderaxespad=0)


def legend_below(ax, ncol: int = 3, fontsize: int = 8) -> None:
  """The legend under the axes (below any tick labels), where it hides no data."""
  ax.legend(loc='upper center', bbox_to_anchor=(0.5, -0.18), ncol=ncol, fontsize=fontsize,
            frameon=False)


def save(fig, path: str, dpi: int = 120) -> None:
  """The figure as PNG, replacing `path` atomically; then closed. A figure laid out by
  matplotlib's constrained layout already fits its titles, labels and legends inside it, so it
  is drawn once; any other is cropped to what it draws (bbox_inches='tight'), which draws it
  twice."""
  from matplotlib.layout_engine import ConstrainedLayoutEngine  # pylint: disable=g-import-not-at-top
  constrained = isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine)
  with run_info.atomic_write(path, 'wb') as f:
    fig.savefig(f, format='png', dpi=dpi, bbox_inches=None if constrained else 'tight')
  pyplot().close(fig)
