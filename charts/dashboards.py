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
"""Every series is selected by these labels: the operator's own (honorLabels), the proxies' and vLLM's from the
PodMonitor (pod namespace, harnessrl.io/run label)."""
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


def run_overview() -> Dashboard:
    return (
        base("harnessrl / runs", "harnessrl-runs", "Phase, progress, reward and rollouts of TrainingRuns.")
        .with_row(Row("Progress"))
        .with_panel(stat("Phase", "none", query(f"max by (phase) (harnessrl_operator_run_phase{{{RUN}}}) == 1",
                                                "{{phase}}")))
        .with_panel(stat("Step", "none", query(f"max(harnessrl_learner_step{{{RUN}}})")))
        .with_panel(stat("Policy version", "none", query(f"max(harnessrl_learner_policy_version{{{RUN}}})")))
        .with_panel(stat("Replicas' synced version", "none",
                         query(f"min(harnessrl_learner_synced_version{{{RUN}}})")))
        .with_row(Row("Reward"))
        .with_panel(timeseries(
            "Reward mean and spread per step", "none",
            query(f"harnessrl_learner_reward_mean{{{RUN}}}", "mean {{run}}"),
            query(f"harnessrl_learner_reward_mean{{{RUN}}} + harnessrl_learner_reward_std{{{RUN}}}", "+1 sd {{run}}"),
            query(f"harnessrl_learner_reward_mean{{{RUN}}} - harnessrl_learner_reward_std{{{RUN}}}", "-1 sd {{run}}"),
        ))
        .with_panel(timeseries(
            "Rollouts by state", "none",
            query(f"sum by (state) (harnessrl_operator_rollouts{{{RUN}}})", "{{state}}"),
        ))
        .with_panel(timeseries(
            "Rollouts per second", "ops",
            query(f"sum by (run) (rate(harnessrl_learner_rollouts_consumed_total{{{RUN}}}[{RATE}]))",
                  "consumed {{run}}"),
            query(f"sum by (run) (rate(harnessrl_operator_pods_created_total{{{RUN}}}[{RATE}]))",
                  "pods started {{run}}"),
        ))
        .with_panel(timeseries(
            "Zero-variance groups per second", "ops",
            query(f"sum by (run) (rate(harnessrl_learner_zero_variance_groups_total{{{RUN}}}[{RATE}]))", "{{run}}"),
            description="Task groups whose rewards were all equal: they give no gradient.",
        ))
    )


def proxy() -> Dashboard:
    return (
        base("harnessrl / capture proxy", "harnessrl-proxy", "The capture proxies of every harness pod.")
        .with_row(Row("Traffic"))
        .with_panel(timeseries(
            "Requests per second", "reqps",
            query(f"sum by (route, status) (rate(harnessrl_proxy_requests_total{{{RUN}}}[{RATE}]))",
                  "{{route}} {{status}}"),
        ))
        .with_panel(timeseries("Request latency", "s", *quantiles("harnessrl_proxy_request_seconds")))
        .with_panel(timeseries("Upstream latency", "s", *quantiles("harnessrl_proxy_upstream_seconds")))
        .with_panel(timeseries(
            "Tokens per second", "short",
            query(f"sum(rate(harnessrl_proxy_prompt_tokens_total{{{RUN}}}[{RATE}]))", "prompt"),
            query(f"sum(rate(harnessrl_proxy_completion_tokens_total{{{RUN}}}[{RATE}]))", "completion"),
        ))
        .with_row(Row("Capture"))
        .with_panel(timeseries(
            "Capture queue", "short",
            query(f"sum(harnessrl_proxy_queue_depth{{{RUN}}})", "items"),
            query(f"sum(harnessrl_proxy_in_flight{{{RUN}}})", "calls in flight"),
        ))
        .with_panel(timeseries(
            "Spooled and replayed calls per second", "ops",
            query(f"sum(rate(harnessrl_proxy_spooled_items_total{{{RUN}}}[{RATE}]))", "spooled"),
            query(f"sum(rate(harnessrl_proxy_replayed_items_total{{{RUN}}}[{RATE}]))", "replayed"),
            query(f"sum(harnessrl_proxy_spool_pending{{{RUN}}})", "pending"),
            description="Spooled: the store was unreachable; replayed into it later.",
        ))
        .with_panel(timeseries(
            "Paused for a weight sync", "none",
            query(f"sum by (run) (harnessrl_proxy_paused{{{RUN}}})", "paused proxies {{run}}"),
            query(f"max by (run) (harnessrl_proxy_policy_version{{{RUN}}})", "policy version {{run}}"),
        ))
        .with_panel(timeseries(
            "Store write errors per second", "ops",
            query(f"sum(rate(harnessrl_proxy_write_errors_total{{{RUN}}}[{RATE}]))", "errors"),
            query(f"sum(harnessrl_proxy_writer_failing{{{RUN}}})", "failing writers"),
        ))
    )


