"""The reward of a coding rollout: the task's tests, run on the harness's final working tree in a fresh sandbox.

Reward 1 when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes, else 0 (no partial
credit: a half-fixed bug, or a fix that breaks another test, is not a fix; the counts are in the reward's
info). The verifier runs in ``spec.harness.verifier`` mode, so it alone holds the reward URL and token.

What is taken from the agent's tree: the library's own modules (the files of the released source distribution
that are not tests), each as the agent left it (or deleted). Everything else comes from the snapshot again:
the tests, every ``conftest.py``, pytest's configuration files, and no file the agent added. So an edited test,
a planted ``conftest.py`` or ``sitecustomize.py`` or an ``addopts`` pointing pytest at a plugin of the agent's
never reaches the test run. The agent's modules do run in the test process, as in SWE-bench: that is the code
under test.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harnessrl.swe.repository import Layout, RepositoryError, unpack
from harnessrl.swe.testrun import run_suite
from harnessrl.swe.workspace import repository_in, snapshot_in


@dataclass(frozen=True)
class Verdict:
    reward: float
    info: dict


def verify(task: dict, workspace: Path) -> Verdict:
    """Score the repository the harness left in ``workspace`` against ``task`` (a SWE-bench-style record)."""
    started = time.monotonic()
    agent_tree = repository_in(workspace, task)
    if not agent_tree.is_dir():
        raise RepositoryError(f"{agent_tree} is missing: the harness leaves the repository it worked on there")
    with tempfile.TemporaryDirectory(prefix="harnessrl-verify-") as scratch:
        root = unpack(snapshot_in(workspace, task), Path(scratch) / "tree")
        layout = Layout(task["python_path"], list(task["test_paths"]), [])
        changed = _take_library_modules(agent_tree, root, layout)
        run = run_suite(root, layout)
    fail_to_pass, pass_to_pass = list(task["FAIL_TO_PASS"]), list(task["PASS_TO_PASS"])
    fixed = [t for t in fail_to_pass if t in run.passed]
    kept = [t for t in pass_to_pass if t in run.passed]
    reward = 1.0 if len(fixed) == len(fail_to_pass) and len(kept) == len(pass_to_pass) else 0.0
    info = {
        "fail_to_pass": f"{len(fixed)}/{len(fail_to_pass)}",
        "pass_to_pass": f"{len(kept)}/{len(pass_to_pass)}",
        "changed_files": changed,
        "still_failing": sorted(set(fail_to_pass) - set(fixed))[:10],
        "broken": sorted(set(pass_to_pass) - set(kept))[:10],
        "verifier_seconds": round(time.monotonic() - started, 2),
    }
    problem = run.why_not_run()
    if problem:
        info["tests_not_run"] = problem[:500]
    return Verdict(reward, info)


def _take_library_modules(agent_tree: Path, root: Path, layout: Layout) -> list[str]:
    """Copy the agent's version of each library module (a released .py file that is no test) over the fresh
    tree; returns the ones that differ."""
    changed = []
    inside = agent_tree.resolve()
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if layout.is_test_file(relative) or not relative.startswith("" if layout.python_path == "." else
                                                                     f"{layout.python_path}/"):
            continue
        theirs = agent_tree / relative
        # A link (of the file or of a folder above it) could point the verifier, which reads as root, at a host
        # file: a module whose path leaves the tree counts as deleted, as does a folder in a module's place.
        if theirs.is_symlink() or not theirs.resolve().is_relative_to(inside) or not theirs.is_file():
            changed.append(relative)
            path.unlink()
        elif theirs.read_bytes() != path.read_bytes():
            changed.append(relative)
            shutil.copyfile(theirs, path)
    return changed


def post_reward(url: str, token: str, verdict: Verdict) -> None:
    """POST the reward as the verifier: the proxy refuses a reward without this token."""
    body = json.dumps({"value": verdict.reward, "info": verdict.info}).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 - the runner's own proxy
        response.read()


def verify_from_environment(score: Callable[[dict, Path], Verdict] | None = None) -> int:
    """``harnessrl swe verify`` (or another example's ``score``, e.g. ``harnessrl search verify``) under the
    verifier contract: task file, workspace, reward URL and token."""
    task = json.loads(Path(os.environ["HARNESSRL_TASK_FILE"]).read_text())["data"]
    verdict = (score or verify)(task, Path(os.environ["HARNESSRL_WORKSPACE"]))
    print(json.dumps({"reward": verdict.reward, **verdict.info}), flush=True)
    url, token = os.environ.get("HARNESSRL_REWARD_URL"), os.environ.get("HARNESSRL_REWARD_TOKEN")
    if url and token:
        post_reward(url, token, verdict)
    elif url or token:
        print("HARNESSRL_REWARD_URL and HARNESSRL_REWARD_TOKEN come together; reward not posted", file=sys.stderr)
        return 2
    return 0
