"""Volume attach and mount errors of a namespace's pods, from their Warning Events.

A pod whose volume cannot be attached (a ReadWriteOnce claim held on another node: "Multi-Attach error") or
mounted (an NFS server that refuses, a missing Secret of a CSI driver) sits in ContainerCreating, and its pod
status says nothing more: the attach/detach controller and the kubelet report why only in Events
(``FailedAttachVolume``, ``FailedMount``). One watch per namespace keeps the latest such Event of each pod, so a
run whose vLLM or learner pod waits on a volume can say why (``workload_pods.with_volume_problems``).

The watch asks for Warning Events of pods only (a field selector, so the API server filters: a busy namespace's
Normal events, several per harness pod, never reach the operator) and starts without a resourceVersion, which
replays the Events that exist, then follows new ones; when it ends or fails it starts again the same way. Only
three fields of each are read, from the raw stream (as ``pod_informer.py`` does; no client model classes).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

from harnessrl.operator.workload_pods import VOLUME

log = logging.getLogger(__name__)

FIELD_SELECTOR = "type=Warning,involvedObject.kind=Pod"
WATCH_TIMEOUT_S = 300
KEPT = 2000  # pods remembered at most (the oldest go first): Events expire after an hour anyway


class VolumeEvents(threading.Thread):
    """The newest volume error of each pod of one namespace, by pod name."""

    def __init__(self, core_v1: Any, namespace: str) -> None:
        super().__init__(name=f"volume-events-{namespace}", daemon=True)
        self.core = core_v1
        self.namespace = namespace
        self._lock = threading.Lock()
        self._latest: OrderedDict[str, tuple[str, str]] = OrderedDict()  # pod -> (reason, message)
        self._stopping = threading.Event()

    def problem(self, pod: str) -> tuple[str, str] | None:
        """(reason, message) of the pod's newest FailedAttachVolume or FailedMount Event, if any."""
        with self._lock:
            return self._latest.get(pod)

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        from kubernetes.watch.watch import iter_resp_lines

        while not self._stopping.is_set():
            try:
                response = self.core.list_namespaced_event(
                    self.namespace, field_selector=FIELD_SELECTOR, watch=True, timeout_seconds=WATCH_TIMEOUT_S,
                    _preload_content=False,
                )
                try:
                    for line in iter_resp_lines(response):
                        if self._stopping.is_set():
                            return
                        if line:
                            change = json.loads(line)
                            if change.get("type") == "ERROR":
                                raise RuntimeError(f"watch error: {change.get('object', {}).get('message')}")
                            self.note(change.get("type", ""), change.get("object") or {})
                finally:
                    response.close()
                    response.release_conn()
            except Exception as exc:  # noqa: BLE001 - an API outage or an expired watch: watch again
                log.info("volume event watch for %s restarts after %s", self.namespace, exc)
                self._stopping.wait(1.0)

    def note(self, kind: str, event: dict[str, Any]) -> None:
        """One watch change (the Event as the API sends it): a volume error of a pod replaces its previous one."""
        reason = event.get("reason")
        if kind not in ("ADDED", "MODIFIED") or reason not in VOLUME:
            return
        pod = (event.get("involvedObject") or {}).get("name", "")
        with self._lock:
            self._latest.pop(pod, None)
            self._latest[pod] = (reason, (event.get("message") or reason).strip())
            while len(self._latest) > KEPT:
                self._latest.popitem(last=False)
