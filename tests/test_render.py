"""The operator's renderers: golden files, schema validation, the real API server, and the rules one by one.

Golden files: every TrainingRun in ``examples/*.yaml`` is rendered (its children plus one harness pod for a
fixed launch) and compared with ``tests/golden/render/<example>/<kind>-<name>.yaml``. After an intended
change, rewrite them with ``HARNESSRL_UPDATE_GOLDEN=1 pytest tests/test_render.py`` and review the diff.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from harnessrl.devcluster import Cluster
from harnessrl.local.runner import SERVED_MODEL_NAME as LOCAL_SERVED_MODEL_NAME
from harnessrl.operator import naming
from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.render import render_harness_pod, render_run_children
from harnessrl.operator.render_common import CACHE_DIR, SERVED_MODEL_NAME
from harnessrl.operator.render_learner import render_learner_job
from harnessrl.operator.render_network import render_network_policy
from harnessrl.operator.render_rollout import render_rollout_deployment
from harnessrl.operator.render_secret import SPEC_KEY, STORE_URL_KEY, render_run_secret, run_secret_name
from harnessrl.scheduler import Launch
from harnessrl.spec.commands import validate_file
from harnessrl.spec.documents import is_other_object, load_documents
from harnessrl.spec.models import TrainingRun
from harnessrl.spec.problems import parse_training_run

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "render"
UPDATE_GOLDEN = os.environ.get("HARNESSRL_UPDATE_GOLDEN") == "1"
NAMESPACE = "team-a"
UID = "0b7c4a52-3f4e-4c1a-9d2e-5a8f1e6b7c90"
CONFIG = OperatorConfig(
    proxy_image="ghcr.io/harnessrl/proxy:test",
    learner_image="ghcr.io/harnessrl/learner:test",
    store_url="postgresql+psycopg://harnessrl:secret@harnessrl-postgresql:5432/harnessrl",
)
TASK_IMAGE = "ghcr.io/example/harness:1"
KUBE_VERSIONS = ("1.30", "1.36")


def example_documents() -> dict[str, dict[str, Any]]:
    found = {}
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for document in load_documents(path.read_text()):
            if not is_other_object(document.data):
                found[path.stem] = document.data
    return found


EXAMPLES = example_documents()
CLUSTER = EXAMPLES["trainingrun-cluster"]
MINIMAL = EXAMPLES["trainingrun-minimal"]


def variant(base: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> TrainingRun:
    doc = copy.deepcopy(base)
    change(doc["spec"])
    return parse_training_run(doc)


def launch_for(run: TrainingRun, task: dict[str, Any] | None = None, timeout_s: float = 1800.0) -> Launch:
    """A fixed attempt; a run with no harness image gets a task that names one (else no pod can start)."""
    if task is None:
        task = {"id": "task-1", "data": {"question": "What is 2 + 3?", "answer": "5"}}
        if run.spec.harness.image is None:
            task["image"] = TASK_IMAGE
    name = run.metadata.name
    return Launch(name, f"{name}-g000002-r003", 1, task["id"], task, 4, timeout_s)


def render_all(run: TrainingRun, namespace: str = NAMESPACE, uid: str = UID) -> list[dict[str, Any]]:
    return [
        *render_run_children(run, namespace, uid, CONFIG),
        render_harness_pod(run, namespace, uid, CONFIG, launch_for(run)),
    ]


def by_kind(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(matches) == 1, f"{len(matches)} {kind} {name or ''} in {[o['kind'] for o in objects]}"
    return matches[0]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """name -> value, or the valueFrom mapping."""
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container.get("env", [])}


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    for item in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]:
        if item["name"] == name:
            return item
    raise AssertionError(f"no container {name}")


# Runs beyond the examples, so schema validation and the API server also see the other branches.
VARIANTS: dict[str, Callable[[], TrainingRun]] = {
    "hub-model": lambda: variant(
        CLUSTER,
        lambda s: s.update(
            model={
                "hub": {"id": "Qwen/Qwen3-8B", "revision": "main", "tokenSecret": {"name": "hf", "key": "t"}}
            }
        ),
    ),
    "upstreams": lambda: variant(
        MINIMAL,
        lambda s: s.update(
            rollout={"upstreams": ["http://10.1.2.3:8000/v1", "https://vllm.example/v1/"]},
            store={"postgres": {"url": "postgresql+psycopg://u@10.9.8.7:6543/db"}},
        ),
    ),
    "cpu-no-policy": lambda: variant(
        CLUSTER,
        lambda s: (
            s["rollout"].update(gpusPerReplica=0, tensorParallel=1, scheduling={}),
            s["learner"].update(gpusPerNode=0, nodes=1, scheduling={}),
            s["harness"]["sandbox"].update(networkPolicy="none", egress=[]),
        ),
    ),
}


def all_runs() -> dict[str, TrainingRun]:
    runs = {name: parse_training_run(doc) for name, doc in EXAMPLES.items()}
    runs.update({name: make() for name, make in VARIANTS.items()})
    return runs


# --- golden files ---------------------------------------------------------------------------------------------


def golden_name(obj: dict[str, Any]) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_golden(example: str) -> None:
    """Rendered objects equal the committed files (HARNESSRL_UPDATE_GOLDEN=1 rewrites them)."""
    objects = render_all(parse_training_run(EXAMPLES[example]))
    folder = GOLDEN / example
    rendered = {golden_name(obj): obj for obj in objects}
    assert len(rendered) == len(objects), "two objects would share a golden file"
    if UPDATE_GOLDEN:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in {p.name for p in folder.glob("*.yaml")} - set(rendered):
            (folder / stale).unlink()
        for name, obj in rendered.items():
            (folder / name).write_text(yaml.safe_dump(obj, sort_keys=False, allow_unicode=True, width=110))
    committed = {p.name for p in folder.glob("*.yaml")}
    assert committed == set(rendered), "golden files differ from the rendered objects; see the test docstring"
    for name, obj in rendered.items():
        assert yaml.safe_load((folder / name).read_text()) == obj, f"{folder / name} differs from the render"


def test_rendering_is_deterministic_and_shares_nothing() -> None:
    """Equal output for equal input, and no part shared between objects (YAML would show it as an alias),
    so a caller may change one rendered object without changing another."""
    for run in all_runs().values():
        objects = render_all(run)
        assert objects == render_all(run)
        assert "&id" not in yaml.safe_dump(objects)


# --- schemas and the API server --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", sorted(all_runs()))
def test_objects_pass_kubernetes_validate(name: str, version: str) -> None:
    for obj in render_all(all_runs()[name]):
        kubernetes_validate.validate(obj, version, strict=True)


def test_api_server_accepts_every_object(kube: Cluster, kube_namespace: str) -> None:
    """Server-side dry run of everything rendered (the owner uid need not exist for that); the
    RuntimeClass and PriorityClass the cluster example names must exist, or admission refuses its pods."""
    runtime_class = {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": "gvisor"},
        "handler": "runsc",
    }
    kube.kubectl("apply", "-f", "-", input=json.dumps(runtime_class))
    priority_class = {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": "gpu-training"},
        "value": 1000,
    }
    kube.kubectl("apply", "-f", "-", input=json.dumps(priority_class))
    for name, run in sorted(all_runs().items()):
        objects = render_all(run, namespace=kube_namespace)
        listing = {"apiVersion": "v1", "kind": "List", "items": objects}
        dry_run = ("apply", "--dry-run=server", "-n", kube_namespace, "-f", "-")
        result = kube.kubectl(*dry_run, input=json.dumps(listing), check=False)
        assert result.returncode == 0, f"{name}: {result.stderr}"
        assert "Warning" not in result.stderr, f"{name}: {result.stderr}"
        assert result.stdout.count("(server dry run)") == len(objects), result.stdout


# --- owners ----------------------------------------------------------------------------------------------------


def test_every_child_is_owned_by_the_run() -> None:
    for run in all_runs().values():
        for obj in render_all(run):
            (owner,) = obj["metadata"]["ownerReferences"]
            assert owner["uid"] == UID and owner["controller"] is True, obj["metadata"]["name"]
            assert owner["kind"] == "TrainingRun" and owner["name"] == run.metadata.name
            assert obj["metadata"]["namespace"] == NAMESPACE
            assert obj["metadata"]["labels"][naming.RUN_LABEL] == run.metadata.name


def test_children_without_rollout_servers_when_upstreams_are_given() -> None:
    run = VARIANTS["upstreams"]()
    kinds = [(o["kind"], o["metadata"]["name"]) for o in render_run_children(run, NAMESPACE, UID, CONFIG)]
    assert kinds == [
        ("Secret", "minimal-config"),
        ("Service", "minimal-learner"),
        ("NetworkPolicy", "minimal-harness"),
        ("Job", "minimal-learner"),
    ]
    proxy = container(render_harness_pod(run, NAMESPACE, UID, CONFIG, launch_for(run))["spec"], "proxy")
    assert env_of(proxy)["HARNESSRL_UPSTREAMS"] == "http://10.1.2.3:8000,https://vllm.example"
    command = by_kind(render_run_children(run, NAMESPACE, UID, CONFIG), "Job")["spec"]["template"]["spec"][
        "containers"
    ][0]["command"]
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--replica"] == [
        "http://10.1.2.3:8000",
        "https://vllm.example",
    ]


# --- the harness pod -------------------------------------------------------------------------------------------


def harness_pod(run: TrainingRun, **launch: Any) -> dict[str, Any]:
    return render_harness_pod(run, NAMESPACE, UID, CONFIG, launch_for(run, **launch))


def test_with_a_verifier_only_the_verifier_and_the_proxy_hold_the_reward_token() -> None:
    run = parse_training_run(EXAMPLES["trainingrun-verifier"])
    spec = harness_pod(run)["spec"]
    # proxy sidecar, then the harness to completion, then the verifier on the workspace it left
    assert [c["name"] for c in spec["initContainers"]] == ["proxy", "harness"]
    assert [c["name"] for c in spec["containers"]] == ["verifier"]
    token = {"secretKeyRef": {"name": "verified-reward", "key": "token"}}
    harness, verifier, proxy = (env_of(container(spec, name)) for name in ("harness", "verifier", "proxy"))
    assert proxy["HARNESSRL_REWARD_TOKEN"] == token and verifier["HARNESSRL_REWARD_TOKEN"] == token
    assert "HARNESSRL_REWARD_TOKEN" not in harness and "HARNESSRL_REWARD_URL" not in harness
    assert verifier["HARNESSRL_REWARD_URL"] == "http://127.0.0.1:8080/v1/reward"
    assert harness["HARNESSRL_WORKSPACE"] == verifier["HARNESSRL_WORKSPACE"] == "/workspace"
    assert verifier["HARNESSRL_ROLLOUT_ID"] == harness["HARNESSRL_ROLLOUT_ID"]
    for name in ("harness", "verifier"):
        assert {"name": "workspace", "mountPath": "/workspace"} in container(spec, name)["volumeMounts"]
    assert {"name": "workspace", "emptyDir": {}} in spec["volumes"]
    # the workspace is all they share: the verifier's /tmp (its HOME) is not the one the harness wrote in
    assert {"name": "tmp", "mountPath": "/tmp"} in container(spec, "harness")["volumeMounts"]
    assert {"name": "verifier-tmp", "mountPath": "/tmp"} in container(spec, "verifier")["volumeMounts"]
    assert {"name": "verifier-tmp", "emptyDir": {}} in spec["volumes"]
    assert container(spec, "verifier")["image"] == "ghcr.io/acme/test-runner:1"
    assert "shareProcessNamespace" not in spec  # the harness cannot read the other containers' environment
    # without a verifier the harness reports its own reward and no token exists
    plain = harness_pod(parse_training_run(CLUSTER))["spec"]
    assert "HARNESSRL_REWARD_URL" in env_of(container(plain, "harness"))
    assert "HARNESSRL_REWARD_TOKEN" not in env_of(container(plain, "proxy"))


def test_proxy_is_a_native_sidecar_that_must_answer_first() -> None:
    spec = harness_pod(parse_training_run(CLUSTER))["spec"]
    (proxy,) = spec["initContainers"]
    assert proxy["name"] == "proxy" and proxy["restartPolicy"] == "Always"
    assert proxy["command"] == ["harnessrl", "proxy"]
    assert "/healthz" in " ".join(proxy["startupProbe"]["exec"]["command"])
    assert [c["name"] for c in spec["containers"]] == ["harness"]
    assert spec["restartPolicy"] == "Never"


def test_harness_reaches_its_sidecar_on_the_spec_port() -> None:
    run = variant(CLUSTER, lambda s: s["proxy"].update(port=9123))
    spec = harness_pod(run)["spec"]
    harness, proxy = env_of(container(spec, "harness")), env_of(container(spec, "proxy"))
    assert harness["OPENAI_BASE_URL"] == "http://127.0.0.1:9123/v1"
    assert harness["HARNESSRL_REWARD_URL"] == "http://127.0.0.1:9123/v1/reward"
    assert harness["HARNESSRL_MODEL_NAME"] == proxy["HARNESSRL_MODEL_NAME"] == SERVED_MODEL_NAME
    assert (proxy["HARNESSRL_PROXY_HOST"], proxy["HARNESSRL_PROXY_PORT"]) == ("127.0.0.1", "9123")
    assert "127.0.0.1:9123/healthz" in container(spec, "proxy")["startupProbe"]["exec"]["command"][-1]
    assert SERVED_MODEL_NAME == LOCAL_SERVED_MODEL_NAME


def test_harness_contract_overrides_a_same_named_spec_variable() -> None:
    run = variant(CLUSTER, lambda s: s["harness"]["env"].append({"name": "OPENAI_BASE_URL", "value": "x"}))
    variables = container(harness_pod(run)["spec"], "harness")["env"]
    assert [v.get("value") for v in variables if v["name"] == "OPENAI_BASE_URL"] == [
        "http://127.0.0.1:8080/v1"
    ]
    assert env_of(container(harness_pod(run)["spec"], "harness"))["GITHUB_TOKEN"] == {
        "secretKeyRef": {"name": "github", "key": "token"}
    }


def test_active_deadline_is_the_attempt_timeout_rounded_up() -> None:
    run = parse_training_run(CLUSTER)
    assert harness_pod(run, timeout_s=1800.0)["spec"]["activeDeadlineSeconds"] == 1800
    assert harness_pod(run, timeout_s=90.2)["spec"]["activeDeadlineSeconds"] == 91


def test_task_image_overrides_the_harness_image() -> None:
    run = parse_training_run(CLUSTER)
    assert container(harness_pod(run)["spec"], "harness")["image"] == "ghcr.io/acme/swe-harness:1"
    task = {"id": "t", "image": "ghcr.io/acme/special:2", "data": {}}
    assert container(harness_pod(run, task=task)["spec"], "harness")["image"] == "ghcr.io/acme/special:2"


def test_no_image_anywhere_names_spec_harness_image() -> None:
    run = parse_training_run(MINIMAL)
    with pytest.raises(ValueError, match=r"spec\.harness\.image.*set spec\.harness\.image"):
        harness_pod(run, task={"id": "t", "data": {}})


def test_task_travels_in_one_annotation_as_file_and_env() -> None:
    run = parse_training_run(CLUSTER)
    task = {"id": "t-7", "data": {"question": "ünïcode", "n": [1, 2]}}
    pod = harness_pod(run, task=task)
    annotations = pod["metadata"]["annotations"]
    assert json.loads(annotations[naming.TASK_ANNOTATION]) == task
    assert annotations[naming.ROLLOUT_ANNOTATION] == "swe-qwen-g000002-r003"
    assert annotations[naming.ATTEMPT_ANNOTATION] == "1"
    assert annotations[naming.POLICY_VERSION_ANNOTATION] == "4"
    assert pod["metadata"]["name"] == naming.harness_pod_name("swe-qwen-g000002-r003", 1)
    field = f"metadata.annotations['{naming.TASK_ANNOTATION}']"
    (item,) = next(v for v in pod["spec"]["volumes"] if v["name"] == "task")["downwardAPI"]["items"]
    assert item == {"path": "task.json", "fieldRef": {"fieldPath": field}}
    harness = container(pod["spec"], "harness")
    assert {"name": "task", "mountPath": "/etc/harnessrl", "readOnly": True} in harness["volumeMounts"]
    variables = env_of(harness)
    assert variables["HARNESSRL_TASK"] == {"fieldRef": {"fieldPath": field}}
    assert variables["HARNESSRL_TASK_FILE"] == "/etc/harnessrl/task.json"
    assert (variables["HARNESSRL_ROLLOUT_ID"], variables["HARNESSRL_ATTEMPT"]) == (
        "swe-qwen-g000002-r003",
        "1",
    )


def test_a_task_too_large_for_the_annotations_is_refused() -> None:
    task = {"id": "big", "data": {"blob": "x" * (256 * 1024)}}
    with pytest.raises(ValueError, match="256 KiB"):
        harness_pod(parse_training_run(CLUSTER), task=task)


def test_proxy_settings_mirror_the_local_runner() -> None:
    pod = harness_pod(parse_training_run(CLUSTER))
    proxy = env_of(container(pod["spec"], "proxy"))
    assert json.loads(proxy["HARNESSRL_SAMPLING"]) == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4096}
    # pinned to one replica of the headless Service, recording that replica's weight label; no admin API
    assert proxy["HARNESSRL_UPSTREAMS"] == "dns://swe-qwen-rollout-pods:8000"
    assert (proxy["HARNESSRL_REPLICA_VERSIONS"], proxy["HARNESSRL_ADMIN"]) == ("true", "false")
    assert proxy["HARNESSRL_STORE_POOL_SIZE"] == "1"  # one connection per harness pod
    assert proxy["HARNESSRL_POLICY_VERSION"] == "4"
    assert (proxy["HARNESSRL_RUN"], proxy["HARNESSRL_ROLLOUT_ID"], proxy["HARNESSRL_ATTEMPT"]) == (
        "swe-qwen", "swe-qwen-g000002-r003", "1",
    )  # fmt: skip
    # every spec.proxy setting, through the one mapping `harnessrl run` uses too
    assert (proxy["HARNESSRL_QUEUE_SIZE"], proxy["HARNESSRL_QUEUE_MAX_BYTES"]) == ("512", str(256 * 1024**2))
    assert proxy["HARNESSRL_SPOOL_MAX_BYTES"] == str(1024**3)
    assert proxy["HARNESSRL_MAX_BODY_BYTES"] == "67108864"
    assert proxy["HARNESSRL_SPOOL_PATH"].startswith("/var/spool/harnessrl/")


def test_sandbox_on_every_harness_pod_container() -> None:
    pod = harness_pod(parse_training_run(CLUSTER))
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert spec["runtimeClassName"] == "gvisor"
    assert spec["securityContext"]["runAsNonRoot"] is True
    for item in [*spec["initContainers"], *spec["containers"]]:
        security = item["securityContext"]
        assert security["runAsNonRoot"] is True and security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container(spec, "proxy")["securityContext"]["readOnlyRootFilesystem"] is True
    assert "readOnlyRootFilesystem" not in container(spec, "harness")["securityContext"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container(spec, "harness")["volumeMounts"]
    assert "runtimeClassName" not in harness_pod(parse_training_run(MINIMAL))["spec"]


def test_the_sandbox_user_read_only_root_and_proxy_resources_come_from_the_spec() -> None:
    doc = copy.deepcopy(CLUSTER)
    doc["spec"]["harness"]["sandbox"].update(runAsUser=1000, readOnlyRootFilesystem=True)
    doc["spec"]["proxy"]["resources"] = {"requests": {"cpu": "250m"}, "limits": {"memory": "1Gi"}}
    spec = harness_pod(parse_training_run(doc))["spec"]
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]) == (1000, 1000)
    proxy = container(spec, "proxy")
    assert proxy["securityContext"]["runAsUser"] == 65532  # the proxy image's own user, whatever the sandbox
    assert proxy["resources"] == {"requests": {"cpu": "250m"}, "limits": {"memory": "1Gi"}}
    assert container(spec, "harness")["securityContext"]["readOnlyRootFilesystem"] is True
    # the defaults: 65532, a writable root, the proxy's built-in requests
    default = harness_pod(parse_training_run(CLUSTER))["spec"]
    assert default["securityContext"]["runAsUser"] == 65532
    assert container(default, "proxy")["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}}


# --- the store -------------------------------------------------------------------------------------------------


def test_store_secret_ref_reaches_proxy_and_learner_by_reference() -> None:
    run = parse_training_run(CLUSTER)
    ref = {"secretKeyRef": {"name": "harnessrl-db", "key": "url"}}
    pod_spec = harness_pod(run)["spec"]
    assert env_of(container(pod_spec, "proxy"))["HARNESSRL_STORE_URL"] == ref
    assert "HARNESSRL_STORE_URL" not in env_of(container(pod_spec, "harness"))
    job_spec = render_learner_job(run, NAMESPACE, UID, CONFIG)["spec"]["template"]["spec"]
    assert env_of(container(job_spec, "learner"))["HARNESSRL_STORE_URL"] == ref
    assert env_of(container(job_spec, "db-upgrade"))["HARNESSRL_STORE_URL"] == ref
    assert container(job_spec, "db-upgrade")["command"] == ["harnessrl", "db", "upgrade"]
    assert not any("secret" in arg or "postgres" in arg for arg in container(job_spec, "learner")["command"])
    secret = render_run_secret(run, NAMESPACE, UID, CONFIG)
    assert STORE_URL_KEY not in secret["data"]


def test_default_store_is_the_operators_through_the_run_secret() -> None:
    run = parse_training_run(MINIMAL)
    secret = render_run_secret(run, NAMESPACE, UID, CONFIG)
    assert base64.b64decode(secret["data"][STORE_URL_KEY]).decode() == CONFIG.store_url
    ref = {"secretKeyRef": {"name": run_secret_name("minimal"), "key": STORE_URL_KEY}}
    assert env_of(container(harness_pod(run)["spec"], "proxy"))["HARNESSRL_STORE_URL"] == ref
    with pytest.raises(ValueError, match=r"spec\.store"):
        render_run_children(run, NAMESPACE, UID, OperatorConfig(store_url=""))


def test_learner_reads_the_run_from_the_secret(tmp_path: Path) -> None:
    """The file ``harnessrl learn --spec`` reads is a valid TrainingRun equal to the run."""
    run = parse_training_run(CLUSTER)
    secret = render_run_secret(run, NAMESPACE, UID, CONFIG)
    text = base64.b64decode(secret["data"][SPEC_KEY]).decode()
    (tmp_path / SPEC_KEY).write_text(text)
    assert validate_file(str(tmp_path / SPEC_KEY))[0] == 0
    assert parse_training_run(json.loads(text)).spec == run.spec
    job = render_learner_job(run, NAMESPACE, UID, CONFIG)
    spec = job["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "spec")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    command = container(spec, "learner")["command"]
    mount = next(m for m in container(spec, "learner")["volumeMounts"] if m["name"] == "spec")
    assert command[command.index("--spec") + 1] == f"{mount['mountPath']}/{SPEC_KEY}"


# --- vLLM ------------------------------------------------------------------------------------------------------


def vllm(run: TrainingRun) -> dict[str, Any]:
    return render_rollout_deployment(run, NAMESPACE, UID, CONFIG)["spec"]["template"]["spec"]["containers"][0]


def test_hub_model_reads_its_token_from_the_secret() -> None:
    run = VARIANTS["hub-model"]()
    server = vllm(run)
    assert server["args"][0] == "Qwen/Qwen3-8B"
    assert server["args"][server["args"].index("--revision") + 1] == "main"
    assert env_of(server)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "t"}}
    assert "HF_HUB_OFFLINE" not in env_of(server)
    assert env_of(server)["HF_HOME"].startswith(CACHE_DIR) and "--download-dir" not in server["args"]
    job_spec = render_learner_job(run, NAMESPACE, UID, CONFIG)["spec"]["template"]["spec"]
    download = container(job_spec, "model")
    assert env_of(download)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "t"}}
    command = container(job_spec, "learner")["command"]
    assert command[command.index("--model") + 1] == env_of(download)["HARNESSRL_MODEL_DIR"]


def test_model_on_a_claim_is_mounted_read_only() -> None:
    run = parse_training_run(CLUSTER)
    server = vllm(run)
    assert server["args"][0] == "/models/qwen3-8b"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in server["volumeMounts"]
    assert env_of(server)["HF_HUB_OFFLINE"] == "1"
    volumes = render_rollout_deployment(run, NAMESPACE, UID, CONFIG)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models"}} in volumes
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in volumes


def test_checkpoints_are_read_by_vllm_where_the_learner_writes_them() -> None:
    run = parse_training_run(CLUSTER)
    assert {"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True} in vllm(run)["volumeMounts"]
    job_spec = render_learner_job(run, NAMESPACE, UID, CONFIG)["spec"]["template"]["spec"]
    learner = container(job_spec, "learner")
    assert {"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": False} in learner["volumeMounts"]
    assert learner["command"][learner["command"].index("--output") + 1] == "/checkpoints/swe-qwen"


def test_two_claims_at_one_path_are_refused() -> None:
    def checkpoints_at_models(pvc: str) -> Callable[[dict[str, Any]], None]:
        volume = {"pvc": pvc, "mountPath": "/models", "readOnly": False}
        return lambda s: s["learner"].update(checkpointVolume=volume, checkpointDir="/models/ckpt")

    other = variant(CLUSTER, checkpoints_at_models("other"))
    with pytest.raises(ValueError, match=r"spec\.learner\.checkpointVolume\.mountPath.*spec\.model\.volume"):
        render_rollout_deployment(other, NAMESPACE, UID, CONFIG)
    same = variant(CLUSTER, checkpoints_at_models("models"))
    job_spec = render_learner_job(same, NAMESPACE, UID, CONFIG)["spec"]["template"]["spec"]
    claims = [m for m in container(job_spec, "learner")["volumeMounts"] if m["mountPath"] == "/models"]
    assert claims == [{"name": "model", "mountPath": "/models", "readOnly": False}]


def test_lora_enables_runtime_adapters_with_a_rank_vllm_accepts() -> None:
    server = vllm(parse_training_run(CLUSTER))
    args = server["args"]
    assert "--enable-lora" in args and args[args.index("--max-lora-rank") + 1] == "64"
    assert env_of(server)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    odd = vllm(variant(CLUSTER, lambda s: s["learner"]["lora"].update(rank=24)))["args"]
    assert odd[odd.index("--max-lora-rank") + 1] == "32"
    full = vllm(
        variant(CLUSTER, lambda s: (s["weightSync"].update(method="reload"), s["learner"].pop("lora")))
    )
    assert "--enable-lora" not in full["args"] and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env_of(full)
    # The adapter is the policy ("policy", what the proxy sends); the base keeps a name of its own.
    assert args[args.index("--served-model-name") + 1] == "policy-base"
    assert full["args"][full["args"].index("--served-model-name") + 1] == "policy"
    with pytest.raises(ValueError, match=r"spec\.learner\.lora\.rank"):
        vllm(variant(CLUSTER, lambda s: s["learner"]["lora"].update(rank=1000)))


def test_vllm_command_and_env() -> None:
    server = vllm(parse_training_run(CLUSTER))
    assert server["command"] == ["vllm", "serve"]
    args = server["args"]
    for flag, value in [
        ("--port", "8002"),
        ("--served-model-name", "policy-base"),  # a LoRA run: the base under its own name
        ("--max-model-len", "32768"),
        ("--tensor-parallel-size", "2"),
        ("--host", "127.0.0.1"),  # behind its gate: test_vllm_is_reached_only_through_its_gate
    ]:
        assert args[args.index(flag) + 1] == value
    assert args[-1] == "--enable-prefix-caching"
    assert env_of(server)["VLLM_SERVER_DEV_MODE"] == "1" and env_of(server)["VLLM_LOGGING_LEVEL"] == "INFO"
    assert "ports" not in server


def test_gpus_only_when_asked_for() -> None:
    server = vllm(parse_training_run(CLUSTER))
    assert (
        server["resources"]["limits"]["nvidia.com/gpu"]
        == server["resources"]["requests"]["nvidia.com/gpu"]
        == "2"
    )
    assert server["resources"]["requests"]["cpu"] == "8"
    cpu = VARIANTS["cpu-no-policy"]()
    assert "nvidia.com/gpu" not in json.dumps(render_run_children(cpu, NAMESPACE, UID, CONFIG))


def test_vllm_probes_wait_for_the_model_not_the_http_server() -> None:
    server = vllm(parse_training_run(CLUSTER))
    startup = server["startupProbe"]
    assert startup["httpGet"]["path"] == "/v1/models" and startup["periodSeconds"] == 10
    assert startup["periodSeconds"] * startup["failureThreshold"] >= CONFIG.provisioning_timeout_seconds
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"  # the gate's: /health once at the run's version
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    # through the gate's public port: vLLM listens on loopback, where the kubelet's probes cannot connect
    assert {probe["httpGet"]["port"] for probe in (startup, server["readinessProbe"], server["livenessProbe"])} == {
        naming.VLLM_PORT
    }


def test_rollout_services() -> None:
    run = parse_training_run(CLUSTER)
    children = render_run_children(run, NAMESPACE, UID, CONFIG)
    plain = by_kind(children, "Service", naming.rollout_name("swe-qwen"))["spec"]
    headless = by_kind(children, "Service", naming.rollout_pods_name("swe-qwen"))["spec"]
    selector = naming.selector("swe-qwen", naming.ROLLOUT)
    assert plain["selector"] == headless["selector"] == selector
    assert plain["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert headless["ports"] == [  # the learner reaches each replica's control port by the headless name
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"},
        {"name": "control", "port": 8001, "targetPort": "control", "protocol": "TCP"},
    ]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is False
    deployment = by_kind(children, "Deployment")
    assert deployment["spec"]["selector"]["matchLabels"] == selector
    assert deployment["spec"]["replicas"] == 2


# --- the learner -----------------------------------------------------------------------------------------------


def test_learner_is_an_indexed_job_with_a_rendezvous_service() -> None:
    run = parse_training_run(CLUSTER)
    children = render_run_children(run, NAMESPACE, UID, CONFIG)
    job, service = by_kind(children, "Job"), by_kind(children, "Service", naming.learner_name("swe-qwen"))
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == naming.selector("swe-qwen", naming.LEARNER)
    assert spec["template"]["metadata"]["labels"] == naming.labels("swe-qwen", naming.LEARNER)
    learner = container(pod, "learner")
    variables = env_of(learner)
    assert variables["MASTER_ADDR"] == "swe-qwen-learner-0.swe-qwen-learner"
    assert variables["MASTER_PORT"] == "29500" and variables["NNODES"] == "2"
    assert variables["NODE_RANK"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    command = learner["command"]
    assert command[:3] == ["torchrun", "--nnodes=$(NNODES)", "--nproc-per-node=$(NPROC_PER_NODE)"]
    assert variables["NPROC_PER_NODE"] == "8" and "--node-rank=$(NODE_RANK)" in command
    # the run's name comes from the spec file: a --run after torchrun's -m is taken for its own --run-path
    assert "--run" not in command and command[command.index("--steps") + 1] == "200"
    # every replica, by the headless Service's DNS answer at each sync (the Service would pick one at random)
    # on the gate's control port, the only one that serves pause and weight loading
    assert command[command.index("--replica") + 1] == "dns://swe-qwen-rollout-pods:8001"
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert learner["image"] == CONFIG.learner_image
    image = variant(CLUSTER, lambda s: s["learner"].update(image="ghcr.io/acme/learner:9"))
    assert (
        container(render_learner_job(image, NAMESPACE, UID, CONFIG)["spec"]["template"]["spec"], "learner")[
            "image"
        ]
        == "ghcr.io/acme/learner:9"
    )


# --- the NetworkPolicy -----------------------------------------------------------------------------------------


def test_network_policy_none_creates_none() -> None:
    """``networkPolicy: none`` is about the harness pods: the policy in front of vLLM's control port stays."""
    run = VARIANTS["cpu-no-policy"]()
    assert render_network_policy(run, NAMESPACE, UID, CONFIG) is None
    policies = [o for o in render_run_children(run, NAMESPACE, UID, CONFIG) if o["kind"] == "NetworkPolicy"]
    assert [policy["metadata"]["name"] for policy in policies] == ["swe-qwen-rollout"]


