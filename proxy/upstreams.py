"""The vLLM upstreams: which one serves a rollout, and retrying what can safely be retried.

Pinning: a rollout always goes to the same upstream while the set of upstreams is unchanged, so its
growing prompt hits that server's prefix cache. Rendezvous (highest-random-weight) hashing of the rollout id
picks it; adding or removing one upstream moves only the rollouts that hashed to it. The same ranking gives
the order of fail-over on retries.

Replicas by DNS: an upstream written ``dns://NAME:PORT`` stands for every address NAME resolves to (on a
cluster, the rollout's headless Service: its Ready vLLM pods), resolved at start and again every
``dns_refresh_s``, so pinning reaches one replica, not a Service that would pick one per request. A call that
finds no address known resolves the names again, once a second, for up to ``resolve_wait_s`` (45 s): the
operator starts harness pods when a replica turns Ready, and the cluster's DNS may keep answering "no such
name" for 30 s more (CoreDNS as kubeadm and kind configure it, ``ttl 30`` and ``cache 30``, caches the
negative answer that an earlier lookup, the learner's or another proxy's, got while no replica was Ready).
Seen on the real node: the first pods' proxies resolved nothing for 30 s, answered 502 at once, and their
harnesses failed.

Policy versions from the replica (``replica_versions``): right before each send the proxy asks that very
replica for its weight label (vLLM's ``GET /weight_info``, set by the learner's sync while the replica is
paused) and records the call under it. A label read before the send is never newer than the weights that
sample the answer (the label changes only after the load), so a call that straddles a sync carries the older
version, the conservative label for off-policy corrections. A replica that cannot tell (no dev-mode
endpoints, or a label that is not a version number, e.g. a fresh server's) falls back to ``current_version``.

Retries: connection errors (refused, reset, DNS), 429 and 5xx are retried with exponential backoff (an
upstream's ``Retry-After`` is honoured up to the cap). A non-streamed call is retried until its whole body
was read; a streamed one only until the upstream answered with a success status: once the first byte of a
stream has gone to the harness nothing is retried. Read timeouts are not retried (the upstream may still be
generating).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp

from harnessrl.replica_targets import DNS_SCHEME, base_urls, parse_dns_target

from .metrics import ProxyMetrics

log = logging.getLogger(__name__)


class UpstreamUnavailable(Exception):
    """No upstream answered (connection errors on every attempt, or a read timeout)."""

    def __init__(self, url: str, cause: BaseException, *, timeout: bool = False) -> None:
        detail = str(cause) or type(cause).__name__
        super().__init__(f"upstream {url} {'timed out' if timeout else 'unreachable'}: {detail}")
        self.url = url
        self.timeout = timeout


@dataclass
class Answer:
    """A fully read upstream answer."""

    status: int
    body: bytes
    content_type: str
    url: str
    policy_version: int
    seconds: float
    retry_after: str | None = None


@dataclass
class OpenStream:
    """An upstream answer whose body is still arriving (a stream, or an error not yet read)."""

    response: aiohttp.ClientResponse
    url: str
    policy_version: int
    started: float


def _retryable_status(status: int) -> bool:
    return status == 429 or status >= 500


def _is_read_timeout(exc: BaseException) -> bool:
    return isinstance(exc, (aiohttp.SocketTimeoutError, TimeoutError)) and not isinstance(
        exc, aiohttp.ConnectionTimeoutError
    )


class UpstreamPool:
    def __init__(
        self,
        urls: list[str],
        metrics: ProxyMetrics,
        current_version: Callable[[], int],
        *,
        retries: int = 3,
        backoff_s: float = 0.1,
        backoff_max_s: float = 5.0,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 900.0,
        connections: int = 1024,
        api_key: str | None = None,
        replica_versions: bool = False,
        dns_refresh_s: float = 10.0,
        resolve_wait_s: float = 45.0,
    ) -> None:
        if not urls:
            raise ValueError("at least one upstream URL is required")
        self.targets = [url.rstrip("/") for url in urls]
        self.urls = [url for url in self.targets if not url.startswith(DNS_SCHEME)]
        self.replica_versions = replica_versions
        self.dns_refresh_s = dns_refresh_s
        self.resolve_wait_s = resolve_wait_s
        self._refresher: asyncio.Task[None] | None = None
        self._resolved: dict[str, list[str]] = {}  # dns:// upstream -> its addresses' base URLs
        self.metrics = metrics
        self.current_version = current_version
        self.retries = retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.connections = connections
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.connections, limit_per_host=0, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.connect_timeout_s, sock_read=self.read_timeout_s
        )
        # read_bufsize: the first chunk of a stream carries the whole prompt's token ids.
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20)
        if any(target.startswith(DNS_SCHEME) for target in self.targets):
            await self.resolve()
            self._refresher = asyncio.create_task(self._refresh_forever())

    async def resolve(self) -> None:
        """Replace the DNS upstreams' addresses by what the names resolve to now; a name that fails or
        answers nothing keeps its previous addresses (a DNS hiccup must not drop every replica)."""
        loop = asyncio.get_running_loop()
        for target in self.targets:
            parsed = parse_dns_target(target)
            if parsed is None:
                continue
            host, port = parsed
            try:
                answers = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("upstream %s does not resolve (%s); keeping its known replicas", target, exc)
                continue
            if answers:
                self._resolved[target] = base_urls((answer[4][0] for answer in answers), port)
        urls = [
            url
            for t in self.targets
            for url in (self._resolved.get(t, []) if t.startswith(DNS_SCHEME) else [t])
        ]
        self.urls = list(dict.fromkeys(urls))

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.dns_refresh_s)
            await self.resolve()

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            self._refresher = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("UpstreamPool.start() was not awaited")
        return self._session

    async def version_of(self, url: str) -> int:
        """The policy version ``url`` serves (its weight label), else the proxy's own (module docstring)."""
        if self.replica_versions:
            try:
                async with self.session.get(
                    url + "/weight_info", headers=self.headers, timeout=aiohttp.ClientTimeout(total=5)
                ) as resp:
                    if resp.status == 200:
                        label = (await resp.json()).get("weight_version")
                        if isinstance(label, str) and label.isdigit():
                            return int(label)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.debug("no weight label from %s (%s): the proxy's version is used", url, exc)
        return self.current_version()

    async def _ranked_resolving(self, key: str) -> list[str]:
        """``ranked(key)``, resolving the DNS upstreams again while none has an address (module docstring)."""
        waited_until = time.monotonic() + self.resolve_wait_s
        while not self.urls and time.monotonic() < waited_until:  # no fixed URL, no DNS answer yet
            await asyncio.sleep(min(1.0, max(0.0, waited_until - time.monotonic())))
            await self.resolve()
            if self.urls:
                self.metrics.upstream_retries.labels(reason="resolved_late").inc()
        return self.ranked(key)

    def ranked(self, key: str) -> list[str]:
        """Upstreams in preference order for ``key`` (rendezvous hashing)."""
        if not self.urls:
            raise UpstreamUnavailable(",".join(self.targets), LookupError("no replica address resolved yet"))
        if len(self.urls) == 1:
            return self.urls

        def score(url: str) -> int:
            return int.from_bytes(hashlib.blake2b(f"{url}\0{key}".encode(), digest_size=8).digest(), "big")

        return sorted(self.urls, key=score, reverse=True)

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after is not None:
            try:
                return min(self.backoff_max_s, max(0.0, float(retry_after)))
            except ValueError:
                pass
        base = min(self.backoff_max_s, self.backoff_s * (2**attempt))
        return base / 2 + random.uniform(0, base / 2)

    async def _send_and_read(
        self,
        url: str,
        path: str,
        payload: bytes | None,
        headers: dict[str, str] | None,
        method: str,
        read: bool,
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        resp = await self.session.request(
            method, url + path, data=payload, headers={**self.headers, **(headers or {})}
        )
        try:
            return resp, (await resp.read() if read else b"")
        except BaseException:  # cut short (a harness that left cancels us too): drop the connection
            resp.close()
            raise

    async def _answer(
        self,
        path: str,
        payload: bytes | None,
        key: str,
        headers: dict[str, str] | None,
        method: str,
        *,
        read: bool,
    ) -> tuple[aiohttp.ClientResponse, bytes, str, int, float]:
        """Send until an answer that is final (2xx, or an error retrying cannot fix, or retries ran out).

        Retries connection errors, 429 and 5xx on the next upstream in ``key``'s order, with backoff.
        ``read``: the body is read inside the retry loop (a body cut short is retried too); otherwise it is
        left unread and the response open. Returns (response, body, url, policy version sent under, start).
        """
        ranked = await self._ranked_resolving(key)
        attempt = 0
        while True:
            url = ranked[attempt % len(ranked)]
            version = await self.version_of(url)
            started = time.perf_counter()
            try:
                resp, body = await self._send_and_read(url, path, payload, headers, method, read)
            except aiohttp.ClientError as exc:
                if _is_read_timeout(exc) or attempt >= self.retries:
                    raise UpstreamUnavailable(url, exc, timeout=_is_read_timeout(exc)) from exc
                self.metrics.upstream_retries.labels(reason="connection").inc()
                await asyncio.sleep(self._delay(attempt, None))
                attempt += 1
                continue
            except TimeoutError as exc:
                raise UpstreamUnavailable(url, exc, timeout=True) from exc
            if _retryable_status(resp.status) and attempt < self.retries:
                retry_after = resp.headers.get("Retry-After")
                resp.close()
                self.metrics.upstream_retries.labels(reason=str(resp.status)).inc()
                await asyncio.sleep(self._delay(attempt, retry_after))
                attempt += 1
                continue
            return resp, body, url, version, started

    async def fetch(
        self,
        path: str,
        payload: bytes | None,
        key: str,
        *,
        method: str = "POST",
        headers: dict[str, str] | None = None,
    ) -> Answer:
        """Send and read the whole answer (retrying as ``_answer`` says)."""
        resp, body, url, version, started = await self._answer(path, payload, key, headers, method, read=True)
        resp.release()
        return Answer(
            resp.status,
            body,
            resp.headers.get("Content-Type", "application/json"),
            url,
            version,
            time.perf_counter() - started,
            resp.headers.get("Retry-After"),
        )

    @asynccontextmanager
    async def stream(
        self, path: str, payload: bytes, key: str, headers: dict[str, str] | None = None
    ) -> AsyncIterator[OpenStream]:
        """Open a streamed answer, retrying until the upstream answers 2xx (or retries run out).

        The body is left unread; leaving the context closes the connection unless the body was read to
        the end, so an abandoned stream aborts the request upstream.
        """
        resp, _, url, version, started = await self._answer(path, payload, key, headers, "POST", read=False)
        try:
            yield OpenStream(resp, url, version, started)
        finally:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()
