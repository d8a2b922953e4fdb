"""``harnessrl export --version best``: the best complete evaluation among the versions still on disk, and one
line naming what exists when there is none."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_report import _finish

from harnessrl.rollout_ids import evaluation_rollout_id
from harnessrl.store import RolloutState, TraceStore
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.trainer.checkpoint import CheckpointDir
from harnessrl.trainer.export import ExportError, ExportSource, choose_version

SPEC = {"spec": {"evaluation": {"tasks": {"inline": [{"id": "h"}]}, "samplesPerTask": 2, "temperature": 1.0,
                                "passReward": 0.5}}}


@pytest.fixture
def evaluated_run(store: TraceStore, tmp_path: Path) -> ExportSource:
    """Versions 0-4 on disk except 1 (pruned); evaluated: v1 best (pass 2/2), v2 and v3 tie on pass rate (1/2)
    with v2's mean reward higher, v4's round still running."""
    store.ensure_run("r", SPEC)
    store.add_tasks("r", [{"id": "t"}, {"id": "eval:h"}])
    ledger = LearnerLedger(store, "r")
    ckpt = CheckpointDir(tmp_path / "ckpt")
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    ledger.ensure_base_version(str(base))
    for version in range(1, 5):
        ledger.commit(version, str(ckpt.version_path(version)), {}, [])
        if version != 1:
            ckpt.version_path(version).mkdir(parents=True)
            (ckpt.version_path(version) / "config.json").write_text("{}")
    rounds = {1: (0.9, 0.8), 2: (0.9, 0.1), 3: (0.6, 0.2), 4: (1.0, None)}
    for version, rewards in rounds.items():
        for index, reward in enumerate(rewards):
            rid = store.create_rollout("r", "eval:h", index, evaluated_version=version,
                                       rollout_id=evaluation_rollout_id("r", version, 0, index))
            if reward is not None:
                _finish(store, rid, RolloutState.SUCCEEDED, reward, version)
    return ExportSource(store.url, "r", ckpt.root)


def test_best_is_the_best_complete_evaluation_still_on_disk(store: TraceStore, evaluated_run: ExportSource) -> None:
    version, path = choose_version(LearnerLedger(store, "r"), evaluated_run, "best")
    assert version == 2  # v1 scored higher but was pruned; v2 beats v3 on mean reward; v4 is still running
    assert (path / "config.json").is_file()


def test_best_names_the_evaluated_versions_when_all_are_gone(store: TraceStore, tmp_path: Path,
                                                             evaluated_run: ExportSource) -> None:
    import shutil

    for version in (2, 3, 4):
        shutil.rmtree(CheckpointDir(tmp_path / "ckpt").version_path(version))
    with pytest.raises(ExportError) as refused:
        choose_version(LearnerLedger(store, "r"), evaluated_run, "best")
    assert str(refused.value) == ("--version best: run 'r' has evaluation results only for versions no longer on "
                                  "disk (1, 2, 3); use --version latest or a number: 0")
