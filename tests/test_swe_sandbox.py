"""The sandbox commands of a coding rollout run in (``harnessrl.swe.sandbox``): real bubblewrap, real processes.

No network (not even the host's loopback), no write outside the folders it is given, and its limits hold: time
(the whole process tree dies with it), processes, memory. ``harnessrl swe sandbox`` takes bubblewrap's calling
convention, as mini-swe-agent's bubblewrap environment calls it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harnessrl.swe.sandbox import SandboxLimits, run_sandboxed, sandbox_uid

HARNESSRL = str(Path(sys.executable).with_name("harnessrl"))


def python(code: str) -> list[str]:
    return ["python", "-c", textwrap.dedent(code)]


def processes_of(uid: int) -> list[str]:
    """``pid state command`` of every process (zombies too) whose real uid is ``uid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = dict(line.split(":\t", 1) for line in (entry / "status").read_text().splitlines()
                          if ":\t" in line)
        except (OSError, ValueError):
            continue
        if status.get("Uid", "").split()[0:1] == [str(uid)]:
            found.append(f"{entry.name} {status['State'].split()[0]} {status['Name']}")
    return found


def test_no_network_inside_not_even_the_hosts_loopback(tmp_path: Path) -> None:
    """A server listening on the host's 127.0.0.1 is unreachable, an outside address has no route, and the
    server never saw a connection."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0)
        port = server.getsockname()[1]
        result = run_sandboxed(python(f"""
            import socket
            for address in [("127.0.0.1", {port}), ("1.1.1.1", 80)]:
                try:
                    socket.create_connection(address, timeout=5)
                    print("connected", address)
                except OSError as exc:
                    print("refused", address, exc.errno)
            """), writable=[tmp_path])
        assert result.returncode == 0, result.output
        assert "connected" not in result.output
        assert result.output.count("refused") == 2, result.output
        with pytest.raises(BlockingIOError):
            server.accept()


def test_writes_reach_the_given_folder_only(tmp_path: Path) -> None:
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("host file")
    result = run_sandboxed(["bash", "-c", f"""
        echo made > {work}/made.txt && echo wrote-work
        cat {elsewhere}/secret.txt 2>/dev/null || echo cannot-read-elsewhere
        (echo x > {elsewhere}/planted.txt) 2>/dev/null || echo cannot-write-elsewhere
        (echo x > /usr/planted) 2>/dev/null || echo cannot-write-usr
        (echo x > {sys.prefix}/planted) 2>/dev/null || echo cannot-write-python
        """], writable=[work])
    assert result.returncode == 0, result.output
    assert result.output.split() == ["wrote-work", "cannot-read-elsewhere", "cannot-write-elsewhere",
                                     "cannot-write-usr", "cannot-write-python"]
    assert (work / "made.txt").read_text() == "made\n"
    assert not (elsewhere / "planted.txt").exists() and not Path("/usr/planted").exists()
    assert not Path(sys.prefix, "planted").exists()


def test_the_time_limit_kills_every_process_of_the_sandbox(tmp_path: Path) -> None:
    """A command that forks a child and ignores SIGTERM is killed with all its processes at the limit."""
    result = run_sandboxed(["bash", "-c", "trap '' TERM; (sleep 300; echo late > late.txt) & sleep 300"],
                           writable=[tmp_path], limits=SandboxLimits(timeout_s=1))
    assert result.timed_out and result.reason == "killed: it passed the sandbox's time limit"
    if os.geteuid() == 0:  # root's sandbox runs as a user of its own: none of its processes is left
        assert processes_of(sandbox_uid(tmp_path)) == []
    assert not (tmp_path / "late.txt").exists()


def test_process_and_memory_limits(tmp_path: Path) -> None:
    forks = run_sandboxed(python("""
        import os, time
        children = 0
        for _ in range(40):
            try:
                pid = os.fork()
            except BlockingIOError:
                break
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            children += 1
        print("children", children)
        """), writable=[tmp_path], limits=SandboxLimits(timeout_s=60, max_processes=8))
    children = int(forks.output.split()[-1])
    assert 0 < children < 8, forks.output
    memory = run_sandboxed(python("""
        try:
            block = bytearray(1 << 30)
            print("allocated")
        except MemoryError:
            print("MemoryError")
        """), writable=[tmp_path], limits=SandboxLimits(memory_bytes=512 << 20))
    assert memory.output.strip() == "MemoryError", memory.output


def test_the_command_line_takes_bubblewraps_calling_convention(tmp_path: Path) -> None:
    """As mini-swe-agent's bubblewrap environment calls its executable: options, then ``bash -c COMMAND``;
    the exit code comes back, and a command past its limit exits 124 saying so."""
    prefix = [HARNESSRL, "swe", "sandbox", "--timeout", "30", "--", "--bind", str(tmp_path), str(tmp_path),
              "--chdir", str(tmp_path), "--setenv", "GREETING", "hello"]
    done = subprocess.run([*prefix, "bash", "-c", "echo $GREETING > out.txt; pwd; exit 3"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 3 and done.stdout.strip() == str(tmp_path), done.stdout + done.stderr
    assert (tmp_path / "out.txt").read_text() == "hello\n"
    slow = [*prefix, "bash", "-c", "sleep 60"]
    slow[4] = "1"  # --timeout 1
    late = subprocess.run(slow, capture_output=True, text=True, timeout=60, check=False)
    assert late.returncode == 124 and "killed after 1 s, the command's time limit" in late.stdout
