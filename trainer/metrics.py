"""Prometheus metrics of the learner (``harnessrl_learner_*``) in a registry of its own.

A registry of its own, so a test or the local runner can hold several learners (or a learner next to a proxy)
in one process without name clashes, and so exposition shows only learner metrics. The step record in the
store carries the same numbers (and more) as JSON; these are for dashboards and alerts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "harnessrl_learner_"

# step-metric name -> help text; each becomes a gauge harnessrl_learner_<name>
GAUGES: dict[str, str] = {
    "step": "Last committed learner step.",
    "policy_version": "Policy version produced by the last committed step.",
    "synced_version": "Newest policy version every rollout replica serves.",
    "loss": "Step loss: each update's weighted sum over its mini-batch, averaged over the step's updates.",
    "pg_loss": "Policy-gradient part of the step loss.",
    "reward_mean": "Mean reward of the step's rollouts that reached a group.",
    "reward_std": "Standard deviation of those rewards.",
    "advantage_mean": "Mean advantage over trained rollouts.",
    "advantage_std": "Standard deviation of advantages over trained rollouts.",
    "advantage_abs_mean": "Mean absolute advantage over trained rollouts.",
    "clip_frac": "Fraction of generated tokens whose ratio the loss clipped, over all updates of the step.",
    "clip_frac_low": "Fraction of generated tokens clipped at the lower ratio bound.",
    "clip_frac_high": "Fraction of generated tokens clipped at the upper ratio bound.",
    "ratio_mean": "Mean ratio of current to step-start probability over generated tokens.",
    "approx_kl": "k3 estimate of KL(step-start policy || current policy) per generated token.",
    "rollout_kl": "k3 estimate of KL(current policy || rollout policy) per generated token.",
    "updates": "Optimizer updates (mini-batches) in the last step.",
    "entropy": "Mean entropy of the learner's next-token distribution on generated tokens.",
    "tis_weight_mean": "Mean truncated importance-sampling weight (learner vs serving engine).",
    "tis_capped_frac": "Fraction of tokens whose importance-sampling weight hit the cap.",
    "grad_norm": "Global gradient norm before clipping, averaged over the step's updates.",
    "tokens_per_second": "Row tokens (prompt and generated) trained per second in the step's train phase.",
    "rows_per_rollout": "Training rows per trained rollout (1 when every trajectory merged into one row).",
    "merge_token_ratio": "Row tokens / final trajectory tokens of the step's rollouts (1.0: a perfect merge).",
    "staleness_mean": "Mean policy-version lag of the step's rollouts.",
    "staleness_max": "Largest policy-version lag of the step's rollouts.",
    "logprob_abs_diff": "Mean |rollout log-prob - learner log-prob| on the same generated tokens.",
    "logprob_pearson": "Pearson correlation of rollout and learner log-probs on the same generated tokens.",
    "logprob_abs_diff_constrained": "Mean |rollout log-prob - learner log-prob| on the tokens scored over a "
                                    "structured-output grammar's allowed set.",
    "logprob_pearson_constrained": "Pearson correlation of rollout and learner log-probs on the tokens scored over "
                                   "a grammar's allowed set.",
    "step_seconds": "Wall time of the last step, claim to commit.",
    "train_seconds": "Wall time of the last step's forward/backward/optimizer phase.",
    "checkpoint_seconds": "Wall time of the last checkpoint save.",
    "sync_seconds": "Wall time of the last weight sync.",
}

# step-metric name -> (counter name, help); increased by the step's value
COUNTERS: dict[str, tuple[str, str]] = {
    "rollouts": ("rollouts_consumed", "Rollout attempts consumed by committed steps."),
    "rows": ("rows", "Training rows built."),
    "row_tokens": ("row_tokens", "Row tokens built (each token once per row)."),
    "generated_tokens": ("generated_tokens", "Generated (trained) tokens in the built rows."),
    "final_trajectory_tokens": ("final_trajectory_tokens",
                                "Tokens of the built rollouts' trajectories as they ended, each counted once."),
    "trained_tokens": ("trained_tokens", "Row tokens that went through forward/backward."),
    "zero_variance_groups": ("zero_variance_groups", "Task groups whose rewards were all equal (no gradient)."),
    "forced_tokens": ("forced_tokens", "Generated tokens with behaviour log-prob 0 (a grammar allowed only them): "
                                       "context, not trained."),
    "constrained_tokens": ("constrained_tokens", "Trained tokens scored over the token ids a grammar allowed."),
    "shared_prefix_rows": ("shared_prefix_rows", "Rows trained with their group's common prefix computed once."),
    "prefix_fallback_rows": ("prefix_fallback_rows", "Rows trained alone: they shared less than "
                                                     "shared_prefix_min_fraction of their tokens with another row."),
    "shared_prefix_tokens": ("shared_prefix_tokens", "Row tokens not computed again because their group's "
                                                     "prefix was computed once."),
    "empty_step": ("empty_steps", "Steps with no trainable group: weights kept, nothing saved or reloaded."),
}

# labelled counters: prefix of step-metric names -> (counter name, label, help)
LABELLED: dict[str, tuple[str, str, str]] = {
    "split_": ("row_splits", "reason", "Places where a call could not extend the row and a new row started."),
    "dropped_": ("calls_dropped", "reason", "Calls that contributed no trained tokens."),
    "excluded_": ("rollouts_excluded", "reason", "Rollouts that got no advantage."),
}


class LearnerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.gauges = {name: Gauge(PREFIX + name, text, registry=self.registry) for name, text in GAUGES.items()}
        self.counters = {
            key: Counter(PREFIX + name, text, registry=self.registry) for key, (name, text) in COUNTERS.items()
        }
        self.labelled = {
            prefix: Counter(PREFIX + name, text, [label], registry=self.registry)
            for prefix, (name, label, text) in LABELLED.items()
        }
        self.steps = Counter(PREFIX + "steps", "Committed learner steps.", registry=self.registry)
        self.sync_failures = Counter(PREFIX + "sync_failures", "Weight syncs that left a replica behind.",
                                     registry=self.registry)
        self.commit_refusals = Counter(PREFIX + "commit_refusals", "Step commits the store refused.",
                                       registry=self.registry)

    def observe_step(self, metrics: Mapping[str, Any]) -> None:
        """Record a committed step's metrics (the same dict that goes into the store's step record)."""
        self.steps.inc()
        for name, gauge in self.gauges.items():
            value = metrics.get(name)
            if _is_number(value):
                gauge.set(float(value))
        for key, counter in self.counters.items():
            value = metrics.get(key)
            if _is_number(value) and value > 0:
                counter.inc(float(value))
        for name, value in metrics.items():
            for prefix, counter in self.labelled.items():
                if name.startswith(prefix) and _is_number(value) and value > 0:
                    counter.labels(name[len(prefix):]).inc(float(value))

    def observe_sync(self, version: int, ok: bool, seconds: float) -> None:
        self.gauges["sync_seconds"].set(seconds)
        if ok:
            self.gauges["synced_version"].set(version)
        else:
            self.sync_failures.inc()

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose ``/metrics`` on ``port`` (a daemon thread; rank 0 only)."""
        start_http_server(port, addr=addr, registry=self.registry)


