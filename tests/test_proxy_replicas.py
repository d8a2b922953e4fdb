"""The proxy's view of the replicas on a cluster: ``dns://NAME:PORT`` upstreams resolved with the machine's
real resolver (every address of the name, a name that resolves to nothing leaves no replica to call), and the
settings that refuse a DNS upstream written wrong; and the reward token of a run with a verifier. Serving and weight labels with a real vLLM are in
test_weight_sync_vllm.py."""

from __future__ import annotations

import asyncio
import socket

import httpx
import openai
import pytest
from proxy_servers import loops, make_proxy, upstream  # noqa: F401 - pytest fixtures
from pydantic import ValidationError

from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.metrics import ProxyMetrics
from harnessrl.proxy.upstreams import UpstreamPool, UpstreamUnavailable
from harnessrl.store import RolloutState


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


def test_a_call_made_before_the_replicas_name_resolves_waits_for_it(upstream, loops) -> None:
    """On a cluster the first harness pods start as soon as a vLLM replica is Ready, and its address reaches
    the cluster's DNS up to 30 s later (its cached negative answer): a call that finds no replica resolves the
    name again (once a second) for up to 45 s, instead of answering 502 at once (what failed the first
    harnesses on the real node). A name that never resolves still fails, once that wait has passed."""
    port = int(upstream.url.rsplit(":", 1)[1])
    asked: dict[str, int] = {"rollout-pods.test": 0, "never.test": 0}

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        real = loop.getaddrinfo

        async def dns(host: str, *args: object, **kwargs: object) -> list:
            if host not in asked:
                return await real(host, *args, **kwargs)
            asked[host] += 1
            if host == "never.test" or asked[host] <= 3:  # at start and the first two retries: no address
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return await real("127.0.0.1", *args, **kwargs)

        loop.getaddrinfo = dns  # type: ignore[method-assign]  # for this loop only
        try:
            late = UpstreamPool([f"dns://rollout-pods.test:{port}"], ProxyMetrics(), lambda: 0)
            never = UpstreamPool(["dns://never.test:1"], ProxyMetrics(), lambda: 0, resolve_wait_s=2)
            for upstreams in (late, never):
                await upstreams.start()
                assert upstreams.urls == []
            body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
            answer = await late.fetch("/v1/chat/completions", body, "rollout-1")
            assert answer.status == 200 and answer.url == f"http://127.0.0.1:{port}"
            assert asked["rollout-pods.test"] >= 4  # the start, then once a second until it answers
            with pytest.raises(UpstreamUnavailable, match="no replica address resolved yet"):
                await never.fetch("/v1/chat/completions", body, "rollout-1")
            assert asked["never.test"] >= 2  # resolved again while it waited
            for upstreams in (late, never):
                await upstreams.close()
        finally:
            del loop.getaddrinfo

    loops.run(scenario())


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


TOKEN = "verifier-only-0123456789abcdef"


def test_with_a_reward_token_only_the_verifier_reports_the_reward(upstream, make_proxy, store):
    """A run with a verifier: the harness's own reward (no token, or its OpenAI key as the bearer) is refused
    with 403 and stores nothing; the verifier's, with the token, is stored."""
    proxy = make_proxy([upstream.url], reward_token=TOKEN)
    client = openai.OpenAI(base_url=proxy.v1, api_key="harnessrl", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    for headers in ({}, {"Authorization": "Bearer harnessrl"}, {"Authorization": f"Bearer {TOKEN}x"}):
        refused = httpx.post(f"{proxy.v1}/reward", json={"value": 1.0}, headers=headers, timeout=60)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "reward_token_required"
    proxy.flush()
    assert store.get_attempt("r-1", 0).reward is None
    accepted = httpx.post(
        f"{proxy.v1}/reward", json={"value": 0.5}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    )
    assert accepted.status_code == 200, accepted.text
    assert store.get_attempt("r-1", 0).reward == 0.5
    assert TOKEN not in repr(proxy.config)  # never in logs


def test_a_rollouts_end_is_stored_when_answered_and_a_second_end_is_refused(upstream, make_proxy, store):
    """As a reward: the harness may exit at once (the writer lingers 30 s here, so an answer given on queueing
    would find nothing stored); ending a settled attempt again is 409, naming its state."""
    proxy = make_proxy([upstream.url], write_linger_s=30.0)
    first = httpx.post(f"{proxy.v1}/rollout/finish", json={"status": "failed", "error": "gave up"}, timeout=60)
    assert first.status_code == 200 and first.json()["stored"] is True
    assert store.get_attempt("r-1", 0).state is RolloutState.FAILED
    again = httpx.post(f"{proxy.v1}/rollout/finish", json={"status": "succeeded"}, timeout=60)
    assert again.status_code == 409 and again.json()["error"]["code"] == "attempt_settled"
    assert "already failed" in again.json()["error"]["message"]
    assert store.get_attempt("r-1", 0).state is RolloutState.FAILED


def test_with_a_reward_token_only_the_verifier_ends_the_rollout(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url], reward_token=TOKEN)
    refused = httpx.post(f"{proxy.v1}/rollout/finish", json={"status": "succeeded"}, timeout=60)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "reward_token_required"
    done = httpx.post(f"{proxy.v1}/rollout/finish", json={"status": "succeeded"},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert done.status_code == 200
    assert store.get_attempt("r-1", 0).state is RolloutState.SUCCEEDED
