"""The HTTP layer: aiohttp routes over the protocol, capture, writer, upstream and pause modules.

Routes (every ``/v1/...`` route also under ``/rollouts/{rollout}/attempts/{attempt}``, which is how a shared
gateway learns attribution; a sidecar takes it from its environment):

``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``, ``POST /v1/messages`` (streamed or
not; the Responses and Anthropic Messages captures are in ``responses_api.py`` and ``anthropic_api.py``), ``GET /v1/models``,
``POST /v1/reward``, ``POST /v1/rollout/finish``, ``GET /healthz``, ``GET /metrics``,
``POST /admin/pause``, ``POST /admin/resume``, ``GET /admin/state``, ``POST /admin/policy-version``,
``POST /admin/flush``.

``POST /v1/reward`` answers once the reward is in the store (the harness may exit at once: the scheduler
then sees it), 409 ``attempt_settled`` naming the attempt and its state when the attempt already ended
(nothing is changed), 503 ``reward_not_stored`` when the store did not take it within ``reward_timeout_s``
(the proxy keeps it in its spool). ``GET /healthz`` is 503 with a ``reason`` while captured items reach
neither the store nor the spool.

In train mode a request with ``n`` above 1 is refused (400, ``param: "n"``; see ``refuse_several_choices``).

Errors the proxy raises itself are 4xx in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``;
an upstream's error answer is passed through with its status and body and recorded as an error call.
A call whose harness went away before the answer was complete is recorded with status ``aborted`` and HTTP
status 499 (the request is cancelled upstream by closing its connection).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from harnessrl.store.call_rows import attempt_key
from harnessrl.store.digest_cache import PrefixDigestCache
from harnessrl.store.records import CallStatus, RolloutState
from harnessrl.store.states import AttemptSettled, IllegalTransition

from . import anthropic_api, chat_served, protocol, responses_api, served_stream
from .call_log import log_call, log_refusal
from .capture import Attribution, RolloutLedger, build_call_record
from .config import ProxyConfig
from .continuity import DerenderFailed, TokenContinuity
from .metrics import ProxyMetrics
from .pause import PausedError, PauseGate
from .protocol import (
    ROUTE_PATHS,
    SSE_DONE,
    ClientWants,
    RequestError,
    Route,
    SSESplitter,
    Tokens,
    dumps,
    error_body,
    loads,
    parse_sse_event,
    sse_bytes,
)
from .spool import Spool
from .upstreams import UpstreamPool, UpstreamUnavailable
from .versions import AdminPolicyVersion, PolicyVersionSource
from .writer import CallItem, FinishItem, RewardItem, TraceSink, TraceWriter, UpstreamFailedItem

log = logging.getLogger(__name__)

ATTRIBUTED_PREFIX = "/rollouts/{rollout_id}/attempts/{attempt}"
MAX_SSE_EVENT_BYTES = 256 * 1024 * 1024
HTTP_CLIENT_CLOSED = 499

PROXY_KEY = web.AppKey("harnessrl_proxy", object)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json", headers=headers)


def json_error(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return json_response(error_body(message, type_=type_, param=param, code=code), status, headers)


def _error_code(response: web.Response) -> str:
    """The ``error.code`` of an error answer the proxy made (``json_error``)."""
    try:
        return str(loads(response.body)["error"]["code"])  # type: ignore[arg-type]
    except (ValueError, KeyError, TypeError):
        return str(response.status)


class _HarnessGone(Exception):
    """Writing to the harness failed: it closed the connection."""


async def read_json(request: web.Request) -> Any:
    """The request body as JSON, or a 4xx ``RequestError`` that says what is wrong with it."""
    if request.headers.get("Content-Type"):
        ctype = request.content_type
        if ctype != "application/json" and not ctype.endswith("+json"):
            raise RequestError(
                f"Content-Type {ctype!r} is not supported; send the body as application/json",
                status=415,
                code="unsupported_media_type",
            )
    raw = await request.read()
    if not raw.strip():
        raise RequestError("request body is empty; send a JSON object")
    try:
        return loads(raw)
    except ValueError as exc:
        raise RequestError(f"request body is not valid JSON ({exc})", code="invalid_json") from None


def refuse_several_choices(body: dict[str, Any]) -> None:
    """Train mode takes one sample per call: ``n`` above 1 is refused (400, param ``n``), never half-captured.

    Why refused rather than stored as ``n`` calls: a stored call is one prompt and one completion, and the
    row builder reads two kept calls with the same prompt as a retry (it keeps one, counts the other as
    ``duplicate``), so the extra choices would be lost again, only later. They would also all share the
    rollout's single reward, while the harness goes on from one of them. Several samples of one task are
    what a group is: ``harness.groupSize`` rollouts, each with its own reward and advantage.
    """
    n = body.get("n")
    if n is None or n == 1:
        return
    raise RequestError(
        f"'n' is {n}: in train mode every call is one sample of the policy, and the trace store keeps one "
        "completion per call (extra choices would be lost to training). Send n=1 (or leave it out) and "
        "sample several times with several calls, or run several rollouts of the task (harness.groupSize); "
        "a proxy in --mode observe passes n through",
        param="n",
        code="n_not_supported",
    )


WIRES = {"responses": responses_api, "messages": anthropic_api}


def wire(route: str) -> Any:
    """The module that knows a route's wire shapes: ``responses_api`` for ``/v1/responses``,
    ``anthropic_api`` for ``/v1/messages``, else ``protocol``."""
    return WIRES.get(route, protocol)


@dataclass
class Exchange:
    """One LLM call on its way through the proxy: what every step from admission to capture needs."""

    route: Route
    who: Attribution
    body: dict[str, Any]  # the request as the harness sent it (what is stored)
    wants: ClientWants  # what the harness asked for (the proxy's additions are taken out again)
    payload: bytes  # the request as sent upstream
    path: str  # the upstream route it is sent to
    started: float
    convert: Any = None  # token continuity: turns the completions answer (or chunk) into the chat shape
    rendered: list[int] | None = None  # token continuity: the chat template's rendering of the messages
    chat_messages: list[Any] | None = None  # a call served as a chat completion: the chat messages it amounts to
    answer_as: Any = None  # such a call: its translation from the chat completion (the route's ``converter``)
    live: served_stream.ServedStream | served_stream.ParsedStream | None = None  # such a call streamed while generated (``served_stream.py``)
    parent: str = ""  # token continuity: the id of the call it continues (``RolloutLedger.remember``)
    keepalive: KeepAlive | None = None  # a stream answered in its route's own events: its keep-alive clock


class KeepAlive:
    """The keep-alive clock of one streamed call the proxy answers in its route's own events (a Messages or
    Responses call served as a chat completion), started when the request arrived.

    Why from the arrival: the first keep-alive must reach the harness ``stream_keepalive_s`` after it sent the
    call, however long the proxy then takes before the answer is asked for. Before, the clock started once a
    continued call was planned (the server rendering ~46k tokens of Claude Code's prompt, three times, under
    load): the first byte came up to 5 s past the keep-alive time (10.0 s for one call,
    ``bench/harness_clis.py`` at ce1239d). The planning, the whole answer (``_replayed``) and a relayed
    stream's prefill (``_relay``) are each awaited through ``until``, which sends the stream's 200, its headers
    and the route's keep-alive (``beats``: the route's ``LiveEvents``, whose Responses numbering carries on
    into the answer's events) whenever one is due. Nothing sent that way is wrong if the call then fails: a
    keep-alive promises no answer, and an error after it goes out as the route's error event
    (``CaptureProxy._ended``)."""

    def __init__(self, request: web.Request, beats: Any, started: float, interval: float) -> None:
        self.request = request
        self.beats = beats  # beat(), error(error), rest(events): ``protocol.Heartbeat``'s interface
        self.interval = interval
        self.due = started + interval  # when the next keep-alive goes out (perf_counter)
        self.resp: web.StreamResponse | None = None  # the stream, once opened

    async def until(self, awaitable: Awaitable[Any],
                    send: Callable[[bytes], Awaitable[None]] | None = None) -> Any:
        """``awaitable``'s result, a keep-alive sent (through ``send``, by default the stream's write) each
        time one is due while waiting; the awaitable is cancelled if this fails or is cancelled (harness gone)."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=max(0.0, self.due - time.perf_counter()))
                if done:
                    return task.result()
                if self.resp is None:
                    self.resp = await CaptureProxy._open_stream(self.request)
                await (send or self.resp.write)(self.beats.beat())
                self.due = time.perf_counter() + self.interval
        except BaseException:
            task.cancel()
            raise