def test_vllm_is_reached_only_through_its_gate() -> None:
    """vLLM listens on its pod's loopback; the gate is the pod's listener, with the OpenAI paths on the public
    port and everything on the control port; proxies get the public port, the learner the control port."""
    run = parse_training_run(CLUSTER)
    pod = render_rollout_deployment(run, NAMESPACE, UID, CONFIG)["spec"]["template"]["spec"]
    assert [item["name"] for item in pod["containers"]] == ["vllm", "gate"]
    args = container(pod, "vllm")["args"]
    assert (args[args.index("--host") + 1], args[args.index("--port") + 1]) == ("127.0.0.1", "8002")
    gate = container(pod, "gate")
    assert gate["command"] == ["harnessrl", "vllm-gate"] and gate["image"] == CONFIG.proxy_image
    assert gate["args"][:6] == ["--upstream", "http://127.0.0.1:8002", "--port", "8000", "--control-port", "8001"]
    # It restores a restarted vLLM from the learner's marker on the checkpoint volume, which it mounts read-only.
    marker = gate["args"][gate["args"].index("--served-marker") + 1]
    mounts = {m["mountPath"]: m for m in gate["volumeMounts"]}
    assert marker == f"{run.spec.learner.checkpoint_dir}/served.json"  # where the learner writes it
    assert any(marker.startswith(path + "/") and m.get("readOnly") for path, m in mounts.items())
    assert gate["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "control", "containerPort": 8001, "protocol": "TCP"},
    ]
    assert gate["securityContext"]["readOnlyRootFilesystem"] is True
    assert gate["securityContext"]["runAsNonRoot"] is True
    children = render_run_children(run, NAMESPACE, UID, CONFIG)
    harness = render_harness_pod(run, NAMESPACE, UID, CONFIG, launch_for(run))["spec"]
    assert env_of(container(harness, "proxy"))["HARNESSRL_UPSTREAMS"] == "dns://swe-qwen-rollout-pods:8000"
    learner = container(by_kind(children, "Job")["spec"]["template"]["spec"], "learner")["command"]
    assert [learner[i + 1] for i, arg in enumerate(learner) if arg == "--replica"] == [
        "dns://swe-qwen-rollout-pods:8001"
    ]


