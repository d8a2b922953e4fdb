"""Harness pods seen through a plain list-then-watch per namespace, as client-go's informers do.

Pods are the operator's highest-volume objects (each rollout's pod is created, scheduled, started, ended and
deleted: about five events). kopf processes every event of a kind it has any handler for, and builds its
diff-base of the object each time (a deep copy of the whole body, managedFields included): measured with
yappi on 300 rollouts, that was about half of the operator's CPU. The reconciler needs none of it, only a
current summary of each pod, so one informer per namespace keeps those summaries:

- it lists the namespace's pods of runs (harness pods, and the vLLM and learner pods, whose problems the
  reconciler reports: ``workload_pods.py``), marks itself ``synced``, then watches from the list's
  resourceVersion; a watch that ends or expires (410 Gone) lists again, and a pod missing from the new list
  is reported as deleted;
- ``on_change(namespace, run, summary, deleted)`` is called for every pod that ended or disappeared, so the
  run's reconciler wakes at once and its backend learns about deletions the view alone cannot show.

The reconciler waits for ``synced`` before its first pass, so a restarted operator sees every pod it created
before it decides anything (the guarantee kopf's indexes gave).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from harnessrl.operator.naming import RUN_LABEL
from harnessrl.operator.pods import PodSummary, summarize_pod
from harnessrl.operator.workload_pods import WorkloadPod, summarize_workload_pod

log = logging.getLogger(__name__)



class _Meta(msgspec.Struct, omit_defaults=True):
    name: str = ""
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    creationTimestamp: str | None = None  # the API's field names
    deletionTimestamp: str | None = None
    resourceVersion: str | None = None


class _ContainerStatus(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    state: dict[str, Any] | None = None
    lastState: dict[str, Any] | None = None  # how the previous run ended (a crash loop's exit, OOMKilled)
    ready: bool | None = None
    started: bool | None = None
    restartCount: int | None = None


class _Status(msgspec.Struct, omit_defaults=True):
    phase: str | None = None
    reason: str | None = None
    message: str | None = None
    conditions: list[dict[str, Any]] | None = None
    initContainerStatuses: list[_ContainerStatus] | None = None
    containerStatuses: list[_ContainerStatus] | None = None


class _Pod(msgspec.Struct, omit_defaults=True):
    """The fields ``summarize_pod`` and ``summarize_workload_pod`` read; ``message`` is an ERROR event's."""

    metadata: _Meta = msgspec.field(default_factory=_Meta)
    status: _Status | str | None = None  # an ERROR event's object is a Status: "status": "Failure"
    message: str | None = None


class _Event(msgspec.Struct):
    type: str
    object: _Pod


class _List(msgspec.Struct):
    metadata: _Meta
    items: list[_Pod] | None = None


# Typed decoding reads only the fields above and skips the rest of each pod (its spec, managedFields) without
# building it: the watch's decoding into plain dicts was still 12% of the operator's CPU at concurrency 200
# (py-spy, bench/operator_scale.py). The summaries are then made from dicts of just those fields.
_EVENT = msgspec.json.Decoder(_Event)
_LIST = msgspec.json.Decoder(_List)


def _as_dict(pod: _Pod) -> dict[str, Any]:
    return msgspec.to_builtins(pod)
SELECTOR = RUN_LABEL  # every pod of a run: harness pods, and the vLLM and learner pods (for their problems)
WATCH_TIMEOUT_S = 300

OnChange = Callable[[str, str, PodSummary, bool], None]