def final_trajectory_tokens(token_rows: Sequence[np.ndarray]) -> int:
    """The tokens of one rollout attempt's trajectories as they ended, each token counted once.

    That is the number of distinct prefixes of the rows' token sequences (the size of their prefix tree): one
    conversation merged into one row counts its final length; a conversation split into rows (a template that
    re-renders the model's output, an edited history) counts the final conversation plus only what really
    differs, while its rows repeat every shared prefix; two interleaved conversations count both (their common
    system prompt once). So row tokens / this is 1.0 for a perfect merge and grows with every prefix trained
    twice. Sorted lexicographically, each sequence shares its longest prefix with a neighbour, so the count is
    the total length minus the neighbours' common prefixes: O(tokens + rows log rows) comparisons.
    """
    seqs = sorted((np.asarray(r, dtype=np.int64) for r in token_rows), key=lambda a: a.astype(">i8").tobytes())
    total = 0
    previous: np.ndarray | None = None
    for seq in seqs:
        total += len(seq)
        if previous is not None:
            n = min(len(seq), len(previous))
            differ = np.flatnonzero(seq[:n] != previous[:n])
            total -= int(differ[0]) if differ.size else n
        previous = seq
    return total


def merge_quality(row_tokens: int, final_tokens: int) -> dict[str, float]:
    """Step metrics of how well calls merged (rows per rollout is ``rows`` / ``rollouts`` of the step)."""
    return {
        "final_trajectory_tokens": final_tokens,
        "merge_token_ratio": row_tokens / final_tokens if final_tokens else math.nan,
    }


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
