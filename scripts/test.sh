#!/usr/bin/env bash
# The test command: install what the tests need, start a throwaway PostgreSQL, run the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k store -x).
set -euo pipefail
cd "$(dirname "$0")/.."
# The Kubernetes tests run on a real control plane built from Go modules (cached under ~/.cache/harnessrl;
# a cold build takes tens of minutes, a warm one nothing). It builds with the system Python while pip fills
# the venv (the build is CPU-bound, the install mostly waits on downloads), and before pytest, so its time is
# not charged to a test's timeout. A cluster test that cannot start its cluster then fails, never skips,
# unless HARNESSRL_TEST_KUBE_REQUIRED=0 is set by hand.
kube_log=$(mktemp)
python3 src/harnessrl/devcluster/build.py --node >"$kube_log" 2>&1 &
kube_build=$!
scripts/setup.sh test
# shellcheck disable=SC1091
. .venv/bin/activate
# The images (podman: downloads and disk, little CPU) build while Go compiles, and go into the real node's image
# store there too (`--node-store`: a containerd started for the import alone), so the first real-node test
# imports nothing. Cached by their inputs (~/.cache/harnessrl/images and podman's store): a warm run builds and
# imports nothing, a source change rebuilds the project layer of the images that copy it.
images_log=$(mktemp)
scripts/kube.sh images --node-store >"$images_log" 2>&1 &
images_build=$!
# shellcheck disable=SC1091
. scripts/postgres.sh
if start_postgres; then
  export HARNESSRL_TEST_PG_REQUIRED=1   # a server is up: a PostgreSQL test that cannot reach it must fail
else
  echo "WARNING: no PostgreSQL server could be started; PostgreSQL tests will be skipped" >&2
fi
trap stop_postgres EXIT
export HARNESSRL_TEST_KUBE_REQUIRED="${HARNESSRL_TEST_KUBE_REQUIRED:-1}"
scripts/chart-tools.sh || echo "WARNING: no helm or no prometheus; the chart tests will fail" >&2
# The trace explorer's browser tests drive Debian's Chromium (Playwright with executable_path, never its own
# browser download); its chart library comes from npm, pinned (an editable install does not run the build hook).
# Only what is missing: Debian's npm conflicts with a Node.js from elsewhere (NodeSource's, which brings its npm).
ui_packages=()
[ -x /usr/bin/chromium ] || ui_packages+=(chromium)
command -v npm >/dev/null || ui_packages+=(npm)
if [ ${#ui_packages[@]} -gt 0 ]; then
  scripts/apt-install.sh "${ui_packages[@]}" ||
    echo "WARNING: ${ui_packages[*]} could not be installed; the UI tests will fail" >&2
fi
python src/harnessrl/ui/vendor.py || echo "WARNING: the UI's assets could not be fetched; the UI tests will fail" >&2
scripts/harness-clis.sh >/dev/null || echo "WARNING: Claude Code / Codex CLI not installed; the harness_cli tests will fail" >&2
# The coding example: bubblewrap (the sandbox of tests/test_swe_*) and mini-swe-agent in its own environment.
scripts/swe-agent.sh >/dev/null || echo "WARNING: bubblewrap or mini-swe-agent not installed; the swe tests will fail" >&2
# `build --node` also installs the Debian packages the real node runs (containerd, runc, CNI plugins, ...).
if wait "$kube_build"; then cat "$kube_log" >&2; scripts/kube.sh build --node; else
  cat "$kube_log" >&2; echo "WARNING: the Kubernetes control plane could not be built; its tests will fail" >&2
fi
if ! wait "$images_build"; then echo "WARNING: the images could not be built; the real_node tests will fail" >&2; fi
cat "$images_log" >&2
rm -f "$kube_log" "$images_log"
# pytest's exit code is the script's (not exec: the EXIT trap must stop PostgreSQL); 5, nothing collected,
# is a failure too.
pytest "$@"