def test_only_the_runs_learner_may_reach_the_vllm_control_port() -> None:
    run = parse_training_run(CLUSTER)
    children = render_run_children(run, NAMESPACE, UID, CONFIG)
    policy = by_kind(children, "NetworkPolicy", "swe-qwen-rollout")["spec"]
    assert policy["podSelector"]["matchLabels"] == naming.selector("swe-qwen", naming.ROLLOUT)
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 8000}]},  # proxies, probes, Prometheus: the OpenAI paths only
        {
            "from": [{"podSelector": {"matchLabels": naming.selector("swe-qwen", naming.LEARNER)}}],
            "ports": [{"protocol": "TCP", "port": 8001}],
        },
    ]
    # the learner's pods carry the labels the policy admits
    job = by_kind(children, "Job")["spec"]["template"]["metadata"]["labels"]
    assert naming.selector("swe-qwen", naming.LEARNER).items() <= job.items()
    # and a harness may never leave for any port of the vLLM pods but the public one
    harness = by_kind(children, "NetworkPolicy", "swe-qwen-harness")["spec"]["egress"]
    to_rollout = [rule for rule in harness if "podSelector" in json.dumps(rule.get("to", []))
                  and naming.ROLLOUT in json.dumps(rule)]
    assert to_rollout == [{"to": [{"podSelector": {"matchLabels": naming.selector("swe-qwen", naming.ROLLOUT)}}],
                           "ports": [{"protocol": "TCP", "port": 8000}]}]
    # a run on servers of its own gets no vLLM pods, so no policy for them
    upstreams = render_run_children(VARIANTS["upstreams"](), NAMESPACE, UID, CONFIG)
    assert [o["metadata"]["name"] for o in upstreams if o["kind"] == "NetworkPolicy"] == ["minimal-harness"]


