"""The product end to end on the real node, as a user meets it: the images built from images/, `helm install`
of the chart (the operator and the embedded PostgreSQL run from those images, the webhook serves), then
`kubectl apply` of examples/vowels/trainingrun-cluster.yaml. The operator starts the CPU vLLM Deployment, the
harness pods with their proxy sidecar and the DeepSpeed learner Job; calls are captured into the chart's
PostgreSQL, the learner trains and syncs weights to vLLM, and the run ends Succeeded. Then `kubectl get tr`,
`harnessrl status` on the store and `harnessrl export` of the last version (loaded by transformers) are checked.

Slow (images of several GiB, vLLM and a learner on 2 cores): the spec runs 2 steps of 4 tasks here.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import kube_helpers
from harnessrl.devcluster import Cluster
from harnessrl.devcluster.helm import ensure_helm
from harnessrl.devcluster.images import ensure_images, import_images

pytestmark = [
    pytest.mark.real_node,
    pytest.mark.slow,
    # Opt-in until it has passed on an idle CI-sized machine: its first runs here shared 2 cores with other
    # test suites (load 15-20), and vLLM's and the proxies' probes timed out (see the issue's note).
    pytest.mark.skipif(
        os.environ.get("HARNESSRL_TEST_E2E") != "1", reason="set HARNESSRL_TEST_E2E=1 to run the end-to-end run"
    ),
]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vowels" / "trainingrun-cluster.yaml"
RELEASE, SYSTEM, TEAM = "harnessrl", "harnessrl-system", "team-a"
STEPS = 2
wait_for = functools.partial(kube_helpers.wait_for, every=2.0)


def get(cluster: Cluster, *args: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def diagnose(cluster: Cluster) -> str:
    """What a failed wait shows: the pods, the run's status and the operator's last log lines."""
    pods = cluster.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
    run = cluster.kubectl("get", "tr", "-n", TEAM, "-o", "yaml", check=False).stdout
    operator = cluster.kubectl("logs", "-n", SYSTEM, f"deploy/{RELEASE}", "--tail=40", check=False).stdout
    return f"\n{pods}\n{run[-3000:]}\n{operator[-3000:]}"


@pytest.fixture(scope="module")
def installed(real_cluster: Cluster) -> Cluster:
    built = ensure_images(log=lambda line: None)
    socket = Path(real_cluster.node["run"]) / "containerd.sock"
    import_images("ctr", str(socket), built=built, log=lambda line: None)
    helm = ensure_helm()
    real_cluster.kubectl("create", "namespace", SYSTEM)
    result = subprocess.run(
        [str(helm), "--kubeconfig", str(real_cluster.kubeconfig), "install", RELEASE, str(ROOT / "charts" / "harnessrl"),
         "--namespace", SYSTEM, "--wait", "--timeout", "600s",
         "--set", "postgresql.persistence.size=1Gi",
         "--set", "postgresql.resources.requests.memory=128Mi", "--set", "operator.resources.requests.memory=128Mi"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + diagnose(real_cluster)
    return real_cluster


def store_url(cluster: Cluster) -> str:
    """The chart's store URL, with the Service's ClusterIP for its name (this process is on the node)."""
    secret = get(cluster, "secret", "-n", SYSTEM, f"{RELEASE}-postgresql")
    url = base64.b64decode(secret["data"]["url"]).decode()
    service = get(cluster, "service", "-n", SYSTEM, f"{RELEASE}-postgresql")
    return url.replace(f"@{RELEASE}-postgresql:", f"@{service['spec']['clusterIP']}:")


def test_vowels_trains_through_the_operator(installed: Cluster, tmp_path: Path) -> None:
    cluster = installed
    operator = get(cluster, "pods", "-n", SYSTEM, "-l", "app.kubernetes.io/component=operator")["items"]
    assert [c["image"] for c in operator[0]["spec"]["containers"]] == ["ghcr.io/harnessrl/operator:0.1.0"]
    cluster.kubectl("create", "namespace", TEAM)
    cluster.kubectl("create", "configmap", "vowels-tasks", "-n", TEAM,
                    f"--from-file=tasks.jsonl={ROOT / 'examples' / 'vowels' / 'tasks.jsonl'}")
    *prepare, run = yaml.safe_load_all(EXAMPLE.read_text())
    cluster.kubectl("apply", "-n", TEAM, "-f", "-", input=yaml.safe_dump_all(prepare))
    done = cluster.kubectl("wait", "-n", TEAM, "--for=condition=complete", "job/vowels-tiny-model",
                           "--timeout=600s", check=False, timeout=660)
    assert done.returncode == 0, done.stderr + diagnose(cluster)
    run["spec"]["learner"]["steps"] = STEPS
    run["spec"]["harness"]["concurrency"] = 4  # 2 cores: vLLM, the learner and 4 harness pods at once
    cluster.kubectl("apply", "-n", TEAM, "-f", "-", input=json.dumps(run))

    def phase() -> dict[str, Any]:
        status = get(cluster, "tr", "vowels", "-n", TEAM).get("status", {})
        assert status.get("phase") != "Failed", f"the run failed: {status}" + diagnose(cluster)
        return status

    try:
        status = wait_for("the run to succeed", lambda: (s := phase()).get("phase") == "Succeeded" and s,
                          timeout=1800)
    except AssertionError as error:
        raise AssertionError(str(error) + diagnose(cluster)) from None
    assert status["step"] == STEPS and status["policyVersion"] >= 1, status
    assert status["rollouts"]["succeeded"] >= STEPS * 4 * 4  # tasksPerStep x groupSize per step
    table = cluster.kubectl("get", "tr", "-n", TEAM).stdout
    assert "Succeeded" in table and "STEP" in table and "REWARD" in table, table

    url = store_url(cluster)
    shown = subprocess.run([sys.executable, "-c", "from harnessrl.cli import main; main()", "status", url,
                            "--run", "vowels"], capture_output=True, text=True, cwd="/")
    assert shown.returncode == 0, shown.stderr
    assert f"step {STEPS}" in shown.stdout or f"{STEPS}/{STEPS}" in shown.stdout, shown.stdout

    # The checkpoints are on the node's disk, where the provisioner made their volume.
    claim = get(cluster, "pvc", "vowels-checkpoints", "-n", TEAM)
    volume = get(cluster, "pv", claim["spec"]["volumeName"])
    host = Path((volume["spec"].get("hostPath") or volume["spec"]["local"])["path"])
    exported = subprocess.run(
        [sys.executable, "-c", "from harnessrl.cli import main; main()", "export", url, "--run", "vowels",
         "--checkpoints", str(host / "vowels"), "--output", str(tmp_path / "model")],
        capture_output=True, text=True, cwd="/",
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert model.config.model_type == "qwen2"
