"""Failed and zero-reward rollouts grouped by failure signature: the batch-level step of structural trajectory
analysis (STRACE) — read one representative per kind of failure instead of a thousand traces.

A signature is four things a person would compare by eye: how the attempt ended (its state and reason), the
error text of its last call when that call failed, the last tool error the harness fed back, and the shape of
the final answer (finish reason; text, tool calls or nothing). Numbers, hex ids and quoted values are masked, so
"exit code 3" and "exit code 7" fall into one group ("exit code N") and no id makes a failure unique. Only the
latest ``SCAN_LIMIT`` such attempts are read, and the page says so.

Their last calls are read in one query, as stored: a call stored as a delta keeps the messages it added to its
base call's, and the last tool message is among them whenever the call added one (a harness feeds a tool result
back as a new message). Only when it added none, or a failed call's response was stored stripped, is the call
rebuilt along its chain (``TraceStore.get_call``), so the signature is always that of the full call.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, and_, func, select

from harnessrl.store import TraceStore, consumed_totals
from harnessrl.store.schema import LlmCall, RolloutAttempt

SCAN_LIMIT = 200  # the latest failures grouped
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


def _last_tool_error(messages: list[Any]) -> str | None:
    """The masked error text of the last tool result among ``messages`` ("" if it reads as no error); None
    when there is no tool result among them."""
    for message in reversed(messages):
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool" or (message.get("role") == "user" and
                                              str(message.get("content", "")).startswith("tool")):
            content = message.get("content")
            text = content if isinstance(content, str) else str(content)
            return mask(text) if ERROR_WORDS.search(text) else ""
    return None


def _last_calls(engine: Engine, attempts: list[Any]) -> dict[tuple[str, int], Any]:
    """The last call of each attempt as stored, in one query: the attempts' highest seq (grouped over the
    (rollout, attempt, seq) index), joined back to that index. A list of (rollout, attempt, seq) keys instead
    made SQLite scan every call of the store (3.7 s at 1,000,000 calls)."""
    if not attempts:
        return {}
    ids = sorted({a.rollout_id for a in attempts})
    wanted = {(a.rollout_id, a.attempt) for a in attempts}
    last = (select(LlmCall.rollout_id, LlmCall.attempt, func.max(LlmCall.seq).label("seq"))
            .where(LlmCall.rollout_id.in_(ids)).group_by(LlmCall.rollout_id, LlmCall.attempt).subquery())
    query = (select(LlmCall.call_id, LlmCall.rollout_id, LlmCall.attempt, LlmCall.status, LlmCall.http_status,
                    LlmCall.finish_reason, LlmCall.request, LlmCall.request_reused, LlmCall.response,
                    LlmCall.response_stripped)
             .join(last, and_(last.c.rollout_id == LlmCall.rollout_id, last.c.attempt == LlmCall.attempt,
                              last.c.seq == LlmCall.seq)))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return {(r.rollout_id, r.attempt): r for r in rows if (r.rollout_id, r.attempt) in wanted}


def _call_signature(store: TraceStore, row: Any) -> tuple[str, str, str, str]:
    """(error, tool error, final shape, example error) of a last call, from its stored row where that is the
    full call's, else from the call rebuilt."""
    stored_messages = (row.request or {}).get("messages") or []
    tool_error = _last_tool_error(stored_messages if isinstance(stored_messages, list) else [])
    failed = row.status != "ok"
    if (tool_error is None and row.request_reused) or (failed and row.response_stripped):
        call = store.get_call(row.call_id)
        request, response = call.request, call.response
        tool_error = _last_tool_error(request.get("messages") or [])
    else:
        response = row.response
    error = example = ""
    if failed:
        example = str((response or {}).get("error") or response or f"HTTP {row.http_status}")
        error = f"HTTP {row.http_status}: {mask(example, 80)}"
    return error, tool_error or "", _final_shape(response, row.finish_reason, row.status), example


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
    with engine.connect() as conn:
        total = consumed_totals.failing(conn, run)
        attempts = conn.execute(  # a walk of ix_rollout_attempts_failing: its condition is consumed_totals.FAILING
            select(RolloutAttempt.rollout_id, RolloutAttempt.attempt, RolloutAttempt.state, RolloutAttempt.reason,
                   RolloutAttempt.reward, RolloutAttempt.policy_version_start)
            .where(RolloutAttempt.run == run, consumed_totals.FAILING)
            .order_by(RolloutAttempt.created_at.desc()).limit(SCAN_LIMIT)).all()
    last_calls = _last_calls(engine, attempts)
    groups: dict[tuple[str, str, str, str], FailureGroup] = {}
    for a in attempts:
        exit_ = f"{a.state}: {mask(a.reason)}" if a.reason else (
            a.state if a.state != "succeeded" else ("succeeded, no reward" if a.reward is None else "reward 0"))
        row = last_calls.get((a.rollout_id, a.attempt))
        error, tool_error, final, example = _call_signature(store, row) if row is not None else ("", "", "no call", "")
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
