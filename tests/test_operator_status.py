"""The status a reconcile writes: counts, conditions whose transition time moves only with their status, and a
comparison that ignores those times (so an unchanged run is never patched)."""

from __future__ import annotations

from harnessrl.operator.status import Observed, build_status, same_status
from harnessrl.spec.status import Phase, Reason, TrainingRunStatus
from harnessrl.store import RolloutState


def observed(**changes) -> Observed:
    base = dict(generation=2, phase=Phase.RUNNING, reason=Reason.RUNNING, message="step 1 of 3", store_ready=True,
                rollout_ready=True, learner_ready=False, policy_version=1, step=1, reward_mean=0.25,
                counts={RolloutState.RUNNING: 4, RolloutState.SUCCEEDED: 9, RolloutState.TIMED_OUT: 1},
                start_time="2026-12-03T10:00:00Z")
    return Observed(**{**base, **changes})


def test_status_fields_and_conditions() -> None:
    status = build_status(observed(), None)
    TrainingRunStatus.model_validate(status)  # the CRD's own status schema accepts it
    assert status["rollouts"] == {"queued": 0, "running": 4, "succeeded": 9, "failed": 0, "timedOut": 1}
    assert (status["phase"], status["reason"], status["observedGeneration"]) == ("Running", "Running", 2)
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conditions == {"StoreReady": ("True", "Connected"), "RolloutReady": ("True", "Serving"),
                          "LearnerReady": ("False", "NotRunning"), "Progressing": ("True", "Running")}
    assert (status["policyVersion"], status["step"], status["rewardMean"]) == (1, 1, 0.25)
    # kubectl's REWARD column shows the number as stored: four decimals, not a float's seventeen digits
    assert build_status(observed(reward_mean=0.19433710522465142), None)["rewardMean"] == 0.1943


def test_transition_times_move_only_with_the_status() -> None:
    first = build_status(observed(), None)
    for condition in first["conditions"]:
        condition["lastTransitionTime"] = "2026-01-01T00:00:00Z"
    again = build_status(observed(), first)
    assert all(c["lastTransitionTime"] == "2026-01-01T00:00:00Z" for c in again["conditions"])
    assert same_status(first, again)
    failed = build_status(observed(phase=Phase.FAILED, reason=Reason.LEARNER_CRASHED, learner_ready=False), first)
    progressing = next(c for c in failed["conditions"] if c["type"] == "Progressing")
    assert progressing["status"] == "False" and progressing["lastTransitionTime"] != "2026-01-01T00:00:00Z"
    learner = next(c for c in failed["conditions"] if c["type"] == "LearnerReady")
    assert learner["lastTransitionTime"] == "2026-01-01T00:00:00Z"  # it was False before too
    assert not same_status(first, failed)


def test_unknown_readiness_is_unknown() -> None:
    status = build_status(observed(store_ready=None, rollout_ready=None, learner_ready=None), None)
    assert {c["status"] for c in status["conditions"] if c["type"] != "Progressing"} == {"Unknown"}
