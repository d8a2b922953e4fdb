"""The kopf handlers: one WATCH per kind feeds in-memory indexes, one daemon per TrainingRun reconciles it.

- harness pods come from one ``PodInformer`` per namespace (list, then watch; see ``pod_informer.py`` for why
  not kopf): a run's reconciler starts only once it holds every existing pod, so a restarted operator sees
  every pod it created before it decides anything (no LIST per reconcile, no false "lost" rollouts); a pod
  that ends or goes wakes the run's reconciler at once.
- volume attach and mount errors come from one watch of Warning pod Events per namespace (``volume_events.py``):
  a vLLM or learner pod that waits on a volume says why only there.
- ``rollout_deployments`` and ``learner_jobs`` are kopf indexes (a few objects per run), kept current by
  kopf's watch; kopf starts no other handler before they hold every existing object.
- ``run_daemon`` reconciles one run at least every ``RECONCILE_INTERVAL_S`` (level-based: each pass starts from the
  object, the indexes and the store), writes the status only when it changed, and posts an Event on every
  phase change. It returns when the run has finished; a restart reconciles finished runs once more.
- ``run_deleted`` is the finalizer: it stops the scheduler (active attempts are cancelled in the store, their
  pods deleted) and leaves the stored traces; the garbage collector removes the owned children.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import kopf

import harnessrl.operator.webhook  # noqa: F401 - the sidecar-injection webhook (off unless configured)
from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.controller import Apis, RunController, Workloads
from harnessrl.operator.metrics import METRICS
from harnessrl.operator.naming import COMPONENT_LABEL, HARNESS, LEARNER, ROLLOUT, RUN_LABEL
from harnessrl.operator.pod_informer import PodInformer
from harnessrl.operator.volume_events import VolumeEvents
from harnessrl.operator.pods import PodSummary
from harnessrl.operator.status import Observed, build_status, epoch, same_status
from harnessrl.operator.status_writer import StatusWriter
from harnessrl.operator.workload_pods import with_volume_problems
from harnessrl.spec.models import GROUP, VERSION
from harnessrl.spec.status import Phase, Reason
from harnessrl.store import RolloutState

log = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 1.0
PLURAL = "trainingruns"

_controllers: dict[tuple[str, str], RunController] = {}
_informers: dict[str, PodInformer] = {}
_volume_events: dict[str, VolumeEvents] = {}
_lock = threading.Lock()
_state: dict[str, Any] = {}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        # Named explicitly: the client reads $KUBECONFIG once, when it is first imported.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    _state["apis"] = Apis(client.ApiClient())
    _state["config"] = OperatorConfig.from_env()
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod, its service account; elsewhere $KUBECONFIG as it is now (kopf's client-library login reads
    the variable only once, when the client is imported)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _run_of(labels: dict[str, str]) -> str:
    return labels.get(RUN_LABEL, "")


@kopf.index("deployments", labels={COMPONENT_LABEL: ROLLOUT, RUN_LABEL: kopf.PRESENT})
def rollout_deployments(body: kopf.Body, namespace: str, labels: dict[str, str], **_: Any) -> Any:
    return {(namespace, _run_of(labels)): {"status": dict(body.get("status") or {})}}


@kopf.index("jobs", labels={COMPONENT_LABEL: LEARNER, RUN_LABEL: kopf.PRESENT})
def learner_jobs(body: kopf.Body, namespace: str, labels: dict[str, str], uid: str, **_: Any) -> Any:
    # the uid tells a recreated Job from the one it replaces (RunController._recreate_learner_job)
    return {(namespace, _run_of(labels)): {"metadata": {"uid": uid}, "status": dict(body.get("status") or {})}}


def _informer(namespace: str) -> PodInformer:
    """The namespace's harness-pod informer, started with its first run."""
    with _lock:
        informer = _informers.get(namespace)
        if informer is None or not informer.is_alive():
            informer = PodInformer(_state["apis"].core, namespace, _pod_changed)
            informer.start()
            _informers[namespace] = informer
        return informer


def _volumes(namespace: str) -> VolumeEvents:
    """The namespace's watch of volume errors, started with its first run."""
    with _lock:
        events = _volume_events.get(namespace)
        if events is None or not events.is_alive():
            events = VolumeEvents(_state["apis"].core, namespace)
            events.start()
            _volume_events[namespace] = events
        return events


def _pod_changed(namespace: str, run: str, summary: PodSummary, deleted: bool) -> None:
    """A pod ended or went: wake its run's reconciler so the freed slot is refilled at once; a deletion is
    also passed to the pod backend, which the informer's current view alone cannot show."""
    controller = _controllers.get((namespace, run))
    if controller is None:
        return
    if deleted:
        controller.backend.pod_deleted(summary)
    controller.wake.set()


