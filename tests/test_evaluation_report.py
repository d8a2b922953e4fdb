"""Evaluation results as a person sees them: a column per evaluated version in the summary (``harnessrl
status`` prints the same), a note on the progress line and a second line on the reward PNG; all read from
the store, evaluation rollouts never mixed into the training numbers."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from test_report import _finish, trained  # noqa: F401 - trained is a fixture

from harnessrl.local.report import progress_line, summarize, summary_table, write_reward_curve
from harnessrl.rollout_ids import evaluation_rollout_id
from harnessrl.store import RolloutState, TraceStore

SPEC = {"spec": {"evaluation": {"tasks": {"inline": [{"id": "h1"}, {"id": "h2"}]}, "samplesPerTask": 2,
                                "temperature": 1.0, "passReward": 0.5}}}


@pytest.fixture
def evaluated(trained: TraceStore) -> TraceStore:  # noqa: F811
    """Version 0: rewards 0.2, 0.4 / 0.0, failed (pass none); version 2: 0.9, 0.3 / 0.6, 0.7 (pass 3 of 4);
    version 1 was never evaluated; all at policy version 2 when they ran."""
    store = trained
    store.ensure_run("r", SPEC)
    store.add_tasks("r", [{"id": "eval:h1"}, {"id": "eval:h2"}])
    plan = {0: [(0.2, 0.4), (0.0, None)], 2: [(0.9, 0.3), (0.6, 0.7)]}
    for version, per_task in plan.items():
        for number, rewards in enumerate(per_task):
            for index, reward in enumerate(rewards):
                rid = store.create_rollout("r", f"eval:h{number + 1}", index, evaluated_version=version,
                                           rollout_id=evaluation_rollout_id("r", version, number, index))
                state = RolloutState.SUCCEEDED if reward is not None else RolloutState.FAILED
                _finish(store, rid, state, reward, 2)
    return store


def test_results_per_version_and_training_numbers_unchanged(evaluated: TraceStore) -> None:
    summary = summarize(evaluated, "r")
    assert summary.reward_by_version == {0: pytest.approx(0.2), 1: pytest.approx(0.7)}  # no evaluation in it
    v0, v2 = summary.evaluation
    assert (v0.version, v0.step, v2.version, v2.step) == (0, 0, 2, 2)
    assert v0.reward_mean == pytest.approx(0.2) and v0.pass_rate == 0.0 and v0.failed == 1
    assert v0.pass_at_k == 0.0
    assert v2.reward_mean == pytest.approx(0.625) and v2.pass_rate == pytest.approx(0.75)
    assert v2.pass_at_k == pytest.approx(1.0)  # each task has a pass among its 2 samples


def test_summary_shows_a_column_per_evaluated_version(evaluated: TraceStore) -> None:
    summary = summarize(evaluated, "r")
    out = io.StringIO()
    Console(file=out, width=160).print(summary_table(summary))
    text = out.getvalue()
    assert "evaluation (held-out)" in text
    header = next(line for line in text.splitlines() if "v0" in line and "v2" in line)
    assert "v1" not in header
    assert "pass@2" in text and "0.625" in text and "0.750" in text
    assert "eval v2 reward 0.625 pass 0.75" in progress_line(summary)


def test_png_has_the_evaluation_line(evaluated: TraceStore, tmp_path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(evaluated, "r")
    drawn = []
    original = plt.Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), [list(a) for a in args]))
        return original(self, *args, **kwargs)

    plt.Axes.plot = spy
    try:
        png = write_reward_curve(summary, tmp_path / "reward.png")
    finally:
        plt.Axes.plot = original
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"
    labels = dict(drawn)
    assert labels["evaluation mean reward (held-out tasks)"] == [[0, 2], [pytest.approx(0.2), pytest.approx(0.625)]]
