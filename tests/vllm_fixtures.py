"""A real vLLM OpenAI server on the tiny local model, shared by every test that needs a serving engine.

Import the fixtures into a test module (``from vllm_fixtures import tiny_model_dir, vllm_server``) and mark
the tests ``@pytest.mark.vllm``. The server is the one ``harnessrl run`` starts (``harnessrl.local.vllm_server``:
module entry point, private torch-inductor cache, settings from ENVIRONMENT.md), started once per test session
and always killed at the end with its whole process group, even when a test fails or the start times out.

``HARNESSRL_TEST_VLLM_URL`` points the fixture at an already running server instead (its model must be the
tiny model the fixture would build, with the same seed).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from harnessrl.local.vllm_server import VllmServer, free_port, start_vllm  # noqa: F401 - re-exported for tests
from harnessrl.store import RolloutState, TraceStore

# The sequence limit the server is started with; it matches the tiny model's position limit so that long
# harness prompts work (a 512-token server returns zero token ids or 400s past that length).
VLLM_MAX_MODEL_LEN = 8192
VLLM_START_TIMEOUT_S = float(os.environ.get("HARNESSRL_TEST_VLLM_START_TIMEOUT", "420"))
SERVED_NAME = "tiny"


def start_test_vllm(model_dir: Path, log_path: Path, extra_args: list[str] | None = None) -> VllmServer:
    return start_vllm(model_dir, log_path, served_name=SERVED_NAME, max_model_len=VLLM_MAX_MODEL_LEN,
                      extra_args=extra_args or [], timeout_s=VLLM_START_TIMEOUT_S, cpu=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (default config, seed 0), built once per session."""
    from harnessrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model")


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A real vLLM OpenAI server on the tiny model, on a free port; killed when the session ends."""
    external = os.environ.get("HARNESSRL_TEST_VLLM_URL")
    if external:
        yield VllmServer(external.rstrip("/"), os.environ.get("HARNESSRL_TEST_VLLM_MODEL", SERVED_NAME),
                         tiny_model_dir, None)
        return
    server = start_test_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm") / "vllm.log")
    try:
        yield server
    finally:
        server.stop()


# The flags of a function-calling deployment: vLLM's hermes tool parser (the tiny model's template is Qwen2.5's,
# with its tool markers), plus the render/generate/derender endpoints the proxy continues tool calls through.
TOOL_SERVER_ARGS = ["--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


@pytest.fixture(scope="session")
def tool_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A server with ``TOOL_SERVER_ARGS``, started once per session (the chat, Anthropic and Responses
    function-calling tests share it); ``HARNESSRL_TEST_VLLM_TOOLS_URL`` points at one already running instead
    (the tiny model, seed 0, started with ``TOOL_SERVER_ARGS`` and served as "tiny")."""
    external = os.environ.get("HARNESSRL_TEST_VLLM_TOOLS_URL")
    if external:
        yield VllmServer(external.rstrip("/"), SERVED_NAME, tiny_model_dir, None)
        return
    server = start_test_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm-tools") / "vllm.log", TOOL_SERVER_ARGS)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def proxy_in_front(server: VllmServer, tmp_path: Path, run: str, sampling: dict[str, Any]
                   ) -> Iterator[tuple[TraceStore, Any]]:
    """A SQLite store and a real capture proxy (train mode, ``sampling`` forced) in front of ``server``."""
    from proxy_servers import LoopThread, RunningProxy, proxy_config

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = TraceStore.connect(store_url)
    store.upgrade()
    loops = LoopThread()
    proxy = RunningProxy(loops, proxy_config([server.base_url], store_url, tmp_path / "spool", rollout_id=None,
                                             run=run, model_name=server.model, sampling=sampling), store)
    try:
        yield store, proxy
    finally:
        proxy.stop()
        loops.close()
        store.close()


def captured_group(store: TraceStore, proxy: Any, run: str, call: Callable[[Any], object], size: int = 4
                   ) -> list[str]:
    """One task's group of ``size`` rollouts, each one ``call(openai client)`` through the proxy, rewarded
    1, 1, 0, 0, ... and finished; returns the rollout ids."""
    import openai

    store.add_tasks(run, [{"id": "task"}])
    rollouts = [store.create_rollout(run, "task", i, rollout_id=f"r{i}") for i in range(size)]
    for rollout in rollouts:
        store.transition(rollout, 0, RolloutState.RUNNING, policy_version=0)
        call(openai.OpenAI(base_url=f"{proxy.url}/rollouts/{rollout}/attempts/0/v1", api_key="unused",
                           max_retries=0, timeout=120))
    proxy.flush(60)
    for i, rollout in enumerate(rollouts):
        store.set_reward(rollout, 0, 1.0 if i < size // 2 else 0.0)
        store.finish_attempt(rollout, 0, RolloutState.SUCCEEDED)
    return rollouts
