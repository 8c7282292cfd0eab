"""Where a decode step's time goes: the main job's warm decode steps under jax.profiler, per batch.

  python -m experiments.profile_decode --config=configs/profile_decode.py --workdir=runs/profile_decode
  python -m experiments.profile_decode --config=configs/profile_decode.py:tiny --workdir=DIR

Per batch (configs/profile_decode.py): the engine brought to a steady decode state (prompts
prefilled, the decode program compiled and warm), then `profile.steps` decode iterations traced
with jax.profiler (`create_perfetto_trace`: a plain JSON trace, .json.gz). XLA:CPU's thunk
runtime emits one event per executed HLO instruction (a thunk: a fusion, a custom call, a
library dot), named by the instruction (args.hlo_op); the step's optimized HLO (the same program
compiled ahead of time and run in that form, RecordingStep) says what each is.

Each traced iteration's step is the window from the jitted call's dispatch (PjitFunction(step)
on the Python thread) to the end of its execution (the ThunkExecutor::Execute events after it,
on whichever threads the executor ran parts of the program). Every microsecond of
that window goes to exactly one category (`attribute`): the op running then (the innermost, where
one op's events hold another's, as a conditional holds its branch; split evenly where ops of
different threads overlap), `dispatch` before the first op starts, `gaps` between ops. So the
categories sum to the traced step. CATEGORIES, from the instruction (`classify`):

  linear_kernel  custom calls of the native linear kernel (kernels/linear_cpu.py) for q/k/v/o,
                 gate/up/down
  linear_xla     XLA's dots (and fusions holding one) for the same layers
  head           the output head: a linear-kernel call or dot with the vocabulary as its output
  attention      the native paged-attention custom call (kernels/cpu.py); with
                 attention.impl=xla its gathers and fusions count as copies / elementwise
  kv_write       scatters into the KV pool (this step's K/V)
  elementwise    fusions with arithmetic inside the model: RMSNorm, RoPE, residual adds, SiLU
  sampling       ops outside the model (its name scope): argmax / top-k / softmax of the logits
  copies         pure data movement: copies, transposes, concatenates, gathers (the embedding
                 lookup)
  other_ops      control flow (conditionals, loops) outside the ops it runs
  gaps           inside the execution, no op running
  dispatch       the call's dispatch: argument handling, until the first op starts

Outside the categories: the iteration's host work before and after the step (scheduling, step
inputs, output handling), as `host_ms_outside_step`.

The matmul floor is bench_decode's (matmul_floor_fn, time_calls): the step's matmuls alone,
XLA's dots (`floor_ms`; through the native kernel too, `floor_ms_kernel`). From the traced
matmul time and the model's shapes: weight GB/s read and GFLOP/s achieved, for the linear layers,
the head, and both, against a numpy memory copy measured in the same run (`copy_gb_per_s`: bytes
copied per second, each read once and written once); `step_ms_if_matmuls_at_copy_rate` is the
traced step with its matmuls replaced by their weights' bytes at that rate, everything else as
traced.

If a trace holds no per-op events (a jaxlib whose CPU runtime does not emit them), the step is
split by measurement instead, and every row says so (`decomposition`): `matmuls_floor` the floor,
`rest` the traced step minus it.

Writes WORKDIR/summary.json, results.csv (a row per batch: ms per step and share of each
category, floor, GB/s, GFLOP/s), ops.csv (a row per batch and HLO instruction: category, JAX
name, microseconds per step), table.md, profile_decode.png (stacked bars, ms per step by
category per batch, the floor marked) and trace/B<batch>/ (the traces, for Perfetto or xprof,
and step.hlo.txt, the optimized HLO the ops' names refer to).
"""
import collections
import glob
import gzip
import json
import os
import re
import statistics
import time

import jax
import numpy as np

from experiments import bench_decode
from experiments import cli
from experiments import plots
from pagedjax import factory
from pagedjax.config import Config, ConfigError
from pagedjax.kernels import cpu as attention_cpu
from pagedjax.kernels import linear_cpu
from pagedjax.model.llama import PROJECTIONS
from pagedjax.model.step import DECODE_LAYERS, CompiledStep
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.studies import run_info

