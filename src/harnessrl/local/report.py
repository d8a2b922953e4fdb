"""What a person watches: progress, the summary table and the reward curve, all read from the store.

Everything here is derived from the trace store alone (attempt states, rewards, which step consumed which
attempt), so the live display, the end-of-run summary and ``harnessrl status RUN_DIR`` always agree, and a
resumed or crashed run reports the same history.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select

from harnessrl.local.evaluation_report import evaluation_note, evaluation_points, evaluation_table
from harnessrl.store import RolloutState, TraceStore, consumed_totals
from harnessrl.store.evaluations import EvaluationResult, evaluation_results
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.store.schema import LearnerStep

RUN_FILE = "run.json"  # in the run directory: which store and run name `harnessrl status` reads


@dataclass(frozen=True)
class StepSummary:
    """One learner step: the rewards of the rollouts it trained on."""

    step: int
    rollouts: int
    succeeded: int
    reward_mean: float | None
    reward_std: float | None
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MergeQuality:
    """How the learner's row builder merged the calls of the rollouts it trained on (from step records).

    ``token_ratio`` is row tokens / final trajectory tokens (``trainer.metrics.final_trajectory_tokens``):
    1.0 when every trajectory became one row, above 1 by the prefixes trained again after each split;
    ``splits`` counts the row builder's reasons for starting a new row.
    """

    rollouts: int
    rows: int
    row_tokens: int
    final_tokens: int
    splits: dict[str, int]

    @classmethod
    def of(cls, metrics: list[dict[str, Any]]) -> MergeQuality:
        def total(name: str, among: list[dict[str, Any]]) -> int:
            return int(sum(m.get(name) or 0 for m in among))

        measured = [m for m in metrics if "final_trajectory_tokens" in m]  # step records that carry it
        splits = {
            name.removeprefix("split_"): total(name, metrics)
            for name in sorted({n for m in metrics for n in m if n.startswith("split_")})
        }
        return cls(total("rollouts", metrics), total("rows", metrics), total("row_tokens", measured),
                   total("final_trajectory_tokens", measured), {k: v for k, v in splits.items() if v})

    @property
    def rows_per_rollout(self) -> float | None:
        return self.rows / self.rollouts if self.rollouts else None

    @property
    def token_ratio(self) -> float | None:
        return self.row_tokens / self.final_tokens if self.final_tokens else None

    def line(self) -> str:
        splits = ", ".join(f"{reason} {n}" for reason, n in self.splits.items()) or "none"
        return (f"merge: {_fmt(self.rows_per_rollout, 2)} rows per rollout, training tokens / final trajectory "
                f"tokens {_fmt(self.token_ratio, 2)} (1.00 is a perfect merge), splits: {splits}")


@dataclass(frozen=True)
class RunSummary:
    run: str
    counts: dict[RolloutState, int]
    policy_version: int
    steps: list[StepSummary]
    rollouts_per_s: float | None
    reward_by_version: dict[int, float]
    evaluation: list[EvaluationResult] = field(default_factory=list)
    """Per evaluated version (``spec.evaluation``), oldest first."""

    @property
    def finished(self) -> int:
        return sum(n for state, n in self.counts.items() if state.terminal)

    @property
    def merge(self) -> MergeQuality:
        return MergeQuality.of([s.metrics for s in self.steps])


def summarize(store: TraceStore, run: str) -> RunSummary:
    """The run's figures, read from what each learner step totalled as it consumed its attempts plus the attempts
    still open (``store.consumed_totals``), so ``harnessrl status`` and the trace explorer's overview cost the
    run's steps, not its rollouts (at 100,000 attempts the scan they replace took most of a second)."""
    ledger = LearnerLedger(store, run)
    with store.engine.connect() as conn:
        per_step = consumed_totals.steps(conn, run)
        metrics = dict(conn.execute(select(LearnerStep.step, LearnerStep.metrics).where(LearnerStep.run == run)).all())
        by_version = consumed_totals.reward_by_version(conn, run)
        ended, first, last = consumed_totals.ended(conn, run)
    steps = [StepSummary(s.step, s.attempts, s.rewarded, *_mean_std(s.rewarded, s.reward_sum, s.reward_squares),
                         metrics.get(s.step) or {}) for s in per_step]
    span = (last - first).total_seconds() if ended > 1 and first is not None and last is not None else 0.0
    return RunSummary(
        run=run,
        counts=store.count_attempts(run),
        policy_version=ledger.committed_version(),
        steps=steps,
        rollouts_per_s=(ended - 1) / span if span > 0 else None,
        reward_by_version=by_version,
        evaluation=evaluation_results(store, run),
    )


