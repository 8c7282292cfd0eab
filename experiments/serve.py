"""Routers live on Ray Serve: N pagedjax engine replicas behind each router, the same requests
over HTTP; prefix hit rate and TTFT per router, and the simulated cluster on the same requests.

  python -m experiments.serve --workdir=runs/serve
  python -m experiments.serve --config=configs/serve.py:tiny --workdir=/tmp/serve

Per router row (configs/serve.py): a fresh deployment (pagedjax/cluster/serve.py:
ServeDeployment, caches cold, Ray on 127.0.0.1 only), the requests replayed at their arrival
times (streamed, greedy, ignore_eos, at most serve.concurrency in flight), then each replica's
engine figures. TTFT is wall time from a request's scheduled arrival to its first streamed
event, on this machine under its load (recorded): compare routers within one run, not with
other machines. Each request's TTFT is split into stages by wall-clock stamps along its path
(pagedjax/cluster/serve.py STAGES: its wait for a free connection, the proxy, the ingress, the
router and its bus pull, the replica, the engine's queue and prompt steps, the way back), and
each replica runs every step shape the requests can reach before it takes traffic
(serve.warm_shapes: without it, replicas compiled during the replay and requests waited
seconds). The serving path is `path_p50_s` (the median over the replay's requests of the
TTFT less the stages the simulated cluster has too: the wait for a connection and the
engine's) and `idle_ttft_s` (the median TTFT of a 3-token request on the idle deployment,
sent before the replay). The hit rate (prompt tokens found in
the replicas' prefix caches) depends on where requests went and in what order they ran, so on
the machine's speed only through how busy each replica is at each arrival (what the routers'
load terms see).
Every request's greedy tokens are compared with one engine's (all requests in one generate
call in this process, which also fills the replicas' compilation cache first).

With serve.simulate, the pagedjax router rows are also replayed on the simulated cluster
(pagedjax/cluster/sim.py: the same engine host code, the same per-replica pool, the same
arrival times and at most serve.concurrency requests in flight, as the live client sends
them). Its device is serve.sim_hardware: 'calibrate' (the default) fits this machine's cost
model for the replicas' own model and engine config before the live runs (as
`experiments.simulate --calibrate` does: this CPU's peaks, the host's time per iteration, the
real jitted step timed over every shape bucket the replicas can use, then the fit;
WORKDIR/hardware_profile.json, with a validation: one real engine on the study's requests
against its simulation), a profile .json such a calibration wrote, or a preset name (an H100
answers the tiny model in milliseconds: its replicas are idle at every arrival, and neither
hit rates nor TTFT are comparable with this machine's). Per router: hit rate live and
simulated and their difference, TTFT p50 live and simulated and their ratio, and the same
ratio with the serving path added to the simulated figure (idle_ttft_s or path_p50_s: the
simulated cluster has no HTTP, proxy, ingress or replica call).

The simulated replicas share one machine as the live ones do (SimulatedCluster's
machine_share), by serve.sim_share_from:
  'steps'  (the default) the share at which the simulated replicas spend in their iterations
           the seconds the live ones measured of their own iterations during the replay
           (`replica_busy_s` against `sim_busy_s`; found by bisection over replays of the
           simulated cluster): the live step's speed, whatever slowed it (the other serving
           processes, the replicas' threads and actor calls, the machine's own drift)
  'cpu'    the part of this machine the live replicas had: the CPU every other process took
           during the replay, `serving_cores`, read from /proc, left out
  'fixed'  serve.sim_machine_share
With serve.sim_share_band b (0.1), the replay also runs at shares share * (1 + p b), p in
BAND_POINTS: `sim_hit_rate_lo` / `_hi` are the hit rates' range over them, and
`live_in_sim_band` says whether the live hit rate is within a point of that range
(BAND_TOLERANCE).

`--config.serve.replay_from=DIR` runs the simulated half alone again, against the live figures
and the calibrated device an earlier run wrote to DIR (no Ray, seconds): for changing the
simulator (sim_share_from, sim_machine_share, sim_time_scale, a router's kwargs) and comparing
with the same live run (replay_study).

Writes to WORKDIR:
  requests.csv   per router and request: replica, status, TTFT, latency, tokens, attempts,
                 TTFT's stages (s), its serving path, the compile seconds its replica spent
                 between its submission and its first token
  routers.csv    per router: live and simulated figures
  hardware_profile.json  this machine's fitted cost model (serve.sim_hardware='calibrate')
  table.md       the routers table, live against simulated, and each stage's mean per router
  serve.png      hit rate (live, simulated) and TTFT p50/p90 per router
  summary.json   everything above, the load averages at start and end, start times, config,
                 versions, git state
"""
import concurrent.futures
import dataclasses
import json
import logging
import os
import time
from typing import Optional

import numpy as np

from experiments import cli
from experiments import cpu_time
from pagedjax import factory, sizing
from pagedjax.studies import run_info
from pagedjax.studies import workloads
from pagedjax.cluster import routers as routers_lib
from pagedjax.cluster import serve as serve_lib
from pagedjax.cluster.sim import ClusterRequest, SimulatedCluster
from pagedjax.config import Config, ConfigError

STAGE_COLUMNS = tuple(f'{name}_s' for name, _, _ in serve_lib.STAGES)
# the stages the simulated cluster has too (the client's wait for a free connection, the
# engine's queue and prompt steps); the rest of a live TTFT is the serving path (path_s)
SIMULATED_STAGES = ('wait_slot_s', 'engine_queue_s', 'prefill_s')
REQUEST_COLUMNS = ('router', 'request_id', 'replica', 'status', 'ttft_s', 'latency_s',
                   'prompt_tokens', 'output_tokens', 'attempts', 'same_tokens_as_single',
                   'compile_s', 'path_s') + STAGE_COLUMNS
