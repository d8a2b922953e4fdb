"""``harnessrl vllm-gate``: the only way into an operator-run vLLM, with its control paths on a port of their own.

vLLM serves its control endpoints (``/pause``, ``/resume``, ``/collective_rpc``, ``/update_weight_version``,
``/v1/load_lora_adapter``, ``/sleep``, ...) on the same port as the OpenAI API, with no authentication
(``--api-key`` guards only ``/v1``, ``/v2`` and ``/inference``), and it cannot listen on a second port. A harness
shares its network with its proxy sidecar, so anything the proxy reaches the harness reaches too: on one port, a
harness could pause every replica, load weights of its choosing or put the engine to sleep.

So in the operator's vLLM pod, vLLM listens on loopback only and this gate, a second container, is the pod's
only listener, on two ports:

- the **public** port (``naming.VLLM_PORT``, what the proxies and the harness NetworkPolicy reach) forwards
  exactly the paths a proxy uses (:data:`PUBLIC_ROUTES`: inference, tokenize/render, the model list, the weight
  label, health and metrics) and answers 403 for every other path, ``/v1/load_lora_adapter`` included;
- the **control** port (``naming.VLLM_CONTROL_PORT``) forwards everything. The run's NetworkPolicy admits only the
  run's learner pods to it, and the harness policy never lets a harness out to it.

With ``--served-marker`` the gate also keeps its server at the run's committed version: a vLLM that (re)starts
is loaded with the version the learner's marker names before any call or control request passes
(:mod:`.replica_restore`); until then those get 503, and the gate's own ``/ready`` (the vLLM container's
readiness probe) answers 503 with the reason, so the pod stays out of the replicas proxies and the learner use.

Forwarding is byte for byte: the request body is read whole (a request is small), the answer is streamed as it
arrives (server-sent events reach the proxy chunk by chunk), and a client that goes away closes the upstream
connection, which is how vLLM learns to abort the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Mapping
from pathlib import Path

import aiohttp
import click
from aiohttp import web

from .replica_restore import ReplicaRestore

log = logging.getLogger("harnessrl.vllm_gate")

PUBLIC_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/messages"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/v1/chat/completions/render"),  # token continuity (proxy/continuity.py)
        ("POST", "/v1/chat/completions/derender"),
        ("POST", "/inference/v1/generate"),
        ("GET", "/v1/models"),
        ("GET", "/weight_info"),  # the version label a proxy records its calls under (proxy/upstreams.py)
        ("GET", "/health"),  # the kubelet's probes
        ("GET", "/metrics"),  # the chart's PodMonitor
        ("GET", "/version"),
    }
)
"""(method, path) pairs the public port forwards: what the capture proxy, the probes and Prometheus use. An
exact list, not prefixes: ``/v1/load_lora_adapter`` sits under ``/v1`` and is a control path."""

READY_PATH = "/ready"
"""The gate's own readiness: vLLM's ``/health`` once the server serves the run's version (503 before)."""
ALWAYS_FORWARDED: frozenset[tuple[str, str]] = frozenset(
    {("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/version"), ("GET", "/weight_info")}
)
"""Read-only paths forwarded while a restore is pending: the startup and liveness probes, metrics, the label."""

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length"}
)
"""Headers that describe one connection, not the message (RFC 9110 7.6.1), and the ones aiohttp sets itself."""


