"""Time and cost of the policy lab's eviction policies: prefill GPU-seconds and TTFT, simulated.

  python -m experiments.policy_lab_sim --workdir=runs/policy_lab_sim
  python -m experiments.policy_lab_sim --config=configs/policy_lab_sim.py:tiny --workdir=DIR

A slice of Mooncake's conversation trace (config.sim_lab.start, limit) is served by one
simulated prefill node (pagedjax/sim: the engine's real host code on a modelled device; here
Llama-3-70B, tensor parallel over 8 x A100 80GB), once per eviction policy and once without a
prefix cache. Each request is a prefill: one output token (Mooncake disaggregates decoding), its
prompt the trace's blocks as token ids (studies/workloads.block_trace_requests: equal hash ids,
equal tokens), the engine's block the trace's 512-token block, its session the inferred
conversation. Arrivals are the trace's, stretched by config.sim_lab.time_scale (the node carries
1 / time_scale of the trace's load; the cache sees every request of the slice, in order).

The prefix cache stands for the node's host-RAM cache of config.sim_lab.cache_tokens: the
simulated pool holds that many tokens (it allocates nothing), so a hit costs no recomputation.
The simulator cannot run the KV tiers (tiering.build_tiers needs block arrays), so moving a
host-RAM hit to HBM is not on its clock; the study reports it beside it: the same slice replayed
through the real tier code (experiments/policy_lab.py, TierReplay) with the device's HBM
capacity over a host tier of cache_tokens gives each policy's tier hit mix, and the host hits'
transfer time over the modelled host link (all tp devices in parallel) is the added load time,
an upper bound for an engine that overlaps the load with earlier layers (Mooncake loads layer by
layer).

Figures per row: hit rate; prefill GPU-seconds (busy simulated seconds x tp) and those saved
against no cache; TTFT p50 / p99 (simulated seconds); the tier mix (device / host hit rates) and
the host-hit load time per request. Fitted and tuned policies take the lab's parameters
(config.sim_lab.params, or a lab run's summary.json: sim_lab.lab_summary); the return model is
fitted on the first half of the whole trace when no summary gives it.

Writes: results.csv, table.md, summary.json, ttft.png (TTFT and GPU-seconds saved per row).
Every time figure is simulated seconds on a modelled device; host wall time is recorded as a
figure under load.
"""
import json
import math
import os
import time

from experiments import cli
from experiments import policy_lab as lab
from pagedjax import config as config_lib
from pagedjax import sizing
from pagedjax.config import Config, PoolConfig
from pagedjax.host import policies
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.sim import hardware, simulated_device
from pagedjax.studies import run_info, workloads

NO_CACHE = 'no_cache'
COLUMNS = ('row', 'hit_rate', 'prefill_gpu_s', 'prefill_gpu_s_saved', 'ttft_p50_s',
           'ttft_p99_s', 'device_hit_rate', 'host_hit_rate', 'host_load_s_per_request',
           'simulated_duration_s', 'prompt_tokens_computed', 'simulator_wall_s')


def check(config) -> None:
  s = config.sim_lab

  def fail(name, value, allowed):
    raise config_lib.ConfigError(f'config.sim_lab.{name}={value!r} is not allowed: {allowed}')
  if not isinstance(s.trace, str) or not os.path.isfile(s.trace):
    fail('trace', s.trace, 'a block-hash trace file that exists (JSON lines)')
  for name in ('start', 'limit'):
    if not isinstance(s[name], int) or s[name] < (0 if name == 'start' else 1):
      fail(name, s[name], 'an integer >= 0' if name == 'start' else 'an integer >= 1')
  if not isinstance(s.time_scale, (int, float)) or not 0 < s.time_scale < math.inf:
    fail('time_scale', s.time_scale, 'a finite number > 0 (arrivals stretched by it)')
  if not isinstance(s.cache_tokens, (int, float)) or s.cache_tokens < 4 * lab.BLOCK:
    fail('cache_tokens', s.cache_tokens, f'tokens >= {4 * lab.BLOCK}')
  for row in s.rows:
    if row != NO_CACHE and (row not in lab.ROWS or row in lab.OFFLINE):
      fail('rows', row, f"{NO_CACHE!r} or an online row of experiments/policy_lab.ROWS")
  if s.model not in sizing.PRESETS:
    fail('model', s.model, f'a sizing preset: {tuple(sizing.PRESETS)}')
  hardware.get_hardware(s.hardware)  # raises naming the presets
  if s.lab_summary and not os.path.isfile(s.lab_summary):
    fail('lab_summary', s.lab_summary, "a policy lab run's summary.json, or '' (none)")


