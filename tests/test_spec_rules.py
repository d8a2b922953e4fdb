"""Every cross-field rule: refused and accepted by the pydantic model, and the CRD's CEL twin of the rule
agrees with it when a real CEL interpreter evaluates it the way the API server does (defaults applied first,
each rule at the schema node of the model that declares it)."""

from __future__ import annotations

import copy
import functools
from typing import Any

import celpy
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harnessrl.spec.base import SpecModel
from harnessrl.spec.crd import _model_classes, openapi_schema
from harnessrl.spec.models import TrainingRun
from harnessrl.spec.problems import format_path, validate_document

MINIMAL: dict[str, Any] = {
    "apiVersion": "harnessrl.io/v1alpha1",
    "kind": "TrainingRun",
    "metadata": {"name": "rules"},
    "spec": {
        "model": {"path": "/models/m"},
        "harness": {"command": ["python", "-m", "h"], "tasks": {"inline": [{"id": "t1"}]}},
        # What a cluster needs (a rule of its own below): the learner and vLLM share the checkpoints.
        "learner": {
            "checkpointDir": "/ckpt/run",
            "checkpointVolume": {"pvc": "ckpt", "mountPath": "/ckpt", "readOnly": False},
        },
    },
}


def merged(patch: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base`` with ``patch`` merged in; a None value in the patch deletes the key."""
    out = copy.deepcopy(MINIMAL if base is None else base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(value, out[key])
        else:
            out[key] = copy.deepcopy(value)
    return out


def spec(patch: dict[str, Any]) -> dict[str, Any]:
    return merged({"spec": patch})


# --- a small model of what the API server does with a CRD: defaults first, then CEL at each node ---------


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting, as the API server does it: missing properties with a default get it, then the
    same recursively (so ``default: {}`` on an object fills in that object's own defaults)."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for name, prop in schema.get("properties", {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                value[name] = apply_defaults(prop, value[name])
        if isinstance(schema.get("additionalProperties"), dict):
            for key in value:
                value[key] = apply_defaults(schema["additionalProperties"], value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def _typed(schema: dict[str, Any], value: Any) -> Any:
    """Values as CEL sees them in Kubernetes: a `number` field is a double even when written as 1."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = (
            schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        )
        return {key: _typed(props.get(key, extra), item) for key, item in value.items()}
    if isinstance(value, list):
        return [_typed(schema.get("items", {}), item) for item in value]
    return value


_CEL = celpy.Environment()


@functools.cache
def _program(rule: str) -> celpy.Runner:
    return _CEL.program(_CEL.compile(rule))


def cel_failures(doc: dict[str, Any]) -> dict[str, str]:
    """The paths (YAML spelling) the CRD's CEL rules refuse in ``doc``, evaluated like the API server does,
    each mapped to the path of the object whose rule refused it."""
    schema = openapi_schema()
    doc = apply_defaults(schema, doc)
    failures: dict[str, str] = {}

    def walk(node_schema: dict[str, Any], value: Any, loc: tuple) -> None:
        for rule in node_schema.get("x-kubernetes-validations", []):
            if "oldSelf" in rule["rule"]:
                continue  # a transition rule: the API server evaluates it on updates only
            program = _program(rule["rule"])
            try:
                result = program.evaluate({"self": celpy.json_to_cel(_typed(node_schema, value))})
            except celpy.CELEvalError:  # the API server refuses an object whose rule cannot be evaluated
                result = False
            if not (isinstance(result, celpy.celtypes.BoolType) and result):
                field = rule.get("fieldPath", "").lstrip(".")
                failures[format_path(loc + tuple(field.split(".")) if field else loc)] = format_path(loc)
        if isinstance(value, dict):
            for name, prop in node_schema.get("properties", {}).items():
                if name in value:
                    walk(prop, value[name], (*loc, name))
        elif isinstance(value, list) and isinstance(node_schema.get("items"), dict):
            for index, item in enumerate(value):
                walk(node_schema["items"], item, (*loc, index))

    walk(schema, doc, ())
    return failures


