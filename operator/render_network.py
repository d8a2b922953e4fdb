"""The NetworkPolicy around a run's harness pods (``spec.harness.sandbox.networkPolicy``).

A harness pod may reach what its proxy needs and nothing else: the rollout servers, the trace store and DNS;
with ``custom``, also the spec's egress rules. Nothing may connect to a harness pod.

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
    upstreams = run.spec.rollout.upstreams
    if not upstreams:
        return [
            {
                "to": [{"podSelector": {"matchLabels": naming.selector(run.metadata.name, naming.ROLLOUT)}}],
                "ports": [_tcp(naming.VLLM_PORT)],
            }
        ]
    return [_to_endpoint(endpoint(url, 443 if url.startswith("https:") else 80)) for url in upstreams]


def _store_rule(run: TrainingRun, config: OperatorConfig | None) -> dict[str, Any]:
    """The store's port: from its URL where the renderer can see one (in the spec, or the operator's own
    store), else PostgreSQL's 5432 (a URL in a Secret is not the renderer's to read)."""
    postgres = run.spec.store.postgres
    url = postgres.url if postgres is not None else (config.store_url if config is not None else None)
    if url:
        return _to_endpoint(endpoint(url, POSTGRES_PORT))
    return {"ports": [_tcp(POSTGRES_PORT)]}


def _dns_rule() -> dict[str, Any]:
    return {
        "to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
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
    run: TrainingRun, namespace: str, uid: str, config: OperatorConfig | None = None
) -> dict[str, Any] | None:
    """The run's harness NetworkPolicy ``<run>-harness``, or None for ``networkPolicy: none`` (then only the
    namespace's own policies apply). ``config`` gives the operator's store URL for runs that use it."""
    sandbox = run.spec.harness.sandbox
    if sandbox.network_policy == "none":
        return None
    egress = [*_rollout_rules(run), _store_rule(run, config), _dns_rule()]
    if sandbox.network_policy == "custom":
        egress += _custom_rules(run)
    name = run.metadata.name
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": naming.child_metadata(
            naming.harness_network_policy_name(name), namespace, name, uid, naming.HARNESS
        ),
        "spec": {
            "podSelector": {"matchLabels": naming.selector(name, naming.HARNESS)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": egress,
        },
    }
