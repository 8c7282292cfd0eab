"""The simulator (pagedjax/sim): cost model against hand-computed figures, presets with sources,
the simulated device driving the same scheduler decisions as a real device given the same clock,
calibration recovering known factors, and the experiment entry point."""
import csv
import dataclasses
import json
import math
import types

import numpy as np
import pytest

from pagedjax import sizing
from pagedjax.studies import workloads
from pagedjax.config import Config, ConfigError
from pagedjax.device.kv_schemes import KVQuantConfig
from pagedjax.engine import Engine
from pagedjax.executor import PlanExecutor
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.scheduling.step_inputs import power_of_two_buckets
from pagedjax.sim import calibrate, hardware
from pagedjax.sim import simulated_device as sd
from pagedjax.sim.cost_model import CostModel, StepShape, decode_step, prefill_step
import fakes
from study_outputs import check_outputs, run_tiny
import tiny_models

SMALL = sizing.ModelShape('small', num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                          head_dim=16, ffn_dim=128, vocab_size=1000, tie_embeddings=True)
EXACT = hardware.Efficiency(matmul_flops=1.0, weight_bandwidth=1.0, attention_flops=1.0,
                            kv_bandwidth=1.0, elementwise_bandwidth=1.0, step_overhead_s=0.0,
                            iteration_overhead_s=0.0, row_overhead_s=0.0,
                            collective_latency_s=0.0)
UNIT = hardware.Hardware('unit', hbm_bytes=1e12, hbm_bandwidth=1e11, peak_flops=1e12,
                         host_link_bandwidth=1e10, interconnect_bandwidth=1e10, efficiency=EXACT)


def small_cost(hw=UNIT, tp=1):
  kv = sizing.kv_bytes_per_token(SMALL, 'bf16')  # 2 * 2 layers * 2 heads * 16 * 2 B = 256
  return CostModel(SMALL, hw, kv_bytes_per_token=kv, block_size=16, tp=tp)


# ---- cost model -----------------------------------------------------------------------------

def test_decode_costs_by_hand():
  cost = small_cost()
  step = decode_step(4, 100, padded_rows=8)  # 4 sequences at context 100, padded to 8 rows
  c = cost.step_costs(step)
  d, hq, hkv, dh, f, layers = 64, 4, 2, 16, 128, 2
  per_layer = d * hq * dh * 2 + d * hkv * dh * 2 + 3 * d * f  # q,o + k,v + gate,up,down
  assert per_layer == 36864
  assert c['linear'].flops == 2 * 8 * layers * per_layer  # padded rows compute too
  assert c['head'].flops == 2 * 8 * d * 1000
  # Attention: each real row scores its one query against 100 keys, per query head and layer,
  # 2 FLOPs per multiply-add for q.k and again for p.v.
  assert c['attention'].flops == 4 * hq * dh * layers * (4 * 100)
  kv_per_token = 2 * layers * hkv * dh * 2
  assert c['attention'].bytes == (4 * 100 + 4) * kv_per_token  # contexts read, new K/V written
  # Weights are read once per step whatever the batch (bf16: 2 bytes).
  assert c['linear'].bytes >= layers * per_layer * 2
  assert c['attention'].memory_s == pytest.approx(c['attention'].bytes / 1e11)
  assert cost.step_time(step) == pytest.approx(sum(x.time_s for x in c.values()))


def test_padding_is_charged_unless_told_otherwise():
  kv = sizing.kv_bytes_per_token(SMALL, 'bf16')
  ragged = CostModel(SMALL, UNIT, kv_bytes_per_token=kv, block_size=16, count_padding=False)
  step = StepShape.from_rows([(5, 5), (20, 20)], 4, 32)  # 2 real rows in a 4 x 32 call
  assert small_cost().step_costs(step)['linear'].flops == 2 * 4 * 32 * ragged.linear_params
  assert ragged.step_costs(step)['linear'].flops == 2 * 25 * ragged.linear_params
  assert ragged.step_costs(step)['head'].flops == 2 * 2 * ragged.head_params


def test_prefill_chunk_pairs_are_causal():
  cost = small_cost()
  # One chunk of 8 tokens after 24 cached: query j sees 24 + j + 1 keys.
  step = StepShape.from_rows([(8, 32)], 1, 8)
  pairs, reads = cost.attention_pairs_and_reads(step)
  assert pairs == sum(24 + j + 1 for j in range(8)) and reads == 32


