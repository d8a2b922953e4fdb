"""``n > 1`` through the real proxy on a real vLLM: refused in train mode, passed through in observe mode.

Train mode stores one completion per call (see ``refuse_several_choices`` in ``proxy/app.py`` for why the
extra choices are refused rather than stored), so no call may come back with choices the learner never
sees: the harness gets one clear 400 naming ``n``, nothing reaches vLLM and nothing is stored.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

pytest.register_assert_rewrite("proxy_servers")
from proxy_servers import LoopThread, RunningProxy, metric_value, proxy_config

from harnessrl.store import TraceStore

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, vllm_server

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "user", "content": "write two short answers"}]


def _proxy(vllm_server, tmp_path: Path, loops: LoopThread, mode: str) -> tuple[RunningProxy, TraceStore]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = TraceStore.connect(url)
    store.upgrade()
    config = proxy_config([vllm_server.base_url], url, tmp_path / "spool", rollout_id=None,
                          model_name=vllm_server.model, proxy_mode=mode, sampling={"temperature": 1.0})
    return RunningProxy(loops, config, store), store


@pytest.fixture
def loops():
    loop_thread = LoopThread()
    yield loop_thread
    loop_thread.close()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("chat/completions", {"messages": MESSAGES, "max_tokens": 8}),
        ("chat/completions", {"messages": MESSAGES, "max_tokens": 8, "stream": True}),
        ("completions", {"prompt": "one two", "max_tokens": 8}),
    ],
    ids=["chat", "chat-stream", "completions"],
)
def test_train_mode_refuses_several_choices(vllm_server, tmp_path, loops, path, body):
    proxy, store = _proxy(vllm_server, tmp_path, loops, "train")
    try:
        base = f"{proxy.url}/rollouts/r0/attempts/0/v1"
        refused = httpx.post(f"{base}/{path}", json={"model": "m", **body, "n": 2}, timeout=120)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "n" and error["code"] == "n_not_supported"
        assert "'n' is 2" in error["message"] and "n=1" in error["message"]
        # n=1 spelled out is one sample: served and stored as usual
        served = httpx.post(f"{base}/{path}", json={"model": "m", **body, "n": 1}, timeout=120)
        assert served.status_code == 200
        proxy.flush(60)
        [call] = store.read_calls("r0", 0)  # only the n=1 call: the refused one reached neither vLLM nor store
        assert call.request["n"] == 1 and len(call.completion_token_ids) == len(call.logprobs) > 0
        exposition = httpx.get(f"{proxy.url}/metrics").text
        route = "chat" if path.startswith("chat") else "completions"
        assert metric_value(exposition, "harnessrl_proxy_requests_total", route=route, status="400") == 1
    finally:
        proxy.stop()
        store.close()


def test_observe_mode_passes_several_choices_through(vllm_server, tmp_path, loops):
    proxy, store = _proxy(vllm_server, tmp_path, loops, "observe")
    try:
        answer = httpx.post(f"{proxy.url}/rollouts/r0/attempts/0/v1/chat/completions",
                            json={"model": "m", "messages": MESSAGES, "max_tokens": 8, "n": 2}, timeout=120)
        assert answer.status_code == 200
        assert [c["index"] for c in answer.json()["choices"]] == [0, 1]
        proxy.flush(60)
        [call] = store.read_calls("r0", 0)
        assert len(call.response["choices"]) == 2  # observe mode keeps the whole answer (and no token ids)
        assert call.completion_token_ids == []
    finally:
        proxy.stop()
        store.close()