def _mean_std(n: int, total: float | None, squares: float | None) -> tuple[float | None, float | None]:
    """Mean and population standard deviation from a count, sum and sum of squares."""
    if not n or total is None or squares is None:
        return None, None
    mean = total / n
    return mean, math.sqrt(max(squares / n - mean * mean, 0.0))


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def progress_line(summary: RunSummary, target_steps: int | None = None) -> str:
    """One line for the live display (and for logs when stdout is not a terminal)."""
    c = summary.counts
    last = summary.steps[-1] if summary.steps else None
    steps = f"{len(summary.steps)}/{target_steps}" if target_steps else str(len(summary.steps))
    return (
        f"step {steps}  policy v{summary.policy_version}  "
        f"rollouts running {c[RolloutState.RUNNING]} queued {c[RolloutState.QUEUED]} "
        f"done {c[RolloutState.SUCCEEDED]} failed {c[RolloutState.FAILED] + c[RolloutState.TIMED_OUT]}  "
        f"reward {_fmt(last.reward_mean if last else None)}  "
        f"rollouts/s {_fmt(summary.rollouts_per_s, 2)}{evaluation_note(summary.evaluation)}"
    )


def summary_table(summary: RunSummary):  # -> rich.table.Table (rich is imported lazily: local extra)
    """The end-of-run table: one line per learner step, then the rollout totals. It fits 80 columns (a
    terminal's default, and what rich assumes when writing to a file or a pipe) without cutting a value:
    short two-line headers, succeeded/rollouts in one column, and no column may be shrunk or wrapped."""
    from rich.table import Table

    table = Table(title=f"harnessrl run {summary.run}: policy v{summary.policy_version}")
    # ok/n: rollouts that succeeded / rollouts the step consumed
    # clip: the fraction of generated tokens whose ratio the loss clipped (0 with one update per step)
    # logp corr: the learner's and vLLM's log-probs of the sampled tokens, correlated
    # merge: the step's training tokens / final trajectory tokens (1.00 when every trajectory was one row);
    # the caption adds the run's rows per rollout and split reasons
    for column in ("step", "ok/n", "reward\nmean", "reward\nstd", "loss", "grad\nnorm", "clip", "logp\ncorr",
                   "merge"):
        table.add_column(column, justify="right", no_wrap=True, overflow="ignore")
    for s in summary.steps:
        m = s.metrics
        table.add_row(str(s.step), f"{s.succeeded}/{s.rollouts}", _fmt(s.reward_mean), _fmt(s.reward_std),
                      _fmt(m.get("loss"), 4), _fmt(m.get("grad_norm"), 3), _fmt(m.get("clip_frac"), 3),
                      _fmt(m.get("logprob_pearson"), 4), _fmt(MergeQuality.of([m]).token_ratio, 2))
    totals = ", ".join(f"{state.value} {n}" for state, n in summary.counts.items() if n)
    table.caption = f"rollouts: {totals or 'none yet'}"
    merge = summary.merge
    if merge.rows:
        table.caption += f"\n{merge.line()}"
    if summary.evaluation:  # then the evaluation's own table, a column per evaluated version
        from rich.console import Group

        return Group(table, evaluation_table(summary.evaluation))
    return table


def write_reward_curve(summary: RunSummary, path: Path) -> Path | None:
    """Reward mean (with its spread) per learner step as a PNG, and the evaluation's mean reward at the step
    that made each evaluated version as a second line; None while no step has a reward."""
    points = [(s.step, s.reward_mean, s.reward_std or 0.0) for s in summary.steps if s.reward_mean is not None]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, means, stds = zip(*points, strict=True)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, means, marker="o", label="reward mean")
    ax.fill_between(steps, [m - s for m, s in zip(means, stds, strict=True)],
                    [m + s for m, s in zip(means, stds, strict=True)], alpha=0.2, label="± std")
    evaluated = evaluation_points(summary.evaluation)
    if evaluated:
        ax.plot(*zip(*evaluated, strict=True), marker="s", color="tab:green",
                label="evaluation mean reward (held-out tasks)")
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward")
    ax.set_title(f"{summary.run}: reward per step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_run_file(run_dir: Path, run: str, store_url: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_FILE).write_text(json.dumps({"run": run, "store": store_url}, indent=2) + "\n")


def run_and_store(target: str, run: str | None) -> tuple[str, str, Path | None]:
    """(run name, store URL, run directory) from a run directory (its ``run.json`` names both) or from a store
    URL and ``--run NAME`` (a run an operator made: its traces are in the cluster's store, with no directory)."""
    if "://" in target:
        if not run:
            raise ValueError(f"{target}: a store URL needs --run NAME (the TrainingRun's name)")
        return run, target, None
    run_dir = Path(target)
    if not run_dir.is_dir():
        raise ValueError(f"{target} is neither a run directory nor a store URL (sqlite:///PATH, "
                         "postgresql+psycopg://...)")
    stored_run, url = read_run_file(run_dir)
    if run and run != stored_run:
        raise ValueError(f"--run {run}: the run directory {run_dir} belongs to run {stored_run!r}; drop --run")
    return stored_run, url, run_dir


def read_run_file(run_dir: Path) -> tuple[str, str]:
    path = run_dir / RUN_FILE
    try:
        data = json.loads(path.read_text())
        return str(data["run"]), str(data["store"])
    except FileNotFoundError:
        raise ValueError(f"{run_dir} is not a run directory (no {RUN_FILE}); give the directory "
                         "`harnessrl run` printed") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is damaged ({exc}); it should hold {{\"run\": ..., \"store\": ...}}") from None
