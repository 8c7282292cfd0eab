"""Calibrate the simulator on this machine and validate it against real runs (SmolLM2-135M, CPU).

  python -m experiments.simulate --config=configs/simulate_cpu.py --workdir=runs/sim_cpu --calibrate
  python -m experiments.simulate --config=configs/simulate_cpu.py --workdir=runs/sim_cpu_replay
  python -m experiments.simulate --config=configs/simulate_cpu.py:tiny --workdir=runs/sim_cpu_tiny --calibrate
  python -m experiments.simulate --config=configs/simulate_cpu.py:tiny --workdir=runs/sim_cpu_tiny_replay

--calibrate profiles the real jitted step of SmolLM2-135M-Instruct (float32, xla attention) over
every (rows, tokens, table width) bucket this engine config uses, at several contexts and fill
levels, in `calibration.rounds` shuffled rounds; between rounds it runs the real engine on the
trace below (`calibration.validation_runs` times), so profile and validation share the machine's
load. It fits the cost model (pagedjax/sim/calibrate.py), writes WORKDIR/hardware_profile.json,
and reports per-iteration and end-to-end errors of the simulation against those real runs.
Without --calibrate, the same trace is simulated with the profile named in sim.hardware (the one
the first command writes; another: --config.sim.hardware=DIR/hardware_profile.json).
`:tiny` is the same pipeline on a 1-layer random Llama (seconds): its profile is
runs/sim_cpu_tiny/hardware_profile.json, and its replay simulates that model (sim.model
'config.model'), not SmolLM2.

The trace: ShareGPT's length laws clipped to 256 prompt / 96 output tokens (calibrate=False:
the plain laws clipped, so the means are lower than ShareGPT's), Poisson arrivals at 0.33
requests/s: below this CPU's capacity (~0.45/s measured), so queues stay bounded and TTFT is a
property of the steps rather than of how far a backlog has grown.
"""
import ml_collections

from configs import simulate_vllm
from pagedjax.config import Config


def get_config(arg=None):
  config = Config().to_configdict()
  # The cost model walks the xla kernel's loop steps (kernels/xla_loops.py); the native cpu
  # kernel that 'auto' now picks on CPU has no cost model yet, so calibrate on the path it models.
  config.attention.impl = 'xla'
  config.engine.update(dict(max_seq_len=512, max_batch_size=16, prefill_chunk=64))
  config.scheduler.max_num_batched_tokens = 256
  config.pool.update(dict(block_size=16, num_blocks=192))
  config.sim = simulate_vllm.simulation('smollm2-135m', 'runs/sim_cpu/hardware_profile.json',
                                        weight_dtype='fp32')
  config.sim.activation_dtype = 'fp32'
  config.sim.num_blocks = 192  # the real run's pool, not what this machine's RAM would hold
  config.trace = ml_collections.ConfigDict(dict(
      dataset='sharegpt', num_requests=40, rate=0.33, seed=0, max_input_len=256,
      max_output_len=96, calibrate=False))
  config.sweep = [{}]
  config.study = 'replay'
  config.title = 'SmolLM2-135M on this CPU with its calibrated profile'
  config.table_columns = ['trace_requests', 'iterations', 'generated_tokens_per_s',
                          'ttft_p50_s', 'tpot_p50_s', 'preemptions']
  config.calibration = ml_collections.ConfigDict(dict(
      rounds=6, validation_runs=3, fills=[0.25, 0.5, 1.0], peak_rounds=5, copy_mb=256))
  if arg == 'tiny':
    config.sim.model = 'config.model'  # the replay simulates the model that was calibrated
    config.sim.hardware = 'runs/sim_cpu_tiny/hardware_profile.json'
    config.title = 'A tiny random Llama on this CPU with its calibrated profile'
    config.model.source = 'random'
    config.model.random.update(dict(vocab_size=256, d_model=32, num_layers=1, num_heads=2,
                                    num_kv_heads=1, head_dim=16, ffn_dim=64, max_seq_len=256))
    # Two rows, 64-token sequences: three step shapes to compile.
    config.engine.update(dict(max_seq_len=64, max_batch_size=2, prefill_chunk=16))
    config.scheduler.max_num_batched_tokens = 32
    config.pool.num_blocks = 12
    config.sim.num_blocks = 12
    config.trace.update(dict(num_requests=4, rate=50.0, max_input_len=30, max_output_len=12))
    config.calibration.update(dict(rounds=2, validation_runs=1, fills=[1.0], peak_rounds=1,
                                   copy_mb=16))
  elif arg:
    raise ValueError(f'configs/simulate_cpu.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
