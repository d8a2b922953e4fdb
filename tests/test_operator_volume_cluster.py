"""The checkpoint claim a run's learner and vLLM share (issue 22, item 6), on the real control plane: its
access modes are reported in the CheckpointsShared condition (ReadWriteMany shares across nodes,
ReadWriteOnce only on one), a ReadWriteOncePod claim that can never be shared and a missing claim keep the run
Pending naming the field and the fix, and a run without a claim is refused by the API server."""

from __future__ import annotations

import copy
import json

import pytest
from test_operator_cluster import checkpoint_claim, operator, training_run, wait_for
from test_operator_outage_cluster import phase

from harnessrl.devcluster import Cluster

pytestmark = pytest.mark.postgres


def on_claim(doc: dict, claim: str) -> dict:
    doc = copy.deepcopy(doc)
    doc["spec"]["learner"]["checkpointVolume"]["pvc"] = claim
    return doc


def test_the_checkpoint_claims_access_modes_are_reported(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = kube_namespace
    checkpoint_claim(kube, ns, "one-node", ("ReadWriteOnce",))
    checkpoint_claim(kube, ns, "one-pod", ("ReadWriteOncePod",))
    docs = {
        "shared": training_run("shared", pg_url),
        "one-node": on_claim(training_run("one-node", pg_url), "one-node"),
        "one-pod": on_claim(training_run("one-pod", pg_url), "one-pod"),
        "missing": on_claim(training_run("missing", pg_url), "nowhere"),
    }
    bare = training_run("bare", pg_url)
    del bare["spec"]["learner"]["checkpointVolume"]
    bare["spec"]["learner"]["checkpointDir"] = "checkpoints"
    refused = kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(bare), check=False)
    assert refused.returncode != 0 and "spec.learner.checkpointVolume: Invalid value" in refused.stderr
    assert "ReadWriteMany" in refused.stderr, refused.stderr
    with operator(kube, ns, monkeypatch):
        for doc in docs.values():
            kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))

        def shared(run: str) -> dict | None:
            conditions = {c["type"]: c for c in phase(kube, ns, run).get("conditions", [])}
            return conditions.get("CheckpointsShared")

        good = wait_for("shared: the condition", lambda: shared("shared"))
        assert (good["status"], good["reason"]) == ("True", "ReadWriteMany"), good
        once = wait_for("one-node: the condition", lambda: shared("one-node"))
        assert (once["status"], once["reason"]) == ("False", "NotShareableAcrossNodes"), once
        assert "ReadWriteOnce" in once["message"] and "Multi-Attach" in once["message"]
        for run, words in (("one-pod", "ReadWriteOncePod"), ("missing", "not found")):
            status = wait_for(f"{run}: refused", lambda run=run: (s := phase(kube, ns, run)).get("message") and s)
            assert (status["phase"], status["reason"]) == ("Pending", "InvalidSpec"), status
            assert "spec.learner.checkpointVolume.pvc" in status["message"] and words in status["message"]
        kube.kubectl("delete", "tr", "--all", "-n", ns, "--wait=true", "--timeout=90s")
