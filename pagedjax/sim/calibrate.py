"""Calibration: fit the cost model to the real jitted step on this machine, then check the
simulator against a real engine run.

  measure_peaks   this machine's matmul FLOP/s and memory bandwidth (jitted float32): the
                  "spec sheet" the CPU profile's efficiencies are shares of
  step_grid       the step calls to profile: every (rows, tokens, table width) bucket the
                  validation engine can use, each at a few contexts and fill levels
  profile_steps   times each call as the executor does (call, then read the tokens back),
                  warm (every shape compiled first), rounds in shuffled order so that load
                  changes on a shared machine hit every point alike; the median per point
  profile_host    the host's own time per iteration (scheduler, bookkeeping, building inputs):
                  the real engine with a step that computes nothing, every request arriving
                  at once so that batches of every size occur; least squares on rows
  fit             least squares on log(predicted / measured) over the efficiency factors
  run_recorded    a real engine run on a trace, keeping each iteration's step shapes and time
  compare_runs    that run vs the cost model's prediction of each of its iterations (teacher
                  forced: same shapes) and vs a free simulation of the same trace (end to end)

The CPU profile's attention model is 'batch_max' (kernels/xla.py walks each of its batch
loops to the loop's longest context; kernels/xla_loops.py). Of the fixed overheads, `step_overhead_s` (every call) and
`chunk_overhead_s` (prompt-chunk calls only) are fitted: with one model, a per-call and a
per-layer constant cannot be told apart. Why the second: small prompt chunks (few rows, many
tokens: small-M matmuls) run slower than the roofline that fits larger calls, and one constant
shared with decode would absorb that and over-predict the decode calls that make up most of a
serving run. The fit's residuals with one constant and with two: docs/simulation.md.
"""
import dataclasses
import math
import os
import platform
import time
from typing import Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import sizing
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.scheduling.step_inputs import RowSpec, build_step_inputs
from pagedjax.sim import simulated_device
from pagedjax.sim.cost_model import CostModel, StepShape
from pagedjax.sim.hardware import Efficiency, Hardware

FIT_FIELDS = ('matmul_flops', 'weight_bandwidth', 'attention_flops', 'kv_bandwidth',
              'elementwise_bandwidth', 'step_overhead_s', 'chunk_overhead_s')


# ---- this machine's peaks -------------------------------------------------------------------

