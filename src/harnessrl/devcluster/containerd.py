"""A containerd started for one job on a given root, on private sockets and state, without the CRI plugin.

Two jobs need one: importing images into the real node's image store before any node is up (the root is the
node's, so its containerd finds them when it starts), and the image tests (a root of their own, never the
system's or the node's). Without CRI it never touches the pod records kubelet keeps in the same root.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT_S = 60.0


class ContainerdError(RuntimeError):
    """The private containerd did not start; one line with its last log line."""


@contextmanager
def private_containerd(root: Path, binary: str = "containerd") -> Iterator[str]:
    """A containerd serving ``root`` while the block runs; yields its socket's address. Two containerds must not
    share a root at once: the caller makes sure the root's usual server is down (its metadata database is
    locked by whoever has it open)."""
    with tempfile.TemporaryDirectory(prefix="hr-ctrd-", dir="/tmp") as folder:
        address = f"{folder}/containerd.sock"
        config = Path(folder) / "config.toml"
        config.write_text(
            f'version = 2\nroot = "{root}"\nstate = "{folder}/state"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{address}"\n[ttrpc]\n  address = "{address}.ttrpc"\n'
            '[debug]\n  address = ""\n[metrics]\n  address = ""\n'
            f'[plugins."io.containerd.internal.v1.opt"]\n  path = "{folder}/opt"\n'
        )
        log_path = Path(folder) / "containerd.log"
        with open(log_path, "wb") as out:
            server = subprocess.Popen([binary, "--config", str(config)], stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not answers(address):
                if server.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                    raise ContainerdError(f"containerd on {root} did not start: {tail[0][:300]}")
                time.sleep(0.2)
            yield address
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def answers(address: str) -> bool:
    """Whether a containerd serves on ``address`` (a socket path) and answers a version request."""
    if not Path(address).exists():
        return False
    try:
        return subprocess.run(["ctr", "--address", address, "version"], capture_output=True, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:  # a containerd still starting, or wedged: not serving
        return False
