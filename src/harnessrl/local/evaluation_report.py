"""How evaluation results are shown: a column per evaluated version (``harnessrl status`` and the run's
summary), a short note on the progress line, and the points of the PNG's evaluation line.

The numbers are ``harnessrl.store.evaluations``'s, read from the store; this module only lays them out.
"""

from __future__ import annotations

from harnessrl.store.evaluations import EvaluationResult


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def evaluation_table(results: list[EvaluationResult]):  # -> rich.table.Table (rich: the local extra)
    """One column per evaluated version (v0 is the baseline); a round still running shows ended/total."""
    from rich.table import Table

    table = Table(title="evaluation (held-out)")
    table.add_column("", justify="left")
    for result in results:
        table.add_column(f"v{result.version}" + ("" if result.complete else " (running)"), justify="right")
    k = max((result.k for result in results), default=1)
    rows: list[tuple[str, list[str]]] = [
        ("rollouts ended", [f"{r.ended}/{r.rollouts}" for r in results]),
        ("mean reward", [_fmt(r.reward_mean) for r in results]),
        ("pass rate", [_fmt(r.pass_rate) for r in results]),
    ]
    if k > 1:
        rows.append((f"pass@{k}", [_fmt(r.pass_at_k) for r in results]))
    rows += [
        ("failed", [str(r.failed) for r in results]),
        ("timed out", [str(r.timed_out) for r in results]),
    ]
    for name, cells in rows:
        table.add_row(name, *cells)
    return table


def evaluation_note(results: list[EvaluationResult]) -> str:
    """The newest complete evaluation, for the progress line ('' while there is none)."""
    done = [result for result in results if result.complete]
    if not done:
        return ""
    last = done[-1]
    return f"  eval v{last.version} reward {_fmt(last.reward_mean)} pass {_fmt(last.pass_rate, 2)}"


def evaluation_points(results: list[EvaluationResult]) -> list[tuple[int, float]]:
    """(learner step, mean reward) of each complete evaluation whose version's step is known."""
    return [(r.step, r.reward_mean) for r in results
            if r.complete and r.step is not None and r.reward_mean is not None]
