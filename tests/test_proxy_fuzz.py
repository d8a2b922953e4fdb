"""Thousands of malformed requests: the proxy answers every one with a clear 4xx (never a 5xx of its own)
and keeps serving."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_servers import LoopThread, RunningProxy, RunningUpstream, proxy_config

from harnessrl.proxy.fake_upstream import FakeUpstream
from harnessrl.store import TraceStore

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/reward", "/v1/rollout/finish"]
PATHS = (
    ROUTES
    + ["/rollouts/r/attempts/0" + r for r in ROUTES]
    + [
        "/rollouts/r/attempts/-3/v1/completions",
        "/rollouts//attempts/0/v1/chat/completions",
        "/healthz",
        "/metrics",
        "/admin/state",
        "/admin/resume",
        "/admin/policy-version",
        "/admin/flush",
        "/",
        "/v1",
        "/v1/chat",
        "/v1/chat/completions/x",
    ]
)
FIELDS = [
    "model",
    "messages",
    "prompt",
    "stream",
    "logprobs",
    "top_logprobs",
    "return_token_ids",
    "n",
    "echo",
    "max_tokens",
    "stream_options",
    "temperature",
    "value",
    "info",
    "status",
    "error",
    "version",
    "timeout_s",
    "mode",
]
MAX_BODY = 64 * 1024

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.one_of(
        json_values,
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", 3]), "content": json_values}
        ),
    ),
    max_size=3,
)
request_objects = st.fixed_dictionaries(
    {}, optional={name: (messages if name == "messages" else json_values) for name in FIELDS}
)
bodies = st.one_of(
    st.binary(max_size=64),
    json_values.map(lambda v: json.dumps(v).encode()),
    request_objects.map(lambda v: json.dumps(v).encode()),
    request_objects.map(lambda v: json.dumps(v).encode()[:-1]),  # truncated JSON
    st.just(b"[" * 50_000 + b"]" * 50_000),  # nesting deeper than any parser's recursion limit
    st.just(b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * (2 * MAX_BODY) + b'"}]}'),
    st.just(b'{"value": NaN}'),
)
content_types = st.sampled_from(
    [
        None,
        "application/json",
        "application/json; charset=utf-8",
        "application/vnd.x+json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=zz",
        "%%garbage%%",
    ]
)


@pytest.mark.slow
def test_malformed_requests_never_get_a_proxy_5xx(tmp_path: Path) -> None:
    loops = LoopThread()
    upstream = RunningUpstream(loops, FakeUpstream())
    url = f"sqlite:///{tmp_path / 'fuzz.db'}"
    store = TraceStore.connect(url)
    store.upgrade()
    proxy = RunningProxy(
        loops,
        proxy_config([upstream.url], url, tmp_path / "spool", max_body_bytes=MAX_BODY, rollout_id=None),
        store,
    )
    statuses: dict[int, int] = {}
    http = httpx.Client(base_url=proxy.url, timeout=30)
    try:

        @settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(
            method=st.sampled_from(["GET", "POST", "POST", "POST", "PUT", "DELETE", "PATCH"]),
            path=st.one_of(
                st.sampled_from(PATHS),
                st.text(
                    alphabet=st.characters(codec="ascii", exclude_characters="#?\r\n\x00 "), max_size=30
                ).map(lambda s: "/" + s),
            ),
            content_type=content_types,
            body=bodies,
        )
        def one_request(method: str, path: str, content_type: str | None, body: bytes) -> None:
            headers = {"Content-Type": content_type} if content_type else {}
            try:
                resp = http.request(method, path, content=body if method != "GET" else None, headers=headers)
            except httpx.InvalidURL:
                return  # the client refuses to send it; nothing reached the proxy
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            assert resp.status_code < 500, (method, path, body[:200], resp.text[:300])
            if resp.status_code >= 400 and path != "/metrics":
                error = resp.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"]

        one_request()

        # Broken HTTP itself, on raw sockets.
        for raw in (
            b"GARBAGE\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
            b"POST /v1/reward HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        ):
            with socket.create_connection(
                ("127.0.0.1", int(proxy.url.rsplit(":", 1)[1])), timeout=10
            ) as sock:
                sock.sendall(raw)
                answer = sock.recv(4096)  # aiohttp's HTTP parser answers these before any route runs
                assert answer.split(b" ")[1].startswith(b"4"), answer[:100]

        # Still serving, and still capturing.
        assert http.get("/healthz").status_code == 200
        ok = http.post(
            "/rollouts/after/attempts/0/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "still there?"}]},
        )
        assert ok.status_code == 200
        proxy.flush(60)
        assert len(store.read_calls("after", 0)) == 1
        assert sum(statuses.values()) >= 1000 and statuses.get(400) and statuses.get(404) and statuses.get(413)
    finally:
        http.close()
        proxy.stop()
        upstream.stop()
        loops.close()
        store.close()
