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
@click.option(
    "--log-format",
    type=click.Choice(["full", "plain", "json"]),
    default="full",
    show_default=True,
    help="Log lines as text with time and logger (full), message only (plain), or JSON for log collectors.",
)
@click.option("--verbose", is_flag=True, help="Log every handler and API call (kopf's verbose level).")
def operator_command(
    namespaces: tuple[str, ...], liveness: str, standalone: bool, metrics_port: int, log_format: str, verbose: bool
) -> None:
    """Reconcile TrainingRuns into vLLM Deployments, harness pods and a learner Job."""
    import kopf
    from prometheus_client import start_http_server

    import harnessrl.operator.handlers  # noqa: F401 - registers the handlers
    from harnessrl.operator.metrics import METRICS

    # kopf.run() leaves logging unset (only `kopf run` configures it): without this the operator's pod log
    # would show warnings alone, never the phases, pods and passes at INFO.
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat[log_format.upper()])

    if metrics_port:
        start_http_server(metrics_port, registry=METRICS.registry)

    kopf.run(
        standalone=standalone,
        namespaces=list(namespaces),
        clusterwide=not namespaces,
        liveness_endpoint=liveness,
    )