def learner() -> Dashboard:
    def gauge(title: str, unit: str, *names: str, description: str = "") -> Timeseries:
        return timeseries(title, unit, *(query(f"harnessrl_learner_{n}{{{RUN}}}", f"{n} {{{{run}}}}")
                                         for n in names), description=description)

    return (
        base("harnessrl / learner", "harnessrl-learner", "Losses, clipping, KL and throughput of the learner.")
        .with_row(Row("Optimisation"))
        .with_panel(gauge("Loss", "none", "loss", "pg_loss"))
        .with_panel(gauge("Clip fractions", "percentunit", "clip_frac", "clip_frac_low", "clip_frac_high"))
        .with_panel(gauge("KL", "none", "approx_kl", "rollout_kl",
                          description="approx_kl: step-start vs current policy; rollout_kl: current vs rollout."))
        .with_panel(gauge("Entropy", "none", "entropy"))
        .with_panel(gauge("Gradient norm", "none", "grad_norm"))
        .with_panel(gauge("Tokens per second", "short", "tokens_per_second"))
        .with_row(Row("Off-policy"))
        .with_panel(gauge("Rollout vs learner log-probs", "none", "logprob_abs_diff", "logprob_pearson",
                          description="Mean |difference| and correlation on the same generated tokens."))
        .with_panel(gauge("Staleness", "none", "staleness_mean", "staleness_max"))
        .with_panel(gauge("Step time", "s", "step_seconds", "train_seconds", "sync_seconds"))
    )


def operator() -> Dashboard:
    return (
        base("harnessrl / operator", "harnessrl-operator", "Reconciles, errors and harness pods of the operator.")
        .with_row(Row("Reconciles"))
        .with_panel(timeseries(
            "Reconciles per second", "ops",
            query(f"sum by (result) (rate(harnessrl_operator_reconciles_total{{{RUN}}}[{RATE}]))", "{{result}}"),
        ))
        .with_panel(timeseries(
            "Reconcile errors per second", "ops",
            query(f"sum by (run) (rate(harnessrl_operator_reconcile_errors_total{{{RUN}}}[{RATE}]))", "{{run}}"),
        ))
        .with_row(Row("Harness pods"))
        .with_panel(timeseries(
            "Pods per second", "ops",
            query(f"sum(rate(harnessrl_operator_pods_created_total{{{RUN}}}[{RATE}]))", "created"),
            query(f"sum(rate(harnessrl_operator_pods_deleted_total{{{RUN}}}[{RATE}]))", "deleted"),
            query(f"sum(rate(harnessrl_operator_pod_create_failures_total{{{RUN}}}[{RATE}]))", "refused"),
        ))
        .with_panel(timeseries("Pod start (created to running)", "s",
                               *quantiles("harnessrl_operator_pod_start_seconds")))
        .with_panel(timeseries(
            "Attempts waiting for a slot", "none",
            query(f"sum by (run) (harnessrl_operator_queue_depth{{{RUN}}})", "{{run}}"),
        ))
    )


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
