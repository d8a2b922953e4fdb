"""`harnessrl run` with ``spec.evaluation``, end to end on the vowels example (a real vLLM on the CPU, the
capture proxy, harness processes, DeepSpeed), checked through the store: the baseline and the evaluated versions
are reported with their numbers, evaluation rollouts are never in a training step, their calls were sampled with
the evaluation's settings, the evaluation score rises with training, and ``export --version best`` exports an
evaluated version. Bad input is refused in one line naming the field, before anything starts.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select, update
from test_local_run_errors import ROOT, model, run, write_spec  # noqa: F401 - model is a fixture

from harnessrl.rollout_ids import is_evaluation
from harnessrl.scheduler import evaluation_owed
from harnessrl.store import RolloutState, TraceStore
from harnessrl.store.evaluations import best_version, evaluation_results
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.store.schema import EVALUATION as EVALUATION_KIND
from harnessrl.store.schema import Rollout, RolloutAttempt

STEPS = 8
EVERY = 4
TASKS = [json.loads(line) for line in (ROOT / "examples/vowels/tasks.jsonl").read_text().splitlines()]
HELD_OUT = TASKS[48:56]  # never in the training set (tasks 0-15)
EVAL_SPEC = {"tasks": {"inline": HELD_OUT}, "everySteps": EVERY, "samplesPerTask": 2, "temperature": 0.7,
             "passReward": 0.3}


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TraceStore, subprocess.CompletedProcess]:
    from harnessrl.tiny_model import build_tiny_model

    base = tmp_path_factory.mktemp("evaluated-run")
    model_dir = build_tiny_model(base / "model")
    spec = yaml.safe_load((ROOT / "examples/vowels/trainingrun.yaml").read_text())
    spec["metadata"]["name"] = "evals"
    spec["spec"]["model"]["path"] = str(model_dir)
    harness = spec["spec"]["harness"]
    harness["command"] = ["python", str(ROOT / "examples/vowels/harness.py")]
    harness["tasks"] = {"inline": TASKS[:16]}
    spec["spec"]["learner"]["maxStaleness"] = 0
    spec["spec"]["learner"]["keepCheckpoints"] = 2
    spec["spec"]["learner"]["algorithm"]["lr"] = 8.0e-3  # a short run: learn a little faster than the example
    spec["spec"]["evaluation"] = EVAL_SPEC
    (base / "run.yaml").write_text(yaml.safe_dump(spec))
    run_dir = base / "run"
    proc = subprocess.run([sys.executable, "-m", "harnessrl.cli", "run", str(base / "run.yaml"), "--run-dir",
                           str(run_dir), "--steps", str(STEPS), "--no-live"], capture_output=True, text=True,
                          timeout=2400, check=False)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, f"harnessrl run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    store = TraceStore.connect(f"sqlite:///{run_dir / 'trace.sqlite'}")
    yield run_dir, store, proc
    store.close()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)  # the run's fixture: vLLM on a shared CPU, 8 steps and three evaluation rounds
def test_baseline_and_evaluated_versions_are_reported(evaluated_run) -> None:
    run_dir, store, proc = evaluated_run
    results = evaluation_results(store, "evals")
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


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)  # the run's fixture: vLLM on a shared CPU, 8 steps and three evaluation rounds
def test_evaluation_rollouts_are_never_trained_on_and_sampled_as_evaluations(evaluated_run) -> None:
    _, store, _ = evaluated_run
    with store.engine.connect() as conn:
        kinds = dict(conn.execute(select(Rollout.rollout_id, Rollout.kind).where(Rollout.run == "evals")).all())
    attempts = store.list_attempts("evals")
    evaluation = [a for a in attempts if kinds[a.rollout_id] == EVALUATION_KIND]
    assert evaluation and all(is_evaluation(a.rollout_id) for a in evaluation)
    assert all(a.consumed_by_step is None for a in evaluation)  # never in a training step
    consumed = [a for a in attempts if a.consumed_by_step is not None]
    assert consumed and all(kinds[a.rollout_id] == "train" for a in consumed)
    for attempt, temperature in ((evaluation[0], 0.7), (consumed[0], 1.0)):
        calls = store.read_calls(attempt.rollout_id, attempt.attempt)
        assert calls and all(c.sampling["temperature"] == temperature for c in calls), attempt.rollout_id


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)  # the run's fixture: vLLM on a shared CPU, 8 steps and three evaluation rounds
def test_the_evaluation_score_rises_with_training(evaluated_run) -> None:
    _, store, _ = evaluated_run
    results = evaluation_results(store, "evals")
    baseline, last = results[0], results[-1]
    rewards = _evaluation_rewards(store, baseline.version)
    n = len(rewards)
    spread = math.sqrt(sum((r - baseline.reward_mean) ** 2 for r in rewards) / n)
    noise = 2 * spread / math.sqrt(n)
    print(f"evaluation: v0 {baseline.reward_mean:.3f} ± {spread:.3f} (n={n}); "
          + ", ".join(f"v{r.version} {r.reward_mean:.3f} pass {r.pass_rate:.2f}" for r in results))
    assert last.reward_mean > baseline.reward_mean + noise


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)  # the run's fixture: vLLM on a shared CPU, 8 steps and three evaluation rounds
def test_export_best_writes_the_best_evaluated_version(evaluated_run, tmp_path: Path) -> None:
    run_dir, store, _ = evaluated_run
    results = evaluation_results(store, "evals")
    on_disk = {v.version for v in _versions(store) if v.version == 0 or Path(v.checkpoint_path).is_dir()}
    best = best_version(results, on_disk)
    assert best is not None and best in {r.version for r in results}
    proc = subprocess.run([sys.executable, "-m", "harnessrl.cli", "export", str(run_dir), "--version", "best",
                           "--output", str(tmp_path / "best")], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    assert f"exported version {best} " in proc.stdout and (tmp_path / "best" / "config.json").is_file()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_final_evaluation_cut_short_is_finished_when_run_again(evaluated_run) -> None:
    """Two rollouts of the final round as a stop during it leaves them (cancelled, no reward): the same command
    run again starts vLLM on the final version, runs them again and ends, with no learner and no training."""
    run_dir, store, _ = evaluated_run
    final = max(v.version for v in _versions(store))
    with store.engine.begin() as conn:
        cut = sorted(conn.scalars(select(Rollout.rollout_id).where(Rollout.run == "evals",
                                                                    Rollout.evaluated_version == final)))[:2]
        conn.execute(update(RolloutAttempt).where(RolloutAttempt.rollout_id.in_(cut)).values(
            state=RolloutState.CANCELLED.value, reward=None, reason="Cancelled: the run is stopping"))
    assert evaluation_owed(store, "evals", final)
    training = [a for a in store.list_attempts("evals") if not is_evaluation(a.rollout_id)]
    proc = subprocess.run([sys.executable, "-m", "harnessrl.cli", "run", str(run_dir.parent / "run.yaml"),
                           "--run-dir", str(run_dir), "--steps", str(STEPS), "--no-live"], capture_output=True,
                          text=True, timeout=1200, check=False)
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not its final evaluation" in proc.stdout and "already finished" not in proc.stdout
    assert not evaluation_owed(store, "evals", final)
    latest = {a.rollout_id: a for a in sorted(store.list_attempts("evals"), key=lambda a: a.attempt)
              if a.rollout_id in cut}
    assert [(a.attempt, a.state) for a in latest.values()] == [(1, RolloutState.SUCCEEDED)] * 2
    assert [a for a in store.list_attempts("evals") if not is_evaluation(a.rollout_id)] == training
    assert LearnerLedger(store, "evals").committed_step() == STEPS


def _versions(store: TraceStore):
    return LearnerLedger(store, "evals").versions()


def _evaluation_rewards(store: TraceStore, version: int) -> list[float]:
    with store.engine.connect() as conn:
        ids = set(conn.scalars(select(Rollout.rollout_id).where(Rollout.run == "evals",
                                                                 Rollout.evaluated_version == version)))
    return [a.reward for a in store.list_attempts("evals", states=(RolloutState.SUCCEEDED,))
            if a.rollout_id in ids and a.reward is not None]

EVALUATION = {"tasks": {"file": {"path": "held-out.jsonl"}}, "everySteps": 2}


def test_a_missing_evaluation_task_file_is_named(tmp_path: Path, model: Path) -> None:  # noqa: F811
    shutil.copy(ROOT / "examples/vowels/tasks.jsonl", tmp_path / "tasks.jsonl")  # the training tasks exist
    proc = run(write_spec(tmp_path, model={"path": str(model)}, evaluation=EVALUATION))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"spec.evaluation.tasks.file.path: cannot read {tmp_path / 'held-out.jsonl'}" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_zero_samples_per_task_is_named(tmp_path: Path, model: Path) -> None:  # noqa: F811
    proc = run(write_spec(tmp_path, model={"path": str(model)}, evaluation={**EVALUATION, "samplesPerTask": 0}))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "spec.evaluation.samplesPerTask" in proc.stderr and "at least 1" in proc.stderr