# (name, words): the order of the table, the CSV and the bars.
CATEGORIES = (
    ('linear_kernel', 'linear layers, native kernel'),
    ('linear_xla', 'linear layers, XLA dots'),
    ('head', 'output head (vocabulary projection)'),
    ('attention', 'paged attention'),
    ('kv_write', 'K/V write into the pool'),
    ('elementwise', 'norms, RoPE, residuals, SiLU'),
    ('sampling', 'sampling (argmax / top-k)'),
    ('copies', 'copies, transposes, gathers'),
    ('other_ops', 'other ops (control flow)'),
    ('gaps', 'inside the execution, no op running'),
    ('dispatch', 'dispatch, until the first op'),
)
WORDS = dict(CATEGORIES)
MATMULS = ('linear_kernel', 'linear_xla', 'head')
# The fallback's categories (no per-op events): measured, not traced.
FALLBACK = (('matmuls_floor', 'matmuls (the floor, timed alone)'),
            ('rest', 'the rest (traced step minus the floor)'))
# Opcodes that only move data: a fusion of nothing else is a copy.
MOVEMENT = frozenset({
    'parameter', 'constant', 'copy', 'transpose', 'bitcast', 'reshape', 'broadcast', 'slice',
    'dynamic-slice', 'concatenate', 'gather', 'pad', 'tuple', 'get-tuple-element', 'iota',
    'reverse', 'copy-start', 'copy-done', 'bitcast-convert'})
CONTROL = frozenset({'conditional', 'while', 'call'})
# The step's model runs under this name scope (flax's module name); what is outside is sampling.
MODEL_SCOPE = '/Llama/'
# The jitted call's dispatch on the Python thread: PjitFunction(step) for the jitted function,
# PjitFunction(jit(step)) for its compiled form (jaxlib 0.10).
STEP_CALL = re.compile(r'^PjitFunction\((jit\()?step\)?\)$')
EXECUTE = 'ThunkExecutor::Execute'
ITERATION = bench_decode.ITERATION  # the annotation of each traced engine step


# ------------------------------------------------------------------------------------------------
# The optimized HLO: what each instruction is
# ------------------------------------------------------------------------------------------------
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')
_OPCODE = re.compile(r'(?:^|\s)([a-z][a-z0-9\-]*)\(')
_DIMS = re.compile(r'[a-z]\d*\[([\d,]*)\]')


def parse_hlo(text: str) -> dict:
  """Optimized HLO text -> {instruction name: dict(opcode, operands (their text), dims (of its
  result, a list of tuples), target (a custom call's), op_name (its JAX name), opcodes (its own
  and, for a fusion, every fused computation's, recursively))}."""
  computations, current, called = {}, None, {}
  for line in text.splitlines():
    stripped = line.strip()
    if stripped.endswith('{') and '=' not in stripped.split('(')[0]:
      current = stripped.split()[1 if stripped.startswith('ENTRY') else 0].lstrip('%')
      computations[current] = []
      continue
    match = _INSTRUCTION.match(line)
    if current is None or not match:
      continue
    name, rhs = match.groups()
    opcode = _OPCODE.search(rhs)
    if not opcode:
      continue
    type_part = rhs[:opcode.start(1)]
    target = re.search(r'custom_call_target="([^"]*)"', rhs)
    op_name = re.search(r'op_name="([^"]*)"', rhs)
    calls = re.search(r'calls=%?([\w.\-]+)', rhs)
    depth, close = 1, len(rhs)
    for i in range(opcode.end(), len(rhs)):  # the operand list: to the matching ')'
      depth += {'(': 1, ')': -1}.get(rhs[i], 0)
      if depth == 0:
        close = i
        break
    info = dict(opcode=opcode.group(1), operands=rhs[opcode.end():close],
                dims=[tuple(int(d) for d in m.split(',') if d) for m in _DIMS.findall(type_part)],
                target=target.group(1) if target else None,
                op_name=op_name.group(1) if op_name else '')
    computations[current].append((name, info))
    if calls and info['opcode'] == 'fusion':
      called[name] = calls.group(1)

  def opcodes(computation, seen=()):
    out = set()
    for name, info in computations.get(computation, ()):
      out.add(info['opcode'])
      if name in called and called[name] not in seen:
        out |= opcodes(called[name], seen + (computation,))
    return out

  instructions = {}
  for computation, rows in computations.items():
    for name, info in rows:
      own = {info['opcode']}
      if name in called:
        own |= opcodes(called[name], (computation,))
      instructions[name] = dict(info, opcodes=frozenset(own))
  return instructions


