"""The real node (``scripts/kube.sh up --real-node``) does what kwok only pretends: containers run, pods reach
the API server and each other through Services and cluster DNS, claims bind through a real provisioner, and
NetworkPolicies are enforced. The operator's own harness policy is checked here by traffic it must let
through and traffic it must stop, and so is the rollout policy with the gate in front of vLLM: a harness cannot
reach vLLM's control paths, the learner can.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from harnessrl.devcluster import Cluster
from harnessrl.devcluster.node_config import CLUSTER_DNS_IP, HELPER_IMAGE, STORAGE_CLASS
from harnessrl.operator import naming
from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.render_common import writable_paths
from harnessrl.operator.render_network import render_network_policy, render_rollout_network_policy
from harnessrl.operator.render_rollout import gate_container
from harnessrl.spec.problems import parse_training_run
from kube_helpers import wait_for

pytestmark = pytest.mark.real_node

ROOT = Path(__file__).resolve().parents[1]


def pod(name: str, command: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    """A busybox pod (the node's volume-helper image: busybox's sh, nc and httpd) running ``command``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": HELPER_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/busybox", "sh", "-c", command],
                    **spec.pop("container", {}),
                }
            ],
            **spec,
        },
    }


def apply(cluster: Cluster, namespace: str, *objects: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input="\n---\n".join(json.dumps(o) for o in objects))


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "-n", namespace, kind, name, "-o", "json").stdout)


def finished(cluster: Cluster, namespace: str, name: str, timeout: float = 90) -> str:
    """Wait for a pod to end; returns its phase (Succeeded or Failed)."""
    return wait_for(
        f"pod {name} to finish",
        lambda: (phase := get(cluster, namespace, "pod", name)["status"].get("phase")) in ("Succeeded", "Failed")
        and phase,
        timeout=timeout,
    )


def logs(cluster: Cluster, namespace: str, name: str) -> str:
    return cluster.kubectl("logs", "-n", namespace, name).stdout


def http_status(cluster: Cluster, namespace: str, client: str, address: str, port: int) -> str:
    """The status line an HTTP server at address:port answers ``client`` with, or "" when the connection is
    refused or times out (busybox's static wget cannot resolve names, so nc speaks HTTP by hand)."""
    request = f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | /bin/busybox nc -w 3 {address} {port} | head -n 1"
    result = cluster.kubectl("exec", "-n", namespace, client, "--", "/bin/busybox", "sh", "-c", request, check=False)
    return result.stdout.strip()


def test_node_is_ready_and_coredns_runs_with_its_service_account(real_cluster: Cluster) -> None:
    nodes = json.loads(real_cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert [n["metadata"]["name"] for n in nodes] == ["harnessrl-node"]
    ready = {c["type"]: c["status"] for c in nodes[0]["status"]["conditions"]}
    assert ready["Ready"] == "True"
    assert nodes[0]["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    dns = json.loads(real_cluster.kubectl("get", "pods", "-n", "kube-system", "-l", "k8s-app=kube-dns", "-o", "json").stdout)
    (coredns,) = dns["items"]
    assert coredns["spec"]["serviceAccountName"] == "coredns"
    assert coredns["status"]["phase"] == "Running"
    assert all(c["ready"] for c in coredns["status"]["containerStatuses"])
    # CoreDNS is ready only once its kubernetes plugin has listed Services through the API server, in-cluster.
    slices = json.loads(real_cluster.kubectl("get", "endpointslices", "-n", "default", "-l",
                                             "kubernetes.io/service-name=kubernetes", "-o", "json").stdout)
    addresses = [a for s in slices["items"] for e in s["endpoints"] for a in e["addresses"]]
    assert addresses == [real_cluster.node_ip]


def test_pods_resolve_services_and_reach_the_api_server(real_cluster: Cluster, real_namespace: str) -> None:
    script = (
        "nslookup kubernetes.default.svc.cluster.local && "
        "nslookup kube-dns.kube-system.svc.cluster.local && "
        "echo | /bin/busybox nc -w 3 10.0.0.1 443 && echo api-reachable && cat /etc/resolv.conf"
    )
    apply(real_cluster, real_namespace, pod("dns", script))
    assert finished(real_cluster, real_namespace, "dns") == "Succeeded", logs(real_cluster, real_namespace, "dns")
    out = logs(real_cluster, real_namespace, "dns")
    assert "Address: 10.0.0.1" in out and f"Address: {CLUSTER_DNS_IP}" in out
    assert "api-reachable" in out and f"nameserver {CLUSTER_DNS_IP}" in out


def test_claims_bind_through_the_provisioner_and_keep_data(real_cluster: Cluster, real_namespace: str) -> None:
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "64Mi"}}},
    }
    volume = {"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
              "container": {"volumeMounts": [{"name": "data", "mountPath": "/data"}]}}
    apply(real_cluster, real_namespace, claim, pod("writer", "echo kept > /data/file", **volume))
    assert finished(real_cluster, real_namespace, "writer") == "Succeeded"
    bound = get(real_cluster, real_namespace, "pvc", "data")
    assert bound["status"]["phase"] == "Bound"
    assert bound["spec"]["storageClassName"] == STORAGE_CLASS  # the default class, as on kind
    pv = json.loads(real_cluster.kubectl("get", "pv", bound["spec"]["volumeName"], "-o", "json").stdout)
    path = Path(pv["spec"]["hostPath"]["path"] if "hostPath" in pv["spec"] else pv["spec"]["local"]["path"])
    assert (path / "file").read_text() == "kept\n"  # on the node's disk, where the provisioner made it
    apply(real_cluster, real_namespace, pod("reader", "cat /data/file", **volume))
    assert finished(real_cluster, real_namespace, "reader") == "Succeeded"
    assert logs(real_cluster, real_namespace, "reader") == "kept\n"
    real_cluster.kubectl("delete", "-n", real_namespace, "pod", "writer", "reader", "--wait=true")
    real_cluster.kubectl("delete", "-n", real_namespace, "pvc", "data", "--wait=true")
    wait_for("the provisioner to delete the volume's folder", lambda: not path.exists(), timeout=60)


