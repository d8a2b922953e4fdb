"""A run stays deletable when no operator runs (issue 22, item 13): kopf keeps a finalizer on every run while
the operator runs, and the operator takes it off as it stops, so after `helm uninstall` (the operator's pod
stopped) `kubectl delete tr` completes; a restarted operator puts it back."""

from __future__ import annotations

import json

import pytest
from test_operator_cluster import get, operator, training_run, wait_for

from harnessrl.devcluster import Cluster

pytestmark = pytest.mark.postgres
FINALIZER = "harnessrl.io/finalizer"


def finalizers(kube: Cluster, ns: str) -> list[str]:
    return get(kube, ns, "tr", "kept")["metadata"].get("finalizers") or []


def test_a_run_is_deletable_once_the_operator_stopped(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = kube_namespace
    kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(training_run("kept", pg_url)))
    with operator(kube, ns, monkeypatch):
        wait_for("the operator's finalizer", lambda: FINALIZER in finalizers(kube, ns))
    assert FINALIZER not in finalizers(kube, ns)  # taken off as the operator stopped
    with operator(kube, ns, monkeypatch):
        wait_for("the finalizer back", lambda: FINALIZER in finalizers(kube, ns))
    kube.kubectl("delete", "tr", "kept", "-n", ns, "--wait=true", "--timeout=30s")  # no operator runs now