def python_paths(doc: dict[str, Any]) -> set[str]:
    """What ``harnessrl validate`` refuses for a cluster, where the CRD's rules all apply."""
    return {problem.path for problem in validate_document(doc, cluster=True)}


# --- explicit cases: one accepted and one refused document per rule ------------------------------------

CASES: list[tuple[str, dict[str, Any], dict[str, Any], str, str]] = [
    # ("Model:field" of the rule [#variant], accepted doc, refused doc, path of the refusal,
    #  words the message must contain)
    (
        "Algorithm:clip",
        spec({"learner": {"algorithm": {"clip": [0.2, 0.2]}}}),
        spec({"learner": {"algorithm": {"clip": [0.3, 0.2]}}}),
        "spec.learner.algorithm.clip",
        "low 0.3 is above high 0.2",
    ),
    (
        "Rows:maxRowTokens",
        spec({"learner": {"rows": {"maxPromptTokens": 100, "maxRowTokens": 100}}}),
        spec({"learner": {"rows": {"maxPromptTokens": 100, "maxRowTokens": 50}}}),
        "spec.learner.rows.maxRowTokens",
        "maxRowTokens 50 is below maxPromptTokens 100",
    ),
    (
        "Learner:microBatchTokens",
        spec({"learner": {"microBatchTokens": 1000, "rows": {"maxPromptTokens": 10, "maxRowTokens": 1000}}}),
        spec({"learner": {"microBatchTokens": 999, "rows": {"maxPromptTokens": 10, "maxRowTokens": 1000}}}),
        "spec.learner.microBatchTokens",
        "microBatchTokens 999 is below rows.maxRowTokens 1000",
    ),
    (
        "Learner:checkpointDir",
        spec(
            {
                "learner": {
                    "checkpointDir": "/ckpt/run",
                    "checkpointVolume": {"pvc": "c", "mountPath": "/ckpt", "readOnly": False},
                }
            }
        ),
        spec(
            {
                "learner": {
                    "checkpointDir": "/ckptx/run",
                    "checkpointVolume": {"pvc": "c", "mountPath": "/ckpt", "readOnly": False},
                }
            }
        ),
        "spec.learner.checkpointDir",
        "'/ckptx/run' is not inside checkpointVolume.mountPath '/ckpt'",
    ),
    (
        "Learner:checkpointVolume.readOnly",
        spec(
            {
                "learner": {
                    "checkpointDir": "/ckpt",
                    "checkpointVolume": {"pvc": "c", "mountPath": "/ckpt", "readOnly": False},
                }
            }
        ),
        spec({"learner": {"checkpointDir": "/ckpt",
                          "checkpointVolume": {"pvc": "c", "mountPath": "/ckpt", "readOnly": True}}}),
        "spec.learner.checkpointVolume.readOnly",
        "set checkpointVolume.readOnly to false",
    ),
    (
        "DeepSpeed:offload.optimizer",
        spec({"learner": {"deepspeed": {"zeroStage": 1, "offload": {"optimizer": "cpu"}}}}),
        spec({"learner": {"deepspeed": {"zeroStage": 0, "offload": {"optimizer": "cpu"}}}}),
        "spec.learner.deepspeed.offload.optimizer",
        "needs ZeRO stage 1 or higher",
    ),
    (
        "DeepSpeed:offload.parameters",
        spec({"learner": {"deepspeed": {"zeroStage": 3, "offload": {"parameters": "cpu"}}}}),
        spec({"learner": {"deepspeed": {"zeroStage": 2, "offload": {"parameters": "cpu"}}}}),
        "spec.learner.deepspeed.offload.parameters",
        "needs ZeRO stage 3, not 2",
    ),
    (
        "Rollout:tensorParallel",
        spec({"rollout": {"gpusPerReplica": 4, "tensorParallel": 2}}),
        spec({"rollout": {"gpusPerReplica": 3, "tensorParallel": 2}}),
        "spec.rollout.tensorParallel",
        "gpusPerReplica 3 is not a multiple of tensorParallel 2",
    ),
    (
        "Rollout:tensorParallel#cpu",
        spec({"rollout": {"gpusPerReplica": 0, "tensorParallel": 1}}),
        spec({"rollout": {"gpusPerReplica": 0, "tensorParallel": 2}}),
        "spec.rollout.tensorParallel",
        "gpusPerReplica is 0",
    ),
    (
        "Rollout:maxTokens",
        spec({"rollout": {"maxModelLen": 4096, "maxTokens": 4095}}),
        spec({"rollout": {"maxModelLen": 4096, "maxTokens": 4096}}),
        "spec.rollout.maxTokens",
        "maxTokens 4096 is not below maxModelLen 4096",
    ),
    (
        "Model:",
        spec({"model": {"path": None, "hub": {"id": "Qwen/Qwen3-8B"}}}),
        spec({"model": {"hub": {"id": "Qwen/Qwen3-8B"}}}),
        "spec.model",
        "needs exactly one of path or hub, got path and hub",
    ),
    (
        "Model:#none",
        spec({"model": {"path": "/m"}}),
        spec({"model": {"path": None, "tokenizer": "/tok"}}),
        "spec.model",
        "needs exactly one of path or hub, got none",
    ),
    (
        "Model:volume",
        spec({"model": {"path": "/models/m", "volume": {"pvc": "models", "mountPath": "/models/"}}}),
        spec({"model": {"path": "/data/m", "volume": {"pvc": "models", "mountPath": "/models"}}}),
        "spec.model.volume",
        "path '/data/m' is not inside volume.mountPath '/models'",
    ),
    (
        "Tasks:",
        spec({"harness": {"tasks": {"inline": None, "configMap": {"name": "tasks"}}}}),
        spec({"harness": {"tasks": {"configMap": {"name": "tasks"}}}}),
        "spec.harness.tasks",
        "the task list needs exactly one of configMap, file or inline, got configMap and inline",
    ),
    (
        "Tasks:#none",
        spec({"harness": {"tasks": {"inline": None, "file": {"path": "tasks.jsonl"}}}}),
        spec({"harness": {"tasks": {"inline": None}}}),
        "spec.harness.tasks",
        "got none",
    ),
    (
        "FileSource:path",
        spec(
            {
                "harness": {
                    "tasks": {
                        "inline": None,
                        "file": {"path": "/data/t.jsonl", "volume": {"pvc": "d", "mountPath": "/data"}},
                    }
                }
            }
        ),
        spec(
            {
                "harness": {
                    "tasks": {
                        "inline": None,
                        "file": {"path": "/tmp/t.jsonl", "volume": {"pvc": "d", "mountPath": "/data"}},
                    }
                }
            }
        ),
        "spec.harness.tasks.file.path",
        "'/tmp/t.jsonl' is not inside volume.mountPath '/data'",
    ),
    (
        "Sandbox:egress#custom",
        spec({"harness": {"sandbox": {"networkPolicy": "custom", "egress": [{"cidr": "10.0.0.0/8"}]}}}),
        spec({"harness": {"sandbox": {"networkPolicy": "custom"}}}),
        "spec.harness.sandbox.egress",
        "custom needs at least one egress rule",
    ),
    (
        "Sandbox:egress#not-custom",
        spec({"harness": {"sandbox": {"networkPolicy": "none"}}}),
        spec({"harness": {"sandbox": {"networkPolicy": "proxy-only", "egress": [{"cidr": "10.0.0.0/8"}]}}}),
        "spec.harness.sandbox.egress",
        "networkPolicy is proxy-only",
    ),
    (
        "Store:",
        spec({"store": {"postgres": {"url": "postgresql://db/h"}}}),
        spec({"store": {}}),
        "spec.store",
        "the store needs exactly one of sqlite or postgres, got none",
    ),
    (
        "Store:#both",
        spec({"store": {"sqlite": {}}}),
        spec({"store": {"sqlite": {}, "postgres": {"url": "postgresql://db/h"}}}),
        "spec.store",
        "the store needs exactly one of sqlite or postgres, got sqlite and postgres",
    ),
    (
        "PostgresStore:",
        spec({"store": {"postgres": {"secretRef": {"name": "db", "key": "url"}}}}),
        spec(
            {"store": {"postgres": {"secretRef": {"name": "db", "key": "url"}, "url": "postgresql://db/h"}}}
        ),
        "spec.store.postgres",
        "exactly one of secretRef or url",
    ),
    (
        "EnvVar:",
        spec({"harness": {"env": [{"name": "A", "value": "1"}]}}),
        spec(
            {
                "harness": {
                    "env": [
                        {"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
                    ]
                }
            }
        ),
        "spec.harness.env[0]",
        "either value or valueFrom",
    ),
    (
        "EnvVarSource:",
        spec({"rollout": {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}}),
        spec({"rollout": {"env": [{"name": "A", "valueFrom": {}}]}}),
        "spec.rollout.env[0].valueFrom",
        "valueFrom needs exactly one of secretKeyRef, configMapKeyRef or fieldRef, got none",
    ),
    (
        "TrainingRunSpec:harness.groupSize",
        spec({"harness": {"groupSize": 2}, "learner": {"algorithm": {"advantage": "rloo"}}}),
        spec({"harness": {"groupSize": 1}, "learner": {"algorithm": {"advantage": "rloo"}}}),
        "spec.harness.groupSize",
        "advantage rloo compares rollouts within a group, but groupSize is 1",
    ),
    (
        "Evaluation:samplesPerTask",
        spec({"evaluation": {"tasks": {"inline": [{"id": "e1"}]}, "samplesPerTask": 4, "temperature": 1.0}}),
        spec({"evaluation": {"tasks": {"inline": [{"id": "e1"}]}, "samplesPerTask": 4}}),
        "spec.evaluation.samplesPerTask",
        "samplesPerTask is 4 but temperature is 0 (greedy)",
    ),
    (
        "TrainingRunSpec:learner.checkpointVolume",
        spec({"rollout": {"upstreams": ["http://vllm:8000/v1"]}, "learner": {"checkpointVolume": None}}),
        spec({"rollout": {"replicas": 2}, "learner": {"checkpointVolume": None, "checkpointDir": "checkpoints"}}),
        "spec.learner.checkpointVolume",
        "need a volume they share with the learner",
    ),
    (
        "Toleration:value",
        spec({"rollout": {"scheduling": {"tolerations": [{"key": "gpu", "operator": "Exists"}]}}}),
        spec({"rollout": {"scheduling": {"tolerations": [{"key": "gpu", "operator": "Exists", "value": "x"}]}}}),
        "spec.rollout.scheduling.tolerations[0].value",
        "operator Exists takes no value",
    ),
    (
        "Toleration:operator",
        spec({"learner": {"scheduling": {"tolerations": [{"operator": "Exists"}]}}}),
        spec({"learner": {"scheduling": {"tolerations": [{"value": "x"}]}}}),
        "spec.learner.scheduling.tolerations[0].operator",
        "without a key must have operator Exists",
    ),
    (
        "Toleration:tolerationSeconds",
        spec({"harness": {"scheduling": {"tolerations": [
            {"key": "k", "effect": "NoExecute", "tolerationSeconds": 30}]}}}),
        spec({"harness": {"scheduling": {"tolerations": [
            {"key": "k", "effect": "NoSchedule", "tolerationSeconds": 30}]}}}),
        "spec.harness.scheduling.tolerations[0].tolerationSeconds",
        "only applies to effect NoExecute",
    ),
    (
        "TrainingRunSpec:learner.lora",
        spec({"weightSync": {"method": "lora"}, "learner": {"lora": {"rank": 8}}}),
        spec({"weightSync": {"method": "lora"}}),
        "spec.learner.lora",
        "needs learner.lora",
    ),
]


@pytest.mark.parametrize(
    "good, bad, path, words", [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_rule_accepts_good_and_refuses_bad(good: dict, bad: dict, path: str, words: str) -> None:
    assert validate_document(good, cluster=True) == []
    assert cel_failures(good) == {}
    problems = validate_document(bad, cluster=True)
    assert [problem.path for problem in problems] == [path]
    assert words in problems[0].message
    assert " — " in problems[0].message  # every message says what to do
    assert set(cel_failures(bad)) == {path}


def test_every_rule_has_a_case() -> None:
    """A new rule without a case above fails here, so no rule goes untested in either language."""
    declared = {
        f"{name}:{rule.field}"
        for name, cls in _model_classes(TrainingRun).items()
        if issubclass(cls, SpecModel)
        for rule in cls.rules
    }
    covered = {case[0].split("#")[0] for case in CASES}
    assert declared <= covered, f"rules without a test case: {sorted(declared - covered)}"


def test_rules_sit_in_the_crd_at_their_models_schema_node() -> None:
    schema = openapi_schema()
    algorithm = schema["properties"]["spec"]["properties"]["learner"]["properties"]["algorithm"]
    assert {"rule": "self.clip[0] <= self.clip[1]", "fieldPath": ".clip"}.items() <= algorithm[
        "x-kubernetes-validations"
    ][0].items()
    env_item = schema["properties"]["spec"]["properties"]["harness"]["properties"]["env"]["items"]
    assert env_item["x-kubernetes-validations"][0]["rule"] == "!(has(self.value) && has(self.valueFrom))"
    total = 0

    def count(node: dict) -> None:
        nonlocal total
        total += sum("oldSelf" not in rule["rule"] for rule in node.get("x-kubernetes-validations", []))
        for child in node.get("properties", {}).values():
            count(child)
        if isinstance(node.get("items"), dict):
            count(node["items"])

    count(schema)
    # EnvVar and EnvVarSource appear three times (rollout.env, harness.env, harness.verifier.env), Tasks and
    # FileSource twice (harness.tasks, evaluation.tasks); every other model once.
    per_model = {
        name: len(cls.rules)
        for name, cls in _model_classes(TrainingRun).items()
        if issubclass(cls, SpecModel)
    }
    # Toleration three times (rollout, learner and harness scheduling).
    expected = (sum(per_model.values()) + 2 * (per_model["EnvVar"] + per_model["EnvVarSource"])
                + per_model["Tasks"] + per_model["FileSource"] + 2 * per_model["Toleration"])
    assert total == expected


# --- random documents: the CEL rule and the Python rule always agree ------------------------------------

_paths = st.sampled_from(["/ckpt", "/ckpt/", "/ckpt/a", "/ckptx/a", "/other/b", "ckpt/a", "/"])
_mounts = st.sampled_from(["/ckpt", "/ckpt/", "/", "/other"])
_optional_source = st.one_of(st.none(), st.just({"name": "tasks"}))

RANDOM_DOCS = st.one_of(
    st.tuples(st.floats(0, 2, allow_nan=False), st.floats(0, 2, allow_nan=False)).map(
        lambda clip: spec({"learner": {"algorithm": {"clip": list(clip)}}})
    ),
    st.tuples(st.integers(1, 70000), st.integers(1, 70000)).map(
        lambda t: spec(
            {"learner": {"microBatchTokens": 10**6, "rows": {"maxPromptTokens": t[0], "maxRowTokens": t[1]}}}
        )
    ),
    st.tuples(st.integers(1, 70000), st.integers(1, 70000)).map(
        lambda t: spec(
            {"learner": {"microBatchTokens": t[0], "rows": {"maxPromptTokens": 1, "maxRowTokens": t[1]}}}
        )
    ),
    st.tuples(_paths, _mounts, st.booleans()).map(
        lambda t: spec(
            {
                "learner": {
                    "checkpointDir": t[0],
                    "checkpointVolume": {"pvc": "c", "mountPath": t[1], "readOnly": t[2]},
                }
            }
        )
    ),
    st.tuples(st.integers(0, 3), st.sampled_from(["none", "cpu"]), st.sampled_from(["none", "cpu"])).map(
        lambda t: spec(
            {
                "learner": {
                    "deepspeed": {"zeroStage": t[0], "offload": {"optimizer": t[1], "parameters": t[2]}}
                }
            }
        )
    ),
    st.tuples(st.integers(0, 16), st.integers(1, 8)).map(
        lambda t: spec({"rollout": {"gpusPerReplica": t[0], "tensorParallel": t[1]}})
    ),
    st.tuples(st.integers(1, 70000), st.integers(1, 70000)).map(
        lambda t: spec({"rollout": {"maxModelLen": t[0], "maxTokens": t[1]}})
    ),
    st.tuples(st.one_of(st.none(), _paths), st.booleans(), st.one_of(st.none(), _mounts)).map(
        lambda t: spec(
            {
                "model": {
                    "path": t[0],
                    **({"hub": {"id": "org/model"}} if t[1] else {}),
                    **({"volume": {"pvc": "m", "mountPath": t[2]}} if t[2] else {}),
                }
            }
        )
    ),
    st.tuples(_optional_source, st.booleans(), st.booleans()).map(
        lambda t: spec(
            {
                "harness": {
                    "tasks": {
                        "inline": [{"id": "a"}] if t[2] else None,
                        **({"configMap": t[0]} if t[0] else {}),
                        **({"file": {"path": "t.jsonl"}} if t[1] else {}),
                    }
                }
            }
        )
    ),
    st.tuples(st.sampled_from(["proxy-only", "none", "custom"]), st.integers(0, 2)).map(
        lambda t: spec(
            {"harness": {"sandbox": {"networkPolicy": t[0], "egress": [{"cidr": "10.0.0.0/8"}] * t[1]}}}
        )
    ),
    st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()).map(
        lambda t: spec(
            {
                "store": {
                    **({"sqlite": {}} if t[0] else {}),
                    **(
                        {
                            "postgres": {
                                **({"secretRef": {"name": "db", "key": "url"}} if t[2] else {}),
                                **({"url": "postgresql://db/x"} if t[3] else {}),
                            }
                        }
                        if t[1]
                        else {}
                    ),
                }
            }
        )
    ),
    st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()).map(
        lambda t: spec(
            {
                "harness": {
                    "env": [
                        {
                            "name": "A",
                            **({"value": "v"} if t[0] else {}),
                            **(
                                {
                                    "valueFrom": {
                                        **({"secretKeyRef": {"name": "s", "key": "k"}} if t[2] else {}),
                                        **({"fieldRef": {"fieldPath": "metadata.name"}} if t[3] else {}),
                                    }
                                }
                                if t[1]
                                else {}
                            ),
                        }
                    ]
                }
            }
        )
    ),
    st.tuples(
        st.sampled_from(["grpo", "rloo"]),
        st.integers(1, 4),
        st.sampled_from(["reload", "lora"]),
        st.booleans(),
    ).map(
        lambda t: spec(
            {
                "harness": {"groupSize": t[1]},
                "learner": {"algorithm": {"advantage": t[0]}, **({"lora": {}} if t[3] else {})},
                "weightSync": {"method": t[2]},
            }
        )
    ),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(RANDOM_DOCS)
def test_cel_and_python_agree_on_random_documents(doc: dict) -> None:
    """Both refuse the same fields, with one difference by design: pydantic runs an object's rules only once
    the objects inside it are valid, so a CEL failure may go unreported in Python while a problem inside that
    same object is reported (the user fixes that first, then sees the next)."""
    python = python_paths(doc)
    cel = cel_failures(doc)
    assert python <= set(cel)
    for path, node in cel.items():
        if path not in python:
            assert any(found.startswith((node + ".", node + "[")) for found in python), (path, python)
