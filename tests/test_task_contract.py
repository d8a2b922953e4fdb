"""A task too large for one environment variable reaches the harness in its file alone (issue 22, item 13):
Linux refuses to exec a program with an environment string above 128 KiB (E2BIG), so with the task in
HARNESSRL_TASK a large task's attempt failed before its harness started."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from harnessrl.local.processes import ProcessBackend
from harnessrl.scheduler import Launch
from harnessrl.task_contract import TASK_ENV_LIMIT_BYTES

# The harness exits 0 when the file holds the whole task, and says whether the variable was set.
HARNESS = (
    "import json, os, sys; task = json.load(open(os.environ['HARNESSRL_TASK_FILE'])); "
    "open(os.environ['OUT'], 'w').write(json.dumps([len(task['data']['blob']), 'HARNESSRL_TASK' in os.environ]))"
)


def run_harness(tmp_path: Path, size: int) -> tuple[int | None, list]:
    out = tmp_path / f"out-{size}.json"
    backend = ProcessBackend([sys.executable, "-c", HARNESS], tmp_path / f"work-{size}", env={"OUT": str(out)})
    task = {"id": "big", "data": {"blob": "x" * size}}
    backend.launch(Launch("run", f"run-g000001-r{size}", 0, "big", task, 0, 60.0))
    deadline = time.monotonic() + 60
    while not (exits := backend.exits()):
        assert time.monotonic() < deadline, "the harness never ended"
        time.sleep(0.05)
    backend.shutdown()
    return exits[0].exit_code, json.loads(out.read_text()) if out.exists() else []


def test_small_tasks_are_in_the_variable_too_and_large_ones_in_the_file_alone(tmp_path: Path) -> None:
    assert run_harness(tmp_path, 1000) == (0, [1000, True])
    large = 200 * 1024  # above the kernel's 128 KiB for one string
    assert large > TASK_ENV_LIMIT_BYTES
    assert run_harness(tmp_path, large) == (0, [large, False])