class PodInformer(threading.Thread):
    def __init__(self, core_v1: Any, namespace: str, on_change: OnChange) -> None:
        super().__init__(name=f"pod-informer-{namespace}", daemon=True)
        self.core = core_v1
        self.namespace = namespace
        self.on_change = on_change
        self.synced = threading.Event()
        self._lock = threading.Lock()
        self._pods: dict[str, tuple[str, PodSummary]] = {}  # harness pod name -> (run, summary)
        self._runs: dict[str, dict[tuple[str, int], PodSummary]] = {}  # the same by run and attempt
        self._workload: dict[str, tuple[str, WorkloadPod]] = {}  # vLLM or learner pod name -> (run, summary)
        self._stopping = threading.Event()

    def pods(self, run: str) -> list[PodSummary]:
        with self._lock:
            return list((self._runs.get(run) or {}).values())

    def pod(self, run: str, key: tuple[str, int]) -> PodSummary | None:
        return (self._runs.get(run) or {}).get(key)  # one dict lookup: atomic under the GIL

    def view(self, run: str) -> RunPods:
        """One run's pods, as its ``PodBackend`` reads them."""
        return RunPods(self, run)

    def workload_pods(self, run: str) -> tuple[WorkloadPod, ...]:
        with self._lock:
            return tuple(summary for owner, summary in self._workload.values() if owner == run)

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                version = self._relist()
                self.synced.set()
                self._watch(version)
            except Exception as exc:  # noqa: BLE001 - an API outage or an expired watch: list again
                log.info("pod informer for %s restarts after %s", self.namespace, exc)
                self._stopping.wait(1.0)

    def _relist(self) -> str:
        listing = self.core.list_namespaced_pod(self.namespace, label_selector=SELECTOR, _preload_content=False)
        data = _LIST.decode(listing.data)
        fresh: dict[str, tuple[str, PodSummary]] = {}
        workload: dict[str, tuple[str, WorkloadPod]] = {}
        for pod in data.items or []:
            item = _as_dict(pod)
            entry = _entry(item)
            if entry is not None:
                fresh[item["metadata"]["name"]] = entry
            elif (other := _workload_entry(item)) is not None:
                workload[item["metadata"]["name"]] = other
        runs: dict[str, dict[tuple[str, int], PodSummary]] = {}
        for run, summary in fresh.values():
            runs.setdefault(run, {})[summary.key] = summary
        with self._lock:
            gone = [self._pods[name] for name in self._pods.keys() - fresh.keys()]
            self._pods, self._runs = fresh, runs
            self._workload = workload
        for run, summary in gone:
            self.on_change(self.namespace, run, summary, True)
        for run, summary in fresh.values():
            if summary.ended:
                self.on_change(self.namespace, run, summary, False)
        return data.metadata.resourceVersion or ""

    def _watch(self, version: str) -> None:
        # The raw event stream, decoded with msgspec (above): kubernetes' Watch decodes each event with json (a
        # tenth of the operator's CPU at concurrency 80, py-spy) and the client's model classes would cost more
        # than everything else here. One watch request; when it ends, run() lists again.
        from kubernetes.watch.watch import iter_resp_lines

        response = self.core.list_namespaced_pod(
            self.namespace, label_selector=SELECTOR, resource_version=version, timeout_seconds=WATCH_TIMEOUT_S,
            allow_watch_bookmarks=True, watch=True, _preload_content=False,
        )
        try:
            self._follow(iter_resp_lines(response))
        finally:
            response.close()
            response.release_conn()

    def _follow(self, lines: Iterable[str]) -> None:
        started = time.monotonic()
        for line in lines:
            if self._stopping.is_set():
                return
            if not line:
                continue
            event = _EVENT.decode(line)
            kind = event.type
            if kind == "ERROR":
                raise RuntimeError(f"watch error: {event.object.message}")
            if kind == "BOOKMARK":
                continue
            item = _as_dict(event.object)
            entry = _entry(item)
            if entry is None:
                self._note_workload(kind, item)
                continue
            name = item["metadata"]["name"]
            run, summary = entry
            with self._lock:
                if kind == "DELETED":
                    self._pods.pop(name, None)
                    (self._runs.get(run) or {}).pop(summary.key, None)
                else:
                    self._pods[name] = entry
                    self._runs.setdefault(run, {})[summary.key] = summary
            if kind == "DELETED" or summary.ended:
                self.on_change(self.namespace, run, summary, kind == "DELETED")
        log.debug("pod watch for %s ended after %.0f s", self.namespace, time.monotonic() - started)


    def _note_workload(self, kind: str, item: dict[str, Any]) -> None:
        entry = _workload_entry(item)
        if entry is None:
            return
        with self._lock:
            if kind == "DELETED":
                self._workload.pop(item["metadata"]["name"], None)
            else:
                self._workload[item["metadata"]["name"]] = entry


class RunPods:
    """``PodView`` of one run: what its ``PodBackend`` sees of the informer."""

    def __init__(self, informer: PodInformer, run: str) -> None:
        self.informer, self.run = informer, run

    def pods(self) -> list[PodSummary]:
        return self.informer.pods(self.run)

    def get(self, key: tuple[str, int]) -> PodSummary | None:
        return self.informer.pod(self.run, key)


def _workload_entry(item: dict[str, Any]) -> tuple[str, WorkloadPod] | None:
    run = ((item.get("metadata") or {}).get("labels") or {}).get(RUN_LABEL)
    summary = summarize_workload_pod(item) if run else None
    return (run, summary) if summary is not None else None


def _entry(item: dict[str, Any]) -> tuple[str, PodSummary] | None:
    run = ((item.get("metadata") or {}).get("labels") or {}).get(RUN_LABEL)
    summary = summarize_pod(item) if run else None
    return (run, summary) if summary is not None else None
