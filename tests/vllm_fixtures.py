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


class SharedServers:
    """vLLM servers with extra flags, each shared by the test modules that use it (a start costs about a minute
    of CI) and stopped as soon as the next test is in a module that does not use it (each holds about 3 GB), so
    running modules that use one side by side costs a single start and nothing stays up longer than needed."""

    def __init__(self) -> None:
        self._running: dict[str, VllmServer] = {}

    def get(self, fixture: str, start: Callable[[], VllmServer]) -> VllmServer:
        server = self._running.get(fixture)
        if server is None:
            server = self._running[fixture] = start()
        return server

    def release(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """After ``item``'s teardown: stop the servers ``nextitem`` (None at the end) will not use."""
        for fixture in list(self._running):
            if nextitem is None or (nextitem.module is not item.module and fixture not in nextitem.fixturenames):
                self._running.pop(fixture).stop()


SHARED_SERVERS = SharedServers()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)  # the fixtures' own teardown first (the proxies in front of a server)
    finally:
        SHARED_SERVERS.release(item, nextitem)


def shared_server(fixture: str, args: list[str], url_env: str, tiny_model_dir: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> VllmServer:
    """The shared server started with ``args``, or the one already running at ``$url_env`` (the tiny model,
    seed 0, started with ``args`` and served as "tiny")."""
    external = os.environ.get(url_env)
    if external:
        return VllmServer(external.rstrip("/"), SERVED_NAME, tiny_model_dir, None)
    return SHARED_SERVERS.get(fixture, lambda: start_test_vllm(
        tiny_model_dir, tmp_path_factory.mktemp(fixture) / "vllm.log", args))


# The flags of a function-calling deployment: vLLM's hermes tool parser (the tiny model's template is Qwen2.5's,
# with its tool markers), plus the render/generate/derender endpoints the proxy continues tool calls through.
TOOL_SERVER_ARGS = ["--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
# A reasoning model's deployment: everything up to ``</think>`` is reasoning (for the random tiny model, its
# whole output), plus the endpoints the proxy continues calls through while the parser splits the answer.
REASONING_SERVER_ARGS = ["--enable-scale-out", "--reasoning-parser", "deepseek_r1"]


@pytest.fixture(scope="module")
def tool_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmServer:
    """A server with ``TOOL_SERVER_ARGS`` (shared: the chat, Anthropic and Responses function-calling tests);
    ``HARNESSRL_TEST_VLLM_TOOLS_URL`` points at one already running instead."""
    return shared_server("tool_server", TOOL_SERVER_ARGS, "HARNESSRL_TEST_VLLM_TOOLS_URL", tiny_model_dir,
                         tmp_path_factory)


@pytest.fixture(scope="module")
def reasoning_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmServer:
    """A server with ``REASONING_SERVER_ARGS`` (shared: the chat, Anthropic and Responses reasoning tests);
    ``HARNESSRL_TEST_VLLM_REASONING_URL`` points at one already running instead."""
    return shared_server("reasoning_server", REASONING_SERVER_ARGS, "HARNESSRL_TEST_VLLM_REASONING_URL",
                         tiny_model_dir, tmp_path_factory)


# A function-calling deployment for agents whose tools are not marked strict, on a weak model forced to call them:
# every tool's arguments pinned to its schema (``--tool-strict-level parameter``, as if each were strict), so a
# forced call is valid and the harness runs it; a 64k context for long agent prompts (Claude Code's is about 29k
# tokens of the tiny tokenizer).
STRICT_TOOL_SERVER_ARGS = [*TOOL_SERVER_ARGS, "--tool-strict-level", "parameter"]
LONG_MAX_MODEL_LEN = 65536


@pytest.fixture(scope="session")
def cli_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (seed 0) with ``LONG_MAX_MODEL_LEN`` positions, built once per session."""
    from harnessrl.tiny_model import TinyModelConfig, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("cli-model") / "model",
                            TinyModelConfig(max_position_embeddings=LONG_MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def cli_server(cli_model: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmServer:
    """A server with ``STRICT_TOOL_SERVER_ARGS`` and a 64k context (shared: the CLI tests and mini-swe-agent's);
    ``HARNESSRL_TEST_VLLM_CLI_URL`` points at one already running (``cli_model``, served as "tiny")."""
    external = os.environ.get("HARNESSRL_TEST_VLLM_CLI_URL")
    if external:
        return VllmServer(external.rstrip("/"), SERVED_NAME, cli_model, None)
    return SHARED_SERVERS.get("cli_server", lambda: start_vllm(
        cli_model, tmp_path_factory.mktemp("cli_server") / "vllm.log", served_name=SERVED_NAME,
        max_model_len=LONG_MAX_MODEL_LEN, extra_args=STRICT_TOOL_SERVER_ARGS, timeout_s=VLLM_START_TIMEOUT_S,
        cpu=True))


@contextmanager
def proxy_in_front(server: VllmServer, tmp_path: Path, run: str, sampling: dict[str, Any], **config: Any
                   ) -> Iterator[tuple[TraceStore, Any]]:
    """A SQLite store and a real capture proxy (train mode, ``sampling`` forced, ``config`` overrides) in front
    of ``server``."""
    from proxy_servers import LoopThread, RunningProxy, proxy_config

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = TraceStore.connect(store_url)
    store.upgrade()
    loops = LoopThread()
    proxy = RunningProxy(loops, proxy_config([server.base_url], store_url, tmp_path / "spool", rollout_id=None,
                                             run=run, model_name=server.model, sampling=sampling, **config),
                           store)
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
