"""The coding verifier (``harnessrl swe verify``) on the example's tasks: real libraries, their real tests, each
run in a fresh sandbox. A repository whose tests or pytest setup were changed to pass still scores 0 (the
verifier takes the library's modules alone from it), and the reward reaches the store through the real capture
proxy with the verifier's token only. (The known fix scoring 1 on every task and the bug 0: test_swe_example.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from proxy_servers import loops, make_proxy, upstream  # noqa: F401 - pytest fixtures

from harnessrl.swe.repository import Layout, apply_patch
from harnessrl.swe.testrun import run_suite
from harnessrl.swe.verifier import verify
from harnessrl.swe.workspace import prepare_workspace

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "swe"
HARNESSRL = str(Path(sys.executable).with_name("harnessrl"))
TOKEN = "verifier-only-0123456789abcdef"


def example_tasks() -> list[dict]:
    return [json.loads(line)["data"] for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]


def test_changed_tests_and_a_planted_conftest_do_not_score(tmp_path: Path) -> None:
    """The agent's tree makes every test pass under pytest (a test added, a conftest.py that turns every
    failure into a pass): run as it stands, its suite passes; verified, the library's modules alone are taken
    and the reward stays 0."""
    task = example_tasks()[0]
    workspace = tmp_path / "ws"
    repository = prepare_workspace(task, EXAMPLE, workspace)
    test_file = repository / task["FAIL_TO_PASS"][0].split("::")[0]
    test_file.write_text(test_file.read_text() + "\n\ndef test_planted():\n    pass\n")
    (test_file.parent / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    report = outcome.get_result()\n"
        "    if report.failed:\n        report.outcome = 'passed'\n")
    forged = run_suite(repository, Layout(task["python_path"], task["test_paths"], []))
    assert set(task["FAIL_TO_PASS"]) <= forged.passed  # the forgery works on pytest itself
    verdict = verify(task, workspace)
    assert verdict.reward == 0.0 and verdict.info["fail_to_pass"] == f"0/{len(task['FAIL_TO_PASS'])}"


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_the_verifier_posts_the_reward_with_its_token(upstream, make_proxy, store, tmp_path):  # noqa: F811
    """``harnessrl swe verify`` under the verifier contract scores the workspace and its reward is stored; the
    same POST without the token (what a harness could send) is refused."""
    proxy = make_proxy([upstream.url], reward_token=TOKEN)
    client = openai.OpenAI(base_url=proxy.v1, api_key="harnessrl", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    task = example_tasks()[-1]
    workspace = tmp_path / "ws"
    apply_patch(prepare_workspace(task, EXAMPLE, workspace), task["patch"])
    (tmp_path / "task.json").write_text(json.dumps({"id": task["instance_id"], "data": task}))
    forged = httpx.post(f"{proxy.v1}/reward", json={"value": 1.0}, timeout=60)
    assert forged.status_code == 403
    env = {**os.environ, "HARNESSRL_TASK_FILE": str(tmp_path / "task.json"), "HARNESSRL_WORKSPACE": str(workspace),
           "HARNESSRL_REWARD_URL": f"{proxy.v1}/reward", "HARNESSRL_REWARD_TOKEN": TOKEN}
    done = subprocess.run([HARNESSRL, "swe", "verify"], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["reward"] == 1.0
    stored = store.get_attempt("r-1", 0)
    assert stored.reward == 1.0
    shutil.rmtree(workspace)
    missing = subprocess.run([HARNESSRL, "swe", "verify"], env=env, capture_output=True, text=True, timeout=300,
                             check=False)
    assert missing.returncode == 1 and "cannot verify" in missing.stderr and "is missing" in missing.stderr
