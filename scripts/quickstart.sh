#!/usr/bin/env bash
# The main job on one machine: install harnessrl for local runs, build the tiny model, check the example run.
# (`harnessrl run` joins in here once the local runner lands; see the README's status table.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh local
# shellcheck disable=SC1091
. .venv/bin/activate
mkdir -p runs
[ -f runs/tiny-model/config.json ] || harnessrl tiny-model runs/tiny-model
harnessrl validate examples/*.yaml
