"""The NetworkPolicies of a run: around its harness pods (``spec.harness.sandbox.networkPolicy``), and in front
of its vLLM pods (who may reach their control port).

A harness pod may reach what its proxy needs and nothing else: the rollout servers, the trace store and DNS;
with ``custom``, also the spec's egress rules. Nothing may connect to a harness pod, except to its proxy's
metrics port (``OperatorConfig.proxy_metrics_port``), from any source as for vLLM's ``/metrics``: that listener
serves Prometheus counters and nothing else.

What a NetworkPolicy cannot do: the proxy sidecar shares the pod's network namespace, and a policy selects
pods, not containers, so the harness can open connections to the rollout servers and to the store just as
its proxy does. What keeps the store to the proxy is that only the proxy container holds the store's
credentials; what keeps the harness from calling vLLM directly (unrecorded calls) is nothing yet, short of
an upstream API key only the proxy knows (``HARNESSRL_UPSTREAM_API_KEY``, which the spec cannot set today).
"""

from __future__ import annotations

from typing import Any

from harnessrl.operator import naming
from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.render_common import Endpoint, endpoint
from harnessrl.spec.models import TrainingRun

POSTGRES_PORT = 5432


def _tcp(port: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def _to_endpoint(target: Endpoint) -> dict[str, Any]:
    """Egress to a URL's port; to its address when it is an IP literal, else anywhere (a DNS name's
    addresses cannot be written into a policy)."""
    rule: dict[str, Any] = {"ports": [_tcp(target.port)]}
    if target.cidr is not None:
        rule["to"] = [{"ipBlock": {"cidr": target.cidr}}]
    return rule


def _rollout_rules(run: TrainingRun) -> list[dict[str, Any]]:
    """The vLLM pods' public port only, never their control port (``render_rollout_network_policy``)."""
    upstreams = run.spec.rollout.upstreams
    if not upstreams:
        return [
            {
                "to": [{"podSelector": {"matchLabels": naming.selector(run.metadata.name, naming.ROLLOUT)}}],
                "ports": [_tcp(naming.VLLM_PORT)],
            }
        ]
    return [_to_endpoint(endpoint(url, 443 if url.startswith("https:") else 80)) for url in upstreams]


def _store_rule(run: TrainingRun, config: OperatorConfig | None, store_url: str | None) -> dict[str, Any]:
    """The store's port (and address, for an IP literal) from its URL: the one the operator resolved (a
    Secret's), the spec's, or the operator's own store; PostgreSQL's 5432 only when no URL is known."""
    postgres = run.spec.store.postgres
    spec_url = postgres.url if postgres is not None else (config.store_url if config is not None else None)
    url = store_url or spec_url
    if url:
        return _to_endpoint(endpoint(url, POSTGRES_PORT))
    return {"ports": [_tcp(POSTGRES_PORT)]}


def _dns_rule(config: OperatorConfig | None) -> dict[str, Any]:
    """DNS: the cluster DNS pods, and the node-local DNS addresses (``OperatorConfig.dns_cidrs``; NodeLocal
    DNSCache listens on 169.254.20.10 on each node, in the host's network, where no pod selector reaches)."""
    cidrs = (config or OperatorConfig()).dns_cidrs
    cluster_dns = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
    peers: list[dict[str, Any]] = [cluster_dns]
    peers += [{"ipBlock": {"cidr": cidr.strip()}} for cidr in cidrs.split(",") if cidr.strip()]
    return {
        "to": peers,
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
    }


def _custom_rules(run: TrainingRun) -> list[dict[str, Any]]:
    rules = []
    for egress in run.spec.harness.sandbox.egress:
        rule: dict[str, Any] = {"to": [{"ipBlock": {"cidr": egress.cidr}}]}
        if egress.ports:
            rule["ports"] = [_tcp(port) for port in egress.ports]
        rules.append(rule)
    return rules


def render_network_policy(
    run: TrainingRun,
    namespace: str,
    uid: str,
    config: OperatorConfig | None = None,
    store_url: str | None = None,
) -> dict[str, Any] | None:
    """The run's harness NetworkPolicy ``<run>-harness``, or None for ``networkPolicy: none`` (then only the
    namespace's own policies apply). ``config`` gives the operator's store URL for runs that use it."""
    sandbox = run.spec.harness.sandbox
    if sandbox.network_policy == "none":
        return None
    egress = [*_rollout_rules(run), _store_rule(run, config, store_url), _dns_rule(config)]
    if sandbox.network_policy == "custom":
        egress += _custom_rules(run)
    name = run.metadata.name
    metrics_port = (config or OperatorConfig()).proxy_metrics_port
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": naming.child_metadata(
            naming.harness_network_policy_name(name), namespace, name, uid, naming.HARNESS
        ),
        "spec": {
            "podSelector": {"matchLabels": naming.selector(name, naming.HARNESS)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"ports": [_tcp(metrics_port)]}] if metrics_port else [],
            "egress": egress,
        },
    }


def render_rollout_network_policy(run: TrainingRun, namespace: str, uid: str) -> dict[str, Any] | None:
    """``<run>-rollout``, in front of the vLLM pods the operator runs (None with ``spec.rollout.upstreams``): the
    public port (the gate's OpenAI paths) from anywhere, since the proxies, the kubelet's probes and Prometheus
    all connect there; the control port (pause, weight reload, LoRA loading, sleep) from this run's learner pods
    only. Nothing else: vLLM itself listens on the pod's loopback. Rendered whatever
    ``sandbox.networkPolicy`` says, which is about the harness pods' own traffic."""
    if run.spec.rollout.upstreams:
        return None
    name = run.metadata.name
    learners = {"podSelector": {"matchLabels": naming.selector(name, naming.LEARNER)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": naming.child_metadata(naming.rollout_name(name), namespace, name, uid, naming.ROLLOUT),
        "spec": {
            "podSelector": {"matchLabels": naming.selector(name, naming.ROLLOUT)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [_tcp(naming.VLLM_PORT)]},
                {"from": [learners], "ports": [_tcp(naming.VLLM_CONTROL_PORT)]},
            ],
        },
    }