def test_batch_max_walks_each_kernel_loop_to_its_longest_context():
  """The spans kernels/xla.py walks (kernels/xla_loops.py): prompt chunks in two halves, decode
  batches under 64 rows in one loop, 64 and more in two halves."""
  cpu = dataclasses.replace(UNIT, attention_reads='batch_max')
  cost = small_cost(cpu)
  chunk = StepShape.from_rows([(2, 10), (2, 40), (2, 5), (2, 70)], 4, 2)
  pairs, reads = cost.attention_pairs_and_reads(chunk)
  # Halves (10, 40) and (5, 70): 2 rows x 48 slots (3 blocks) + 2 rows x 80 slots (5 blocks),
  # each of a row's 2 query tokens scoring every slot.
  assert reads == 2 * 48 + 2 * 80 and pairs == 2 * reads
  decode = StepShape.from_rows([(1, 10), (1, 40), (1, 5), (1, 70)], 4, 1)
  pairs, reads = cost.attention_pairs_and_reads(decode)
  assert reads == 4 * 80 and pairs == reads  # one loop, to the longest context (5 blocks)
  wide = StepShape.from_rows([(1, 10)] * 32 + [(1, 70)] * 32, 64, 1)
  pairs, reads = cost.attention_pairs_and_reads(wide)
  assert reads == 32 * 16 + 32 * 80 and pairs == reads  # two halves


def test_chunk_overhead_is_charged_to_prompt_chunk_calls_only():
  hw = UNIT.with_efficiency(step_overhead_s=1e-3, chunk_overhead_s=5e-3)
  cost = small_cost(hw)
  assert cost.step_costs(decode_step(4, 100, 8))['overhead'].time_s == pytest.approx(1e-3)
  assert cost.step_costs(prefill_step([8, 8], 8))['overhead'].time_s == pytest.approx(6e-3)
  # A profile written before the field existed loads with none.
  d = hardware.to_dict(UNIT)
  del d['efficiency']['chunk_overhead_s']
  assert hardware.from_dict(d).efficiency.chunk_overhead_s == 0.0


def test_memory_bound_decode_and_compute_bound_prefill_on_a100():
  opt = sizing.PRESETS['opt-13b']
  a100 = hardware.PRESETS['a100-40gb'].with_efficiency(**{
      f.name: getattr(EXACT, f.name) for f in dataclasses.fields(EXACT)})
  cost = CostModel(opt, a100, kv_bytes_per_token=sizing.kv_bytes_per_token(opt, 'fp16'),
                   block_size=16, weight_dtype='fp16')
  decode = cost.describe(decode_step(1, 1))
  assert decode['linear']['bound'] == 'memory'
  # Batch 1 decode reads the 25.7 GB of fp16 weights: ~16.5 ms at 1.555 TB/s.
  assert decode['linear']['time_s'] == pytest.approx(
      2 * sizing.param_breakdown(opt)['attention'] / 1.555e12 +
      2 * sizing.param_breakdown(opt)['mlp'] / 1.555e12, rel=1e-3)
  prefill = cost.describe(prefill_step([512] * 4, 512))
  assert prefill['linear']['bound'] == 'compute'
  assert prefill['linear']['time_s'] == pytest.approx(prefill['linear']['flops'] / 312e12)


def test_tensor_parallel_splits_work_and_adds_collectives():
  one, eight = small_cost(tp=1), CostModel(
      dataclasses.replace(SMALL, num_heads=8, num_kv_heads=8), UNIT, kv_bytes_per_token=1024,
      block_size=16, tp=8)
  assert one.collective_time(decode_step(8, 10)) == 0
  # Two ring all-reduces of [8 tokens, 64] bf16 per layer + the logits' all-gather.
  expected = 2 * 2 * (2 * 7 / 8 * 8 * 64 * 2 / 1e10) + 7 / 8 * 8 * 1000 * 4 / 1e10
  assert eight.collective_time(decode_step(8, 10)) == pytest.approx(expected)
  assert eight.kv_per_token == 1024 / 8


def test_transfers_by_hand():
  cost = small_cost()
  block = 256 * 16  # bytes per token x block size
  assert cost.swap_time(10) == pytest.approx(10 * block / 1e10)
  assert cost.copy_time(10) == pytest.approx(2 * 10 * block / 1e11)
  assert cost.swap_time(0) == cost.copy_time(0) == 0


def test_presets_carry_their_specs_and_sources():
  expected = {'h100-sxm': (989.5e12, 3.35e12), 'h200': (989.5e12, 4.8e12),
              'a100-80gb': (312e12, 2.039e12), 'a100-40gb': (312e12, 1.555e12),
              'tpu-v5e': (197e12, 819e9), 'tpu-v6e': (918e12, 1638e9)}
  assert set(hardware.PRESETS) == set(expected)
  text = open(hardware.__file__).read()
  for name, hw in hardware.PRESETS.items():
    assert (hw.peak_flops, hw.hbm_bandwidth) == pytest.approx(expected[name], rel=1e-12)
    assert hw.source and not hw.calibrated
    # The comment just above each preset names its spec sheet.
    comment = text.split(f"'{name}': Hardware(")[0].rsplit('),\n', 1)[-1]
    assert 'datasheet' in comment or 'cloud.google.com' in comment, name
  assert hardware.get_hardware('H100 SXM') is hardware.PRESETS['h100-sxm']
  with pytest.raises(ValueError, match='unknown hardware'):
    hardware.get_hardware('b200')