class CaptureProxy:
    """One proxy: its settings, state, writer and upstream pool; ``app()`` builds the aiohttp application."""

    def __init__(
        self, config: ProxyConfig, store: TraceSink, *, versions: PolicyVersionSource | None = None
    ) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.versions = versions or AdminPolicyVersion(config.policy_version)
        self.gate = PauseGate(config.pause_mode, config.pause_retry_after_s)
        self.ledger = RolloutLedger(config.live_rollouts, config.last_call_tokens)
        self.digests = PrefixDigestCache()  # message prefix digests of live conversations (delta encoding)
        self.writer = TraceWriter(
            store,
            Spool(config.resolved_spool_path, config.spool_max_bytes),
            self.metrics,
            batch_size=config.write_batch,
            queue_size=config.queue_size,
            queue_max_bytes=config.queue_max_bytes,
            retry_s=config.spool_retry_s,
            linger_s=config.write_linger_s,
            release_idle_s=config.store_release_idle_s,
        )
        self.upstreams = UpstreamPool(
            config.upstreams,
            self.metrics,
            self.versions.current,
            retries=config.upstream_retries,
            backoff_s=config.upstream_backoff_s,
            backoff_max_s=config.upstream_backoff_max_s,
            connect_timeout_s=config.upstream_connect_timeout_s,
            read_timeout_s=config.upstream_read_timeout_s,
            connections=config.upstream_connections,
            api_key=config.upstream_api_key,
            replica_versions=config.replica_versions,
        )
        self.continuity = TokenContinuity(self.upstreams, self.metrics) if config.continuity_enabled else None
        self.metrics.in_flight.set_function(lambda: self.gate.in_flight)
        self.metrics.paused.set_function(lambda: 1 if self.gate.paused else 0)
        self.metrics.policy_version.set_function(self.versions.current)

    # -- application -----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._middleware])
        app[PROXY_KEY] = self
        for prefix in ("", ATTRIBUTED_PREFIX):
            named = "" if not prefix else "attributed_"
            app.router.add_post(prefix + "/v1/chat/completions", self.chat, name=named + "chat")
            app.router.add_post(prefix + "/v1/completions", self.completions, name=named + "completions")
            app.router.add_post(prefix + "/v1/responses", self.responses, name=named + "responses")
            app.router.add_post(prefix + "/v1/messages", self.messages, name=named + "messages")
            app.router.add_get(prefix + "/v1/models", self.models, name=named + "models")
            app.router.add_post(prefix + "/v1/reward", self.reward, name=named + "reward")
            app.router.add_post(prefix + "/v1/rollout/finish", self.finish, name=named + "finish")
        app.router.add_get("/healthz", self.healthz, name="healthz")
        app.router.add_get("/metrics", self.prometheus, name="metrics")
        if self.config.admin:
            app.router.add_post("/admin/pause", self.admin_pause, name="admin_pause")
            app.router.add_post("/admin/resume", self.admin_resume, name="admin_resume")
            app.router.add_get("/admin/state", self.admin_state, name="admin_state")
            app.router.add_post(
                "/admin/policy-version", self.admin_policy_version, name="admin_policy_version"
            )
            app.router.add_post("/admin/flush", self.admin_flush, name="admin_flush")
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.upstreams.start()
        self.writer.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.upstreams.close()
        loop = asyncio.get_running_loop()
        stored = await loop.run_in_executor(None, self.writer.close, self.config.shutdown_timeout_s)
        if not stored:
            log.warning("proxy stopped with items left in the spool %s", self.writer.spool.path)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        start = time.perf_counter()
        info = request.match_info
        route = info.route.name if info.route.name else "unmatched"
        route = route.removeprefix("attributed_")
        try:
            response = await handler(request)
        except RequestError as exc:
            response = json_error(exc.status, exc.message, type_=exc.type, param=exc.param, code=exc.code)
            self._refused(request, route, exc.status, exc.code or exc.type, exc.message)
        except web.HTTPException as exc:
            response = self._http_exception(request, exc)
            self._refused(request, route, response.status, _error_code(response), exc.reason)
        except asyncio.CancelledError:
            self.metrics.requests.labels(route, str(HTTP_CLIENT_CLOSED)).inc()
            raise
        except Exception as exc:  # a bug in the proxy: answer in the same shape, keep serving
            log.exception("internal error on %s %s", request.method, request.path)
            response = json_error(500, f"internal proxy error: {type(exc).__name__}", type_="server_error")
            self._refused(request, route, 500, "internal_error", f"{type(exc).__name__}: {exc}")
        self.metrics.requests.labels(route, str(response.status)).inc()
        self.metrics.latency.labels(route).observe(time.perf_counter() - start)
        return response

    def _refused(self, request: web.Request, route: str, status: int, code: Any, message: str) -> None:
        """A response the proxy made itself (no upstream answer, so no call record): counted by route, status
        and code, and logged with its rollout, so a harness retrying a refused call shows up (issue 26: Claude
        Code's tool_reference blocks were refused 3 times and nobody saw it)."""
        code = str(code)
        self.metrics.refused.labels(route, str(status), code).inc()
        info = request.match_info
        if "rollout_id" in info:
            who = f"{info['rollout_id']}/{info['attempt']}"
        else:
            who = "-" if self.config.rollout_id is None else f"{self.config.rollout_id}/{self.config.attempt}"
        log_refusal(who, route, status, code, message)

    @staticmethod
    def _http_exception(request: web.Request, exc: web.HTTPException) -> web.Response:
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        if exc.status == 404:
            message = (
                f"unknown route {request.method} {request.path}: the proxy serves /v1/chat/completions, "
                "/v1/completions, /v1/responses, /v1/messages, /v1/models, /v1/reward, /v1/rollout/finish (also under "
                "/rollouts/{rollout}/attempts/{attempt}), /healthz, /metrics and /admin/*"
            )
            return json_error(404, message, code="not_found")
        if exc.status == 405:
            return json_error(
                405,
                f"method {request.method} is not allowed on {request.path}",
                code="method_not_allowed",
                headers=headers,
            )
        if exc.status == 413:
            return json_error(
                413,
                f"request body larger than {request.app[PROXY_KEY].config.max_body_bytes} "
                "bytes (raise HARNESSRL_MAX_BODY_BYTES to allow it)",
                code="body_too_large",
            )
        return json_error(exc.status, exc.text or exc.reason, code=exc.status, headers=headers)

    # -- attribution and capture -----------------------------------------------------------------------

    def attribution(self, request: web.Request) -> Attribution:
        info = request.match_info
        if "rollout_id" in info:
            try:
                attempt = int(info["attempt"])
            except ValueError:
                attempt = -1
            if attempt < 0:
                raise RequestError(
                    f"attempt {info['attempt']!r} in the URL must be a non-negative integer",
                    param="attempt",
                    code="invalid_attribution",
                )
            return Attribution(self.config.run, info["rollout_id"], attempt)
        if self.config.rollout_id is not None:
            return Attribution(self.config.run, self.config.rollout_id, self.config.attempt)
        raise RequestError(
            "missing rollout attribution: this proxy is a shared gateway, so call it under "
            "/rollouts/{rollout}/attempts/{attempt}/v1/... (a sidecar sets HARNESSRL_ROLLOUT_ID)",
            code="missing_attribution",
        )

    def capture(
        self,
        x: Exchange,
        response: dict[str, Any] | None,
        tokens: Tokens,
        *,
        policy_version: int,
        upstream: str,
        status: CallStatus,
        http_status: int,
    ) -> None:
        """Number the call, remember it as the attempt's last, and hand it to the writer (no awaits).

        The response is stored as the harness got it: the token ids and log-probs the proxy asked for on its
        own behalf live once, in the record's arrays (DESIGN.md section 4), so the store neither keeps nor
        checks a second copy (on a 200-token chat answer, checking the log-prob entries before cutting them
        out cost more CPU than the rest of the capture). An answer with several choices (observe mode only:
        train mode refuses ``n`` > 1) is kept whole; the arrays hold choice 0 only.
        """
        who = x.who
        choices = response.get("choices") if response is not None else None
        if not isinstance(choices, list) or len(choices) <= 1:
            response = None if response is None else wire(x.route).strip_unrequested(response, x.wants)
        record = build_call_record(
            who=who,
            seq=self.ledger.next_seq(who.key),
            route=x.route,
            request=x.body,
            response=response,
            tokens=tokens,
            policy_version=policy_version,
            upstream=upstream,
            latency_s=time.perf_counter() - x.started,
            status=status,
            http_status=http_status,
        )
        record.sampling = self.config.sampling_sent(who.rollout_id, x.body)
        chat = None
        if x.chat_messages is not None and status is CallStatus.OK:  # continued later like the chat call it was
            reply = wire(x.route).chat_reply(response)
            chat = None if reply is None else (x.chat_messages, reply)
        item = CallItem(record, size=len(x.payload), digests=self.digests)
        self.ledger.remember(who.key, record, x.rendered, chat, item.packed, x.parent)
        self.writer.put(item)
        asyncio.get_running_loop().call_soon(item.prepare)  # once the answer is on its way (see CallItem)
        self.metrics.calls.labels(x.route, status.value).inc()
        log_call(record)
        self.metrics.prompt_tokens.inc(len(tokens.prompt_token_ids))
        self.metrics.completion_tokens.inc(len(tokens.completion_token_ids))

    async def _wait_for_room(self) -> None:
        if self.writer.has_room():
            return
        self.metrics.backpressure_waits.inc()
        delay = 0.001
        while not self.writer.has_room():
            await asyncio.sleep(delay)
            delay = min(0.05, delay * 2)

    # -- LLM routes ------------------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._llm(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._llm(request, "completions")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._llm(request, "responses")  # type: ignore[arg-type]

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._llm(request, "messages")  # type: ignore[arg-type]

    async def _llm(self, request: web.Request, route: Route) -> web.StreamResponse:
        started = time.perf_counter()
        who = self.attribution(request)
        body = wire(route).validate_request(route, await read_json(request))
        wants = wire(route).client_wants(route, body)
        cfg = self.config
        if cfg.train:
            refuse_several_choices(body)
        await self._wait_for_room()
        try:
            async with self.gate.admit():
                chat_body = self._as_chat(route, body)
                streams = body.get("stream") is True
                # one translation (a Responses answer's id) for the keep-alives, the answer and any fallback
                early_as = None if chat_body is None else wire(route).converter(body)
                keepalive = None
                if streams and early_as is not None:
                    keepalive = KeepAlive(request, wire(route).live_events(body, early_as), started,
                                          cfg.stream_keepalive_s)
                if self.continuity is not None and (route == "chat" or chat_body is not None):
                    planning = self.continuity.plan(
                        who,
                        body if chat_body is None else served_stream.streamed_chat(chat_body) if streams
                        else chat_body,
                        self.ledger.recent_calls(who.key),
                        cfg.model_name,
                        cfg.sampling_for(who.rollout_id) if cfg.train else {},
                    )
                    try:
                        plan = await (planning if keepalive is None else keepalive.until(planning))
                    except (asyncio.CancelledError, ConnectionResetError, aiohttp.ClientConnectionResetError):
                        # the harness left while the server rendered its call
                        self._capture_abandoned(Exchange(route, who, body, wants, b"", "", started))
                        if keepalive is None or keepalive.resp is None:
                            raise
                        return keepalive.resp
                    except Exception as exc:
                        if keepalive is None or keepalive.resp is None:
                            raise  # answered by the middleware, as any other failure of the proxy's
                        return await self._failed_open(request, route, keepalive, exc)
                    if plan is not None:
                        convert = plan.convert_chunk if plan.stream else plan.convert_response
                        answer_as = early_as
                        if answer_as is not None:
                            convert = chat_served.then(convert, answer_as)
                        parsed_live = chat_body is not None and streams and getattr(plan, "live", False)
                        if parsed_live:  # tools, tool_choice auto: generated as a stream (ParsedStream)
                            plan.request["stream"] = True
                        x = Exchange(
                            route, who, body, wants, plan.payload, plan.path, started, convert,
                            plan.rendered_prompt, None if chat_body is None else chat_body["messages"], answer_as,
                            parent=plan.parent_call_id, keepalive=keepalive,
                        )  # fmt: skip
                        if keepalive is not None and plan.stream:  # through /v1/completions
                            x.live = served_stream.ServedStream(plan.convert_chunk, answer_as,
                                                                keepalive.beats)
                            return await self._ended(keepalive, await self._streamed(request, x))
                        if keepalive is not None and parsed_live:
                            x.live = served_stream.ParsedStream(plan, answer_as, keepalive.beats,
                                                                derender_tokens=cfg.stream_derender_tokens)
                            return await self._ended(keepalive, await self._streamed(request, x))
                        if chat_body is not None and streams:  # the server's parsers read the whole answer
                            return await self._replayed(request, x)
                        if getattr(plan, "replay", False):  # a streamed chat call the server's parsers read
                            return await self._replayed(request, x, plan.replay_sse)  # type: ignore[attr-defined]
                        return await (self._streamed(request, x) if plan.stream else self._unary(x))
                shapes = wire(route)
                sampling = cfg.sampling_for(who.rollout_id)
                if chat_body is not None:
                    payload = dumps(chat_served.for_upstream(chat_body, train=cfg.train, model=cfg.model_name,
                                                             sampling=sampling))
                    answer_as = early_as
                    x = Exchange(route, who, body, wants, payload, chat_served.PATH, started, answer_as, None,
                                 chat_body["messages"], answer_as, keepalive=keepalive)
                else:
                    payload = dumps(
                        shapes.upstream_request(route, body, train=cfg.train, model=cfg.model_name, sampling=sampling)
                    )
                    path = getattr(shapes, "PATH", None) or ROUTE_PATHS[route]
                    x = Exchange(route, who, body, wants, payload, path, started)
                if body.get("stream") is True and (route == "messages" or (route == "responses" and cfg.train)):
                    return await self._replayed(request, x)
                return await (self._streamed(request, x) if body.get("stream") is True else self._unary(x))
        except PausedError as exc:
            self._refused(request, route, 503, "paused", "paused for a weight sync")
            return json_error(
                503,
                "the proxy is paused for a weight sync; retry after the Retry-After delay",
                type_="server_error",
                code="paused",
                headers={"Retry-After": str(exc.retry_after_s)},
            )

    def _as_chat(self, route: Route, body: dict[str, Any]) -> dict[str, Any] | None:
        """The chat request a Messages call, or a Responses call in train mode with token continuity on, is
        served as (``chat_served.py``); None for a call served on its own route. A Responses call the
        translation cannot carry keeps vLLM's route, its reason counted as a continuity outcome."""
        if route == "messages":
            chat = anthropic_api.chat_request(body)
            for name in anthropic_api.dropped_fields(body):
                self.metrics.dropped.labels(route, name).inc()
            return chat
        if route != "responses" or not self.config.train or self.continuity is None:
            return None
        try:
            chat = responses_api.chat_request(body)
        except responses_api.Untranslatable as exc:
            self.metrics.continuity.labels(outcome=exc.reason).inc()
            return None
        for name in responses_api.dropped_fields(body):
            self.metrics.dropped.labels(route, name).inc()
        return chat

    async def _unary(self, x: Exchange) -> web.Response:
        try:
            answer = await self.upstreams.fetch(x.path, x.payload, x.who.rollout_id)
        except UpstreamUnavailable as exc:
            return self._unavailable(x, exc)
        except asyncio.CancelledError:
            self._capture_abandoned(x)
            raise
        self.metrics.upstream_latency.labels(x.route).observe(answer.seconds)
        if not 200 <= answer.status < 300:
            return self._passthrough_error(
                x,
                answer.status,
                answer.body,
                answer.content_type,
                answer.url,
                answer.policy_version,
                answer.retry_after,
            )
        try:
            data = loads(answer.body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return self._bad_upstream(
                x,
                answer.url,
                answer.policy_version,
                "upstream answered 2xx with a body that is not a JSON object",
            )
        if x.convert is not None:
            data = x.convert(data)
            if inspect.isawaitable(data):  # continuity's tool calls: the server's derender reads the answer
                try:
                    data = await data
                except DerenderFailed as exc:
                    return self._bad_upstream(x, answer.url, answer.policy_version, str(exc))
                except asyncio.CancelledError:  # the harness left while the server derendered its answer
                    self._capture_abandoned(x)
                    raise
        tokens = wire(x.route).tokens_from_response(x.route, data)
        out = dumps(wire(x.route).strip_unrequested(data, x.wants))
        self.capture(
            x,
            data,
            tokens,
            policy_version=answer.policy_version,
            upstream=answer.url,
            status=CallStatus.OK,
            http_status=answer.status,
        )
        return web.Response(body=out, status=answer.status, content_type="application/json")

    async def _replayed(
        self, request: web.Request, x: Exchange, replay: Callable[[dict[str, Any]], bytes] | None = None
    ) -> web.StreamResponse:
        """A streamed Responses call in train mode, a streamed Messages call, or a streamed chat call continued
        through the server's parsers (``replay``: its answer as stream bytes): fetched whole, captured, then
        replayed to the harness as its API's event stream (``responses_api.py``, ``anthropic_api.py`` and
        ``continuity.py`` say why).

        Keep-alive: an answer not there after ``stream_keepalive_s`` gets its 200 and the stream's headers then,
        and the route's keep-alive every ``stream_keepalive_s`` until the answer is whole (its ``heartbeat``:
        Anthropic's ``ping`` event; for Responses the answer's own ``response.created``, then
        ``response.in_progress`` again, since Codex's idle timer does not count SSE comments; an SSE comment for
        chat): the first byte came only after the whole generation (30-62 s on CPU for Claude Code and Codex,
        minutes on a GPU with long generations), and clients with stream idle timeouts gave up. An error
        answered before that goes back with its status as it came; one after it as the protocol's error event
        (``error_event``)."""
        self.metrics.streams.labels(x.route, "replayed").inc()
        fetch = asyncio.ensure_future(self._unary(x))
        clock = x.keepalive or KeepAlive(request, wire(x.route).heartbeat(x.body, x.answer_as), x.started,
                                         self.config.stream_keepalive_s)
        heart = clock.beats
        resp: web.StreamResponse | None = clock.resp
        try:
            answer = await clock.until(fetch)
            resp = clock.resp
            body = answer.body if isinstance(answer.body, bytes) else b""
            if resp is None and answer.status != 200:
                return answer
            shapes = wire(x.route)
            if resp is None:
                resp = await self._open_stream(request)
            if answer.status != 200:
                await resp.write(heart.error(protocol.answered_error(body)))
            else:
                answered = loads(body)
                if replay is not None:
                    await resp.write(replay(answered))
                else:
                    await resp.write(b"".join(map(shapes.sse_bytes, heart.rest(shapes.replay_events(answered)))))
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            if not fetch.done():
                fetch.cancel()  # the harness left while waiting: the call is recorded as aborted
        except asyncio.CancelledError:
            fetch.cancel()
            raise
        return resp if resp is not None else clock.resp

    async def _ended(self, clock: KeepAlive, response: web.StreamResponse) -> web.StreamResponse:
        """``response``, or where the keep-alives already opened the stream and the call then failed before
        its own stream began (the upstream refused it or was unreachable: already captured), that error as the
        route's error event on the open stream, as ``_replayed`` answers one."""
        if clock.resp is None or response is clock.resp or not isinstance(response, web.Response):
            return response
        body = response.body if isinstance(response.body, bytes) else b""
        try:
            await clock.resp.write(clock.beats.error(protocol.answered_error(body)))
            await clock.resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass  # the harness left; the call is captured already
        return clock.resp

    async def _failed_open(self, request: web.Request, route: str, clock: KeepAlive,
                           exc: Exception) -> web.StreamResponse:
        """A failure of the proxy's own (the middleware's 500) after keep-alives opened the stream: logged and
        counted as the middleware does, and answered as the route's error event."""
        log.exception("internal error on %s %s", request.method, request.path)
        self._refused(request, route, 500, "internal_error", f"{type(exc).__name__}: {exc}")
        resp = await self._ended(clock, json_error(500, f"internal proxy error: {type(exc).__name__}",
                                                   type_="server_error"))
        return resp

    @staticmethod
    async def _open_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"},
        )
        await resp.prepare(request)
        return resp

    def _capture_abandoned(self, x: Exchange) -> None:
        """Record a call the harness gave up on before any upstream answer reached it (stored as aborted)."""
        self.capture(
            x,
            None,
            Tokens(),
            policy_version=self.versions.current(),
            upstream="",
            status=CallStatus.ABORTED,
            http_status=HTTP_CLIENT_CLOSED,
        )

    def _unavailable(self, x: Exchange, exc: UpstreamUnavailable) -> web.Response:
        status = 504 if exc.timeout else 502
        code = "upstream_timeout" if exc.timeout else "upstream_unavailable"
        err = error_body(str(exc), type_="upstream_error", code=code)
        self.metrics.upstream_failures.labels(x.route, str(status), code).inc()
        self.capture(
            x,
            err,
            Tokens(),
            policy_version=self.versions.current(),
            upstream=exc.url,
            status=CallStatus.ERROR,
            http_status=status,
        )
        # behind the call, in order: the attempt's failure is then retried without using an attempt
        self.writer.put(UpstreamFailedItem(x.who.rollout_id, x.who.attempt, x.who.run))
        return json_response(err, status)

    def _bad_upstream(self, x: Exchange, url: str, version: int, message: str) -> web.Response:
        err = error_body(message, type_="upstream_error", code="upstream_bad_response")
        self.metrics.upstream_failures.labels(x.route, "502", "upstream_bad_response").inc()
        self.capture(
            x,
            err,
            Tokens(),
            policy_version=version,
            upstream=url,
            status=CallStatus.ERROR,
            http_status=502,
        )
        return json_response(err, 502)

    def _passthrough_error(
        self,
        x: Exchange,
        status: int,
        raw: bytes,
        content_type: str,
        url: str,
        version: int,
        retry_after: str | None,
    ) -> web.Response:
        try:
            parsed = loads(raw)
            stored = parsed if isinstance(parsed, dict) else {"error": {"message": parsed}}
        except ValueError:
            stored = {"error": {"message": raw.decode("utf-8", "replace")}}
        self.capture(
            x,
            stored,
            Tokens(),
            policy_version=version,
            upstream=url,
            status=CallStatus.ERROR,
            http_status=status,
        )
        headers = {"Retry-After": retry_after} if retry_after else None
        return web.Response(
            body=raw,
            status=status,
            headers=headers,
            content_type=content_type.split(";")[0].strip() or "application/json",
        )

    async def _streamed(self, request: web.Request, x: Exchange) -> web.StreamResponse:
        relaying = False  # from then on _relay records the call, however it ends
        self.metrics.streams.labels(x.route, "relayed").inc()
        try:
            async with self.upstreams.stream(x.path, x.payload, x.who.rollout_id) as up:
                upstream = up.response
                if not 200 <= upstream.status < 300:
                    raw = await upstream.read()
                    return self._passthrough_error(
                        x,
                        upstream.status,
                        raw,
                        upstream.headers.get("Content-Type", "application/json"),
                        up.url,
                        up.policy_version,
                        upstream.headers.get("Retry-After"),
                    )
                relaying = True
                return await self._relay(request, x, up)
        except UpstreamUnavailable as exc:
            return self._unavailable(x, exc)
        except asyncio.CancelledError:
            if not relaying:
                self._capture_abandoned(x)
            raise

    async def _relay(self, request: web.Request, x: Exchange, up: Any) -> web.StreamResponse:
        """Pass the upstream's events through as they arrive (what one read brought goes out in one write),
        capturing them; the call is queued before ``[DONE]`` goes out, so a reward sent after the stream ends
        can never overtake it."""
        resp = x.keepalive.resp if x.keepalive is not None else None
        if resp is None:  # no keep-alive went out yet
            resp = await self._open_stream(request)
            if x.keepalive is not None:
                x.keepalive.resp = resp
        route, wants, convert, live = x.route, x.wants, x.convert, x.live
        shapes = wire(route)
        assembler = live if live is not None else shapes.StreamAssembler(route)
        raw_passthrough = wants.token_ids and wants.logprobs and convert is None
        status, http_status = CallStatus.OK, up.response.status
        error_event: bytes | None = None
        done = False
        recorded = False

        async def send(data: bytes) -> None:
            try:
                await resp.write(data)
            except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
                raise _HarnessGone() from exc

        def record(call_status: CallStatus, code: int) -> None:
            nonlocal recorded
            recorded = True
            self.metrics.upstream_latency.labels(route).observe(time.perf_counter() - up.started)
            self.capture(
                x,
                assembler.response(),
                assembler.tokens(),
                policy_version=up.policy_version,
                upstream=up.url,
                status=call_status,
                http_status=code,
            )

        try:
            content = up.response.content
            splitter = SSESplitter(MAX_SSE_EVENT_BYTES)
            while True:
                try:
                    if live is not None and not live.started and x.keepalive is not None:
                        # prefill (Claude Code's prompt is about 46k tokens): nothing to send but keep-alives,
                        # which clients with stream idle timers must see, as on the replay path
                        data = await x.keepalive.until(content.readany(), send)
                    else:
                        data = await content.readany()
                    events = splitter.feed(data) if data else [splitter.rest()]
                except (aiohttp.ClientError, TimeoutError, HttpProcessingError, ValueError) as exc:
                    status, http_status = CallStatus.ERROR, 502
                    message = f"upstream {up.url} failed mid-stream: {type(exc).__name__}: {exc}"
                    assembler.error = error_body(
                        message, type_="upstream_error", code="upstream_stream_broken"
                    )
                    error_event = sse_bytes(assembler.error)
                    break
                out: list[bytes] = []  # everything that arrived in this read goes out in one write
                parsed: list[dict[str, Any]] = []  # a ParsedStream's chunks of this read: derendered at once
                for raw in events:
                    if not raw.strip():
                        continue
                    event = parse_sse_event(raw)
                    if event.done:
                        done = True
                    elif event.data is None:
                        out.append(raw if raw.endswith(b"\n\n") else raw + b"\n\n")
                    elif isinstance(live, served_stream.ParsedStream):
                        parsed.append(event.data)
                    elif live is not None:
                        out += [shapes.sse_bytes(shapes.strip_unrequested(e, wants)) for e in live.feed(event.data)]
                    else:
                        for chunk in convert(event.data) if convert is not None else (event.data,):
                            assembler.feed(chunk)
                            out.append(raw if raw_passthrough else shapes.sse_bytes(shapes.strip_unrequested(chunk, wants)))
                if parsed:  # the start events go out before the derender call is awaited
                    out += [shapes.sse_bytes(shapes.strip_unrequested(e, wants)) for e in live.take(parsed)]
                    if out:
                        await send(b"".join(out))
                    out = [shapes.sse_bytes(shapes.strip_unrequested(e, wants)) for e in await live.derender_taken()]
                if out:
                    await send(b"".join(out))
                if not data:
                    break
            if done and isinstance(live, served_stream.ParsedStream):  # the whole answer parsed as unstreamed
                settled = await live.settle()
                if settled:
                    await send(b"".join(shapes.sse_bytes(shapes.strip_unrequested(e, wants)) for e in settled))
            if assembler.error is not None:
                status = CallStatus.ERROR
            if live is not None:  # the route's error event, or its closing events built before the record
                ending = (live.live.error(assembler.error.get("error", assembler.error)) if assembler.error
                          else self._closing(live, shapes, wants) if done else b"")
            record(status, http_status)
            if live is not None:
                await send(ending)  # no [DONE]: these routes end with their own events
            else:
                if error_event is not None:
                    await send(error_event)
                    done = True
                if done:
                    await send(SSE_DONE)
            await resp.write_eof()
        except _HarnessGone:
            if not recorded:
                record(CallStatus.ABORTED, HTTP_CLIENT_CLOSED)
        except asyncio.CancelledError:
            if not recorded:
                record(CallStatus.ABORTED, HTTP_CLIENT_CLOSED)
            raise
        return resp

    @staticmethod
    def _closing(live: served_stream.ServedStream | served_stream.ParsedStream, shapes: Any, wants: ClientWants) -> bytes:
        """The closing events of a stream relayed while generated (the whole answer translated, ``finish``)."""
        return b"".join(shapes.sse_bytes(shapes.strip_unrequested(e, wants)) for e in live.finish())

    # -- models, rewards, rollout end --------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        try:
            answer = await self.upstreams.fetch("/v1/models", None, "models", method="GET")
        except UpstreamUnavailable as exc:
            return json_error(502, str(exc), type_="upstream_error", code="upstream_unavailable")
        return web.Response(
            body=answer.body,
            status=answer.status,
            content_type=answer.content_type.split(";")[0].strip() or "application/json",
        )

    def _check_reward_token(self, request: web.Request) -> None:
        """With a verifier (``HARNESSRL_REWARD_TOKEN``), only the verifier decides an attempt's outcome."""
        token = self.config.reward_token
        if token is not None and not hmac.compare_digest(
            request.headers.get("Authorization", "").encode(), f"Bearer {token}".encode()
        ):
            raise RequestError(
                f"this run's rewards come from its verifier: {request.path} needs the header Authorization: "
                "Bearer $HARNESSRL_REWARD_TOKEN, which only the verifier is given",
                status=403,
                code="reward_token_required",
            )

    async def reward(self, request: web.Request) -> web.Response:
        who = self.attribution(request)
        self._check_reward_token(request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise RequestError('reward body must be a JSON object like {"value": 1.0, "info": {...}}')
        value = body.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(
                f"'value' must be a finite number, got {json.dumps(value)[:80]}",
                param="value",
                code="invalid_reward",
            )
        info = body.get("info")
        if info is not None and not isinstance(info, dict):
            raise RequestError("'info' must be a JSON object (or left out)", param="info")
        error = await self._stored(RewardItem(who.rollout_id, who.attempt, float(value), info, who.run))
        if isinstance(error, AttemptSettled):
            raise RequestError(str(error), status=409, param="attempt", code="attempt_settled")
        self._raise_unstored(
            error,
            f"the reward for rollout {who.rollout_id} attempt {who.attempt}",
            "reward",
            "but the attempt may be settled without it — post it again before exiting",
        )
        return json_response(
            {
                "rollout_id": who.rollout_id,
                "attempt": who.attempt,
                "value": float(value),
                "accepted": True,
                "stored": True,
            }
        )

    def _raise_unstored(self, error: BaseException | None, what: str, code: str, advice: str = "") -> None:
        """The answer for a reward or a rollout end the store did not take: 503 while it is away (the item
        stays in the proxy), 422 when it refused it."""
        if isinstance(error, TimeoutError):
            raise RequestError(
                f"{what} is not stored yet: the trace store did not take it within "
                f"{self.config.reward_timeout_s:g} s ({self.writer.problem() or 'it is unavailable'}); the proxy "
                f"keeps it and stores it when it can{', ' + advice if advice else ''}",
                status=503,
                code=f"{code}_not_stored",
            )
        if error is not None:
            raise RequestError(
                f"the trace store refused {what}: {type(error).__name__}: {error}",
                status=422,
                code=f"{code}_refused",
            )

    async def _stored(self, item: RewardItem | FinishItem) -> BaseException | None:
        """Queue ``item`` behind the calls before it and wait until the store has it (None), refused it (the
        error) or ``reward_timeout_s`` passed (``TimeoutError``).

        Why wait: a harness exits right after its reward is accepted, and the scheduler settles an attempt
        that exited without a stored reward as NoReward; answering before the write would race it.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[BaseException | None] = loop.create_future()

        def resolve(error: BaseException | None) -> None:
            if not done.done():
                done.set_result(error)

        self.writer.put(item, on_done=lambda error: loop.call_soon_threadsafe(resolve, error))
        try:
            return await asyncio.wait_for(done, self.config.reward_timeout_s)
        except TimeoutError as exc:
            return exc

    async def finish(self, request: web.Request) -> web.Response:
        who = self.attribution(request)
        self._check_reward_token(request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise RequestError('finish body must be a JSON object like {"status": "succeeded"}')
        status = body.get("status")
        if status not in ("succeeded", "failed"):
            raise RequestError(
                f'\'status\' must be "succeeded" or "failed", got {json.dumps(status)[:80]}', param="status"
            )
        error = body.get("error")
        reason = None if error is None else (error if isinstance(error, str) else json.dumps(error))
        # Answered once stored, as a reward is: the harness may exit at once, and the scheduler must see it.
        failure = await self._stored(
            FinishItem(who.rollout_id, who.attempt, RolloutState(status), reason, who.run)
        )
        self.ledger.forget(who.key)
        self.digests.forget(attempt_key(who))
        if isinstance(failure, IllegalTransition):
            raise RequestError(
                f"rollout {who.rollout_id} attempt {who.attempt} is already {failure.from_state.value}: "
                "a settled attempt is not finished again",
                status=409,
                param="attempt",
                code="attempt_settled",
            )
        self._raise_unstored(failure, f"the end of rollout {who.rollout_id} attempt {who.attempt}", "finish")
        return json_response(
            {
                "rollout_id": who.rollout_id,
                "attempt": who.attempt,
                "status": status,
                "accepted": True,
                "stored": True,
            }
        )

    # -- operations ----------------------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        """200 while captured calls reach the store or the spool; 503 with the reason while they cannot
        (the spool is full or unwritable, the writer fails), since then the proxy only holds them in memory
        and soon makes every call wait: a probe must see that, not "ok"."""
        writer = self.writer
        body = {"status": "ok", "paused": self.gate.paused, "spool_pending": writer.spool.pending}
        problem = writer.problem()
        if problem is None:
            return json_response(body)
        return json_response({**body, "status": "failing", "reason": problem}, 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _optional_json(self, request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        raw = await request.read()
        if not raw.strip():
            return {}
        try:
            body = loads(raw)
        except ValueError:
            raise RequestError("admin request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError("admin request body must be a JSON object")
        return body

    async def admin_pause(self, request: web.Request) -> web.Response:
        body = await self._optional_json(request)
        mode = body.get("mode", self.config.pause_mode)
        if mode not in ("reject", "wait"):
            raise RequestError('\'mode\' must be "reject" (503 + Retry-After) or "wait"', param="mode")
        timeout = body.get("timeout_s", self.config.drain_timeout_s)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise RequestError("'timeout_s' must be a number of seconds >= 0", param="timeout_s")
        report = await self.gate.pause(mode, float(timeout))
        return json_response(report.as_json())

    async def admin_resume(self, request: web.Request) -> web.Response:
        self.gate.resume()
        return json_response(self.gate.state())

    async def admin_state(self, request: web.Request) -> web.Response:
        cfg = self.config
        return json_response(
            {
                **self.gate.state(),
                "policy_version": self.versions.current(),
                "queue_depth": self.writer.queued,
                "unwritten": self.writer.depth,
                "spool_pending": self.writer.spool.pending,
                "queue_bytes": self.writer.queued_bytes,
                "spool_bytes": self.writer.spool.size,
                "writer_problem": self.writer.problem(),
                "queue_size": cfg.queue_size,
                "queue_max_bytes": cfg.queue_max_bytes,
                "spool_path": str(self.writer.spool.path),
                "spool_max_bytes": cfg.spool_max_bytes,
                "retry_after_s": cfg.pause_retry_after_s,
                "upstreams": self.upstreams.urls,
                "mode": cfg.proxy_mode,
                "attribution": "sidecar" if cfg.sidecar else "gateway",
                "run": cfg.run,
            }
        )

    async def admin_policy_version(self, request: web.Request) -> web.Response:
        body = await self._optional_json(request)
        version = body.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise RequestError("'version' must be an integer >= 0", param="version")
        if not isinstance(self.versions, AdminPolicyVersion):
            raise RequestError(
                "this proxy reads the policy version from a shared source; set it there",
                status=409,
                code="version_not_settable",
            )
        self.versions.set(version)
        return json_response({"policy_version": version})

    async def admin_flush(self, request: web.Request) -> web.Response:
        """Wait until every captured item so far is in the store (for tests and for a learner's barrier)."""
        body = await self._optional_json(request)
        timeout = body.get("timeout_s", 30.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise RequestError("'timeout_s' must be a number of seconds >= 0", param="timeout_s")
        loop = asyncio.get_running_loop()
        flushed = await loop.run_in_executor(None, self.writer.flush, float(timeout))
        return json_response(
            {"flushed": flushed, "spool_pending": self.writer.spool.pending}, 200 if flushed else 503
        )


async def start_proxy(
    proxy: CaptureProxy, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float | None = None
) -> tuple[web.AppRunner, str]:
    """Serve ``proxy`` on ``host:port`` (0: a free port); returns the runner and the base URL."""
    runner = web.AppRunner(
        proxy.app(),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=proxy.config.shutdown_timeout_s if shutdown_timeout is None else shutdown_timeout,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, f"http://{host}:{bound}"


async def start_metrics(proxy: CaptureProxy, port: int, host: str = "0.0.0.0") -> web.AppRunner:
    """Serve ``GET /metrics`` alone on ``host:port``. A sidecar's proxy listens on loopback, so that only the
    harness in its pod can attribute calls and rewards; Prometheus scrapes the pod's address, and this listener
    gives it the counters and nothing else (no call, reward or admin route)."""
    app = web.Application()
    app.router.add_get("/metrics", proxy.prometheus)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
