"""The pod backend at unit level: pod objects as the kubelet reports them map to the right exits, creation is
idempotent and rate-bounded, deletions and refusals become exits (fast: a recording API, no cluster; the
scenarios in test_operator_cluster.py run it against the real control plane)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from harnessrl.operator.naming import ATTEMPT_ANNOTATION, ROLLOUT_ANNOTATION
from harnessrl.operator.pods import PodApi, PodBackend, PodSummary, summarize_pod
from harnessrl.scheduler import HarnessExit, Launch


def pod(
    phase: str,
    *,
    harness: dict[str, Any] | None = None,
    reason: str | None = None,
    attempt: int = 0,
    deleting: bool = False,
    message: str | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if harness is not None:
        status["containerStatuses"] = [{"name": "harness", "state": harness}]
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    meta: dict[str, Any] = {
        "name": f"r1-a{attempt}",
        "creationTimestamp": "2026-12-03T10:00:00Z",
        "annotations": {ROLLOUT_ANNOTATION: "r1", ATTEMPT_ANNOTATION: str(attempt)},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-12-03T10:01:00Z"
    return {"metadata": meta, "status": status}


@pytest.mark.parametrize(
    "body, expected",
    [
        (
            pod("Running", harness={"running": {"startedAt": "2026-12-03T10:00:01Z"}}),
            ("Running", None, None, False),
        ),
        (
            pod("Succeeded", harness={"terminated": {"exitCode": 0, "reason": "Completed"}}),
            ("Succeeded", 0, "Completed", False),
        ),
        (
            pod("Failed", harness={"terminated": {"exitCode": 3, "reason": "Error"}}),
            ("Failed", 3, "Error", False),
        ),
        (
            pod("Failed", harness={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}),
            ("Failed", 137, "OOMKilled", False),
        ),
        (
            pod("Failed", reason="Evicted", message="The node was low on resource: memory."),
            ("Failed", None, "Evicted: The node was low on resource: memory.", False),
        ),
        (
            pod(
                "Failed",
                reason="DeadlineExceeded",
                message="Pod was active on the node longer than specified",
            ),
            ("Failed", None, "DeadlineExceeded: Pod was active on the node longer than specified", False),
        ),
        (
            pod(
                "Pending",
                harness={"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}},
            ),
            ("Pending", None, "ImagePullBackOff: Back-off pulling image", True),
        ),
        (pod("Pending", harness={"waiting": {"reason": "ErrImagePull"}}), ("Pending", None, None, False)),
        (
            pod(
                "Pending",
                harness={
                    "waiting": {"reason": "CreateContainerConfigError", "message": 'secret "gh" not found'}
                },
            ),
            ("Pending", None, 'CreateContainerConfigError: secret "gh" not found', True),
        ),
    ],
    ids=[
        "running",
        "succeeded",
        "exit-3",
        "oom",
        "evicted",
        "deadline",
        "image-pull",
        "first-pull-error",
        "missing-secret",
    ],
)
def test_summaries_read_what_the_kubelet_reports(body: dict, expected: tuple) -> None:
    summary = summarize_pod(body)
    assert summary is not None and summary.key == ("r1", 0)
    assert (summary.phase, summary.exit_code, summary.reason, summary.fatal) == expected


def verified_pod(phase: str, harness: dict[str, Any], verifier: dict[str, Any] | None) -> dict[str, Any]:
    """A pod of a run with a verifier: the harness is an init container, the verifier the main one."""
    body = pod(phase)
    body["status"]["initContainerStatuses"] = [
        {"name": "proxy", "state": {"running": {}}},
        {"name": "harness", "state": harness},
    ]
    if verifier is not None:
        body["status"]["containerStatuses"] = [{"name": "verifier", "state": verifier}]
    return body


@pytest.mark.parametrize(
    "body, expected",
    [
        (
            verified_pod("Pending", {"running": {"startedAt": "2026-12-03T10:00:01Z"}}, None),
            ("Pending", None, None, False),
        ),
        (  # the harness failed: the verifier never runs, and the harness's exit is the outcome
            verified_pod("Failed", {"terminated": {"exitCode": 2, "reason": "Error"}}, None),
            ("Failed", 2, "Error", False),
        ),
        (  # the harness is done and the verifier still runs: no outcome yet
            verified_pod("Running", {"terminated": {"exitCode": 0, "reason": "Completed"}}, {"running": {}}),
            ("Running", 0, "Completed", False),
        ),
        (
            verified_pod(
                "Failed",
                {"terminated": {"exitCode": 0, "reason": "Completed"}},
                {"terminated": {"exitCode": 4, "reason": "Error"}},
            ),
            ("Failed", 4, "verifier Error", False),
        ),
        (
            verified_pod(
                "Succeeded",
                {"terminated": {"exitCode": 0, "reason": "Completed"}},
                {"terminated": {"exitCode": 0, "reason": "Completed"}},
            ),
            ("Succeeded", 0, "verifier Completed", False),
        ),
        (
            verified_pod(
                "Pending",
                {"terminated": {"exitCode": 0, "reason": "Completed"}},
                {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}},
            ),
            ("Pending", 0, "verifier ImagePullBackOff: Back-off pulling image", True),
        ),
    ],
    ids=["harness-running", "harness-failed", "verifying", "verifier-failed", "verified", "verifier-image"],
)
def test_with_a_verifier_the_harness_failure_or_else_the_verifier_exit_is_the_outcome(
    body: dict, expected: tuple
) -> None:
    summary = summarize_pod(body)
    assert summary is not None
    assert (summary.phase, summary.exit_code, summary.reason, summary.fatal) == expected
    if expected[0] == "Pending" and expected[1] is None:
        assert summary.started_at is not None  # the harness (an init container) has started


def test_foreign_pods_are_not_summarized() -> None:
    assert summarize_pod({"metadata": {"name": "x", "annotations": {}}, "status": {}}) is None


class RecordingApi(PodApi):
    def __init__(self, refuse: ApiException | None = None) -> None:
        self.created: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, int]] = []
        self.refuse = refuse

    def create(self, namespace: str, pod: dict[str, Any]) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.created.append(pod)

    def delete(self, namespace: str, name: str, grace_seconds: int) -> None:
        self.deleted.append((name, grace_seconds))


def launch(attempt: int = 0, rollout: str = "r1") -> Launch:
    return Launch("run", rollout, attempt, "t1", {"id": "t1"}, 0, 60.0)


class ListView:
    """A ``PodView`` over a list the test edits, standing in for the informer (tests/test_operator_pod_informer.py
    checks the informer's own view)."""

    def __init__(self, pods: list[PodSummary]) -> None:
        self.items = pods

    def pods(self) -> list[PodSummary]:
        return list(self.items)

    def get(self, key: tuple[str, int]) -> PodSummary | None:
        return next((pod for pod in self.items if pod.key == key), None)


def backend(api: RecordingApi, pods: list[PodSummary], clock: list[float] | None = None) -> PodBackend:
    clock = clock if clock is not None else [0.0]
    return PodBackend(
        "ns",
        lambda item: {"metadata": {"name": f"{item.rollout_id}-a{item.attempt}"}},
        api,
        ListView(pods),
        pods_per_second=4,
        clock=lambda: clock[0],
    )


def test_exits_map_pod_outcomes_and_released_pods_stay_quiet_until_gone() -> None:
    api, pods = RecordingApi(), []
    b = backend(api, pods)
    pods += [
        summarize_pod(pod("Succeeded", harness={"terminated": {"exitCode": 0}}, attempt=0)),
        summarize_pod(pod("Failed", harness={"terminated": {"exitCode": 2, "reason": "Error"}}, attempt=1)),
        summarize_pod(pod("Running", harness={"running": {}}, attempt=2)),
    ]
    assert b.alive() == {("r1", 2)}
    assert b.exits() == [HarnessExit("r1", 0, 0, None), HarnessExit("r1", 1, 2, "Error")]
    b.release("r1", 0)
    assert api.deleted == [("r1-a0", 0)]
    assert [e.attempt for e in b.exits()] == [1]  # the deletion has not reached the watch yet
    b.pod_deleted(pods.pop(0))  # the watch saw it go: nothing is remembered for it any more
    assert b.gone == {} and not b._released


def test_a_pod_deleted_before_it_ended_is_an_exit_without_code() -> None:
    api, pods = RecordingApi(), []
    b = backend(api, pods)
    running = summarize_pod(pod("Running", harness={"running": {}}))
    b.pod_deleted(running)
    assert b.exits() == [
        HarnessExit("r1", 0, None, "PodDeleted: the pod was deleted before the harness ended")
    ]
    b.release("r1", 0)
    assert b.exits() == []


def test_an_evicted_pod_names_the_eviction() -> None:
    """The API server marks a pod it evicts (or preempts) with a DisruptionTarget condition before deleting
    it: the attempt's reason says so, so a user tells an eviction from a deletion by hand."""
    api, pods = RecordingApi(), []
    b = backend(api, pods)
    body = pod("Running", harness={"running": {}})
    body["status"]["conditions"] = [
        {"type": "Ready", "status": "True"},
        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
         "message": "Eviction API: evicting"},
    ]
    evicted = HarnessExit("r1", 0, None, "PodDeleted: the pod was deleted before the harness ended "
                                         "(EvictionByEvictionAPI: Eviction API: evicting)")
    b.pod_deleted(summarize_pod(body))
    assert b.exits() == [evicted]

    # While the evicted pod is still terminating (its grace period: the proxy's flush, a harness that ignores
    # SIGTERM), its attempt has ended already, not at its timeout; the operator does not delete it again.
    api, pods = RecordingApi(), []
    b = backend(api, pods)
    body["metadata"]["deletionTimestamp"] = "2026-12-05T12:00:00Z"
    pods.append(summarize_pod(body))
    assert b.alive() == set() and b.exits() == [evicted]
    b.release("r1", 0)
    assert b.exits() == [] and api.deleted == []
    body["status"]["conditions"] = [{"type": "Ready", "status": "True"}]  # deleted by hand: its end is awaited
    pods[0] = summarize_pod(body)
    b = backend(api, pods)
    assert b.exits() == []


