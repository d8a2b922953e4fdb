"""Progress, summary and reward curve are derived from the store, so they agree with what was trained on."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from harnessrl.local.report import (
    progress_line,
    read_run_file,
    summarize,
    summary_table,
    write_reward_curve,
    write_run_file,
)
from harnessrl.store import RolloutState, TraceStore
from harnessrl.store.learner_ledger import LearnerLedger


def _finish(store: TraceStore, rollout: str, state: RolloutState, reward: float | None, version: int) -> None:
    store.transition(rollout, 0, RolloutState.RUNNING, policy_version=version)
    if reward is not None:
        store.set_reward(rollout, 0, reward)
    store.finish_attempt(rollout, 0, state, None if state is RolloutState.SUCCEEDED else "HarnessFailed: x")


@pytest.fixture
def trained(store: TraceStore) -> TraceStore:
    """Two steps: step 1 trained on rewards 0.1, 0.3 (+ one failure), step 2 on 0.6, 0.8; one running left."""
    store.add_tasks("r", [{"id": "a"}, {"id": "b"}, {"id": "c"}])
    plan = [("a", 0, RolloutState.SUCCEEDED, 0.1, 0), ("a", 1, RolloutState.SUCCEEDED, 0.3, 0),
            ("a", 2, RolloutState.FAILED, None, 0),
            ("b", 0, RolloutState.SUCCEEDED, 0.6, 1), ("b", 1, RolloutState.SUCCEEDED, 0.8, 1)]
    for task, index, state, reward, version in plan:
        rid = store.create_rollout("r", task, index, rollout_id=f"{task}{index}")
        _finish(store, rid, state, reward, version)
    store.create_rollout("r", "c", 0, rollout_id="c0")
    store.transition("c0", 0, RolloutState.RUNNING, policy_version=2)
    ledger = LearnerLedger(store, "r")
    ledger.commit(1, "/ckpt/v1", {"loss": 0.5, "grad_norm": 1.25, "clip_frac": 0.125},
                  [("a0", 0), ("a1", 0), ("a2", 0)])
    ledger.commit(2, "/ckpt/v2", {"loss": 0.25}, [("b0", 0), ("b1", 0)])
    return store


def test_summary_is_derived_from_consumed_attempts(trained: TraceStore) -> None:
    summary = summarize(trained, "r")
    assert summary.policy_version == 2
    assert [(s.step, s.rollouts, s.succeeded) for s in summary.steps] == [(1, 3, 2), (2, 2, 2)]
    assert summary.steps[0].reward_mean == pytest.approx(0.2)
    assert summary.steps[0].reward_std == pytest.approx(0.1)
    assert summary.steps[1].reward_mean == pytest.approx(0.7)
    assert summary.steps[0].metrics["grad_norm"] == 1.25
    assert summary.reward_by_version == {0: pytest.approx(0.2), 1: pytest.approx(0.7)}
    assert summary.counts[RolloutState.RUNNING] == 1 and summary.finished == 5

    line = progress_line(summary, target_steps=10)
    assert line.startswith("step 2/10  policy v2  rollouts running 1 queued 0 done 4 failed 1  reward 0.700")


def test_table_and_png(trained: TraceStore, tmp_path: Path) -> None:
    from rich.console import Console

    summary = summarize(trained, "r")
    console = Console(record=True, width=80)  # a terminal's default, and rich's for a file or a pipe
    console.print(summary_table(summary))
    text = console.export_text()
    assert "0.200" in text and "0.700" in text and "1.250" in text and "running 1" in text
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80, text
    lines = text.splitlines()
    header = next(line for line in lines if "clip" in line)
    columns = [c.strip() for c in header.split("┃") if c.strip()]
    # the fraction of generated tokens the loss clipped, per step (what `harnessrl status` prints too)
    clip = columns.index("clip")
    rows = [[c.strip() for c in line.split("│") if c.strip()] for line in lines if line.strip().startswith("│")]
    assert [(row[0], row[1], row[clip]) for row in rows] == [("1", "2/3", "0.125"), ("2", "2/2", "-")]

    png = write_reward_curve(summary, tmp_path / "curve" / "reward.png")
    assert png is not None
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (700, 400)


def test_empty_run_has_no_curve_and_a_plain_line(store: TraceStore, tmp_path: Path) -> None:
    summary = summarize(store, "nothing")
    assert summary.steps == [] and summary.policy_version == 0
    assert write_reward_curve(summary, tmp_path / "r.png") is None
    assert "reward -" in progress_line(summary)


def test_run_file_round_trip_and_errors(tmp_path: Path) -> None:
    write_run_file(tmp_path / "run", "demo", "sqlite:///x.db")
    assert read_run_file(tmp_path / "run") == ("demo", "sqlite:///x.db")
    with pytest.raises(ValueError, match="not a run directory"):
        read_run_file(tmp_path)
    (tmp_path / "run" / "run.json").write_text("{")
    with pytest.raises(ValueError, match="damaged"):
        read_run_file(tmp_path / "run")