def _best_time(fn, *args, rounds: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return min(times)  # the least disturbed round: a peak, not a typical figure


def measure_peaks(rounds: int = 5, matmul=(256, 1024, 4096), copy_mb: int = 256) -> dict:
  """Float32 matmul FLOP/s ([m, k] x [k, n]) and memory bandwidth (read + write of an array)."""
  m, k, n = matmul
  a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
  mm = jax.jit(lambda x, y: x @ y)
  flops = 2 * m * k * n / _best_time(mm, a, b, rounds=rounds)
  # Donated, so the output reuses the input's pages: a fresh 256 MB output would time the
  # kernel's page faults, not the memory.
  scale = jax.jit(lambda v: v * 1.0001, donate_argnums=0)
  x = scale(jnp.ones((copy_mb * 2**20 // 4,), jnp.float32))
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    x = jax.block_until_ready(scale(x))
    times.append(time.perf_counter() - t0)
  return {'peak_flops': flops, 'bandwidth': 2 * x.nbytes / min(times)}


def cpu_hardware(peaks: dict, efficiency: Efficiency = Efficiency()) -> Hardware:
  """This machine as a Hardware: measured peaks; RAM as its memory; a swap is a RAM copy."""
  ram = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  bw = peaks['bandwidth']
  return Hardware(
      f'CPU ({platform.machine()}, {os.cpu_count()} cores)', hbm_bytes=ram, hbm_bandwidth=bw,
      peak_flops=peaks['peak_flops'], host_link_bandwidth=bw, interconnect_bandwidth=bw,
      efficiency=efficiency, attention_reads='batch_max', calibrated=True,
      source='measured on this machine (pagedjax.sim.calibrate.measure_peaks), float32')


# ---- the grid of step calls -----------------------------------------------------------------

@dataclasses.dataclass
class GridPoint:
  kind: str  # 'prefill' or 'decode'
  rows: List[tuple]  # (new tokens, context after) per real row


def step_grid(executor, max_num_batched_tokens: int, prefill_chunk: int,
              fills=(0.5, 1.0)) -> List[GridPoint]:
  """Calls covering every shape bucket of an engine's executor (executor.py's buckets):
  decode calls per (rows, table width) bucket, prompt-chunk calls per (rows, width) bucket, each
  with `fills` of its rows real, at the bucket's shortest and longest context and with
  contexts spread over it (as a serving batch has). A fill that lands in a smaller bucket (half
  of 2 rows is 1 row) repeats another point: each call is kept once, so that no shape weighs
  more than another in the fit by accident (repeats made 1-row prompt chunks 12 of 64 points)."""
  bs = executor.block_size
  widths = executor.table_width_buckets
  points = []
  for w_lo, w in zip([0] + widths[:-1], widths):
    lo, hi = max(w_lo * bs + 1, bs), w * bs
    for batch in executor.decode_batch_buckets:
      for fill in fills:
        n = max(1, round(batch * fill))
        for ctxs in ([lo] * n, [hi] * n, np.linspace(lo, hi, n).round().astype(int).tolist()):
          points.append(GridPoint('decode', [(1, int(c)) for c in ctxs]))
    for batch in executor.batch_buckets:
      for fill in fills:
        n = max(1, round(batch * fill))
        # The token budget shared out: whole chunks for a few rows, short prompts for many.
        q = min(prefill_chunk, max(1, max_num_batched_tokens // n))
        for end in (lo, hi):
          points.append(GridPoint('prefill', [(q, max(q, end))] * n))
  unique = {(p.kind, tuple(p.rows)): p for p in points}
  return list(unique.values())


def grid_inputs(point: GridPoint, executor, vocab_size: int, rng: np.random.Generator):
  """The StepInputs the executor would build for these rows."""
  bs, num_blocks = executor.block_size, executor.blocks.allocator.num_blocks
  specs, used = [], 0
  for q, ctx in point.rows:
    # Consecutive block ids, wrapping past the pool's end (never the null block): the engine's
    # own pool, so its compiled programs serve the run that follows.
    table = [1 + (used + i) % (num_blocks - 1) for i in range(math.ceil(ctx / bs))]
    used += len(table)
    specs.append(RowSpec(rng.integers(0, vocab_size, q).tolist(), ctx - q, table))
  buckets = executor.decode_batch_buckets if point.kind == 'decode' else executor.batch_buckets
  return build_step_inputs(specs, bs, buckets, executor.token_buckets,
                           executor.table_width_buckets)


def _timed_call(executor, inputs) -> float:
  t0 = time.perf_counter()
  out = executor.step_fn(executor.params, executor.pool, inputs)
  np.asarray(out[1])  # as the executor does: the call ends when the tokens are back
  executor.pool = out[0]
  return time.perf_counter() - t0


def compile_shapes(executor, inputs, progress: Callable[[str], None] = lambda s: None) -> None:
  """One call per distinct shape among `inputs` (StepInputs), so later calls compile nothing."""
  seen = set()
  for x in inputs:
    key = (x.tokens.shape, x.block_tables.shape)
    if key not in seen:
      seen.add(key)
      progress(f'compiling shape {len(seen)} (rows, tokens, table width) = '
               f'{x.tokens.shape + x.block_tables.shape[1:]}')
      _timed_call(executor, x)


def profile_steps(executor, points: Sequence[GridPoint], vocab_size: int, rounds: int = 5,
                  seed: int = 0, progress: Callable[[str], None] = lambda s: None,
                  between_rounds: Callable[[int], None] = lambda r: None) -> List[dict]:
  """Median wall time of each point's call on the executor's own step, params and pool. Every
  shape is compiled first. between_rounds(r) runs after round r: other measurements placed
  there share the rounds' machine load (a validation run, interleaved)."""
  rng = np.random.default_rng(seed)
  inputs = [grid_inputs(p, executor, vocab_size, rng) for p in points]
  compile_shapes(executor, inputs, progress)
  times = [[] for _ in points]
  for r in range(rounds):
    progress(f'round {r + 1}/{rounds} of {len(points)} calls')
    for i in rng.permutation(len(points)):
      times[i].append(_timed_call(executor, inputs[i]))
    between_rounds(r)
  return [{'kind': p.kind, 'shape': StepShape.from_inputs(x), 'seconds': float(np.median(t)),
           'repeat_mad': float(np.median(np.abs(np.asarray(t) - np.median(t))) / np.median(t)),
           'all_seconds': t} for p, x, t in zip(points, inputs, times)]


# ---- host time ------------------------------------------------------------------------------

class NullStep:
  """A step that computes nothing (every row samples token 1): what remains of an engine
  iteration's wall time is the host's."""
  return_logits = False
  num_compilations = 0

  def __init__(self):
    self.rows = []  # real rows of every call

  def with_topk(self, k):
    raise ValueError('profile_host runs no beam search')

  def __call__(self, params, pool, inputs):
    self.rows.append(int((inputs.context_lens > 0).sum()))
    return pool, np.ones(len(inputs.context_lens), np.int32)


def profile_host(make_engine: Callable, trace) -> dict:
  """Host seconds per iteration against batch rows, from the real engine (make_engine(step_fn)
  -> Engine) with a NullStep replaying `trace`: least squares for a + b * rows.

  Every request arrives at 0: a NullStep takes no time, so the engine clock would barely move
  and at the trace's own arrival times every request would run alone (one row in every
  iteration, and a and b could not be told apart). Arriving at once, the batch fills to the
  engine's limit and drains, so every batch size is seen."""
  step = NullStep()
  engine = make_engine(step)
  submit(engine, [dataclasses.replace(r, arrival_time=0.0) for r in trace])
  rows, host = [], []
  while engine.has_work():
    n_iter, n_calls = len(engine.metrics.steps['t']), len(step.rows)
    engine.step()
    if len(engine.metrics.steps['t']) > n_iter:
      rows.append(sum(step.rows[n_calls:]))
      host.append(engine.metrics.steps['host_s'][-1])
  if len(set(rows)) > 1:
    a = np.stack([np.ones(len(rows)), np.asarray(rows, float)], axis=1)
    (base, per_row), *_ = np.linalg.lstsq(a, np.asarray(host), rcond=None)
  else:  # one batch size only (a trace no larger than a batch): no slope to fit
    base, per_row = float(np.mean(host)), 0.0
  return {'iteration_overhead_s': max(0.0, float(base)), 'row_overhead_s': max(0.0, float(per_row)),
          'iterations': len(rows), 'median_host_s': float(np.median(host)),
          'rows_seen': sorted(set(rows))}


# ---- fitting --------------------------------------------------------------------------------

def fit(shape: sizing.ModelShape, hardware: Hardware, samples: Sequence[dict], *,
        kv_bytes_per_token: float, block_size: int, weight_dtype: str = 'fp32',
        activation_dtype: str = 'fp32', fields: Sequence[str] = FIT_FIELDS) -> tuple:
  """(hardware with fitted efficiency, report): least squares on log(predicted / measured) of
  every sample's step time over `fields`, from several starting points (time is a max of
  terms, so the loss has kinks and local minima)."""
  from scipy import optimize  # pylint: disable=g-import-not-at-top  (jax depends on scipy)
  shapes = [s['shape'] for s in samples]
  measured = np.log([s['seconds'] for s in samples])
  share = [not f.endswith('_s') for f in fields]
  lower = np.log([1e-4 if s else 1e-7 for s in share])
  upper = np.log([1.5 if s else 1.0 for s in share])

  def model(x) -> CostModel:
    hw = hardware.with_efficiency(**dict(zip(fields, np.exp(x).tolist())))
    return CostModel(shape, hw, kv_bytes_per_token=kv_bytes_per_token, block_size=block_size,
                     weight_dtype=weight_dtype, activation_dtype=activation_dtype)

  def residuals(x):
    m = model(x)
    return np.log([m.step_time(s) for s in shapes]) - measured

  best = None
  for start_share, start_overhead in ((0.5, 1e-3), (0.1, 1e-2), (0.9, 1e-4), (0.2, 1e-3)):
    x0 = np.log([start_share if s else start_overhead for s in share])
    res = optimize.least_squares(residuals, x0, bounds=(lower, upper), diff_step=1e-3)
    if best is None or res.cost < best.cost:
      best = res
  fitted = model(best.x).hw
  errors = np.exp(residuals(best.x)) - 1
  report = {'fitted': {f: getattr(fitted.efficiency, f) for f in fields},
            'median_abs_error': float(np.median(np.abs(errors))),
            'max_abs_error': float(np.max(np.abs(errors))), 'points': len(samples),
            'errors': errors.tolist()}
  return fitted, report


# ---- validation -----------------------------------------------------------------------------

class RecordingStep:
  """Wraps an engine's step to keep the StepShape and the wall time of every call. The call is
  timed as the executor times it (to the sampled tokens on the host), which the executor does
  right after anyway, so its own figure does not change."""

  def __init__(self, step):
    self.step, self.shapes, self.seconds = step, [], []
    self.return_logits = step.return_logits

  @property
  def num_compilations(self):
    return self.step.num_compilations

  def with_topk(self, k):
    raise ValueError('validation runs no beam search')

  def __call__(self, params, pool, inputs):
    self.shapes.append(StepShape.from_inputs(inputs))
    t0 = time.perf_counter()
    out = self.step(params, pool, inputs)
    np.asarray(out[1])
    self.seconds.append(time.perf_counter() - t0)
    return out


def submit(engine, trace) -> None:
  """Every request ignores EOS and generates its trace length (as serving benchmarks do)."""
  for r in trace:
    engine.submit(r.prompt_ids, SamplingParams(max_new_tokens=r.max_new_tokens,
                                               stop_on_eos=False), arrival_time=r.arrival_time)


def run_recorded(engine, trace) -> dict:
  """Runs the trace; returns the summary and, per iteration, its step shapes and its measured
  time on the engine clock (host + device; iterations that compiled are flagged)."""
  rec = RecordingStep(engine.executor.step_fn)
  engine.executor.step_fn = rec
  submit(engine, trace)
  iterations = []
  t0 = time.perf_counter()
  while engine.has_work():
    n_iter, n_calls = len(engine.metrics.steps['t']), len(rec.shapes)
    engine.step()
    if len(engine.metrics.steps['t']) > n_iter:
      s = engine.metrics.steps
      iterations.append({'shapes': rec.shapes[n_calls:], 'call_s': rec.seconds[n_calls:],
                         'host_s': s['host_s'][-1], 'device_s': s['device_s'][-1],
                         'compiled': s['compile_s'][-1] > 0})
  return {'summary': engine.summary(), 'iterations': iterations,
          'wall_s': time.perf_counter() - t0}


def iteration_records(cost: CostModel, iterations: Sequence[dict]) -> List[dict]:
  """One flat row per measured iteration: measured and predicted seconds (host, device, total)
  and per call (prefill chunks, decodes) its padded and real sizes, contexts, and measured and
  predicted seconds; what iterations_run{i}.csv holds, for analysis offline."""
  records = []
  for i, it in enumerate(iterations):
    rows = sum(int((s.context_lens > 0).sum()) for s in it['shapes'])
    calls = [cost.step_time(s) for s in it['shapes']]
    rec = {'iteration': i, 'compiled': bool(it['compiled']), 'real_rows': rows,
           'measured_s': it['host_s'] + it['device_s'], 'predicted_s': 0.0,
           'measured_host_s': it['host_s'], 'predicted_host_s': cost.host_time(rows),
           'measured_device_s': it['device_s'], 'predicted_device_s': sum(calls)}
    rec['predicted_s'] = rec['predicted_host_s'] + rec['predicted_device_s']
    measured_calls = it.get('call_s') or [None] * len(calls)
    for kind in ('prefill', 'decode'):  # empty columns for a call the iteration did not make
      rec.update({f'{kind}_{k}': '' for k in (
          'rows', 'tokens_per_row', 'real_rows', 'real_tokens', 'max_context', 'measured_s',
          'predicted_s', 'q_lens', 'context_lens')})
    for shape, measured, predicted in zip(it['shapes'], measured_calls, calls):
      kind = 'prefill' if shape.tokens_per_row > 1 else 'decode'
      real = shape.context_lens > 0
      rec.update({
          f'{kind}_rows': shape.rows, f'{kind}_tokens_per_row': shape.tokens_per_row,
          f'{kind}_real_rows': int(real.sum()), f'{kind}_real_tokens': int(shape.q_lens.sum()),
          f'{kind}_max_context': int(shape.context_lens.max()),
          f'{kind}_measured_s': '' if measured is None else measured,
          f'{kind}_predicted_s': predicted,
          f'{kind}_q_lens': ' '.join(map(str, shape.q_lens[real])),
          f'{kind}_context_lens': ' '.join(map(str, shape.context_lens[real]))})
    records.append(rec)
  return records


def iteration_errors(cost: CostModel, iterations: Sequence[dict]) -> dict:
  """The cost model's prediction of each measured iteration (same shapes), relative error;
  `records` holds every iteration's row (iteration_records), compiling ones included."""
  records = iteration_records(cost, iterations)
  timed = [r for r in records if not r['compiled']]
  pred = np.asarray([r['predicted_s'] for r in timed])
  meas = np.asarray([r['measured_s'] for r in timed])
  err = pred / meas - 1
  dev_err = (np.asarray([r['predicted_device_s'] for r in timed]) /
             np.asarray([r['measured_device_s'] for r in timed]) - 1)
  return {'iterations_compared': len(timed),
          'iterations_skipped_compiling': len(records) - len(timed),
          'median_abs_error': float(np.median(np.abs(err))),
          'p90_abs_error': float(np.percentile(np.abs(err), 90)),
          'mean_signed_error': float(np.mean(err)),
          'device_median_abs_error': float(np.median(np.abs(dev_err))),
          'device_mean_signed_error': float(np.mean(dev_err)),
          'measured_total_s': float(np.sum(meas)), 'predicted_total_s': float(np.sum(pred)),
          'predicted': pred.tolist(), 'measured': meas.tolist(), 'records': records}


END_TO_END = ('generated_tokens_per_s', 'ttft_p50_s', 'tpot_p50_s', 'normalized_latency_s',
              'duration_s', 'iterations', 'preemptions', 'mean_concurrent_sequences')


def compare_runs(real: dict, simulated: dict) -> Dict[str, dict]:
  """Figure -> measured, simulated and the simulated / measured - 1 error."""
  out = {}
  for key in END_TO_END:
    m, s = real.get(key), simulated.get(key)
    err = s / m - 1 if isinstance(m, (int, float)) and m and s is not None else None
    out[key] = {'measured': m, 'simulated': s, 'error': err}
  return out


def simulate_trace(shape: sizing.ModelShape, hardware: Hardware, config, trace, *,
                   weight_dtype: str, activation_dtype: str,
                   eos_id: Optional[int] = None) -> dict:
  """A free simulation of the trace: the engine's summary, simulated seconds."""
  engine = simulated_device.simulated_engine(shape, hardware, config, weight_dtype=weight_dtype,
                                             activation_dtype=activation_dtype, eos_id=eos_id)
  submit(engine, trace)
  t0 = time.perf_counter()
  engine.run()
  return {'summary': engine.summary(), 'wall_s': time.perf_counter() - t0, 'engine': engine}