def test_the_operators_harness_policy_is_enforced(real_cluster: Cluster, real_namespace: str) -> None:
    """The policy ``render_network_policy`` makes for a run, applied as the operator applies it: the harness
    reaches the rollout server's port, the store's port and DNS, and nothing else; nothing reaches it."""
    run_name = "policy"
    servers = "httpd -p 8000 -h /tmp && httpd -p 8001 -h /tmp && httpd -p 5432 -h /tmp && sleep 3600"
    apply(
        real_cluster,
        real_namespace,
        pod("rollout", servers, naming.selector(run_name, naming.ROLLOUT)),
        pod("store", servers, {"app": "store"}),
        pod("harness", "httpd -p 8080 -h /tmp && sleep 3600", naming.selector(run_name, naming.HARNESS)),
        pod("outsider", "httpd -p 8080 -h /tmp && sleep 3600", {"app": "outsider"}),
    )
    real_cluster.kubectl("wait", "-n", real_namespace, "--for=condition=Ready", "pod", "--all", "--timeout=90s")
    ip = {name: get(real_cluster, real_namespace, "pod", name)["status"]["podIP"]
          for name in ("rollout", "store", "harness", "outsider")}

    def reach(client: str, server: str, port: int) -> bool:
        return http_status(real_cluster, real_namespace, client, ip[server], port).startswith("HTTP/1")

    before = {(c, s, p): reach(c, s, p) for c, s, p in
              [("harness", "rollout", 8000), ("harness", "rollout", 8001), ("harness", "outsider", 8080),
               ("outsider", "harness", 8080)]}
    assert all(before.values()), before  # without a policy every pod reaches every other

    doc = yaml.safe_load((ROOT / "examples" / "trainingrun-minimal.yaml").read_text())
    doc["metadata"]["name"] = run_name
    config = OperatorConfig(
        proxy_image="unused", learner_image="unused", store_url=f"postgresql://u:p@{ip['store']}:5432/db"
    )
    policy = render_network_policy(parse_training_run(doc), real_namespace, "uid", config)
    policy["metadata"].pop("ownerReferences", None)  # no TrainingRun object owns it in this test
    apply(real_cluster, real_namespace, policy)

    expected = {
        ("harness", "rollout", 8000): True,  # the rollout servers' port: what the proxy calls
        ("harness", "store", 5432): True,  # the store, at the port of its URL
        ("harness", "rollout", 8001): False,  # any other port of the rollout pods
        ("harness", "store", 8000): False,  # the store's address, at another port
        ("harness", "outsider", 8080): False,  # any other pod
        ("outsider", "harness", 8080): False,  # nothing connects to a harness pod
        ("outsider", "rollout", 8000): True,  # the policy selects harness pods only
    }
    observed: dict = {}

    def settled() -> bool:
        observed.update({key: reach(*key) for key in expected})
        return observed == expected

    wait_for(f"the policy to be enforced (expected {expected}, observed {observed})", settled, timeout=30, every=1)
    lookup = real_cluster.kubectl(
        "exec", "-n", real_namespace, "harness", "--", "/bin/busybox", "nslookup", "kubernetes.default.svc.cluster.local", check=False
    )
    assert "Address: 10.0.0.1" in lookup.stdout, lookup.stdout + lookup.stderr  # DNS stays allowed


def test_kubectl_logs_and_exec_reach_the_node(real_cluster: Cluster, real_namespace: str) -> None:
    """The API server dials kubelet at the node's address with its client certificate."""
    apply(real_cluster, real_namespace, pod("web", "echo started && httpd -f -p 8080 -h /tmp"))
    real_cluster.kubectl("wait", "-n", real_namespace, "--for=condition=Ready", "pod/web", "--timeout=60s")
    wait_for("the pod's log", lambda: "started" in logs(real_cluster, real_namespace, "web"))
    out = real_cluster.kubectl("exec", "-n", real_namespace, "web", "--", "/bin/busybox", "echo", "from-exec")
    assert out.stdout.strip() == "from-exec"
    assert http_status(real_cluster, real_namespace, "web", "127.0.0.1", 8080).startswith("HTTP/1.")


