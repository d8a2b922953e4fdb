"""A learner killed (SIGKILL) between saving a checkpoint and committing it resumes without loss or repetition.

The first process commits step 1, trains and saves step 2, and is killed before step 2's commit. The store then
still says version 1, the rollouts of step 2 are unconsumed, and version 2 is on disk as an uncommitted
leftover. A second process (the real ``harnessrl learn`` command) discards the leftover, restores version 1
with its optimizer state, redoes step 2 and goes on to step 3.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from learner_helpers import Sample, record_group

from harnessrl.store import TraceStore
from harnessrl.store.learner_ledger import LearnerLedger

HERE = Path(__file__).parent
RUN = "resume"
pytestmark = pytest.mark.slow  # real learner processes: ~20 s


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harnessrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def clean_env() -> dict[str, str]:
    """A single-process world: no launcher variables inherited from the test runner."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in launcher}


def test_kill_between_save_and_commit_then_resume(tiny: Path, tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = TraceStore.connect(url)
    store.upgrade()
    prompt = list(range(100, 116))
    groups = {}
    for g in range(3):  # one task group per step; token ids differ per group so rows are distinguishable
        samples = [Sample(((prompt, [200 + 10 * g + i] * 5, [-3.0] * 5),), float(i % 2)) for i in range(4)]
        groups[g] = set(record_group(store, RUN, f"task{g}", samples))
    out = tmp_path / "ckpt"
    ledger = LearnerLedger(store, RUN)

    killed = subprocess.run(
        [sys.executable, str(HERE / "learner_worker.py"), "--store", url, "--run", RUN, "--model", str(tiny),
         "--output", str(out), "--steps", "3", "--kill-after-save", "2"],
        env=clean_env(), capture_output=True, text=True, check=False, timeout=600,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert ledger.committed_version() == 1
    assert set(ledger.consumed_by(1)) == groups[0]
    assert ledger.consumed_by(2) == []  # trained, saved, but not committed
    assert (out / "versions" / "v000002" / "model.safetensors").is_file()  # the uncommitted leftover
    marker = out / "versions" / "v000002" / "leftover-marker"
    marker.write_text("written into the uncommitted leftover")  # an inode number could be reused; a file cannot

    resumed = subprocess.run(
        [sys.executable, "-m", "harnessrl.cli", "learn", "--store", url, "--run", RUN, "--model", str(tiny),
         "--output", str(out), "--steps", "3", "--tasks-per-step", "1", "--group-size", "4", "--lr", "1e-3",
         "--wait-timeout", "1", "--max-staleness", "2"],  # every group was sampled by version 0: all still train
        env=clean_env(), capture_output=True, text=True, check=False, timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "discarded uncommitted checkpoint files" in resumed.stderr
    assert "learner stopped after 2 step(s); last version 3" in resumed.stdout

    versions = ledger.versions()
    assert [v.version for v in versions] == [0, 1, 2, 3]  # no gap, nothing twice
    # offline (no replica, no proxy): nothing serves the trained versions, so none is called synced
    assert [v.synced for v in versions] == [True, False, False, False]
    consumed = {step: set(ledger.consumed_by(step)) for step in (1, 2, 3)}
    assert consumed == {1: groups[0], 2: groups[1], 3: groups[2]}  # each group exactly once
    assert not marker.exists()  # the leftover was discarded; step 2 was redone and re-published
    assert (out / "versions" / "v000002" / "model.safetensors").is_file()
    assert sorted(p.name for p in (out / "versions").iterdir()) == ["v000001", "v000002", "v000003"]
    assert sorted(p.name for p in (out / "engine").iterdir() if p.is_dir()) == ["v000003"]
    assert ledger.claim(1, 4) is None
    store.close()