def classify(info: dict, vocab_size: int, pool_dims=()) -> str:
  """The category (CATEGORIES) of one instruction of the step (parse_hlo's dict)."""
  opcodes, dims = info['opcodes'], info['dims']
  vocab_out = bool(dims) and bool(dims[0]) and dims[0][-1] == vocab_size
  if info['opcode'] == 'custom-call':
    if info['target'] == linear_cpu.TARGET:
      return 'head' if vocab_out else 'linear_kernel'
    if info['target'] == attention_cpu.TARGET:
      return 'attention'
    return 'other_ops'
  if opcodes & {'dot', 'convolution'}:
    return 'head' if vocab_out else 'linear_xla'
  if info['opcode'] in CONTROL:
    return 'other_ops'
  if info['op_name'] and MODEL_SCOPE not in info['op_name']:
    return 'sampling'
  if opcodes & {'scatter', 'dynamic-update-slice'} and (
      not pool_dims or any(d in pool_dims for d in dims)):
    return 'kv_write'
  if opcodes <= MOVEMENT or 'gather' in opcodes:  # a gather's index arithmetic is no compute
    return 'copies'
  if not info['op_name'] and any(d and d[-1] == vocab_size for d in dims):
    return 'sampling'
  return 'elementwise'


# ------------------------------------------------------------------------------------------------
# The trace: events, steps, attribution
# ------------------------------------------------------------------------------------------------
def trace_file(trace_dir: str) -> str:
  """The JSON trace jax.profiler wrote under trace_dir: perfetto_trace.json.gz
  (create_perfetto_trace), else a *.trace.json.gz."""
  found = sorted(glob.glob(os.path.join(trace_dir, 'plugins', 'profile', '*',
                                        'perfetto_trace.json.gz')))
  found = found or sorted(glob.glob(os.path.join(trace_dir, 'plugins', 'profile', '*',
                                                 '*.trace.json.gz')))
  if not found:
    raise RuntimeError(f'jax.profiler wrote no JSON trace under {trace_dir}')
  return found[-1]


def load_events(path: str) -> list:
  """The complete ('X') events of a Chrome/Perfetto JSON trace, by start time; Python-tracer
  frames ('$...') left out."""
  with gzip.open(path, 'rt') as f:
    data = json.load(f)
  events = data['traceEvents'] if isinstance(data, dict) else data
  events = [e for e in events if e.get('ph') == 'X' and 'ts' in e
            and not str(e.get('name', '')).startswith('$')]
  return sorted(events, key=lambda e: (float(e['ts']), -float(e.get('dur', 0))))


def _end(e) -> float:
  return float(e['ts']) + float(e.get('dur', 0))


def step_windows(events: list) -> list:
  """Per traced iteration (a `decode_iteration` annotation): dict(start, first_op, end,
  iteration_start, iteration_end, ops): the step from its dispatch to the end of its execution,
  and the ops (events naming an hlo_op) inside it. The execution is every ThunkExecutor::Execute
  event after the dispatch (the executor may hand the rest of a program to pool threads, each
  part an event of its own, the first returning at once, and wait for them: '... (wait for
  completion)'); first_op is its start, where dispatch ends."""
  iterations = [e for e in events if e['name'] == ITERATION]
  executions = [e for e in events if e['name'].startswith(EXECUTE)]
  ops = [e for e in events if isinstance(e.get('args'), dict) and 'hlo_op' in e['args']]
  windows = []
  for it in iterations:
    t0, t1 = float(it['ts']), _end(it)
    calls = [e for e in events if STEP_CALL.match(e['name']) and t0 <= float(e['ts']) <= t1]
    start = float(calls[0]['ts']) if calls else None
    runs = [e for e in executions if (start or t0) <= float(e['ts']) <= t1]
    if not runs:
      continue
    begin, end = min(float(e['ts']) for e in runs), max(_end(e) for e in runs)
    if start is None:  # no dispatch event: the window is the execution alone
      start = begin
    mine = [e for e in ops if begin <= float(e['ts']) <= end]
    windows.append(dict(start=start, first_op=begin, end=end, iteration_start=t0,
                        iteration_end=t1, ops=mine))
  return windows


