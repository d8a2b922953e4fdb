"""Anthropic Messages (``POST /v1/messages``) through the proxy: served as a chat completion, captured as one.

vLLM 0.32 serves ``/v1/messages`` but answers it without token ids or log-probs whatever the request asks
(measured: ``return_token_ids``/``logprobs`` are ignored, streamed or not), so the proxy cannot capture it
there. Instead it translates the request into the chat completion vLLM's own Messages endpoint would run (the
same messages, tools and sampling, rendered by the same chat template), sends that to
``/v1/chat/completions`` with token ids and log-probs, and translates the answer back into an Anthropic
message (text and ``tool_use`` blocks, ``stop_reason``, ``usage``). The call is stored with the harness's
own request and the Anthropic answer it got, and the chat completion's exact token ids and log-probs.
Being a chat request, it gets token continuity too (``continuity.py``, ``chat_served.py``): a call whose
messages repeat an earlier call's messages and answer (its text and ``tool_use`` blocks) + new ones
(``tool_result`` blocks, user text) continues that call's exact tokens, so an agent loop trains as one row.

A streamed request continued through ``/v1/completions`` (no tools, no reasoning parser) is relayed while
generated, one ``content_block_delta`` per chunk (``LiveMessage``, ``served_stream.py``); any other is
answered once the completion is whole, as Anthropic's event sequence (``message_start``, each block's start /
delta / stop, ``message_delta``, ``message_stop``): exact capture over token-by-token delivery, as for the
Responses API (``served_stream.py`` says which calls and why). Supported content: text, ``thinking`` (the reasoning a
server's reasoning parser splits off, answered as vLLM's own route does), ``tool_use`` and ``tool_result``
blocks (with text and ``tool_reference`` content: ``tool_reference_text``); an image or document block gets a
400 naming it (logged with its rollout and counted in ``harnessrl_proxy_refused_total``).

A ``tool_use`` input is the model's arguments as generated (``tool_input``): read leniently, a number no float
holds kept as its literal, and arguments that are no JSON object as ``{"_raw": "<text>"}``.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping
from functools import partial
from typing import Any

import msgspec

from . import chat_served
from .chat_served import carried, without_carried
from .protocol import ClientWants, Heartbeat, RequestError, Tokens, dumps

PATH = chat_served.PATH
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def validate_request(route: str, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array of message objects", param="messages")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError("'max_tokens' must be a positive integer (the Messages API requires it)",
                           param="max_tokens")
    chat_messages(body)  # every block understood, or a 400 naming it
    return body


def client_wants(route: str, body: Mapping[str, Any]) -> ClientWants:
    return ClientWants(token_ids=False, logprobs=False)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or an array of content blocks", param=where)
    texts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_reference" and isinstance(block.get("tool_name"), str):
            texts.append(tool_reference_text(block["tool_name"]))
        else:
            raise RequestError(f"'{where}[{i}]' is a {kind!s} block; the proxy passes text (and in tool results "
                               "tool_reference) blocks here", param=f"{where}[{i}]", code="unsupported_block")
    return "".join(texts)


def tool_reference_text(name: str) -> str:
    """A ``tool_reference`` block (Claude Code's ToolSearch answers with them) as the text the model reads.

    Anthropic's API loads the named tool's definition when a tool search result references it, the tools
    marked ``defer_loading`` being left out of the prompt until then. The proxy renders every tool, deferred
    ones included (``chat_request``), so the definition is already in the prompt and the reference only names
    the tool, one line each."""
    return f"Tool loaded: {name}\n"


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Anthropic ``system`` and ``messages`` as chat messages (tool uses as tool calls, results as tools)."""
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text(body["system"], "system")})
    for i, message in enumerate(body["messages"]):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise RequestError(f"'{where}.role' must be \"user\", \"assistant\" or \"system\"",
                               param=f"{where}.role")
        content = message.get("content")
        if role == "system":  # Claude Code 2.1 puts its environment in a system message after the first user turn
            out.append({"role": "system", "content": _text(content, f"{where}.content")})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"'{where}.content' must be a string or an array of blocks", param=f"{where}.content")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        thoughts: list[str] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])  # the reasoning the server's parser split off, as vLLM reads it
            elif kind == "redacted_thinking" and role == "assistant":
                pass  # opaque (as in vLLM's own route): accepted so an echoed answer is not refused
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"), "arguments": tool_arguments(block.get("input"))}})
            elif kind == "tool_result" and role == "user":
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                "content": _text(block.get("content") or "", f"{at}.content")})
            else:
                raise RequestError(f"'{at}' is a {kind!s} block in a {role} message; the proxy passes text, "
                                   "thinking and tool_use (assistant) and tool_result (user) blocks", param=at,
                                   code="unsupported_block")
        out.extend(results)
        if texts or calls or thoughts or not results:
            message_out: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if thoughts:
                message_out["reasoning"] = "".join(thoughts)
            if calls:
                message_out["tool_calls"] = calls
            out.append(message_out)
    return out


