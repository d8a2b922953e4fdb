"""The TrainingRun models: a tiny spec gets runnable defaults, YAML spelling is camelCase and strict like the
API server, and what the models write back reads back unchanged."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from test_spec_rules import MINIMAL, merged, spec

from harnessrl.spec.documents import load_documents
from harnessrl.spec.learner import Algorithm, Learner, Lora
from harnessrl.spec.models import (
    TrainingRunSpec,
)
from harnessrl.spec.problems import InvalidSpec, parse_training_run, validate_document
from harnessrl.spec.status import Condition, ConditionType, Phase, Reason, TrainingRunStatus

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_minimal_spec_gets_runnable_defaults() -> None:
    run = parse_training_run(MINIMAL)
    s = run.spec
    assert run.metadata.name == "rules"
    assert (s.rollout.replicas, s.rollout.gpus_per_replica, s.rollout.tensor_parallel) == (1, 1, 1)
    assert s.rollout.image is None  # the operator picks vLLM's CUDA image or its CPU build (gpusPerReplica)
    assert (s.rollout.temperature, s.rollout.top_p, s.rollout.max_tokens, s.rollout.upstreams) == (
        1.0,
        1.0,
        None,
        None,
    )
    assert (
        s.harness.group_size,
        s.harness.concurrency,
        s.harness.timeout_seconds,
        s.harness.max_attempts,
    ) == (8, 16, 1800, 2)
    assert s.harness.sandbox.network_policy == "proxy-only" and s.harness.sandbox.egress == []
    assert s.proxy.max_request_body_bytes == 64 * 1024 * 1024
    assert (s.proxy.pause.mode, s.proxy.pause.retry_after_seconds) == ("wait", 2)
    algorithm = s.learner.algorithm
    assert (algorithm.advantage, algorithm.loss, algorithm.loss_aggregation) == (
        "grpo",
        "ppo-clip",
        "per-rollout-mean",
    )
    assert algorithm.clip == [0.2, 0.28]
    assert algorithm.failed_rollout_reward is None  # failed rollouts are left out of training
    assert s.learner.deepspeed.zero_stage == 2 and s.learner.lora is None
    assert (s.learner.rows.mode, s.learner.rows.max_prompt_tokens, s.learner.rows.max_row_tokens) == (
        "merge",
        16384,
        32768,
    )
    assert s.weight_sync.method == "reload"
    assert s.store.sqlite is not None and s.store.sqlite.path == "trace.sqlite" and s.store.postgres is None
    assert (s.suspend, s.active_deadline_seconds, s.ttl_seconds_after_finished) == (False, None, None)
    assert run.status is None


def test_python_names_are_snake_case_and_models_build_without_yaml() -> None:
    """The operator and trainer build specs in Python with snake_case names; rules still apply."""
    learner = Learner(micro_batch_tokens=65536, lora=Lora(rank=8), algorithm=Algorithm(clip=[0.1, 0.3]))
    assert learner.lora is not None and learner.lora.rank == 8
    with pytest.raises(ValidationError, match="low 0.4 is above high 0.3"):
        Algorithm(clip=[0.4, 0.3])


def test_documents_must_use_the_yaml_spelling() -> None:
    """`group_size` in a document is refused: the API server would drop it and silently use the default."""
    problems = validate_document(spec({"harness": {"group_size": 4}}))
    assert [(p.path, p.message) for p in problems] == [
        ("spec.harness.group_size", "unknown field 'group_size' — did you mean 'groupSize'?")
    ]


@pytest.mark.parametrize(
    "patch, path",
    [
        ({"harness": {"groupSize": "8"}}, "spec.harness.groupSize"),  # kubectl refuses a quoted integer
        ({"harness": {"groupSize": 8.0}}, "spec.harness.groupSize"),
        ({"suspend": "true"}, "spec.suspend"),
        ({"harness": {"env": [{"name": "PORT", "value": 8080}]}}, "spec.harness.env[0].value"),
        ({"learner": {"algorithm": {"lr": "fast"}}}, "spec.learner.algorithm.lr"),
    ],
)
def test_types_are_strict_like_the_api_server(patch: dict, path: str) -> None:
    assert [p.path for p in validate_document(spec(patch))] == [path]


def test_document_round_trip_is_lossless() -> None:
    """What the operator writes back (to_document) parses to the same run."""
    for example in sorted(EXAMPLES.glob("*.yaml")):
        [document] = load_documents(example.read_text())
        run = parse_training_run(document.data)
        again = parse_training_run(run.to_document())
        assert again == run, example.name


def test_status_round_trips_through_json() -> None:
    status = TrainingRunStatus(
        phase=Phase.RUNNING,
        reason=Reason.RUNNING,
        conditions=[
            Condition(
                type=ConditionType.ROLLOUT_READY,
                status="True",
                reason="ReplicasReady",
                last_transition_time=datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC),
                observed_generation=3,
            )
        ],
        observed_generation=3,
        policy_version=12,
        step=12,
        rollouts={"queued": 40, "running": 64, "succeeded": 3000, "failed": 12, "timedOut": 2},
        reward_mean=0.41,
    )
    doc = merged({"status": status.model_dump(mode="json", exclude_none=True)})
    assert doc["status"]["conditions"][0]["lastTransitionTime"] == "2025-01-02T03:04:05Z"
    assert doc["status"]["rollouts"]["timedOut"] == 2
    run = parse_training_run(doc)
    assert run.status == status


def test_status_refuses_an_unknown_reason() -> None:
    problems = validate_document(merged({"status": {"phase": "Failed", "reason": "Exploded"}}))
    assert [p.path for p in problems] == ["status.reason"]
    assert "use one of:" in problems[0].message and "LearnerCrashed" in problems[0].message


def test_invalid_spec_exception_lists_every_problem() -> None:
    with pytest.raises(InvalidSpec) as caught:
        parse_training_run(spec({"harness": {"concurrency": 0, "groupSize": 0}}))
    assert [p.path for p in caught.value.problems] == ["spec.harness.groupSize", "spec.harness.concurrency"]
    assert str(caught.value).count("\n") == 1


def test_spec_model_refuses_unknown_fields_in_python_too() -> None:
    with pytest.raises(ValidationError, match="extra"):
        TrainingRunSpec.model_validate({**MINIMAL["spec"], "learnr": {}})


def test_inline_task_ids_must_be_unique() -> None:
    doc = spec({"harness": {"tasks": {"inline": [{"id": "a"}, {"id": "b"}, {"id": "a"}]}}})
    assert [str(p) for p in validate_document(doc)] == [
        "spec.harness.tasks.inline: task id 'a' is used by inline[0] and inline[2] — give every task its "
        "own id"
    ]


@given(st.floats(0, 10, allow_nan=False), st.floats(0, 10, allow_nan=False))
def test_clip_pairs(low: float, high: float) -> None:
    problems = validate_document(spec({"learner": {"algorithm": {"clip": [low, high]}}}))
    if low <= high:
        assert problems == []
    else:
        assert [p.path for p in problems] == ["spec.learner.algorithm.clip"]
        assert problems[0].message.startswith(f"low {low} is above high {high} — ")


@pytest.mark.parametrize("clip", [[-0.1, 0.2], [0.2], [0.1, 0.2, 0.3]])
def test_clip_shape_and_sign(clip: list) -> None:
    problems = validate_document(spec({"learner": {"algorithm": {"clip": clip}}}))
    assert problems and all(p.path.startswith("spec.learner.algorithm.clip") for p in problems)
