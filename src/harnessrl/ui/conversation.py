"""A rollout's calls as the harness saw them: what each call added to the conversation and what came back.

Each call's request carries the whole conversation so far, so showing every request in full would repeat it n
times; a call shows only the messages after the ones the previous call sent plus its answer (when the previous
request and answer are a prefix of this one), else all of them. Long texts are cut at ``TEXT_LIMIT`` characters
with the full call one link away (``/api/calls/ID``), so a 100k-token call does not freeze the page.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from harnessrl.store.records import CallRecord

TEXT_LIMIT = 8000


@dataclass(frozen=True)
class Message:
    role: str
    text: str
    cut: int = 0  # characters left out
    reasoning: str | None = None
    tool_calls: list[str] = field(default_factory=list)  # "name(arguments)"
    name: str | None = None  # a tool result's tool call id or name


@dataclass(frozen=True)
class CallView:
    call_id: str
    seq: int
    route: str
    status: str
    http_status: int
    finish_reason: str | None
    version: int
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    earlier: int  # messages of the request not shown (sent by an earlier call already)
    sent: list[Message]
    answer: list[Message]


def _cut(text: str) -> tuple[str, int]:
    return (text, 0) if len(text) <= TEXT_LIMIT else (text[:TEXT_LIMIT], len(text) - TEXT_LIMIT)


def _text(content: Any) -> str:
    """Message content as text: a string, or OpenAI/Anthropic content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                value = part.get("text") or part.get("content") or part.get("thinking")
                parts.append(value if isinstance(value, str) else json.dumps(part, ensure_ascii=False))
            else:
                parts.append(str(part))
        return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False)


def _tool_calls(message: dict[str, Any]) -> list[str]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        calls.append(f"{function.get('name', '?')}({function.get('arguments', '')})")
    return calls


def _message(message: dict[str, Any]) -> Message:
    text, cut = _cut(_text(message.get("content")))
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    return Message(role=str(message.get("role", "?")), text=text, cut=cut,
                   reasoning=_cut(_text(reasoning))[0] if reasoning else None,
                   tool_calls=_tool_calls(message), name=message.get("tool_call_id") or message.get("name"))


def _answer(record: CallRecord) -> list[Message]:
    response = record.response
    if not isinstance(response, dict):
        return []
    out = []
    for choice in response.get("choices") or []:
        if "message" in choice:
            out.append(_message(choice["message"] or {}))
        elif "text" in choice:  # completions
            text, cut = _cut(str(choice.get("text") or ""))
            out.append(Message("completion", text, cut))
    if not out and "content" in response:  # Anthropic Messages
        out.append(_message({"role": response.get("role", "assistant"), "content": response["content"]}))
    return out


def _sent(request: dict[str, Any]) -> list[dict[str, Any]]:
    if isinstance(request.get("messages"), list):
        return [m for m in request["messages"] if isinstance(m, dict)]
    if "prompt" in request:
        return [{"role": "prompt", "content": request["prompt"]}]
    if isinstance(request.get("input"), list):  # Responses API
        return [m for m in request["input"] if isinstance(m, dict)]
    return []


def conversation(records: list[CallRecord]) -> list[CallView]:
    views = []
    previous: list[dict[str, Any]] = []  # the previous request's messages and its answer
    previous_sent: list[dict[str, Any]] = []
    for record in records:
        sent = _sent(record.request)
        earlier = 0
        for prefix in (previous, previous_sent):  # its answer sent back as it came, or re-rendered
            if prefix and sent[: len(prefix)] == prefix:
                earlier = len(prefix)
                break
        views.append(CallView(
            call_id=record.call_id, seq=record.seq, route=record.route, status=record.status.value,
            http_status=record.http_status, finish_reason=record.finish_reason, version=record.policy_version,
            latency_s=record.latency_s, prompt_tokens=len(record.prompt_token_ids),
            completion_tokens=len(record.completion_token_ids), earlier=earlier,
            sent=[_message(m) for m in sent[earlier:]], answer=_answer(record)))
        answer = (record.response or {}).get("choices") or [{}]
        replied = answer[0].get("message") if isinstance(answer[0], dict) else None
        previous_sent = sent
        previous = sent + ([_comparable(replied)] if isinstance(replied, dict) else [])
    return views


def _comparable(message: dict[str, Any]) -> dict[str, Any]:
    """The answer as a harness sends it back: role and content (and tool calls when there are any)."""
    out = {"role": message.get("role", "assistant"), "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out
