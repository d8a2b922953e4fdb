"""End to end: `harnessrl run` with a real vLLM CPU server, the capture proxy, harness processes and DeepSpeed.

One run of the real CLI on the tiny model, checked entirely through what it left in the store: every call is
captured token-exactly, multi-turn calls merge into one row, the policy version advances and the serving
engine's log-probs agree with the learner's on the tokens its current weights produced (which only holds if
vLLM really serves each new checkpoint), the reward rises beyond step 1's spread, and harnesses that crash,
hang or report no reward become failed / timed-out rollouts the learner does not train on while the run goes on.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from sqlalchemy.exc import OperationalError

from harnessrl.local.report import summarize
from harnessrl.store import CallStatus, RolloutState, TraceStore
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.trainer.rows import merge_calls_into_rows

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
INTERRUPT_AT = 3


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TraceStore]:
    from harnessrl.tiny_model import build_tiny_model

    base = tmp_path_factory.mktemp("local-run")
    model = build_tiny_model(base / "model")
    spec = yaml.safe_load((ROOT / "examples/vowels/trainingrun.yaml").read_text())
    spec["metadata"]["name"] = "e2e"
    spec["spec"]["model"]["path"] = str(model)
    harness = spec["spec"]["harness"]
    harness["command"] = ["python", str(ROOT / "tests/harnesses/chaos_harness.py")]
    tasks = [json.loads(line) for line in (ROOT / "examples/vowels/tasks.jsonl").read_text().splitlines()[:12]]
    tasks += [{"id": f"chaos-{b}", "data": {"behaviour": b}} for b in ("crash", "hang", "noreward")]
    harness["tasks"] = {"inline": tasks}
    harness["timeoutSeconds"] = 45
    spec["spec"]["learner"]["maxStaleness"] = 0
    spec["spec"]["learner"]["algorithm"]["lr"] = 8.0e-3  # a short run: learn a little faster than the example
    (base / "run.yaml").write_text(yaml.safe_dump(spec))
    run_dir = base / "run"
    command = [sys.executable, "-m", "harnessrl.cli", "run", str(base / "run.yaml"), "--run-dir", str(run_dir),
               "--steps", str(STEPS), "--no-live"]
    db = f"sqlite:///{run_dir / 'trace.sqlite'}"

    # First invocation: Ctrl-C (SIGINT) once a few versions are committed — it must stop cleanly.
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline and first.poll() is None:
            if (run_dir / "trace.sqlite").exists():
                with TraceStore.connect(db) as peek:
                    try:
                        if LearnerLedger(peek, "e2e").committed_version() >= INTERRUPT_AT:
                            break
                    except OperationalError:  # the file exists before the run has created its tables
                        pass
            time.sleep(2)
        first.send_signal(signal.SIGINT)
        out, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, out[-3000:]
    assert "run the same command to resume" in out
    with TraceStore.connect(db) as peek:
        interrupted_at = LearnerLedger(peek, "e2e").committed_version()
        assert INTERRUPT_AT <= interrupted_at < STEPS
        assert peek.count_attempts("e2e")[RolloutState.RUNNING] == 0  # nothing left dangling

    # Second invocation: the same command resumes from the last committed version and finishes.
    second = subprocess.run(command, capture_output=True, text=True, timeout=1500)
    print(second.stdout[-4000:], second.stderr[-4000:])
    assert second.returncode == 0, f"harnessrl run failed:\n{second.stdout[-3000:]}\n{second.stderr[-3000:]}"
    assert f"serving v{interrupted_at}" in second.stdout
    store = TraceStore.connect(db)
    yield run_dir, store
    store.close()


def _trained_steps(store: TraceStore) -> list[dict]:
    ledger = LearnerLedger(store, "e2e")
    return [ledger.step_metrics(step) for step in range(1, STEPS + 1)]


def test_every_call_is_captured_token_exactly(finished_run) -> None:
    _, store = finished_run
    succeeded = 0
    for attempt in store.list_attempts("e2e"):
        calls = store.read_calls(attempt.rollout_id, attempt.attempt)
        for call in calls:
            if call.status is not CallStatus.OK:
                continue
            assert call.prompt_token_ids and call.completion_token_ids
            assert len(call.logprobs) == len(call.completion_token_ids)
            assert all(lp <= 0.0 and math.isfinite(lp) for lp in call.logprobs)
            assert 0 <= call.policy_version <= STEPS
        if attempt.state is RolloutState.SUCCEEDED:
            succeeded += 1
            # the example harness makes two calls; both were captured, in order, as OK calls
            assert [c.seq for c in calls] == [0, 1] and all(c.status is CallStatus.OK for c in calls)
    assert succeeded >= STEPS * 4


def test_versions_advance_and_vllm_serves_each_new_checkpoint(finished_run) -> None:
    _, store = finished_run
    versions = LearnerLedger(store, "e2e").versions()
    empty = sum(m["empty_step"] for m in _trained_steps(store))  # a step that trains nothing makes no version
    assert [v.version for v in versions] == list(range(STEPS - empty + 1))
    assert all(v.synced for v in versions)
    served = {call.policy_version for a in store.list_attempts("e2e") for call in store.read_calls(a.rollout_id, a.attempt)}
    assert len(served) >= STEPS - 2 and max(served) >= STEPS - 1  # calls went to the new versions as they came
    # With maxStaleness 0 every token a step trains on was served by the weights the learner holds; their
    # log-probs agree only if vLLM really loaded each synced checkpoint.
    trained = [m for m in _trained_steps(store) if m["trained_rollouts"]]
    assert len(trained) >= STEPS - 2
    for metrics in trained:
        assert metrics["logprob_tokens"] == metrics["trained_target_tokens"], metrics
        assert metrics["logprob_pearson"] > 0.99, metrics
        assert metrics["logprob_abs_diff"] < 0.05, metrics


def test_multi_turn_calls_merge_into_rows(finished_run) -> None:
    _, store = finished_run
    for metrics in _trained_steps(store):
        if metrics["trained_rollouts"]:
            assert metrics["rows_per_rollout"] == 1.0, metrics
            assert metrics["merged_calls"] >= metrics["trained_rollouts"], metrics


def test_bad_harnesses_fail_and_are_not_trained_on(finished_run) -> None:
    _, store = finished_run
    attempts = store.list_attempts("e2e")
    by_task: dict[str, list] = {}
    for attempt in attempts:
        by_task.setdefault(attempt.task_id, []).append(attempt)
    for task, state, reason in (("chaos-crash", RolloutState.FAILED, "HarnessFailed: exit code 3"),
                                ("chaos-hang", RolloutState.TIMED_OUT, "Timeout"),
                                ("chaos-noreward", RolloutState.FAILED, "NoReward")):
        ended = [a for a in by_task.get(task, []) if a.state.terminal and a.state is not RolloutState.CANCELLED]
        assert ended, f"{task} never ran"
        assert all(a.state is state and a.reason.startswith(reason) for a in ended), ended
    steps = _trained_steps(store)
    excluded = sum(m.get("excluded_failed", 0) + m.get("excluded_timed_out", 0) for m in steps)
    assert excluded >= 1  # some step claimed a bad group and left it out
    assert LearnerLedger(store, "e2e").committed_step() == STEPS  # the run went on


def test_resume_never_trains_on_a_rollout_twice(finished_run) -> None:
    """The store marks each attempt with one consuming step, so its marks alone cannot show a rollout trained
    twice; what each committed step recorded it built rows from can. Counted per step against the marks, and
    in generated tokens against the calls of the distinct consumed attempts (rebuilt here from the store), a
    rollout that two steps (say, one before the interruption and its redo after) built rows from would be
    counted twice on the learner's side and once on the store's."""
    _, store = finished_run
    ledger = LearnerLedger(store, "e2e")
    steps = _trained_steps(store)
    marked = [ledger.consumed_by(step) for step in range(1, STEPS + 1)]
    assert all(marked)  # every step consumed something
    assert [int(m["rollouts"]) for m in steps] == [len(keys) for keys in marked]
    consumed = {key for keys in marked for key in keys}
    from_store = sum(merge_calls_into_rows(store.rollout_calls(*key)).stats.generated_tokens for key in consumed)
    assert sum(int(m["generated_tokens"]) for m in steps) == from_store > 0


def test_reward_rises_beyond_the_first_steps_spread(finished_run) -> None:
    run_dir, store = finished_run
    summary = summarize(store, "e2e")
    first, last = summary.steps[0], summary.steps[-2:]
    late = [s.reward_mean for s in last if s.reward_mean is not None]
    n = first.succeeded
    assert n >= 4 and late
    noise = 2 * first.reward_std / math.sqrt(n)
    print(f"reward: step 1 {first.reward_mean:.3f} ± {first.reward_std:.3f} (n={n}); "
          f"last steps {[round(x, 3) for x in late]}")
    assert sum(late) / len(late) > first.reward_mean + noise
    assert (run_dir / "reward.png").read_bytes()[:4] == b"\x89PNG"