ROUTER_COLUMNS = ('router', 'router_class', 'ok_requests', 'failed_requests',
                  'prefix_hit_rate_tokens', 'prompt_tokens_computed', 'ttft_p50_s', 'ttft_p90_s',
                  'ttft_p99_s', 'latency_p50_s', 'latency_p90_s', 'imbalance_requests',
                  'same_tokens_as_single', 'keys_handed', 'idle_ttft_s', 'path_p50_s',
                  'start_s', 'replay_s', 'sim_prefix_hit_rate_tokens',
                  'sim_hit_rate_minus_live', 'sim_hit_rate_lo', 'sim_hit_rate_hi',
                  'live_in_sim_band', 'sim_prompt_tokens_computed', 'sim_ttft_p50_s',
                  'sim_ttft_p90_s', 'sim_over_live_ttft_p50', 'sim_plus_idle_over_live_ttft_p50',
                  'sim_plus_path_over_live_ttft_p50', 'sim_slowdown_mean', 'serving_cores',
                  'replica_busy_s', 'sim_busy_s', 'sim_machine_share')
COMPARE_COLUMNS = ('router', 'prefix_hit_rate_tokens', 'sim_prefix_hit_rate_tokens',
                   'sim_hit_rate_minus_live', 'sim_hit_rate_lo', 'sim_hit_rate_hi',
                   'live_in_sim_band', 'ttft_p50_s', 'sim_ttft_p50_s',
                   'sim_over_live_ttft_p50', 'idle_ttft_s', 'sim_plus_idle_ttft_p50_s',
                   'sim_plus_idle_over_live_ttft_p50', 'path_p50_s', 'sim_plus_path_ttft_p50_s',
                   'sim_plus_path_over_live_ttft_p50', 'sim_slowdown_mean', 'serving_cores',
                   'replica_busy_s', 'sim_busy_s', 'sim_machine_share')
SHARE_FROM = ('steps', 'cpu', 'fixed')  # serve.sim_share_from (machine_share)
# the bisection of sim_share_from='steps': shares in [lo, hi], halving the log range each time
SHARE_RANGE, SHARE_STEPS = (0.05, 4.0), 9
BAND_POINTS = (-1.0, -0.5, 0.5, 1.0)  # serve.sim_share_band: the shares share * (1 + p * band)
BAND_TOLERANCE = 0.01  # live_in_sim_band: the live hit rate within this of the band's range
WORKLOADS = ('mooncake', 'shared_prefix')
CALIBRATE = 'calibrate'  # serve.sim_hardware: fit this machine's cost model here
IDLE_PROBES = 3  # short requests on the idle deployment before each replay (idle_ttft_s)


def check(config) -> None:
  w, s = config.workload, config.serve

  def fail(name, value, allowed):
    raise ConfigError(f'config.{name}={value!r} is not allowed: {allowed}')
  if w.kind not in WORKLOADS:
    fail('workload.kind', w.kind, f'one of {WORKLOADS}')
  for name in ('requests', 'tenants', 'prefix_tokens', 'question_tokens', 'output_tokens'):
    if not isinstance(w[name], int) or w[name] < 1:
      fail(f'workload.{name}', w[name], 'an integer >= 1')
  if w.kind == 'mooncake' and not os.path.isfile(w.path):
    fail('workload.path', w.path, 'a Mooncake block-hash trace file (JSON lines)')
  if not w.rate > 0:
    fail('workload.rate', w.rate, 'requests/s > 0')
  for name in ('replicas', 'concurrency', 'max_ongoing_requests'):
    if not isinstance(s[name], int) or s[name] < 1:
      fail(f'serve.{name}', s[name], 'an integer >= 1')
  if not s.sim_time_scale > 0:
    fail('serve.sim_time_scale', s.sim_time_scale, 'a number > 0')
  if s.replay_from:
    if not s.simulate:
      fail('serve.simulate', s.simulate, f'True with serve.replay_from={s.replay_from!r} (the '
           'replay is the simulated half)')
    for name in ('summary.json', 'hardware_profile.json'):
      if not os.path.exists(os.path.join(s.replay_from, name)):
        fail('serve.replay_from', s.replay_from,
             f'the workdir of an earlier run of this study (no {name} there)')
  if not (isinstance(s.sim_machine_share, (int, float)) and not isinstance(
      s.sim_machine_share, bool) and s.sim_machine_share >= 0):
    fail('serve.sim_machine_share', s.sim_machine_share,
         'a number >= 0 (0: a machine per simulated replica)')
  if s.sim_share_from not in SHARE_FROM:
    fail('serve.sim_share_from', s.sim_share_from, f'one of {SHARE_FROM}')
  if not (isinstance(s.sim_share_band, (int, float)) and not isinstance(s.sim_share_band, bool)
          and 0 <= s.sim_share_band < 1):
    fail('serve.sim_share_band', s.sim_share_band, 'a fraction in [0, 1) (0: no band)')
  if s.sim_hardware != CALIBRATE:
    from pagedjax.sim import hardware  # pylint: disable=import-outside-toplevel
    try:
      hardware.get_hardware(s.sim_hardware)
    except (ValueError, OSError, KeyError, TypeError) as e:
      fail('serve.sim_hardware', s.sim_hardware, f"'{CALIBRATE}' (this machine, fitted here), a "
           f'profile .json or a preset name ({e})')
  cal = s.calibration
  for name in ('rounds', 'peak_rounds', 'copy_mb'):
    if not isinstance(cal[name], int) or cal[name] < 1:
      fail(f'serve.calibration.{name}', cal[name], 'an integer >= 1')
  if not cal.fills or not all(0 < f <= 1 for f in cal.fills):
    fail('serve.calibration.fills', cal.fills, 'fractions of a batch in (0, 1]')
  for name in ('request_timeout_s', 'start_timeout_s'):
    if not s[name] > 0:
      fail(f'serve.{name}', s[name], 'seconds > 0')
  labels = [row[0] for row in s.routers]
  if not labels or len(set(labels)) != len(labels):
    fail('serve.routers', labels, 'a non-empty tuple of (label, name, kwargs), labels unique')
  for row in s.routers:
    if len(row) != 3:
      fail('serve.routers', row, 'rows of (label, name, kwargs)')
    try:
      serve_lib.router_config(row, 'check')
    except (ValueError, TypeError) as e:
      fail(f'serve.routers[{row[0]!r}]', row[1], str(e))
  if not config.prefix_cache.enabled:
    fail('prefix_cache.enabled', False, 'True (the routers route by cached prefix)')


