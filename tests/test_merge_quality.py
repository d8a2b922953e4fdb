"""Merge quality as the user sees it: rows per rollout, split reasons, training tokens / final trajectory tokens.

Calls are written to the real trace store (SQLite and PostgreSQL) the way the proxy writes them and read back
in delta form, as the learner reads them; the expected numbers are counted by hand.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from synthetic_calls import chat_trajectory

from harnessrl.local.report import MergeQuality, summarize, summary_table
from harnessrl.store import CallRecord, RolloutState, TraceStore
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.trainer.metrics import LearnerMetrics, final_trajectory_tokens, merge_quality
from harnessrl.trainer.rows import merge_calls_into_rows


def built(store: TraceStore, records: list[CallRecord]):
    store.add_calls(records)
    result = merge_calls_into_rows(store.rollout_calls(records[0].rollout_id, records[0].attempt))
    final = final_trajectory_tokens([row.input_ids for row in result.rows])
    return result, final


def drifted(template: CallRecord, rollout: str) -> list[CallRecord]:
    """Three calls whose harness re-renders the model's answer: the resent last token of each completion is
    not the sampled one (a template drift), so every call starts a new row.

    system 10 tokens, completions 4, observations 3: prompts of 10, 17 and 24 tokens; rows of 14, 21, 28
    tokens (63 trained). Row 1 shares 13 tokens with row 0 (system + 3 completion tokens), row 2 shares 20
    with row 1; final trajectory tokens 14 + 21 + 28 - 13 - 20 = 30 (the last call's 28 plus the two
    sampled tokens the harness re-rendered).
    """
    system = list(range(1000, 1010))
    prompt = system
    out = []
    for seq in range(3):
        completion = [2000 + 10 * seq + j for j in range(4)]
        out.append(replace(template, call_id=f"{rollout}-{seq}", rollout_id=rollout, seq=seq,
                           prompt_token_ids=list(prompt), completion_token_ids=completion,
                           logprobs=[-0.5] * 4))
        prompt = [*prompt, *completion[:3], 9999, *(3000 + 10 * seq + j for j in range(3))]
    return out


def test_a_perfect_merge_is_one_row_and_ratio_one(store: TraceStore) -> None:
    records = chat_trajectory("perfect", turns=6, system_tokens=50, observation_tokens=20, completion_tokens=10)
    result, final = built(store, records)
    last = records[-1]
    assert result.stats.rows == 1 and not result.stats.splits
    assert final == len(last.prompt_token_ids) + len(last.completion_token_ids) == result.stats.row_tokens
    assert merge_quality(result.stats.row_tokens, final)["merge_token_ratio"] == 1.0


def test_splits_count_rows_reasons_and_the_tokens_trained_twice(store: TraceStore) -> None:
    template = chat_trajectory("t", turns=1, system_tokens=5, observation_tokens=2, completion_tokens=3)[0]
    result, final = built(store, drifted(template, "drift"))
    assert result.stats.rows == 3 and dict(result.stats.splits) == {"template_drift": 2}
    assert result.stats.row_tokens == 14 + 21 + 28
    assert final == 30
    assert merge_quality(result.stats.row_tokens, final)["merge_token_ratio"] == pytest.approx(63 / 30)


def test_interleaved_conversations_count_each_final_once() -> None:
    """Two conversations sharing a 5-token system prompt, merged into one row each: only the shared
    prompt is trained twice (whatever rows the builder makes, the denominator is the same)."""
    a = np.arange(100, 130)
    b = np.concatenate((a[:5], np.arange(500, 520)))
    assert final_trajectory_tokens([a, b]) == 30 + 25 - 5
    assert final_trajectory_tokens([a[:12], a, b[:9], b]) == 50  # prefixes of a row add nothing
    assert final_trajectory_tokens([]) == 0


def test_status_and_learner_metrics_show_merge_quality(store: TraceStore) -> None:
    """Two steps as the learner records them: one perfect rollout, then one split three times."""
    from rich.console import Console

    template = chat_trajectory("t", turns=1, system_tokens=5, observation_tokens=2, completion_tokens=3)[0]
    store.add_tasks("run", [{"id": "a"}, {"id": "b"}])
    ledger = LearnerLedger(store, "run")
    steps = []
    for step, (task, rollout, records) in enumerate(
        (("a", "p0", chat_trajectory("p0", turns=4, system_tokens=20, observation_tokens=5, completion_tokens=5)),
         ("b", "d0", drifted(template, "d0"))), start=1,
    ):
        store.create_rollout("run", task, 0, rollout_id=rollout)
        result, final = built(store, records)
        metrics = {"rollouts": 1, **result.stats.as_metrics(), **merge_quality(result.stats.row_tokens, final)}
        steps.append((rollout, metrics))
        store.transition(rollout, 0, RolloutState.RUNNING, policy_version=step - 1)
        store.set_reward(rollout, 0, 1.0)
        store.finish_attempt(rollout, 0, RolloutState.SUCCEEDED)
        ledger.commit(step, f"/ckpt/v{step}", metrics, [(rollout, 0)])

    summary = summarize(store, "run")
    merge = summary.merge
    perfect_tokens = steps[0][1]["row_tokens"]
    assert (merge.rollouts, merge.rows, merge.splits) == (2, 4, {"template_drift": 2})
    assert merge.rows_per_rollout == 2.0
    assert merge.token_ratio == pytest.approx((perfect_tokens + 63) / (perfect_tokens + 30))
    console = Console(record=True, width=120)
    console.print(summary_table(summary))
    text = console.export_text()
    header = next(line for line in text.splitlines() if "clip" in line)
    columns = [c.strip() for c in header.split("┃") if c.strip()]
    rows = [[c.strip() for c in line.split("│") if c.strip()] for line in text.splitlines()
            if line.strip().startswith("│")]
    assert [row[columns.index("merge")] for row in rows] == ["1.00", "2.10"]
    assert "2.00 rows per rollout" in text and "splits: template_drift 2" in text

    learner = LearnerMetrics()
    for _, metrics in steps:
        learner.observe_step(metrics)
    exposition = learner.exposition()[0].decode()
    assert "harnessrl_learner_merge_token_ratio 2.1" in exposition
    assert f"harnessrl_learner_final_trajectory_tokens_total {perfect_tokens + 30}.0" in exposition
    assert 'harnessrl_learner_row_splits_total{reason="template_drift"} 2.0' in exposition


def test_step_records_without_the_count_show_a_dash() -> None:
    """Steps recorded before the learner counted final trajectory tokens: rows still shown, the ratio not."""
    merge = MergeQuality.of([{"rollouts": 2, "rows": 2, "row_tokens": 40}])
    assert merge.rows_per_rollout == 1.0 and merge.token_ratio is None
    assert "final trajectory tokens -" in merge.line()
