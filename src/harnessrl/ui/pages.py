"""What each page shows, as plain data for its template (no HTTP here, so tests and the benchmark call it)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from markupsafe import Markup, escape
from sqlalchemy import Engine, func, select

from harnessrl.store import NotFound, RolloutState, TraceStore
from harnessrl.store.schema import LearnerStep, Run
from harnessrl.trainer.rows import SplitReason
from harnessrl.ui import queries
from harnessrl.ui.conversation import conversation
from harnessrl.ui.token_text import TOKEN_PAGE, load_tokenizer, token_texts

CURVES = (  # (title, [(series label, step-metric name)]): the run overview's charts
    ("Reward", [("train reward mean", "reward_mean"), ("evaluation mean reward", "eval_reward_mean"),
                ("evaluation pass rate", "eval_pass_rate")]),
    ("Merge: training tokens / final trajectory tokens", [("merge ratio", "merge_token_ratio")]),
    ("Rollout vs learner log-prob correlation", [("pearson", "logprob_pearson")]),
    ("Clip fraction", [("clip frac", "clip_frac")]),
    ("Staleness (policy versions)", [("mean", "staleness_mean"), ("max", "staleness_max")]),
)


SPLIT_NOTES = {  # what each of the row builder's split reasons means for a reader
    SplitReason.TEMPLATE_DRIFT.value: "the harness re-rendered the model's previous answer differently",
    SplitReason.NEW_CONVERSATION.value: "the prompt starts with no earlier kept prompt: another conversation, "
                                        "e.g. a sub-agent",
    SplitReason.TRUNCATION.value: "the conversation shrank: context was dropped",
    SplitReason.HISTORY_EDITED.value: "an earlier message was changed",
}


def _need_run(engine: Engine, run: str) -> None:
    if not queries.run_exists(engine, run):
        known = [r.name for r in queries.list_runs(engine)][:10]
        raise NotFound(f"the store has no run {run!r}" + (f"; its runs: {', '.join(known)}" if known else ""))


def runs(engine: Engine) -> dict[str, Any]:
    return {"runs": queries.list_runs(engine)}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def overview(engine: Engine, run: str) -> dict[str, Any]:
    """Per-step figures from ``harnessrl status``'s own summary (``local.report.summarize``)."""
    from harnessrl.local.report import summarize

    _need_run(engine, run)
    summary = summarize(TraceStore(engine), run)
    steps = [s.step for s in summary.steps]
    values: dict[str, list[float | None]] = {}
    for name in {name for _, series in CURVES for _, name in series}:
        values[name] = [_number(s.metrics.get(name)) for s in summary.steps]
    values["reward_mean"] = [s.reward_mean for s in summary.steps]
    evaluated = {e.step: e for e in summary.evaluation if e.step is not None}
    values["eval_reward_mean"] = [evaluated[s].reward_mean if s in evaluated else None for s in steps]
    values["eval_pass_rate"] = [evaluated[s].pass_rate if s in evaluated else None for s in steps]
    charts = [{"title": title, "steps": steps, "series": [{"label": label, "values": values[name]}
                                                          for label, name in series]} for title, series in CURVES]
    return {"run": run, "summary": summary, "charts": charts,
            "counts": {state.value: n for state, n in summary.counts.items()}, "merge": summary.merge}


def rollouts(engine: Engine, run: str, query: dict[str, str]) -> dict[str, Any]:
    _need_run(engine, run)
    filt = queries.RolloutFilter.parse(query)
    if filt.step is not None:
        with engine.connect() as conn:
            found = conn.scalar(select(LearnerStep.step).where(LearnerStep.run == run, LearnerStep.step == filt.step))
            last = conn.scalar(select(func.max(LearnerStep.step)).where(LearnerStep.run == run))
        if found is None:
            raise NotFound(f"run {run!r} has no learner step {filt.step}"
                           + (f" (steps 1-{last} are committed)" if last else " (no step is committed yet)"))
    return {"run": run, "page": queries.rollout_page(engine, run, filt), "filter": filt,
            "states": [state.value for state in RolloutState],
            "sorts": list(queries.SORTS)}


