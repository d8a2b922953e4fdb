"""The Responses API (``POST /v1/responses``) on vLLM 0.32: what the proxy adds, what it takes out, SSE.

In train mode with token continuity on, a call the proxy can translate (text messages, ``function_call``,
``function_call_output`` and reasoning items, function tools) is served as the chat completion it amounts to (the end of
this module; ``chat_served.py`` says why), so its function calls get log-probs and a later call continues its
exact tokens; ``previous_response_id`` is then refused (400 naming it: the proxy keeps no responses). Any
other call -- and every call with continuity off or in observe mode -- goes to vLLM's own route, as follows.

The same pure functions as ``protocol.py`` offers for chat and completions, for the Responses shapes.
vLLM 0.32 (measured on the tiny model, CPU) gives a token-exact capture of a Responses call through two of
its own request fields, which the proxy adds in train mode:

* ``enable_response_messages: true`` -> ``input_messages`` and ``output_messages`` on the response, each a
  list of ``{"type": "raw_message_tokens", "message": text, "tokens": [ids]}``: the prompt as the engine saw
  it and the sampled completion, as token ids (streamed: on the final ``response.completed`` /
  ``response.incomplete`` event's ``response``);
* ``include: ["message.output_text.logprobs"]`` -> per-token log-probs on every ``output_text`` part
  (``output[].content[].logprobs[].logprob``; streamed: on each ``response.output_text.delta`` event).

Streaming: vLLM's streamed Responses leave out the log-probs of tokens whose text is still empty (a UTF-8
character cut between tokens; measured: 13-16 log-probs for 16 tokens on the tiny model), so in train mode
a streamed call is sent upstream unstreamed and its answer replayed to the harness as the event sequence
vLLM streams (``replay_events``), once the answer is complete: exact capture over token-by-token delivery.
A streamed call served as a chat completion and continued through ``/v1/completions`` (no tools, no reasoning
parser) is relayed while generated instead, one ``response.output_text.delta`` per chunk, every log-prob
included (``LiveResponse``, ``served_stream.py``).

Log-probs come only for ``output_text``: a completion that is (partly) a function call or reasoning gets
fewer log-probs than tokens, and the learner drops such a call as ``malformed`` instead of guessing.

What the harness gets back is what it asked for: the messages and log-probs it did not request are taken
out again (``input_messages``/``output_messages`` null, log-prob lists empty, as vLLM answers without them).
``background: true`` is refused in train mode (vLLM returns no token ids for background responses).
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import chat_served, protocol
from .chat_served import carried, without_carried
from .protocol import ClientWants, RequestError, Tokens, _expect, _logprob, dumps

PATH = "/v1/responses"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def validate_request(route: str, body: Any) -> dict[str, Any]:
    """Check the fields the proxy reads or changes; everything else is vLLM's to judge."""
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    if not isinstance(body.get("input"), (str, list)):
        raise RequestError("'input' must be a string or an array of input items", param="input")
    _expect(body, "include", (list,), "an array of strings")
    _expect(body, "enable_response_messages", (bool,), "a boolean")
    _expect(body, "model", (str,), "a string")
    _expect(body, "stream", (bool,), "a boolean")
    _expect(body, "background", (bool,), "a boolean")
    return body


def client_wants(route: str, body: Mapping[str, Any]) -> ClientWants:
    include = body.get("include") or []
    return ClientWants(token_ids=body.get("enable_response_messages") is True, logprobs=LOGPROBS_INCLUDE in include)


def upstream_request(
    route: str, body: Mapping[str, Any], *, train: bool, model: str | None, sampling: Mapping[str, Any]
) -> dict[str, Any]:
    """The body sent upstream: the harness's, plus the token messages and log-probs and the run's sampling."""
    out = dict(body)
    if model is not None:
        out["model"] = model
    if not train:
        return out
    if body.get("background") is True:
        raise RequestError(
            "'background' responses are not captured: vLLM returns no token ids for them; send "
            "background false (or leave it out)",
            param="background",
            code="background_not_supported",
        )
    out.update(sampling)
    out["stream"] = False  # see the module docstring: a streamed call is replayed to the harness
    out.pop("stream_options", None)
    out["enable_response_messages"] = True
    include = list(body.get("include") or [])
    if LOGPROBS_INCLUDE not in include:
        include.append(LOGPROBS_INCLUDE)
    out["include"] = include
    return out