def test_network_policy_custom_adds_the_egress_cidrs() -> None:
    policy = render_network_policy(parse_training_run(CLUSTER), NAMESPACE, UID, CONFIG)
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == naming.selector("swe-qwen", naming.HARNESS)
    # Nothing may connect to a harness pod but Prometheus, to the proxy's metrics listener alone.
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["ingress"] == [{"ports": [{"protocol": "TCP", "port": CONFIG.proxy_metrics_port}]}]
    egress = spec["egress"]
    assert {
        "to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
        "ports": [{"protocol": "TCP", "port": 443}],
    } in egress
    rollout = {"podSelector": {"matchLabels": naming.selector("swe-qwen", naming.ROLLOUT)}}
    assert {"to": [rollout], "ports": [{"protocol": "TCP", "port": 8000}]} in egress
    assert {"ports": [{"protocol": "TCP", "port": 5432}]} in egress  # the URL is in a Secret not read here
    dns = next(rule for rule in egress if {"protocol": "UDP", "port": 53} in rule.get("ports", []))
    assert dns["to"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}},
        {"ipBlock": {"cidr": "169.254.20.10/32"}},  # NodeLocal DNSCache, in the host network of each node
    ]


def test_the_proxys_metrics_listener_is_on_the_pods_address_or_off() -> None:
    """The sidecar serves /metrics on the pod's address at the operator's port (named for the PodMonitor), its API
    on loopback; with the port 0 there is neither the listener nor the policy's ingress rule."""
    run = parse_training_run(CLUSTER)
    launch = launch_for(run)
    pod = render_harness_pod(run, NAMESPACE, UID, CONFIG, launch)
    proxy = pod["spec"]["initContainers"][0]
    env = {item["name"]: item.get("value") for item in proxy["env"]}
    assert env["HARNESSRL_PROXY_HOST"] == "127.0.0.1"
    assert env["HARNESSRL_METRICS_PORT"] == str(CONFIG.proxy_metrics_port)
    assert proxy["ports"] == [{"name": "proxy-metrics", "containerPort": CONFIG.proxy_metrics_port, "protocol": "TCP"}]
    off = dataclasses.replace(CONFIG, proxy_metrics_port=0)
    proxy = render_harness_pod(run, NAMESPACE, UID, off, launch)["spec"]["initContainers"][0]
    assert "ports" not in proxy and "HARNESSRL_METRICS_PORT" not in {item["name"] for item in proxy["env"]}
    assert render_network_policy(run, NAMESPACE, UID, off)["spec"]["ingress"] == []