RAW_ARGUMENTS = "_raw"  # a tool_use input holding arguments that are no JSON object, as generated


def _float(text: str) -> Any:
    """A JSON number as a float, or its literal (``msgspec.Raw``, sent as written) when no finite float holds
    it: the harness gets the number the model wrote (``1e999`` reads back as Infinity in JavaScript too)."""
    value = float(text)
    return value if math.isfinite(value) else msgspec.Raw(text.encode())


def _constant(name: str) -> Any:
    """``Infinity`` / ``-Infinity`` / ``NaN``, which vLLM's tool parsers write for a number too large for a
    float (they re-dump the model's arguments with Python's json): as the JSON number that reads back as it."""
    return msgspec.Raw({"Infinity": b"1e999", "-Infinity": b"-1e999"}[name]) if name != "NaN" else None


def tool_input(arguments: Any) -> dict[str, Any]:
    """A chat tool call's ``arguments`` as an Anthropic ``tool_use`` input.

    What the model generated, read leniently: control characters inside strings are taken (Python's
    ``strict=False``, as the parsers that accepted them do), and a number no float holds keeps its literal
    (the store keeps it as text, ``strict_json.py``).
    Arguments that are no JSON object (a forced call without a strict schema lets a random model write any
    JSON, or a call cut at ``max_tokens``) come as ``{"_raw": "<the arguments as generated>"}``, since an
    input must be an object; ``tool_arguments`` turns such an input back into the same text.
    """
    text = arguments if isinstance(arguments, str) else "{}" if arguments is None else json.dumps(arguments)
    try:
        value = json.loads(text or "{}", strict=False, parse_float=_float, parse_constant=_constant)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {RAW_ARGUMENTS: text}


def tool_arguments(tool_input_: Any) -> str:
    """A ``tool_use`` input as chat arguments: the text of an input ``tool_input`` wrapped, else its JSON."""
    raw = tool_input_.get(RAW_ARGUMENTS) if isinstance(tool_input_, dict) and len(tool_input_) == 1 else None
    if isinstance(raw, str):
        return raw
    try:
        return json.dumps(tool_input_ or {})
    except TypeError:  # a number ``tool_input`` kept as its literal
        return dumps(tool_input_).decode()


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(str(kind), "auto")