def attribute(window: dict, category_of) -> tuple:
  """Every microsecond of the window [start, end] to one category -> ({category: µs},
  {op name: µs}). At each instant: the innermost running op of each thread (the latest to
  start), the instant split evenly among threads running one; none running: 'dispatch' before
  first_op, 'gaps' after. category_of(op event) -> category."""
  start, end, first_op = window['start'], window['end'], window['first_op']
  spans = []
  for e in window['ops']:
    a, b = max(start, float(e['ts'])), min(end, _end(e))
    if b > a:
      spans.append((a, b, e.get('tid'), e['args']['hlo_op'], category_of(e)))
  cuts = sorted({start, end, first_op, *[s[0] for s in spans], *[s[1] for s in spans]})
  cuts = [c for c in cuts if start <= c <= end]
  by_category = collections.Counter()
  by_op = collections.Counter()
  spans.sort()
  active, i = [], 0
  for a, b in zip(cuts, cuts[1:]):
    while i < len(spans) and spans[i][0] <= a:
      active.append(spans[i])
      i += 1
    active = [s for s in active if s[1] > a]
    running = [s for s in active if s[0] <= a and s[1] >= b]
    if not running:
      by_category['dispatch' if b <= first_op else 'gaps'] += b - a
      continue
    innermost = {}
    for s in running:  # later start = nested inside the earlier one on that thread
      if s[2] not in innermost or s[0] >= innermost[s[2]][0]:
        innermost[s[2]] = s
    share = (b - a) / len(innermost)
    for s in innermost.values():
      by_category[s[4]] += share
      by_op[s[3]] += share
  return dict(by_category), dict(by_op)


# ------------------------------------------------------------------------------------------------
# The engine: steady decode state, recorded step calls, the trace
# ------------------------------------------------------------------------------------------------
class RecordingStep:
  """A CompiledStep whose programs run in their ahead-of-time compiled form
  (`jit(...).lower(...).compile()`, jax.stages), one per input signature, so that the optimized
  HLO of the program a call ran is at hand without compiling it twice. Which program runs for a
  call, and with which params, is the wrapped step's choice; everything else is the wrapped
  step's too (its counters, with_topk, ...)."""

  def __init__(self, step: CompiledStep):
    self._step = step
    self._compiled = {}  # (program, signature) -> jax.stages.Compiled
    self.last = None  # the last call: its Compiled, its rows, the pool's array shapes

  def __getattr__(self, name):
    return getattr(self._step, name)

  def __call__(self, params, pool, inputs):
    unrolled = self._step.runs_unrolled(inputs)
    fn, args = self._step.program_for(params, pool, inputs)
    abstract = jax.tree.map(_abstract, args)
    key = (unrolled, jax.tree.structure(abstract), tuple(
        (a.shape, str(a.dtype), str(a.sharding)) for a in jax.tree.leaves(abstract)))
    if key not in self._compiled:
      self._compiled[key] = fn.lower(*abstract).compile()
    compiled = self._compiled[key]
    self.last = dict(compiled=compiled, rows=int(inputs.tokens.shape[0]),
                     pool_dims={tuple(x.shape) for x in jax.tree.leaves(pool)})
    return compiled(*args)

  def optimized_hlo(self) -> str:
    """The optimized HLO of the program the last call ran."""
    return self.last['compiled'].as_text()


def _abstract(x):
  sharding = getattr(x, 'sharding', None) if isinstance(x, jax.Array) else None
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def steady_decode(engine, prompts, steps_after: int, warmup_steps: int) -> None:
  """Submits the prompts, steps until every one is prefilled, then warmup_steps decode
  iterations (the decode program compiles in the first)."""
  bench_decode.start_decoding(engine, prompts, SamplingParams(
      max_new_tokens=warmup_steps + steps_after + 2, temperature=0.0, stop_on_eos=False))
  for _ in range(warmup_steps):
    engine.step()


def trace_steps(engine, steps: int, trace_dir: str) -> str:
  """`steps` decode iterations under jax.profiler, each in a `decode_iteration` annotation ->
  the JSON trace's path."""
  os.makedirs(trace_dir, exist_ok=True)
  options = getattr(jax.profiler, 'ProfileOptions', lambda: None)()
  if hasattr(options, 'python_tracer_level'):
    options.python_tracer_level = 0  # no Python frames: the host's own events stay
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options):
    for _ in range(steps):
      with jax.profiler.TraceAnnotation(ITERATION):
        engine.step()
  return trace_file(trace_dir)


def copy_bandwidth(megabytes: float, repeats: int = 3) -> float:
  """Bytes copied per second by numpy (each byte read once, written once), best of `repeats`."""
  src = np.ones(int(megabytes * 2**20) // 4, np.float32)
  dst = np.empty_like(src)
  best = float('inf')
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - t0)
  return src.nbytes / best


# A projection by its JAX name (.../layer_3/mlp/up_proj/...) or, where XLA dropped the name (its
# 1-row dots), by its weight operand (%params__params____layer_3____mlp____up_proj____kernel__).
PROJECTION = re.compile(r'(?<![a-z])(' + '|'.join(n for _, n in PROJECTIONS) + r')(?![a-z])')