def rollout(engine: Engine, run: str, rollout_id: str, query: dict[str, str], tokenizer_dir: str) -> dict[str, Any]:
    _need_run(engine, run)
    header = queries.attempt_header(engine, run, rollout_id, queries.parse_number(query, "attempt", int, 0))
    if header is None:
        raise NotFound(f"run {run!r} has no rollout {rollout_id!r}"
                       + (f" attempt {query['attempt']}" if query.get("attempt") else ""))
    from harnessrl.ui.training_view import training_view  # the learner's code: torch, imported once

    store = TraceStore(engine)
    records = store.read_calls(rollout_id, header.attempt)
    view = training_view(engine, run, rollout_id, header.attempt)
    tokenizer = load_tokenizer(tokenizer_dir or _model_dir(engine, run))
    row_index = queries.parse_number(query, "row", int, 0) or 0
    start = queries.parse_number(query, "from", int, 0) or 0
    shown: dict[str, Any] | None = None
    if view.rows:
        if row_index >= len(view.rows):
            raise NotFound(f"rollout {rollout_id!r} has {len(view.rows)} training rows; there is no row {row_index}")
        row = view.rows[row_index]
        start = min(start - start % TOKEN_PAGE, max(row.num_tokens - 1, 0) // TOKEN_PAGE * TOKEN_PAGE)
        stop = min(start + TOKEN_PAGE, row.num_tokens)
        ids = row.input_ids[start:stop]
        texts = token_texts(tokenizer, ids)
        shown_tokens = token_spans(row, start, stop, texts, view.advantage)
        shown = {"row": row, "start": start, "stop": stop, "tokens": shown_tokens, "counts": row.counts(),
                 "prev": start - TOKEN_PAGE if start > 0 else None,
                 "next": stop if stop < row.num_tokens else None}
    return {"run": run, "h": header, "calls": conversation(records), "view": view, "shown": shown,
            "row_index": row_index, "tokenizer": tokenizer is not None, "token_page": TOKEN_PAGE,
            "split_notes": SPLIT_NOTES}


def token_spans(row: Any, start: int, stop: int, texts: list[str] | None, advantage: float | None) -> Markup:
    """The token view's spans, built here rather than in the template: a page of 2,000 tokens with their
    attributes is most of a rollout page's time through Jinja2's per-attribute lookups, a tenth of it here.
    Each span: kind (trained, context, forced), grammar-constrained, and a title with everything known of it."""
    call_at = {s: (seq, v) for seq, (_c, s, _e, v) in enumerate(row.spans)}
    out = []
    ids = row.input_ids[start:stop].tolist()
    trained = row.trained[start:stop].tolist()
    generated = row.generated[start:stop].tolist()
    logprobs = row.rollout_logprobs[start:stop].tolist()
    learner = row.learner_logprobs[start:stop].tolist() if row.learner_logprobs is not None else None
    for offset, token in enumerate(ids):
        pos = start + offset
        if pos in call_at:
            seq, version = call_at[pos]
            out.append(f'<span class="callmark">call {seq} · v{version}</span>')
        kind = "trained" if trained[offset] else ("forced" if generated[offset] else "context")
        title = f"position {pos} · token id {token} · {kind}"
        if generated[offset]:
            title += f" · behaviour log-prob {logprobs[offset]:.4f}"
        if learner is not None and not math.isnan(learner[offset]):
            title += f" · learner log-prob {learner[offset]:.4f}"
        if trained[offset] and advantage is not None:
            title += f" · advantage {advantage:.4f}"
        allowed = row.constrained.get(pos)
        if allowed:
            title += f" · grammar allowed {allowed} tokens"
        text = texts[offset] if texts is not None else str(token)
        extra = f' data-learner="{learner[offset]!r}"' if learner is not None and not math.isnan(learner[offset]) else ""
        out.append(f'<span class="tok {kind}{" constrained" if allowed else ""}" data-pos="{pos}" data-id="{token}" '
                   f'data-trained="{trained[offset]}"{extra} title="{title}">{escape(text)}</span>')
    return Markup("".join(out))


def _model_dir(engine: Engine, run: str) -> str:
    """The run's model directory from its stored spec, when this machine has it (for token texts)."""
    with engine.connect() as conn:
        document = conn.scalar(select(Run.spec).where(Run.name == run)) or {}
    path = ((document.get("spec") or {}).get("model") or {}).get("path")
    return str(path) if path and Path(str(path)).is_dir() else ""


def failures(engine: Engine, run: str) -> dict[str, Any]:
    from harnessrl.ui.failures import failure_groups

    _need_run(engine, run)
    return {"run": run, **failure_groups(engine, run)}


def compare(engine: Engine, run: str, query: dict[str, str]) -> dict[str, Any]:
    from harnessrl.ui.compare import compare_task

    _need_run(engine, run)
    return {"run": run, **compare_task(engine, run, query)}


def call_record(engine: Engine, call_id: str) -> dict[str, Any]:
    record = TraceStore(engine).get_call(call_id)
    return {"call_id": record.call_id, "rollout_id": record.rollout_id, "attempt": record.attempt,
            "seq": record.seq, "route": record.route, "policy_version": record.policy_version,
            "status": record.status.value, "finish_reason": record.finish_reason, "latency_s": record.latency_s,
            "request": record.request, "response": record.response, "prompt_token_ids": record.prompt_token_ids,
            "completion_token_ids": record.completion_token_ids, "logprobs": record.logprobs}
