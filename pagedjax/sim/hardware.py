"""Hardware presets for the simulator: public specifications, plus efficiency factors.

A `Hardware` is what the cost model (cost_model.py) needs of one device: HBM capacity and
bandwidth, peak dense bf16 FLOP/s, the host link (swap traffic) and the interconnect between
devices (tensor-parallel all-reduces). Every figure of a preset comes from the vendor's public
spec sheet, cited next to it; where a sheet gives no figure, the comment says what was assumed.

Units: bytes, bytes/s and FLOP/s in SI units (1 GB/s = 1e9 B/s). HBM capacity is in GiB: the
sheets' "80GB" of an H100 is 80 GiB of HBM3 (nvidia-smi reports 81559 MiB; the difference is the
driver's reserve), the same holds for the A100s, and Google's TPU pages quote "16 GB"/"32 GB"
for 16/32 GiB parts. Bandwidths quoted as "bidirectional" are halved: a swap or a ring
all-reduce step sends one way at a time on each link.

`Efficiency` holds what a spec sheet cannot: the share of peak a real step reaches per op class,
and fixed overheads. `--calibrate` (experiments/simulate.py, calibrate.py) fits them on the
machine it runs on and writes a profile (`save_profile` / `load_profile`, a JSON file). The
accelerator presets carry ASSUMED defaults, not calibrated ones: no accelerator was available to
this project when they were written (see DEFAULT_ACCELERATOR_EFFICIENCY for the reasoning), so
their absolute times are estimates and ratios between configurations are the figures to trust.
"""
import dataclasses
import json
import math
import re
from typing import Optional, Union

GB = 1e9
GIB = 2**30
TB = 1e12
TFLOPS = 1e12