def test_profile_round_trip(tmp_path):
  hw = UNIT.with_efficiency(matmul_flops=0.3)
  path = str(tmp_path / 'p.json')
  hardware.save_profile(path, hw, {'fit': {'x': 1}})
  assert hardware.get_hardware(path) == hw


# ---- the simulated pool ---------------------------------------------------------------------

@pytest.mark.parametrize('kv_dtype, group', [('bfloat16', None), ('int8', 128)])
def test_pool_bytes_match_sizing(kv_dtype, group):
  shape = sizing.PRESETS['llama3-8b']
  pool = sd.SimulatedPool(sd.model_config(shape), 17, 16, KVQuantConfig(kv_dtype), 4)
  # int8: one float16 scale per token and head, i.e. a group of head_dim channels.
  assert pool.bytes_per_token == sizing.kv_bytes_per_token(
      shape, kv_dtype, kv_group_size=group)


def test_70b_engine_allocates_no_pool():
  config = Config(mesh=dataclasses.replace(Config().mesh, model=8))
  config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, max_seq_len=8192))
  shape = sizing.PRESETS['llama3-70b']
  plan = sd.plan_pool(shape, hardware.PRESETS['h100-sxm'], block_size=16, tp=8,
                      kv_quant=KVQuantConfig('bfloat16'), max_tokens=512, max_rows=8)
  config = dataclasses.replace(config, pool=dataclasses.replace(config.pool,
                                                                num_blocks=plan['num_blocks']))
  engine = sd.simulated_engine(shape, 'h100-sxm', config)
  assert isinstance(engine.pool, sd.SimulatedPool)
  # Eight GPUs' worth of KV: more than this machine holds, so it cannot have been allocated.
  assert engine.pool.nbytes > 400e9
  assert plan['kv_bytes_per_token_per_device'] == sizing.kv_bytes_per_token(shape, 'bf16') / 8


# ---- same decisions as a real device --------------------------------------------------------

COMPUTE_ONLY = dataclasses.replace(UNIT, hbm_bandwidth=math.inf, host_link_bandwidth=math.inf,
                                   interconnect_bandwidth=math.inf, peak_flops=2e6)


def trace(n=14, rate=60.0, vocab=97, shared=True):
  encode = lambda text: [b % vocab for b in text.encode()]
  lengths = (workloads.LengthDist(12, 0.6), workloads.LengthDist(9, 0.6))
  if shared:
    return workloads.shared_system_prompt(n, system_tokens=12, dataset=lengths, encode=encode,
                                          rate=rate, seed=3, max_input_len=24, max_output_len=14)
  return workloads.synthetic_trace(n, lengths, encode=encode, rate=rate, seed=3,
                                   max_input_len=30, max_output_len=14)


def drive(engine, requests, n_samples=1):
  """Runs the requests; returns every iteration's decisions: who runs with which blocks, who
  waits or is swapped, and the preemption count so far."""
  for r in requests:
    engine.submit(r.prompt_ids, SamplingParams(max_new_tokens=r.max_new_tokens, n=n_samples,
                                               stop_on_eos=False), arrival_time=r.arrival_time)
  history = []
  while engine.has_work():
    engine.step()
    history.append((round(engine.clock, 9),
                    [(s.request_id, tuple(s.block_table), s.num_cached) for s in engine.running],
                    [s.request_id for s in engine.scheduler.waiting],
                    [s.request_id for s in engine.scheduler.swapped],
                    engine.stats['preemptions'], engine.stats['cow_copies']))
  return history


class ClockedStep:
  """A real step that advances a clock by the cost model's time for the inputs it is given: the
  same clock the simulated device keeps."""

  def __init__(self, step, clock, cost):
    self.step, self.clock, self.cost = step, clock, cost
    self.return_logits = step.return_logits
    self.num_compilations = 0

  def __call__(self, params, pool, inputs):
    self.clock.advance(self.cost.step_time(StepShape.from_inputs(inputs)))
    return self.step(params, pool, inputs)


class SameTokensStep(fakes.FakeStep):
  """The model-free fake step (tests/fakes.py) sampling the simulated device's tokens. Tokens
  reach scheduling decisions only through prefix-cache keys of generated blocks (and a fake's
  parallel samples would all agree, where the simulator's, like a model's, differ by seed):
  fixing them isolates what is tested, the host decisions under one clock."""

  def __call__(self, params, pool, inputs):
    super().__call__(params, pool, inputs)
    return pool, sd.sim_tokens(inputs.seeds, inputs.counters, inputs.context_lens,
                               fakes.VOCAB, None)


