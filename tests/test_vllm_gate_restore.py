"""A vLLM that (re)starts behind its gate serves the run's committed version before it serves anything.

Real processes: the gate (``harnessrl vllm-gate --served-marker``) in front of a real vLLM on the tiny model, and
a servable checkpoint of "version 3" (the tiny model's weights changed) named by the learner's marker. The
fresh server is loaded with version 3 and labelled 3 before ``/ready`` passes; while it is down or being
restored, calls and the learner's control requests get 503. Then vLLM is killed and started again on the same
port, as a restarted container: the gate restores version 3 again. Without it the new server would answer
with the base model while proxies recorded its calls under the launch version (issue 22, fault 1).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from vllm_fixtures import SERVED_NAME, VLLM_MAX_MODEL_LEN

from harnessrl.local.vllm_server import free_port, kill_process_group, vllm_command, vllm_env
from harnessrl.served_marker import ServedVersion, write_marker

pytest_plugins = ["vllm_fixtures"]  # fixture: tiny_model_dir

PROMPT = [5, 77, 300, 12, 901, 44]


def start_vllm_on(model_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            vllm_command(model_dir, port, SERVED_NAME, VLLM_MAX_MODEL_LEN, True, []),
            env=vllm_env(log.parent / "torchinductor", True), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=log.parent,
        )  # fmt: skip


def wait(what: str, check, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def greedy(base: str) -> list[int]:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    answer = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    answer.raise_for_status()
    return list(answer.json()["choices"][0]["token_ids"])


@pytest.fixture(scope="module")
def version_3(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A servable checkpoint whose weights clearly differ from the base model's, named by the marker."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("checkpoints")
    published = root / "versions" / "v000003"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * parameter.std().clamp(min=0.02))
    model.save_pretrained(published, safe_serialization=True)
    for name in tiny_model_dir.iterdir():
        if name.name.startswith("tokenizer") or name.name == "special_tokens_map.json":
            shutil.copy(name, published / name.name)
    write_marker(root, ServedVersion(3, str(published), lora=False))
    return root


@pytest.fixture(scope="module")
def behind_gate(tiny_model_dir: Path, version_3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    folder = tmp_path_factory.mktemp("restore")
    upstream, public, control = free_port(), free_port(), free_port()
    gate_log = folder / "gate.log"
    with open(gate_log, "wb") as log:
        gate = subprocess.Popen(
            [sys.executable, "-m", "harnessrl.cli", "vllm-gate", "--upstream", f"http://127.0.0.1:{upstream}",
             "--host", "127.0.0.1", "--port", str(public), "--control-port", str(control),
             "--served-marker", str(version_3 / "served.json")],
            stdout=log, stderr=subprocess.STDOUT, cwd=folder, start_new_session=True,
        )  # fmt: skip
    state = {"public": f"http://127.0.0.1:{public}", "control": f"http://127.0.0.1:{control}",
             "start": lambda: start_vllm_on(tiny_model_dir, upstream, folder / "vllm.log"), "gate_log": gate_log,
             "vllm": None}
    try:
        yield state
    finally:
        if state["vllm"] is not None:
            kill_process_group(state["vllm"], grace_s=5)
        kill_process_group(gate, grace_s=5)


def test_a_started_and_a_restarted_vllm_serve_the_marked_version_before_anything(behind_gate: dict,
                                                                                  tiny_model_dir: Path) -> None:
    public, control = behind_gate["public"], behind_gate["control"]
    # No server yet: closed, and saying why.
    ready = wait("the gate", lambda: httpx.get(f"{public}/ready", timeout=5))
    assert ready.status_code == 503 and "restoring the run's version" in ready.text
    behind_gate["vllm"] = behind_gate["start"]()
    wait("the restored server to be ready", lambda: httpx.get(f"{public}/ready", timeout=5).status_code == 200)
    assert httpx.get(f"{public}/weight_info", timeout=5).json() == {"weight_version": "3"}
    restored = greedy(public)

    kill_process_group(behind_gate["vllm"], grace_s=5)
    wait("the gate to close", lambda: httpx.get(f"{public}/ready", timeout=5).status_code == 503)
    down = httpx.post(f"{public}/v1/completions", json={"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 1},
                      timeout=30)
    assert down.status_code == 503, down.text
    paused = httpx.post(f"{control}/pause", timeout=30)
    assert paused.status_code == 503 and "not serving the run's version yet" in paused.text

    behind_gate["vllm"] = behind_gate["start"]()  # the container restarted: same port, base weights
    wait("the restarted server to be ready", lambda: httpx.get(f"{public}/ready", timeout=5).status_code == 200)
    assert httpx.get(f"{public}/weight_info", timeout=5).json() == {"weight_version": "3"}
    assert greedy(public) == restored
    assert behind_gate["gate_log"].read_text().count("restored version 3") == 2

    # What the restore prevented: the same server with the base model's weights answers otherwise.
    httpx.post(f"{control}/collective_rpc", json={"method": "reload_weights",
                                                  "kwargs": {"weights_path": str(tiny_model_dir)}}, timeout=120)
    assert greedy(public) != restored