ATTENTION_READS = ('per_row', 'batch_max')


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Shares of peak that a step reaches per op class (cost_model.py), and overheads.

  matmul_flops, weight_bandwidth: projections, MLP and the output head (dense matmuls reading
    the weights once per step).
  attention_flops, kv_bandwidth: paged attention (scores and weighted values; K/V reads).
  elementwise_bandwidth: norms, residual adds, RoPE, SwiGLU's product, the K/V write.
  step_overhead_s: per device call (launch, dispatch, the host reading the sampled ids back).
  chunk_overhead_s: added per prompt-chunk call (more than one query token per row): what such
    a program costs beyond the roofline of its work. On this CPU (fitted) a 64-token chunk's
    small-M matmuls run well under the large-batch rate, and one shared per-call overhead
    must then be too large for decode calls. 0 for the accelerator presets.
  layer_overhead_s: per layer per call (kernel launches or per-op overheads of a layer).
  iteration_overhead_s, row_overhead_s: host time per engine iteration and per batch row
    (scheduling, block bookkeeping, building the step's inputs): the Python between steps.
  collective_latency_s: fixed cost of one all-reduce or all-gather between devices.
  """
  matmul_flops: float = 0.6
  weight_bandwidth: float = 0.8
  attention_flops: float = 0.4
  kv_bandwidth: float = 0.6
  elementwise_bandwidth: float = 0.6
  step_overhead_s: float = 3e-4
  chunk_overhead_s: float = 0.0
  layer_overhead_s: float = 0.0
  iteration_overhead_s: float = 1e-3
  row_overhead_s: float = 1e-5
  collective_latency_s: float = 1e-5

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      share = not f.name.endswith('_s')
      if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (
          share and not 0 < value <= 1.5):
        allowed = 'a share of peak in (0, 1.5]' if share else 'seconds >= 0'
        raise ValueError(f'Efficiency.{f.name}={value!r} is not allowed: {allowed}')


# Assumed for the accelerator presets (not calibrated: no accelerator was available). Why these:
# - large bf16 GEMMs reach about 60-75% of the dense peak on H100/A100 (vendor GEMM benchmarks),
#   decode-sized ones (few rows) are bandwidth-bound anyway, so 0.6 for matmul_flops;
# - streaming reads reach 80-90% of HBM bandwidth (STREAM-like measurements), 0.8 for weights;
# - paged-attention kernels over 16-token blocks reach less: 0.6 of bandwidth, 0.4 of peak FLOPs;
# - a step costs a few hundred microseconds of launches and host sync even with CUDA graphs,
#   and a Python scheduler about a millisecond per iteration plus ~10 us per running sequence
#   (the order of vLLM's own per-step CPU time in its early versions).
DEFAULT_ACCELERATOR_EFFICIENCY = Efficiency()


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One device. Tensor parallelism uses `tp` identical devices linked by `interconnect_*`."""
  name: str
  hbm_bytes: float            # HBM capacity of one device
  hbm_bandwidth: float        # bytes/s
  peak_flops: float           # dense bf16 FLOP/s (float32 for the CPU profile: what it runs)
  host_link_bandwidth: float  # bytes/s, one direction (swap to and from host RAM)
  interconnect_bandwidth: float  # bytes/s, one direction, per device (all-reduce traffic)
  efficiency: Efficiency = DEFAULT_ACCELERATOR_EFFICIENCY
  # How the attention kernel walks a batch: 'per_row' (GPU/TPU kernels stop at each row's own
  # context) or 'batch_max' (this CPU's xla kernel, kernels/xla.py: every row of a batch half
  # steps to that half's longest context, padded rows included).
  attention_reads: str = 'per_row'
  calibrated: bool = False  # efficiency fitted on this device (True) or assumed (False)
  source: str = ''  # where the spec figures come from

  def __post_init__(self):
    for name in ('hbm_bytes', 'hbm_bandwidth', 'peak_flops', 'host_link_bandwidth',
                 'interconnect_bandwidth'):
      value = getattr(self, name)
      # Rates may be infinite (an ideal device, e.g. compute-only in tests); memory may not.
      finite = name == 'hbm_bytes'
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (
          finite and not math.isfinite(value)):
        raise ValueError(f'Hardware.{name}={value!r} is not allowed: a '
                         f'{"finite " if finite else ""}number > 0')
    if self.attention_reads not in ATTENTION_READS:
      raise ValueError(f'Hardware.attention_reads={self.attention_reads!r} is not allowed: '
                       f'one of {ATTENTION_READS}')

  def with_efficiency(self, **changes) -> 'Hardware':
    return dataclasses.replace(self, efficiency=dataclasses.replace(self.efficiency, **changes))


PRESETS = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (nvidia.com/en-us/data-center/h100):
    # 80GB HBM3, 3.35 TB/s; BF16 Tensor Core 1,979 TFLOPS *with sparsity*, so 989.5 dense;
    # NVLink 900 GB/s (bidirectional: 450 one way); PCIe Gen5 128 GB/s (64 one way).
    'h100-sxm': Hardware(
        'H100 SXM', hbm_bytes=80 * GIB, hbm_bandwidth=3.35 * TB, peak_flops=989.5 * TFLOPS,
        host_link_bandwidth=64 * GB, interconnect_bandwidth=450 * GB,
        source='NVIDIA H100 Tensor Core GPU datasheet (SXM5)'),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column (nvidia.com/en-us/data-center/h200):
    # 141GB HBM3e, 4.8 TB/s; BF16 1,979 TFLOPS with sparsity (989.5 dense); NVLink 900 GB/s;
    # PCIe Gen5 128 GB/s.
    'h200': Hardware(
        'H200 SXM', hbm_bytes=141 * GIB, hbm_bandwidth=4.8 * TB, peak_flops=989.5 * TFLOPS,
        host_link_bandwidth=64 * GB, interconnect_bandwidth=450 * GB,
        source='NVIDIA H200 Tensor Core GPU datasheet (SXM)'),
    # NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM" column: HBM2e 2,039 GB/s; BF16
    # Tensor Core 312 TFLOPS dense (624 with sparsity); NVLink 600 GB/s (300 one way); PCIe
    # Gen4 64 GB/s (32 one way).
    'a100-80gb': Hardware(
        'A100 80GB SXM', hbm_bytes=80 * GIB, hbm_bandwidth=2.039 * TB, peak_flops=312 * TFLOPS,
        host_link_bandwidth=32 * GB, interconnect_bandwidth=300 * GB,
        source='NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)'),
    # Same datasheet, "A100 40GB SXM" column: HBM2 1,555 GB/s; the rest as the 80GB part. The
    # vLLM paper's OPT-13B runs used this GPU.
    'a100-40gb': Hardware(
        'A100 40GB SXM', hbm_bytes=40 * GIB, hbm_bandwidth=1.555 * TB, peak_flops=312 * TFLOPS,
        host_link_bandwidth=32 * GB, interconnect_bandwidth=300 * GB,
        source='NVIDIA A100 Tensor Core GPU datasheet (40GB SXM)'),
    # Google Cloud TPU v5e page (cloud.google.com/tpu/docs/v5e): 197 TFLOPs bf16, 16 GB HBM2 at
    # 819 GBps, ICI 400 GBps bidirectional per chip (200 one way). The page gives no host-link
    # figure: ASSUMED PCIe Gen4 x16, 32 GB/s one way.
    'tpu-v5e': Hardware(
        'TPU v5e', hbm_bytes=16 * GIB, hbm_bandwidth=819 * GB, peak_flops=197 * TFLOPS,
        host_link_bandwidth=32 * GB, interconnect_bandwidth=200 * GB,
        source='Google Cloud TPU v5e system architecture page; host link assumed'),
    # Google Cloud TPU v6e page (cloud.google.com/tpu/docs/v6e): 918 TFLOPs bf16, 32 GB HBM at
    # 1638 GBps, ICI 800 GBps bidirectional per chip (400 one way), "connects to the host
    # through a PCIe Gen5 interface" (x16 assumed: 64 GB/s one way).
    'tpu-v6e': Hardware(
        'TPU v6e (Trillium)', hbm_bytes=32 * GIB, hbm_bandwidth=1638 * GB,
        peak_flops=918 * TFLOPS, host_link_bandwidth=64 * GB, interconnect_bandwidth=400 * GB,
        source='Google Cloud TPU v6e system architecture page; PCIe Gen5 width assumed x16'),
}


