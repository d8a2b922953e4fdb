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
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.local.vllm_server import VllmServer, free_port, start_vllm  # noqa: F401 - re-exported for tests

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
