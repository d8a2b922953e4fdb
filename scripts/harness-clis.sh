#!/usr/bin/env bash
# The coding-agent CLIs the harness_cli tests run unchanged (tests/test_harness_clis.py), pinned, installed with
# npm from the npm registry into ~/.cache/harnessrl/harness-clis/ (XDG_CACHE_HOME moves it), never into the
# repository; nothing is downloaded when they are there. scripts/test.sh runs this. Prints the native binary of
# each, one line each: "claude <path>" and "codex <path>".
#
# Both packages ship a native binary in a per-platform optional dependency, which is what runs: Claude Code 2.1
# declares node >= 22 (Debian's node is 20) but its binary needs no node; install scripts are not run.
set -euo pipefail
CLAUDE_CODE_VERSION=2.1.332
CODEX_VERSION=0.171.0
root="${XDG_CACHE_HOME:-$HOME/.cache}/harnessrl/harness-clis"

if ! command -v npm >/dev/null; then
  "$(dirname "$0")/apt-install.sh" npm
fi

# install PACKAGE VERSION: the prefix it is installed under (installed once; a half-done install is redone)
install() {
  local prefix="$root/${1//\//+}@$2"
  if [ ! -f "$prefix/.installed" ]; then
    mkdir -p "$root"
    rm -rf "$prefix.partial"
    npm install --prefix "$prefix.partial" --no-audit --no-fund --no-save --ignore-scripts --loglevel=error \
      "$1@$2" >&2
    rm -rf "$prefix"
    mv "$prefix.partial" "$prefix"
    touch "$prefix/.installed"
  fi
  echo "$prefix"
}

binary() {  # PREFIX PATTERN: the one native binary of the installed package
  local found
  found=$(find "$1/node_modules" -path "$2" -type f -perm -u+x | head -1)
  if [ -z "$found" ]; then echo "no binary $2 under $1 (an unsupported platform?)" >&2; exit 1; fi
  echo "$found"
}

claude=$(install @anthropic-ai/claude-code "$CLAUDE_CODE_VERSION")
codex=$(install @openai/codex "$CODEX_VERSION")
echo "claude $(binary "$claude" '*/@anthropic-ai/claude-code-linux-*/claude')"
echo "codex $(binary "$codex" '*/@openai/codex-linux-*/bin/codex')"
