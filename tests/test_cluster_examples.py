"""The examples' cluster halves (examples/*/trainingrun-cluster.yaml) as the API server and the operator take them:
every object passes Kubernetes' schemas, the TrainingRun the CRD's schema and the webhook's rules, each image is
one the dev cluster builds (`scripts/kube.sh images`), and a harness pod renders with its verifier on the
example's own task. They run through the operator on the real node in test_real_node_examples.py."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from test_crd import crd_validator

from harnessrl.devcluster.images import IMAGES
from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.render_harness import render_harness_pod
from harnessrl.scheduler import Launch
from harnessrl.spec.documents import is_other_object
from harnessrl.spec.problems import parse_training_run, validate_document

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("vowels", "search", "swe")
BUILT = {ref for image in IMAGES for ref in (image.ref, *image.aliases)}


def documents(example: str) -> list[dict]:
    return list(yaml.safe_load_all((ROOT / "examples" / example / "trainingrun-cluster.yaml").read_text()))


def images_of(document: dict) -> list[str]:
    text = json.dumps(document)
    return sorted({ref for ref in BUILT if f'"{ref}"' in text} | {
        value for key, value in _leaves(document) if key == "image"})


def _leaves(node: object, key: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, k)
    elif isinstance(node, list):
        for v in node:
            yield from _leaves(v, key)
    else:
        yield key, node


@pytest.mark.parametrize("example", EXAMPLES)
def test_each_object_is_valid_and_each_image_is_built_by_the_dev_cluster(example: str) -> None:
    docs = documents(example)
    runs = [doc for doc in docs if not is_other_object(doc)]
    assert len(runs) == 1 and runs[0]["metadata"]["name"] == example
    crd_validator().validate(runs[0])
    assert validate_document(runs[0]) == []
    for doc in docs:
        if is_other_object(doc):
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    used = [image for doc in docs for image in images_of(doc)]
    assert used and set(used) <= BUILT, f"not built by scripts/kube.sh images: {sorted(set(used) - BUILT)}"


@pytest.mark.parametrize("example", ["search", "swe"])
def test_the_harness_pod_runs_its_image_then_the_verifier_on_the_examples_task(example: str) -> None:
    """The harness (an init container) and the verifier (the main container) run the example's image, read-only
    and with memory limits; the tasks come from the ConfigMap the example names, and its tasks fit a pod."""
    run = parse_training_run(documents(example)[-1], cluster=True)
    assert run.spec.harness.tasks.config_map.name == f"{example}-tasks"
    line = (ROOT / "examples" / example / "tasks.jsonl").read_text().splitlines()[0]
    task = json.loads(line)
    launch = Launch(example, f"{example}-g000001-r000", 1, task["id"], task, 0, 600.0)
    config = OperatorConfig(store_url="postgresql://harnessrl@db/harnessrl")
    pod = render_harness_pod(run, "team-a", "uid-1", config, launch)["spec"]
    harness = next(c for c in pod["initContainers"] if c["name"] == "harness")
    (verifier,) = pod["containers"]
    image = f"ghcr.io/harnessrl/harness-{example}:0.1.0"
    assert harness["image"] == verifier["image"] == image
    assert verifier["command"] == ["harnessrl", example, "verify"]
    for container in (harness, verifier):
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["resources"]["limits"]["memory"]