GATED = "gated"


def status_line(cluster: Cluster, namespace: str, client: str, address: str, port: int, method: str, path: str
                ) -> str:
    """The status line of ``method path`` from ``client`` to address:port, "" when no connection is made.

    The request's side stays open for 2 s: nc half-closes the connection when its input ends, and an aiohttp
    server (the gate) takes that as the client gone and closes before it answers a forwarded request."""
    head = f"{method} {path} HTTP/1.0\\r\\nContent-Length: 0\\r\\n\\r\\n"
    request = f"(printf '{head}'; sleep 2) | /bin/busybox nc -w 3 {address} {port} | head -n 1"
    result = cluster.kubectl("exec", "-n", namespace, client, "--", "/bin/busybox", "sh", "-c", request, check=False)
    return result.stdout.strip()


def test_only_the_learner_reaches_the_vllm_control_port(real_cluster: Cluster, real_namespace: str) -> None:
    """A vLLM pod as the operator renders it, with busybox's httpd standing in for vLLM on the pod's loopback
    (the real image takes minutes to start here): the rendered gate in front, the rendered rollout policy
    around it, and traffic from a harness, a learner and an unrelated pod."""
    doc = yaml.safe_load((ROOT / "examples" / "trainingrun-minimal.yaml").read_text())
    doc["metadata"]["name"] = GATED
    run = parse_training_run(doc)
    # vLLM's stand-in answers every path on loopback:8002 only; the gate is the rendered one
    serve = f"httpd -f -p 127.0.0.1:{naming.VLLM_SERVER_PORT} -h /tmp/www"
    stand_in = f"mkdir -p /tmp/www && echo ok > /tmp/www/health && {serve}"
    rollout = pod("rollout", stand_in, naming.selector(GATED, naming.ROLLOUT))
    rollout["spec"]["containers"].append(gate_container(run, OperatorConfig()))
    rollout["spec"]["volumes"] = copy.deepcopy(writable_paths()[0])
    idle = "sleep 3600"
    apply(real_cluster, real_namespace, rollout,
          pod("learner", idle, naming.selector(GATED, naming.LEARNER)),
          pod("harness", idle, naming.selector(GATED, naming.HARNESS)),
          pod("outsider", idle, {"app": "outsider"}))
    real_cluster.kubectl("wait", "-n", real_namespace, "--for=condition=Ready", "pod", "--all", "--timeout=120s")
    address = get(real_cluster, real_namespace, "pod", "rollout")["status"]["podIP"]

    def ask(client: str, port: int, method: str, path: str) -> str:
        return status_line(real_cluster, real_namespace, client, address, port, method, path)

    # the pod is Ready before the gate's Python has started (the gate has no readiness probe of its own: the
    # vLLM container's readiness asks it), which takes seconds on a loaded machine
    wait_for("the gate to answer", lambda: ask("harness", naming.VLLM_PORT, "GET", "/health") != "", timeout=60, every=1)
    # before any policy: the gate alone keeps control paths off the public port, and vLLM off the network
    assert " 200" in ask("harness", naming.VLLM_PORT, "GET", "/health")
    assert " 403" in ask("harness", naming.VLLM_PORT, "POST", "/pause")
    assert ask("harness", naming.VLLM_SERVER_PORT, "GET", "/health") == ""
    assert ask("harness", naming.VLLM_CONTROL_PORT, "POST", "/pause").startswith("HTTP/1")

    policy = render_rollout_network_policy(run, real_namespace, "uid")
    assert policy is not None
    policy["metadata"].pop("ownerReferences", None)  # no TrainingRun object owns it in this test
    apply(real_cluster, real_namespace, policy)
    expected = {
        ("learner", naming.VLLM_CONTROL_PORT, "POST", "/pause"): True,  # forwarded to vLLM
        ("harness", naming.VLLM_CONTROL_PORT, "POST", "/pause"): False,  # no connection at all
        ("outsider", naming.VLLM_CONTROL_PORT, "POST", "/pause"): False,
        ("harness", naming.VLLM_PORT, "GET", "/health"): True,  # what a proxy calls
        ("outsider", naming.VLLM_PORT, "GET", "/health"): True,  # Prometheus, the probes: any source
    }
    observed: dict = {}

    def served(line: str) -> bool:  # a status line from the stand-in, not the gate's refusal
        return line.startswith("HTTP/1") and " 403" not in line

    def settled() -> bool:
        observed.update({key: served(ask(*key)) for key in expected})
        return observed == expected

    wait_for(f"the policy to be enforced (expected {expected}, observed {observed})", settled, timeout=60, every=1)
    assert " 403" in ask("harness", naming.VLLM_PORT, "POST", "/collective_rpc")
    assert " 403" in ask("harness", naming.VLLM_PORT, "POST", "/v1/load_lora_adapter")
