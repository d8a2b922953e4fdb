"""The Responses API (``POST /v1/responses``) on vLLM 0.32: what the proxy adds, what it takes out, SSE.

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

Log-probs come only for ``output_text``: a completion that is (partly) a function call or reasoning gets
fewer log-probs than tokens, and the learner drops such a call as ``malformed`` instead of guessing.

What the harness gets back is what it asked for: the messages and log-probs it did not request are taken
out again (``input_messages``/``output_messages`` null, log-prob lists empty, as vLLM answers without them).
``background: true`` is refused in train mode (vLLM returns no token ids for background responses).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
    """Prompt ids, completion ids and log-probs of a (non-streamed or assembled) Responses answer."""
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