def projection_floats(model_cfg) -> dict:
  """Weight floats of each projection, all layers together."""
  c = model_cfg
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  per = {'q_proj': c.d_model * q, 'k_proj': c.d_model * kv, 'v_proj': c.d_model * kv,
         'o_proj': q * c.d_model, 'gate_proj': c.d_model * c.ffn_dim,
         'up_proj': c.d_model * c.ffn_dim, 'down_proj': c.ffn_dim * c.d_model}
  return {name: c.num_layers * n for name, n in per.items()}


def by_projection(op_rows: list, model_cfg) -> dict:
  """The linear layers' traced time per projection (q/k/v/o, gate/up/down; all layers):
  {name: dict(ms, calls, us_per_call, gb_per_s)}, from the op rows' JAX names."""
  floats = projection_floats(model_cfg)
  out = {name: {'ms': 0.0, 'calls': 0.0} for name in floats}
  for o in op_rows:
    match = PROJECTION.search(o['jax_name']) or PROJECTION.search(o['operands'])
    if o['category'] in ('linear_kernel', 'linear_xla') and match:
      out[match.group(1)]['ms'] += o['us_per_step'] / 1e3
      out[match.group(1)]['calls'] += o['calls_per_step']
  for name, p in out.items():
    p['us_per_call'] = 1e3 * p['ms'] / p['calls'] if p['calls'] else None
    p['gb_per_s'] = 4 * floats[name] / (p['ms'] / 1e3) / 1e9 if p['ms'] else None
  return out


def matmul_shapes(model_cfg) -> dict:
  """Weight floats of the linear layers (all layers: projection_floats' sum) and of the head."""
  return {'linear': sum(projection_floats(model_cfg).values()),
          'head': model_cfg.vocab_size * model_cfg.d_model}


# ------------------------------------------------------------------------------------------------
# One batch
# ------------------------------------------------------------------------------------------------
def profile_batch(config, model_cfg, params, tokenizer, batch: int, workdir: str) -> tuple:
  """One batch: engine, steady state, trace, attribution, floor -> (row, op rows)."""
  prof = config.profile
  step = RecordingStep(CompiledStep(model_cfg, config.attention.impl,
                                    decode_layers=prof.decode_layers,
                                    linear_impl=prof.linear_impl))
  engine = factory.make_engine(config, model_cfg, params, tokenizer, step_fn=step)
  rng = np.random.default_rng(prof.seed + batch)
  prompts = [rng.integers(0, model_cfg.vocab_size, prof.prompt_len).tolist()
             for _ in range(batch)]
  steady_decode(engine, prompts, prof.steps, prof.warmup_steps)
  compiled_before = step.num_compilations
  first = len(engine.metrics.steps['device_s'])
  trace_dir = os.path.join(workdir, 'trace', f'B{batch}')
  path = trace_steps(engine, prof.steps, trace_dir)
  compiled_in_trace = step.num_compilations - compiled_before
  traced = {k: list(v)[first:] for k, v in engine.metrics.steps.items()}
  windows = step_windows(load_events(path))
  floor = timed_floor(model_cfg, params, batch, 'xla', prof.floor_calls)
  row = {'batch': batch, 'rows': step.last['rows'], 'traced_steps': len(windows),
         'op_events': sum(len(w['ops']) for w in windows),
         'compilations_in_trace': compiled_in_trace}
  step_ms = [(w['end'] - w['start']) / 1e3 for w in windows]
  # The engine's own figure for the same iterations (bench_decode's decode step: median device
  # plus host seconds per iteration, host/metrics.py), with the profiler running.
  decode_s = bench_decode.step_figures(traced)['decode_step_s']
  row['engine_step_ms'] = 1e3 * decode_s if decode_s is not None else None
  op_rows = []
  if row['op_events']:
    row['decomposition'] = 'traced'
    hlo_text = step.optimized_hlo()
    with run_info.atomic_write(os.path.join(trace_dir, 'step.hlo.txt')) as f:
      f.write(hlo_text)  # what the ops' names refer to
    totals, ops, row['unmatched_ops'] = decompose(
        windows, parse_hlo(hlo_text), model_cfg.vocab_size, step.last['pool_dims'])
    op_rows = [{'batch': batch, **o} for o in ops]
    row['projections'] = by_projection(ops, model_cfg)
    row['step_ms'] = statistics.fmean(step_ms)
  else:  # measured instead: the floor, and the rest of the step (traced, else the engine's)
    row['decomposition'] = 'measured (the trace held no per-op events)'
    row['step_ms'] = statistics.fmean(step_ms) if step_ms else row['engine_step_ms']
    totals = {'matmuls_floor': 1e3 * floor, 'rest': row['step_ms'] - 1e3 * floor}
  row['step_ms_min'] = min(step_ms) if step_ms else None
  row['step_ms_max'] = max(step_ms) if step_ms else None
  row['iteration_ms'] = statistics.fmean(
      (w['iteration_end'] - w['iteration_start']) / 1e3 for w in windows) if windows else None
  row['host_ms_outside_step'] = (row['iteration_ms'] - row['step_ms']) if windows else None
  for name, ms in totals.items():
    row[f'{name}_ms'] = ms
    row[f'{name}_share'] = ms / row['step_ms']
  row['floor_ms'] = 1e3 * floor
  kernel = linear_cpu.resolve(prof.linear_impl) in linear_cpu.KERNEL_IMPLS
  if prof.kernel_floor and kernel and linear_cpu.MIN_ROWS <= batch <= linear_cpu.MAX_ROWS:
    row['floor_ms_kernel'] = 1e3 * timed_floor(model_cfg, params, batch, 'cpu', prof.floor_calls)
  row['step_over_floor'] = row['step_ms'] / row['floor_ms'] if row['step_ms'] else None
  row.update(throughput(row, model_cfg, row['rows']))
  return row, op_rows