def tokenizer_for(config):
  """The tokenizer the engines use (factory.load_model_and_tokenizer's choice), for the
  ingress."""
  from pagedjax.model import weights  # pylint: disable=import-outside-toplevel
  from pagedjax.model.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  m = config.model
  if m.source == 'safetensors':
    return Tokenizer.from_file(os.path.join(m.path, 'tokenizer.json'))
  return Tokenizer.from_gguf(m.path if m.source == 'gguf' else weights.smollm2_gguf_path())


def make_requests(config, vocab_size: int) -> tuple:
  """-> (requests as sim.ClusterRequests, how many were left out as too long)."""
  w, limit = config.workload, config.engine.max_seq_len
  out, dropped = [], 0
  if w.kind == 'mooncake':
    for r in workloads.block_trace_requests(w.path, vocab_size, start=w.start, limit=None,
                                            time_scale=w.time_scale,
                                            length_scale=w.length_scale):
      if len(r.prompt_ids) + r.max_new_tokens > limit:
        dropped += 1
        continue
      out.append(ClusterRequest(len(out), list(r.prompt_ids), r.max_new_tokens, r.arrival_time,
                                tenant=r.conversation_id))
      if len(out) == w.requests:
        break
    return out, dropped
  rng = np.random.default_rng(w.seed)
  draw = lambda n: [int(t) for t in rng.integers(0, vocab_size, n)]
  prefixes = [draw(w.prefix_tokens) for _ in range(w.tenants)]
  t = 0.0
  for i in range(w.requests):
    t += float(rng.exponential(1.0 / w.rate))
    tenant = int(rng.integers(w.tenants))
    out.append(ClusterRequest(i, prefixes[tenant] + draw(w.question_tokens), w.output_tokens, t,
                              tenant=tenant))
  return out, dropped


def replay(url: str, requests, concurrency: int, timeout_s: float) -> list:
  """Each request streamed at its arrival time (at most `concurrency` in flight); per request:
  status, replica, tokens, TTFT and latency from its scheduled arrival, and where its TTFT went
  (serve.STAGES: the path's stamps, the first from its scheduled arrival, the last its first
  event here; their seconds add up to its TTFT) with the compile seconds its replica's engine
  spent between its submission and its first token."""
  t0 = time.monotonic() + 0.5
  wall = time.time() - time.monotonic()  # the stamps are wall-clock, these times monotonic
  results = [None] * len(requests)

  def one(i, r):
    body = {'prompt': r.prompt_ids, 'max_tokens': r.max_new_tokens, 'temperature': 0.0,
            'ignore_eos': True}
    arrival = t0 + r.arrival_time
    sent = time.monotonic()
    status, events, first = serve_lib.post_stream(url, body, timeout_s)
    done = time.monotonic()
    ok = status == 200 and events and 'choices' in events[-1]
    tokens = [t for e in events if 'choices' in e for t in e['choices'][0]['token_ids']]
    last = events[-1] if ok else {}
    stamped = events[0].get('pagedjax', {}) if ok else {}
    times = {**stamped.get('times', {}), 'arrival': arrival + wall, 'sent': sent + wall}
    if ok and first is not None:
      times['first_event'] = sent + first + wall
    stages = {f'{name}_s': s for name, s in serve_lib.stage_seconds(times).items()}
    ttft = (sent + first - arrival) if ok and first is not None else None
    simulated = [stages[name] for name in SIMULATED_STAGES]
    path = None if ttft is None or None in simulated else ttft - sum(simulated)
    results[i] = {
        'request_id': r.request_id, 'status': status, 'prompt_tokens': len(r.prompt_ids),
        'ttft_s': ttft, 'path_s': path,
        'latency_s': done - arrival, 'output_tokens': len(tokens), 'tokens': tokens,
        'replica': last.get('pagedjax', {}).get('replica'),
        'attempts': last.get('pagedjax', {}).get('attempts'),
        'compile_s': stamped.get('compile_s'), **stages,
        'error': None if ok else str(events[-1] if events else 'no events')[:300]}

  with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
    futures = []
    for i, r in enumerate(requests):
      wait = t0 + r.arrival_time - time.monotonic()
      if wait > 0:
        time.sleep(wait)
      futures.append(pool.submit(one, i, r))
    for f in futures:
      f.result(timeout=timeout_s * (len(requests) + 1))  # each request is bounded by timeout_s
  return results


