"""``spec.evaluation``: its defaults, its refusals (one line naming the field) and which of its fields may
change while a run exists."""

from __future__ import annotations

import copy
from typing import Any

from harnessrl.spec.changes import changeable_paths
from harnessrl.spec.crd import openapi_schema
from harnessrl.spec.evaluation import Evaluation, evaluation_sampling
from harnessrl.spec.models import TrainingRunSpec
from harnessrl.spec.problems import parse_training_run, validate_document

DOC: dict[str, Any] = {
    "apiVersion": "harnessrl.io/v1alpha1",
    "kind": "TrainingRun",
    "metadata": {"name": "evals"},
    "spec": {
        "model": {"path": "/models/m"},
        "harness": {"command": ["python", "h.py"], "tasks": {"inline": [{"id": "t1"}]}},
        "evaluation": {"tasks": {"inline": [{"id": "held-out-1"}]}},
    },
}


def with_evaluation(**fields: Any) -> dict[str, Any]:
    doc = copy.deepcopy(DOC)
    doc["spec"]["evaluation"].update(fields)
    return doc


def test_defaults_are_documented_and_greedy() -> None:
    evaluation = parse_training_run(DOC).spec.evaluation
    assert evaluation is not None
    assert (evaluation.every_steps, evaluation.at_start, evaluation.samples_per_task) == (10, True, 1)
    assert evaluation_sampling(evaluation) == {"temperature": 0.0, "top_p": 1.0}
    assert evaluation.pass_reward == 1.0
    for name, field in Evaluation.model_fields.items():
        assert field.description, f"evaluation.{name} has no docstring"
    no_eval = copy.deepcopy(DOC)
    del no_eval["spec"]["evaluation"]
    assert parse_training_run(no_eval).spec.evaluation is None


def test_samples_per_task_zero_names_the_field() -> None:
    problems = validate_document(with_evaluation(samplesPerTask=0))
    assert [(p.path, p.message) for p in problems] == [
        ("spec.evaluation.samplesPerTask", "must be at least 1, got 0 — use 1 or more")
    ]


def test_several_greedy_samples_are_refused_and_sampled_ones_accepted() -> None:
    problems = validate_document(with_evaluation(samplesPerTask=4))
    assert [p.path for p in problems] == ["spec.evaluation.samplesPerTask"]
    assert "temperature" in problems[0].message
    assert validate_document(with_evaluation(samplesPerTask=4, temperature=0.7, topP=0.9)) == []


def test_a_task_source_is_required() -> None:
    problems = validate_document(with_evaluation(tasks={}))
    assert [p.path for p in problems] == ["spec.evaluation.tasks"]
    assert "configMap, file or inline" in problems[0].message


def test_only_every_steps_may_change_and_other_fields_are_fixed_in_the_crd() -> None:
    assert "spec.evaluation.everySteps" in list(changeable_paths(TrainingRunSpec))
    assert not any(p.startswith("spec.evaluation.") and p != "spec.evaluation.everySteps"
                   for p in changeable_paths(TrainingRunSpec))
    node = openapi_schema()["properties"]["spec"]["properties"]["evaluation"]
    fixed = {rule["fieldPath"] for rule in node["x-kubernetes-validations"] if "oldSelf" in rule["rule"]}
    assert fixed == {".tasks", ".atStart", ".samplesPerTask", ".temperature", ".topP", ".passReward"}
