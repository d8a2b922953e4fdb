"""`harnessrl run` with ``spec.evaluation``: bad input is refused in one line naming the field, before anything
starts."""

from __future__ import annotations

import shutil
from pathlib import Path

from test_local_run_errors import ROOT, model, run, write_spec  # noqa: F401 - model is a fixture

EVALUATION = {"tasks": {"file": {"path": "held-out.jsonl"}}, "everySteps": 2}


def test_a_missing_evaluation_task_file_is_named(tmp_path: Path, model: Path) -> None:  # noqa: F811
    shutil.copy(ROOT / "examples/vowels/tasks.jsonl", tmp_path / "tasks.jsonl")  # the training tasks exist
    proc = run(write_spec(tmp_path, model={"path": str(model)}, evaluation=EVALUATION))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"spec.evaluation.tasks.file.path: cannot read {tmp_path / 'held-out.jsonl'}" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_zero_samples_per_task_is_named(tmp_path: Path, model: Path) -> None:  # noqa: F811
    proc = run(write_spec(tmp_path, model={"path": str(model)}, evaluation={**EVALUATION, "samplesPerTask": 0}))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "spec.evaluation.samplesPerTask" in proc.stderr and "at least 1" in proc.stderr
