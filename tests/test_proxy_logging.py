"""What ``harnessrl proxy`` says on its own log: one line per call, no library noise, observe mode's limits.

The proxy runs as the real command (a subprocess, as in a pod or under ``harnessrl run``) in front of the fake
vLLM upstream; the test reads its log.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.register_assert_rewrite("proxy_servers")
from proxy_servers import LoopThread, RunningUpstream
from test_proxy_resilience import _healthy

from harnessrl.local.vllm_server import free_port
from harnessrl.proxy.fake_upstream import FakeUpstream

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def upstream():
    loops = LoopThread()
    running = RunningUpstream(loops, FakeUpstream())
    yield running
    running.stop()
    loops.close()


def proxy_log(upstream: RunningUpstream, tmp_path: Path, *flags: str, calls: int = 1) -> str:
    """Start ``harnessrl proxy`` (gateway, a fresh SQLite store it migrates), make ``calls`` chat calls of
    rollout r1, stop it with SIGTERM and return everything it logged."""
    port = free_port()
    command = [sys.executable, "-m", "harnessrl.cli", "proxy", "--upstream", upstream.url, "--store",
               f"sqlite:///{tmp_path / 'store.db'}", "--upgrade-db", "--port", str(port), "--spool",
               str(tmp_path / "spool.jsonl"), *flags]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(base):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)[0]
            time.sleep(0.2)
        for i in range(calls):
            answer = httpx.post(f"{base}/rollouts/r1/attempts/0/v1/chat/completions",
                                json={"model": "m", "messages": MESSAGES, "max_tokens": 5 + i}, timeout=30)
            assert answer.status_code == 200, answer.text
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    return out


CALL_LINE = re.compile(r"INFO harnessrl\.proxy\.calls: call r1/0 #(\d+) chat ok 200 prompt (\d+) completion (\d+) "
                       r"tokens( \(usage\))? \d+\.\d\d s$")


def call_lines(out: str) -> list[re.Match[str]]:
    return [m for m in map(CALL_LINE.search, out.splitlines()) if m]


def test_train_mode_logs_one_line_per_call_and_no_library_lines(upstream, tmp_path):
    out = proxy_log(upstream, tmp_path, calls=2)
    lines = call_lines(out)
    assert [m.group(1) for m in lines] == ["0", "1"], out
    assert all(int(m.group(2)) > 0 and m.group(4) is None for m in lines), out  # the stored token arrays
    assert [int(m.group(3)) for m in lines] == [5, 6], out  # the fake upstream answers max_tokens tokens
    assert "alembic" not in out and "observe mode" not in out, out
    assert "harnessrl proxy listening on" in out


def test_no_log_calls_silences_the_call_lines(upstream, tmp_path):
    out = proxy_log(upstream, tmp_path, "--no-log-calls")
    assert not call_lines(out) and "harnessrl.proxy.calls" not in out, out
    assert "harnessrl proxy listening on" in out


def test_observe_mode_says_at_start_what_it_keeps(upstream, tmp_path):
    out = proxy_log(upstream, tmp_path, "--mode", "observe")
    assert "WARNING harnessrl.proxy: observe mode:" in out and "no token ids" in out, out
    [line] = call_lines(out)
    assert line.group(4) == " (usage)" and int(line.group(3)) == 5, out  # counts from the server's usage
