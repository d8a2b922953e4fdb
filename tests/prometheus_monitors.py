"""The chart's ServiceMonitor and PodMonitors as a plain Prometheus' scrape configs, for a test cluster without the
Prometheus Operator.

The translation is the part of the Prometheus Operator's that these monitors use: Kubernetes service discovery
(role ``endpoints`` for a ServiceMonitor, ``pod`` for a PodMonitor), a ``keep`` rule for each selector label and
for the named port, running pods only, the target labels ``namespace``, ``pod``, ``container`` (and ``service``),
then the monitor's own relabelings. So a selector that names a label the real pods lack, or a port they do not
expose, finds no target here as it would find none on a cluster.

Debian's Prometheus is built without Kubernetes service discovery, so ``Discovery`` stands in for it: an HTTP
service-discovery endpoint that lists the cluster's pods (and Endpoints) with the ``__meta_kubernetes_*`` labels
Prometheus' own discovery gives them; Prometheus then applies the relabel rules above itself.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def meta(name: str) -> str:
    """Kubernetes service discovery's spelling of a label or name: every character outside [a-zA-Z0-9_] is _."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _relabelings(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Prometheus Operator's camelCase relabel fields as Prometheus' snake_case ones."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return [{keys.get(key, key): value for key, value in rule.items()} for rule in rules]


def _namespaces(monitor: dict[str, Any]) -> list[dict[str, Any]]:
    selector = monitor["spec"].get("namespaceSelector") or {}
    if selector.get("any"):
        return []
    names = selector.get("matchNames") or [monitor["metadata"]["namespace"]]
    return [{"source_labels": ["__meta_kubernetes_namespace"], "regex": "|".join(map(re.escape, names)),
             "action": "keep"}]


def _scrape_config(monitor: dict[str, Any], discovery: str, interval: str) -> list[dict[str, Any]]:
    kind, spec = monitor["kind"], monitor["spec"]
    role = {"PodMonitor": "pod", "ServiceMonitor": "endpoints"}[kind]
    object_meta = {"pod": "pod", "endpoints": "service"}[role]
    keep = [
        {"source_labels": [f"__meta_kubernetes_{object_meta}_label_{meta(label)}"], "regex": value, "action": "keep"}
        for label, value in spec["selector"]["matchLabels"].items()
    ]
    targets = [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)", "action": "drop"},
    ]
    if role == "endpoints":
        targets.append({"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"})
    endpoints = spec["podMetricsEndpoints"] if role == "pod" else spec["endpoints"]
    port_label = "__meta_kubernetes_pod_container_port_name" if role == "pod" else "__meta_kubernetes_endpoint_port_name"
    configs = []
    for index, endpoint in enumerate(endpoints):
        configs.append({
            "job_name": f"{kind.lower()}/{monitor['metadata']['name']}/{index}",
            "scrape_interval": interval,
            "metrics_path": endpoint.get("path", "/metrics"),
            "honor_labels": bool(endpoint.get("honorLabels", False)),
            "http_sd_configs": [{"url": f"{discovery}/{role}", "refresh_interval": "1s"}],
            "relabel_configs": [
                *_namespaces(monitor),
                *keep,
                {"source_labels": [port_label], "regex": endpoint["port"], "action": "keep"},
                *targets,
                *_relabelings(endpoint.get("relabelings") or []),
            ],
        })  # fmt: skip
    return configs


def scrape_configs(monitors: list[dict[str, Any]], discovery: str, interval: str = "1s") -> list[dict[str, Any]]:
    """Prometheus scrape configs for every ServiceMonitor and PodMonitor in ``monitors`` (other kinds are skipped),
    discovering targets at ``discovery`` (a ``Discovery``'s URL)."""
    configs: list[dict[str, Any]] = []
    for monitor in monitors:
        if monitor and monitor.get("kind") in ("PodMonitor", "ServiceMonitor"):
            configs += _scrape_config(monitor, discovery, interval)
    return configs


