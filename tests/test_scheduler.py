"""The rollout scheduler against real harness processes and a real store (SQLite and PostgreSQL).

The harness here is a real Python process started by the local ``ProcessBackend``. It reads its task from the
pod/process contract and behaves as the task says (report a reward, crash, hang, forget the reward), writing
its reward straight to the store — the proxy's reward endpoint is tested with the proxy.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harnessrl.local.processes import ProcessBackend
from harnessrl.rollout_ids import group_of
from harnessrl.scheduler import RolloutScheduler, SchedulerSettings
from harnessrl.store import RolloutState, TraceStore
from harnessrl.store import attempt_budget
from harnessrl.store.attempt_budget import INFRASTRUCTURE
from harnessrl.store.learner_ledger import LearnerLedger

HARNESS = r'''
import json, os, sys, time
from harnessrl.store import TraceStore
task = json.load(open(os.environ["HARNESSRL_TASK_FILE"]))
assert json.loads(os.environ["HARNESSRL_TASK"]) == task
rollout, attempt = os.environ["HARNESSRL_ROLLOUT_ID"], int(os.environ["HARNESSRL_ATTEMPT"])
with open(os.environ["TRACE_FILE"], "a") as fh:
    fh.write(f"{rollout} {attempt} start {time.time()}\n")
time.sleep(task.get("sleep", 0))
behaviour = task["behaviour"]
if behaviour == "hang":
    time.sleep(3600)
if behaviour == "crash":
    print("harness blew up", file=sys.stderr)
    sys.exit(3)
if behaviour == "upstream_down":  # what the proxy records when vLLM is away; the harness then gives up
    store = TraceStore.connect(os.environ["STORE_URL"])
    store.mark_upstream_failed(rollout, attempt)
    store.close()
    sys.exit(1)
if behaviour == "ok":
    store = TraceStore.connect(os.environ["STORE_URL"])
    store.set_reward(rollout, attempt, float(task["reward"]))
    store.close()
with open(os.environ["TRACE_FILE"], "a") as fh:
    fh.write(f"{rollout} {attempt} end {time.time()}\n")
'''


@pytest.fixture
def harness(tmp_path: Path) -> Path:
    path = tmp_path / "harness.py"
    path.write_text(HARNESS)
    return path


def make(store: TraceStore, store_url: str, harness: Path, tmp_path: Path, tasks: list[dict], **overrides):
    settings = SchedulerSettings(**{
        "run": "sched", "group_size": 2, "concurrency": 4, "timeout_s": 60.0, "tasks_per_step": 2,
        "max_staleness": 0, "lost_grace_s": 0.0, **overrides,
    })
    backend = ProcessBackend(
        [sys.executable, str(harness)], tmp_path / "work",
        env={"STORE_URL": store_url, "TRACE_FILE": str(tmp_path / "trace.txt")}, kill_grace_s=2.0,
    )
    return RolloutScheduler(store, settings, backend, tasks), backend


def run_until(scheduler: RolloutScheduler, done: Callable[[], bool], *, each=None, max_rounds: int = 2000) -> None:
    """Reconcile until ``done`` (bounded: a stuck scheduler fails the test instead of hanging it)."""
    for _ in range(max_rounds):
        status = scheduler.reconcile(policy_version=0)
        if each is not None:
            each(status)
        if done():
            return
        time.sleep(0.02)
    raise AssertionError("the scheduler did not reach the expected state")


def active(store: TraceStore, run: str = "sched") -> int:
    counts = store.count_attempts(run)
    return counts[RolloutState.QUEUED] + counts[RolloutState.RUNNING]


def test_outcomes_follow_the_harness(store: TraceStore, store_url: str, harness: Path, tmp_path: Path) -> None:
    tasks = [
        {"id": "ok", "behaviour": "ok", "reward": 0.5},
        {"id": "crash", "behaviour": "crash"},
        {"id": "noreward", "behaviour": "noreward"},
        {"id": "hang", "behaviour": "hang"},
    ]
    # 30 s: an "ok" harness (a Python start) must finish inside it even on a loaded 2-core machine; 8 s did not
    scheduler, backend = make(store, store_url, harness, tmp_path, tasks, tasks_per_step=4, timeout_s=30.0)
    run_until(scheduler, lambda: store.count_attempts("sched")[RolloutState.TIMED_OUT] == 2 and active(store) == 0)
    by_task: dict[str, list] = {}
    for attempt in store.list_attempts("sched"):
        by_task.setdefault(attempt.task_id, []).append(attempt)
    assert sorted(by_task) == ["crash", "hang", "noreward", "ok"]
    assert all(len(group) == 2 for group in by_task.values())
    for a in by_task["ok"]:
        assert (a.state, a.reward, a.policy_version_start) == (RolloutState.SUCCEEDED, 0.5, 0)
    for a in by_task["crash"]:
        assert a.state is RolloutState.FAILED and a.reason.startswith("HarnessFailed: exit code 3")
        assert "harness blew up" in backend.log_path(a.rollout_id, a.attempt).read_text()
    for a in by_task["noreward"]:
        assert a.state is RolloutState.FAILED and a.reason.startswith("NoReward") and a.reward is None
    for a in by_task["hang"]:
        assert a.state is RolloutState.TIMED_OUT and "timeoutSeconds=30" in a.reason
    assert backend.alive() == set()  # the hanging harnesses were killed, not left behind


def test_concurrency_is_filled_and_never_exceeded(store: TraceStore, store_url: str, harness: Path,
                                                  tmp_path: Path) -> None:
    tasks = [{"id": f"t{i}", "behaviour": "ok", "reward": 1.0, "sleep": 0.3} for i in range(6)]
    scheduler, backend = make(store, store_url, harness, tmp_path, tasks, concurrency=3, tasks_per_step=6)
    seen: list[int] = []
    run_until(scheduler, lambda: store.count_attempts("sched")[RolloutState.SUCCEEDED] == 12,
              each=lambda _: seen.append(len(backend.alive())))
    assert max(seen) == 3
    # Independently of our sampling: at no instant were more than 3 harnesses between start and end.
    events = []
    for line in (tmp_path / "trace.txt").read_text().splitlines():
        _, _, kind, at = line.split()
        events.append((float(at), 1 if kind == "start" else -1))
    live = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        live += delta
        peak = max(peak, live)
    assert peak <= 3


def test_staleness_bounds_outstanding_groups(store: TraceStore, store_url: str, harness: Path,
                                            tmp_path: Path) -> None:
    tasks = [{"id": f"t{i}", "behaviour": "ok", "reward": float(i)} for i in range(10)]
    scheduler, _ = make(store, store_url, harness, tmp_path, tasks, concurrency=8, tasks_per_step=2,
                        max_staleness=1)
    run_until(scheduler, lambda: active(store) == 0 and store.count_attempts("sched")[RolloutState.SUCCEEDED] > 0)
    for _ in range(5):  # nothing consumed: more reconciles create nothing more
        scheduler.reconcile(policy_version=0)
    attempts = store.list_attempts("sched")
    assert len({group_of(a.rollout_id) for a in attempts}) == 4  # (max_staleness + 1) * tasks_per_step
    assert len(attempts) == 8

    ledger = LearnerLedger(store, "sched")
    claim = ledger.claim(tasks_per_step=2, group_size=2)
    assert claim is not None
    ledger.commit(1, "/ckpt/v1", None, claim.keys)
    run_until(scheduler, lambda: len(store.list_attempts("sched")) == 12 and active(store) == 0)
    groups = {group_of(a.rollout_id) for a in store.list_attempts("sched")}
    assert len(groups) == 6  # exactly the two consumed groups were replaced


def test_retries_until_max_attempts(store: TraceStore, store_url: str, harness: Path, tmp_path: Path) -> None:
    scheduler, _ = make(store, store_url, harness, tmp_path, [{"id": "crash", "behaviour": "crash"}],
                        tasks_per_step=1, max_attempts=3)
    run_until(scheduler, lambda: len(store.list_attempts("sched")) == 6 and active(store) == 0)
    for _ in range(3):
        scheduler.reconcile(policy_version=0)
    attempts = store.list_attempts("sched")
    assert sorted(a.attempt for a in attempts) == [0, 0, 1, 1, 2, 2]
    assert all(a.state is RolloutState.FAILED for a in attempts)


def test_upstream_failures_are_retried_without_using_an_attempt_up_to_the_bound(
    store: TraceStore, store_url: str, harness: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout whose LLM upstream is down on every attempt: its first two failures (the bound, lowered from 10
    to keep the test short) are retried for free, then it gets its maxAttempts=2 harness attempts and fails."""
    monkeypatch.setattr(attempt_budget, "MAX_INFRA_RETRIES", 2)
    scheduler, _ = make(store, store_url, harness, tmp_path, [{"id": "down", "behaviour": "upstream_down"}],
                        group_size=1, tasks_per_step=1, max_attempts=2)
    run_until(scheduler, lambda: len(store.list_attempts("sched")) == 4 and active(store) == 0)
    for _ in range(3):
        scheduler.reconcile(policy_version=0)
    attempts = store.list_attempts("sched")
    assert [(a.attempt, a.infra_retries, a.state) for a in attempts] == [
        (0, 0, RolloutState.FAILED), (1, 1, RolloutState.FAILED), (2, 2, RolloutState.FAILED),
        (3, 2, RolloutState.FAILED),
    ]
    assert all(a.reason == INFRASTRUCTURE + "HarnessFailed: exit code 1" for a in attempts)
    claim = LearnerLedger(store, "sched").claim(tasks_per_step=1, group_size=1, max_attempts=2)
    assert claim is not None and claim.keys == [(attempts[0].rollout_id, 3)]  # its last word, for the learner too


