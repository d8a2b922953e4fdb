"""The test control plane itself: real binaries at the right version, the controllers and kwok doing their
part (Deployments, Jobs, garbage collection, pods that run, succeed, fail or never start), RBAC on, and every
failure to start reported in one line with nothing left running."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_helpers import wait_for

from harnessrl.devcluster import BuildError, Cluster, ClusterError, ensure_binaries, start_cluster
from harnessrl.devcluster.build import KUBERNETES_VERSION
from harnessrl.devcluster.kwok import (
    EXIT_CODE,
    IMAGE_PULL_BACKOFF_IMAGE,
    REASON,
    RUN_FOR,
    STAGES_FILE,
    WAITING_REASON,
)

ROOT = Path(__file__).resolve().parents[1]


def get(kube: Cluster, *args: str) -> dict[str, Any]:
    return json.loads(kube.kubectl("get", *args, "-o", "json").stdout)


def pod(name: str, annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "containers": [{"name": "main", "image": "example.invalid/main:1"}],
            "restartPolicy": "Never",
            **spec,
        },
    }


def apply(kube: Cluster, namespace: str, *objects: dict[str, Any]) -> None:
    kube.kubectl("apply", "-n", namespace, "-f", "-", input="\n---\n".join(json.dumps(o) for o in objects))


def phase_of(kube: Cluster, namespace: str, name: str) -> str:
    return get(kube, "pod", name, "-n", namespace).get("status", {}).get("phase", "")


def test_binaries_carry_the_real_version(kube: Cluster) -> None:
    out = subprocess.run([str(kube.binaries["kube-apiserver"]), "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == f"Kubernetes {KUBERNETES_VERSION}"
    server = json.loads(kube.kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert (server["gitVersion"], server["major"], server["minor"]) == (KUBERNETES_VERSION, "1", "36")
    etcd = subprocess.run([str(kube.binaries["etcd"]), "--version"], capture_output=True, text=True).stdout
    assert "etcd Version: 3.6." in etcd
    measured = kube.binaries.measurements()
    assert set(measured) == {
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kubectl",
        "etcd",
        "kwok",
    }


def test_a_warm_cache_is_reused_without_building(kube: Cluster) -> None:
    lines: list[str] = []
    assert ensure_binaries(lines.append).dir == kube.binaries.dir
    assert lines == []


def test_fake_nodes_are_ready_with_gpus(kube: Cluster) -> None:
    nodes = get(kube, "nodes", "-l", "type=kwok")["items"]
    assert len(nodes) == 3
    for node in nodes:
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True" and node["status"]["allocatable"]["nvidia.com/gpu"] == "8"


def test_deployment_replicas_run_and_garbage_collection_removes_them(
    kube: Cluster, kube_namespace: str
) -> None:
    ns = kube_namespace
    apply(
        kube,
        ns,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "containers": [
                            {
                                "name": "web",
                                "image": "example.invalid/web:1",
                                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                            }
                        ]
                    },
                },
            },
        },
    )
    kube.kubectl("rollout", "status", "deployment/web", "-n", ns, "--timeout=60s")
    pods = get(kube, "pods", "-n", ns, "-l", "app=web")["items"]
    assert len(pods) == 2 and {p["status"]["phase"] for p in pods} == {"Running"}
    assert all(p["spec"]["nodeName"].startswith("kwok-node-") and p["status"]["podIP"] for p in pods)
    kube.kubectl("delete", "deployment", "web", "-n", ns, "--cascade=background")
    wait_for(
        "the garbage collector to delete the ReplicaSet's pods",
        lambda: not get(kube, "pods", "-n", ns, "-l", "app=web")["items"],
    )


def test_pods_end_as_their_annotations_say(kube: Cluster, kube_namespace: str) -> None:
    ns = kube_namespace
    apply(
        kube,
        ns,
        pod("ok", {RUN_FOR: "1s"}),
        pod("crash", {RUN_FOR: "1s", EXIT_CODE: "3"}),
        pod("oom", {RUN_FOR: "1s", EXIT_CODE: "137", REASON: "OOMKilled"}),
        pod("forever"),
        pod("bad-image", {WAITING_REASON: "ImagePullBackOff"}),
        {**pod("pull-backoff"), "spec": {"containers": [{"name": "main", "image": IMAGE_PULL_BACKOFF_IMAGE}]}},
    )
    wait_for("ok to succeed", lambda: phase_of(kube, ns, "ok") == "Succeeded")
    wait_for("crash to fail", lambda: phase_of(kube, ns, "crash") == "Failed")
    wait_for("oom to fail", lambda: phase_of(kube, ns, "oom") == "Failed")
    terminated = {
        name: get(kube, "pod", name, "-n", ns)["status"]["containerStatuses"][0]["state"]["terminated"]
        for name in ("ok", "crash", "oom")
    }
    assert (terminated["ok"]["exitCode"], terminated["ok"]["reason"]) == (0, "Completed")
    assert (terminated["crash"]["exitCode"], terminated["crash"]["reason"]) == (3, "Error")
    assert (terminated["oom"]["exitCode"], terminated["oom"]["reason"]) == (137, "OOMKilled")
    for name in ("bad-image", "pull-backoff"):
        waiting = wait_for(f"{name} to report its waiting reason",
                           lambda name=name: get(kube, "pod", name, "-n", ns)["status"].get("containerStatuses"))
        assert get(kube, "pod", name, "-n", ns)["status"]["phase"] == "Pending"
        assert waiting[0]["state"]["waiting"]["reason"] == "ImagePullBackOff"
    assert phase_of(kube, ns, "forever") == "Running"


def test_native_sidecar_runs_beside_the_main_container_and_the_pod_completes(
    kube: Cluster, kube_namespace: str
) -> None:
    ns = kube_namespace
    apply(
        kube,
        ns,
        pod(
            "with-sidecar",
            {RUN_FOR: "2s"},
            initContainers=[
                {"name": "proxy", "image": "example.invalid/proxy:1", "restartPolicy": "Always"},
                {"name": "setup", "image": "example.invalid/setup:1"},
            ],
        ),
    )
    wait_for("the pod to run", lambda: phase_of(kube, ns, "with-sidecar") == "Running")
    status = get(kube, "pod", "with-sidecar", "-n", ns)["status"]
    states = {s["name"]: next(iter(s["state"])) for s in status["initContainerStatuses"]}
    assert states == {"proxy": "running", "setup": "terminated"}
    wait_for("the pod to succeed", lambda: phase_of(kube, ns, "with-sidecar") == "Succeeded")


def test_a_job_completes_and_an_indexed_job_gets_one_pod_per_index(
    kube: Cluster, kube_namespace: str
) -> None:
    ns = kube_namespace
    template = {
        "metadata": {"annotations": {RUN_FOR: "1s"}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "learner", "image": "example.invalid/learner:1"}],
        },
    }
    apply(
        kube,
        ns,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "learner"},
            "spec": {
                "completions": 2,
                "parallelism": 2,
                "completionMode": "Indexed",
                "backoffLimit": 0,
                "template": template,
            },
        },
    )
    kube.kubectl("wait", "--for=condition=Complete", "job/learner", "-n", ns, "--timeout=60s")
    indexes = sorted(
        p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]
        for p in get(kube, "pods", "-n", ns, "-l", "job-name=learner")["items"]
    )
    assert indexes == ["0", "1"]


def test_rbac_is_enforced_for_a_real_identity(kube: Cluster, kube_namespace: str) -> None:
    ns = kube_namespace
    user = kube.user_kubeconfig("reader")
    refused = kube.kubectl("get", "pods", "-n", ns, kubeconfig_path=user, check=False)
    assert refused.returncode != 0 and 'User "reader" cannot list resource "pods"' in refused.stderr
    kube.kubectl("create", "role", "pod-reader", "--verb=list", "--resource=pods", "-n", ns)
    kube.kubectl("create", "rolebinding", "reader", "--role=pod-reader", "--user=reader", "-n", ns)
    wait_for(
        "the binding to take effect",
        lambda: kube.kubectl("get", "pods", "-n", ns, kubeconfig_path=user, check=False).returncode == 0,
    )
    assert (
        kube.kubectl(
            "auth", "can-i", "delete", "pods", "-n", ns, kubeconfig_path=user, check=False
        ).stdout.strip()
        == "no"
    )


def test_stage_annotations_in_the_module_are_the_ones_in_the_stage_file() -> None:
    stages = list(yaml.safe_load_all(STAGES_FILE.read_text()))
    assert [s["kind"] for s in stages] == ["Stage"] * 7
    text = STAGES_FILE.read_text()
    for annotation in (RUN_FOR, EXIT_CODE, REASON, WAITING_REASON):
        assert f'"{annotation}"' in text


# --- failures: one line naming the component and its log, nothing left running ---------------------------


def _ours_running(cluster_dir: Path) -> list[int]:
    """PIDs of processes whose working directory is this cluster's folder (each component starts there)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(entry / "cwd").resolve() == cluster_dir.resolve():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_port_in_use_stops_the_start_naming_the_apiserver_and_leaves_nothing(
    kube: Cluster, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ClusterError) as failure:
            start_cluster(tmp_path / "c", port=port, log=lambda line: None)
    message = str(failure.value)
    assert "\n" not in message
    assert message.startswith("kube-apiserver exited with code 1 while starting:")
    assert "address already in use" in message
    assert message.endswith(f"log: {tmp_path / 'c' / 'logs' / 'kube-apiserver.log'}")
    assert _ours_running(tmp_path / "c") == []


