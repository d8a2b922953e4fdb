"""OpenAI / vLLM wire shapes: what the proxy adds to a request, what it takes out of a response, SSE.

Everything here is pure (dicts and bytes in, dicts and bytes out) so the HTTP layer stays thin and the rules
can be tested without a server.

vLLM field names (ENVIRONMENT.md, vLLM 0.32):

* ``return_token_ids: true`` -> chat: top-level ``prompt_token_ids`` and ``choices[].token_ids``;
  completions: ``choices[].prompt_token_ids`` and ``choices[].token_ids``. Streaming: the same fields, the
  prompt ids only in the first chunk (of each choice), ``token_ids`` per chunk.
* chat ``logprobs: true`` -> ``choices[].logprobs.content[].logprob``;
  completions ``logprobs: k`` -> ``choices[].logprobs.token_logprobs`` (with ``echo`` the prompt's entries
  come first, so the completion's are the last ``len(token_ids)``).

Grammar-constrained chat calls (a forced ``tool_choice``, a JSON ``response_format``, vLLM's
``structured_outputs``) whose harness did not ask for log-probs itself are sent with ``top_logprobs``
``CONSTRAINED_TOP_LOGPROBS`` and ``return_tokens_as_token_ids``: with ``--logprobs-mode processed_logprobs`` the
top entries are those of the grammar-masked distribution, the tokens it forbids come back at ``-9999.0`` (-inf,
clamped), so a position with such an entry shows its whole allowed set, which is stored with the call
(``Tokens.allowed``) for the learner to score the token over it. Checked on vLLM 0.32
(``tests/test_proxy_tools_vllm_constrained.py``). A harness that asks for log-probs gets its own request unchanged,
and its constrained calls no sets (its token strings would change).

What the harness gets back: exactly what it asked for. Token-id arrays it did not request are removed (they
are vLLM extensions); ``logprobs`` it did not request is ``null``, as OpenAI returns it. What is stored as the
call's response: the upstream's full answer (a streamed one assembled into the non-streamed shape, token ids
and log-probs included); the store itself keeps the arrays once (``harnessrl.store.codec.strip_response``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

Route = Literal["chat", "completions"]

ROUTE_PATHS: dict[Route, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

SSE_DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: every SSE reader skips it (chat streams)


class Heartbeat:
    """The keep-alive of one stream answered whole: ``beat()`` is written while the answer is not there yet,
    ``rest(events)`` is what is still to be sent of the answer's own events once it is.

    This one writes the same bytes every time (an SSE comment for chat, Anthropic's ``ping`` event) and leaves
    the answer's events alone. A keep-alive must be something the client's stream idle timer counts: Codex
    CLI's does not count SSE comments (measured: with ``stream_idle_timeout_ms`` 3000 it gave up on a stream
    of comments every 0.5 s), so Responses streams use events (``responses_api.ResponsesHeartbeat``).
    ``error`` is the route's error event (``failed``) for an answer that failed once the stream was open.
    """

    def __init__(self, keepalive: bytes, failed: Callable[[Mapping[str, Any]], bytes]) -> None:
        self.keepalive = keepalive
        self.failed = failed

    def beat(self) -> bytes:
        return self.keepalive

    def error(self, error: Mapping[str, Any]) -> bytes:
        return self.failed(error)

    def rest(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return events


def heartbeat(body: Mapping[str, Any], convert: Any) -> Heartbeat:
    """The keep-alive of a streamed chat call answered whole (``ServedPlan.replay``): SSE comments."""
    return Heartbeat(KEEPALIVE, error_event)


class RequestError(ValueError):
    """A request the proxy refuses itself (4xx), in OpenAI's error vocabulary."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type_


