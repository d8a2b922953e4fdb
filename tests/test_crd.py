"""The committed CRD: up to date with the models, accepted by Kubernetes' own CRD schema, structural, and
agreeing with the pydantic models on the examples and on basic bad documents."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner
from test_spec_rules import MINIMAL, spec

from harnessrl.spec.commands import crd_command
from harnessrl.spec.crd import (
    CRD_PATH,
    PRINTER_COLUMNS,
    build_crd,
    openapi_schema,
    render_crd_yaml,
    strict_json_schema,
)
from harnessrl.spec.documents import is_other_object, load_documents
from harnessrl.spec.problems import validate_document

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / CRD_PATH
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

# What a structural schema may contain: JSONSchemaProps of apiextensions.k8s.io/v1, less what it forbids.
ALLOWED_KEYS = {
    "description",
    "type",
    "format",
    "enum",
    "default",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "required",
    "properties",
    "items",
    "additionalProperties",
    "anyOf",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}


def schema_nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from schema_nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], f"{path}{{}}")


def crd_validator() -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(strict_json_schema())


def test_committed_crd_is_up_to_date() -> None:
    assert COMMITTED.read_text(encoding="utf-8") == render_crd_yaml(), (
        f"{CRD_PATH} is stale: run `harnessrl crd --output {CRD_PATH}`"
    )


def test_crd_check_command_detects_a_stale_file(tmp_path: Path) -> None:
    runner = CliRunner()
    target = tmp_path / "crd.yaml"
    missing = runner.invoke(crd_command, ["--check", "--output", str(target)])
    assert missing.exit_code == 1 and "cannot read" in missing.output
    written = runner.invoke(crd_command, ["--output", str(target)])
    assert written.exit_code == 0 and target.read_text() == render_crd_yaml()
    assert runner.invoke(crd_command, ["--check", "--output", str(target)]).exit_code == 0
    target.write_text(render_crd_yaml().replace("default: 8\n", "default: 9\n", 1))
    stale = runner.invoke(crd_command, ["--check", "--output", str(target)])
    assert stale.exit_code == 1
    assert stale.output.strip() == f"{target}: stale — regenerate it with: harnessrl crd --output {target}"
    printed = runner.invoke(crd_command, [])
    assert printed.exit_code == 0 and printed.output == render_crd_yaml()


def test_crd_passes_kubernetes_validate_strict() -> None:
    crd = yaml.safe_load(COMMITTED.read_text())
    kubernetes_validate.validate(crd, kubernetes_validate.latest_version(), strict=True)
    broken = copy.deepcopy(crd)
    broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["typo"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_crd_identity() -> None:
    crd = build_crd()
    assert crd["metadata"]["name"] == "trainingruns.harnessrl.io"
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["shortNames"] == ["tr"] and crd["spec"]["names"]["kind"] == "TrainingRun"
    [version] = crd["spec"]["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    names = [column["name"] for column in version["additionalPrinterColumns"]]
    assert names[:6] == ["Phase", "Step", "Reward", "Running", "Succeeded", "Failed"] and names[-1] == "Age"


def test_schema_is_structural() -> None:
    """Every node typed (or int-or-string / preserve-unknown-fields), no $ref, anyOf only for int-or-string,
    no additionalProperties: false, nothing nullable (null means absent and the API server prunes it)."""
    for path, node in schema_nodes(openapi_schema()):
        assert set(node) <= ALLOWED_KEYS, (path, set(node) - ALLOWED_KEYS)
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node and node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, path
        assert "anyOf" not in node, path
        assert node.get("additionalProperties") is not False, path
        assert not ("properties" in node and "additionalProperties" in node), path
        if node["type"] == "object" and path != ".metadata":
            assert (
                "properties" in node
                or "additionalProperties" in node
                or node.get("x-kubernetes-preserve-unknown-fields")
            ), path
        if node["type"] == "array":
            assert isinstance(node.get("items"), dict), path
        for name in node.get("required", []):
            assert name in node["properties"], (path, name)
        if node.get("x-kubernetes-list-type") == "map":
            item = node["items"]
            for key in node["x-kubernetes-list-map-keys"]:
                assert key in item.get("required", []) or "default" in item["properties"][key], (path, key)
    assert "$ref" not in COMMITTED.read_text() and "nullable" not in COMMITTED.read_text()


def test_defaults_are_valid_values_of_their_own_schema() -> None:
    """The API server refuses a CRD whose defaults do not validate (or would be pruned)."""
    checked = 0
    for _path, node in schema_nodes(strict_json_schema()):
        if "default" in node:
            jsonschema.Draft4Validator(node).validate(node["default"])
            checked += 1
    assert checked > 50


def test_validation_field_paths_and_printer_columns_resolve() -> None:
    schema = openapi_schema()
    for _path, node in schema_nodes(schema):
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["rule"] and rule["message"] and "\n" not in rule["message"]
            target = node
            for part in rule.get("fieldPath", "").lstrip(".").split(".") if rule.get("fieldPath") else []:
                target = target["properties"][part]
    for column in PRINTER_COLUMNS:
        target = schema
        for part in column["jsonPath"].lstrip(".").split("."):
            if part == "metadata":
                break
            target = target["properties"][part]
        else:
            assert target["type"] == column["type"], column


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_examples_validate_against_crd_schema_and_model(example: Path) -> None:
    documents = load_documents(example.read_text())
    assert documents
    runs = [document for document in documents if not is_other_object(document.data)]
    assert runs, f"{example.name} holds no TrainingRun"
    for document in runs:
        crd_validator().validate(document.data)
        assert validate_document(document.data) == []


def test_examples_cover_minimal_and_cluster() -> None:
    names = {path.name for path in EXAMPLES}
    assert {"trainingrun-minimal.yaml", "trainingrun-cluster.yaml"} <= names


# Documents the schema itself refuses (no CEL rule involved): (id, document, path of the refused field).
BAD_DOCUMENTS: list[tuple[str, dict, list[str]]] = [
    ("unknown-field", spec({"harness": {"gropSize": 8}}), ["spec", "harness"]),
    ("wrong-type", spec({"learner": {"steps": "many"}}), ["spec", "learner", "steps"]),
    (
        "out-of-range",
        spec({"learner": {"deepspeed": {"zeroStage": 5}}}),
        ["spec", "learner", "deepspeed", "zeroStage"],
    ),
    ("bad-enum", spec({"learner": {"algorithm": {"loss": "dpo"}}}), ["spec", "learner", "algorithm", "loss"]),
    (
        "bad-quantity",
        spec({"rollout": {"resources": {"limits": {"memory": "lots"}}}}),
        ["spec", "rollout", "resources", "limits", "memory"],
    ),
    ("missing-required", {**MINIMAL, "spec": {"model": {"path": "/m"}}}, ["spec"]),  # harness missing
]


@pytest.mark.parametrize(
    "doc, path", [case[1:] for case in BAD_DOCUMENTS], ids=[case[0] for case in BAD_DOCUMENTS]
)
def test_bad_documents_fail_jsonschema_and_the_model(doc: dict, path: list[str]) -> None:
    errors = list(crd_validator().iter_errors(doc))
    assert errors, "the CRD schema accepted a bad document"
    assert any(list(error.absolute_path) == path for error in errors), [list(e.absolute_path) for e in errors]
    assert validate_document(doc)


def test_minimal_document_gets_the_same_defaults_from_crd_and_model() -> None:
    """Defaulting by the API server (from the CRD) and by pydantic give the same object."""
    from test_spec_rules import apply_defaults

    from harnessrl.spec.problems import parse_training_run

    by_server = apply_defaults(openapi_schema(), MINIMAL)
    by_model = parse_training_run(MINIMAL).to_document()
    by_model["metadata"] = MINIMAL["metadata"]
    assert by_server == by_model
