"""The TrainingRun CRD through a real kube-apiserver: the server accepts the schema and the cost of every CEL
rule, accepts every example, refuses every bad document of the spec tests naming the field (and agrees with
`harnessrl validate` on each), prints the printer columns, explains the fields, and keeps status a
subresource.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from test_crd import BAD_DOCUMENTS, EXAMPLES
from test_spec_rules import CASES, MINIMAL, RANDOM_DOCS, python_paths

from harnessrl.devcluster import Cluster
from harnessrl.spec.changes import changeable_paths
from harnessrl.spec.commands import validate_file
from harnessrl.spec.crd import CRD_PATH, PRINTER_COLUMNS, _model_classes, build_crd
from harnessrl.spec.models import TrainingRun, TrainingRunSpec

ROOT = Path(__file__).resolve().parents[1]
CRD_NAME = "trainingruns.harnessrl.io"


def dry_run(kube: Cluster, namespace: str, doc: dict[str, Any]) -> tuple[bool, str]:
    """(accepted, the server's refusal) for ``kubectl apply --dry-run=server`` (strict field validation)."""
    result = kube.kubectl(
        "apply",
        "--dry-run=server",
        "--validate=strict",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps(doc),
        check=False,
    )
    return result.returncode == 0, result.stderr.strip()


def harnessrl_validate(doc: dict[str, Any], tmp_path: Path) -> tuple[int, list[str]]:
    path = tmp_path / "doc.yaml"
    path.write_text(yaml.safe_dump(doc))
    return validate_file(str(path))


def test_the_server_accepts_the_crd_and_every_cel_rule_within_its_cost_budget(kube: Cluster) -> None:
    crd = json.loads(kube.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    assert conditions.get("NonStructuralSchema", "False") == "False"
    assert crd["spec"]["versions"][0]["schema"] == build_crd()["spec"]["versions"][0]["schema"]
    # The cost budget is checked on create and on every update: re-applying the file goes through it again.
    applied = kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / CRD_PATH))
    assert "serverside-applied" in applied.stdout


def test_a_rule_over_the_cost_budget_is_refused_by_the_server(kube: Cluster) -> None:
    """The cost check is real: an unbounded list walked by a nested rule is refused at CRD creation."""
    crd = copy.deepcopy(build_crd())
    crd["metadata"]["name"] = "costlies.harnessrl.io"
    crd["spec"]["names"] = {
        "plural": "costlies",
        "singular": "costly",
        "kind": "Costly",
        "listKind": "CostlyList",
    }
    version = crd["spec"]["versions"][0]
    version.pop("additionalPrinterColumns")
    version["schema"]["openAPIV3Schema"] = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "properties": {"items": {"type": "array", "items": {"type": "string"}}},
                "x-kubernetes-validations": [
                    {"rule": "self.items.all(a, self.items.all(b, self.items.all(c, a + b + c != '')))"}
                ],
            }
        },
    }
    refused = kube.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(crd), check=False)
    assert refused.returncode != 0 and "cost" in refused.stderr.lower(), refused.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_every_example_is_accepted_by_the_server(kube: Cluster, kube_namespace: str, example: Path) -> None:
    """Every example a cluster can run; the local minimal one is refused for the cluster-only rule alone,
    with the message `harnessrl validate` prints for it."""
    result = kube.kubectl(
        "apply",
        "--dry-run=server",
        "--validate=strict",
        "-n",
        kube_namespace,
        "-f",
        str(example),
        check=False,
    )
    if example.name == "trainingrun-minimal.yaml":
        assert result.returncode != 0 and "spec.learner.checkpointVolume: Invalid value" in result.stderr
        assert "need a volume they share with the learner" in result.stderr, result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert "trainingrun.harnessrl.io/" in result.stdout


def crd_message(case_id: str) -> str:
    """The message the CRD's CEL twin of a rule carries (fixed text: the server shows no values)."""
    model, field = case_id.split("#")[0].split(":")
    [rule] = [rule for rule in _model_classes(TrainingRun)[model].rules if rule.field == field]
    return rule.to_crd()["message"]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_each_cel_rule_agrees_with_harnessrl_validate(
    kube: Cluster, kube_namespace: str, tmp_path: Path, case: tuple
) -> None:
    case_id, good, bad, path, words = case
    accepted, refusal = dry_run(kube, kube_namespace, good)
    assert accepted, refusal
    assert harnessrl_validate(good, tmp_path)[0] == 0
    accepted, refusal = dry_run(kube, kube_namespace, bad)
    assert not accepted
    assert f"{path}: Invalid value: {crd_message(case_id)}" in refusal, refusal
    code, lines = harnessrl_validate(bad, tmp_path)
    assert any(path in line and words in line for line in lines), lines
    model, field = case_id.split("#")[0].split(":")
    [rule] = [rule for rule in _model_classes(TrainingRun)[model].rules if rule.field == field]
    # A rule only a cluster needs: `harnessrl run` takes the file, and validate says the cluster refuses it.
    assert code == (0 if rule.cluster_only else 1), lines
    assert any("a cluster refuses it" in line for line in lines) == rule.cluster_only, lines


