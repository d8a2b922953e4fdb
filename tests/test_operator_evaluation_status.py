"""``status.evaluation``: a row per evaluated version and the best complete one, in the shape the CRD's status
schema accepts; absent while nothing was evaluated."""

from __future__ import annotations

from test_operator_status import observed

from harnessrl.operator.status import build_status
from harnessrl.spec.status import TrainingRunStatus
from harnessrl.store.evaluations import EvaluationResult


def result(version: int, ended: int, reward: float | None, pass_rate: float | None, **more) -> EvaluationResult:
    return EvaluationResult(version=version, rollouts=4, ended=ended, succeeded=ended, failed=0, timed_out=0,
                            reward_mean=reward, pass_rate=pass_rate, k=2, pass_at_k=more.get("at_k"), step=version)


def test_status_evaluation_lists_versions_and_the_best() -> None:
    results = [result(0, 4, 0.2, 0.25, at_k=0.5), result(4, 4, 0.6, 0.75, at_k=1.0), result(8, 1, 0.9, 1.0)]
    status = build_status(observed(evaluation=results), None)
    parsed = TrainingRunStatus.model_validate(status)  # the CRD's own status schema accepts it
    assert parsed.evaluation is not None and parsed.evaluation.best_version == 4  # v8's round still runs
    assert status["evaluation"]["versions"] == [
        {"version": 0, "rollouts": 4, "ended": 4, "rewardMean": 0.2, "passRate": 0.25, "passAtK": 0.5, "failed": 0,
         "timedOut": 0},
        {"version": 4, "rollouts": 4, "ended": 4, "rewardMean": 0.6, "passRate": 0.75, "passAtK": 1.0, "failed": 0,
         "timedOut": 0},
        {"version": 8, "rollouts": 4, "ended": 1, "rewardMean": 0.9, "passRate": 1.0, "failed": 0, "timedOut": 0},
    ]


def test_no_evaluation_no_status_field() -> None:
    assert "evaluation" not in build_status(observed(), None)


def test_metrics_follow_the_newest_complete_evaluation() -> None:
    from harnessrl.operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    labels = {"namespace": "ns", "run": "r"}
    metrics.observe_evaluation(("ns", "r"), [result(0, 1, 0.2, 0.25)])  # nothing complete yet
    assert metrics.registry.get_sample_value("harnessrl_operator_evaluation_version", labels) is None
    metrics.observe_evaluation(("ns", "r"), [result(0, 4, 0.2, 0.25), result(4, 4, 0.6, 0.75), result(8, 2, 1, 1)])
    value = lambda name: metrics.registry.get_sample_value(f"harnessrl_operator_evaluation_{name}", labels)  # noqa: E731
    assert (value("version"), value("reward_mean"), value("pass_rate")) == (4, 0.6, 0.75)
    metrics.forget("ns", "r")
    assert value("version") is None


def test_sidecars_get_the_evaluation_sampling_only_when_the_run_evaluates() -> None:
    import copy
    import json

    from test_render import CLUSTER, container, env_of, harness_pod

    from harnessrl.spec.problems import parse_training_run

    assert "HARNESSRL_EVALUATION_SAMPLING" not in env_of(container(harness_pod(parse_training_run(CLUSTER))["spec"],
                                                                   "proxy"))
    document = copy.deepcopy(CLUSTER)
    document["spec"]["evaluation"] = {"tasks": {"inline": [{"id": "h"}]}, "temperature": 0.5, "topP": 0.9}
    proxy = env_of(container(harness_pod(parse_training_run(document))["spec"], "proxy"))
    assert json.loads(proxy["HARNESSRL_EVALUATION_SAMPLING"]) == {"temperature": 0.5, "top_p": 0.9}


def test_a_long_runs_status_keeps_the_baseline_the_best_and_the_newest_versions() -> None:
    """status.evaluation.versions is capped (an object is limited to 1.5 MiB): of 100 evaluated versions the
    status shows the baseline, the best and the newest 20, and says how many it left out."""
    from harnessrl.spec.status import EVALUATED_VERSIONS_SHOWN

    results = [result(v, 4, 0.1, 0.1) for v in range(100)]
    results[30] = result(30, 4, 0.9, 1.0)  # the best, long ago
    status = build_status(observed(evaluation=results), None)
    TrainingRunStatus.model_validate(status)
    shown = [row["version"] for row in status["evaluation"]["versions"]]
    assert shown == [0, 30, *range(100 - EVALUATED_VERSIONS_SHOWN, 100)]
    assert status["evaluation"]["versionsOmitted"] == 100 - len(shown)
    assert status["evaluation"]["bestVersion"] == 30