def share_compilation_cache(directory: str) -> None:
  """JAX's persistent compilation cache in `directory` (unless one is set already) for this
  process (jax is imported: its config) and the processes it starts (the environment)."""
  import jax  # pylint: disable=import-outside-toplevel
  directory = os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', directory)
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  jax.config.update('jax_compilation_cache_dir', directory)
  jax.config.update('jax_persistent_cache_min_compile_time_secs',
                    float(os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS']))


def longest_context(requests) -> int:
  """The most tokens a request's context reaches (its prompt and output)."""
  return max(len(r.prompt_ids) + r.max_new_tokens for r in requests)


def single_engine_tokens(engine, requests) -> dict:
  """request id -> one engine's greedy tokens for it (all requests in one generate call). Run
  in this process before any deployment: it also compiles every program the replicas will ask
  for (their warm-up: serve.warm_shapes and warm_up) into the shared compilation cache, so
  the replicas load them instead of compiling."""
  serve_lib.warm_shapes(engine, longest_context(requests))
  serve_lib.warm_up(engine)  # the replicas' own first request
  done = engine.generate([r.prompt_ids for r in requests],
                         dict(max_new_tokens=max(r.max_new_tokens for r in requests),
                              temperature=0.0, stop_on_eos=False))
  return {r.request_id: c.output_ids[:r.max_new_tokens] for r, c in zip(requests, done)}


@dataclasses.dataclass
class SimDevice:
  """What the simulated replicas run on: a cost model's hardware, the model's shape and the
  dtypes the cost model counts bytes in."""
  hardware: object  # pagedjax.sim.hardware.Hardware
  shape: sizing.ModelShape
  weight_dtype: str = 'bf16'
  activation_dtype: str = 'bf16'
  calibration: Optional[dict] = None  # the fit and its validation, when fitted here


def calibrate_cpu(config, engine, requests, workdir: str, progress=print) -> SimDevice:
  """This machine's cost model for the replicas' model and engine config, fitted as
  `experiments.simulate --calibrate` fits it (pagedjax/sim/calibrate.py): the CPU's matmul
  and memory peaks; the host's time per iteration (the engine with a step that computes
  nothing, on the study's requests); the real jitted step of `engine` (the replicas' config,
  its programs already compiled) timed over every (rows, tokens, table width) bucket whose
  contexts the study's requests reach, in serve.calibration.rounds shuffled rounds; the
  least-squares fit. Validated as the simulator's CPU validation is: one real engine runs the
  requests at their arrival times, and the simulated engine the same. Writes
  WORKDIR/hardware_profile.json."""
  from pagedjax.sim import calibrate, hardware  # pylint: disable=import-outside-toplevel
  cal, typed = config.serve.calibration, engine.config
  model_cfg, executor = engine.model_cfg, engine.executor
  make = lambda step_fn=None: factory.make_engine(
      typed, model_cfg, executor.params, engine.tokenizer, step_fn=step_fn or executor.step_fn)
  shape, weight_dtype, act_dtype = own_model(config, engine)
  t0 = time.monotonic()
  progress("calibrating this machine for the replicas' model: peaks, host time, step grid")
  peaks = calibrate.measure_peaks(rounds=cal.peak_rounds, copy_mb=cal.copy_mb)
  host = calibrate.profile_host(make, requests)
  points = serve_lib.step_points(engine, longest_context(requests), cal.fills)
  samples = calibrate.profile_steps(executor, points, model_cfg.vocab_size, rounds=cal.rounds)
  base = calibrate.cpu_hardware(peaks).with_efficiency(
      iteration_overhead_s=host['iteration_overhead_s'], row_overhead_s=host['row_overhead_s'])
  fitted, fit = calibrate.fit(shape, base, samples, kv_bytes_per_token=engine.kv_bytes_per_token,
                              block_size=typed.pool.block_size, weight_dtype=weight_dtype,
                              activation_dtype=act_dtype)
  fit.pop('errors')
  real = calibrate.run_recorded(make(), requests)['summary']
  sim = calibrate.simulate_trace(shape, fitted, typed, requests, weight_dtype=weight_dtype,
                                 activation_dtype=act_dtype)['summary']
  validation = calibrate.compare_runs(real, sim)
  report = {'profile': os.path.join(workdir, 'hardware_profile.json'), 'fit': fit,
            'grid_points': len(samples), 'host': host, 'peaks': peaks,
            'single_engine_validation': validation, 'seconds': time.monotonic() - t0}
  hardware.save_profile(report['profile'], fitted, {'model': shape.name, 'fit': fit,
                                                    'host': host, 'peaks': peaks})
  ttft = validation['ttft_p50_s']
  progress(f"calibrated in {report['seconds']:.0f} s: fit median |error| "
           f"{fit['median_abs_error']:.1%} over {len(samples)} step shapes; one engine on the "
           f"requests, TTFT p50 real {ttft['measured']:.4g} s, simulated {ttft['simulated']:.4g} s")
  return SimDevice(fitted, shape, weight_dtype, act_dtype, report)


def sim_device(config, engine, requests, workdir: str) -> SimDevice:
  """serve.sim_hardware's device: fitted here ('calibrate'), or a profile / preset by name."""
  from pagedjax.sim import hardware  # pylint: disable=import-outside-toplevel
  name = config.serve.sim_hardware
  if name == CALIBRATE:
    return calibrate_cpu(config, engine, requests, workdir)
  hw = hardware.get_hardware(name)
  if name.endswith('.json'):  # a calibration's profile: this machine, the model in float32
    return SimDevice(hw, *own_model(config, engine))
  return SimDevice(hw, model_shape(config))


def own_model(config, engine) -> tuple:
  """(shape, weight dtype, activation dtype) of the replicas' model as this machine runs it:
  pagedjax keeps params in float32 whatever the compute dtype (model/llama.py)."""
  shape = dataclasses.replace(sizing.from_model_config(engine.model_cfg),
                              name=f'{config.model.source} model')
  return shape, 'fp32', sizing.canonical_dtype(engine.model_cfg.dtype)


def quantile(values, q):
  values = [v for v in values if v is not None]
  return float(np.percentile(values, q)) if values else None


def mean(values):
  values = [v for v in values if v is not None]
  return float(np.mean(values)) if values else None


def ratio(a, b):
  """a / b; None when either is missing or b is 0."""
  return a / b if a is not None and b else None


def serving_cores(before: dict, after: dict, seconds: float) -> Optional[float]:
  """Cores' worth of CPU that everything but the replicas used over a replay: the machine's
  busy seconds less the replicas' own, over the replay's wall time. before / after: {'machine':
  cpu_time.machine_busy_s(), 'replicas': {pid: cpu_time.process_cpu_s(pid)}}, the same pids
  in both."""
  replicas = [after['replicas'][p] - before['replicas'][p] for p in before['replicas']
              if before['replicas'][p] is not None and after['replicas'].get(p) is not None]
  if (before['machine'] is None or after['machine'] is None or not seconds or
      len(replicas) != len(before['replicas']) or not replicas):
    return None
  return max(0.0, (after['machine'] - before['machine'] - sum(replicas)) / seconds)


def cpu_snapshot(pids) -> dict:
  return {'machine': cpu_time.machine_busy_s(),
          'replicas': {p: cpu_time.process_cpu_s(p) for p in pids}}


def live_router(config, typed, tokenizer, row, requests) -> tuple:
  s = config.serve
  deployment = serve_lib.ServeDeployment(
      typed, s.replicas, row, tokenizer=tokenizer, max_ongoing_requests=s.max_ongoing_requests,
      request_timeout_s=s.request_timeout_s, start_timeout_s=s.start_timeout_s,
      warm_context_tokens=longest_context(requests))
  with deployment:
    # one request shorter than a block first: Serve builds a handle's router on its first
    # request (Ray's prefix router then creates its tree actor, seconds under load); cached
    # nothing, so the replay starts from cold caches
    # (greedy, as the replay: at OpenAI's default temperature 1.0 the step also samples top-p
    # over the vocabulary, 25 ms of the tiny model's 30 ms step on this CPU)
    probe = {'prompt': [1, 2, 3], 'max_tokens': 1, 'temperature': 0.0}
    serve_lib.post(deployment.url, probe, s.request_timeout_s)
    # the serving path's own share of a TTFT: HTTP, proxy, ingress, router, replica call, and
    # an engine step of 3 tokens, on idle replicas (the simulated cluster has no such path)
    idle = [serve_lib.post_stream(deployment.url, probe, s.request_timeout_s)[2]
            for _ in range(IDLE_PROBES)]
    before = deployment.replica_summaries()  # (their compile seconds before the replay)
    pids = sorted({x.get('pid') for x in before.values() if x.get('pid') is not None})
    # the CPU the serving processes (proxy, ingress, controller, Ray, this client) take beside
    # the replicas: what serve.sim_share_from='cpu' leaves the simulated replicas
    cpu_before = cpu_snapshot(pids) if len(pids) == s.replicas else None
    t0 = time.monotonic()
    rows = replay(deployment.url, requests, s.concurrency, s.request_timeout_s)
    replay_s = time.monotonic() - t0
    cpu_after = cpu_snapshot(pids) if cpu_before is not None else None
    ok = sum(r['status'] == 200 for r in rows)
    deadline, summaries = time.monotonic() + 30, {}
    while time.monotonic() < deadline:  # each replica publishes its figures when it goes idle
      summaries = deployment.replica_summaries()
      if (len(summaries) == s.replicas and
          sum(x['finished_requests'] for x in summaries.values()) >= (
              ok + s.replicas + 1 + IDLE_PROBES)):  # and each replica's warm-up, the probes
        break
      time.sleep(0.2)
  hit = sum(x.get('prefix_hit_tokens', 0) for x in summaries.values())
  queried = sum(x.get('prefix_queried_tokens', 0) for x in summaries.values())
  per_replica = [sum(r['replica'] == uid for r in rows) for uid in summaries]
  figures = {
      'router': row[0], 'router_class': row[1], 'ok_requests': ok,
      'failed_requests': len(rows) - ok,
      'prefix_hit_rate_tokens': hit / queried if queried else None,
      'prompt_tokens_computed': sum(x.get('prompt_tokens_computed', 0)
                                    for x in summaries.values()),
      'ttft_p50_s': quantile([r['ttft_s'] for r in rows], 50),
      'ttft_p90_s': quantile([r['ttft_s'] for r in rows], 90),
      'ttft_p99_s': quantile([r['ttft_s'] for r in rows], 99),
      'latency_p50_s': quantile([r['latency_s'] for r in rows], 50),
      'latency_p90_s': quantile([r['latency_s'] for r in rows], 90),
      'imbalance_requests': (max(per_replica) / np.mean(per_replica)
                             if per_replica and np.mean(per_replica) else None),
      'idle_ttft_s': quantile(idle, 50),
      # the serving path as the replay's own requests met it: TTFT less the client's slot
      # wait and the engine's queue and prompt steps (SIMULATED_STAGES)
      'path_p50_s': quantile([r['path_s'] for r in rows], 50),
      # requests whose engine took the router's chain keys instead of hashing the prompt
      'keys_handed': sum(x.get('keys_handed', 0) for x in summaries.values()),
      'start_s': deployment.start_s, 'replay_s': replay_s,
      'serving_cores': (serving_cores(cpu_before, cpu_after, replay_s)
                        if cpu_before is not None else None),
      # the seconds the replicas' engines spent in their iterations during the replay (what
      # serve.sim_share_from='steps' matches)
      'replica_busy_s': busy_s(summaries.values()) - busy_s(
          before[uid] for uid in summaries if uid in before),
      'replica_requests': per_replica,
      # where the TTFT went: each stage's mean over the answered requests (means add up to the
      # mean TTFT; medians would not), and the replicas' compile seconds during the replay
      'ttft_mean_s': mean([r['ttft_s'] for r in rows]),
      'stages_mean_s': {name: mean([r[name] for r in rows if r['ttft_s'] is not None])
                        for name in STAGE_COLUMNS},
      'replay_compile_s': sum((x.get('compile_s') or 0) - (before.get(uid, {}).get(
          'compile_s') or 0) for uid, x in summaries.items()),
      'replica_summaries': {uid: {k: x.get(k) for k in (
          'finished_requests', 'prefix_hit_rate_tokens', 'prompt_tokens_computed',
          'prefix_cache_evictions', 'iterations', 'compile_s', 'num_compilations',
          'host_s_per_step', 'device_s_per_step')} for uid, x in summaries.items()}}
  print(f"{row[0]:>12}: started in {deployment.start_s:.0f} s, {ok}/{len(rows)} answered in "
        f"{replay_s:.1f} s", flush=True)
  return figures, [{'router': row[0], **r} for r in rows]


def model_shape(config) -> sizing.ModelShape:
  m = config.model
  if m.source == 'random':
    r = dict(m.random)
    r.pop('seed', None)
    r.pop('rope_theta', None)
    return sizing.ModelShape(name='random', **r)
  return sizing.PRESETS['smollm2-135m']


def busy_s(summaries) -> float:
  """Seconds engines spent in their iterations (host and device), from their summaries
  (Engine.summary: iterations, host_s_per_step, device_s_per_step)."""
  return float(sum((x.get('iterations') or 0) * ((x.get('host_s_per_step') or 0) +
                                                  (x.get('device_s_per_step') or 0))
                   for x in summaries))


def live_busy_s(live: dict) -> Optional[float]:
  """The live replicas' iteration seconds during the replay (replica_busy_s; a run that did
  not record it: their whole summaries', which add each replica's warm-up request and the
  probes, a few short iterations)."""
  if live.get('replica_busy_s') is not None:
    return float(live['replica_busy_s'])
  summaries = live.get('replica_summaries')
  return busy_s(summaries.values()) if summaries else None


def machine_share(config, live: dict, simulated_busy=None) -> float:
  """The simulated replicas' machine share (serve.sim_share_from, module docstring):
    'fixed'  serve.sim_machine_share
    'cpu'    (cores - serving_cores) / cores, serving_cores being the CPU everything but the
             replicas took during that router's replay (at least 0.1)
    'steps'  the share s at which simulated_busy(s), the simulated replicas' iteration seconds
             on the same requests, equals the live replicas' (live_busy_s), by bisection over
             SHARE_RANGE (a slower shared machine stretches every simulated step, so the
             seconds fall as s grows); an end of the range if the live figure lies beyond it
  serve.sim_machine_share where the live run did not measure what the mode needs."""
  s = config.serve
  share = float(s.sim_machine_share)
  if s.sim_share_from == 'cpu':
    cores, others = os.cpu_count() or 1, live.get('serving_cores')
    return share if others is None else max(0.1, min(1.0, (cores - others) / cores))
  if s.sim_share_from == 'steps':
    target = live_busy_s(live)
    if not target or simulated_busy is None:
      return share
    lo, hi = (np.log(x) for x in SHARE_RANGE)
    for _ in range(SHARE_STEPS):
      mid = (lo + hi) / 2
      if simulated_busy(float(np.exp(mid))) > target:
        lo = mid  # the simulated steps are slower than live: more of the machine
      else:
        hi = mid
    return float(np.exp((lo + hi) / 2))
  return share


def simulated_cluster(config, row, requests, device: SimDevice,
                      share: float) -> SimulatedCluster:
  """The requests replayed on SimulatedCluster replicas of the live ones' engine config and
  pool, on `device`, at most serve.concurrency in flight, sharing the machine at `share` (0: a
  machine each), arrival times multiplied by serve.sim_time_scale."""
  from pagedjax.sim import simulated_device  # pylint: disable=import-outside-toplevel
  typed = Config.from_configdict(config)
  engines = [simulated_device.simulated_engine(
      device.shape, device.hardware, typed, weight_dtype=device.weight_dtype,
      activation_dtype=device.activation_dtype) for _ in range(config.serve.replicas)]
  cluster = SimulatedCluster(engines, routers_lib.make_router(row[1], **dict(row[2])),
                             max_in_flight=config.serve.concurrency,
                             machine_share=share if share > 0 else None)
  scale = config.serve.sim_time_scale
  cluster.run([dataclasses.replace(r, arrival_time=r.arrival_time * scale) for r in requests])
  return cluster


def cluster_busy_s(cluster: SimulatedCluster) -> float:
  return busy_s(r.engine.summary() for r in cluster.replicas)


def simulated_router(config, row, requests, device: SimDevice, live: dict) -> dict:
  """The same requests on the simulated cluster (simulated_cluster) at the machine share
  machine_share gives, set beside `live`, that router's live figures."""
  share = machine_share(config, live, lambda x: cluster_busy_s(
      simulated_cluster(config, row, requests, device, x)))
  cluster = simulated_cluster(config, row, requests, device, share)
  f = cluster.figures()
  hit, live_hit = f['prefix_hit_rate_tokens'], live.get('prefix_hit_rate_tokens')
  # how far the hit rate moves when the share is a little off (serve.sim_share_band): where a
  # pool is nearly full, whether a prefix is evicted turns on a few milliseconds
  band = config.serve.sim_share_band
  hits = [hit] + ([simulated_cluster(config, row, requests, device, share * (1 + p * band))
                   .figures()['prefix_hit_rate_tokens'] for p in BAND_POINTS]
                  if band and share > 0 else [])
  hits = [h for h in hits if h is not None]
  ttft, live_ttft, idle = f['ttft_p50_s'], live.get('ttft_p50_s'), live.get('idle_ttft_s')
  # the serving path the simulated cluster has not, as the idle deployment measured it, and
  # as the replay's requests met it (path_p50_s)
  with_path = ttft + idle if ttft is not None and idle is not None else None
  path = live.get('path_p50_s')
  with_live_path = ttft + path if ttft is not None and path is not None else None
  return {'sim_prefix_hit_rate_tokens': hit,
          'sim_hit_rate_minus_live': (hit - live_hit if None not in (hit, live_hit) else None),
          'sim_hit_rate_lo': min(hits) if hits else None,
          'sim_hit_rate_hi': max(hits) if hits else None,
          'live_in_sim_band': (None if not hits or live_hit is None else
                               min(hits) - BAND_TOLERANCE <= live_hit <=
                               max(hits) + BAND_TOLERANCE),
          'sim_prompt_tokens_computed': f['prompt_tokens_computed'],
          'sim_ttft_p50_s': ttft, 'sim_ttft_p90_s': f['ttft_p90_s'],
          'sim_over_live_ttft_p50': ratio(ttft, live_ttft),
          'sim_plus_idle_ttft_p50_s': with_path,
          'sim_plus_idle_over_live_ttft_p50': ratio(with_path, live_ttft),
          'sim_plus_path_ttft_p50_s': with_live_path,
          'sim_plus_path_over_live_ttft_p50': ratio(with_live_path, live_ttft),
          'sim_replica_requests': [r.routed for r in cluster.replicas],
          'sim_slowdown_mean': f['slowdown_mean'],
          'replica_busy_s': live_busy_s(live), 'sim_busy_s': cluster_busy_s(cluster),
          'sim_machine_share': share, 'sim_share_from': config.serve.sim_share_from,
          'sim_rejected': f['rejected_requests']}


def plot(routers: list, workdir: str, title: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  labels = [r['router'] for r in routers]
  x = np.arange(len(labels))
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  val = lambda key: [r.get(key) if r.get(key) is not None else np.nan for r in routers]
  axes[0].bar(x - 0.2, val('prefix_hit_rate_tokens'), 0.4, label='live (Ray Serve)')
  axes[0].bar(x + 0.2, val('sim_prefix_hit_rate_tokens'), 0.4, label='simulated cluster')
  axes[0].set_title('prefix hit rate (prompt tokens)')
  axes[1].bar(x - 0.27, val('ttft_p50_s'), 0.27, label='p50')
  axes[1].bar(x, val('ttft_p90_s'), 0.27, label='p90')
  axes[1].bar(x + 0.27, val('sim_ttft_p50_s'), 0.27, label='p50, simulated')
  axes[1].set_title('TTFT, s from arrival (live: wall, this machine under its load)')
  for ax in axes:
    ax.set_xticks(x, labels, rotation=20)
    ax.legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'serve.png'), dpi=100)
  plt.close(fig)


# What a replay takes from the earlier run's config: the same requests on the same replicas.
REPLAY_SAME = ('workload', 'pool', 'engine', 'model', 'prefix_cache', 'scheduler',
               'serve.replicas', 'serve.concurrency')


def replay_study(config, workdir: str) -> dict:
  """serve.replay_from=DIR: the simulated half of the study again, against the live figures an
  earlier run wrote to DIR (its summary.json) and on the device it calibrated there
  (DIR/hardware_profile.json), for each pagedjax router row of this config; no Ray, no live
  run. This config must give the same requests on the same replicas (REPLAY_SAME: a
  ConfigError names the field that differs); the simulator's own settings (sim_share_from,
  sim_machine_share, sim_time_scale, the routers' kwargs) may change, which is what a replay
  is for. Writes routers.csv, table.md and summary.json (`replayed_from`) to workdir."""
  s = config.serve
  with open(os.path.join(s.replay_from, 'summary.json')) as f:
    saved = json.load(f)
  # as JSON both (tuples are lists in the saved file)
  before = saved.get('config') or {}
  now = json.loads(json.dumps(config.to_dict(), default=str))
  for field in REPLAY_SAME:
    a, b = before, now
    for part in field.split('.'):
      a, b = (a or {}).get(part), (b or {}).get(part)
    if a != b:
      raise ConfigError(f'config.{field} differs from the run in {s.replay_from} ({b!r} here, '
                        f'{a!r} there): a replay needs the same requests on the same replicas')
  live_rows = {r['router']: r for r in saved.get('routers', [])}
  typed = factory.typed(config)
  tokenizer = tokenizer_for(typed)
  vocab = (typed.model.random.vocab_size if typed.model.source == 'random' else
           tokenizer.vocab_size)
  requests, _ = make_requests(config, vocab)
  engine = factory.build_engine(typed, tokenizer)
  from pagedjax.sim import hardware  # pylint: disable=import-outside-toplevel
  device = SimDevice(hardware.get_hardware(os.path.join(s.replay_from, 'hardware_profile.json')),
                     *own_model(config, engine))
  del engine
  routers = []
  for row in s.routers:
    if row[1] in serve_lib.RAY_ROUTERS:
      continue
    if row[0] not in live_rows:
      raise ConfigError(f'config.serve.routers row {row[0]!r} has no live figures in '
                        f'{s.replay_from}; it has {sorted(live_rows)}')
    # the live figures alone: the earlier run's simulated ones (sim_*) are computed again
    figures = {k: v for k, v in live_rows[row[0]].items() if not k.startswith('sim_')}
    figures.update(simulated_router(config, row, requests, device, figures))
    routers.append(figures)
  run_info.write_csv(os.path.join(workdir, 'routers.csv'), routers, ROUTER_COLUMNS)
  table = (f'The simulated replay of {s.replay_from}\'s live run (live figures from there, '
           f'simulated on {device.hardware.name}, sim_share_from={s.sim_share_from!r})\n\n'
           f'{run_info.markdown_table(routers, COMPARE_COLUMNS)}\n')
  cli.write_table(workdir, table)
  summary = {'replayed_from': os.path.abspath(s.replay_from), 'requests': len(requests),
             'routers': routers, 'sim_hardware': device.hardware.name,
             **run_info.summary_fields(config)}
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  return summary


def study(config, workdir: str) -> dict:
  if config.serve.replay_from:
    return replay_study(config, workdir)
  # Serve's driver-side INFO lines (each deployment's start, connect, stop) are not results.
  logging.getLogger('ray.serve').setLevel(logging.WARNING)
  # with Ray's log format on the root logger, jax's INFO line about backends it did not find
  logging.getLogger('jax._src.xla_bridge').setLevel(logging.WARNING)
  load_before = os.getloadavg()
  typed = factory.typed(config)
  tokenizer = tokenizer_for(typed)
  vocab = (typed.model.random.vocab_size if typed.model.source == 'random' else
           tokenizer.vocab_size)
  requests, dropped = make_requests(config, vocab)
  s = config.serve
  title = (f'{s.replicas} x {typed.model.source} replicas on Ray Serve, {len(requests)} '
           f'{config.workload.kind} requests')
  print(f'{title} ({dropped} left out as longer than max_seq_len)', flush=True)
  routers, rows = [], []
  # One compilation cache for this process and every replica (they inherit the environment):
  # the single engine compiles first, the replicas load what it compiled.
  share_compilation_cache(os.path.join(workdir, 'jit-cache'))
  with serve_lib.ray_started():  # one Ray for every router's deployment, forked before jax runs
    engine = factory.build_engine(typed, tokenizer)
    single = single_engine_tokens(engine, requests)
    # before the live runs, with Ray up and idle: the load the replicas will run under
    device = sim_device(config, engine, requests, workdir) if s.simulate else None
    del engine
    live = [live_router(config, typed, tokenizer, row, requests) for row in s.routers]
  for row, (figures, mine) in zip(s.routers, live):
    for r in mine:
      r['same_tokens_as_single'] = r['status'] == 200 and r['tokens'] == single[r['request_id']]
    figures['same_tokens_as_single'] = float(np.mean([r['same_tokens_as_single'] for r in mine]))
    if s.simulate and row[1] not in serve_lib.RAY_ROUTERS:
      figures.update(simulated_router(config, row, requests, device, figures))
    routers.append(figures)
    rows += mine
  run_info.write_csv(os.path.join(workdir, 'requests.csv'), rows, REQUEST_COLUMNS)
  run_info.write_csv(os.path.join(workdir, 'routers.csv'), routers, ROUTER_COLUMNS)
  load_after = os.getloadavg()
  table = (f'{title}; TTFT and latency are wall seconds on this machine (1-minute load '
           f'average {load_before[0]:.1f} at the start, {load_after[0]:.1f} at the end)\n\n'
           f'{run_info.markdown_table(routers, ROUTER_COLUMNS)}\n')
  simulated = [r for r in routers if 'sim_ttft_p50_s' in r]
  if simulated:
    table += (f'\nLive against simulated on {device.hardware.name} (TTFT p50: live wall s, '
              f'simulated s of its cost model; at most {s.concurrency} requests in flight in '
              f'both)\n\n{run_info.markdown_table(simulated, COMPARE_COLUMNS)}\n')
  stages = [{'router': r['router'], 'ttft_mean_s': r['ttft_mean_s'], **{
      name[:-2]: r['stages_mean_s'][name] for name in STAGE_COLUMNS},
              'replay_compile_s': r['replay_compile_s']} for r in routers]
  table += ('\nWhere a live TTFT went: each stage\'s mean over the requests, s (they add up '
            'to the mean TTFT; pagedjax/cluster/serve.py STAGES), and the seconds the replicas '
            f'compiled during the replay\n\n{run_info.markdown_table(stages, list(stages[0]))}\n')
  cli.write_table(workdir, table)
  plot(routers, workdir, title)
  summary = {
      'setting': title, 'requests': len(requests), 'left_out_too_long': dropped,
      'routers': routers, 'tokens_equal_to_single_engine': all(r['same_tokens_as_single']
                                                                for r in rows),
      'sim_hardware': None if device is None else device.hardware.name,
      'calibration': None if device is None else device.calibration,
      'timing_note': 'wall time on this machine under its load (load_average_run)',
      'load_average_run': {'start': load_before, 'end': load_after},
      **run_info.summary_fields(config)}
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  return summary


if __name__ == '__main__':
  cli.run_study('configs/serve.py', 'Live Ray Serve routing study config.', study, check=check)