@pytest.mark.parametrize(
    "doc, path", [case[1:] for case in BAD_DOCUMENTS], ids=[case[0] for case in BAD_DOCUMENTS]
)
def test_each_schema_refusal_agrees_with_harnessrl_validate(
    kube: Cluster, kube_namespace: str, tmp_path: Path, doc: dict, path: list[str]
) -> None:
    accepted, refusal = dry_run(kube, kube_namespace, doc)
    field = ".".join(path)
    assert not accepted and field in refusal, refusal
    code, lines = harnessrl_validate(doc, tmp_path)
    assert code == 1 and any(field in line for line in lines), lines


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(doc=RANDOM_DOCS)
def test_server_and_harnessrl_validate_agree_on_random_documents(
    kube: Cluster, kube_namespace: str, doc: dict
) -> None:
    """Accepted by one exactly when accepted by the other, and every field `harnessrl validate` refuses is
    named by the server. The server may name more: pydantic checks an object's own rules only once the
    objects inside it are valid, CEL checks every rule at once (test_spec_rules says the same)."""
    accepted, refusal = dry_run(kube, kube_namespace, doc)
    refused_fields = python_paths(doc)
    assert accepted == (not refused_fields), (refusal, refused_fields)
    for field in refused_fields:
        assert f"{field}:" in refusal, (field, refusal)


def patch(kube: Cluster, namespace: str, body: dict[str, Any], *flags: str) -> None:
    kube.kubectl("patch", "tr", "rules", "-n", namespace, "--type=merge", "-p", json.dumps(body), *flags)


def test_get_prints_the_printer_columns_and_status_is_a_subresource(
    kube: Cluster, kube_namespace: str
) -> None:
    ns = kube_namespace
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(MINIMAL))
    created = json.loads(kube.kubectl("get", "tr", "rules", "-n", ns, "-o", "json").stdout)
    assert created["metadata"]["generation"] == 1
    assert created["spec"]["harness"]["groupSize"] == 8  # defaults applied by the server

    status = {
        "phase": "Running",
        "step": 12,
        "rewardMean": 0.41,
        "reason": "Running",
        "rollouts": {"running": 64, "succeeded": 3000, "failed": 12},
    }
    patch(kube, ns, {"status": status}, "--subresource=status")
    patched = json.loads(kube.kubectl("get", "tr", "rules", "-n", ns, "-o", "json").stdout)
    assert patched["metadata"]["generation"] == 1 and patched["status"]["step"] == 12
    # Status sent through the main resource is ignored; spec changes bump the generation.
    patch(kube, ns, {"spec": {"harness": {"concurrency": 7}}, "status": {"step": 99}})
    after = json.loads(kube.kubectl("get", "tr", "rules", "-n", ns, "-o", "json").stdout)
    assert after["metadata"]["generation"] == 2 and after["status"]["step"] == 12

    table = kube.kubectl("get", "tr", "-n", ns).stdout.splitlines()
    shown = [column["name"].upper() for column in PRINTER_COLUMNS if not column.get("priority")]
    assert table[0].split() == ["NAME", *shown]
    assert table[1].split()[:7] == ["rules", "Running", "12", "0.41", "64", "3000", "12"]
    wide = kube.kubectl("get", "trainingruns", "-n", ns, "-o", "wide").stdout.splitlines()
    header, row = wide[0].split(), wide[1].split()
    assert row[header.index("REASON")] == "Running"


def test_explain_shows_the_field_descriptions(kube: Cluster) -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    harness = schema["properties"]["spec"]["properties"]["harness"]
    explained = kube.kubectl("explain", "trainingrun.spec.harness").stdout
    assert explained.split()[:6] == ["GROUP:", "harnessrl.io", "KIND:", "TrainingRun", "VERSION:", "v1alpha1"]
    for name in ("command", "tasks", "groupSize", "concurrency", "timeoutSeconds"):
        first_words = " ".join(harness["properties"][name]["description"].split()[:4])
        assert name in explained and first_words in " ".join(explained.split()), name


