"""The vowels example's reward per step through the operator on a real node, beside `harnessrl run`'s.

The same spec (examples/vowels/trainingrun-cluster.yaml is examples/vowels/trainingrun.yaml with images, volumes
and a ConfigMap of the same tasks), the same steps: the two curves should agree within sampling noise, since only
the machinery differs (pods, Services, the chart's PostgreSQL and a DeepSpeed Job instead of processes and
SQLite). Prints both curves, their means and the difference of the means in units of its standard error.

Needs a cluster with a real node and the images imported (`scripts/kube.sh up --real-node`, then
`scripts/kube.sh images`) and KUBECONFIG pointing at it (`eval "$(scripts/kube.sh env)"`). It installs the chart
(release harnessrl in harnessrl-system) unless it is there, runs in the namespace bench-vowels (deleted first),
then runs the local spec in a temporary run directory.

    python bench/reward_curve.py --steps 6
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import create_engine, select

from harnessrl.devcluster import chart
from harnessrl.devcluster.chart import SMALL_NODE_VALUES
from harnessrl.devcluster.helm import ensure_helm
from harnessrl.store.schema import LearnerStep

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vowels"
RELEASE, SYSTEM, NAMESPACE = "harnessrl", "harnessrl-system", "bench-vowels"


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True)
    if check and done.returncode != 0:
        sys.exit(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def get(*args: str) -> dict[str, Any]:
    return json.loads(kubectl("get", *args, "-o", "json"))


def rewards(store_url: str, run: str) -> list[float]:
    """Each learner step's mean reward, in step order."""
    engine = create_engine(store_url)
    with engine.connect() as conn:
        rows = conn.execute(select(LearnerStep.metrics).where(LearnerStep.run == run).order_by(LearnerStep.step))
        curve = [float(metrics["reward_mean"]) for (metrics,) in rows]
    engine.dispose()
    return curve


def through_the_operator(steps: int) -> list[float]:
    if kubectl("get", "deployment", RELEASE, "-n", SYSTEM, check=False).strip() == "":
        subprocess.run([str(ensure_helm()), "install", RELEASE, str(ROOT / "charts" / "harnessrl"), "--namespace",
                        SYSTEM, "--create-namespace", "--wait", "--timeout", "600s", *SMALL_NODE_VALUES], check=True)
    kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true", "--timeout=300s")
    kubectl("create", "namespace", NAMESPACE)
    kubectl("create", "configmap", "vowels-tasks", "-n", NAMESPACE,
            f"--from-file=tasks.jsonl={EXAMPLE / 'tasks.jsonl'}")
    *prepare, run = yaml.safe_load_all((EXAMPLE / "trainingrun-cluster.yaml").read_text())
    kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=yaml.safe_dump_all(prepare))
    kubectl("wait", "-n", NAMESPACE, "--for=condition=complete", "job/vowels-tiny-model", "--timeout=900s")
    run["spec"]["learner"]["steps"] = steps
    # A name of its own: the chart's store keeps every earlier run's rows, and a TrainingRun of a name it already
    # holds continues that run.
    name = run["metadata"]["name"] = f"vowels-{int(time.time())}"
    kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=json.dumps(run))
    deadline = time.monotonic() + 3600
    while (status := get("tr", name, "-n", NAMESPACE).get("status", {})).get("phase") != "Succeeded":
        if status.get("phase") == "Failed" or time.monotonic() > deadline:
            sys.exit(f"the run through the operator did not succeed: {status}")
        time.sleep(10)
    return rewards(chart.store_url(get, RELEASE, SYSTEM), name)


def locally(steps: int) -> list[float]:
    """The local spec on a tiny model built as the cluster example's Job builds it (`harnessrl tiny-model DIR`)."""
    harnessrl = str(Path(sys.executable).parent / "harnessrl")
    with tempfile.TemporaryDirectory(prefix="reward-curve-") as scratch:
        model, run_dir = Path(scratch) / "tiny-model", Path(scratch) / "run"
        subprocess.run([harnessrl, "tiny-model", str(model)], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([harnessrl, "run", str(EXAMPLE / "trainingrun.yaml"), "--steps", str(steps), "--model",
                        str(model), "--run-dir", str(run_dir), "--no-live"], check=True, stdout=subprocess.DEVNULL)
        return rewards(json.loads((run_dir / "run.json").read_text())["store"], "vowels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if not os.environ.get("KUBECONFIG"):
        sys.exit('KUBECONFIG is not set: eval "$(scripts/kube.sh env)" first')
    started = time.monotonic()
    operator = through_the_operator(args.steps)
    operator_s = time.monotonic() - started
    print(f"through the operator: {[round(r, 3) for r in operator]} in {operator_s:.0f} s", flush=True)
    started = time.monotonic()
    local = locally(args.steps)
    local_s = time.monotonic() - started
    print(f"{'step':>4}  {'harnessrl run':>13}  {'operator':>8}")
    for step, (a, b) in enumerate(zip(local, operator, strict=True), start=1):
        print(f"{step:>4}  {a:>13.3f}  {b:>8.3f}")
    mean_local, mean_operator = statistics.fmean(local), statistics.fmean(operator)
    # Steps are not independent draws (the policy moves), so this is a rough yardstick, not a test.
    error = math.sqrt((statistics.pvariance(local) + statistics.pvariance(operator)) / len(local)) or float("nan")
    print(f"mean  {mean_local:>13.3f}  {mean_operator:>8.3f}")
    print(f"difference of the means: {mean_operator - mean_local:+.3f} ({(mean_operator - mean_local) / error:+.1f} "
          f"standard errors); wall time: harnessrl run {local_s:.0f} s, operator {operator_s:.0f} s "
          f"(ratio {operator_s / local_s:.2f})")


if __name__ == "__main__":
    main()