def _message(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


def _error(status: int, message: str, kind: str) -> web.Response:
    """An error in OpenAI's shape, which the proxy and the learner already read."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


class VllmGate:
    """Forwards requests to one vLLM server (``upstream``, its root URL) from a public and a control app."""

    def __init__(self, upstream: str, control_port: int, served_marker: Path | None = None,
                 lora_name: str | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.control_port = control_port
        self.served_marker = served_marker
        self.lora_name = lora_name
        self.session: aiohttp.ClientSession | None = None
        self.restore: ReplicaRestore | None = None
        self._restoring: asyncio.Task | None = None

    async def start(self) -> None:
        # No pool limit (the proxies' concurrency is the bound); no total timeout (a long generation or a large
        # weight reload may take minutes); bodies passed through as sent (no decompression).
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent"),  # only what the client sent
        )
        if self.served_marker is not None:
            self.restore = ReplicaRestore(self.session, self.upstream, self.served_marker, self.lora_name)
            self._restoring = asyncio.create_task(self.restore.run())

    async def close(self) -> None:
        if self._restoring is not None:
            self._restoring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restoring
        if self.session is not None:
            await self.session.close()

    def _closed(self, request: web.Request) -> web.Response | None:
        """503 while the server is not yet at the run's version (the read-only paths of the probes pass)."""
        if self.restore is None or self.restore.ready or (request.method, request.path) in ALWAYS_FORWARDED:
            return None
        return _error(503, f"this vLLM replica is not serving the run's version yet: {self.restore.detail}",
                      "unavailable")

    def app(self, public: bool) -> web.Application:
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{path:.*}", self.public if public else self.forward)
        return app

    async def public(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET" and request.path == READY_PATH:
            if self.restore is not None and not self.restore.ready:
                return _error(503, f"restoring the run's version: {self.restore.detail}", "unavailable")
            return await self._forward(request, "/health")
        if (request.method, request.path) not in PUBLIC_ROUTES:
            return _error(
                403,
                f"{request.method} {request.path} is not served on this port: it serves vLLM's OpenAI API to the "
                f"run's proxies; vLLM's control paths are on port {self.control_port}, which only the run's "
                "learner reaches",
                "forbidden",
            )
        return await self.forward(request)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        closed = self._closed(request)
        if closed is not None:
            return closed
        return await self._forward(request, request.rel_url.raw_path_qs)

    async def _forward(self, request: web.Request, path_qs: str) -> web.StreamResponse:
        assert self.session is not None
        body = await request.read() if request.body_exists else None
        try:
            upstream = await self.session.request(
                request.method, self.upstream + path_qs, headers=_message(request.headers),
                data=body, allow_redirects=False,
            )
        except aiohttp.ClientError as exc:
            return _error(502, f"vLLM at {self.upstream} did not answer: {type(exc).__name__}: {exc}", "bad_gateway")
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                          headers=_message(upstream.headers))
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


async def serve(upstream: str, host: str, port: int, control_port: int, shutdown_timeout_s: float = 30.0,
                served_marker: Path | None = None, lora_name: str | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then let requests in flight finish (up to ``shutdown_timeout_s``)."""
    gate = VllmGate(upstream, control_port, served_marker, lora_name)
    await gate.start()
    runners = []
    try:
        for public, listen in ((True, port), (False, control_port)):
            runner = web.AppRunner(gate.app(public), handler_cancellation=True, access_log=None,
                                   shutdown_timeout=shutdown_timeout_s)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, host, listen).start()
        log.info("vllm-gate: %s:%d (OpenAI paths) and %s:%d (everything) -> %s", host, port, host, control_port,
                 upstream)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()
        await gate.close()


@click.command("vllm-gate")
@click.option("--upstream", required=True, metavar="URL", help="The vLLM server's root URL (on loopback).")
@click.option("--host", default="0.0.0.0", show_default=True, help="Listen address of both ports.")
@click.option("--port", type=int, required=True, help="The public port: vLLM's OpenAI paths only.")
@click.option("--control-port", type=int, required=True, help="The control port: every path.")
@click.option("--served-marker", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The learner's served-version marker (<checkpointDir>/served.json): a vLLM that (re)starts is "
              "loaded with that version before it serves.")
@click.option("--lora-name", default=None, metavar="NAME",
              help="The policy is the LoRA adapter served under NAME (else full weights).")
def gate_command(upstream: str, host: str, port: int, control_port: int, served_marker: Path | None,
                 lora_name: str | None) -> None:
    """Put vLLM behind two ports: its OpenAI API on --port, its control paths as well on --control-port."""
    from .commands import _run

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    if port == control_port:
        raise click.UsageError("--port and --control-port must differ: the control port is the one only the "
                               "learner may reach")
    try:
        _run(serve(upstream, host, port, control_port, served_marker=served_marker, lora_name=lora_name))
    except OSError as exc:
        raise click.ClickException(f"cannot serve on {host}:{port} and {control_port}: {exc}") from None