def sim_engine(cfg, **flat):
  config, _ = tiny_models.engine_config(cfg, **flat)
  backend = sd.SimulatedBackend(sizing.from_model_config(cfg), COMPUTE_ONLY,
                                activation_dtype='fp32', weight_dtype='fp32', record_shapes=True)
  return Engine(cfg, None, config, timer=backend.clock, backend=backend)


@pytest.mark.parametrize('flat, n_samples', [
    ({'preemption': 'swap', 'prefix_caching': True}, 1),
    ({'preemption': 'recompute', 'prefix_caching': True}, 2),  # forks and copy-on-write
    ({'preemption': 'swap', 'swap_blocks': 3}, 1),  # a full host tier falls back to recompute
], ids=['swap_prefix', 'recompute_forks', 'swap_tier_full'])
def test_same_decisions_as_fake_device(flat, n_samples):
  """The fake step on a real pool (with real block copies and host-tier transfers) vs the
  simulated device: same admissions, preemptions, swaps and block tables every iteration."""
  flat = {'block_size': 4, 'num_blocks': 24, 'max_batch_size': 4, 'prefill_chunk': 8, **flat}
  sim = sim_engine(fakes.CFG, **flat)
  clock = sd.SimClock()
  real = tiny_models.build_engine(
      fakes.CFG, None, timer=clock,
      step_fn=ClockedStep(SameTokensStep(), clock, sim.executor.backend.cost), **flat)
  requests = trace()
  expected = drive(real, requests, n_samples)
  assert drive(sim, requests, n_samples) == expected
  assert real.stats['preemptions'] > 0  # the trace is tight enough to preempt
  if flat['preemption'] == 'swap':
    assert real.stats['swapped_out_blocks'] > 0


def test_same_decisions_as_tiny_model():
  """A real tiny Llama (compiled first, so no compilation hides step time from its clock)."""
  cfg, params, step = tiny_models.tiny('gqa')
  # Two rows and 64-token sequences: three step shapes to compile, and memory for ~2 sequences.
  flat = {'block_size': 4, 'num_blocks': 12, 'max_batch_size': 2, 'prefill_chunk': 8,
          'max_seq_len': 64}
  requests = trace(n=6, rate=200.0, shared=False)
  sim = sim_engine(cfg, **flat)
  cost = sim.executor.backend.cost
  clock = sd.SimClock()
  real = tiny_models.build_engine(cfg, params, timer=clock,
                                  step_fn=ClockedStep(step, clock, cost), **flat)
  # Every shape bucket compiled first, as --calibrate does: a compiling call's time would be
  # left off the real engine's clock.
  rng = np.random.default_rng(0)
  calibrate.compile_shapes(real.executor, [
      calibrate.grid_inputs(p, real.executor, cfg.vocab_size, rng)
      for p in calibrate.step_grid(real.executor, 16, 8)])
  clock.now = 0.0
  expected = drive(real, requests)
  assert real.num_compilations == 0
  assert drive(sim, requests) == expected
  assert real.stats['preemptions'] > 0


# ---- KV tiers on the simulated device -------------------------------------------------------

TIERED = {'block_size': 4, 'num_blocks': 12, 'max_batch_size': 2, 'prefill_chunk': 8,
          'max_seq_len': 64, 'prefix_caching': True}
# stated figures, so neither engine measures them: a load is cheaper than recomputing
TIER_FIGURES = dict(prefill_s_per_token=1e-3, host_bytes_per_s=1e9, host_latency_s=1e-4)


def tiered_config(cfg, host_blocks: int, **tiers):
  config = tiny_models.engine_config(cfg, **TIERED)[0]
  return dataclasses.replace(config, tiers=dataclasses.replace(
      config.tiers, host_blocks=host_blocks, **{**TIER_FIGURES, **tiers}))


def tiered_sim(cfg, host_blocks: int, **tiers):
  backend = sd.SimulatedBackend(sizing.from_model_config(cfg), COMPUTE_ONLY,
                                activation_dtype='fp32', weight_dtype='fp32')
  return Engine(cfg, None, tiered_config(cfg, host_blocks, **tiers), timer=backend.clock,
                backend=backend)


def revisits(vocab=97):
  """Four 16-token prompts (4 full blocks, 3 matchable), then the same four again, 3 tokens
  generated each (a partial block: only prompt blocks are keyed): the 11-block pool
  holds about two of them, so the second pass finds the others only below the device."""
  rng = np.random.default_rng(5)
  prompts = [[int(t) for t in rng.integers(1, vocab, 16)] for _ in range(4)]
  return [types.SimpleNamespace(prompt_ids=p, max_new_tokens=3, arrival_time=0.05 * i)
          for i, p in enumerate(prompts + prompts)]


TIER_COUNTS = ('tiers_tier1_hit_blocks', 'tiers_tier2_hit_blocks', 'tiers_promoted_blocks',
               'tiers_declined_blocks', 'tiers_tier2_demoted_blocks', 'tiers_tier1_evictions',
               'tiers_tier2_evictions', 'tiers_queried_blocks', 'tiers_tier2_full_skips')


