"""The chart's Grafana dashboards, generated from code with grafana-foundation-sdk (never hand-edited JSON).

    python charts/dashboards.py     # rewrites charts/harnessrl/dashboards/*.json

Four dashboards, each with variables for the Prometheus data source, namespace and run: the run overview (phase,
step, policy version, reward mean and spread, rollouts by state, rollouts/s), the capture proxy, the learner and
the operator. Every query names only metrics the code exports (tests/test_chart.py holds each name against the
proxy's, learner's and operator's real registries, and the chart's JSON against this file's output).

It lives beside the chart, not in it, so `helm package` ships the JSON and not the generator.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.stat import Panel as Stat
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableOption, VariableRefresh

OUTPUT = Path(__file__).resolve().parent / "harnessrl" / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = 'namespace=~"$namespace", run=~"$run"'
"""Every series is selected by these labels: the operator's carry them (its ServiceMonitor honours them); a
proxy's, learner's or vLLM replica's get them from its pod's scrape (the namespace, and the run from the pod's
label: the chart's PodMonitors)."""
RATE = "$__rate_interval"


def query(expr: str, legend: str = "") -> Dataquery:
    target = Dataquery().expr(expr).datasource(DATASOURCE)
    return target.legend_format(legend) if legend else target


def timeseries(title: str, unit: str, *targets: Dataquery, description: str = "") -> Timeseries:
    panel = Timeseries().title(title).unit(unit).datasource(DATASOURCE).height(8).span(12)
    for index, target in enumerate(targets):
        panel = panel.with_target(target.ref_id(chr(ord("A") + index)))
    return panel.description(description) if description else panel


def stat(title: str, unit: str, target: Dataquery) -> Stat:
    return Stat().title(title).unit(unit).datasource(DATASOURCE).height(4).span(6).with_target(target.ref_id("A"))


def quantiles(metric: str, by: str = "") -> Iterator[Dataquery]:
    group = f"le, {by}" if by else "le"
    for q in (0.5, 0.95, 0.99):
        legend = f"p{round(q * 100)}" + (f" {{{{{by}}}}}" if by else "")
        yield query(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{RUN}}}[{RATE}])))", legend)