def _pod_labels(pod: dict[str, Any]) -> dict[str, str]:
    labels = {
        "__meta_kubernetes_namespace": pod["metadata"]["namespace"],
        "__meta_kubernetes_pod_name": pod["metadata"]["name"],
        "__meta_kubernetes_pod_phase": pod.get("status", {}).get("phase", ""),
        "__meta_kubernetes_pod_ip": pod.get("status", {}).get("podIP", ""),
    }
    for name, value in (pod["metadata"].get("labels") or {}).items():
        labels[f"__meta_kubernetes_pod_label_{meta(name)}"] = value
        labels[f"__meta_kubernetes_pod_labelpresent_{meta(name)}"] = "true"
    return labels


def pod_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Role ``pod``: one target per declared port of each container, init containers (native sidecars) included,
    of every pod that has an address."""
    groups = []
    for pod in pods:
        address = pod.get("status", {}).get("podIP")
        if not address:
            continue
        spec = pod["spec"]
        for init, containers in (("false", spec.get("containers") or []), ("true", spec.get("initContainers") or [])):
            for container in containers:
                for port in container.get("ports") or []:
                    groups.append({"targets": [f"{address}:{port['containerPort']}"], "labels": {
                        **_pod_labels(pod),
                        "__meta_kubernetes_pod_container_name": container["name"],
                        "__meta_kubernetes_pod_container_init": init,
                        "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                        "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    }})  # fmt: skip
    return groups


def endpoint_targets(endpoints: list[dict[str, Any]], services: list[dict[str, Any]],
                     pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Role ``endpoints``: one target per ready address and port of each Service's Endpoints, with the Service's
    labels and, for an address backed by a pod, the pod's."""
    service_labels = {(s["metadata"]["namespace"], s["metadata"]["name"]): s["metadata"].get("labels") or {}
                      for s in services}
    by_pod = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
    groups = []
    for item in endpoints:
        namespace, name = item["metadata"]["namespace"], item["metadata"]["name"]
        base = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_service_name": name}
        for label, value in service_labels.get((namespace, name), {}).items():
            base[f"__meta_kubernetes_service_label_{meta(label)}"] = value
        for subset in item.get("subsets") or []:
            for address in subset.get("addresses") or []:
                ref = address.get("targetRef") or {}
                pod = by_pod.get((namespace, ref.get("name", ""))) if ref.get("kind") == "Pod" else None
                for port in subset.get("ports") or []:
                    labels = {**base, **(_pod_labels(pod) if pod else {}),
                              "__meta_kubernetes_endpoint_port_name": port.get("name", ""),
                              "__meta_kubernetes_endpoint_ready": "true"}
                    groups.append({"targets": [f"{address['ip']}:{port['port']}"], "labels": labels})
    return groups


class Discovery:
    """Prometheus' HTTP service discovery at ``/pod`` and ``/endpoints``, from ``get(resource)``: the items of a
    cluster-wide list (``kubectl get <resource> -A``). A thread lists them every second and the endpoint answers
    the latest lists at once (a kubectl call can take longer than Prometheus waits for an answer)."""

    def __init__(self, get: Callable[[str], list[dict[str, Any]]]) -> None:
        self.answers: dict[str, bytes] = {"/pod": b"[]", "/endpoints": b"[]"}
        self.stopped = threading.Event()
        answers = self.answers

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = answers.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: Any) -> None:
                pass

        def refresh() -> None:
            while not self.stopped.wait(1.0):
                try:
                    pods = get("pods")
                    self.answers["/pod"] = json.dumps(pod_targets(pods)).encode()
                    self.answers["/endpoints"] = json.dumps(
                        endpoint_targets(get("endpoints"), get("services"), pods)).encode()
                except Exception:  # noqa: BLE001 - an API server busy for a moment: the next round lists again
                    continue

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        threading.Thread(target=refresh, daemon=True).start()

    def close(self) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()
