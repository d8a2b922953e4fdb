"""``scripts/kube.sh up --real-node``, ``status`` and ``down`` as people run them: ``down`` leaves no process,
mount, network namespace, bridge, iptables chain or ipset behind, also after a failed start; a component that
dies while starting is named in one line with its log; without root the command says so in one line.

Each test brings a node up and down itself (one real node fits a machine, so no other real-node module may
hold one meanwhile: pytest runs modules one at a time and their node fixtures end with them).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from harnessrl.devcluster.node import LIB, leftovers

pytestmark = pytest.mark.real_node

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "scripts" / "kube.sh"


def kube_sh(directory: Path, *args: str, root: bool = True) -> subprocess.CompletedProcess[str]:
    """``scripts/kube.sh``; ``root=False`` runs it as an unmapped user in a new user namespace, whose
    effective uid is not 0 while the checkout and its venv stay readable (another uid could not run root's
    Python here)."""
    env = {**os.environ, "HARNESSRL_KUBE_DIR": str(directory)}
    command = [str(KUBE), *args] if root else ["unshare", "--user", str(KUBE), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def kubectl(directory: Path, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    state = json.loads((directory / "cluster.json").read_text())
    binary = Path(state["binaries"]) / "bin" / "kubectl"
    return subprocess.run(
        [str(binary), "--kubeconfig", str(directory / "admin.kubeconfig"), *args],
        input=input, capture_output=True, text=True, timeout=120,
    )


def test_up_status_down_leaves_nothing_behind(tmp_path: Path) -> None:
    assert leftovers() == [], "an earlier node left something; this test would not see its own"
    # A cluster folder as deep as CI's: kubelet's Unix sockets (at most 107 bytes) must not live under it.
    directory = tmp_path / "a-cluster-folder-as-deep-as-a-ci-checkouts-tmp-folder" / "cluster"
    assert len(str(directory / "node/kubelet/pod-resources/1826614704")) > 107
    up = kube_sh(directory, "up", "--real-node")
    try:
        assert up.returncode == 0, up.stderr
        assert f"export KUBECONFIG={directory / 'admin.kubeconfig'}" in up.stdout
        status = kube_sh(directory, "status")
        assert status.returncode == 0, status.stderr
        for component in ("containerd", "kubelet", "kube-proxy", "local-path-provisioner", "kube-router"):
            assert f"{component}: pid" in status.stdout and "NOT RUNNING" not in status.stdout
        assert "harnessrl-node   Ready" in status.stdout
        # Something of every kind down must clean up: a running pod (sandbox, netns, veth, mounts), a bound
        # volume, Service rules (kube-proxy) and a NetworkPolicy (kube-router's chains and ipsets).
        workload = """
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 16Mi}}}
---
apiVersion: v1
kind: Pod
metadata: {name: busy, labels: {app: busy}}
spec:
  terminationGracePeriodSeconds: 30
  containers:
  - {name: main, image: harnessrl.dev/busybox:1, imagePullPolicy: Never, command: [sleep, "3600"],
     volumeMounts: [{name: data, mountPath: /data}]}
  volumes: [{name: data, persistentVolumeClaim: {claimName: data}}]
---
apiVersion: v1
kind: Service
metadata: {name: busy}
spec: {selector: {app: busy}, ports: [{port: 80}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: busy}
spec: {podSelector: {matchLabels: {app: busy}}, policyTypes: [Ingress]}
"""
        assert kubectl(directory, "apply", "-f", "-", input=workload).returncode == 0
        ready = kubectl(directory, "wait", "--for=condition=Ready", "pod/busy", "--timeout=90s")
        assert ready.returncode == 0, ready.stderr
        assert leftovers(), "a running node shows up in leftovers(), or this test proves nothing"
    finally:
        down = kube_sh(directory, "down")
    assert down.returncode == 0, down.stderr
    assert leftovers() == []
    assert not directory.exists() and not LIB.exists()


def test_a_component_that_dies_at_start_is_named_with_its_log(tmp_path: Path) -> None:
    """kubelet cannot bind its port: the start fails naming kubelet and its log, and stops everything."""
    directory = tmp_path / "cluster"
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("0.0.0.0", 10250))
        holder.listen()
        up = kube_sh(directory, "up", "--real-node")
    assert up.returncode == 1
    lines = up.stderr.strip().splitlines()
    assert lines[-1].startswith("kubelet exited with code"), up.stderr
    assert "address already in use" in lines[-1]
    log = Path(lines[-1].rsplit("log: ", 1)[1])
    assert log.is_file() and "bind: address already in use" in log.read_text()
    assert leftovers() == []
    assert kube_sh(directory, "down").returncode == 0


def test_without_root_it_says_so_in_one_line(tmp_path: Path) -> None:
    up = kube_sh(tmp_path / "cluster", "up", "--real-node", root=False)
    assert up.returncode == 1
    assert up.stderr.strip().splitlines() == [
        "real node: needs root (kubelet, containerd and CNI change mounts, cgroups and iptables)"
    ]
    assert not (tmp_path / "cluster").exists()
