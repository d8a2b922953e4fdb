#!/usr/bin/env bash
# apt-install.sh PACKAGE...: install Debian packages, as root, holding the project's apt lock
# (/run/lock/harnessrl-apt.lock, also taken by harnessrl.devcluster.apt): scripts/test.sh installs from several
# steps at once, and apt-get refuses to start, rather than waits, while another apt-get holds dpkg's lock.
# The package lists are updated only when an install from the current ones fails.
set -euo pipefail
if [ "$(id -u)" != 0 ]; then echo "$* not installed and not root to install them: apt-get install $*" >&2; exit 1; fi
export DEBIAN_FRONTEND=noninteractive
mkdir -p /run/lock && exec 9>/run/lock/harnessrl-apt.lock
flock 9
apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 ||
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }
