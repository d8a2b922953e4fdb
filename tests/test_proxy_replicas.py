"""The proxy's view of the replicas on a cluster: ``dns://NAME:PORT`` upstreams resolved with the machine's
real resolver (every address of the name, a name that resolves to nothing leaves no replica to call), and the
settings that refuse a DNS upstream written wrong. Serving and weight labels with a real vLLM are in
test_weight_sync_vllm.py."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.metrics import ProxyMetrics
from harnessrl.proxy.upstreams import UpstreamPool, UpstreamUnavailable


def pool(*urls: str) -> UpstreamPool:
    return UpstreamPool(list(urls), ProxyMetrics(), lambda: 0)


def test_a_dns_upstream_becomes_the_addresses_of_its_name_and_keeps_them_when_dns_fails() -> None:
    async def scenario() -> None:
        upstreams = pool("dns://localhost:8123", "http://fixed:9000")
        await upstreams.start()
        try:
            assert upstreams.urls == ["http://127.0.0.1:8123", "http://fixed:9000"]
            assert set(upstreams.ranked("rollout-1")) == set(upstreams.urls)
            loop = asyncio.get_running_loop()

            async def dns_down(*args: object, **kwargs: object) -> list:
                raise OSError("Temporary failure in name resolution")

            loop.getaddrinfo = dns_down  # type: ignore[method-assign]  # a DNS outage, for this loop only
            await upstreams.resolve()
            assert upstreams.urls == ["http://127.0.0.1:8123", "http://fixed:9000"]  # kept through the outage
            del loop.getaddrinfo
            upstreams.targets[0] = "dns://no-such-host.invalid:8123"  # another name, never resolved
            await upstreams.resolve()
            assert upstreams.urls == ["http://fixed:9000"]
        finally:
            await upstreams.close()

    asyncio.run(scenario())


def test_a_name_that_never_resolved_leaves_no_replica_to_call() -> None:
    async def scenario() -> None:
        upstreams = pool("dns://no-such-host.invalid:8000")
        await upstreams.start()
        try:
            with pytest.raises(UpstreamUnavailable, match="no replica address resolved yet"):
                upstreams.ranked("rollout-1")
        finally:
            await upstreams.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("upstream", "accepted"),
    [("dns://run-rollout-pods:8000", True), ("dns://run-rollout-pods", False), ("ftp://x:1", False)],
)
def test_dns_upstreams_in_the_settings(upstream: str, accepted: bool) -> None:
    if accepted:
        assert ProxyConfig(upstreams=upstream, store_url="sqlite://").upstreams == [upstream]
        return
    with pytest.raises(ValidationError, match=r"dns://NAME:PORT"):
        ProxyConfig(upstreams=upstream, store_url="sqlite://")