def error_body(
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


def dumps(obj: Any) -> bytes:
    """Compact JSON. msgspec: ~10x faster than the standard library on these bodies, and floats use the
    shortest representation that round-trips bit-exactly (log-probs are never rounded)."""
    return _encoder.encode(obj)


def loads(raw: bytes) -> Any:
    """Strict JSON (no NaN/Infinity literals); raises ``ValueError`` on malformed input or absurd nesting."""
    try:
        return _decoder.decode(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


# --------------------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class ClientWants:
    """What the harness itself asked for, so the proxy's additions can be taken out again."""

    token_ids: bool
    logprobs: bool


def _expect(body: Mapping[str, Any], name: str, types: tuple[type, ...], what: str) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) and bool not in types:
        raise RequestError(f"'{name}' must be {what}, got a boolean", param=name)
    if not isinstance(value, types):
        raise RequestError(f"'{name}' must be {what}, got {type(value).__name__}", param=name)


def validate_request(route: Route, body: Any) -> dict[str, Any]:
    """Check the fields the proxy reads or changes; everything else is the upstream's to judge."""
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    if route == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty array of message objects", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise RequestError(
                    f"'messages[{i}]' must be an object with 'role' and 'content'", param=f"messages[{i}]"
                )
        _expect(body, "logprobs", (bool,), "a boolean")
        _expect(body, "top_logprobs", (int,), "an integer")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise RequestError(
                "'prompt' must be a string, an array of strings or an array of token ids", param="prompt"
            )
        _expect(body, "logprobs", (int,), "an integer")
        _expect(body, "echo", (bool,), "a boolean")
    _expect(body, "model", (str,), "a string")
    _expect(body, "stream", (bool,), "a boolean")
    _expect(body, "return_token_ids", (bool,), "a boolean")
    _expect(body, "n", (int,), "an integer")
    _expect(body, "stream_options", (dict,), "an object")
    return body


# Top log-probs asked for on a constrained call: vLLM's default --max-logprobs (a server started with a lower
# one refuses more); a position with fewer legal tokens than this shows all of them.
CONSTRAINED_TOP_LOGPROBS = 20
TOKEN_ID_PREFIX = "token_id:"  # a token as ``return_tokens_as_token_ids`` writes it
FORBIDDEN_LOGPROB = -9999.0  # vLLM's floor for a log-prob: -inf, a token the sampler could not draw
_STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def constrained(body: Mapping[str, Any]) -> bool:
    """Whether vLLM may decode this chat request under a structured-output grammar: a ``tool_choice`` that
    forces a call (``required`` or a named function) with tools, ``strict`` tools the model may call (vLLM then
    constrains a call once the model starts one: measured on the tiny model with ``tool_choice`` auto, 28 of
    480 positions of free text had forbidden tokens), a ``json_schema``/``json_object``/``structural_tag``
    ``response_format``, or vLLM's own ``structured_outputs`` (``guided_*`` in older servers). Asking too often
    costs only top log-probs: positions the grammar leaves free show no forbidden token and get no set."""
    choice = body.get("tool_choice")
    tools = body.get("tools")
    if tools and choice != "none":
        if choice == "required" or isinstance(choice, dict):
            return True
        if isinstance(tools, list) and any(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("strict") is True
            for t in tools
        ):
            return True
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object", "structural_tag"):
        return True
    return any(body.get(name) is not None for name in _STRUCTURED_FIELDS)


def ask_allowed(out: dict[str, Any], body: Mapping[str, Any]) -> bool:
    """Add to the upstream chat request ``out`` what shows a constrained call's allowed sets (see the module
    docstring); whether it did. Only for a harness that did not ask for log-probs: it gets none back
    (``strip_unrequested``), so nothing it sees changes."""
    if body.get("logprobs") is True or not constrained(body):
        return False
    out["top_logprobs"] = CONSTRAINED_TOP_LOGPROBS
    out["return_tokens_as_token_ids"] = True
    return True