@kopf.on.cleanup()
def stop_informers(**_: Any) -> None:
    with _lock:
        namespaces = list(_informers)
        for informer in _informers.values():
            informer.stop()
        _informers.clear()
        for events in _volume_events.values():
            events.stop()
        _volume_events.clear()
    _release_finalizers(namespaces)


FINALIZER = "harnessrl.io/finalizer"


def _release_finalizers(namespaces: list[str]) -> None:
    """Take the operator's finalizer off every TrainingRun it watched, as it stops: kopf puts one on each run
    (its daemons must stop before a run goes), and with no operator left (``helm uninstall``) a run holding it
    could never be deleted. A restarted operator puts it back before its daemons start; a run deleted in
    between goes at once, its pods with it through their owner references. The chart runs one replica with the
    Recreate strategy, so no other operator is running when this one takes the finalizers off."""
    apis = _state.get("apis")
    if apis is None:
        return
    for namespace in namespaces:
        try:
            runs = apis.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
            for run in runs:
                meta = run["metadata"]
                if FINALIZER in (meta.get("finalizers") or []):
                    kept = [f for f in meta["finalizers"] if f != FINALIZER]
                    patch = {"metadata": {"finalizers": kept, "resourceVersion": meta["resourceVersion"]}}
                    apis.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, meta["name"], patch)
        except Exception:  # noqa: BLE001 - stopping goes on; the next start or a person can remove it
            log.exception("could not take the finalizer off the TrainingRuns of %s", namespace)


def _first(index: kopf.Index, key: tuple[str, str]) -> Any:
    for value in index.get(key, []):
        return value
    return None


@kopf.daemon(GROUP, VERSION, PLURAL, initial_delay=0, cancellation_timeout=30)
def run_daemon(
    stopped: kopf.DaemonStopped,
    name: str,
    namespace: str,
    uid: str,
    body: kopf.Body,
    rollout_deployments: kopf.Index,
    learner_jobs: kopf.Index,
    **_: Any,
) -> None:
    from harnessrl.operator.render import render_harness_pod, render_run_children

    key = (namespace, name)
    informer = _informer(namespace)
    volumes = _volumes(namespace)
    while not informer.synced.wait(RECONCILE_INTERVAL_S):  # every existing pod is known before any decision
        if stopped:
            return
    controller = RunController(
        namespace,
        name,
        uid,
        _state["apis"],
        _state["config"],
        pods=informer.view(name),
        workloads=lambda: Workloads(
            _first(rollout_deployments, key), _first(learner_jobs, key),
            with_volume_problems(informer.workload_pods(name), volumes.problem),
        ),
        renderers=(render_run_children, render_harness_pod),
        metrics=METRICS,
    )
    with _lock:
        _controllers[key] = controller
    before = body.get("status") or {}
    last = (before.get("phase"), before.get("reason"))
    restarts = int((before.get("learner") or {}).get("restarts") or 0)
    writer = StatusWriter(
        lambda status: _state["apis"].patch_status(namespace, name, status),
        on_error=lambda: METRICS.errors.labels(*key).inc(),
    )
    try:
        while not stopped:
            current = dict(body)  # kopf keeps a daemon's body current with the watch
            started = time.perf_counter()
            try:
                observed = controller.reconcile(current)
            except Exception:  # noqa: BLE001 - a bug in one pass must not stop the run's reconciler
                log.exception("reconciling %s/%s failed; retrying", namespace, name)
                METRICS.errors.labels(*key).inc()
                METRICS.reconciles.labels(*key, "error").inc()
                stopped.wait(5 * RECONCILE_INTERVAL_S)
                continue
            _record(key, observed)
            status = build_status(observed, current.get("status"))
            final = status["phase"] in (Phase.SUCCEEDED.value, Phase.FAILED.value)
            if final:
                writer.write_now(status)
            elif not same_status(current.get("status"), status):
                writer.write(status, urgent=(status["phase"], status["reason"]) != last)
            METRICS.reconcile_seconds.labels(*key).observe(time.perf_counter() - started)
            if (status["phase"], status["reason"]) != last:
                _post_phase_event(current, status)
                last = (status["phase"], status["reason"])
            if int((status.get("learner") or {}).get("restarts") or 0) > restarts:
                restarts = status["learner"]["restarts"]
                kopf.warn(current, reason="LearnerRestarted", message=observed.learner_message[:1024])
            if final:
                _release_accelerators(controller, current)
                _clean_up_after_ttl(controller, status, stopped)
                return
            wait_for_next_pass(controller.wake, stopped, started, _state["config"].min_pass_interval_seconds)
    finally:
        with _lock:
            _controllers.pop(key, None)
        METRICS.forget(*key)
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            # Stopped because the run is being deleted: cancel its active attempts in the store (the traces
            # stay) before the finalizer lets the object go.
            controller.stop("Cancelled: the TrainingRun was deleted")