# One change per fixed field of MINIMAL (merge patches; a None deletes). Fields unset in MINIMAL are set, which
# is a change too.
FIXED_CHANGES: dict[str, dict[str, Any]] = {
    "spec.model": {"model": {"path": "/models/other"}},
    "spec.rollout.image": {"rollout": {"image": "vllm/vllm-openai:v0.31.0"}},
    "spec.rollout.maxTokens": {"rollout": {"maxTokens": 64}},
    "spec.rollout.args": {"rollout": {"args": ["--seed", "1"]}},
    "spec.harness.command": {"harness": {"command": ["python", "-m", "other"]}},
    "spec.harness.image": {"harness": {"image": "example/harness:2"}},
    "spec.harness.groupSize": {"harness": {"groupSize": 4}},
    "spec.harness.tasks": {"harness": {"tasks": {"inline": [{"id": "t2"}]}}},
    "spec.proxy": {"proxy": {"port": 8081}},
    "spec.learner": {"learner": {"steps": 7}},
    "spec.rollout.scheduling": {"rollout": {"scheduling": {"priorityClassName": "high"}}},
    "spec.weightSync": {"weightSync": {"retries": 5}},
    "spec.store": {"store": {"sqlite": {"path": "other.sqlite"}}},
}
CHANGEABLE_CHANGES: dict[str, dict[str, Any]] = {
    "spec.rollout.replicas": {"rollout": {"replicas": 3}},
    "spec.harness.concurrency": {"harness": {"concurrency": 2}},
    "spec.harness.timeoutSeconds": {"harness": {"timeoutSeconds": 60}},
    "spec.harness.maxAttempts": {"harness": {"maxAttempts": 4}},
    "spec.harness.scheduling": {
        "harness": {"scheduling": {"nodeSelector": {"pool": "cpu"}, "tolerations": [], "imagePullSecrets": []}}
    },
    "spec.suspend": {"suspend": True},
    "spec.activeDeadlineSeconds": {"activeDeadlineSeconds": 3600},
    "spec.ttlSecondsAfterFinished": {"ttlSecondsAfterFinished": 60},
    # MINIMAL has no evaluation: the section may be added to a run (with its tasks); within it everySteps may
    # change, its other fields are fixed once set.
    "spec.evaluation.everySteps": {"evaluation": {"tasks": {"inline": [{"id": "e1"}]}, "everySteps": 3}},
}


def test_every_changeable_field_has_a_case() -> None:
    assert set(CHANGEABLE_CHANGES) == set(changeable_paths(TrainingRunSpec))


@pytest.mark.parametrize("path", sorted(FIXED_CHANGES))
def test_a_fixed_field_cannot_change_once_the_run_exists(
    kube: Cluster, kube_namespace: str, path: str
) -> None:
    ns = kube_namespace
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(MINIMAL))
    before = json.loads(kube.kubectl("get", "tr", "rules", "-n", ns, "-o", "json").stdout)
    refused = kube.kubectl(
        "patch",
        "tr",
        "rules",
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": FIXED_CHANGES[path]}),
        check=False,
    )
    assert refused.returncode != 0
    assert f"{path}: Invalid value" in refused.stderr and "is fixed once the run exists" in refused.stderr, (
        refused.stderr
    )
    assert "spec.rollout.replicas" in refused.stderr  # the message lists what may change
    after = json.loads(kube.kubectl("get", "tr", "rules", "-n", ns, "-o", "json").stdout)
    assert after["spec"] == before["spec"] and after["metadata"]["generation"] == 1


def test_the_changeable_fields_change_and_bump_the_generation(kube: Cluster, kube_namespace: str) -> None:
    ns = kube_namespace
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(MINIMAL))
    for generation, (path, change) in enumerate(sorted(CHANGEABLE_CHANGES.items()), start=2):
        patch(kube, ns, {"spec": change})
        after = json.loads(kube.kubectl("get", "tr", "rules", "-n", ns, "-o", "json").stdout)
        assert after["metadata"]["generation"] == generation, path
        value = after["spec"]
        for part in path.split(".")[1:]:
            value = value[part]
        expected = change
        for part in path.split(".")[1:]:
            expected = expected[part]
        assert value == expected, path


def test_a_name_too_long_for_the_runs_objects_is_refused_by_the_server(kube: Cluster, kube_namespace: str) -> None:
    """The CRD's root rule and ObjectMeta agree: 50 characters are accepted, 51 refused naming metadata.name."""
    from harnessrl.spec.kube import RUN_NAME_MAX

    doc = copy.deepcopy(MINIMAL)
    doc["metadata"]["name"] = "n" * RUN_NAME_MAX
    assert dry_run(kube, kube_namespace, doc)[0]
    doc["metadata"]["name"] += "n"
    accepted, refusal = dry_run(kube, kube_namespace, doc)
    assert not accepted and "metadata.name: Too long" in refusal and f"more than {RUN_NAME_MAX}" in refusal, refusal