def allowed_sets(entries: Any) -> list[list[int]] | None:
    """Per chat log-prob entry, the token ids the sampler could draw there: the finite top entries where some
    entry is forbidden (so every legal token is listed), else [] (not all shown). None when the entries carry
    no top log-probs written as token ids (nothing was asked for).

    Top log-probs come at every position or at none (as many as the request's ``top_logprobs``, vLLM and OpenAI
    alike), so entries whose first has none are answered at once: an unconstrained call's 200 entries cost a
    Python loop otherwise, on every call (~20 us, measured).
    """
    if not isinstance(entries, list) or not entries:
        return None
    first = entries[0]
    if isinstance(first, dict) and not first.get("top_logprobs"):
        return None
    out: list[list[int]] = []
    seen = False
    for entry in entries:
        tops = entry.get("top_logprobs") if isinstance(entry, dict) else None
        ids: list[int] = []
        if isinstance(tops, list) and tops:
            try:
                legal = [t for t in tops if t["logprob"] > FORBIDDEN_LOGPROB]
                if len(legal) < len(tops) and all(t["token"].startswith(TOKEN_ID_PREFIX) for t in legal):
                    ids = sorted({int(t["token"][len(TOKEN_ID_PREFIX):]) for t in legal})
                    seen = True
            except (TypeError, KeyError, ValueError, AttributeError):
                ids = []
        out.append(ids)
    return out if seen else None


def client_wants(route: Route, body: Mapping[str, Any]) -> ClientWants:
    logprobs = body.get("logprobs")
    wants_logprobs = bool(logprobs) if route == "chat" else logprobs is not None
    return ClientWants(token_ids=body.get("return_token_ids") is True, logprobs=wants_logprobs)


def upstream_request(
    route: Route, body: Mapping[str, Any], *, train: bool, model: str | None, sampling: Mapping[str, Any]
) -> dict[str, Any]:
    """The body sent upstream: the harness's, plus token ids and log-probs and the run's fixed settings."""
    out = dict(body)
    if model is not None:
        out["model"] = model
    if not train:
        return out
    out.update(sampling)
    out["return_token_ids"] = True
    if route == "chat":
        out["logprobs"] = True
        ask_allowed(out, body)
    else:
        asked = body.get("logprobs")
        out["logprobs"] = (
            asked if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 1 else 1
        )
    return out


# -------------------------------------------------------------------------------------------- responses


def strip_unrequested(obj: dict[str, Any], wants: ClientWants) -> dict[str, Any]:
    """What the harness gets: ``obj`` without what it did not ask for (a shallow copy; ``obj`` is untouched).

    Works on full responses and stream chunks of both routes alike.
    """
    if wants.token_ids and wants.logprobs:
        return obj
    out = dict(obj)
    if not wants.token_ids:
        out.pop("prompt_token_ids", None)
    choices = out.get("choices")
    if isinstance(choices, list):
        new_choices: list[Any] = []
        for choice in choices:
            if isinstance(choice, dict):
                choice = dict(choice)
                if not wants.token_ids:
                    choice.pop("token_ids", None)
                    choice.pop("prompt_token_ids", None)
                if not wants.logprobs and choice.get("logprobs") is not None:
                    choice["logprobs"] = None
            new_choices.append(choice)
        out["choices"] = new_choices
    return out


@dataclass
class Tokens:
    """Token-exact capture of one choice (choice 0; see ``capture.py`` for n > 1)."""

    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    # per completion token, the ids a structured-output grammar allowed there ([]: not shown); None: no sets
    allowed: list[list[int]] | None = None


def _int_list(value: Any) -> list[int]:
    # Elements are not checked one by one here (hot path); the store validates every array it packs.
    return list(value) if isinstance(value, list) else []