def tier_decisions(engine, log):
  """The tiers' counts, what the host tier holds (in eviction order) and every KV event."""
  s = engine.summary()
  host = engine.tiers.host.index
  events = [(type(e).__name__, e.medium, tuple(getattr(e, 'block_hashes', ())))
            for e in log.pending]
  return {k: s[k] for k in TIER_COUNTS}, sorted(host.keys()), events


def test_simulated_host_tier_hits_where_the_device_alone_misses():
  """The same pool and requests on the simulated device, with and without 8 host blocks: the
  second pass finds prompts below the device only with the tier, computes that much less, and
  the promotions' scatter is charged to the clock."""
  cfg = fakes.CFG
  requests = revisits(fakes.VOCAB)
  device_only, tiered = tiered_sim(cfg, 0), tiered_sim(cfg, 8)
  assert device_only.tiers is None and tiered.tiers is not None
  drive(device_only, requests), drive(tiered, requests)
  a, b = device_only.summary(), tiered.summary()
  assert b['tiers_tier2_hit_blocks'] >= 4 and b['tiers_promoted_bytes'] == (
      b['tiers_promoted_blocks'] * tiered.pool.block_nbytes)
  assert b['prompt_tokens_computed'] == a['prompt_tokens_computed'] - 4 * b[
      'tiers_tier2_hit_blocks']
  assert b['prefix_hit_tokens'] == a['prefix_hit_tokens']  # device hits alike; the rest below
  assert tiered.tiers.counters['promote_seconds'] == 0  # COMPUTE_ONLY: free transfers
  charged = tiered_sim(cfg, 8)
  charged.executor.backend.cost.hw = dataclasses.replace(UNIT, host_link_bandwidth=1e6)
  drive(charged, requests)
  # each promoted block's bytes over the 1 MB/s host link (this hardware has no call overhead)
  assert charged.tiers.counters['promote_seconds'] == pytest.approx(
      charged.summary()['tiers_tier2_hit_blocks'] * charged.executor.backend.cost.block_bytes / 1e6)
  with pytest.raises(ValueError, match=r'tiers\.disk_blocks=4 is not allowed on a simulated'):
    tiered_sim(cfg, 8, disk_blocks=4, disk_kvstore='memory://sim/')


def test_tiers_make_the_same_decisions_as_the_tiny_model():
  """A host tier under the real tiny Llama and under the simulated device, same clock: the
  same iterations, the same tier counts (hits per tier, promotions, declines, demotions,
  evictions), the same host-tier contents and the same KV events, GPU and CPU, in order."""
  from pagedjax.host import kv_events  # pylint: disable=import-outside-toplevel
  cfg, params, step = tiny_models.tiny('gqa')
  requests = revisits(cfg.vocab_size)
  sim = tiered_sim(cfg, 6)
  cost = sim.executor.backend.cost
  clock = sd.SimClock()
  real = Engine(cfg, params, tiered_config(cfg, 6), timer=clock,
                step_fn=ClockedStep(step, clock, cost))
  assert real.tiers.cost == sim.tiers.cost  # the promotion rule weighs the same figures
  calibrate.compile_shapes(real.executor, [
      calibrate.grid_inputs(p, real.executor, cfg.vocab_size, np.random.default_rng(0))
      for p in calibrate.step_grid(real.executor, 16, 8)])
  clock.now = 0.0
  logs = [kv_events.EventLog(e.prefix_cache.events) for e in (real, sim)]
  assert drive(sim, requests) == drive(real, requests)
  expected, got = tier_decisions(real, logs[0]), tier_decisions(sim, logs[1])
  assert got == expected
  counts, host_keys, events = got
  assert counts['tiers_tier2_hit_blocks'] > 0 and counts['tiers_tier2_evictions'] > 0
  assert any(kind == 'BlockStored' and medium == 'CPU' for kind, medium, _ in events)
  assert any(kind == 'BlockRemoved' and medium == 'CPU' for kind, medium, _ in events)


def test_simulated_executor_times_what_the_step_interface_would():
  """The executor's shortcut (shapes from rows) and SimulatedStep on the StepInputs the real
  executor builds give the same calls, times and figures."""
  cfg = fakes.CFG
  flat = {'block_size': 4, 'num_blocks': 40, 'max_batch_size': 4, 'prefill_chunk': 8}
  fast = sim_engine(cfg, **flat)
  config, _ = tiny_models.engine_config(cfg, **flat)
  backend = sd.SimulatedBackend(sizing.from_model_config(cfg), COMPUTE_ONLY,
                                activation_dtype='fp32', weight_dtype='fp32', record_shapes=True)
  via_inputs = types.SimpleNamespace(init_model_pool=backend.init_model_pool,
                                     executor=PlanExecutor, step=backend.step)
  slow = Engine(cfg, None, config, timer=backend.clock, backend=via_inputs)
  requests = trace(shared=False)
  assert drive(fast, requests) == drive(slow, requests)
  shapes = fast.executor.device.shapes
  assert shapes == slow.executor.step_fn.calls and shapes
  assert fast.summary()['generated_tokens_per_s'] == slow.summary()['generated_tokens_per_s']