def _message_tokens(messages: Any) -> list[int]:
    if not isinstance(messages, list):
        return []
    ids: list[int] = []
    for message in messages:
        tokens = message.get("tokens") if isinstance(message, dict) else None
        if isinstance(tokens, list):
            ids.extend(tokens)
    return ids


def _output_logprobs(output: Any) -> list[float]:
    values: list[float] = []
    for item in output if isinstance(output, list) else []:
        for part in (item.get("content") or []) if isinstance(item, dict) else []:
            if isinstance(part, dict) and part.get("type") == "output_text":
                for entry in part.get("logprobs") or []:
                    values.append(_logprob(entry.get("logprob")) if isinstance(entry, dict) else float("nan"))
    return values


def _finish_reason(body: Mapping[str, Any]) -> str | None:
    status = body.get("status")
    if status == "completed":
        return "stop"
    if status == "incomplete":
        details = body.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return "length" if reason == "max_output_tokens" else reason if isinstance(reason, str) else "incomplete"
    return status if isinstance(status, str) else None


def tokens_from_response(route: str, body: Mapping[str, Any]) -> Tokens:
    """Prompt ids, completion ids and log-probs of a (non-streamed or assembled) Responses answer: those it
    carries when it was served as a chat completion, else vLLM's token messages and output log-probs."""
    tokens = carried(body)
    if tokens is not None:
        return tokens
    return Tokens(
        prompt_token_ids=_message_tokens(body.get("input_messages")),
        completion_token_ids=_message_tokens(body.get("output_messages")),
        logprobs=_output_logprobs(body.get("output")),
        finish_reason=_finish_reason(body),
    )