def _logprob(value: Any) -> float:
    # vLLM clamps -inf to -9999.0; a None (echo's first prompt token) never reaches completion tokens.
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _choice_logprobs(route: Route, choice: Mapping[str, Any], n_tokens: int) -> list[float]:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or n_tokens == 0:
        return []
    if route == "chat":
        content = lp.get("content")
        if not isinstance(content, list):
            return []
        try:
            return [float(entry["logprob"]) for entry in content]
        except (TypeError, KeyError, ValueError):  # something odd in one entry: take the careful path
            return [
                _logprob(entry.get("logprob")) if isinstance(entry, dict) else math.nan for entry in content
            ]
    values = lp.get("token_logprobs")
    if not isinstance(values, list):
        return []
    tail = values[-n_tokens:]
    try:
        return [float(v) for v in tail]
    except (TypeError, ValueError):
        return [_logprob(v) for v in tail]


def _first_choice(obj: Mapping[str, Any], index: int = 0) -> dict[str, Any] | None:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == index:
            return choice
    return None


def tokens_from_response(route: Route, body: Mapping[str, Any]) -> Tokens:
    """Prompt ids, completion ids and log-probs of choice 0 of a non-streamed vLLM response."""
    choice = _first_choice(body)
    if choice is None:
        return Tokens()
    prompt = body.get("prompt_token_ids") if route == "chat" else choice.get("prompt_token_ids")
    completion = _int_list(choice.get("token_ids"))
    finish = choice.get("finish_reason")
    lp = choice.get("logprobs")
    return Tokens(
        prompt_token_ids=_int_list(prompt),
        completion_token_ids=completion,
        logprobs=_choice_logprobs(route, choice, len(completion)),
        finish_reason=finish if isinstance(finish, str) else None,
        allowed=_choice_allowed(route, lp.get("content") if isinstance(lp, dict) else None, len(completion)),
    )


def _choice_allowed(route: Route, entries: Any, n_tokens: int) -> list[list[int]] | None:
    """A chat choice's allowed sets (``allowed_sets``), when they line up with its completion tokens."""
    if route != "chat" or entries is None:
        return None
    sets = allowed_sets(entries)
    return sets if sets is not None and len(sets) == n_tokens else None


def usage_tokens(body: Mapping[str, Any]) -> tuple[int, int]:
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return 0, 0
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (prompt if isinstance(prompt, int) else 0, completion if isinstance(completion, int) else 0)


def reply_message(response: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The assistant message of choice 0 of a chat response (stored or assembled), if any."""
    if not response:
        return None
    choice = _first_choice(response)
    message = choice.get("message") if choice else None
    return message if isinstance(message, dict) else None


def _norm_tool_calls(calls: Any) -> list[tuple[Any, Any, Any]]:
    if not isinstance(calls, list):
        return []
    out = []
    for call in calls:
        if not isinstance(call, dict):
            return [("invalid", call, None)]
        fn = call.get("function") or {}
        out.append((call.get("id"), fn.get("name"), fn.get("arguments")))
    return out


def same_message(sent: Mapping[str, Any], reply: Mapping[str, Any]) -> bool:
    """Whether a message the harness sent back is the model's reply: role, content and tool calls match.

    Fields the server fills with null/empty defaults (``refusal``, ``annotations``, ``reasoning``...) are
    ignored; content ``null`` and ``""`` are the same (both render as nothing in a chat template).
    """
    if sent.get("role") != reply.get("role"):
        return False
    if (sent.get("content") or "") != (reply.get("content") or ""):
        return False
    return _norm_tool_calls(sent.get("tool_calls")) == _norm_tool_calls(reply.get("tool_calls"))


# ------------------------------------------------------------------------------------------- streaming


@dataclass
class SSEEvent:
    """One server-sent event: ``data`` is the parsed JSON payload, ``done`` the ``[DONE]`` sentinel."""

    raw: bytes
    data: dict[str, Any] | None = None
    done: bool = False


def parse_sse_event(raw: bytes) -> SSEEvent:
    """Parse one event (the bytes up to and including its blank line); non-JSON events stay opaque."""
    if raw.startswith(b"data: ") and raw.find(b"\n") == len(raw) - 2:  # one data line: vLLM's every event
        payload = raw[6:-2].rstrip(b"\r")
    else:
        lines = [line[5:].lstrip(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")]
        if not lines:
            return SSEEvent(raw)
        payload = b"\n".join(line.rstrip(b"\r") for line in lines)
    if payload.strip() == b"[DONE]":
        return SSEEvent(raw, done=True)
    try:
        data = loads(payload)
    except ValueError:
        return SSEEvent(raw)
    return SSEEvent(raw, data=data if isinstance(data, dict) else None)


class SSESplitter:
    """Cuts a byte stream into whole events (each ending with its blank line), whatever the read sizes."""

    def __init__(self, max_event_bytes: int) -> None:
        self.max_event_bytes = max_event_bytes
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer + data if self._buffer else data
        events: list[bytes] = []
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            events.append(buffer[start : end + 2])
            start = end + 2
        self._buffer = buffer[start:]
        if len(self._buffer) > self.max_event_bytes:
            raise ValueError(f"a server-sent event is larger than {self.max_event_bytes} bytes")
        return events

    def rest(self) -> bytes:
        """Bytes after the last complete event (a stream that ended without its blank line)."""
        rest, self._buffer = self._buffer, b""
        return rest


def sse_bytes(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def answered_error(body: bytes) -> dict[str, Any]:
    """The ``error`` object of an error answer (the proxy's own or an upstream's), for a stream's error event."""
    try:
        parsed = loads(body)
    except ValueError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict):
        return error
    message = error if isinstance(error, str) else body.decode("utf-8", "replace")
    return {"message": message, "type": "upstream_error"}