def test_tokens_follow_trace_lengths_and_avoid_eos():
  shape = sizing.PRESETS['smollm2-135m']
  engine = sd.simulated_engine(shape, 'h100-sxm', Config(), eos_id=0)
  requests = trace(n=6, shared=False, vocab=shape.vocab_size)
  for r in requests:
    engine.submit(r.prompt_ids, SamplingParams(max_new_tokens=r.max_new_tokens))  # EOS honoured
  done = engine.run()
  assert [len(c.output_ids) for c in done] == [r.max_new_tokens for r in requests]
  assert all(t != 0 for c in done for t in c.output_ids)


@pytest.mark.parametrize('prefill_s_per_token,policy', [(1.0, 'swap'), (1e-12, 'recompute')])
def test_auto_preemption_weighs_the_simulated_costs(prefill_s_per_token, policy):
  """preemption='auto' on the simulator: the host link's figures are the preset's, and a stated
  prefill cost decides every preemption one way."""
  shape = sizing.PRESETS['smollm2-135m']
  config = tiny_models.engine_config(tiny_models.tiny('gqa')[0], block_size=4, num_blocks=13,
                                     max_batch_size=4, prefill_chunk=8, max_seq_len=64,
                                     preemption='auto', victim='cost',
                                     prefill_s_per_token=prefill_s_per_token)[0]
  engine = sd.simulated_engine(shape, 'h100-sxm', config)
  cost = engine.scheduler.cost
  assert cost.bytes_per_s[2] == hardware.PRESETS['h100-sxm'].host_link_bandwidth
  assert cost.block_bytes == engine.pool.bytes_per_token * 4
  requests = trace(n=10, shared=False, vocab=shape.vocab_size)
  for r in requests:
    engine.submit(r.prompt_ids, SamplingParams(max_new_tokens=r.max_new_tokens,
                                               stop_on_eos=False), arrival_time=r.arrival_time)
  done = engine.run()
  assert [len(c.output_ids) for c in done] == [r.max_new_tokens for r in requests]
  assert engine.stats[f'preemptions_{policy}'] == engine.stats['preemptions'] > 0


# ---- calibration ----------------------------------------------------------------------------

def test_fit_recovers_known_efficiencies():
  truth = hardware.Efficiency(matmul_flops=0.4, weight_bandwidth=0.7, attention_flops=0.2,
                              kv_bandwidth=0.3, elementwise_bandwidth=0.5, step_overhead_s=2e-3)
  cpu = dataclasses.replace(UNIT, attention_reads='batch_max', peak_flops=1e11,
                            hbm_bandwidth=2e10)
  shape = sizing.PRESETS['smollm2-135m']
  kv = sizing.kv_bytes_per_token(shape, 'fp32')
  model = CostModel(shape, dataclasses.replace(cpu, efficiency=truth), kv_bytes_per_token=kv,
                    block_size=16, weight_dtype='fp32', activation_dtype='fp32')
  shapes = [decode_step(n, c, 16) for n in (1, 8, 16) for c in (16, 200, 500)]
  shapes += [prefill_step([64] * n, 64, n) for n in (1, 4, 16)]
  shapes += [StepShape.from_rows([(64, 448)] * n, n, 64) for n in (2, 8)]
  samples = [{'shape': s, 'seconds': model.step_time(s)} for s in shapes]
  fitted, report = calibrate.fit(shape, cpu, samples, kv_bytes_per_token=kv, block_size=16)
  assert report['max_abs_error'] < 0.02
  assert fitted.efficiency.step_overhead_s == pytest.approx(2e-3, rel=0.1)


def test_host_profile_sees_every_batch_size():
  """A step that takes no time leaves the engine clock still; at the trace's arrival times
  every request would run alone. The profile submits them all at once instead."""
  cfg, params, _ = tiny_models.tiny()
  encode = lambda text: [b % tiny_models.VOCAB for b in workloads.byte_encode(text)]
  trace = workloads.synthetic_trace(12, rate=0.5, seed=0, max_input_len=20, max_output_len=48,
                                    calibrate=False, encode=encode)
  make = lambda step: tiny_models.build_engine(cfg, params, step_fn=step, block_size=16,
                                               num_blocks=64, max_batch_size=8)
  host = calibrate.profile_host(make, trace)
  assert len(host['rows_seen']) > 2 and max(host['rows_seen']) == 8