def lab_parameters(config) -> dict:
  """The replay params of the lab rows (policy_lab.replay's): tuned values and the return model,
  from a lab run's summary.json if named, else config.sim_lab.params and a fresh fit."""
  s = config.sim_lab
  if s.lab_summary:
    with open(s.lab_summary, encoding='utf-8') as f:
      summary = json.load(f)
    params = dict(summary['tuned'])
    if summary.get('return_model'):
      params[lab.FIT] = summary['return_model']
  else:
    params = dict(s.params)
  if lab.FIT not in params and any(r in lab.FITTED for r in s.rows):
    records = list(workloads.read_block_trace(s.trace))
    params[lab.FIT] = lab.fit_return_model(records[:len(records) // 2])
  return params


def engine_config(config, row: str, params: dict):
  """The simulated node's Config for one row (eviction policy, or no prefix cache)."""
  s = config.sim_lab
  cfg = Config().to_configdict()
  cfg.mesh.model = s.tp
  cfg.engine.update(dict(max_seq_len=s.max_seq_len, max_batch_size=s.max_batch_size,
                         prefill_chunk=s.prefill_chunk))
  cfg.scheduler.max_num_batched_tokens = s.max_num_batched_tokens
  cfg.pool.block_size = lab.BLOCK
  cfg.pool.num_blocks = int(s.cache_tokens // lab.BLOCK) + 1  # + the null block
  if row != NO_CACHE:
    cfg.prefix_cache.enabled = True
    cfg.prefix_cache.eviction = row_policy(config, row, params)
  return Config.from_configdict(cfg)


def row_policy(config, row: str, params: dict) -> str:
  """The registered name of row's policy with the lab's parameters set: a subclass made and
  registered here (an engine config names a policy class), whose class attributes are what
  policy_lab.make_queue sets on an instance (the attributes that shadow the class's own)."""
  blocks = int(config.sim_lab.cache_tokens // lab.BLOCK)
  template = lab.make_queue(row, blocks, [], params)
  base = type(template)
  fields = {k: v for k, v in vars(template).items() if hasattr(base, k)}
  name = f'policy_lab_sim_{row}'
  if name in policies.EVICTION:
    policies.EVICTION.unregister(name)
  policies.EVICTION.register(name, type(f'Lab{base.__name__}', (base,), fields))
  return name


def hbm_tokens(config) -> int:
  """Tokens of KV the node's HBM holds after the weights (simulated_device.plan_pool)."""
  s = config.sim_lab
  shape, hw = sizing.PRESETS[s.model], hardware.get_hardware(s.hardware)
  spec = PoolConfig().kv_quant(simulated_device.activation_dtype_name('bf16'))
  plan = simulated_device.plan_pool(shape, hw, block_size=lab.BLOCK, kv_quant=spec, tp=s.tp,
                                    max_tokens=s.max_num_batched_tokens,
                                    max_rows=s.max_batch_size)
  return plan['num_blocks'] * lab.BLOCK


def simulate_row(config, row: str, params: dict) -> dict:
  s = config.sim_lab
  shape, hw = sizing.PRESETS[s.model], hardware.get_hardware(s.hardware)
  engine = simulated_device.simulated_engine(shape, hw, engine_config(config, row, params),
                                             count_padding=False)
  for r in workloads.block_trace_requests(s.trace, shape.vocab_size, start=s.start,
                                          limit=s.limit, time_scale=s.time_scale):
    session = (str(r.conversation_id) if r.conversation_id is not None and row != NO_CACHE
               else None)
    engine.submit(r.prompt_ids, SamplingParams(max_new_tokens=1, stop_on_eos=False,
                                               session_id=session),
                  arrival_time=r.arrival_time)
  start = time.perf_counter()
  engine.run()
  wall = time.perf_counter() - start
  f = engine.summary()
  busy = f['device_s_per_step'] * f['iterations']
  return {'row': row, 'hit_rate': f['prefill_tokens_saved_fraction'],
          'prefill_gpu_s': busy * s.tp, 'ttft_p50_s': f['ttft_p50_s'],
          'ttft_p99_s': f['ttft_p99_s'], 'simulated_duration_s': f['duration_s'],
          'prompt_tokens_computed': f['prompt_tokens_computed'],
          'prompt_tokens_submitted': f['prompt_tokens_submitted'],
          'kv_bytes_per_token': f['kv_bytes_per_token'], 'simulator_wall_s': wall}


def tier_mix(config, row: str, records, hbm: int, params: dict) -> dict:
  """The row's hits by tier with the HBM over a host tier of cache_tokens (real tier code)."""
  sizes = {'device_tokens': hbm, 'host_tokens': config.sim_lab.cache_tokens, 'disk_tokens': 0}
  return lab.tier_replay(row, records, sizes, params, 'hash')


def study(config, workdir: str) -> dict:
  s = config.sim_lab
  start = time.perf_counter()
  params = lab_parameters(config)
  hbm = hbm_tokens(config)
  hw = hardware.get_hardware(s.hardware)
  records = list(workloads.read_block_trace(s.trace, s.start, s.limit))
  rows = []
  for row in cli.progress(list(s.rows), desc='simulated node', unit='row'):
    out = simulate_row(config, row, params)
    if row != NO_CACHE:
      mix = tier_mix(config, row, records, hbm, params)
      host_tokens = mix['host_hit_rate'] * out['prompt_tokens_submitted']
      per_device = out['kv_bytes_per_token'] / s.tp
      out.update(device_hit_rate=mix['device_hit_rate'], host_hit_rate=mix['host_hit_rate'],
                 tier_replay_hit_rate=mix['hit_rate'],
                 host_load_s_per_request=host_tokens * per_device / hw.host_link_bandwidth /
                 len(records))
    rows.append(out)
  base = next((r for r in rows if r['row'] == NO_CACHE), None)
  for r in rows:
    r['prefill_gpu_s_saved'] = base['prefill_gpu_s'] - r['prefill_gpu_s'] if base else None
  run_info.write_csv(os.path.join(workdir, 'results.csv'), rows, COLUMNS)
  text = (f'{len(records)} requests (trace {s.start}..{s.start + len(records) - 1}), '
          f'{s.model} on {s.tp} x {hw.name}, arrivals x{s.time_scale:g}, cache '
          f'{s.cache_tokens:.3g} tokens (host RAM), HBM {hbm:.3g} tokens. Simulated seconds.\n\n'
          + run_info.markdown_table(rows, COLUMNS[:-1]))
  cli.write_table(workdir, text)
  wall = time.perf_counter() - start
  summary = {'simulated': True, 'rows': rows, 'requests': len(records), 'hbm_tokens': hbm,
             'hardware': hw.name, 'model': s.model, 'tp': s.tp,
             'host_link_bandwidth': hw.host_link_bandwidth,
             'params': params,
             'wall_s': wall, 'load_average': os.getloadavg(),
             'timing_note': 'simulated seconds; wall_s is host time on a shared machine (under '
                            'load)', **run_info.summary_fields(config)}
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  plot(config, rows, workdir)
  return summary


def plot(config, rows: list, workdir: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  s = config.sim_lab
  names = [r['row'] for r in rows]
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
  xs = range(len(rows))
  a1.bar([x - 0.2 for x in xs], [r['ttft_p50_s'] for r in rows], 0.4, label='TTFT p50')
  a1.bar([x + 0.2 for x in xs], [r['ttft_p99_s'] for r in rows], 0.4, label='TTFT p99')
  a1.set_ylabel('time to first token (simulated s)')
  a2.bar(xs, [r['prefill_gpu_s_saved'] or 0.0 for r in rows], 0.6, color='tab:green',
         label='prefill GPU-seconds saved vs no cache')
  a2.set_ylabel('GPU-seconds saved (simulated)')
  for a in (a1, a2):
    a.set_xticks(list(xs))
    a.set_xticklabels(names, rotation=30, ha='right', fontsize=8)
    a.grid(True, axis='y', alpha=0.3)
    a.legend(fontsize=8)
  fig.suptitle(f'{s.model} on {s.tp} x {s.hardware}, {s.limit} Mooncake requests, '
               f'{s.cache_tokens:.3g}-token cache, arrivals x{s.time_scale:g} (simulated)'
               + cli.variant_note(config), fontsize=9)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'ttft.png'), dpi=120)
  plt.close(fig)


if __name__ == '__main__':
  cli.run_study('configs/policy_lab_sim.py', 'Policy lab, simulated time and cost.', study,
                check=check, validate=False)
