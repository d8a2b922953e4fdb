"""``harnessrl vllm-gate`` as a real process in front of a real vLLM: the public port serves what a proxy uses,
byte for byte and streamed, and refuses every control path; the control port serves the learner's sync calls.

The operator puts it in every vLLM pod (``render_rollout.gate_container``) so that a harness, which reaches
whatever its proxy sidecar reaches, cannot pause the replicas, load weights or put the engine to sleep.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from vllm_fixtures import captured_group, proxy_in_front

from harnessrl.local.vllm_server import VllmServer, free_port, kill_process_group
from harnessrl.proxy import continuity
from harnessrl.proxy.protocol import ROUTE_PATHS
from harnessrl.proxy.vllm_gate import PUBLIC_ROUTES

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, vllm_server

# vLLM 0.32's control paths (VLLM_SERVER_DEV_MODE=1 and runtime LoRA updating on), the read-only ones too.
CONTROL_PATHS = [
    ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/collective_rpc"),
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("POST", "/update_weight_version"),
    ("POST", "/start_weight_update"), ("POST", "/update_weights"), ("POST", "/finish_weight_update"),
    ("POST", "/init_weight_transfer_engine"), ("POST", "/sleep"), ("POST", "/wake_up"),
    ("POST", "/reset_prefix_cache"), ("POST", "/reset_mm_cache"), ("POST", "/scale_elastic_ep"),
]  # fmt: skip


@dataclass(frozen=True)
class Gate:
    public: str
    control: str


@pytest.fixture(scope="module")
def gate(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gate]:
    folder = tmp_path_factory.mktemp("gate")
    public, control = free_port(), free_port()
    with open(folder / "gate.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "harnessrl.cli", "vllm-gate", "--upstream", vllm_server.base_url,
             "--host", "127.0.0.1", "--port", str(public), "--control-port", str(control)],
            stdout=log, stderr=subprocess.STDOUT, cwd=folder, start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{public}"
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (folder / "gate.log").read_text()
            time.sleep(0.1)
        else:
            pytest.fail(f"the gate did not answer /health in 30 s: {(folder / 'gate.log').read_text()}")
        yield Gate(url, f"http://127.0.0.1:{control}")
    finally:
        kill_process_group(proc, grace_s=5)


def test_the_public_routes_cover_every_path_the_proxy_calls_upstream() -> None:
    used = {("POST", path) for path in ROUTE_PATHS.values()}
    used |= {("POST", path) for path in (continuity.RENDER_PATH, continuity.GENERATE_PATH, continuity.DERENDER_PATH)}
    used |= {("POST", "/tokenize"), ("POST", "/v1/responses"), ("POST", "/v1/messages"), ("GET", "/v1/models"),
             ("GET", "/weight_info")}
    assert used <= PUBLIC_ROUTES
    assert not {(method, path) for method, path in CONTROL_PATHS} & PUBLIC_ROUTES


@pytest.mark.vllm
def test_the_public_port_refuses_every_control_path(gate: Gate, vllm_server: VllmServer) -> None:
    label = httpx.get(f"{vllm_server.base_url}/weight_info", timeout=10).json()
    bodies = {"/collective_rpc": {"method": "reload_weights", "kwargs": {"weights_path": "/nonexistent"}},
              "/update_weight_version": {"new_version": "999"},
              "/v1/load_lora_adapter": {"lora_name": "x", "lora_path": "/nonexistent"}}
    for method, path in CONTROL_PATHS:
        answer = httpx.request(method, gate.public + path, json=bodies.get(path), timeout=10)
        assert answer.status_code == 403, (path, answer.status_code, answer.text)
        message = answer.json()["error"]["message"]
        assert path in message and f"port {gate.control.rsplit(':', 1)[1]}" in message
    # nothing of it reached vLLM: it neither paused nor took the label
    assert httpx.get(f"{vllm_server.base_url}/is_paused", timeout=10).json() == {"is_paused": False}
    assert httpx.get(f"{gate.public}/weight_info", timeout=10).json() == label
    # a path vLLM does not have is refused alike, and the query string does not change the path
    assert httpx.post(f"{gate.public}/pause?x=/v1/completions", timeout=10).status_code == 403
    assert httpx.get(f"{gate.public}/docs", timeout=10).status_code == 403


@pytest.mark.vllm
def test_the_public_port_forwards_the_openai_api_byte_for_byte_and_streams(gate: Gate, vllm_server: VllmServer
                                                                           ) -> None:
    body = {"model": vllm_server.model, "prompt": "count: one two", "max_tokens": 12, "temperature": 0,
            "return_token_ids": True, "logprobs": 1}
    direct = httpx.post(f"{vllm_server.base_url}/v1/completions", json=body, timeout=60).json()
    through = httpx.post(f"{gate.public}/v1/completions", json=body, timeout=60).json()
    for key in ("token_ids", "text", "prompt_token_ids"):
        assert through["choices"][0][key] == direct["choices"][0][key]
    assert through["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        direct["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    chat = {"model": vllm_server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{gate.public}/v1/chat/completions", json=chat, timeout=60) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2
    assert all("choices" in json.loads(event[6:]) for event in events[:-1])
    for path in ("/v1/models", "/weight_info", "/health", "/metrics"):
        assert httpx.get(gate.public + path, timeout=10).status_code == 200, path
    # vLLM's own error answers pass through with their status
    assert httpx.post(f"{gate.public}/v1/completions", json={"model": "nope", "prompt": "x"},
                      timeout=30).status_code == 404


@pytest.mark.vllm
def test_the_capture_proxy_works_through_the_public_port(gate: Gate, vllm_server: VllmServer, tmp_path: Path
                                                         ) -> None:
    behind = VllmServer(gate.public, vllm_server.model, vllm_server.model_dir, None)
    with proxy_in_front(behind, tmp_path, "gated", {"temperature": 1.0}) as (store, proxy):
        rollouts = captured_group(store, proxy, "gated", lambda client: client.chat.completions.create(
            model="anything", messages=[{"role": "user", "content": "hello"}], max_tokens=6), size=2)
        for rollout in rollouts:
            [call] = store.read_calls(rollout, 0)
            assert call.upstream.startswith(gate.public)
            assert call.completion_token_ids and len(call.logprobs) == len(call.completion_token_ids)


@pytest.mark.vllm
def test_the_control_port_serves_the_learners_sync_calls(gate: Gate, vllm_server: VllmServer) -> None:
    from harnessrl.trainer.weight_sync import VllmReplica

    replica = VllmReplica(gate.control, timeout_s=60)
    try:
        replica.pause()
        assert httpx.get(f"{gate.control}/is_paused", timeout=10).json() == {"is_paused": True}
        replica.resume()
        assert httpx.get(f"{vllm_server.base_url}/is_paused", timeout=10).json() == {"is_paused": False}
        replica.probe()  # one generated token, through the control port
    finally:
        httpx.post(f"{vllm_server.base_url}/resume", timeout=10)
        replica.close()