def test_restarted_scheduler_settles_lost_runs_without_duplicates(store: TraceStore, store_url: str,
                                                                  harness: Path, tmp_path: Path) -> None:
    tasks = [{"id": f"t{i}", "behaviour": "hang"} for i in range(3)]
    first, first_backend = make(store, store_url, harness, tmp_path, tasks, tasks_per_step=2)
    run_until(first, lambda: store.count_attempts("sched")[RolloutState.RUNNING] == 4)
    before = {(a.rollout_id, a.attempt) for a in store.list_attempts("sched")}
    first_backend.shutdown()  # the runner died: its processes are gone, the store still says running

    second, second_backend = make(store, store_url, harness, tmp_path, tasks, tasks_per_step=2)
    second.reconcile(policy_version=1)
    attempts = store.list_attempts("sched")
    assert {(a.rollout_id, a.attempt) for a in attempts} == before  # no group created twice
    assert all(a.state is RolloutState.FAILED and a.reason.startswith("Lost") for a in attempts)
    assert second_backend.alive() == set()


def test_stop_all_cancels_and_kills(store: TraceStore, store_url: str, harness: Path, tmp_path: Path) -> None:
    scheduler, backend = make(store, store_url, harness, tmp_path, [{"id": "h", "behaviour": "hang"}],
                              tasks_per_step=1, concurrency=1)
    run_until(scheduler, lambda: store.count_attempts("sched")[RolloutState.RUNNING] == 1)
    assert scheduler.stop_all() == 2  # the running one and its queued group mate
    counts = store.count_attempts("sched")
    assert counts[RolloutState.CANCELLED] == 2 and active(store) == 0
    assert backend.alive() == set()


