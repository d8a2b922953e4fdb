"""`harnessrl run` stops with a clear reason when a service it needs dies, instead of running on blind.

Real processes and no vLLM: the policy server is the fake upstream (``harnessrl.proxy.fake_upstream``, a real
HTTP server speaking vLLM's wire format) passed as ``--openai-base-url``, the harness a few lines of Python
that makes one call and reports a random reward, the learner the real ``harnessrl learn`` (DeepSpeed on the
CPU). The fake upstream has no weight-sync routes, so the learner's first sync fails: that is the failed-sync
case, end to end. Killing the fake upstream is the dead-policy-server case.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harnessrl.local.vllm_server import free_port, healthy

HARNESS = """
import os, random
from openai import OpenAI
client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key="unused", max_retries=0)
client.chat.completions.create(model=os.environ["HARNESSRL_MODEL_NAME"], max_tokens=6,
                               messages=[{"role": "user", "content": "say something"}])
import httpx
httpx.post(os.environ["HARNESSRL_REWARD_URL"], json={"value": random.random()}, timeout=30).raise_for_status()
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harnessrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def fake_upstream(tmp_path: Path):
    port = free_port()
    # cwd: never a checkout root, whose operator/ would shadow the stdlib module
    proc = subprocess.Popen([sys.executable, "-m", "harnessrl.proxy.fake_upstream", "--port", str(port)],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if healthy(url):
                break
            assert proc.poll() is None, "the fake upstream did not start"
            time.sleep(0.1)
        yield url, proc
    finally:
        proc.kill()
        proc.wait()


def spec_file(tmp_path: Path, model: Path, **extra: dict) -> Path:
    (tmp_path / "harness.py").write_text(HARNESS)
    spec = {
        "apiVersion": "harnessrl.io/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "services"},
        "spec": {
            "model": {"path": str(model)},
            "rollout": {"maxModelLen": 8192, "maxTokens": 6},
            "harness": {"command": [sys.executable, str(tmp_path / "harness.py")],
                        "tasks": {"inline": [{"id": f"t{i}", "data": {}} for i in range(4)]},
                        "groupSize": 2, "concurrency": 4, "timeoutSeconds": 60},
            "learner": {"steps": 3, "tasksPerStep": 1, "deepspeed": {"zeroStage": 1}},
            "weightSync": {"retries": 0},
        },
    }
    for section, values in extra.items():
        spec["spec"].setdefault(section, {})
        if isinstance(values, dict):
            spec["spec"][section].update(values)
        else:
            spec["spec"][section] = values
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def start_run(tmp_path: Path, model: Path, upstream: str, **extra: dict) -> subprocess.Popen:
    command = [sys.executable, "-m", "harnessrl.cli", "run", str(spec_file(tmp_path, model, **extra)), "--run-dir",
               str(tmp_path / "run"), "--openai-base-url", upstream, "--no-live"]
    return subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_failed_weight_sync_fails_the_run(tmp_path: Path, model: Path, fake_upstream) -> None:
    upstream, _ = fake_upstream
    proc = start_run(tmp_path, model, upstream)
    out, err = finish(proc)
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert "Traceback (most recent call last)" not in err.split("its log")[0]  # the reason comes first
    assert "Error: the learner exited with code 1 before the run's 3 steps were done" in err, err[-3000:]
    assert "weight sync of version 1 failed after 1 tries" in err and upstream in err  # the learner's log tail
    assert "spec.weightSync.retries" in err


def test_a_dead_policy_server_stops_the_run(tmp_path: Path, model: Path, fake_upstream) -> None:
    upstream, server = fake_upstream
    proc = start_run(tmp_path, model, upstream)
    try:
        while True:  # the run is up (proxy and learner started) once it prints where it serves from
            line = proc.stdout.readline()
            assert line, "the run ended before it started serving"
            if "serving v0" in line:
                break
        server.send_signal(signal.SIGKILL)
    finally:
        out, err = finish(proc)
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert f"Error: the policy server at {upstream} stopped answering GET /health" in err, err[-3000:]


def test_active_deadline_stops_a_local_run_and_cluster_only_fields_are_named(
    tmp_path: Path, model: Path, fake_upstream
) -> None:
    """spec.activeDeadlineSeconds acts locally too (counted from this start); a field only the operator reads
    is named, not silently dropped. No step can finish first: a step waits for 100 tasks' groups."""
    upstream, _ = fake_upstream
    proc = start_run(tmp_path, model, upstream, activeDeadlineSeconds=3,
                     learner={"tasksPerStep": 100}, rollout={"image": "vllm/vllm-openai:v0.32.0"})
    out, err = finish(proc)
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert "DeadlineExceeded: the run ran longer than spec.activeDeadlineSeconds=3" in err, err[-3000:]
    assert "only on a cluster (this run leaves them alone): spec.rollout.image" in out, out[-3000:]
