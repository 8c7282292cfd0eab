"""Accelerator-scale studies without the accelerator: the engine's real host code on a simulated
device whose time comes from a calibrated cost model.

  hardware.py          device presets from public spec sheets (sources cited), efficiency factors
  cost_model.py        seconds per step call and per block transfer: a roofline per op class
  simulated_device.py  the backend Engine(backend=...) takes: a pool without arrays, a step and
                       executor that advance a simulated clock; simulated_engine() builds one
  sim_config.py        config.sim: its fields checked (one ConfigError naming the field), the
                       model shape and device a simulation uses
  calibrate.py         profiles the real jitted step on this machine, fits the efficiencies,
                       and checks the simulator against a real run (per iteration, end to end)

Entry point: experiments/simulate.py. Every figure a simulation produces is simulated seconds
on a modelled device, and is marked so in every file and table it writes.
"""
