#!/usr/bin/env bash
# The main job on one machine: install harnessrl for local runs, build the tiny model (no download), and train
# it through the example harness with `harnessrl run` (vLLM on the CPU, capture proxy, harness processes,
# DeepSpeed learner). Progress is shown live; the summary and runs/vowels/reward.png come at the end.
# Ctrl-C stops cleanly; running it again resumes. Extra arguments go to `harnessrl run` (e.g. --steps 5).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh local
# shellcheck disable=SC1091
. .venv/bin/activate
harnessrl validate examples/vowels/trainingrun.yaml
[ -f examples/vowels/tiny-model/config.json ] || harnessrl tiny-model examples/vowels/tiny-model
harnessrl run examples/vowels/trainingrun.yaml "$@"
