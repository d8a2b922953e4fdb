"""Prometheus metrics of one proxy, in a registry of its own (tests and benchmarks run several proxies)."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

PREFIX = "harnessrl_proxy_"

# The proxy adds well under a millisecond; the upstream takes from milliseconds to minutes.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _remembered_children(metric: MetricWrapperBase) -> None:
    """Make ``metric.labels(...)`` a dict lookup after the first call with the same values.

    prometheus-client's ``labels()`` checks and formats its arguments and takes a lock every time (~2.5 us,
    measured), and a captured call asked for five children; it returns the same child for the same values
    anyway, and the proxy never removes a child, so remembering them changes nothing but the cost. The values
    are few (routes, status codes, outcomes, error codes), as the children prometheus-client keeps are.
    """
    metric.labels = functools.cache(metric.labels)  # type: ignore[method-assign]


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "HTTP requests answered, by route and status code.",
            ["route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            PREFIX + "request_seconds",
            "Time from request received to response done.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_latency = Histogram(
            PREFIX + "upstream_seconds",
            "Time the upstream took, from sending to its last byte.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_retries = Counter(
            PREFIX + "upstream_retries", "Upstream attempts retried, by reason.", ["reason"], registry=r
        )
        self.calls = Counter(
            PREFIX + "calls", "LLM calls captured, by route and call status.", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of captured calls.", registry=r)
        self.completion_tokens = Counter(
            PREFIX + "completion_tokens", "Completion tokens of captured calls.", registry=r
        )
        self.queue_depth = Gauge(
            PREFIX + "queue_depth", "Captured items in memory waiting for the writer.", registry=r
        )
        self.queue_bytes = Gauge(
            PREFIX + "queue_bytes", "Estimated bytes of the captured items waiting for the writer.", registry=r
        )
        self.backpressure_waits = Counter(
            PREFIX + "backpressure_waits", "Calls that waited because the write queue was full.", registry=r
        )
        self.batch_size = Histogram(
            PREFIX + "write_batch_size", "Calls per store write.", buckets=BATCH_BUCKETS, registry=r
        )
        self.streams = Counter(
            PREFIX + "streams", "Streamed calls by how the harness got them: relayed while generated, or "
            "replayed once the answer was whole (first byte after the last token).", ["route", "mode"], registry=r
        )
        self.spooled = Counter(
            PREFIX + "spooled_items", "Items written to the spool (store unavailable).", registry=r
        )
        self.replayed = Counter(
            PREFIX + "replayed_items", "Spooled items replayed into the store.", registry=r
        )
        self.spool_pending = Gauge(
            PREFIX + "spool_pending", "Items in the spool not yet replayed.", registry=r
        )
        self.spool_bytes = Gauge(PREFIX + "spool_bytes", "Size of the spool file.", registry=r)
        self.write_errors = Counter(
            PREFIX + "write_errors",
            "Write failures: outage (spooled, retried), rejected (kept aside), spool_full (held in memory), "
            "writer (the spool or its .rejected file could not be written, or a bug: held, retried) or "
            "nonstrict_json (a call whose answer strict JSON cannot hold, stored with such values as text).",
            ["kind"],
            registry=r,
        )
        self.writer_failing = Gauge(
            PREFIX + "writer_failing",
            "1 while captured items reach neither the store nor the spool (the reason is in /healthz).",
            registry=r,
        )
        self.paused = Gauge(PREFIX + "paused", "1 while paused for a weight sync.", registry=r)
        self.in_flight = Gauge(PREFIX + "in_flight", "LLM calls being served.", registry=r)
        self.policy_version = Gauge(
            PREFIX + "policy_version", "Policy version new calls are recorded with.", registry=r
        )
        self.dropped = Counter(
            PREFIX + "dropped_fields",
            "Request fields of calls served as chat completions that vLLM cannot honour and the proxy left out "
            "(the model never sees them, so nothing stored or trained changes), by route and field.",
            ["route", "field"],
            registry=r,
        )
        self.refused = Counter(
            PREFIX + "refused",
            "Requests the proxy answered itself with an error (no call stored), by route, status and error code.",
            ["route", "status", "code"],
            registry=r,
        )
        self.upstream_failures = Counter(
            PREFIX + "upstream_failures",
            "Calls the proxy answered with an error of its own because the upstream failed them (unreachable, "
            "timed out, or an answer the proxy could not use; each is stored as an error call), by route, status "
            "and error code.",
            ["route", "status", "code"],
            registry=r,
        )
        self.continuity = Counter(
            PREFIX + "token_continuity",
            "Chat calls sent as token ids (used) or on the plain chat path (reason).",
            ["outcome"],
            registry=r,
        )

        for metric in vars(self).values():
            if isinstance(metric, MetricWrapperBase):
                _remembered_children(metric)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
