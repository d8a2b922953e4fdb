"""Harness runs as pods: the operator's ``RolloutBackend``.

The same ``RolloutScheduler`` that ``harnessrl run`` drives with processes drives this backend with pods. What
the backend knows of its pods comes from the operator's watch (a kopf index, fed by one WATCH per operator),
never from a LIST per reconcile: ``PodBackend`` is given the run's :class:`PodView` (its current pods as
:class:`PodSummary` values, by attempt), plus the pods the watch saw disappear (tombstones).

- launch = create the pod (its name is the attempt's, so a repeated create is a 409, not a second pod);
- alive = pods not yet in a terminal state;
- exits = terminal pods, pods that can never start (bad image, missing Secret: failed fast with the kubelet's
  reason) and pods deleted before they ended (by hand, by eviction or node loss): each mapped to a
  ``HarnessExit`` with the exit code and reason the kubelet reported;
- stop = delete the pod; release = delete it if it is still there, and forget it.

At most ``budget`` pods are created per pass (a token bucket refilled at ``pods_per_second``), so a burst of
free slots never floods the API server; the scheduler launches no more than ``launch_budget()`` allows.

Inside ``parallel_calls()`` (the controller wraps each pass in it) the creates and stops of the pass run on a
small shared thread pool and the block waits for all of them: at concurrency 200 a pass settles and launches
dozens of pods, and one API round trip after the other made such a pass take seconds. Deleting the pod of a
released attempt (its harness ended and was settled) is clean-up that nothing waits for; if it fails, the pod is
reported by ``exits()`` again and released again on a later pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from harnessrl.operator.metrics import OperatorMetrics
from harnessrl.operator.naming import ATTEMPT_ANNOTATION, ROLLOUT_ANNOTATION
from harnessrl.operator.render_harness import HARNESS_CONTAINER, VERIFIER_CONTAINER
from harnessrl.operator.status import epoch
from harnessrl.operator.thread_pools import shared_pool
from harnessrl.scheduler import HarnessExit, Launch

log = logging.getLogger(__name__)

# Waiting reasons a pod never recovers from without a change to the spec: the attempt fails fast with the
# reason instead of holding a slot until its timeout. (ErrImagePull alone can be transient: the kubelet
# reports it on the first failed pull, then ImagePullBackOff.)
FATAL_WAITING = frozenset(
    {
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "ErrImageNeverPull",
        "RunContainerError",
    }
)


@dataclass(frozen=True)
class PodSummary:
    """What the backend needs of a harness pod, small enough to keep one per live pod in the index."""

    name: str
    rollout_id: str
    attempt: int
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    deleting: bool = False
    exit_code: int | None = None  # the harness container's, once it terminated
    reason: str | None = None  # why it ended or cannot start (kubelet reason and message)
    fatal: bool = False  # can never start (FATAL_WAITING)
    started_at: float | None = None  # when the harness container started (epoch seconds)
    created_at: float | None = None
    disruption: str | None = None  # the DisruptionTarget condition's reason: why the pod is being deleted

    @property
    def key(self) -> tuple[str, int]:
        return self.rollout_id, self.attempt

    @property
    def ended(self) -> bool:
        return self.phase in ("Succeeded", "Failed") or self.fatal


def summarize_pod(body: dict[str, Any]) -> PodSummary | None:
    """A harness pod's summary from its object (kopf's body or a client dict); None for foreign pods."""
    meta = body.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    try:
        rollout_id, attempt = annotations[ROLLOUT_ANNOTATION], int(annotations[ATTEMPT_ANNOTATION])
    except (KeyError, ValueError):
        return None
    status = body.get("status") or {}
    phase = status.get("phase") or "Pending"
    exit_code, reason, fatal, started = None, None, False, None
    # The harness is the main container, or with a verifier an init container followed by the verifier: the
    # attempt's outcome is the harness's failure if it failed, else the verifier's exit.
    statuses = {
        container.get("name"): container
        for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    }
    for name in (HARNESS_CONTAINER, VERIFIER_CONTAINER):
        state = (statuses.get(name) or {}).get("state") or {}
        prefix = "verifier " if name == VERIFIER_CONTAINER else ""
        if "terminated" in state:
            terminated = state["terminated"]
            exit_code = terminated.get("exitCode")
            reason = _join(terminated.get("reason"), terminated.get("message"))
            reason = prefix + reason if reason and prefix else reason
            if exit_code != 0:
                break
        elif "waiting" in state and (state["waiting"] or {}).get("reason") in FATAL_WAITING:
            waiting = state["waiting"]
            fatal, reason = True, prefix + (_join(waiting.get("reason"), waiting.get("message")) or "")
            break
        elif "running" in state and started is None:
            started = epoch(state["running"].get("startedAt"))
    disruption = next(
        (_join(c.get("reason"), c.get("message")) for c in status.get("conditions") or []
         if c.get("type") == "DisruptionTarget" and c.get("status") == "True"),
        None,
    )  # set before the deletion by an eviction (API or node pressure), preemption or taint manager
    if phase == "Failed" and exit_code is None:
        # The pod failed without the harness exiting on its own: evicted, past activeDeadlineSeconds, ...
        reason = _join(status.get("reason"), status.get("message")) or reason or "the pod failed"
    return PodSummary(
        name=meta.get("name", ""),
        rollout_id=rollout_id,
        attempt=attempt,
        phase=phase,
        deleting=bool(meta.get("deletionTimestamp")),
        exit_code=exit_code,
        reason=reason,
        fatal=fatal,
        started_at=started,
        created_at=epoch(meta.get("creationTimestamp")),
        disruption=disruption,
    )


def deleted_reason(summary: PodSummary) -> str:
    """Why an attempt whose pod was deleted before its harness ended did not finish."""
    why = f" ({summary.disruption})" if summary.disruption else ""
    return f"PodDeleted: the pod was deleted before the harness ended{why}"


def _join(reason: str | None, message: str | None) -> str | None:
    if reason and message:
        return f"{reason}: {message}"
    return reason or message


class PodView(Protocol):
    """The watch's current view of one run's harness pods (``PodInformer.view``)."""

    def pods(self) -> list[PodSummary]:
        """A snapshot of every pod of the run."""

    def get(self, key: tuple[str, int]) -> PodSummary | None:
        """The pod of one attempt, without going through the others: a pass stops and releases dozens of
        attempts, and a run may have thousands of pods."""


class PodApi:
    """The two API calls the backend makes; a small seam so the unit tests can count and fail them.

    Both are sent with the client's ``param_serialize`` and ``call_api`` and read the raw response: the
    generated ``create_namespaced_pod`` validates its body into the client's ``V1Pod`` model and dumps it back
    to JSON (a fifth of the operator's CPU at concurrency 80), every generated method validates its arguments
    with pydantic (5% at concurrency 200), and turning answers into model objects was a tenth (py-spy,
    bench/operator_scale.py); the answer is not used, and the API server validates the pod anyway. A refusal
    still raises ``ApiException`` with its status and body.
    """

    def __init__(self, core_v1: Any) -> None:
        self.core = core_v1

    def create(self, namespace: str, pod: dict[str, Any]) -> None:
        """POST the pod as the dict it is rendered as; 409 (this attempt's pod exists already) is done."""
        self._send("POST", "/api/v1/namespaces/{namespace}/pods", {"namespace": namespace}, done=409, body=pod)

    def delete(self, namespace: str, name: str, grace_seconds: int) -> None:
        """DELETE the pod; 404 (gone already) is done."""
        self._send(
            "DELETE", "/api/v1/namespaces/{namespace}/pods/{name}", {"namespace": namespace, "name": name},
            done=404, query=[("gracePeriodSeconds", grace_seconds)],
        )

    def _send(
        self, method: str, path: str, path_params: dict[str, str], *, done: int,
        body: dict[str, Any] | None = None, query: list[tuple[str, Any]] | None = None,
    ) -> None:
        from kubernetes.client.exceptions import ApiException

        client = self.core.api_client
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        request = client.param_serialize(
            method=method, resource_path=path, path_params=path_params, query_params=query,
            header_params=headers, body=body, auth_settings=["BearerToken"],
        )
        response = client.call_api(*request)
        try:
            if not 200 <= response.status <= 299:
                response.read()
                raise ApiException.from_response(http_resp=response, body=None, data=None)
        except ApiException as exc:
            if exc.status != done:
                raise
        finally:
            _drain(response.response)


def _drain(response: Any) -> None:
    """Read an unused raw response to its end, so its connection goes back to the pool."""
    response.read()
    response.release_conn()


# Pod API calls in flight at once, for all runs of the operator together. Below the kubernetes client's
# connection pool (5 per CPU, at least 10 on 2 cores), so no connection is opened only to be thrown away.
API_WORKERS = 8


def _api_pool() -> ThreadPoolExecutor:
    return shared_pool("pod-api", API_WORKERS)


class PodBackend:
    """One run's harness pods. ``view`` is the watch's current view; ``gone`` its tombstones."""

    def __init__(
        self,
        namespace: str,
        render: Callable[[Launch], dict[str, Any]],
        api: PodApi,
        view: PodView,
        *,
        pods_per_second: float = 20.0,
        stop_grace_seconds: int = 10,
        clock: Callable[[], float] = time.monotonic,
        metrics: OperatorMetrics | None = None,
        run: str = "",
    ) -> None:
        self.namespace = namespace
        self.render = render
        self.api = api
        self.view = view
        self.stop_grace_seconds = stop_grace_seconds
        self.clock = clock
        self.rate = pods_per_second
        self._tokens = pods_per_second
        self._refilled = clock()
        self.suspended = False  # no new pods (spec.suspend, or no vLLM replica serving yet)
        # Attempts whose pod the watch saw deleted before it ended, until the scheduler releases them.
        self.gone: dict[tuple[str, int], str] = {}
        # Ended attempts released while their pod's deletion has not reached the watch yet.
        self._released: set[tuple[str, int]] = set()
        # Pods the API refused to create: reported as exits so the attempt fails with the reason.
        self._refused: dict[tuple[str, int], str] = {}
        self.metrics = metrics
        self.labels = (namespace, run)
        self._start_recorded: set[tuple[str, int]] = set()
        self._batch: list[Future[None]] | None = None  # calls of the current parallel_calls() block

    @contextmanager
    def parallel_calls(self) -> Iterator[None]:
        """Run the block's pod creates and deletes concurrently; leaving the block waits for every one.

        A create the API server refuses still fails its attempt (reported by ``exits()``); any other failure
        of a call is raised here, after all calls of the block have finished, as it would be without the block.
        """
        if self._batch is not None:  # nested (a pass that stops the run): the outer block waits
            yield
            return
        batch: list[Future[None]] = []
        self._batch = batch
        try:
            yield
        finally:
            self._batch = None
            wait(batch)
        for future in batch:
            error = future.exception()
            if error is not None:
                raise error

    def _call(self, function: Callable[..., None], *args: Any, waited: bool = True) -> None:
        """Call now outside ``parallel_calls()``; inside, on the pool (``waited``: the block waits for it)."""
        if self._batch is None:
            function(*args)
            return
        future = _api_pool().submit(function, *args)
        if waited:
            self._batch.append(future)

    # --- what the scheduler calls ---------------------------------------------------------------------------

    def launch_budget(self) -> int:
        """Pods this pass may create: 0 while suspended, else the token bucket's whole tokens."""
        if self.suspended:
            return 0
        now = self.clock()
        self._tokens = min(self.rate, self._tokens + (now - self._refilled) * self.rate)
        self._refilled = now
        return int(self._tokens)

    def launch(self, launch: Launch) -> None:
        self._tokens -= 1
        try:
            pod = self.render(launch)
        except Exception as exc:  # noqa: BLE001 - a pod that cannot be rendered fails this attempt, not the run
            self._refuse(launch, exc)
            return
        self._call(self._create, launch, pod)

    def _create(self, launch: Launch, pod: dict[str, Any]) -> None:
        try:
            self.api.create(self.namespace, pod)
            if self.metrics:
                self.metrics.pods_created.labels(*self.labels).inc()
        except Exception as exc:  # noqa: BLE001 - any refusal fails this attempt with the reason, not the run
            self._refuse(launch, exc)

    def _refuse(self, launch: Launch, exc: Exception) -> None:
        if self.metrics:
            self.metrics.pod_create_failures.labels(*self.labels).inc()
        reason = getattr(exc, "reason", None) or exc.__class__.__name__
        body = getattr(exc, "body", None)
        self._refused[(launch.rollout_id, launch.attempt)] = f"PodRejected: {reason}: {body or exc}"[:1000]
        log.warning("creating the pod of %s attempt %d failed: %s", launch.rollout_id, launch.attempt, exc)

    def alive(self) -> set[tuple[str, int]]:
        live = set()
        for pod in self.view.pods():
            if not pod.ended and not pod.deleting:
                live.add(pod.key)
                if pod.started_at and pod.created_at and pod.key not in self._start_recorded:
                    self._start_recorded.add(pod.key)
                    if self.metrics:
                        self.metrics.pod_start.labels(*self.labels).observe(
                            max(0.0, pod.started_at - pod.created_at)
                        )
        return live

    def exits(self) -> list[HarnessExit]:
        ended: dict[tuple[str, int], HarnessExit] = {}
        # Snapshots: the watch thread adds tombstones while the reconciler reads them.
        for key, why in list(self.gone.items()):
            ended[key] = HarnessExit(*key, None, why)
        for key, why in list(self._refused.items()):
            ended[key] = HarnessExit(*key, None, why)
        for pod in self.view.pods():
            if pod.key in self._released:
                continue
            if pod.phase == "Succeeded":
                ended[pod.key] = HarnessExit(
                    *pod.key, pod.exit_code if pod.exit_code is not None else 0, None
                )
            elif pod.phase == "Failed" or pod.fatal:
                detail = pod.reason if pod.exit_code is None or pod.exit_code != 0 else None
                ended[pod.key] = HarnessExit(*pod.key, pod.exit_code if not pod.fatal else None, detail)
            elif pod.deleting and pod.disruption:
                # Evicted, preempted or tainted away: the pod goes whatever its containers do now, and may take
                # its whole grace period (the proxy's flush; a harness that ignores SIGTERM, as a Python PID 1
                # does). The attempt ends now with the reason, not at its timeout, and its retry may start.
                ended[pod.key] = HarnessExit(*pod.key, None, deleted_reason(pod))
        return [ended[key] for key in sorted(ended)]

    def stop(self, rollout_id: str, attempt: int, reason: str) -> None:
        pod = self.view.get((rollout_id, attempt))
        if pod is not None and not pod.deleting:
            log.info("stopping %s: %s", pod.name, reason)
            self._delete(pod.name, self.stop_grace_seconds)

    def release(self, rollout_id: str, attempt: int) -> None:
        key = (rollout_id, attempt)
        self.gone.pop(key, None)
        self._refused.pop(key, None)
        self._start_recorded.discard(key)
        pod = self.view.get(key)
        if pod is not None:
            self._released.add(key)
            if not pod.deleting:
                # Clean-up nothing waits for: a pass does not hold its next settlements back on it.
                self._call(self._delete_released, key, pod.name, waited=False)

    def _delete(self, name: str, grace_seconds: int) -> None:
        self._call(self._delete_now, name, grace_seconds)

    def _delete_released(self, key: tuple[str, int], name: str) -> None:
        try:
            self._delete_now(name, 0)
        except Exception:  # noqa: BLE001 - the pod is reported again by exits() and released again
            log.warning("deleting the ended pod %s failed; it is deleted again on a later pass", name, exc_info=True)
            self._released.discard(key)

    def _delete_now(self, name: str, grace_seconds: int) -> None:
        self.api.delete(self.namespace, name, grace_seconds)
        if self.metrics:
            self.metrics.pods_deleted.labels(*self.labels).inc()

    # --- what the watch calls -------------------------------------------------------------------------------

    def pod_deleted(self, summary: PodSummary) -> None:
        """The watch saw the pod disappear. If it had not ended, its attempt ended with it."""
        self._start_recorded.discard(summary.key)
        if summary.key in self._released:
            self._released.discard(summary.key)
            return
        if not summary.ended:
            self.gone[summary.key] = deleted_reason(summary)