def test_grid_keeps_each_call_once_and_covers_every_bucket():
  """A fill that lands in a smaller bucket would repeat another point (and weigh it twice in
  the fit); each call is profiled once, and every (kind, rows, width) bucket is there."""
  buckets = power_of_two_buckets
  executor = types.SimpleNamespace(block_size=16, batch_buckets=buckets(16),
                                   decode_batch_buckets=buckets(16, 8), token_buckets=[1, 64],
                                   table_width_buckets=buckets(32, 16))
  points = calibrate.step_grid(executor, 256, 64, (0.25, 0.5, 1.0))
  keys = [(p.kind, tuple(p.rows)) for p in points]
  assert len(keys) == len(set(keys))
  widths = lambda p: 16 if max(c for _, c in p.rows) <= 256 else 32
  assert {('decode', len(p.rows), widths(p)) for p in points if p.kind == 'decode'} == {
      ('decode', n, w) for n in (2, 4, 8, 16) for w in (16, 32)}
  assert {('prefill', len(p.rows), widths(p)) for p in points if p.kind == 'prefill'} == {
      ('prefill', n, w) for n in (1, 2, 4, 8, 16) for w in (16, 32)}


def test_calibrate_and_validate_tiny(tmp_path):
  """--calibrate's whole pipeline on a tiny random model: profile, fit, profile file, real runs
  compared per iteration and end to end; then the replay of the same trace with that profile
  (the `:tiny` replay simulates the calibrated model, not SmolLM2)."""
  from configs import simulate_cpu
  from experiments import simulate
  config = simulate_cpu.get_config('tiny')
  summary, stdout = run_tiny(simulate.study, config, tmp_path / 'cal', check=simulate.check,
                             validate=False, calibrate=True)
  check_outputs(tmp_path / 'cal', stdout, table=False)
  profile = hardware.load_profile(summary['profile'])
  assert profile.calibrated and profile.attention_reads == 'batch_max'
  (run,) = summary['validation']
  assert run['num_compilations'] == 0  # the profile compiled every shape the run meets
  assert run['per_iteration']['iterations_compared'] > 0
  e2e = run['end_to_end']
  assert e2e['iterations']['measured'] > 0 and e2e['generated_tokens_per_s']['simulated'] > 0
  assert (tmp_path / 'cal' / 'hardware_profile.json').exists()
  # The host profile's requests all arrive at once: here 4 requests in batches of 2 give one
  # batch size only, so no per-row slope is fitted (it used to be an arbitrary half).
  assert summary['host']['rows_seen'] == [2] and summary['host']['row_overhead_s'] == 0.0
  rows = list(csv.DictReader(open(run['iterations_csv'])))
  assert len(rows) == run['per_iteration']['iterations_compared'] + run['per_iteration'][
      'iterations_skipped_compiling']
  timed = [r for r in rows if r['compiled'] == 'False']
  assert all(float(r['measured_s']) > 0 and float(r['predicted_s']) > 0 for r in timed)
  assert all(r['decode_measured_s'] or r['prefill_measured_s'] for r in timed)
  assert (tmp_path / 'cal' / 'grid.csv').read_text().startswith('kind,rows,tokens_per_row')

  # The replay: the same model and trace on the profile; its throughput is the calibration's
  # simulated one (both are the fitted cost model on the same trace).
  config.sim.hardware = summary['profile']
  replay, stdout = run_tiny(simulate.study, config, tmp_path / 'replay', check=simulate.check,
                            validate=False)
  check_outputs(tmp_path / 'replay', stdout, plots=0)
  (row,) = replay['rows']
  assert row['model'] == 'tiny random Llama' and row['hardware_calibrated'] is True
  assert row['generated_tokens_per_s'] == pytest.approx(
      e2e['generated_tokens_per_s']['simulated'], rel=0.05)
  config.sim.hardware = 'runs/nowhere/hardware_profile.json'
  with pytest.raises(ConfigError, match=r"config.sim.hardware='runs/nowhere/hardware_profile."
                     r"json' is not allowed: .*this file does not exist"):
    simulate.check(config)


def test_simulate_vllm_tiny(tmp_path):
  """The rate sweep through its entry point's pipeline: files and titles marked simulated and
  tiny, the paged / contiguous table printed."""
  from configs import simulate_vllm
  from experiments import simulate
  config = simulate_vllm.get_config('tiny')
  summary, stdout = run_tiny(simulate.study, config, tmp_path, check=simulate.check,
                             validate=False)
  check_outputs(tmp_path, stdout)
  assert summary['simulated'] and summary['figures']['simulated']
  assert 'SmolLM2-135M on 1x A100 40GB' in summary['title'] and 'OPT' not in summary['title']
  assert 'paged rate (req/s)' in stdout
  rows = [json.loads(line) for line in (tmp_path / 'results.jsonl').read_text().splitlines()]
  assert len(rows) == 4 and all(r['simulated'] for r in rows)
  header = (tmp_path / 'results.csv').read_text().splitlines()[0].split(',')
  assert header[:2] == ['pool.kind', 'trace.rate'] and 'simulated' in header
  assert 'pool_kind' not in header and 'trace_rate' not in header  # repeats of swept fields
  assert '(simulated)' in (tmp_path / 'table.md').read_text()
  kinds = {r['pool.kind']: r for r in rows if r['trace_rate'] == 80.0}
  # Same KV budget; the contiguous pool reserves max_seq_len per request, so fewer run at once.
  assert kinds['paged']['num_blocks'] == kinds['contiguous']['num_blocks']
  assert kinds['paged']['peak_concurrent_sequences'] > kinds['contiguous'][
      'peak_concurrent_sequences']