def _without_logprobs(obj: Any) -> Any:
    """``obj`` with every ``logprobs`` emptied the way vLLM leaves them when none were asked for."""
    if isinstance(obj, dict):
        return {k: ([] if isinstance(v, list) else None) if k == "logprobs" and v is not None
                else _without_logprobs(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_without_logprobs(v) for v in obj]
    return obj


def strip_unrequested(obj: dict[str, Any], wants: ClientWants) -> dict[str, Any]:
    """What the harness gets: a response (or a stream event) without what it did not ask for."""
    obj = without_carried(obj)
    if wants.token_ids and wants.logprobs:
        return obj
    out = obj if wants.logprobs else _without_logprobs(obj)
    if not wants.token_ids:
        out = dict(out)
        for holder in (out, out.get("response")):
            if isinstance(holder, dict) and (holder.get("input_messages") or holder.get("output_messages")):
                if holder is not out:
                    holder = out["response"] = dict(holder)
                holder["input_messages"] = None
                holder["output_messages"] = None
    return out


def sse_bytes(obj: Mapping[str, Any]) -> bytes:
    """One Responses event as vLLM frames it: ``event: <type>`` then its data."""
    kind = obj.get("type")
    head = f"event: {kind}\n".encode() if isinstance(kind, str) else b""
    return head + b"data: " + dumps(obj) + b"\n\n"


class ResponsesHeartbeat(protocol.Heartbeat):
    """The keep-alive of a Responses stream answered whole: events, since Codex CLI's stream idle timer counts
    events, not SSE comments (``protocol.Heartbeat``). The first beat is the answer's own start,
    ``response.created`` then ``response.in_progress`` (the OpenAI SDK's stream helper refuses any event before
    ``response.created``), each later beat ``response.in_progress`` again; once the answer is whole, ``rest``
    leaves those two out of its events and numbers the others on, as ``error`` numbers a failed answer's error
    event (the Codex CLI and the openai SDK read ``sequence_number``). The response id is the one the answer
    will carry when the call is served as a chat completion (``converter``); on vLLM's own route it is not
    known in advance, and only the final event names the answer's id.
    """

    def __init__(self, body: Mapping[str, Any], response_id: str) -> None:
        super().__init__(b"", self.error)  # beat and error: this class's own, numbered
        self.start_response = {**envelope(body, response_id, int(time.time()), body.get("model")),
                               "status": "in_progress", "output": [], "usage": None}
        self.sent = 0

    def beat(self) -> bytes:
        kinds = ("response.in_progress",) if self.sent else ("response.created", "response.in_progress")
        out = []
        for kind in kinds:
            out.append(sse_bytes({"response": self.start_response, "sequence_number": self.sent, "type": kind}))
            self.sent += 1
        return b"".join(out)

    def rest(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.sent:
            return events
        kept = [e for e in events if e.get("type") not in ("response.created", "response.in_progress")]
        return [{**e, "sequence_number": self.sent + i} for i, e in enumerate(kept)]

    def error(self, error: Mapping[str, Any]) -> bytes:
        self.sent += 1
        return error_event(error, self.sent - 1)


class LiveResponse(ResponsesHeartbeat):
    """The Responses events for an answer relayed while generated (``served_stream.py``): the answer's start
    (``beat``), the message item and its ``output_text`` part opened with the first text, one
    ``response.output_text.delta`` per chunk (with that chunk's log-probs), then the rest of ``replay_events``
    for the whole answer (``rest``: the text's and the item's ends, any later item, the final event with usage),
    numbered on. The answer's id is the one ``converter`` gives it (``response_id``)."""

    def __init__(self, body: Mapping[str, Any], response_id: str) -> None:
        super().__init__(body, response_id)
        self.item_id = f"msg_{response_id.removeprefix('resp_')}"  # as ``from_chat`` names the message item
        self.where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}  # the text part's place
        self.opened = False  # the message item (output 0: there is no reasoning item on this path)
        self.pending: list[dict[str, Any]] = []  # log-probs of tokens whose text is still empty

    def start(self, head: Mapping[str, Any], prompt_tokens: int) -> list[dict[str, Any]]:
        """The answer's start, unless keep-alives (``beat``) already sent it."""
        if self.sent:
            return []
        return self._numbered([{"type": kind, "response": self.start_response}
                               for kind in ("response.created", "response.in_progress")])

    def text(self, delta: str, logprobs: Any) -> list[dict[str, Any]]:
        """A delta with its log-probs; those of a token whose text is still empty (vLLM's own stream drops them)
        go out with the next text, or with an empty delta at the end, so the deltas carry every log-prob."""
        self.pending += _response_logprobs({"logprobs": logprobs})
        if not delta:
            return []
        events: list[dict[str, Any]] = []
        if not self.opened:
            self.opened = True
            item = {"id": self.item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += [{"type": "response.output_item.added", "item": item, "output_index": 0},
                       {"type": "response.content_part.added", "part": part, **self.where}]
        events.append({"type": "response.output_text.delta", "delta": delta, "logprobs": self.pending, **self.where})
        self.pending = []
        return self._numbered(events)

    def end(self, response: Mapping[str, Any]) -> list[dict[str, Any]]:
        sent = ("response.output_item.added", "response.content_part.added", "response.output_text.delta")
        events = [e for e in replay_events(response)
                  if not (self.opened and e["type"] in sent and e.get("output_index") == 0)]
        if self.opened and self.pending:  # the last tokens' (a stop token's) log-probs
            events.insert(0, {"type": "response.output_text.delta", "delta": "", "logprobs": self.pending,
                              **self.where})
        return self.rest(events)

    def _numbered(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = [{**e, "sequence_number": self.sent + i} for i, e in enumerate(events)]
        self.sent += len(out)
        return out


def heartbeat(body: Mapping[str, Any], convert: Any) -> protocol.Heartbeat:
    """The keep-alive of a streamed call answered whole (``convert``: the answer's translation, or None)."""
    return ResponsesHeartbeat(body, getattr(convert, "response_id", None) or new_response_id())


def live_events(body: Mapping[str, Any], convert: Converter) -> LiveResponse:
    """The events of a call relayed while generated (``served_stream.py``), under the id ``convert`` gives it."""
    return LiveResponse(body, convert.response_id)


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def error_event(error: Mapping[str, Any], sequence_number: int) -> bytes:
    """The Responses stream's error event, numbered after the ``sequence_number`` events sent before it
    (``ResponsesHeartbeat.error`` knows how many)."""
    return sse_bytes({"type": "error", "code": error.get("code"), "message": str(error.get("message") or ""),
                      "param": error.get("param"), "sequence_number": sequence_number})


@dataclass
class StreamAssembler:
    """The answer a streamed Responses call amounts to: the final event's response, plus its tokens.

    Log-probs come from the final response's output when it carries them, else from the deltas in order.
    """

    route: str = "responses"

    def __post_init__(self) -> None:
        self.final: dict[str, Any] | None = None
        self.delta_logprobs: list[float] = []
        self.error: dict[str, Any] | None = None

    def feed(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        if kind == "response.output_text.delta":
            for entry in event.get("logprobs") or []:
                self.delta_logprobs.append(_logprob(entry.get("logprob")) if isinstance(entry, dict) else float("nan"))
        elif kind in FINAL_EVENTS and isinstance(event.get("response"), dict):
            self.final = dict(event["response"])
        elif kind == "error" or ("error" in event and kind is None):
            self.error = dict(event)

    def tokens(self) -> Tokens:
        if self.final is None:
            return Tokens(logprobs=[])
        tokens = tokens_from_response(self.route, self.final)
        if not tokens.logprobs:
            tokens.logprobs = list(self.delta_logprobs)
        return tokens

    def response(self) -> dict[str, Any]:
        out = dict(self.final) if self.final is not None else {"object": "response", "status": "incomplete"}
        if self.error is not None:
            out["error"] = self.error.get("error", self.error)
        return out


def replay_events(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The events vLLM streams for ``response`` (created, in progress, each output item with its text or
    arguments as one delta, then completed / incomplete / failed), for a harness that asked for a stream."""
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({**fields, "sequence_number": len(events), "type": kind})

    start = {**response, "status": "in_progress", "output": [], "usage": None}
    emit("response.created", response=start)
    emit("response.in_progress", response=start)
    for index, item in enumerate(response.get("output") or []):
        if not isinstance(item, dict):
            continue
        item_id = item.get("id")
        parts = item.get("content") if item.get("type") == "message" else None
        added = {**item, "status": "in_progress"}
        if isinstance(parts, list):
            added["content"] = []
        if item.get("type") == "function_call":
            added["arguments"] = ""
        emit("response.output_item.added", item=added, output_index=index)
        for part_index, part in enumerate(parts if isinstance(parts, list) else []):
            where = {"content_index": part_index, "item_id": item_id, "output_index": index}
            if not isinstance(part, dict) or part.get("type") != "output_text":
                emit("response.content_part.added", part=part, **where)
                emit("response.content_part.done", part=part, **where)
                continue
            logprobs = part.get("logprobs") or []
            emit("response.content_part.added", part={**part, "text": "", "logprobs": []}, **where)
            emit("response.output_text.delta", delta=part.get("text") or "", logprobs=logprobs, **where)
            emit("response.output_text.done", text=part.get("text") or "", logprobs=logprobs, **where)
            emit("response.content_part.done", part=part, **where)
        if item.get("type") == "function_call":
            where = {"item_id": item_id, "output_index": index}
            emit("response.function_call_arguments.delta", delta=item.get("arguments") or "", **where)
            emit("response.function_call_arguments.done", arguments=item.get("arguments") or "",
                 name=item.get("name"), **where)
        emit("response.output_item.done", item=item, output_index=index)
    status = response.get("status")
    final = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(str(status), "response.completed")
    emit(final, response=dict(response))
    return events


# ------------------------------------------------------------------------- served as a chat completion
#
# In train mode with token continuity on, a Responses call the proxy can translate is served as the chat
# completion it amounts to (``chat_served.py`` says why): ``function_call`` outputs then get their log-probs,
# and a call whose input repeats an earlier call's input + output items (+ function_call_output items and new
# messages) continues that call's exact tokens, as a chat call does. The translation follows vLLM's own
# (``construct_input_messages``: instructions as the system message, a function_call or output message joined
# to the assistant message (or reasoning item) before it, a function_call_output as a tool message), so the
# prompt is what vLLM's route renders.

# Request fields the translation carries to chat under the same name (vLLM sampling parameters included).
SAME_IN_CHAT = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "logit_bias",
                "user", "skip_special_tokens", "include_stop_str_in_output", "priority", "parallel_tool_calls")
# Fields that only shape the answer (echoed or ignored), or that the translation reads itself.
TRANSLATED = frozenset(SAME_IN_CHAT) | {
    "model", "input", "instructions", "max_output_tokens", "tools", "tool_choice", "include", "top_logprobs",
    "stream", "stream_options", "store", "metadata", "service_tier", "truncation", "text", "reasoning",
    "prompt_cache_key", "previous_response_id", "client_metadata",
}
# What a Responses request may carry that vLLM cannot honour, and what the translation does with it (Codex CLI
# sends all of them on every call, and its configuration cannot remove them). The rule: what the proxy sends
# to vLLM is what is stored and trained, so a dropped field changes nothing the learner sees; each drop is
# counted in harnessrl_proxy_dropped_fields_total{route="responses", field}.
#   client_metadata      dropped: the client's ids (installation, session, turn), never shown to the model.
#   reasoning.summary    dropped: vLLM writes no summaries; reasoning comes back as the parser's reasoning text.
#   reasoning.effort     translated: chat's reasoning_effort (the chat template reads it, as on vLLM's route).
#   include reasoning.encrypted_content (with store false)
#                        translated: each reasoning item answered carries its text as ``encrypted_content``
#                        (``ENCRYPTED_PREFIX`` + base64), which is read back when the harness resends the item;
#                        encrypted content the proxy did not write is untranslatable (vLLM's own route).
#   namespace tools      translated: each function of the namespace is a chat function named
#                        ``<namespace>.<name>``, and a call of it is answered as a function_call with
#                        ``namespace`` and ``name`` (and read back the same way).
#   web_search tools     dropped: a hosted tool the server cannot run; the model is not told of it.
# Other hosted tools (file_search, code_interpreter, ...) and other include values stay untranslatable.
DROPPED_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_2025_08_26"})
ENCRYPTED_INCLUDE = "reasoning.encrypted_content"
ENCRYPTED_PREFIX = "harnessrl-reasoning-v1:"
NAMESPACE_SEPARATOR = "."


class Untranslatable(Exception):
    """The call cannot be served as a chat completion; ``reason`` labels the continuity metric."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _parts_text(content: Any) -> str:
    """A message's text: a string, or its text parts joined (any other part cannot be translated)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Untranslatable("responses_input_item")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise Untranslatable("responses_input_item")
        text = part.get("text")
        if not isinstance(text, str):
            raise Untranslatable("responses_input_item")
        texts.append(text)
    return "".join(texts)


def chat_messages(instructions: Any, items: Any) -> list[dict[str, Any]]:
    """``instructions`` and the ``input`` items as chat messages, the way vLLM's own route builds them."""
    out: list[dict[str, Any]] = []
    if instructions:
        if not isinstance(instructions, str):
            raise Untranslatable("responses_input_item")
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    for item in items:
        if not isinstance(item, dict):
            raise Untranslatable("responses_input_item")
        kind = item.get("type", "message")
        prev = out[-1] if out and out[-1].get("role") == "assistant" else None
        if kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            namespace = item.get("namespace")
            strings = all(isinstance(v, str) for v in (name, arguments, call_id))
            if not strings or not isinstance(namespace, (str, type(None))):
                raise Untranslatable("responses_input_item")
            if namespace:
                name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise Untranslatable("responses_input_item")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _parts_text(item.get("output"))})
        elif kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]  # the developer's is system's place
            text = _parts_text(item.get("content"))
            if role == "assistant" and prev is not None and prev.get("content") is None:
                prev["content"] = text
            else:
                out.append({"role": role, "content": text})
        elif kind == "reasoning":
            encrypted = item.get("encrypted_content")
            if encrypted:
                text = _decrypted(encrypted)
            else:
                parts = item.get("content") or item.get("summary") or [{}]  # vLLM reads the first part
                text = parts[0].get("text") if isinstance(parts, list) and isinstance(parts[0], dict) else None
            if not isinstance(text, str):
                raise Untranslatable("responses_input_item")
            if prev is not None and prev.get("reasoning") is None:
                prev["reasoning"] = text
            else:
                out.append({"role": "assistant", "content": None, "reasoning": text})
        else:  # images, built-in tools' items...: served by vLLM's own route
            raise Untranslatable("responses_input_item")
    return out


def _encrypted(text: str) -> str:
    """The ``encrypted_content`` of a reasoning item the proxy answers: its text, readable again by
    ``_decrypted`` (the proxy keeps no responses, so the item must carry what the next call needs)."""
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def _decrypted(encrypted: Any) -> str:
    """The reasoning text of ``encrypted_content`` the proxy wrote; untranslatable for any other."""
    if not isinstance(encrypted, str) or not encrypted.startswith(ENCRYPTED_PREFIX):
        raise Untranslatable("responses_input_item")
    try:
        return base64.b64decode(encrypted.removeprefix(ENCRYPTED_PREFIX), validate=True).decode()
    except ValueError:
        raise Untranslatable("responses_input_item") from None


def _chat_function(tool: Any, namespace: str | None = None) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise Untranslatable("responses_tool")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    if namespace is not None:
        function["name"] = f"{namespace}{NAMESPACE_SEPARATOR}{function['name']}"
    return {"type": "function", "function": function}


def _chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The request's tools as chat functions: namespaces flattened, hosted web search left out."""
    out = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in DROPPED_TOOLS:
            continue
        if kind == "namespace" and isinstance(tool.get("name"), str) and isinstance(tool.get("tools"), list):
            out += [_chat_function(inner, tool["name"]) for inner in tool["tools"]]
        else:
            out.append(_chat_function(tool))
    return out


def _namespaces(body: Mapping[str, Any]) -> frozenset[str]:
    tools = body.get("tools")
    return frozenset(t["name"] for t in tools if isinstance(t, dict) and t.get("type") == "namespace"
                     and isinstance(t.get("name"), str)) if isinstance(tools, list) else frozenset()


def dropped_fields(body: Mapping[str, Any]) -> list[str]:
    """What of a translatable request does not reach vLLM (see ``DROPPED_TOOLS`` and the table above it)."""
    out = ["client_metadata"] if body.get("client_metadata") is not None else []
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("summary") is not None:
        out.append("reasoning.summary")
    tools = body.get("tools")
    out += [f"tools.{t['type']}" for t in tools or [] if isinstance(t, dict) and t.get("type") in DROPPED_TOOLS]
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        namespace = choice.get("namespace")
        name = choice["name"]
        if isinstance(namespace, str):
            name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
        return {"type": "function", "function": {"name": name}}
    raise Untranslatable("responses_tool_choice")


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completion a Responses request amounts to, without the proxy's additions; ``Untranslatable``
    (with the reason) for a request only vLLM's own route serves, and a 400 for ``previous_response_id``."""
    if body.get("previous_response_id") is not None:
        raise RequestError(
            "'previous_response_id' is not supported in train mode: the proxy keeps no responses (it serves "
            "each Responses call as the chat completion it amounts to, so that it continues the previous call's "
            "exact tokens); send the conversation in 'input' instead: the earlier input items, the previous "
            "response's output items and your function_call_output items",
            param="previous_response_id",
            code="previous_response_id_not_supported",
        )
    if set(body) - TRANSLATED:
        raise Untranslatable("responses_unsupported_field")
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict)
                                  or set(reasoning) - {"effort", "summary", "generate_summary"}):
        raise Untranslatable("responses_reasoning")
    text = body.get("text")
    if text is not None and (not isinstance(text, dict) or (text.get("format") or {"type": "text"}) != {"type": "text"}):
        raise Untranslatable("responses_structured_output")
    include = body.get("include") or []
    unknown_include = any(name not in (LOGPROBS_INCLUDE, ENCRYPTED_INCLUDE) for name in include)
    if unknown_include or body.get("truncation") not in (None, "disabled"):
        raise Untranslatable("responses_unsupported_field")
    out: dict[str, Any] = {"model": body.get("model"), "messages": chat_messages(body.get("instructions"), body["input"])}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    out.update((name, body[name]) for name in SAME_IN_CHAT if body.get(name) is not None)
    if reasoning and reasoning.get("effort") is not None:
        out["reasoning_effort"] = reasoning["effort"]
    tools = _chat_tools(body.get("tools") or [])
    if tools:
        out["tools"] = tools
        if body.get("tool_choice") is not None:
            out["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if LOGPROBS_INCLUDE in include:
        out["logprobs"] = True
        if body.get("top_logprobs"):
            out["top_logprobs"] = body["top_logprobs"]
    return out


def chat_reply(response: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The chat message a Responses answer amounts to when the harness sends its output items back (the same
    translation as its request's): what a later call must repeat to continue this one's tokens."""
    output = response.get("output") if response else None
    if not isinstance(output, list):
        return None
    try:
        messages = chat_messages(None, output)
    except Untranslatable:
        return None
    return messages[0] if len(messages) == 1 and messages[0]["role"] == "assistant" else None


def _response_logprobs(choice: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat choice's log-probs as Responses ``output_text`` log-probs (vLLM's shape)."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return [{"token": e.get("token"), "logprob": e.get("logprob"), "bytes": e.get("bytes"),
             "top_logprobs": [{"token": t.get("token"), "logprob": t.get("logprob"), "bytes": t.get("bytes")}
                              for t in e.get("top_logprobs") or []]}
            for e in content or [] if isinstance(e, dict)]


def from_chat(body: Mapping[str, Any], chat: dict[str, Any], response_id: str | None = None) -> dict[str, Any]:
    """The Responses answer vLLM's own route would give for a chat completion (its items, status and usage),
    carrying the chat completion's tokens for the capture. Its id is ``response_id`` (its items' ids follow
    it), else the chat completion's."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    if response_id is not None:
        suffix = response_id.removeprefix("resp_")
    else:
        suffix = str(chat.get("id") or "").removeprefix("chatcmpl-")
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        item = {"id": f"rs_{suffix}", "type": "reasoning", "summary": [], "status": None,
                "content": [{"type": "reasoning_text", "text": reasoning}]}
        if ENCRYPTED_INCLUDE in (body.get("include") or []):
            item["encrypted_content"] = _encrypted(reasoning)
        output.append(item)
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        text = message.get("content") or ""
        parts = [{"type": "output_text", "text": text, "annotations": [], "logprobs": _response_logprobs(choice)}]
        output.append({"id": f"msg_{suffix}", "type": "message", "role": "assistant", "status": "completed",
                       "content": parts if text else []})
    namespaces = _namespaces(body)
    for i, call in enumerate(calls):
        fn = call.get("function") or {}
        item = {"id": f"fc_{suffix}_{i}", "type": "function_call", "status": "completed",
                "call_id": call.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments")}
        namespace, _, name = str(fn.get("name")).partition(NAMESPACE_SEPARATOR)
        if name and namespace in namespaces:
            item.update(namespace=namespace, name=name)
        output.append(item)
    incomplete = choice.get("finish_reason") == "length"
    usage = chat.get("usage") or {}
    prompt_tokens, completion_tokens = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        **envelope(body, f"resp_{suffix}", chat.get("created"), chat.get("model")),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output,
        "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": prompt_tokens + completion_tokens},
        chat_served.CAPTURE_KEY: chat_served.carry(chat),
    }


def envelope(body: Mapping[str, Any], response_id: str, created_at: Any, model: Any) -> dict[str, Any]:
    """A Responses answer without its status, output and usage (``from_chat`` fills them in), in vLLM's field
    order: what it repeats of its request."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "status": None,
        "incomplete_details": None,
        "error": None,
        "instructions": body.get("instructions"),
        "output": [],
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_logprobs": body.get("top_logprobs", 0),
        "metadata": body.get("metadata"),
        "previous_response_id": None,
        "reasoning": None,
        "service_tier": body.get("service_tier", "auto"),
        "text": body.get("text"),
        "truncation": body.get("truncation", "disabled"),
        "user": body.get("user"),
        "background": False,
        "usage": None,
        "input_messages": None,
        "output_messages": None,
    }


@dataclass
class Converter:
    """Turns the chat completion a call was served as into its Responses answer, under an id chosen when the
    call came in (a stream's keep-alive announces it before the answer exists: ``ResponsesHeartbeat``)."""

    body: Mapping[str, Any]
    response_id: str = field(default_factory=new_response_id)

    def __call__(self, chat: dict[str, Any]) -> dict[str, Any]:
        return from_chat(self.body, chat, self.response_id)


def converter(body: Mapping[str, Any]) -> Converter:
    return Converter(body)
