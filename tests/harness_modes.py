"""An example harness's scripted modes (oracle, no-op) through the runner's process backend: the harness, then
the example's verifier on its workspace with the reward URL and the token only the verifier gets, all rollouts at
once, as spec.harness.verifier runs them; the rewards land in the proxy's store."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from harnessrl.local.processes import ProcessBackend
from harnessrl.scheduler import Launch

HARNESSRL = str(Path(sys.executable).with_name("harnessrl"))
TOKEN = "verifier-only-0123456789abcdef"


def run_mode(example: Path, verifier: list[str], run: str, mode: str, chosen: list[dict], proxy, workdir: Path,
             timeout_s: float, args: Sequence[str] = ()) -> dict[str, tuple[int | None, str | None]]:
    """Every chosen task once as rollout ``{mode}-{task id}`` (the harness with ``--mode mode`` and ``args``;
    its workspace is ``workdir/rollouts/{rollout}-a0``); returns each rollout's exit code and detail, all 0."""
    def base(launch: Launch) -> str:
        return f"{proxy.url}/rollouts/{launch.rollout_id}/attempts/{launch.attempt}/v1"

    backend = ProcessBackend(
        [sys.executable, str(example / "harness.py"), "--mode", mode, *args], workdir, cwd=example,
        env_for=lambda launch: {"OPENAI_BASE_URL": base(launch)},
        verifier=[HARNESSRL, *verifier],
        verifier_env_for=lambda launch: {"HARNESSRL_REWARD_URL": f"{base(launch)}/reward",
                                         "HARNESSRL_REWARD_TOKEN": TOKEN},
    )
    ended: dict[str, tuple[int | None, str | None]] = {}
    try:
        for task in chosen:
            backend.launch(Launch(run, f"{mode}-{task['id']}", 0, task["id"], task, 0, timeout_s))
        deadline = time.monotonic() + timeout_s
        while len(ended) < len(chosen):
            ended.update({e.rollout_id: (e.exit_code, e.detail) for e in backend.exits()})
            assert time.monotonic() < deadline, f"still running: {backend.alive()}"
            time.sleep(0.2)
    finally:
        backend.shutdown()
    logs = {rollout: (workdir / "rollouts" / f"{rollout}-a0" / "harness.log").read_text()[-3000:]
            for rollout, (code, _) in ended.items() if code != 0}
    assert not logs, (ended, logs)
    return ended
