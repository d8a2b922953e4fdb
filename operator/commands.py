"""``harnessrl operator``: run the TrainingRun operator (the chart's Deployment runs this)."""

from __future__ import annotations

import click


@click.command("operator")
@click.option(
    "--namespace",
    "-n",
    "namespaces",
    multiple=True,
    help="Watch only these namespaces (repeatable); default: every namespace.",
)
@click.option(
    "--liveness",
    default="http://0.0.0.0:8080/healthz",
    show_default=True,
    help="Liveness endpoint kopf serves (the chart's livenessProbe).",
)
@click.option(
    "--standalone/--peering",
    default=True,
    show_default=True,
    help="Standalone: one operator replica (no kopf peering objects needed).",
)
@click.option(
    "--metrics-port",
    type=int,
    default=9090,
    show_default=True,
    help="Serve the harnessrl_operator_* Prometheus metrics on this port (0: off).",
)
def operator_command(namespaces: tuple[str, ...], liveness: str, standalone: bool, metrics_port: int) -> None:
    """Reconcile TrainingRuns into vLLM Deployments, harness pods and a learner Job."""
    import kopf
    from prometheus_client import start_http_server

    import harnessrl.operator.handlers  # noqa: F401 - registers the handlers
    from harnessrl.operator.metrics import METRICS

    if metrics_port:
        start_http_server(metrics_port, registry=METRICS.registry)

    kopf.run(
        standalone=standalone,
        namespaces=list(namespaces),
        clusterwide=not namespaces,
        liveness_endpoint=liveness,
    )
