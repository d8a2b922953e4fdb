"""A child the runner started does not outlive it, even when the runner is killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

PARENT = """
import subprocess, sys, time
from harnessrl.local.orphans import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                         preexec_fn=die_with_parent())
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie waiting for init counts as gone
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("use_it", [True, False])
def test_a_child_dies_with_its_killed_parent(use_it: bool):
    script = PARENT if use_it else PARENT.replace("preexec_fn=die_with_parent()", "preexec_fn=None")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)  # no handler runs: only the kernel can stop the child now
        parent.wait(10)
        deadline = time.monotonic() + (10 if use_it else 2)
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(child) is not use_it  # without it, the child is left running (the bug it fixes)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
