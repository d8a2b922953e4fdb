"""`harnessrl run` refuses bad input before starting anything, with one line naming the field and the fix."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def run(spec: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harnessrl.cli", "run", str(spec), "--run-dir",
                           str(spec.parent / "run"), *args], capture_output=True, text=True, timeout=300)


def write_spec(tmp_path: Path, **spec_changes) -> Path:
    doc = yaml.safe_load((ROOT / "examples/vowels/trainingrun.yaml").read_text())
    doc["spec"].update(spec_changes)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harnessrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_missing_model_says_how_to_build_one(tmp_path: Path) -> None:
    proc = run(write_spec(tmp_path, model={"path": "nowhere"}))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "spec.model.path" in proc.stderr and "harnessrl tiny-model" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_invalid_spec_lists_problems_with_lines(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples/vowels/trainingrun.yaml").read_text())
    doc["spec"]["harness"]["concurency"] = 4
    spec = tmp_path / "bad.yaml"
    spec.write_text(yaml.safe_dump(doc))
    proc = run(spec)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "spec.harness.concurency" in proc.stderr and "concurrency" in proc.stderr


def test_bad_task_file_line_is_named(tmp_path: Path, model: Path) -> None:
    (tmp_path / "tasks.jsonl").write_text('{"id": "a", "data": {}}\nnot json\n')
    harness = yaml.safe_load((ROOT / "examples/vowels/trainingrun.yaml").read_text())["spec"]["harness"]
    harness["tasks"] = {"file": {"path": "tasks.jsonl"}}
    proc = run(write_spec(tmp_path, model={"path": str(model)}, harness=harness))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"{tmp_path / 'tasks.jsonl'}:2: not JSON" in proc.stderr


def test_config_map_tasks_need_a_cluster(tmp_path: Path, model: Path) -> None:
    harness = yaml.safe_load((ROOT / "examples/vowels/trainingrun.yaml").read_text())["spec"]["harness"]
    harness["tasks"] = {"configMap": {"name": "tasks"}}
    proc = run(write_spec(tmp_path, model={"path": str(model)}, harness=harness))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "configMap is only available on a cluster" in proc.stderr


EVALUATION = {"tasks": {"file": {"path": "held-out.jsonl"}}, "everySteps": 2}


def test_a_missing_evaluation_task_file_is_named(tmp_path: Path, model: Path) -> None:
    shutil.copy(ROOT / "examples/vowels/tasks.jsonl", tmp_path / "tasks.jsonl")  # the training tasks exist
    proc = run(write_spec(tmp_path, model={"path": str(model)}, evaluation=EVALUATION))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"spec.evaluation.tasks.file.path: cannot read {tmp_path / 'held-out.jsonl'}" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_zero_samples_per_task_is_named(tmp_path: Path, model: Path) -> None:
    proc = run(write_spec(tmp_path, model={"path": str(model)}, evaluation={**EVALUATION, "samplesPerTask": 0}))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "spec.evaluation.samplesPerTask" in proc.stderr and "at least 1" in proc.stderr
