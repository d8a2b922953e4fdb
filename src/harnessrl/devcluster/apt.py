"""Debian packages the dev cluster runs, installed with apt-get when missing (CI machines start without them)."""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

APT_LOCK = "/run/lock/harnessrl-apt.lock"
"""Held around every apt-get run of the project's scripts (bash: ``flock``): scripts/test.sh installs from several
steps at once, and apt-get refuses to start, not waits, while another holds dpkg's lock."""


def install_missing(packages: dict[str, str], what: str, log: Callable[[str], None]) -> str | None:
    """Install the packages (``{path it provides: package}``) whose path is missing; returns None, or one line
    saying why they could not be installed (not root, or the apt-get command that failed and its last line)."""
    missing = sorted({package for path, package in packages.items() if not Path(path).exists()})
    if not missing:
        return None
    if os.geteuid() != 0:
        names = " ".join(missing)
        return f"{what}: {names} missing, and not root to install them (apt-get install {names})"
    log(f"{what}: installing {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with open(APT_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
            result = subprocess.run(command, capture_output=True, text=True, env=env)
            if result.returncode != 0:
                tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
                return f"{what}: `{' '.join(command)}` failed: {tail[0]}"
    return None
