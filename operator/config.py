"""Operator-wide settings: what a TrainingRun does not say (images of our own components, pacing).

Read from the environment the chart sets (``HARNESSRL_OPERATOR_*``); defaults fit a plain install.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from harnessrl import __version__

IMAGE_REPOSITORY = "ghcr.io/harnessrl"


@dataclass(frozen=True)
class OperatorConfig:
    proxy_image: str = f"{IMAGE_REPOSITORY}/proxy:{__version__}"
    """The capture-proxy sidecar (a TrainingRun's spec.proxy.image overrides it)."""
    learner_image: str = f"{IMAGE_REPOSITORY}/learner:{__version__}"
    """The DeepSpeed learner (CUDA, PyTorch, DeepSpeed, transformers)."""
    dns_cidrs: str = "169.254.20.10/32"
    """Addresses (comma-separated CIDRs) harness pods may query DNS at besides the cluster DNS pods: NodeLocal
    DNSCache's default link-local address, which a pod selector cannot name (it runs in the host network)."""
    vllm_cpu_image: str = f"{IMAGE_REPOSITORY}/vllm-cpu:{__version__}"
    """vLLM built for the CPU (images/vllm-cpu), for runs with spec.rollout.gpusPerReplica 0 and no image;
    vLLM's own image is CUDA-only."""
    pod_creates_per_second: float = 20.0
    """Harness pods created per second per run at most, so a burst of free slots never floods the API."""
    min_pass_interval_seconds: float = 0.25
    """The shortest time from one reconcile pass of a run to the next: the pod events of that time are settled
    and their slots refilled by one pass. A pass has a fixed cost (a dozen store queries); at concurrency 200
    the operator ran 740 passes for 2,000 rollouts (2.7 rollouts a pass) when every ended pod woke one at once
    (bench/operator_scale.py). 0: a pass at every pod event."""
    store_url: str = ""
    """The trace store of runs that name none (their spec keeps the SQLite default, which only `harnessrl run`
    can use): the chart points it at its PostgreSQL. Empty: such runs fail with InvalidSpec naming
    spec.store."""
    proxy_metrics_port: int = 8101
    """Where each harness pod's proxy serves ``/metrics`` on the pod's address for Prometheus (the chart's
    harness PodMonitor); its API stays on loopback. A harness must not listen on this port. 0: not served."""
    provisioning_timeout_seconds: int = 1800
    """How long vLLM and the learner may take to become ready before the run fails (RolloutUnavailable)."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        values = {}
        for item in fields(cls):
            raw = env.get(f"HARNESSRL_OPERATOR_{item.name.upper()}")
            if raw is not None:
                kind = type(item.default)
                try:
                    values[item.name] = kind(raw)
                except ValueError:
                    raise ValueError(
                        f"HARNESSRL_OPERATOR_{item.name.upper()}={raw!r} is not a {kind.__name__}"
                    )
        return cls(**values)