def decompose(windows: list, hlo: dict, vocab_size: int, pool_dims) -> tuple:
  """The traced steps' time by category and by op, means per step -> ({category: ms},
  [op rows: hlo_op, category, jax_name, opcode, us_per_step, calls_per_step], names of traced
  ops the HLO lacks, counted as other ops)."""
  category = {name: classify(info, vocab_size, pool_dims) for name, info in hlo.items()}
  unmatched = set()

  def category_of(e):
    name = e['args']['hlo_op']
    if name not in category:
      unmatched.add(name)
    return category.get(name, 'other_ops')

  parts = [attribute(w, category_of) for w in windows]
  n = len(parts)
  totals = {c: sum(p[0].get(c, 0.0) for p in parts) / n / 1e3 for c, _ in CATEGORIES}
  op_us, calls = collections.Counter(), collections.Counter()
  for (_, by_op), w in zip(parts, windows):
    op_us.update(by_op)
    calls.update(e['args']['hlo_op'] for e in w['ops'])
  op_rows = [{'hlo_op': name, 'category': category.get(name, 'other_ops'),
              'jax_name': hlo.get(name, {}).get('op_name', ''),
              'opcode': hlo.get(name, {}).get('opcode', ''),
              'operands': hlo.get(name, {}).get('operands', ''),
              'us_per_step': us / n, 'calls_per_step': calls[name] / n}
             for name, us in op_us.most_common()]
  return totals, op_rows, sorted(unmatched)


def timed_floor(model_cfg, params, batch: int, impl: str, calls: int) -> float:
  """bench_decode's matmul floor at `batch` rows: seconds per call, median of `calls` after
  one call that compiles it."""
  fn = bench_decode.matmul_floor_fn(model_cfg, params, batch, impl)
  jax.block_until_ready(fn())
  return bench_decode.time_calls(fn, calls)


def throughput(row: dict, model_cfg, rows: int) -> dict:
  """Weight GB/s read and GFLOP/s of the traced matmuls (linear layers, head, both) and of the
  floor: weights read once per step, 2 * rows FLOPs per weight."""
  floats = matmul_shapes(model_cfg)
  both = floats['linear'] + floats['head']
  traced = 'linear_kernel_ms' in row
  spans = {  # name -> (ms, weight floats read)
      'linear': (row['linear_kernel_ms'] + row['linear_xla_ms'] if traced else None,
                 floats['linear']),
      'head': (row['head_ms'] if traced else None, floats['head']),
      'matmuls': (sum(row[f'{c}_ms'] for c in MATMULS) if traced else None, both),
      'floor': (row['floor_ms'], both)}
  out = {'weight_mb': 4 * both / 1e6}
  for name, (ms, n) in spans.items():
    ok = ms is not None and ms > 0
    out[f'{name}_gb_per_s'] = 4 * n / (ms / 1e3) / 1e9 if ok else None
    out[f'{name}_gflop_per_s'] = 2 * rows * n / (ms / 1e3) / 1e9 if ok else None
  return out


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------
def categories_of(rows: list) -> list:
  """(name, words) of the categories the rows carry, in CATEGORIES (or FALLBACK) order."""
  names = CATEGORIES + FALLBACK
  return [(c, w) for c, w in names if any(f'{c}_ms' in r for r in rows)]


