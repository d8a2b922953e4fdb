"""Failed and zero-reward rollouts grouped by failure signature: the batch-level step of structural trajectory
analysis (STRACE) — read one representative per kind of failure instead of a thousand traces.

A signature is four things a person would compare by eye: how the attempt ended (its state and reason), the
error text of its last call when that call failed, the last tool error the harness fed back, and the shape of
the final answer (finish reason; text, tool calls or nothing). Numbers, hex ids and quoted values are masked, so
"exit code 3" and "exit code 7" fall into one group ("exit code N") and no id makes a failure unique. Only the
latest ``SCAN_LIMIT`` such attempts are read (their last call is rebuilt from the store), and the page says so.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, func, or_, select

from harnessrl.store import TraceStore
from harnessrl.store.schema import LlmCall, RolloutAttempt

SCAN_LIMIT = 200  # each costs its last call rebuilt along its chain: ~3 ms a 10-call attempt here
ERROR_WORDS = re.compile(r"error|exception|traceback|failed|not found|denied|invalid", re.IGNORECASE)
_MASKS = [(re.compile(r"0x[0-9a-f]+|\b[0-9a-f]{8,}\b", re.IGNORECASE), "X"), (re.compile(r"\d+(\.\d+)?"), "N"),
          (re.compile(r"'[^']*'|\"[^\"]*\""), "'…'"), (re.compile(r"\s+"), " ")]


def mask(text: str | None, limit: int = 120) -> str:
    if not text:
        return ""
    for pattern, replacement in _MASKS:
        text = pattern.sub(replacement, text)
    return text.strip()[:limit]


@dataclass
class FailureGroup:
    exit: str
    error: str
    tool_error: str
    final: str
    count: int = 0
    by_version: Counter[int | None] = field(default_factory=Counter)
    representative: tuple[str, int] | None = None  # the latest attempt of the group
    example_error: str = ""


def _last_tool_error(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "tool" or (message.get("role") == "user" and
                                              str(message.get("content", "")).startswith("tool")):
            content = message.get("content")
            text = content if isinstance(content, str) else str(content)
            return mask(text) if ERROR_WORDS.search(text) else ""
    return ""


def _final_shape(response: dict[str, Any] | None, finish: str | None, status: str) -> str:
    if status != "ok" or not isinstance(response, dict):
        return f"{status}, no answer"
    choice = (response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    kinds = [k for k, present in (("tool calls", message.get("tool_calls")), ("text", message.get("content") or
                                  choice.get("text"))) if present] or ["empty"]
    return f"{finish or '?'}, {' + '.join(kinds)}"


def failure_groups(engine: Engine, run: str) -> dict[str, Any]:
    store = TraceStore(engine)
    failing = or_(RolloutAttempt.state.in_(["failed", "timed_out"]),
                  (RolloutAttempt.state == "succeeded") & or_(RolloutAttempt.reward == 0,
                                                              RolloutAttempt.reward.is_(None)))
    with engine.connect() as conn:
        total = conn.scalar(select(func.count()).where(RolloutAttempt.run == run, failing)) or 0
        attempts = conn.execute(
            select(RolloutAttempt.rollout_id, RolloutAttempt.attempt, RolloutAttempt.state, RolloutAttempt.reason,
                   RolloutAttempt.reward, RolloutAttempt.policy_version_start)
            .where(RolloutAttempt.run == run, failing)
            .order_by(RolloutAttempt.created_at.desc()).limit(SCAN_LIMIT)).all()
        last_calls = {}
        for a in attempts:
            last_calls[(a.rollout_id, a.attempt)] = conn.scalar(
                select(LlmCall.call_id).where(LlmCall.rollout_id == a.rollout_id, LlmCall.attempt == a.attempt)
                .order_by(LlmCall.seq.desc()).limit(1))
    groups: dict[tuple[str, str, str, str], FailureGroup] = {}
    for a in attempts:
        exit_ = f"{a.state}: {mask(a.reason)}" if a.reason else (
            a.state if a.state != "succeeded" else ("succeeded, no reward" if a.reward is None else "reward 0"))
        call_id = last_calls[(a.rollout_id, a.attempt)]
        error = tool_error = ""
        final = "no call"
        example = ""
        if call_id is not None:
            call = store.get_call(call_id)
            if call.status.value != "ok":
                example = str((call.response or {}).get("error") or call.response or f"HTTP {call.http_status}")
                error = f"HTTP {call.http_status}: {mask(example, 80)}"
            tool_error = _last_tool_error(call.request.get("messages") or [])
            final = _final_shape(call.response, call.finish_reason, call.status.value)
        key = (exit_, error, tool_error, final)
        group = groups.get(key)
        if group is None:
            group = groups[key] = FailureGroup(*key, representative=(a.rollout_id, a.attempt),
                                               example_error=example[:400])
        group.count += 1
        group.by_version[a.policy_version_start] += 1
    ordered = sorted(groups.values(), key=lambda g: -g.count)
    versions = sorted({v for g in ordered for v in g.by_version}, key=lambda v: (v is None, v or 0))
    return {"groups": ordered, "versions": versions, "total": total, "scanned": len(attempts),
            "scan_limit": SCAN_LIMIT}