def test_build_without_go_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESSRL_KUBE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BuildError, match=r"^kube build: `go` is not on PATH; install Go 1.26 or later"):
        ensure_binaries(lambda line: None)


def test_build_with_an_unreachable_module_names_the_binary_and_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARNESSRL_KUBE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GOMODCACHE", str(tmp_path / "empty-modcache"))
    monkeypatch.setenv("GOPROXY", "off")
    with pytest.raises(BuildError) as failure:
        ensure_binaries(lambda line: None)
    message = str(failure.value)
    assert "\n" not in message and message.startswith("kube build: kube-apiserver failed (go build exit 1):")
    assert "GOPROXY=off" in message and "log: " in message and "build-kube-apiserver.log" in message


def test_kube_sh_up_status_env_down(tmp_path: Path) -> None:
    env = {**os.environ, "HARNESSRL_KUBE_DIR": str(tmp_path / "cli")}
    script = str(ROOT / "scripts" / "kube.sh")
    up = subprocess.run([script, "up", "--nodes", "1"], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.strip() == f"export KUBECONFIG={tmp_path / 'cli' / 'admin.kubeconfig'}"
        status = subprocess.run([script, "status"], env=env, capture_output=True, text=True).stdout
        assert status.count("running") == 5 and "NOT RUNNING" not in status
        exports = subprocess.run([script, "env"], env=env, capture_output=True, text=True).stdout
        shell = subprocess.run(
            ["bash", "-c", f"{exports}\nkubectl get nodes -o name"], capture_output=True, text=True
        )
        assert shell.stdout.strip() == "node/kwok-node-0", shell.stderr
        again = subprocess.run([script, "up"], env=env, capture_output=True, text=True)
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        down = subprocess.run([script, "down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert _ours_running(tmp_path / "cli") == [] and not (tmp_path / "cli").exists()