def test_the_store_port_comes_from_the_url_the_operator_resolved() -> None:
    """A store URL read from the run's Secret gives the policy its port (and address, for an IP literal)."""
    run = parse_training_run(CLUSTER)
    url = "postgresql+psycopg://u:p@10.3.3.3:6432/db"
    children = render_run_children(run, NAMESPACE, UID, CONFIG, store_url=url)
    egress = by_kind(children, "NetworkPolicy", "swe-qwen-harness")["spec"]["egress"]
    assert {"to": [{"ipBlock": {"cidr": "10.3.3.3/32"}}], "ports": [{"protocol": "TCP", "port": 6432}]} in egress
    assert not any(rule.get("ports") == [{"protocol": "TCP", "port": 5432}] for rule in egress)
    by_name = render_network_policy(run, NAMESPACE, UID, CONFIG, "postgresql://u@db.example:7000/db")
    assert {"ports": [{"protocol": "TCP", "port": 7000}]} in by_name["spec"]["egress"]


def test_network_policy_proxy_only_with_literal_addresses() -> None:
    policy = render_network_policy(VARIANTS["upstreams"](), NAMESPACE, UID, CONFIG)
    egress = policy["spec"]["egress"]
    assert {
        "to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}],
        "ports": [{"protocol": "TCP", "port": 8000}],
    } in egress
    assert {"ports": [{"protocol": "TCP", "port": 443}]} in egress
    assert {
        "to": [{"ipBlock": {"cidr": "10.9.8.7/32"}}],
        "ports": [{"protocol": "TCP", "port": 6543}],
    } in egress
    assert not any("ipBlock" in str(rule) and "10.20" in str(rule) for rule in egress)


