"""``dns://NAME:PORT``: the vLLM replicas a DNS name resolves to (on a cluster the rollout's headless Service,
whose answer is its Ready pods), written one way for the operator that renders it, the learner that syncs every
replica and the proxy that pins a rollout to one."""

from __future__ import annotations

from collections.abc import Iterable

DNS_SCHEME = "dns://"


def dns_target(name: str, port: int) -> str:
    return f"{DNS_SCHEME}{name}:{port}"


def parse_dns_target(target: str) -> tuple[str, int] | None:
    """(name, port) of a ``dns://NAME:PORT`` target, None for any other URL; a dns:// target written wrong
    raises ValueError naming the form."""
    if not target.startswith(DNS_SCHEME):
        return None
    host, _, port = target.removeprefix(DNS_SCHEME).rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{target}: write a DNS target as dns://NAME:PORT")
    return host, int(port)


def base_urls(addresses: Iterable[str], port: int) -> list[str]:
    """One base URL per distinct address, sorted; IPv6 addresses in brackets."""
    return [f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}" for ip in sorted(set(addresses))]
