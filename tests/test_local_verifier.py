"""``spec.harness.verifier`` in ``harnessrl run``: real processes. The harness leaves its work in the attempt's
workspace and never sees the reward URL or token; the verifier runs after it, on that workspace, with both;
the verifier's exit is the attempt's; a harness that fails is not verified. (The proxy's refusal of a reward
without the token is in test_proxy_replicas.py; the pod layout in test_render.py.)"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from harnessrl.local.processes import ProcessBackend
from harnessrl.scheduler import HarnessExit, Launch

HARNESS = """
import json, os, sys
task = json.loads(os.environ["HARNESSRL_TASK"])["data"]
seen = {k: k in os.environ for k in ("HARNESSRL_REWARD_URL", "HARNESSRL_REWARD_TOKEN")}
open(os.path.join(os.environ["HARNESSRL_WORKSPACE"], "work.json"), "w").write(json.dumps({"seen": seen, **task}))
sys.exit(task["harness_exit"])
"""

VERIFIER = """
import json, os, sys
workspace = os.environ["HARNESSRL_WORKSPACE"]
work = json.load(open(os.path.join(workspace, "work.json")))
seen = {k: os.environ.get(k) for k in ("HARNESSRL_REWARD_URL", "HARNESSRL_REWARD_TOKEN", "HARNESSRL_ROLLOUT_ID")}
open(os.path.join(workspace, "verified.json"), "w").write(json.dumps(seen))
sys.exit(work["verifier_exit"])
"""


def launch(rollout: str, harness_exit: int, verifier_exit: int) -> Launch:
    task = {"id": "t", "data": {"harness_exit": harness_exit, "verifier_exit": verifier_exit}}
    return Launch("run", rollout, 0, "t", task, 0, 60.0)


def ended(backend: ProcessBackend, count: int) -> dict[str, HarnessExit]:
    deadline = time.monotonic() + 60
    while True:
        exits = {exit.rollout_id: exit for exit in backend.exits()}
        if len(exits) == count:
            return exits
        assert time.monotonic() < deadline, f"only {sorted(exits)} ended"
        time.sleep(0.05)


@pytest.fixture
def backend(tmp_path: Path):
    made = ProcessBackend(
        [sys.executable, "-c", HARNESS], tmp_path,
        env_for=lambda launch: {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1"},
        verifier=[sys.executable, "-c", VERIFIER],
        verifier_env_for=lambda launch: {
            "HARNESSRL_REWARD_URL": f"http://127.0.0.1:9/rollouts/{launch.rollout_id}/attempts/0/v1/reward",
            "HARNESSRL_REWARD_TOKEN": "secret-token",
        },
    )
    yield made
    made.shutdown()


def test_the_verifier_scores_the_workspace_the_harness_left_and_alone_holds_the_token(
    backend: ProcessBackend, tmp_path: Path
) -> None:
    for rollout, codes in {"ok": (0, 0), "harness-fails": (3, 0), "rejected": (0, 5)}.items():
        backend.launch(launch(rollout, *codes))
    exits = ended(backend, 3)
    assert (exits["ok"].exit_code, exits["ok"].detail) == (0, None)
    assert (exits["harness-fails"].exit_code, exits["harness-fails"].detail) == (3, None)
    assert (exits["rejected"].exit_code, exits["rejected"].detail) == (5, "verifier exited 5")

    workspace = tmp_path / "rollouts" / "ok-a0"
    work = json.loads((workspace / "work.json").read_text())
    assert work["seen"] == {"HARNESSRL_REWARD_URL": False, "HARNESSRL_REWARD_TOKEN": False}
    verified = json.loads((workspace / "verified.json").read_text())
    assert verified == {
        "HARNESSRL_REWARD_URL": "http://127.0.0.1:9/rollouts/ok/attempts/0/v1/reward",
        "HARNESSRL_REWARD_TOKEN": "secret-token",
        "HARNESSRL_ROLLOUT_ID": "ok",
    }
    assert not (tmp_path / "rollouts" / "harness-fails-a0" / "verified.json").exists()  # never verified
    assert backend.alive() == set()