def table(rows: list, copy_gb_per_s: float) -> str:
  """Categories down, batches across: ms per step and share; then step, floor, throughput."""
  f = lambda v, spec: '' if v is None else format(v, spec)
  head = '| ms per step (share) | ' + ' | '.join(f"batch {r['batch']}" for r in rows) + ' |'
  lines = [head, '|---|' + '---|' * len(rows)]
  for c, words in categories_of(rows):
    lines.append(f'| {words} | ' + ' | '.join(
        f"{f(r.get(f'{c}_ms'), '.2f')} ({f(r.get(f'{c}_share') and 100 * r[f'{c}_share'], '.1f')}%)"
        for r in rows) + ' |')
  extra = [('**traced step**', 'step_ms', '.2f'),
           ('engine decode step, its own clock', 'engine_step_ms', '.2f'),
           ('engine host work outside the step', 'host_ms_outside_step', '.2f'),
           ('matmul floor, XLA dots', 'floor_ms', '.2f'),
           ('matmul floor, native kernel', 'floor_ms_kernel', '.2f'),
           ('step / floor', 'step_over_floor', '.2f'),
           ('step if the matmuls read weights at the copy rate', 'step_ms_if_matmuls_at_copy_rate',
            '.2f'),
           ('linear layers: weight GB/s', 'linear_gb_per_s', '.1f'),
           ('linear layers: GFLOP/s', 'linear_gflop_per_s', '.1f'),
           ('head: weight GB/s', 'head_gb_per_s', '.1f'),
           ('all matmuls: weight GB/s', 'matmuls_gb_per_s', '.1f'),
           ('floor: weight GB/s', 'floor_gb_per_s', '.1f')]
  for words, key, spec in extra:
    if any(r.get(key) is not None for r in rows):
      lines.append(f'| {words} | ' + ' | '.join(f(r.get(key), spec) for r in rows) + ' |')
  lines.append('')
  lines.append(f'Memory copy (numpy, bytes copied per second): {copy_gb_per_s:.1f} GB/s; '
               f'weights read per step: {rows[0]["weight_mb"]:.1f} MB.')
  notes = [f"batch {r['batch']}: {r['decomposition']}" for r in rows
           if r['decomposition'] != 'traced']
  notes += [f"batch {r['batch']}: {r['compilations_in_trace']} compilation(s) inside the trace"
            for r in rows if r['compilations_in_trace']]
  notes += [f"batch {r['batch']}: ops not in the HLO, counted as other ops: "
            f"{', '.join(r['unmatched_ops'][:5])}" for r in rows if r.get('unmatched_ops')]
  with_projections = [r for r in rows if r.get('projections')]
  if with_projections:
    lines += ['', 'Linear layers by projection (all layers; ms per step, µs per call, weight '
              'GB/s):', '',
              '| projection | ' + ' | '.join(f"batch {r['batch']}" for r in with_projections)
              + ' |', '|---|' + '---|' * len(with_projections)]
    for name in with_projections[0]['projections']:
      cells = []
      for r in with_projections:
        p = r['projections'][name]
        cells.append(f"{p['ms']:.2f} ms, {f(p['us_per_call'], '.0f')} µs, "
                     f"{f(p['gb_per_s'], '.1f')} GB/s")
      lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines + notes)


def plot(path: str, rows: list, title_note: str) -> None:
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(8, 4.5))
  labels = [f"batch {r['batch']}" for r in rows]
  x = np.arange(len(rows))
  bottom = np.zeros(len(rows))
  cmap = plt.get_cmap('tab20')
  bars, lines = [], []  # legend handles
  for i, (c, words) in enumerate(categories_of(rows)):
    ms = np.array([r.get(f'{c}_ms') or 0.0 for r in rows])
    if not ms.any():
      continue
    bars.append(ax.bar(x, ms, 0.6, bottom=bottom, label=words, color=cmap(i)))
    bottom += ms
  floors = [('floor_ms', 'black', 'matmul floor, XLA dots (timed alone)'),
            ('floor_ms_kernel', 'tab:red', 'matmul floor, native kernel (timed alone)')]
  for key, color, label in floors:
    ms = [r.get(key) for r in rows]
    if any(m is not None for m in ms):
      at = [i for i, m in enumerate(ms) if m is not None]
      lines.append(ax.hlines([ms[i] for i in at], [i - 0.36 for i in at], [i + 0.36 for i in at],
                             colors=color, linewidths=2, zorder=3, label=label))
  ax.set_xticks(x)
  ax.set_xticklabels(labels)
  ax.set_ylabel('time per decode step (ms)')
  ax.set_title('Where a decode step\'s time goes (jax.profiler, mean of traced steps)'
               + title_note, fontsize=9)
  ax.set_ylim(bottom=0)
  handles = bars[::-1] + lines  # the categories as stacked, top first; then the floors
  ax.legend(handles, [h.get_label() for h in handles], loc='upper left',
            bbox_to_anchor=(1.01, 1.0), fontsize=8, title='category', title_fontsize=8,
            borderaxespad=0)
  plots.save(fig, path)


