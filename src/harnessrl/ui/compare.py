"""One task's rollouts across policy versions, side by side: what changed in the answers as training went on.

Per version (the version an attempt started at; evaluation rollouts at the version they evaluate) at most
``PER_VERSION`` rollouts, each with its reward and final answer (its last call's answer, rebuilt from the
store). Versions to show are ``?versions=0,5,9``; by default the first and the last ``DEFAULT_VERSIONS - 1``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import Engine, func, select

from harnessrl.store import NotFound, TraceStore
from harnessrl.store.schema import LlmCall, Rollout, RolloutAttempt
from harnessrl.ui.conversation import conversation
from harnessrl.ui.queries import BadQuery

PER_VERSION = 8
DEFAULT_VERSIONS = 4


def compare_task(engine: Engine, run: str, query: dict[str, str]) -> dict[str, Any]:
    task = (query.get("task") or "").strip()
    with engine.connect() as conn:
        tasks = conn.execute(select(Rollout.task_id, func.count()).where(Rollout.run == run,
                             Rollout.task_id.is_not(None)).group_by(Rollout.task_id).order_by(Rollout.task_id)
                             .limit(1000)).all()
        if not task:
            return {"task": None, "tasks": tasks, "columns": [], "versions": []}
        version = func.coalesce(Rollout.evaluated_version, RolloutAttempt.policy_version_start)
        rows = conn.execute(
            select(RolloutAttempt.rollout_id, RolloutAttempt.attempt, RolloutAttempt.state, RolloutAttempt.reward,
                   Rollout.kind, version.label("version"))
            .join(Rollout, Rollout.rollout_id == RolloutAttempt.rollout_id)
            .where(Rollout.run == run, Rollout.task_id == task)
            .order_by(RolloutAttempt.created_at)).all()
        if not rows:
            raise NotFound(f"run {run!r} has no rollout of task {task!r}")
        by_version: dict[int, list[Any]] = defaultdict(list)
        for row in rows:
            if row.version is not None:
                by_version[row.version].append(row)
        available = sorted(by_version)
        wanted = _versions(query.get("versions"), available)
        store = TraceStore(engine)
        columns = []
        for v in wanted:
            members = by_version.get(v, [])[:PER_VERSION]
            entries = []
            for m in members:
                last = conn.scalar(select(LlmCall.call_id).where(LlmCall.rollout_id == m.rollout_id,
                                   LlmCall.attempt == m.attempt).order_by(LlmCall.seq.desc()).limit(1))
                answer = conversation([store.get_call(last)])[0].answer if last else []
                entries.append({"row": m, "answer": answer})
            rewards = [m.reward for m in by_version.get(v, []) if m.reward is not None]
            columns.append({"version": v, "entries": entries, "count": len(by_version.get(v, [])),
                            "reward_mean": sum(rewards) / len(rewards) if rewards else None})
    return {"task": task, "tasks": tasks, "columns": columns, "versions": available}


def _versions(text: str | None, available: list[int]) -> list[int]:
    if not text:
        return available[:1] + available[1:][-(DEFAULT_VERSIONS - 1):]
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BadQuery(f"versions={text!r} must be policy versions separated by commas, e.g. 0,5,9") from None
