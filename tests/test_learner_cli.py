"""``harnessrl learn``: wrong input is one clear line naming the option and the fix, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def learn(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harnessrl.cli", "learn", *args], capture_output=True, text=True, check=False,
                          timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harnessrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_a_directory_without_a_model_is_refused(tmp_path: Path):
    proc = learn("--store", f"sqlite:///{tmp_path / 's.db'}", "--run", "r", "--model", str(tmp_path),
                 "--output", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "--model" in proc.stderr and "config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_a_wrong_store_url_is_one_line(tiny: Path, tmp_path: Path):
    proc = learn("--store", "mysql://db/x", "--run", "r", "--model", str(tiny), "--output", str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error:")]
    assert "mysql" in line and "sqlite:///" in line  # names the URL and what to use instead


@pytest.mark.parametrize(("args", "names"), [
    (["--loss-aggregation", "seq-mean-token-sum-norm"], "--max-row-tokens"),
    (["--lr", "0"], "--lr"),
    (["--zero-stage", "4"], "--zero-stage"),
    (["--mini-batches", "0"], "--mini-batches"),
])
def test_bad_settings_name_the_option(tiny: Path, tmp_path: Path, args: list[str], names: str):
    proc = learn("--store", f"sqlite:///{tmp_path / 's.db'}", "--run", "r", "--model", str(tiny),
                 "--output", str(tmp_path / "out"), *args)
    assert proc.returncode == 2
    assert names in proc.stderr and "Traceback" not in proc.stderr


def test_spec_owns_the_algorithm_flags(tiny: Path, tmp_path: Path):
    spec = Path(__file__).resolve().parents[1] / "examples" / "vowels" / "trainingrun.yaml"
    proc = learn("--spec", str(spec), "--store", f"sqlite:///{tmp_path / 's.db'}", "--model", str(tiny),
                 "--output", str(tmp_path / "out"), "--lr", "0.1", "--zero-stage", "3", "--mini-batches", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--lr, --zero-stage, --mini-batches: set in the TrainingRun's spec.learner" in proc.stderr


def test_a_bad_spec_names_its_problems(tiny: Path, tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: harnessrl.io/v1alpha1\nkind: TrainingRun\nmetadata: {name: x}\n"
                   "spec: {model: {path: m}, harness: {command: [h], tasks: {inline: [{id: a}]}, groupSize: 0}}\n")
    proc = learn("--spec", str(bad), "--store", f"sqlite:///{tmp_path / 's.db'}", "--model", str(tiny),
                 "--output", str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "spec.harness.groupSize" in proc.stderr


def test_a_sync_that_fails_after_its_retries_stops_the_learner(tiny: Path, tmp_path: Path):
    """spec.weightSync.retries: a failed sync fails the run. The learner trains step 1, cannot load it on the
    (dead) replica, and exits non-zero naming the replica and the settings, before training step 2; version 1
    stays committed and unsynced for a restarted learner to sync first."""
    from learner_helpers import Sample, record_group
    from test_weight_sync import dead_url

    from harnessrl.store import TraceStore
    from harnessrl.store.learner_ledger import LearnerLedger

    url = f"sqlite:///{tmp_path / 's.db'}"
    with TraceStore.connect(url) as store:
        store.upgrade()
        prompt = list(range(20, 30))
        for task in ("a", "b"):  # two steps' worth: the learner must stop after the first
            record_group(store, "r", task, [Sample(((prompt, [300 + i] * 4, [-2.0] * 4),), float(i)) for i in range(2)])
    dead = dead_url()
    proc = learn("--store", url, "--run", "r", "--model", str(tiny), "--output", str(tmp_path / "out"),
                 "--steps", "2", "--tasks-per-step", "1", "--group-size", "2", "--wait-timeout", "1",
                 "--replica", dead)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error:")]
    assert "weight sync of version 1 failed after 3 tries" in line and dead in line
    assert "spec.weightSync.retries" in line
    with TraceStore.connect(url) as store:
        ledger = LearnerLedger(store, "r")
        assert ledger.committed_version() == 1 and not ledger.version(1).synced


def test_each_flag_that_mirrors_a_spec_field_has_the_specs_default() -> None:
    """One default everywhere: `harnessrl learn` without --spec trains as a TrainingRun that leaves the field
    out would (gradient checkpointing and the staleness bound differed once)."""
    from harnessrl.trainer.commands import SPEC_FIELDS, SPEC_OWNED, _spec_default, learn_command

    assert set(SPEC_FIELDS) <= set(SPEC_OWNED)
    defaults = {param.name: param.default for param in learn_command.params}
    for flag, field in SPEC_FIELDS.items():
        assert defaults[flag] == _spec_default(*field), flag