def check(config) -> None:
  """config.profile's fields, refused as one line each."""
  cli.check_fields(config, 'profile', batches=cli.list_of(cli.POSITIVE_INT),
                   prompt_len=cli.POSITIVE_INT, warmup_steps=cli.POSITIVE_INT,
                   steps=cli.POSITIVE_INT, floor_calls=cli.POSITIVE_INT,
                   linear_impl=cli.one_of(linear_cpu.LINEAR_IMPLS),
                   decode_layers=cli.one_of(DECODE_LAYERS), kernel_floor=cli.BOOL,
                   copy_mb=cli.POSITIVE, seed=cli.INT)
  typed = Config.from_configdict(config)
  prof = config.profile
  if max(prof.batches) > typed.engine.max_batch_size:
    raise ConfigError(f'config.profile.batches={tuple(prof.batches)} is not allowed: batch sizes '
                      f'up to engine.max_batch_size={typed.engine.max_batch_size}')
  need = prof.prompt_len + prof.warmup_steps + prof.steps + 2
  if need > typed.engine.max_seq_len:
    raise ConfigError(f'config.profile.prompt_len={prof.prompt_len} is not allowed: prompt_len '
                      f'+ warmup_steps + steps + 2 = {need} must be at most engine.max_seq_len='
                      f'{typed.engine.max_seq_len}')
  if typed.mesh.model > 1:
    raise ConfigError(f'config.mesh.model={typed.mesh.model} is not allowed: the profile runs '
                      'on one device (1)')
  try:
    linear_cpu.resolve(prof.linear_impl)
  except RuntimeError as e:
    raise ConfigError(f'config.profile.linear_impl: {e}') from None
  cli.check_model_path(typed)


def study(config, workdir: str) -> dict:
  prof = config.profile
  model_cfg, params, tokenizer = factory.load_model_and_tokenizer(config)
  rows, op_rows = [], []
  for batch in cli.progress(sorted(set(int(b) for b in prof.batches)), desc='profile_decode'):
    row, ops = profile_batch(config, model_cfg, params, tokenizer, batch, workdir)
    rows.append(row)
    op_rows += ops
  copy_gb = copy_bandwidth(prof.copy_mb) / 1e9
  for r in rows:
    for name in ('linear', 'head', 'matmuls', 'floor'):
      gb = r.get(f'{name}_gb_per_s')
      r[f'{name}_share_of_copy_bandwidth'] = gb / copy_gb if gb else None
    # What the step would take with every other part as traced and the matmuls reading their
    # weights at the memory copy's rate: how far faster matmuls alone could take it.
    if r['decomposition'] == 'traced':
      matmul_ms = sum(r[f'{c}_ms'] for c in MATMULS)
      r['step_ms_if_matmuls_at_copy_rate'] = (r['step_ms'] - matmul_ms
                                              + r['weight_mb'] / 1e3 / copy_gb * 1e3)
  text = table(rows, copy_gb)
  cli.write_table(workdir, text)
  summary = {
      'title': 'Where a decode step\'s time goes' + cli.variant_note(config),
      'model': config.model.source if config.model.source != 'random' else 'random-tiny',
      'model_config': model_cfg.__dict__,
      'attention_impl': bench_decode.attention_impl(config.attention.impl),
      'linear_impl': linear_cpu.resolve(prof.linear_impl),
      'categories': dict(categories_of(rows)),
      'copy_gb_per_s': copy_gb,
      'rows': rows,
      'top_ops': {r['batch']: [o for o in op_rows if o['batch'] == r['batch']][:15]
                  for r in rows},
      'markdown_table': text,
      **run_info.summary_fields(config),
  }
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  run_info.write_csv(os.path.join(workdir, 'results.csv'), rows)
  if op_rows:
    run_info.write_csv(os.path.join(workdir, 'ops.csv'), op_rows)
  plot(os.path.join(workdir, 'profile_decode.png'), rows, cli.variant_note(config))
  return summary


if __name__ == '__main__':
  cli.run_study('configs/profile_decode.py', 'Decode profile config.', study, check=check)
