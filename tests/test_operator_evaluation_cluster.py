"""The operator schedules evaluation rollouts on the real control plane (kwok plays the kubelet, the test plays
each harness, PostgreSQL is the store): the baseline round of version 0 runs as harness pods whose sidecars
carry the evaluation's sampling, and ``status.evaluation`` reports it with its numbers; once the learner's last
step is committed, the final version is evaluated before the run succeeds."""

from __future__ import annotations

import json

import pytest
from test_operator_cluster import Harnesses, get, harness_pods, operator, training_run, wait_for

from harnessrl.operator.naming import ROLLOUT_ANNOTATION
from harnessrl.rollout_ids import is_evaluation
from harnessrl.store import TraceStore
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.store.schema import EVALUATION, Rollout

pytestmark = pytest.mark.postgres


def env_of_proxy(pod: dict) -> dict[str, str]:
    sidecar = next(c for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
                   if c["name"] == "proxy")
    return {e["name"]: e.get("value") for e in sidecar.get("env", [])}


def test_a_run_reports_its_baseline_evaluation_in_status(kube, kube_namespace, pg_url, monkeypatch) -> None:
    ns, run = kube_namespace, "evals"
    document = training_run(run, pg_url)
    document["spec"]["evaluation"] = {
        "tasks": {"inline": [{"id": "h1", "data": {"q": 3}}, {"id": "h2", "data": {"q": 4}}]},
        "samplesPerTask": 2, "temperature": 0.5, "passReward": 0.5,
    }
    sidecars: dict[str, dict[str, str]] = {}  # evaluation rollout -> its proxy sidecar's environment

    def outcome(rollout: str, attempt: int) -> tuple[float, int]:
        """Evaluation pods of task h1 score 1.0, of h2 0.25; training pods 1.0."""
        if is_evaluation(rollout):
            pod = next(p for p in harness_pods(kube, ns, run)
                       if p["metadata"]["annotations"][ROLLOUT_ANNOTATION] == rollout)
            sidecars[rollout] = env_of_proxy(pod)
        return (0.25 if "-t0001-" in rollout else 1.0, 0)

    harnesses = Harnesses(kube, ns, run, pg_url, outcome)
    with operator(kube, ns, monkeypatch):
        kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(document))
        harnesses.start()
        try:
            evaluation = wait_for(
                "the baseline evaluation to end",
                lambda: (e if (e := get(kube, ns, "tr", run).get("status", {}).get("evaluation"))
                         and e["versions"][0]["ended"] == 4 else None),
            )
            # The learner (none runs under kwok) commits its 3 steps and the replicas serve version 3: the run
            # evaluates that final version before it succeeds.
            with TraceStore.connect(pg_url) as store:
                ledger = LearnerLedger(store, run)
                for step in (1, 2, 3):
                    ledger.commit(step, f"/ckpt/v{step}", {}, [])
                    store.mark_policy_synced(run, step)
            final = wait_for(
                "the run to succeed",
                lambda: (s if (s := get(kube, ns, "tr", run).get("status", {})).get("phase") == "Succeeded"
                         else None),
            )
        finally:
            harnesses.close()
    assert evaluation["versions"] == [{"version": 0, "rollouts": 4, "ended": 4, "rewardMean": 0.625,
                                       "passRate": 0.5, "passAtK": 0.5, "failed": 0, "timedOut": 0}]
    assert evaluation["bestVersion"] == 0
    assert [v["version"] for v in final["evaluation"]["versions"]] == [0, 3]
    assert final["evaluation"]["versions"][1]["ended"] == 4 and final["message"] == "trained 3 steps"
    assert len(sidecars) == 8  # the baseline's 4 and the final version's 4
    assert all(json.loads(env["HARNESSRL_EVALUATION_SAMPLING"]) == {"temperature": 0.5, "top_p": 1.0}
               for env in sidecars.values())
    with TraceStore.connect(pg_url) as store, store.engine.connect() as conn:
        rows = conn.execute(Rollout.__table__.select().where(Rollout.run == run, Rollout.kind == EVALUATION)).all()
        assert sorted((r.evaluated_version, r.task_id) for r in rows) == [
            (version, f"eval:{task}") for version in (0, 3) for task in ("h1", "h1", "h2", "h2")
        ]
