#!/usr/bin/env bash
# Paged-attention kernels on a GPU machine: the kernel tests un-interpreted, then the benchmark.
#
#   bash experiments/gpu_check.sh            # results under $OUT (if set) or runs/gpu_check
#
# Expects a Python with a CUDA jax/jaxlib, triton and torch (the lent H200 image has them; its
# python3 is jax 0.11.2 / Python 3.12). jax_triton is not in that image: put its wheel in .whl/
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl jax-triton==0.3.1`)
# and this script installs it into /tmp/site; without it the `triton` path is skipped, and the
# Pallas GPU kernel (no extra package) still runs. Takes a few minutes; nothing asserts a time.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${OUT:-runs/gpu_check}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
# XLA on GPU runs float32 matmuls in TF32 by default; the equality tests compare at float32.
export JAX_DEFAULT_MATMUL_PRECISION=highest

if ls .whl/jax_triton-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/jax_triton-*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

{
  nvidia-smi -L 2>/dev/null
  $PY - <<'EOF'
import importlib, platform
import jax
print('python', platform.python_version(), '| jax', jax.__version__, '| backend',
      jax.default_backend(), '|', jax.devices()[0].device_kind)
for name in ('triton', 'jax_triton', 'torch'):
  try:
    print(name, importlib.import_module(name).__version__)
  except Exception as e:  # jax_triton raises more than ImportError on a mismatched jax
    print(name, 'unavailable:', type(e).__name__, str(e)[:200])
EOF
} 2>&1 | tee "$RESULTS/versions.txt"

# The conformance suite with every path for real: pallas_gpu compiles through Triton for this
# GPU, and with TRITON_INTERPRET=0 the triton path launches through jax_triton (its cases skip,
# with the reason, if jax_triton is missing). pallas_tpu is interpreted off TPU and already
# covered on CPU.
TRITON_INTERPRET=0 timeout 600 $PY -m pytest -q -rs tests/test_kernels.py -k 'not pallas_tpu' \
  2>&1 | tee "$RESULTS/test_kernels.txt" | tail -25

# BENCH_CONFIG: the benchmark's config and overrides, e.g. configs/bench_attention.py:tiny for a
# dry run of this script on a CPU machine; BENCH_ARGS: extra flags.
BENCH_CONFIG=${BENCH_CONFIG:-configs/bench_attention.py --config.bench.rounds=20}
timeout 900 $PY -m experiments.bench_attention --config=$BENCH_CONFIG --workdir="$RESULTS/bench" ${BENCH_ARGS:-} \
  2>&1 | grep -v '^[IW][0-9]' | tee "$RESULTS/bench.txt"

$PY - "$RESULTS/bench/summary.json" <<'EOF'
import json, sys
try:
  summary = json.load(open(sys.argv[1]))
except OSError as e:
  sys.exit(f'no benchmark summary: {e}')
print(f"\n{'shape':<18}{'best paged':<12}{'x contiguous':>13}{'GB/s':>9}{'of copy':>9}"
      f"{'copy GB/s':>11}   all (ms)")
for key, f in summary['figures'].items():
  ms = ' '.join(f'{name}={t:.3f}' for name, t in f['ms'].items())
  print(f"{key:<18}{f['best_paged']:<12}{f['paged_over_contiguous']:>13.2f}"
        f"{f['achieved_read_gbs']:>9.0f}{f['bandwidth_fraction']:>9.0%}{f['copy_gbs']:>11.0f}   {ms}")
EOF