def base(title: str, uid: str, description: str) -> Dashboard:
    namespace = (
        QueryVariable("namespace").label("Namespace").datasource(DATASOURCE)
        .query("label_values(harnessrl_operator_run_phase, namespace)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True)
        .current(VariableOption(text="All", value="$__all", selected=True))
    )
    run = (
        QueryVariable("run").label("Run").datasource(DATASOURCE)
        .query('label_values(harnessrl_operator_run_phase{namespace=~"$namespace"}, run)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True)
        .current(VariableOption(text="All", value="$__all", selected=True))
    )
    return (
        Dashboard(title).uid(uid).description(description).tags(["harnessrl"]).refresh("30s")
        .time("now-3h", "now").timezone("browser")
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(namespace).with_variable(run)
    )


def rate(metric: str, by: str = "") -> str:
    """Per second over Grafana's rate interval, summed (by ``by``) over the selected runs' series."""
    group = f" by ({by}) " if by else ""
    return f"sum{group}(rate({metric}{{{RUN}}}[{RATE}]))"


def of(metric: str, aggregate: str = "sum", by: str = "") -> str:
    group = f" by ({by}) " if by else ""
    return f"{aggregate}{group}({metric}{{{RUN}}})"


Queries = tuple[tuple[str, str], ...]
"""(PromQL, legend) pairs of one panel."""


def panels(board: Dashboard, rows: dict[str, list[tuple[str, str, Queries] | Timeseries]]) -> Dashboard:
    """Rows of time series panels, each given as (title, unit, queries) or already built."""
    for row, contents in rows.items():
        board = board.with_row(Row(row))
        for item in contents:
            if not isinstance(item, tuple):
                board = board.with_panel(item)
                continue
            title, unit, queries = item
            board = board.with_panel(timeseries(title, unit, *(query(expr, legend) for expr, legend in queries)))
    return board


def run_overview() -> Dashboard:
    board = (
        base("harnessrl / runs", "harnessrl-runs", "Phase, progress, reward and rollouts of TrainingRuns.")
        .with_row(Row("Progress"))
        .with_panel(stat("Phase", "none", query(f"{of('harnessrl_operator_run_phase', 'max', 'phase')} == 1",
                                                "{{phase}}")))
        .with_panel(stat("Step", "none", query(of("harnessrl_learner_step", "max"))))
        .with_panel(stat("Policy version", "none", query(of("harnessrl_learner_policy_version", "max"))))
        .with_panel(stat("Replicas' synced version", "none", query(of("harnessrl_learner_synced_version", "min"))))
    )
    mean, spread = f"harnessrl_learner_reward_mean{{{RUN}}}", f"harnessrl_learner_reward_std{{{RUN}}}"
    return panels(board, {
        "Reward and rollouts": [
            ("Reward mean and spread per step", "none",
             ((mean, "mean {{run}}"), (f"{mean} + {spread}", "+1 sd {{run}}"), (f"{mean} - {spread}", "-1 sd {{run}}"))),
            ("Rollouts by state", "none", ((of("harnessrl_operator_rollouts", by="state"), "{{state}}"),)),
            ("Rollouts per second", "ops",
             ((rate("harnessrl_learner_rollouts_consumed_total", "run"), "consumed {{run}}"),
              (rate("harnessrl_operator_pods_created_total", "run"), "pods started {{run}}"))),
            timeseries("Zero-variance groups per second", "ops",
                       query(rate("harnessrl_learner_zero_variance_groups_total", "run"), "{{run}}"),
                       description="Task groups whose rewards were all equal: they give no gradient."),
            timeseries("Evaluation on held-out tasks", "none",
                       query(of("harnessrl_operator_evaluation_reward_mean", "max", "run"), "mean reward {{run}}"),
                       query(of("harnessrl_operator_evaluation_pass_rate", "max", "run"), "pass rate {{run}}"),
                       description="The newest complete evaluation round (spec.evaluation): never trained on."),
        ],
    })


def proxy() -> Dashboard:
    board = base("harnessrl / capture proxy", "harnessrl-proxy", "The capture proxies of every harness pod.")
    return panels(board, {
        "Traffic": [
            ("Requests per second", "reqps",
             ((rate("harnessrl_proxy_requests_total", "route, status"), "{{route}} {{status}}"),)),
            timeseries("Request latency", "s", *quantiles("harnessrl_proxy_request_seconds")),
            timeseries("Upstream latency", "s", *quantiles("harnessrl_proxy_upstream_seconds")),
            ("Tokens per second", "short",
             ((rate("harnessrl_proxy_prompt_tokens_total"), "prompt"),
              (rate("harnessrl_proxy_completion_tokens_total"), "completion"))),
        ],
        "Capture": [
            ("Capture queue", "short",
             ((of("harnessrl_proxy_queue_depth"), "items"), (of("harnessrl_proxy_in_flight"), "calls in flight"))),
            timeseries("Spooled and replayed calls per second", "ops",
                       query(rate("harnessrl_proxy_spooled_items_total"), "spooled"),
                       query(rate("harnessrl_proxy_replayed_items_total"), "replayed"),
                       query(of("harnessrl_proxy_spool_pending"), "pending"),
                       description="Spooled: the store was unreachable; replayed into it later."),
            ("Paused for a weight sync", "none",
             ((of("harnessrl_proxy_paused", by="run"), "paused proxies {{run}}"),
              (of("harnessrl_proxy_policy_version", "max", "run"), "policy version {{run}}"))),
            ("Store write errors per second", "ops",
             ((rate("harnessrl_proxy_write_errors_total"), "errors"),
              (of("harnessrl_proxy_writer_failing"), "failing writers"))),
        ],
    })


def learner() -> Dashboard:
    def gauge(title: str, unit: str, *names: str, description: str = "") -> Timeseries:
        return timeseries(title, unit, *(query(f"harnessrl_learner_{n}{{{RUN}}}", f"{n} {{{{run}}}}")
                                         for n in names), description=description)

    board = base("harnessrl / learner", "harnessrl-learner", "Losses, clipping, KL and throughput of the learner.")
    return panels(board, {
        "Optimisation": [
            gauge("Loss", "none", "loss", "pg_loss"),
            gauge("Clip fractions", "percentunit", "clip_frac", "clip_frac_low", "clip_frac_high"),
            gauge("KL", "none", "approx_kl", "rollout_kl",
                  description="approx_kl: step-start vs current policy; rollout_kl: current vs rollout."),
            gauge("Entropy", "none", "entropy"),
            gauge("Gradient norm", "none", "grad_norm"),
            gauge("Tokens per second", "short", "tokens_per_second"),
        ],
        "Off-policy": [
            gauge("Rollout vs learner log-probs", "none", "logprob_abs_diff", "logprob_pearson",
                  description="Mean |difference| and correlation on the same generated tokens."),
            gauge("Staleness", "none", "staleness_mean", "staleness_max"),
            gauge("Step time", "s", "step_seconds", "train_seconds", "sync_seconds"),
        ],
        "Merge": [
            gauge("Merge quality", "none", "merge_token_ratio", "rows_per_rollout",
                  description="merge_token_ratio: training tokens / final trajectory tokens of the step's rollouts "
                              "(1.0: a perfect merge); rows_per_rollout: training rows per trained rollout (1: "
                              "every trajectory one row)."),
            ("Row splits by reason", "short",
             ((f"{rate('harnessrl_learner_row_splits_total', 'reason')} or vector(0)", "{{reason}}"),)),
        ],
    })


def operator() -> Dashboard:
    board = base("harnessrl / operator", "harnessrl-operator", "Reconciles, errors and harness pods of the operator.")
    return panels(board, {
        "Reconciles": [
            ("Reconciles per second", "ops", ((rate("harnessrl_operator_reconciles_total", "result"), "{{result}}"),)),
            ("Reconcile errors per second", "ops",
             ((rate("harnessrl_operator_reconcile_errors_total", "run"), "{{run}}"),)),
        ],
        "Harness pods": [
            ("Pods per second", "ops",
             ((rate("harnessrl_operator_pods_created_total"), "created"),
              (rate("harnessrl_operator_pods_deleted_total"), "deleted"),
              (rate("harnessrl_operator_pod_create_failures_total"), "refused"))),
            timeseries("Pod start (created to running)", "s", *quantiles("harnessrl_operator_pod_start_seconds")),
            ("Attempts waiting for a slot", "none", ((of("harnessrl_operator_queue_depth", by="run"), "{{run}}"),)),
        ],
    })


DASHBOARDS = {"runs": run_overview, "proxy": proxy, "learner": learner, "operator": operator}


def render() -> dict[str, str]:
    """File name -> dashboard JSON (sorted keys, so regenerating gives the same bytes)."""
    encoder = JSONEncoder(sort_keys=True, indent=2)
    return {f"{name}.json": encoder.encode(build().build()) + "\n" for name, build in DASHBOARDS.items()}


def main() -> None:
    OUTPUT.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        json.loads(text)
        (OUTPUT / name).write_text(text)
        print(OUTPUT / name)


if __name__ == "__main__":
    main()
