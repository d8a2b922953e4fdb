"""examples/swe's pipeline without a model: the harness's scripted modes through the runner's process backend
(spec.harness.verifier: the harness, then ``harnessrl swe verify`` on its workspace) and the real capture proxy.

The tiny random model fixes no bug, so what shows the pipeline is right is this: the harness applying each
task's known fix (``--mode oracle``) is scored 1 on every task of examples/swe/tasks.jsonl, and leaving the bug
(``--mode noop``) 0, every reward coming from the verifier, which alone has the token. Each verification runs
the library's real tests in a fresh sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import harness_modes
import pytest
from harness_modes import TOKEN
from proxy_servers import loops, make_proxy, upstream  # noqa: F401 - pytest fixtures

from harnessrl.store import RolloutState

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "swe"
RUN = "swe-modes"


def tasks() -> list[dict]:
    return [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]


def run_mode(mode: str, chosen: list[dict], proxy, workdir: Path) -> dict[str, tuple[int | None, str | None]]:
    """Every chosen task once in ``mode``, all at once; returns each rollout's exit code and detail."""
    return harness_modes.run_mode(EXAMPLE, ["swe", "verify"], RUN, mode, chosen, proxy, workdir, timeout_s=600.0)


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_the_known_fix_scores_1_on_every_task_and_the_bug_0(upstream, make_proxy, store, tmp_path):  # noqa: F811
    proxy = make_proxy([upstream.url], reward_token=TOKEN, rollout_id=None, run=RUN)  # the runner's gateway
    every = tasks()
    run_mode("oracle", every, proxy, tmp_path / "oracle")
    first_per_library = list({task["data"]["repo"]: task for task in reversed(every)}.values())
    run_mode("noop", first_per_library, proxy, tmp_path / "noop")
    proxy.flush()
    for mode, chosen, expected in (("oracle", every, 1.0), ("noop", first_per_library, 0.0)):
        for task in chosen:
            attempt = store.get_attempt(f"{mode}-{task['id']}", 0)
            assert attempt.state in (RolloutState.RUNNING, RolloutState.QUEUED)  # no scheduler settles it here
            assert attempt.reward == expected, (mode, task["id"], attempt.reward_info)
            fail_to_pass = len(task["data"]["FAIL_TO_PASS"])
            assert attempt.reward_info["fail_to_pass"] == f"{fail_to_pass if expected else 0}/{fail_to_pass}"
            pass_to_pass = len(task["data"]["PASS_TO_PASS"])
            assert attempt.reward_info["pass_to_pass"] == f"{pass_to_pass}/{pass_to_pass}"
            # the bug is the one change from the release, and the fix undoes it
            assert attempt.reward_info["changed_files"] == ([] if expected else [task["data"]["mutation"]["path"]])
