"""Prometheus metrics of the operator (``harnessrl_operator_*``), in a registry of its own so tests can run
several operators in one process; ``harnessrl operator`` serves it on ``--metrics-port``.

Per-run series are labelled ``namespace`` and ``run`` and removed when the run's reconciler stops, so the
number of series follows the live runs, not every run there ever was.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from harnessrl.store.evaluations import EvaluationResult

PREFIX = "harnessrl_operator_"
# A pod starts in about a second on an idle cluster and in minutes when images are pulled or nodes scale up.
START_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# A pass is a few store queries and API calls: tens of milliseconds; seconds mean the store or API is slow.
PASS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        run = ("namespace", "run")
        r = self.registry
        self.reconciles = Counter(
            PREFIX + "reconciles",
            "Reconcile passes, by result (ok, problem, error).",
            [*run, "result"],
            registry=r,
        )
        self.errors = Counter(
            PREFIX + "reconcile_errors",
            "Reconcile passes that raised (a bug or an API outage).",
            run,
            registry=r,
        )
        self.pods_created = Counter(PREFIX + "pods_created", "Harness pods created.", run, registry=r)
        self.pods_deleted = Counter(PREFIX + "pods_deleted", "Harness pods deleted.", run, registry=r)
        self.pod_create_failures = Counter(
            PREFIX + "pod_create_failures", "Harness pods the API refused.", run, registry=r
        )
        self.rollouts = Gauge(PREFIX + "rollouts", "Rollout attempts by state.", [*run, "state"], registry=r)
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Attempts queued for a free slot.", run, registry=r)
        self.phase = Gauge(
            PREFIX + "run_phase", "1 for the run's current phase.", [*run, "phase"], registry=r
        )
        self.pod_start = Histogram(
            PREFIX + "pod_start_seconds",
            "From a harness pod's creation to its harness container running.",
            run,
            buckets=START_BUCKETS,
            registry=r,
        )
        # The newest complete evaluation on spec.evaluation's held-out tasks (harnessrl.store.evaluations).
        self.evaluation_version = Gauge(
            PREFIX + "evaluation_version", "Policy version of the newest complete evaluation.", run, registry=r
        )
        self.evaluation_reward_mean = Gauge(
            PREFIX + "evaluation_reward_mean", "Mean reward of the newest complete evaluation.", run, registry=r
        )
        self.evaluation_pass_rate = Gauge(
            PREFIX + "evaluation_pass_rate",
            "Pass rate (reward >= spec.evaluation.passReward) of the newest complete evaluation.",
            run,
            registry=r,
        )

        self.reconcile_seconds = Histogram(
            PREFIX + "reconcile_seconds",
            "One reconcile pass of a run, status patch included: what a free slot waits at most for its pod.",
            run,
            buckets=PASS_BUCKETS,
            registry=r,
        )

    def observe_evaluation(self, key: tuple[str, str], results: list[EvaluationResult]) -> None:
        """Set the evaluation gauges from the newest complete round (left unset until there is one)."""
        done = [result for result in results if result.complete]
        if not done:
            return
        last = done[-1]
        self.evaluation_version.labels(*key).set(last.version)
        self.evaluation_reward_mean.labels(*key).set(last.reward_mean if last.reward_mean is not None else float("nan"))
        self.evaluation_pass_rate.labels(*key).set(last.pass_rate if last.pass_rate is not None else float("nan"))

    def forget(self, namespace: str, run: str) -> None:
        """Drop a run's labelled series (its reconciler stopped)."""
        for metric in (
            self.reconciles,
            self.errors,
            self.pods_created,
            self.pods_deleted,
            self.pod_create_failures,
            self.rollouts,
            self.queue_depth,
            self.phase,
            self.pod_start,
            self.evaluation_version,
            self.evaluation_reward_mean,
            self.evaluation_pass_rate,
            self.reconcile_seconds,
        ):
            for labels in list(metric._metrics):  # noqa: SLF001 - prometheus_client has no public lookup
                if labels[:2] == (namespace, run):
                    metric.remove(*labels)


METRICS = OperatorMetrics()
