"""The ``HARNESSRL_*`` variables a TrainingRun's ``spec.proxy`` fixes, for every place that starts a proxy from a
spec: ``harnessrl run`` and the operator's sidecars. A module of its own so the operator can use it without the
proxy's runtime dependencies (aiohttp, pydantic-settings)."""

from __future__ import annotations

from pathlib import PurePath

from harnessrl.spec.models import Proxy


def spec_environment(proxy: Proxy, spool_path: PurePath) -> dict[str, str]:
    """The settings a TrainingRun's ``spec.proxy`` fixes, as the ``HARNESSRL_*`` variables a proxy reads.

    One mapping for every place that starts a proxy from a spec, so no validated field is silently dropped
    on the way (``spool_path``: where that place puts ``spec.proxy.spoolDir``'s spool file).
    """
    return {
        "HARNESSRL_QUEUE_SIZE": str(proxy.queue_size),
        "HARNESSRL_QUEUE_MAX_BYTES": str(proxy.queue_max_bytes),
        "HARNESSRL_SPOOL_PATH": str(spool_path),
        "HARNESSRL_SPOOL_MAX_BYTES": str(proxy.spool_max_bytes),
        "HARNESSRL_MAX_BODY_BYTES": str(proxy.max_request_body_bytes),
        "HARNESSRL_PAUSE_MODE": proxy.pause.mode,
        "HARNESSRL_PAUSE_RETRY_AFTER_S": str(proxy.pause.retry_after_seconds),
    }
