"""What a stop leaves behind is done when the run goes on, on SQLite and PostgreSQL with real harness processes:
training rollouts a stop cancelled are queued again (never claimed as a finished group meanwhile), a final
evaluation round a stop interrupted is owed until it ran, and pruning keeps the serving version until its
evaluation round exists.
"""

from __future__ import annotations

from pathlib import Path

from test_scheduler import active, harness, make  # noqa: F401 - harness is a fixture
from test_scheduler_evaluation import drive, scheduler_with_evaluation

from harnessrl.rollout_ids import is_evaluation
from harnessrl.scheduler import evaluation_owed, versions_to_keep
from harnessrl.store import RolloutState, TraceStore
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.trainer.checkpoint import CheckpointDir

TASKS = [{"id": f"t{i}", "behaviour": "ok", "reward": 0.5 + i / 10} for i in range(2)]


def test_training_rollouts_cancelled_by_a_stop_run_again_and_are_never_claimed_meanwhile(
    store: TraceStore, store_url: str, harness: Path, tmp_path: Path  # noqa: F811
) -> None:
    scheduler, _ = make(store, store_url, harness, tmp_path, TASKS)
    scheduler.reconcile(0)  # two groups of two (the staleness bound), all launched
    assert scheduler.stop_all() == 4  # Ctrl-C: every one cancelled
    ledger = LearnerLedger(store, "sched")
    # a learner still running (or started again) finds no finished group: cancelled is not an outcome
    assert ledger.claim(tasks_per_step=2, group_size=2) is None
    again, _ = make(store, store_url, harness, tmp_path / "again", TASKS)
    drive(again, 0, lambda: active(store) == 0 and ledger.claim(tasks_per_step=2, group_size=2) is not None)
    claim = ledger.claim(tasks_per_step=2, group_size=2)
    assert claim is not None
    assert sorted((a.attempt, a.state) for a in claim.attempts) == [(1, RolloutState.SUCCEEDED)] * 4
    assert {a.reward for a in claim.attempts} == {0.5, 0.6}
    assert len(store.list_attempts("sched")) == 8  # the four cancelled ones and their new attempts, no new group


def test_a_final_round_cut_short_by_a_stop_is_owed_until_it_ran(
    store: TraceStore, store_url: str, harness: Path, tmp_path: Path  # noqa: F811
) -> None:
    scheduler = scheduler_with_evaluation(store, store_url, harness, tmp_path, every_steps=10, samples=1)
    assert evaluation_owed(store, "sched", 3)  # no round for the final version yet
    scheduler.reconcile(3, finishing=True)
    assert scheduler.stop_all() == 3  # Ctrl-C during the final round
    assert evaluation_owed(store, "sched", 3)
    training = len([a for a in store.list_attempts("sched") if not is_evaluation(a.rollout_id)])
    again = scheduler_with_evaluation(store, store_url, harness, tmp_path / "again", every_steps=10, samples=1)
    drive(again, 3, lambda: not evaluation_owed(store, "sched", 3), finishing=True)
    # a finishing run queues its round again, never a training rollout
    assert len([a for a in store.list_attempts("sched") if not is_evaluation(a.rollout_id)]) == training
    assert not again.evaluation_pending()


def test_pruning_keeps_the_serving_version_until_its_round_exists(store: TraceStore, tmp_path: Path) -> None:
    """keepCheckpoints 1: the learner prunes as it commits version 3, before syncing it, while version 2 is
    still serving and due a round (everySteps 2) the scheduler has not created yet."""
    evaluation = {"tasks": {"inline": [{"id": "e"}]}, "everySteps": 2, "atStart": False}
    store.ensure_run("sched", {"spec": {"evaluation": evaluation}})
    ledger = LearnerLedger(store, "sched")
    ckpt = CheckpointDir(tmp_path / "checkpoints", keep_last=1)
    ledger.ensure_base_version(str(tmp_path / "base"))
    for version in (1, 2, 3):
        ckpt.write_version(version, lambda path: (path / "model.safetensors").write_bytes(b"x"))
        ledger.commit(version, str(ckpt.version_path(version)), {}, [], version=version)
        if version < 3:
            ledger.mark_synced(version)
    assert versions_to_keep(store, "sched") == {2}
    ckpt.prune(3, spare=versions_to_keep(store, "sched"))
    assert ckpt.listed(ckpt.versions) == [2, 3]
    # its round created (and running), the round keeps it; once version 3 serves without a round for 2, 2 goes
    store.add_tasks("sched", [{"id": "eval:e"}])
    store.create_rollout("sched", "eval:e", 0, rollout_id="sched-eval-v2", evaluated_version=2)
    assert versions_to_keep(store, "sched") == {2}
    # a run whose version 3 serves before a round for 2 was made: 3 stands in for it, and 2 is not kept
    store.ensure_run("skipped", {"spec": {"evaluation": evaluation}})
    skipped = LearnerLedger(store, "skipped")
    skipped.ensure_base_version(str(tmp_path / "base"))
    for version in (1, 2, 3):
        skipped.commit(version, f"/v{version}", {}, [], version=version)
        skipped.mark_synced(version)
    assert versions_to_keep(store, "skipped") == {3}