def error_event(error: Mapping[str, Any]) -> bytes:
    """A chat or completions stream's error (as vLLM ends a stream that failed), then ``[DONE]``."""
    return sse_bytes({"error": dict(error)}) + SSE_DONE


@dataclass
class _ChoiceState:
    index: int
    role: str | None = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    reasoning_field: str = "reasoning"
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    text: list[str] = field(default_factory=list)
    logprob_entries: list[Any] = field(default_factory=list)  # chat: content entries
    completion_logprobs: dict[str, list[Any]] = field(default_factory=dict)  # completions: parallel arrays
    finish_reason: str | None = None
    stop_reason: Any = None
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)


class StreamAssembler:
    """Builds, chunk by chunk, the non-streamed response a streamed call amounts to, plus its tokens.

    ``feed`` must see each chunk *before* it is stripped for the harness, since the stripped fields
    (token ids, log-probs) are exactly what the capture needs.
    """

    def __init__(self, route: Route) -> None:
        self.route = route
        self.head: dict[str, Any] = {}
        self.prompt_token_ids: list[int] = []
        self.choices: dict[int, _ChoiceState] = {}
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None

    def feed(self, chunk: Mapping[str, Any]) -> None:
        if "error" in chunk and not chunk.get("choices"):
            self.error = dict(chunk)
            return
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model") if k in chunk}
        if self.route == "chat" and isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_token_ids = _int_list(chunk["prompt_token_ids"])
        if isinstance(chunk.get("usage"), dict):
            self.usage = dict(chunk["usage"])
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for raw in choices:
            if isinstance(raw, dict):
                self._feed_choice(raw)

    def _feed_choice(self, raw: Mapping[str, Any]) -> None:
        index = raw.get("index", 0)
        index = index if isinstance(index, int) else 0
        state = self.choices.get(index)
        if state is None:  # not setdefault: that would build a state (15 fields) for every chunk
            state = self.choices[index] = _ChoiceState(index)
        ids = _int_list(raw.get("token_ids"))
        state.token_ids.extend(ids)
        if self.route == "completions" and isinstance(raw.get("prompt_token_ids"), list):
            state.prompt_token_ids = _int_list(raw["prompt_token_ids"])
        state.token_logprobs.extend(_choice_logprobs(self.route, raw, len(ids)) if ids else [])
        if raw.get("finish_reason") is not None:
            state.finish_reason = raw["finish_reason"]
        if raw.get("stop_reason") is not None:
            state.stop_reason = raw["stop_reason"]
        lp = raw.get("logprobs")
        if self.route == "chat":
            delta = raw.get("delta")
            if isinstance(delta, dict):
                self._feed_delta(state, delta)
            if isinstance(lp, dict) and isinstance(lp.get("content"), list):
                state.logprob_entries.extend(lp["content"])
        else:
            if isinstance(raw.get("text"), str):
                state.text.append(raw["text"])
            if isinstance(lp, dict):
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    if isinstance(lp.get(key), list):
                        state.completion_logprobs.setdefault(key, []).extend(lp[key])

    @staticmethod
    def _feed_delta(state: _ChoiceState, delta: Mapping[str, Any]) -> None:
        if isinstance(delta.get("role"), str):
            state.role = delta["role"]
        if isinstance(delta.get("content"), str):
            state.content.append(delta["content"])
        for name in ("reasoning", "reasoning_content"):
            if isinstance(delta.get(name), str):
                state.reasoning_field = name
                state.reasoning.append(delta[name])
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            idx = call.get("index", 0)
            slot = state.tool_calls.setdefault(
                idx, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
            )
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            fn = call.get("function") or {}
            if fn.get("name"):
                slot["function"]["name"] = fn["name"]
            if isinstance(fn.get("arguments"), str):
                slot["function"]["arguments"] += fn["arguments"]

    def tokens(self) -> Tokens:
        state = self.choices.get(0)
        if state is None:
            return Tokens(prompt_token_ids=list(self.prompt_token_ids))
        prompt = self.prompt_token_ids if self.route == "chat" else state.prompt_token_ids
        allowed = _choice_allowed(self.route, state.logprob_entries, len(state.token_ids))
        return Tokens(list(prompt), list(state.token_ids), list(state.token_logprobs), state.finish_reason, allowed)

    def response(self) -> dict[str, Any]:
        """The assembled answer shaped like vLLM's non-streamed one (token ids and log-probs included)."""
        if self.route == "chat":
            out: dict[str, Any] = {**self.head, "object": "chat.completion", "choices": []}
            for idx in sorted(self.choices):
                st = self.choices[idx]
                message: dict[str, Any] = {"role": st.role or "assistant", "content": "".join(st.content)}
                if st.reasoning:
                    message[st.reasoning_field] = "".join(st.reasoning)
                if st.tool_calls:
                    message["tool_calls"] = [st.tool_calls[k] for k in sorted(st.tool_calls)]
                choice: dict[str, Any] = {
                    "index": idx,
                    "message": message,
                    "logprobs": {"content": st.logprob_entries} if st.logprob_entries else None,
                    "finish_reason": st.finish_reason,
                    "stop_reason": st.stop_reason,
                }
                if st.token_ids or self.prompt_token_ids:
                    choice["token_ids"] = st.token_ids
                out["choices"].append(choice)
            if self.prompt_token_ids:
                out["prompt_token_ids"] = self.prompt_token_ids
        else:
            out = {**self.head, "object": "text_completion", "choices": []}
            for idx in sorted(self.choices):
                st = self.choices[idx]
                choice = {
                    "index": idx,
                    "text": "".join(st.text),
                    "logprobs": st.completion_logprobs or None,
                    "finish_reason": st.finish_reason,
                    "stop_reason": st.stop_reason,
                }
                if st.prompt_token_ids or st.token_ids:
                    choice["prompt_token_ids"] = st.prompt_token_ids
                    choice["token_ids"] = st.token_ids
                out["choices"].append(choice)
        if self.usage is not None:
            out["usage"] = self.usage
        if self.error is not None:
            out["error"] = self.error.get("error", self.error)
        return out