def wait_for_next_pass(wake: threading.Event, stopped: Any, started: float, min_interval_s: float) -> None:
    """Until a pod of the run ends (``wake``) or ``RECONCILE_INTERVAL_S`` passed, but never less than
    ``min_interval_s`` after the last pass ``started`` (a ``time.perf_counter()``): the pod events of that time
    are then settled by one pass instead of one pass each. ``stopped`` (an event-like ``wait``) cuts it short."""
    wake.wait(RECONCILE_INTERVAL_S)
    spacing = min_interval_s - (time.perf_counter() - started)
    if spacing > 0:
        stopped.wait(spacing)
    wake.clear()


def _release_accelerators(controller: RunController, body: dict[str, Any]) -> None:
    """A finished run (succeeded or failed) gives its GPUs back at once, without waiting for
    spec.ttlSecondsAfterFinished: vLLM scales to 0 and the learner Job goes. Checkpoints and traces stay. Done
    again by a restarted operator (a no-op then), so a crash between the final status and this loses nothing."""
    try:
        released = controller.apis.release_accelerators(controller.namespace, controller.name)
    except Exception:  # noqa: BLE001 - reported and counted; the ttl clean-up and a restart try again
        log.exception("releasing the accelerators of %s/%s failed", controller.namespace, controller.name)
        METRICS.errors.labels(controller.namespace, controller.name).inc()
        return
    if released:
        kopf.info(body, reason="Released", message="; ".join(released) + " (traces and checkpoints are kept)")


def _clean_up_after_ttl(
    controller: RunController, status: dict[str, Any], stopped: kopf.DaemonStopped
) -> None:
    """spec.ttlSecondsAfterFinished: the run's pods, Services, Deployment and Job go that long after it ended;
    the TrainingRun (with its status) and the stored traces stay."""
    ttl = controller.run.spec.ttl_seconds_after_finished if controller.run is not None else None
    if ttl is None:
        return
    finished = epoch(status.get("completionTime")) or time.time()
    if stopped.wait(max(0.0, finished + ttl - time.time())):
        return  # the operator is stopping or the run is being deleted
    controller.apis.delete_children(controller.namespace, controller.name)
    kopf.info(
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "TrainingRun",
            "metadata": {"name": controller.name, "namespace": controller.namespace, "uid": controller.uid},
        },
        reason="CleanedUp",
        message=f"deleted the run's pods and services {ttl} s after it finished",
    )


def _record(key: tuple[str, str], observed: Observed) -> None:
    METRICS.reconciles.labels(*key, "problem" if observed.reason in _PROBLEMS else "ok").inc()
    for state in RolloutState:
        METRICS.rollouts.labels(*key, state.value).set(observed.counts.get(state, 0))
    METRICS.queue_depth.labels(*key).set(observed.counts.get(RolloutState.QUEUED, 0))
    for phase in Phase:
        METRICS.phase.labels(*key, phase.value).set(1 if phase is observed.phase else 0)
    METRICS.observe_evaluation(key, observed.evaluation)


_PROBLEMS = {
    Reason.INVALID_SPEC,
    Reason.STORE_UNAVAILABLE,
    Reason.IMAGE_PULL_FAILED,
    Reason.UNSCHEDULABLE,
    Reason.LEARNER_CRASHED,
    Reason.ROLLOUT_UNAVAILABLE,
    Reason.WEIGHT_SYNC_FAILED,
    Reason.DEADLINE_EXCEEDED,
}


def _post_phase_event(body: dict[str, Any], status: dict[str, Any]) -> None:
    """One Event per change of phase or reason: a Warning for every problem, Normal otherwise."""
    message = f"{status['phase']}: {status.get('message') or status['reason']}"[:1024]
    if status["phase"] == Phase.FAILED.value or Reason(status["reason"]) in _PROBLEMS:
        kopf.warn(body, reason=status["reason"], message=message)
    else:
        kopf.info(body, reason=status["reason"], message=message)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def run_deleted(name: str, namespace: str, **_: Any) -> None:
    """Harness pods go at once (their attempts were cancelled by the daemon on its way out); the other
    children follow their owner through the garbage collector."""
    _state["apis"].delete_pods(namespace, f"{RUN_LABEL}={name},{COMPONENT_LABEL}={HARNESS}")
