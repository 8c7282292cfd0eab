"""One iteration is schedule -> run -> update: the Plan is the whole work order (the executor
makes exactly the device calls the plan names, in the plan's order, and no other), the simulator
is a Device (host/scheduling/device_api.py) rather than a subclass of the executor, and the
counters have one owner, the metrics."""
import ast
import dataclasses
import pathlib

from pagedjax import sizing
from pagedjax.config import TiersConfig
from pagedjax.engine import Engine
from pagedjax.executor import JaxDevice, PlanExecutor
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.scheduling.device_api import Device
from pagedjax.sim import simulated_device as sd
import fakes
from tiny_models import engine_config, prompts

ROOT = pathlib.Path(__file__).resolve().parent.parent


class RecordingDevice:
  """A Device that records every call (kind, what it names) and passes it on."""

  def __init__(self, inner):
    self.inner, self.calls = inner, []

  def __getattr__(self, name):  # pool, params, step_fn, record_logits, ... of the inner device
    return getattr(self.inner, name)

  def start_iteration(self, num_rows):
    self.calls.append(('start', num_rows))
    self.inner.start_iteration(num_rows)

  def gather(self, blocks):
    self.calls.append(('gather', list(blocks)))
    return self.inner.gather(blocks)

  def scatter(self, blocks, data):
    self.calls.append(('scatter', list(blocks)))
    self.inner.scatter(blocks, data)

  def copy(self, pairs):
    self.calls.append(('copy', list(pairs)))
    self.inner.copy(pairs)

  def step(self, call):
    self.calls.append(('step', [(s.request_id, n) for s, n in call.rows]))
    return self.inner.step(call)


def named_calls(plan) -> list:
  """The device calls the plan names, in the order Plan's docstring gives."""
  calls = [('start', len(plan.rows))]
  gathered = [b for src, _ in plan.swap_out for b in src] + [d.block for d in plan.demotions]
  if gathered:
    calls.append(('gather', gathered))
  if plan.offload_out:
    calls.append(('gather', [d for d, _ in plan.offload_out]))
  if plan.copies or plan.tier_copies:
    calls.append(('copy', plan.copies + plan.tier_copies))
  scattered = [b for _, dst in plan.swap_in for b in dst] + [p.block for p in plan.promotions]
  if scattered:
    calls.append(('scatter', scattered))
  rows = [(s.request_id, n) for s, n in plan.rows if not s.host_table]
  for kind in (lambda n: n > 1, lambda n: n == 1):
    if any(kind(n) for _, n in rows):
      calls.append(('step', [(rid, n) for rid, n in rows if kind(n)]))
  return calls


def record_iterations(engine):
  """Wraps the engine's device and scheduler; returns the (plan, device calls) of each
  iteration as they happen."""
  device = engine.executor.device = RecordingDevice(engine.executor.device)
  iterations, schedule = [], engine.scheduler.schedule

  def recorded_schedule():
    plan = schedule()
    iterations.append((plan, len(device.calls)))
    return plan
  engine.scheduler.schedule = recorded_schedule
  return lambda: [(plan, device.calls[start:end]) for (plan, start), end in
                  zip(iterations, [s for _, s in iterations[1:]] + [len(device.calls)])]


def check_plans_name_every_call(engine, submit) -> list:
  iterations = record_iterations(engine)
  submit(engine)
  engine.run()
  plans = iterations()
  assert plans
  for plan, calls in plans:
    assert calls == named_calls(plan)
  return [plan for plan, _ in plans]


def test_simulated_run_makes_only_the_calls_its_plans_name():
  """Swap preemption, copy-on-write (parallel samples) and prefix hits on the simulated
  device: every iteration's device calls are exactly its plan's."""
  flat = {'block_size': 4, 'num_blocks': 20, 'max_batch_size': 4, 'prefill_chunk': 8,
          'preemption': 'swap', 'prefix_caching': True}
  config, _ = engine_config(fakes.CFG, **flat)
  backend = sd.SimulatedBackend(sizing.from_model_config(fakes.CFG), 'h100-sxm',
                                activation_dtype='fp32', weight_dtype='fp32')
  engine = Engine(fakes.CFG, None, config, timer=backend.clock, backend=backend)

  def submit(e):
    for p in prompts([13, 9, 17, 11, 15], seed=2):
      e.submit(p, SamplingParams(max_new_tokens=12, n=2, stop_on_eos=False))
  plans = check_plans_name_every_call(engine, submit)
  assert any(p.swap_out for p in plans) and any(p.swap_in for p in plans)
  assert any(p.copies for p in plans) and any(p.lanes for p in plans)


def test_tier_moves_come_from_the_plan():
  """A real pool with a host-RAM KV tier: demotions and promotions reach the device only as
  plan entries (the executor reads no tier queue of its own)."""
  flat = {'block_size': 4, 'num_blocks': 10, 'max_batch_size': 2, 'prefill_chunk': 8,
          'prefix_caching': True}
  config, rest = engine_config(fakes.CFG, **flat)
  config = dataclasses.replace(config, tiers=TiersConfig(host_blocks=16, promotion='load'))
  engine = Engine(fakes.CFG, None, config, step_fn=fakes.FakeStep(), **rest)
  docs = prompts([17, 18, 19], seed=5)

  def submit(e):
    for d in docs + docs:  # each evicted by the next two, then asked again
      e.submit(d, SamplingParams(max_new_tokens=2))
  plans = check_plans_name_every_call(engine, submit)
  assert any(p.demotions for p in plans) and any(p.promotions for p in plans)
  engine.tiers.check()


def test_the_simulator_is_a_device_not_an_executor():
  engine = sd.simulated_engine(sizing.PRESETS['smollm2-135m'], 'h100-sxm',
                               engine_config(fakes.CFG, max_seq_len=256)[0])
  assert type(engine.executor) is PlanExecutor  # pylint: disable=unidiomatic-typecheck
  assert isinstance(engine.executor.device, sd.SimulatedDevice)
  assert isinstance(engine.executor.device, Device)
  assert not issubclass(sd.SimulatedDevice, (PlanExecutor, JaxDevice))
  assert issubclass(JaxDevice, Device)


def test_counters_have_one_owner():
  """engine.stats is the metrics' counters, and no library module writes a `stats` counter."""
  engine = sd.simulated_engine(sizing.PRESETS['smollm2-135m'], 'h100-sxm',
                               engine_config(fakes.CFG, max_seq_len=256)[0])
  engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
  assert engine.stats is engine.metrics.counters and engine.stats['generated_tokens'] == 3
  writes = []
  for path in (ROOT / 'pagedjax').rglob('*.py'):
    for node in ast.walk(ast.parse(path.read_text())):
      targets = (node.targets if isinstance(node, ast.Assign) else
                 [node.target] if isinstance(node, ast.AugAssign) else [])
      for t in targets:
        if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute)
            and t.value.attr == 'stats'):
          writes.append(f'{path.relative_to(ROOT)}:{node.lineno}')
  assert not writes, writes
