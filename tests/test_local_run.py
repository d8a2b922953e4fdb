"""End to end: `harnessrl run` with a real vLLM CPU server, the capture proxy, harness processes and DeepSpeed.

One run of the real CLI on the tiny model, with ``spec.evaluation``, stopped by Ctrl-C and resumed, checked
entirely through what it left in the store: every call is captured token-exactly, multi-turn calls merge into
one row, the policy version advances and the serving engine's log-probs agree with the learner's on the tokens
its current weights produced (which only holds if vLLM really serves each new checkpoint), the reward rises
beyond step 1's spread, and harnesses that crash, hang or report no reward become failed / timed-out rollouts
the learner does not train on while the run goes on. Evaluation: the baseline and the evaluated versions are
reported with their numbers, evaluation rollouts are never in a training step, their calls were sampled with
the evaluation's settings, the evaluation score rises with training, ``export --version best`` exports an
evaluated version, and a final evaluation cut short is finished when the command runs again.

One run for all of it, since each `harnessrl run` starts vLLM and DeepSpeed (minutes on 2 shared cores).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from sqlalchemy.exc import OperationalError

from sqlalchemy import select, update

from harnessrl.local.report import summarize
from harnessrl.rollout_ids import is_evaluation
from harnessrl.scheduler import evaluation_owed
from harnessrl.store import CallStatus, RolloutState, TraceStore
from harnessrl.store.evaluations import best_version, evaluation_results
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.store.schema import EVALUATION as EVALUATION_KIND
from harnessrl.store.schema import Rollout, RolloutAttempt
from harnessrl.trainer.rows import merge_calls_into_rows

# The run's fixture: vLLM on a shared CPU, 10 steps, four evaluation rounds, a stop and a resume.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
INTERRUPT_AT = 3
EVERY = 4
TASKS = [json.loads(line) for line in (ROOT / "examples/vowels/tasks.jsonl").read_text().splitlines()]
HELD_OUT = TASKS[48:56]  # never in the training set (tasks 0-11)
EVAL_SPEC = {"tasks": {"inline": HELD_OUT}, "everySteps": EVERY, "samplesPerTask": 2, "temperature": 0.7,
             "passReward": 0.3}


@pytest.fixture(scope="module")
def finished_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, TraceStore, subprocess.CompletedProcess]]:
    from harnessrl.tiny_model import build_tiny_model

    base = tmp_path_factory.mktemp("local-run")
    model = build_tiny_model(base / "model")
    spec = yaml.safe_load((ROOT / "examples/vowels/trainingrun.yaml").read_text())
    spec["metadata"]["name"] = "e2e"
    spec["spec"]["model"]["path"] = str(model)
    harness = spec["spec"]["harness"]
    harness["command"] = ["python", str(ROOT / "tests/harnesses/chaos_harness.py")]
    tasks = TASKS[:12] + [{"id": f"chaos-{b}", "data": {"behaviour": b}} for b in ("crash", "hang", "noreward")]
    harness["tasks"] = {"inline": tasks}
    harness["timeoutSeconds"] = 45
    spec["spec"]["learner"]["maxStaleness"] = 0
    spec["spec"]["learner"]["keepCheckpoints"] = 2
    spec["spec"]["learner"]["algorithm"]["lr"] = 8.0e-3  # a short run: learn a little faster than the example
    spec["spec"]["evaluation"] = EVAL_SPEC
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
    yield run_dir, store, second
    store.close()


def _trained_steps(store: TraceStore) -> list[dict]:
    ledger = LearnerLedger(store, "e2e")
    return [ledger.step_metrics(step) for step in range(1, STEPS + 1)]


def test_every_call_is_captured_token_exactly(finished_run) -> None:
    _, store, _ = finished_run
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
    _, store, _ = finished_run
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
    _, store, _ = finished_run
    for metrics in _trained_steps(store):
        if metrics["trained_rollouts"]:
            assert metrics["rows_per_rollout"] == 1.0, metrics
            assert metrics["merged_calls"] >= metrics["trained_rollouts"], metrics


def test_bad_harnesses_fail_and_are_not_trained_on(finished_run) -> None:
    _, store, _ = finished_run
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
    _, store, _ = finished_run
    ledger = LearnerLedger(store, "e2e")
    steps = _trained_steps(store)
    marked = [ledger.consumed_by(step) for step in range(1, STEPS + 1)]
    assert all(marked)  # every step consumed something
    assert [int(m["rollouts"]) for m in steps] == [len(keys) for keys in marked]
    consumed = {key for keys in marked for key in keys}
    from_store = sum(merge_calls_into_rows(store.rollout_calls(*key)).stats.generated_tokens for key in consumed)
    assert sum(int(m["generated_tokens"]) for m in steps) == from_store > 0


def test_reward_rises_beyond_the_first_steps_spread(finished_run) -> None:
    run_dir, store, _ = finished_run
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


def test_baseline_and_evaluated_versions_are_reported(finished_run) -> None:
    run_dir, store, proc = finished_run
    results = evaluation_results(store, "e2e")
    versions = [r.version for r in results]
    final = max(v.version for v in _versions(store))
    # the baseline, the versions served at multiples of everySteps, and the final version
    assert versions[0] == 0 and versions[-1] == final and versions == sorted(set(versions))
    assert final >= EVERY and len(versions) >= 3
    for result in results:
        assert result.complete and result.rollouts == len(HELD_OUT) * 2 and result.k == 2
        assert result.pass_at_k is not None and result.failed + result.timed_out == 0
    status = subprocess.run([sys.executable, "-m", "harnessrl.cli", "status", str(run_dir)], capture_output=True,
                            text=True, timeout=300, check=False)
    assert status.returncode == 0, status.stderr
    for text in (status.stdout, proc.stdout):
        header = next(line for line in text.splitlines() if "v0" in line and f"v{final}" in line)
        assert all(f"v{v}" in header for v in versions), header
        assert "pass@2" in text
    assert (run_dir / "reward.png").read_bytes()[:4] == b"\x89PNG"


def test_evaluation_rollouts_are_never_trained_on_and_sampled_as_evaluations(finished_run) -> None:
    _, store, _ = finished_run
    with store.engine.connect() as conn:
        kinds = dict(conn.execute(select(Rollout.rollout_id, Rollout.kind).where(Rollout.run == "e2e")).all())
    attempts = store.list_attempts("e2e")
    evaluation = [a for a in attempts if kinds[a.rollout_id] == EVALUATION_KIND]
    assert evaluation and all(is_evaluation(a.rollout_id) for a in evaluation)
    assert all(a.consumed_by_step is None for a in evaluation)  # never in a training step
    consumed = [a for a in attempts if a.consumed_by_step is not None]
    assert consumed and all(kinds[a.rollout_id] == "train" for a in consumed)
    for attempt, temperature in ((evaluation[0], 0.7), (consumed[0], 1.0)):
        calls = store.read_calls(attempt.rollout_id, attempt.attempt)
        assert calls and all(c.sampling["temperature"] == temperature for c in calls), attempt.rollout_id


def test_the_evaluation_score_rises_with_training(finished_run) -> None:
    _, store, _ = finished_run
    results = evaluation_results(store, "e2e")
    baseline, last = results[0], results[-1]
    rewards = _evaluation_rewards(store, baseline.version)
    n = len(rewards)
    spread = math.sqrt(sum((r - baseline.reward_mean) ** 2 for r in rewards) / n)
    noise = 2 * spread / math.sqrt(n)
    print(f"evaluation: v0 {baseline.reward_mean:.3f} ± {spread:.3f} (n={n}); "
          + ", ".join(f"v{r.version} {r.reward_mean:.3f} pass {r.pass_rate:.2f}" for r in results))
    assert last.reward_mean > baseline.reward_mean + noise


def test_export_best_writes_the_best_evaluated_version(finished_run, tmp_path: Path) -> None:
    run_dir, store, _ = finished_run
    results = evaluation_results(store, "e2e")
    on_disk = {v.version for v in _versions(store) if v.version == 0 or Path(v.checkpoint_path).is_dir()}
    best = best_version(results, on_disk)
    assert best is not None and best in {r.version for r in results}
    proc = subprocess.run([sys.executable, "-m", "harnessrl.cli", "export", str(run_dir), "--version", "best",
                           "--output", str(tmp_path / "best")], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    assert f"exported version {best} " in proc.stdout and (tmp_path / "best" / "config.json").is_file()


def test_a_final_evaluation_cut_short_is_finished_when_run_again(finished_run) -> None:
    """Two rollouts of the final round as a stop during it leaves them (cancelled, no reward): the same command
    run again starts vLLM on the final version, runs them again and ends, with no learner and no training."""
    run_dir, store, _ = finished_run
    final = max(v.version for v in _versions(store))
    with store.engine.begin() as conn:
        cut = sorted(conn.scalars(select(Rollout.rollout_id).where(Rollout.run == "e2e",
                                                                    Rollout.evaluated_version == final)))[:2]
        conn.execute(update(RolloutAttempt).where(RolloutAttempt.rollout_id.in_(cut)).values(
            state=RolloutState.CANCELLED.value, reward=None, reason="Cancelled: the run is stopping"))
    assert evaluation_owed(store, "e2e", final)
    training = [a for a in store.list_attempts("e2e") if not is_evaluation(a.rollout_id)]
    proc = subprocess.run([sys.executable, "-m", "harnessrl.cli", "run", str(run_dir.parent / "run.yaml"),
                           "--run-dir", str(run_dir), "--steps", str(STEPS), "--no-live"], capture_output=True,
                          text=True, timeout=1200, check=False)
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not its final evaluation" in proc.stdout and "already finished" not in proc.stdout
    assert not evaluation_owed(store, "e2e", final)
    latest = {a.rollout_id: a for a in sorted(store.list_attempts("e2e"), key=lambda a: a.attempt)
              if a.rollout_id in cut}
    assert [(a.attempt, a.state) for a in latest.values()] == [(1, RolloutState.SUCCEEDED)] * 2
    assert [a for a in store.list_attempts("e2e") if not is_evaluation(a.rollout_id)] == training
    assert LearnerLedger(store, "e2e").committed_step() == STEPS


def _versions(store: TraceStore):
    return LearnerLedger(store, "e2e").versions()


def _evaluation_rewards(store: TraceStore, version: int) -> list[float]:
    with store.engine.connect() as conn:
        ids = set(conn.scalars(select(Rollout.rollout_id).where(Rollout.run == "e2e",
                                                                 Rollout.evaluated_version == version)))
    return [a.reward for a in store.list_attempts("e2e", states=(RolloutState.SUCCEEDED,))
            if a.rollout_id in ids and a.reward is not None]
