"""Children that do not outlive the runner: vLLM, the proxy, the learner and harness runs.

The runner stops its children on every way out it can see (return, exception, SIGINT, SIGTERM), but not when
it is killed outright (SIGKILL, the OOM killer, a test's timeout): the children, each in its own session,
would go on holding ports, GPU or CPU memory and the store. Linux's parent-death signal closes that gap: a
child asks the kernel for SIGTERM when the process that started it dies, and shuts down as it would on any
SIGTERM (the proxy flushes its queue first).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Resolved here, before any fork: the child between fork and exec only makes one foreign call and two
# system calls (no imports, no dlopen), which is what makes a preexec_fn safe next to other threads.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` (None where the platform has no parent-death signal).

    Spawn from a thread that lives as long as the process (the kernel ties the signal to the spawning
    thread); the runner spawns from its main thread.
    """
    if _prctl is None:
        return None
    prctl, parent, term = _prctl, os.getpid(), int(signal.SIGTERM)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, term)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), term)

    return preexec
