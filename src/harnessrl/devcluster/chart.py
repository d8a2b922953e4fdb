"""The chart on the dev cluster's real node, as the end-to-end test and ``bench/reward_curve.py`` install it.

Both talk to the chart's embedded PostgreSQL from the node itself, outside the cluster's DNS: its Service is
headless (no ClusterIP), so the URL in the chart's Secret gets the PostgreSQL pod's address for its host name.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

SMALL_NODE_VALUES = (
    "--set", "postgresql.persistence.size=1Gi",
    "--set", "postgresql.resources.requests.memory=128Mi", "--set", "operator.resources.requests.memory=128Mi",
    # Harness pods fill a 2-core node's CPU: a deleted PostgreSQL or operator pod must get back before them.
    "--set", "postgresql.priorityClassName=system-cluster-critical",
    "--set", "operator.priorityClassName=system-cluster-critical",
)  # fmt: skip
"""``helm install`` values for one 2-core node running vLLM, a learner and harness pods beside the chart."""


def store_url(get: Callable[..., dict[str, Any]], fullname: str, namespace: str) -> str:
    """The embedded store's URL, reachable from the node. ``get(*args)`` is ``kubectl get *args -o json``;
    ``fullname`` is the release's full name (the release's own name when it contains ``harnessrl``)."""
    from sqlalchemy.engine import make_url

    name = f"{fullname}-postgresql"
    secret = get("secret", name, "-n", namespace)
    url = make_url(base64.b64decode(secret["data"]["url"]).decode())
    pod = get("pod", f"{name}-0", "-n", namespace)
    return url.set(host=pod["status"]["podIP"]).render_as_string(hide_password=False)