def _chat_function(tool: Mapping[str, Any]) -> dict[str, Any]:
    """An Anthropic tool as a chat function; ``strict`` (arguments constrained to the schema) kept."""
    function = {"name": tool.get("name"), "description": tool.get("description"),
                "parameters": tool.get("input_schema") or {}}
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return function


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completion the Messages request amounts to, without the proxy's additions (what token
    continuity plans on, ``continuity.py``)."""
    out: dict[str, Any] = {"model": body.get("model"), "messages": chat_messages(body), "max_tokens": body["max_tokens"]}
    for name, chat_name in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                            ("top_k", "top_k")):
        if body.get(name) is not None:
            out[chat_name] = body[name]
    effort = body.get("output_config", {}).get("effort") if isinstance(body.get("output_config"), dict) else None
    if effort is not None:
        out["reasoning_effort"] = effort
    tools = [{"type": "function", "function": _chat_function(t)} for t in body.get("tools") or []
             if isinstance(t, dict) and t.get("type") in CLIENT_TOOL_TYPES]
    if tools:
        out["tools"] = tools
        if body.get("tool_choice") is not None:
            out["tool_choice"] = _tool_choice(body["tool_choice"])
    return out


# What a Messages request may carry that vLLM cannot honour, and what the translation does with it (Claude
# Code 2.1 sends all of these). As for Responses: what reaches vLLM is what is stored and trained, and each
# drop is counted in harnessrl_proxy_dropped_fields_total{route="messages", field}.
#   metadata             dropped: the client's ids, never shown to the model.
#   thinking             dropped: vLLM has no thinking budget; a reasoning model reasons as its template and
#                        reasoning parser make it (answered as thinking blocks, read back the same way).
#   context_management   dropped: Anthropic's server-side edits of the history (clearing old thinking or tool
#                        results); the proxy renders the messages as sent, so the tokens are what vLLM saw.
#   cache_control        dropped: prompt caching hints; vLLM's prefix cache needs none.
#   output_config.effort translated: chat's reasoning_effort (read by chat templates that know it).
#   server tools         dropped (``tools.<type>``): Anthropic-hosted tools (web_search_*, code_execution_*, ...)
#                        that the server cannot run; the model is not told of them.
#   defer_loading        rendered: a deferred tool is in the prompt from the start (``tool_reference_text``).
#   anthropic-beta       (a header) not read: the features it names are the fields above.
CLIENT_TOOL_TYPES = (None, "custom")
DROPPED_FIELDS = ("metadata", "thinking", "context_management")


def dropped_fields(body: Mapping[str, Any]) -> list[str]:
    """What of a Messages request does not reach vLLM (the table above)."""
    out = [name for name in DROPPED_FIELDS if body.get(name) is not None]
    blocks = [*(body.get("system") if isinstance(body.get("system"), list) else []), *(body.get("tools") or [])]
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        blocks += content if isinstance(content, list) else []
    if any(isinstance(b, dict) and b.get("cache_control") is not None for b in blocks):
        out.append("cache_control")
    out += [f"tools.{t['type']}" for t in body.get("tools") or []
            if isinstance(t, dict) and t.get("type") not in CLIENT_TOOL_TYPES]
    return out


def upstream_request(
    route: str, body: Mapping[str, Any], *, train: bool, model: str | None, sampling: Mapping[str, Any]
) -> dict[str, Any]:
    """The chat completion the Messages request amounts to, as sent upstream (never streamed: see the module
    docstring)."""
    return chat_served.for_upstream(chat_request(body), train=train, model=model, sampling=sampling)


def chat_reply(response: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The chat message an Anthropic answer amounts to when the harness sends its content back (the same
    translation as its request's): what a later call must repeat to continue this one's tokens."""
    content = response.get("content") if response else None
    if not isinstance(content, list):
        return None
    try:
        return chat_messages({"messages": [{"role": "assistant", "content": content}]})[-1]
    except RequestError:
        return None