# --- scheduling ------------------------------------------------------------------------------------------------


def test_each_components_scheduling_reaches_its_pods_and_only_its_pods() -> None:
    """spec.<component>.scheduling lands in that component's pod spec, spelled as Kubernetes spells it; a
    component without one renders none of the fields (the cluster's defaults apply)."""
    tolerate = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    term = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}
    run = variant(
        MINIMAL,
        lambda s: (
            s.setdefault("rollout", {}).update(scheduling={"tolerations": tolerate, "priorityClassName": "hi"}),
            s.setdefault("learner", {}).update(
                scheduling={"affinity": affinity, "serviceAccountName": "trainer", 
                            "nodeSelector": {"b": "2", "a": "1"}}
            ),
            s["harness"].update(scheduling={"imagePullSecrets": [{"name": "regcred"}]}),
        ),
    )
    objects = render_all(run)
    rollout = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    learner = by_kind(objects, "Job")["spec"]["template"]["spec"]
    harness = by_kind(objects, "Pod")["spec"]
    assert rollout["tolerations"] == tolerate and rollout["priorityClassName"] == "hi"
    assert learner["affinity"] == affinity and learner["serviceAccountName"] == "trainer"
    assert list(learner["nodeSelector"].items()) == [("a", "1"), ("b", "2")]
    assert harness["imagePullSecrets"] == [{"name": "regcred"}]
    fields = {"nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets"}
    fields.add("serviceAccountName")
    assert fields & set(rollout) == {"tolerations", "priorityClassName"}
    assert fields & set(learner) == {"affinity", "serviceAccountName", "nodeSelector"}
    assert fields & set(harness) == {"imagePullSecrets"}
    for pod in (rollout, learner, harness):  # no harnessrl pod calls the API, whatever account it runs as
        assert pod["automountServiceAccountToken"] is False
    plain = render_all(parse_training_run(MINIMAL))
    for obj in plain:
        pod = obj["spec"]["template"]["spec"] if obj["kind"] in ("Deployment", "Job") else obj.get("spec", {})
        assert not fields & set(pod), obj["kind"]