def _profile(tmp_path, **changes):
  """A hardware-profile file: UNIT's figures with `changes` (JSON allows Infinity and NaN)."""
  hw = hardware.to_dict(UNIT)
  for key, value in changes.items():
    if key.startswith('efficiency.'):
      hw['efficiency'][key.split('.', 1)[1]] = value
    else:
      hw[key] = value
  path = tmp_path / 'profile.json'
  path.write_text(json.dumps({'hardware': hw}))
  return str(path)


@pytest.mark.parametrize('field, value, message', [
    ('hardware', 'b200', r"config.sim.hardware='b200' is not allowed: one of h100-sxm, .*profile"),
    ('model', 'gpt-5', r"config.sim.model='gpt-5' is not allowed: one of .*llama3-8b"),
    ('model', 'config.model', r"config.sim.model='config.model' is not allowed: .* only with "
                              r"model.source='random'"),
    ('weight_dtype', 'fp12', r"config.sim.weight_dtype='fp12' is not allowed: one of fp32, "),
    ('activation_dtype', 'int8', r"config.sim.activation_dtype='int8' is not allowed: one of "
                                 r"fp32, bf16, fp16"),
    ('num_kv_heads', -3, r'config.sim.num_kv_heads=-3 is not allowed: an integer >= 0'),
    ('num_kv_heads', 3, r'config.sim.num_kv_heads=3 is not allowed: 0 .*or a divisor of the 32 '
                        r'query heads'),
    ('memory_fraction', 5, r'config.sim.memory_fraction=5.0 is not allowed: a share of one '
                           r"device's memory in \(0, 1\]"),
    ('memory_fraction', float('nan'), r'config.sim.memory_fraction=nan is not allowed'),
    ('memory_fraction', -1, r'config.sim.memory_fraction=-1.0 is not allowed'),
    ('num_blocks', -5, r'config.sim.num_blocks=-5 is not allowed: an integer >= 0'),
    ('num_blocks', 100, r'config.sim.num_blocks=100 is not allowed: 0 .*or at least '
                        r'engine.max_batch_size \+ 1 = 257'),
    ('memory_fractoin', 0.5, r"config.sim.memory_fractoin=0.5 is not allowed: a field of "
                             r"config.sim: model, hardware"),
    ('hardware', {'hbm_bytes': float('inf')}, r'is not allowed: a hardware profile that loads: '
                                              r'.*hbm_bytes=inf is not allowed'),
    ('hardware', {'hbm_bandwidth': float('nan')}, r'hbm_bandwidth=nan is not allowed'),
    ('hardware', {'efficiency.kv_bandwidth': -0.5}, r'kv_bandwidth=-0.5 is not allowed'),
    ('hardware', 'missing.json', r"config.sim.hardware='missing.json' is not allowed: .*this file "
                                 r"does not exist"),
])
def test_sim_config_errors_name_field_value_and_allowed(tmp_path, field, value, message):
  """config.sim is checked like the engine's sections, before any point runs (exit 2 from the
  command line): a bad preset, dtype, count, share or profile file is one ConfigError."""
  from configs import simulate_ablations
  from experiments import simulate
  config = simulate_ablations.get_config('tiny')
  if isinstance(value, dict):
    value = _profile(tmp_path, **value)
  config.sim[field] = value
  with pytest.raises(ConfigError, match=message):
    simulate.check(config)


def test_sim_config_is_refused_before_the_workdir(tmp_path):
  """The entry point's path (cli.run_config, what `python -m experiments.simulate` runs): the
  refusal comes before the workdir is made (the command line prints it as one `error:` line,
  exit 2: tests/test_decode_experiment.py checks that mapping)."""
  from configs import simulate_ablations
  from experiments import simulate
  config = simulate_ablations.get_config('tiny')
  config.sim.memory_fraction = 5
  with pytest.raises(ConfigError, match=r'config.sim.memory_fraction=5.0 is not allowed'):
    run_tiny(simulate.study, config, tmp_path / 'w', check=simulate.check, validate=False)
  assert not (tmp_path / 'w').exists()
