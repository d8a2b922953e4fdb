#!/usr/bin/env bash
# What the coding example (examples/swe) needs beside harnessrl: Debian's bubblewrap (the sandbox every
# command of the agent and every test run goes through) and mini-swe-agent, the coding agent, pinned, from
# PyPI into its own virtual environment under ~/.cache/harnessrl/ (XDG_CACHE_HOME moves it), never into the
# project's: its litellm pulls boto3, whose botocore pins python-dateutil below 3 while the kubernetes client
# needs 3 or later, so the two cannot share one environment. Nothing is downloaded when both are there.
# scripts/test.sh runs this. Prints the agent's command: "mini <path>".
set -euo pipefail
MINI_SWE_AGENT_VERSION=2.4.6
root="${XDG_CACHE_HOME:-$HOME/.cache}/harnessrl/mini-swe-agent-$MINI_SWE_AGENT_VERSION"

if ! command -v bwrap >/dev/null; then
  "$(dirname "$0")/apt-install.sh" bubblewrap
fi

if [ ! -f "$root/.installed" ]; then  # a half-done install is redone
  rm -rf "$root"
  python3 -m venv "$root"
  "$root/bin/pip" install -q --disable-pip-version-check "mini-swe-agent==$MINI_SWE_AGENT_VERSION" >&2
  touch "$root/.installed"
fi
echo "mini $root/bin/mini"