# --- writable paths under read-only root filesystems -----------------------------------------------------------

CACHE_VARIABLES = (
    "HOME", "XDG_CACHE_HOME", "HF_HOME", "TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
    "TORCH_EXTENSIONS_DIR", "TMPDIR",
)  # fmt: skip


def writable_mounts(pod: dict[str, Any], item: dict[str, Any]) -> list[str]:
    """The mount paths of ``item`` the container may write: emptyDirs and claims not mounted read-only."""
    kinds = {volume["name"]: volume for volume in pod["volumes"]}
    return [
        mount["mountPath"]
        for mount in item.get("volumeMounts", [])
        if not mount.get("readOnly") and {"emptyDir", "persistentVolumeClaim"} & set(kinds[mount["name"]])
    ]


@pytest.mark.parametrize("name", ["trainingrun-cluster", "hub-model"])
def test_learner_and_vllm_write_only_to_volumes(name: str) -> None:
    """Every learner and vLLM container has a read-only root filesystem, and HOME and each cache directory
    (torch, triton, inductor, DeepSpeed's extensions, huggingface, vLLM's own) lie on a writable volume; the
    learner's pod gives fresh claims its group without walking a large volume at every start."""
    run = all_runs()[name]
    deployment = render_rollout_deployment(run, NAMESPACE, UID, CONFIG)["spec"]["template"]["spec"]
    job = render_learner_job(run, NAMESPACE, UID, CONFIG)["spec"]["template"]["spec"]
    assert job["securityContext"] == {"fsGroup": 65532, "fsGroupChangePolicy": "OnRootMismatch"}
    checked = 0
    for pod in (deployment, job):
        for item in [*pod.get("initContainers", []), *pod["containers"]]:
            assert item["securityContext"]["readOnlyRootFilesystem"] is True, item["name"]
            writable = writable_mounts(pod, item)
            variables = env_of(item)
            wanted = CACHE_VARIABLES + (("VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT") if item["name"] == "vllm" else ())
            for variable in wanted:
                path = variables[variable]
                inside = any(path == root or path.startswith(root + "/") for root in writable)
                assert inside, (item["name"], variable, path)
                checked += 1
            assert "/tmp" in writable, item["name"]
    assert checked >= 3 * len(CACHE_VARIABLES)  # vLLM, the schema upgrade and the learner at least
    # The checkpoint claim is the learner's to write, and vLLM only reads it.
    if run.spec.learner.checkpoint_volume is not None:
        path = run.spec.learner.checkpoint_volume.mount_path
        assert path in writable_mounts(job, container(job, "learner"))
        assert path not in writable_mounts(deployment, deployment["containers"][0])