def _squash(name: str) -> str:
  return re.sub(r'[^a-z0-9]', '', name.lower())


def get_hardware(name_or_path: Union[str, Hardware]) -> Hardware:
  """A preset ('h100-sxm', 'H100 SXM', 'a100_40gb' name the same ones) or a profile JSON path
  (`save_profile`'s file, e.g. the CPU profile --calibrate writes)."""
  if isinstance(name_or_path, Hardware):
    return name_or_path
  if name_or_path.endswith('.json'):
    return load_profile(name_or_path)
  by_squashed = {_squash(k): v for k, v in PRESETS.items()}
  if _squash(name_or_path) not in by_squashed:
    raise ValueError(f'unknown hardware {name_or_path!r}; allowed: {", ".join(PRESETS)} or a '
                     'profile .json written by `experiments.simulate --calibrate`')
  return by_squashed[_squash(name_or_path)]


def to_dict(hw: Hardware) -> dict:
  return dataclasses.asdict(hw)


def from_dict(d: dict) -> Hardware:
  d = dict(d)
  eff = Efficiency(**d.pop('efficiency', {}))
  known = {f.name for f in dataclasses.fields(Hardware)}
  return Hardware(**{k: v for k, v in d.items() if k in known}, efficiency=eff)


def save_profile(path: str, hw: Hardware, extra: Optional[dict] = None) -> None:
  """The hardware with its fitted efficiency, and `extra` (the fit's data and errors)."""
  with open(path, 'w') as f:
    json.dump({'hardware': to_dict(hw), **(extra or {})}, f, indent=1)


def _finite_figures(d: dict) -> dict:
  """A profile's hardware section, every number in it finite (a fitted profile has no ideal
  device in it: Infinity or NaN there is damage)."""
  for key, value in list(d.items()) + [(f'efficiency.{k}', v)
                                        for k, v in (d.get('efficiency') or {}).items()]:
    if isinstance(value, float) and not math.isfinite(value):
      raise ValueError(f'hardware.{key}={value!r} is not allowed: a finite number')
  return d


def load_profile(path: str) -> Hardware:
  try:
    with open(path) as f:
      return from_dict(_finite_figures(json.load(f)['hardware']))
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f'hardware profile {path!r} does not load ({type(e).__name__}: {e}); '
                     'write one with `python -m experiments.simulate --calibrate ...`') from None
