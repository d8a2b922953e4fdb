"""How a harness receives its task, the same under `harnessrl run` and in a pod.

The task is always a JSON file (``HARNESSRL_TASK_FILE``). It is also in ``HARNESSRL_TASK`` when it is small:
Linux caps one environment string at 128 KiB (MAX_ARG_STRLEN), and an exec with a longer one fails with
E2BIG before the harness starts, so a task's JSON above ``TASK_ENV_LIMIT_BYTES`` travels in the file alone.
"""

from __future__ import annotations

TASK_ENV_LIMIT_BYTES = 100 * 1024
"""The largest task JSON also put in HARNESSRL_TASK (below the kernel's 128 KiB, with room for the name)."""


def task_fits_in_env(task_json: str) -> bool:
    return len(task_json.encode()) <= TASK_ENV_LIMIT_BYTES