# --- names and images that follow from the spec ----------------------------------------------------------------


def test_every_name_derived_from_the_longest_run_name_is_valid() -> None:
    """A run name at the limit (spec.kube.RUN_NAME_MAX) keeps every child's name, the learner pods' host names
    and the label values a DNS-1035 label of at most 63 characters; one more character is refused."""
    from harnessrl.spec.kube import RUN_NAME_MAX

    doc = copy.deepcopy(CLUSTER)
    doc["metadata"]["name"] = "r" * RUN_NAME_MAX
    run = parse_training_run(doc)
    names = []
    for obj in render_all(run):
        if obj["kind"] != "Pod":  # a pod's name may be longer (its host name is cut to 63)
            names.append(obj["metadata"]["name"])
        names += obj["metadata"].get("labels", {}).values()
        if obj["kind"] == "Job":
            names.append(f"{obj['metadata']['name']}-{obj['spec']['completions'] * 50 - 1}")  # pod host names
    longest = max(names, key=len)
    services = [o["metadata"]["name"] for o in render_all(run) if o["kind"] == "Service"]
    assert len(longest) <= 63 and max(len(n) for n in services) == 63, longest
    doc["metadata"]["name"] += "r"
    with pytest.raises(Exception, match="limit is 50"):
        parse_training_run(doc)


def test_cpu_replicas_get_the_cpu_build_of_vllm_unless_an_image_is_named() -> None:
    cpu = variant(MINIMAL, lambda s: s.setdefault("rollout", {}).update(gpusPerReplica=0))
    server = vllm(cpu)
    assert server["image"] == CONFIG.vllm_cpu_image
    assert server["args"][-3:] == ["--enforce-eager", "--distributed-executor-backend", "uni"]
    assert "resources" not in server or "nvidia.com/gpu" not in json.dumps(server["resources"])
    gpu = vllm(parse_training_run(MINIMAL))
    assert gpu["image"] == "vllm/vllm-openai:v0.32.0" and "--enforce-eager" not in gpu["args"]
    named = variant(MINIMAL, lambda s: s.setdefault("rollout", {}).update(gpusPerReplica=0, image="my/vllm:1"))
    assert vllm(named)["image"] == "my/vllm:1"


def test_a_task_above_the_env_limit_is_in_the_file_alone() -> None:
    """Kubernetes would start the harness with a 200 KiB env var and the exec would fail (E2BIG)."""
    task = {"id": "big", "data": {"blob": "x" * (200 * 1024)}}
    pod = harness_pod(parse_training_run(CLUSTER), task=task)
    harness = env_of(container(pod["spec"], "harness"))
    assert "HARNESSRL_TASK" not in harness and harness["HARNESSRL_TASK_FILE"] == "/etc/harnessrl/task.json"
    assert "HARNESSRL_TASK" in env_of(container(harness_pod(parse_training_run(CLUSTER))["spec"], "harness"))