def test_bad_settings_and_empty_tasks_are_clear_errors(store: TraceStore, harness: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        SchedulerSettings(run="r", group_size=2, concurrency=0, timeout_s=1, tasks_per_step=1, max_staleness=0)
    settings = SchedulerSettings(run="r", group_size=2, concurrency=1, timeout_s=1, tasks_per_step=1, max_staleness=0)
    with pytest.raises(ValueError, match="no tasks"):
        RolloutScheduler(store, settings, ProcessBackend(["true"], tmp_path), [])
    with pytest.raises(ValueError, match="harness.command is empty"):
        ProcessBackend([], tmp_path)


def test_unstartable_command_fails_the_attempt_with_the_reason(store: TraceStore, tmp_path: Path) -> None:
    settings = SchedulerSettings(run="r", group_size=2, concurrency=2, timeout_s=10, tasks_per_step=1,
                                 max_staleness=0)
    backend = ProcessBackend([str(tmp_path / "no-such-harness")], tmp_path / "work")
    scheduler = RolloutScheduler(store, settings, backend, [{"id": "t"}])
    run_until(scheduler, lambda: store.count_attempts("r")[RolloutState.FAILED] == 2)
    reasons = {a.reason for a in store.list_attempts("r")}
    assert len(reasons) == 1 and "cannot start harness" in reasons.pop()


REWARD_THEN_EXIT = r'''
import json, os, urllib.request
task = json.load(open(os.environ["HARNESSRL_TASK_FILE"]))
body = json.dumps({"value": task["reward"]}).encode()
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/reward", data=body,
                                 headers={"Content-Type": "application/json"})
urllib.request.urlopen(request, timeout=60).read()
'''  # and exit 0 at once: nothing between the reward's answer and the exit the scheduler settles on


def test_a_harness_that_exits_right_after_its_reward_is_never_settled_noreward(
    store: TraceStore, store_url: str, tmp_path: Path
) -> None:
    """The reward goes through the real proxy; its writer lingers long (as a busy store would make it) so an
    answer given before the reward is stored loses the race to the scheduler every time."""
    from proxy_servers import LoopThread, RunningProxy, proxy_config

    harness = tmp_path / "reward_then_exit.py"
    harness.write_text(REWARD_THEN_EXIT)
    loops = LoopThread()
    config = proxy_config(["http://127.0.0.1:1"], store_url, tmp_path / "spool.jsonl", rollout_id=None,
                          run="sched", write_linger_s=30.0)
    proxy = RunningProxy(loops, config, store)
    try:
        settings = SchedulerSettings(run="sched", group_size=2, concurrency=4, timeout_s=60.0, tasks_per_step=2,
                                     max_staleness=0, lost_grace_s=0.0)
        backend = ProcessBackend(
            [sys.executable, str(harness)], tmp_path / "work", kill_grace_s=2.0,
            env_for=lambda launch: {
                "OPENAI_BASE_URL": f"{proxy.url}/rollouts/{launch.rollout_id}/attempts/{launch.attempt}/v1"
            },
        )
        scheduler = RolloutScheduler(store, settings, backend, [{"id": "a", "reward": 0.75}, {"id": "b", "reward": -1}])
        run_until(scheduler, lambda: store.count_attempts("sched")[RolloutState.QUEUED] == 0 and active(store) == 0
                  and len(store.list_attempts("sched")) == 4)
    finally:
        proxy.stop()
        loops.close()
    attempts = store.list_attempts("sched")
    assert [(a.state, a.reason) for a in attempts] == [(RolloutState.SUCCEEDED, None)] * 4
    assert sorted(a.reward for a in attempts) == [-1.0, -1.0, 0.75, 0.75]