def from_chat(body: Mapping[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """The Anthropic message for a chat completion answer, carrying its tokens for the capture."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:  # as vLLM's own route answers it: a thinking block (its signature a random id)
        content.append({"type": "thinking", "thinking": reasoning, "signature": uuid.uuid4().hex})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                        "input": tool_input(fn.get("arguments"))})
    finish = choice.get("finish_reason")
    stop_sequence = choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else None
    usage = chat.get("usage") or {}
    return {
        "id": chat.get("id"),
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": body.get("model"),
        # a forced tool (a named tool_choice) ends with chat's "stop"; Anthropic says tool_use for any tool call
        "stop_reason": "stop_sequence" if stop_sequence else "tool_use" if message.get("tool_calls") and finish != "length"
        else STOP_REASONS.get(str(finish), "end_turn"),
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)},
        chat_served.CAPTURE_KEY: chat_served.carry(chat),
    }


def converter(body: Mapping[str, Any]) -> Any:
    return partial(from_chat, body)


def tokens_from_response(route: str, body: Mapping[str, Any]) -> Tokens:
    return carried(body) or Tokens()


def strip_unrequested(obj: dict[str, Any], wants: ClientWants) -> dict[str, Any]:
    return without_carried(obj)


def sse_bytes(obj: Mapping[str, Any]) -> bytes:
    return f"event: {obj.get('type')}\n".encode() + b"data: " + dumps(obj) + b"\n\n"


KEEPALIVE = sse_bytes({"type": "ping"})  # Anthropic's own keep-alive event


def heartbeat(body: Mapping[str, Any], convert: Any) -> Heartbeat:
    """The keep-alive of a streamed call answered whole: ``ping`` events (Claude Code's idle timers count them)."""
    return Heartbeat(KEEPALIVE, error_event)


def error_event(error: Mapping[str, Any]) -> bytes:
    """Anthropic's stream error event."""
    return sse_bytes({"type": "error", "error": {"type": str(error.get("type") or "api_error"),
                                                 "message": str(error.get("message") or "")}})


class LiveMessage:
    """Anthropic's events for a message relayed while generated (``served_stream.py``): ``message_start`` with
    the prompt's length as ``input_tokens``, the text as one ``content_block_delta`` per chunk, then the rest of
    ``replay_events`` for the whole message (the text block's stop, any later block, ``message_delta`` with the
    stop reason and usage, ``message_stop``)."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        self.body = body
        self.opened = False  # the text block (index 0: the message has no thinking block on this path)

    def beat(self) -> bytes:
        return KEEPALIVE

    def error(self, error: Mapping[str, Any]) -> bytes:
        return error_event(error)

    def rest(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A whole answer's events after keep-alives (``protocol.Heartbeat.rest``): pings leave them as they
        are, so a call planned under keep-alives can still be answered whole (``CaptureProxy._replayed``)."""
        return events

    def start(self, head: Mapping[str, Any], prompt_tokens: int) -> list[dict[str, Any]]:
        message = {"id": head.get("id"), "type": "message", "role": "assistant", "content": [],
                   "model": self.body.get("model"), "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}]

    def text(self, delta: str, logprobs: Any) -> list[dict[str, Any]]:
        if not delta:
            return []
        events = [] if self.opened else [{"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}}]
        self.opened = True
        return [*events, {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": delta}}]

    def end(self, message: Mapping[str, Any]) -> list[dict[str, Any]]:
        sent = {"message_start"} | ({"content_block_start", "content_block_delta"} if self.opened else set())
        return [e for e in replay_events(message) if not (e["type"] in sent and e.get("index", 0) == 0)]


def live_events(body: Mapping[str, Any], convert: Any) -> LiveMessage:
    """The events of a call relayed while generated (``served_stream.py``)."""
    return LiveMessage(body)


def replay_events(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Anthropic's stream for a whole ``message``: each block started, given in one delta, stopped."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**(message.get("usage") or {}), "output_tokens": 0}}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for index, block in enumerate(message.get("content") or []):
        signed: list[dict[str, Any]] = []
        if block.get("type") == "tool_use":
            opened = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": dumps(block.get("input") or {}).decode()}
        elif block.get("type") == "thinking":
            opened = {**block, "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": block.get("thinking") or ""}
            signed = [{"type": "content_block_delta", "index": index,
                       "delta": {"type": "signature_delta", "signature": block.get("signature") or ""}}]
        else:
            opened = {**block, "text": ""}
            delta = {"type": "text_delta", "text": block.get("text") or ""}
        events += [{"type": "content_block_start", "index": index, "content_block": opened},
                   {"type": "content_block_delta", "index": index, "delta": delta},
                   *signed,
                   {"type": "content_block_stop", "index": index}]
    events += [{"type": "message_delta", "delta": {"stop_reason": message.get("stop_reason"),
                                                   "stop_sequence": message.get("stop_sequence")},
                "usage": {"output_tokens": (message.get("usage") or {}).get("output_tokens", 0)}},
               {"type": "message_stop"}]
    return events