def test_creation_is_rate_bounded_and_suspend_stops_it() -> None:
    api, clock = RecordingApi(), [0.0]
    b = backend(api, [], clock)
    assert b.launch_budget() == 4
    for attempt in range(4):
        b.launch(launch(attempt))
    assert b.launch_budget() == 0
    clock[0] = 0.5
    assert b.launch_budget() == 2
    clock[0] = 10.0
    assert b.launch_budget() == 4  # the bucket holds at most one second of tokens
    b.suspended = True
    assert b.launch_budget() == 0
    assert len(api.created) == 4


def test_a_refused_pod_fails_its_attempt_with_the_reason() -> None:
    refusal = ApiException(status=403, reason="Forbidden")
    refusal.body = 'pods "r1-a0" is forbidden: exceeded quota'
    b = backend(RecordingApi(refuse=refusal), [])
    b.launch(launch())
    [ended] = b.exits()
    assert ended.exit_code is None and ended.detail.startswith("PodRejected: Forbidden: ")
    assert "exceeded quota" in ended.detail


class MeetingApi(RecordingApi):
    """Each create waits until ``parties`` creates are in flight at once: only concurrent calls get through."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.meeting = threading.Barrier(parties, timeout=60)

    def create(self, namespace: str, pod: dict[str, Any]) -> None:
        self.meeting.wait()
        super().create(namespace, pod)


def test_a_pass_creates_its_pods_concurrently_and_waits_for_all_of_them() -> None:
    api = MeetingApi(parties=4)
    b = backend(api, [])
    with b.parallel_calls():
        for attempt in range(4):
            b.launch(launch(attempt))
    # One create after the other would have broken the barrier (each refused after 60 s); leaving the block
    # waited for all four.
    assert sorted(pod["metadata"]["name"] for pod in api.created) == [f"r1-a{i}" for i in range(4)]
    assert b.exits() == []


class FailingDeleteApi(RecordingApi):
    def delete(self, namespace: str, name: str, grace_seconds: int) -> None:
        if name == "r1-a0":
            raise ApiException(status=500, reason="Internal Server Error")
        super().delete(namespace, name, grace_seconds)


def test_a_failed_call_of_the_pass_is_raised_after_the_others_finished() -> None:
    api, pods = FailingDeleteApi(), []
    b = backend(api, pods)
    pods += [summarize_pod(pod("Running", harness={"running": {}}, attempt=attempt)) for attempt in range(3)]
    with pytest.raises(ApiException, match="Internal Server Error"), b.parallel_calls():
        for attempt in range(3):
            b.stop("r1", attempt, "Timeout")
        with b.parallel_calls():  # nested, as when a pass stops the run: the outer block still waits
            b.launch(launch(9))
    assert sorted(api.deleted) == [("r1-a1", 10), ("r1-a2", 10)]
    assert [p["metadata"]["name"] for p in api.created] == ["r1-a9"]


def test_a_released_pod_whose_delete_failed_is_reported_and_released_again() -> None:
    """Deleting an ended pod is not waited for; a failure hands the pod back to the next pass."""
    api, pods = FailingDeleteApi(), []
    b = backend(api, pods)
    pods += [
        summarize_pod(pod("Succeeded", harness={"terminated": {"exitCode": 0}}, attempt=attempt))
        for attempt in range(2)
    ]
    with b.parallel_calls():
        for ended in b.exits():
            b.release(ended.rollout_id, ended.attempt)
    deadline = time.monotonic() + 60
    while (not api.deleted or ("r1", 0) in b._released) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert api.deleted == [("r1-a1", 0)]
    assert [(e.rollout_id, e.attempt, e.exit_code) for e in b.exits()] == [("r1", 0, 0)]  # back for a retry
