"""One TrainingRun's reconciler: compare what the run asks for with what is observed, then act.

It holds no state a restart would lose. The children are (re)applied with server-side apply whenever the
spec's generation is new to this process or a child is missing from the watch; rollouts live in the store
and are driven by the same ``RolloutScheduler`` as ``harnessrl run``, with the pod backend. Everything a
reconcile observed goes into one :class:`~harnessrl.operator.status.Observed`, from which the status is built.

Failures at run time (a missing Secret or ConfigMap, an unreachable store, a learner that failed beyond its
backoff, vLLM that never became ready) end up as a phase, a typed reason and a message that names the field
and the fix; they never raise out of the reconcile, so the operator never crash-loops on one bad run.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from harnessrl.operator import naming
from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.metrics import OperatorMetrics
from harnessrl.operator.naming import RUN_LABEL
from harnessrl.operator.pods import PodApi, PodBackend, PodView
from harnessrl.operator.render_secret import render_reward_secret
from harnessrl.operator.status import LearnerJobRecord, Observed, epoch, now_iso, unavailable_since
from harnessrl.operator.workload_pods import WorkloadPod, kubelet_reason, workload_problem
from harnessrl.policy_serving import is_lora
from harnessrl.scheduler import Launch, RolloutScheduler, SchedulerSettings
from harnessrl.spec.harness import Tasks
from harnessrl.spec.models import TrainingRun
from harnessrl.spec.problems import InvalidSpec, parse_training_run
from harnessrl.spec.status import Phase, Reason
from harnessrl.store import RunOwnedElsewhere, TraceStore
from harnessrl.store.evaluations import evaluation_results
from harnessrl.store.learner_ledger import LearnerLedger

log = logging.getLogger(__name__)


CHILD_KINDS = (
    ("apps/v1", "Deployment"),
    ("batch/v1", "Job"),
    ("v1", "Service"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("v1", "Pod"),
    ("v1", "Secret"),
)


class RunProblem(Exception):
    """A problem the user must fix; the message names the field and the fix. ``terminal`` problems fail the
    run; the others (a Secret or ConfigMap not created yet, the store not reachable yet) keep it Pending and
    are checked again on every pass, so creating the missing object is all it takes."""

    def __init__(self, reason: Reason, message: str, terminal: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.terminal = terminal


@dataclass
class Workloads:
    """What the watch says of the run's vLLM Deployment and learner Job (None: not there)."""

    deployment: dict[str, Any] | None
    job: dict[str, Any] | None
    pods: tuple[WorkloadPod, ...] = ()  # their pods, for what keeps them from running


class Apis:
    """The Kubernetes API calls the reconciler makes (sync client; kopf runs sync daemons in threads)."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client, dynamic

        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.dynamic = dynamic.DynamicClient(api_client)

    def apply(self, obj: dict[str, Any]) -> None:
        resource = self.dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        resource.server_side_apply(
            body=obj,
            namespace=obj["metadata"]["namespace"],
            field_manager="harnessrl-operator",
            force_conflicts=True,
        )

    def create_once(self, obj: dict[str, Any]) -> None:
        """Create ``obj`` unless an object of that name exists (which is then kept as it is)."""
        from kubernetes.client.exceptions import ApiException

        resource = self.dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        try:
            resource.create(body=obj, namespace=obj["metadata"]["namespace"])
        except ApiException as exc:
            if exc.status != 409:
                raise

    def delete_children(self, namespace: str, run: str) -> None:
        """Every object the run owns, but the run itself (spec.ttlSecondsAfterFinished)."""
        from kubernetes.client.exceptions import ApiException

        for api_version, kind in CHILD_KINDS:
            resource = self.dynamic.resources.get(api_version=api_version, kind=kind)
            for item in resource.get(namespace=namespace, label_selector=f"{RUN_LABEL}={run}").items:
                try:
                    resource.delete(
                        name=item.metadata.name, namespace=namespace, body={"propagationPolicy": "Background"}
                    )
                except ApiException as exc:
                    if exc.status != 404:
                        raise

    def release_accelerators(self, namespace: str, run: str) -> list[str]:
        """Scale the run's vLLM Deployment to 0 and delete its learner Job (the Job's pods go with it), so a
        finished run holds no GPU; what the run wrote stays (the store, the checkpoint claim, which the run
        does not own), and so do its Services, Secret and the Deployment object. A merge patch, not an apply:
        an apply of just the replicas would drop every other field this manager owns. What was released."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        released = []
        apps = client.AppsV1Api(self.core.api_client)
        try:
            # The answer's status still counts the replicas the patch is about to remove (none after a restart).
            scaled = apps.patch_namespaced_deployment(
                naming.rollout_name(run), namespace, {"spec": {"replicas": 0}}
            )
            if (scaled.status.replicas or 0) > 0:
                released.append(f"scaled Deployment {naming.rollout_name(run)} to 0")
        except ApiException as exc:
            if exc.status != 404:
                raise
        if self.delete_job(namespace, naming.learner_name(run)):
            released.append(f"deleted Job {naming.learner_name(run)}")
        return released

    def delete_job(self, namespace: str, name: str) -> bool:
        """Delete a Job and, in the background, its pods; False when it was gone already."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            client.BatchV1Api(self.core.api_client).delete_namespaced_job(
                name, namespace, body={"propagationPolicy": "Background"}
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            return False
        return True

    def delete_pods(self, namespace: str, label_selector: str) -> None:
        self.core.delete_collection_namespaced_pod(
            namespace, label_selector=label_selector, grace_period_seconds=10
        )

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            "harnessrl.io", "v1alpha1", namespace, "trainingruns", name, {"status": status}
        )

    def secret_value(self, namespace: str, name: str, key: str, field: str) -> str:
        read = lambda: self.core.read_namespaced_secret(name, namespace).data
        return base64.b64decode(self._value(read, key, field, f"Secret {name!r}", namespace)).decode()

    def claim(self, namespace: str, name: str, field: str) -> Any:
        """A PersistentVolumeClaim; a missing one is the field's problem (the run waits for it)."""
        return self._read(
            lambda: self.core.read_namespaced_persistent_volume_claim(name, namespace),
            field, f"PersistentVolumeClaim {name!r}", namespace,
        )

    def config_map_value(self, namespace: str, name: str, key: str, field: str) -> str:
        read = lambda: self.core.read_namespaced_config_map(name, namespace).data
        return self._value(read, key, field, f"ConfigMap {name!r}", namespace)

    def _value(self, read: Callable[[], Any], key: str, field: str, what: str, namespace: str) -> str:
        """One key of a Secret's or ConfigMap's data; a missing object or key is the field's problem."""
        data = self._read(read, field, what, namespace)
        if not data or key not in data:
            raise RunProblem(
                Reason.INVALID_SPEC,
                f"{field}: {what} has no key {key!r} — add the key or point {field}.key at the key that holds it",
                terminal=False,
            )
        return data[key]

    @staticmethod
    def _read(read: Callable[[], Any], field: str, what: str, namespace: str) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return read()
        except ApiException as exc:
            if exc.status == 404:
                raise RunProblem(
                    Reason.INVALID_SPEC,
                    f"{field}: {what} not found in namespace {namespace} — create it or fix the name",
                    terminal=False,
                ) from None
            raise


Renderers = tuple[Callable[..., list[dict[str, Any]]], Callable[..., dict[str, Any]]]


class RunController:
    """Reconciles one TrainingRun; created by the run's daemon, rebuilt from scratch after a restart."""

    def __init__(
        self,
        namespace: str,
        name: str,
        uid: str,
        apis: Apis,
        config: OperatorConfig,
        pods: PodView,
        workloads: Callable[[], Workloads],
        renderers: Renderers,
        clock: Callable[[], float] = time.time,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self.namespace, self.name, self.uid = namespace, name, uid
        self.apis = apis
        self.config = config
        self.workloads = workloads
        self.render_children, self.render_pod = renderers
        self.clock = clock
        self.backend = PodBackend(
            namespace,
            self._render_pod,
            PodApi(apis.core),
            pods,
            pods_per_second=config.pod_creates_per_second,
            metrics=metrics,
            run=name,
        )
        self.run: TrainingRun | None = None
        self.store: TraceStore | None = None
        self.store_url: str | None = None
        self.evaluation_read: Any = None  # the spec.evaluation whose tasks the scheduler holds
        self.scheduler: RolloutScheduler | None = None
        self.applied_generation: int | None = None
        self.claim_checked: tuple[int, tuple[bool, str, str] | None] | None = None  # (generation, finding)
        self.learner_job: LearnerJobRecord | None = None  # status.learner, read from the run's status once
        self.retired_jobs: set[str] = set()  # learner Jobs deleted to be recreated, while the watch still shows them
        self.wake = threading.Event()  # set by the watch when a pod ends: reconcile now, not at the interval

    # --- one pass -------------------------------------------------------------------------------------------

    def reconcile(self, body: dict[str, Any]) -> Observed:
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        generation = int(meta.get("generation") or 0)
        observed = Observed(generation, Phase.PENDING, Reason.CREATED)
        if status.get("phase") in (Phase.SUCCEEDED.value, Phase.FAILED.value):
            return self._finished(body, observed)
        try:
            self.run = parse_training_run({k: v for k, v in body.items() if k != "status"}, cluster=True)
        except InvalidSpec as invalid:
            return self._fail(observed, Reason.INVALID_SPEC, "; ".join(str(p) for p in invalid.problems))
        if self.learner_job is None:
            self.learner_job = LearnerJobRecord.from_status(status.get("learner"))
        try:
            self._connect_store(observed)
            self._apply_children(generation)
            self._check_checkpoint_claim(generation, observed)
            self._observe_workloads(observed)
            with self.backend.parallel_calls():
                self._progress(observed, status)
        except RunProblem as problem:
            if problem.terminal:
                return self._fail(observed, problem.reason, str(problem))
            if self.store is None:
                observed.store_ready, observed.store_message = False, str(problem)
            observed.phase, observed.reason, observed.message = Phase.PENDING, problem.reason, str(problem)
        finally:
            observed.learner_job = self.learner_job
        return observed

    def stop(self, reason: str) -> None:
        """Stop scheduling: cancel active attempts and delete their pods (finalizer, suspend, end)."""
        if self.scheduler is not None:
            with self.backend.parallel_calls():
                self.scheduler.stop_all(reason)

    # --- steps ----------------------------------------------------------------------------------------------

    def _connect_store(self, observed: Observed) -> None:
        if self.store is None:
            url = self._store_url()
            owner = f"{self.namespace}/{self.name}"
            try:
                store = TraceStore.connect(url)
                store.upgrade()
                store.ensure_run(
                    self.name, self.run.model_dump(mode="json", by_alias=True, exclude_none=True), owner=owner
                )
            except RunOwnedElsewhere as exc:
                store.close()
                raise RunProblem(
                    Reason.INVALID_SPEC,
                    f"metadata.name: the trace store already holds a run {self.name!r} of TrainingRun {exc.owner}, "
                    "and a store names runs by name alone — give this run another name, or set spec.store to "
                    "another database; nothing of the other run was changed",
                ) from None
            except Exception as exc:  # noqa: BLE001 - any failure to reach the store is reported, not raised
                raise RunProblem(
                    Reason.STORE_UNAVAILABLE,
                    f"spec.store: cannot use the trace store "
                    f"({exc.__class__.__name__}: {str(exc).splitlines()[0][:300]}) — check the URL, "
                    "the credentials and that the database accepts connections",
                    terminal=False,
                ) from None
            self.store, self.store_url = store, url
            self.evaluation_read = self.run.spec.evaluation
            self.scheduler = RolloutScheduler(
                store, SchedulerSettings.from_spec(self.name, self.run.spec), self.backend, self._tasks(),
                evaluation_tasks=self._evaluation_tasks(),
            )
        else:
            # harness.concurrency, timeoutSeconds and maxAttempts may change while the run exists
            # (harnessrl.spec.changes); the next launches and settlements follow them. So may spec.evaluation
            # be added (or its everySteps change): its tasks are read again when it changes, no restart needed.
            self.scheduler.settings = SchedulerSettings.from_spec(self.name, self.run.spec)
            evaluation = self.run.spec.evaluation
            if evaluation is not None and evaluation != self.evaluation_read:
                self.scheduler.set_evaluation_tasks(self._evaluation_tasks())
                self.evaluation_read = evaluation
        observed.store_ready, observed.store_message = True, "the trace store answers"

    def _store_url(self) -> str:
        postgres = self.run.spec.store.postgres
        if postgres is None:
            if self.config.store_url:
                return self.config.store_url
            raise RunProblem(
                Reason.INVALID_SPEC,
                "spec.store: the SQLite store only works with `harnessrl run` "
                "— set spec.store.postgres.secretRef, or install the chart's PostgreSQL "
                "(the operator's default store)",
            )
        if postgres.url:
            return postgres.url
        ref = postgres.secret_ref
        return self.apis.secret_value(self.namespace, ref.name, ref.key, "spec.store.postgres.secretRef")

    def _tasks(self) -> list[dict[str, Any]]:
        return self._task_list(self.run.spec.harness.tasks, "spec.harness.tasks")

    def _evaluation_tasks(self) -> list[dict[str, Any]]:
        evaluation = self.run.spec.evaluation
        return self._task_list(evaluation.tasks, "spec.evaluation.tasks") if evaluation is not None else []

    def _task_list(self, source: Tasks, field: str) -> list[dict[str, Any]]:
        """Tasks from one source (harness.tasks or evaluation.tasks, named by ``field`` in every error)."""
        if source.inline is not None:
            return [task.model_dump(mode="json", by_alias=True, exclude_none=True) for task in source.inline]
        if source.config_map is not None:
            ref = source.config_map
            text = self.apis.config_map_value(
                self.namespace, ref.name, ref.key, f"{field}.configMap"
            )
            tasks = []
            for number, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        task = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise RunProblem(
                            Reason.INVALID_SPEC,
                            f"{field}.configMap: line {number} of "
                            f"{ref.name}/{ref.key} is not JSON ({exc.msg}) — one task object "
                            "per line",
                        ) from None
                    tasks.append(task)
            if not tasks:
                raise RunProblem(
                    Reason.INVALID_SPEC,
                    f"{field}.configMap: {ref.name}/{ref.key} has "
                    "no tasks — add one JSON object per line",
                )
            return tasks
        raise RunProblem(
            Reason.INVALID_SPEC,
            f"{field}.file: the operator cannot read files on a "
            "volume — put the tasks in a ConfigMap (tasks.configMap) or inline",
        )

    def _workloads(self) -> Workloads:
        """What the watch says, less a learner Job this controller deleted to recreate (the watch shows it
        until its deletion event arrives)."""
        loads = self.workloads()
        if loads.job is not None and (loads.job.get("metadata") or {}).get("uid") in self.retired_jobs:
            loads = replace(loads, job=None)
        return loads

    def _apply_children(self, generation: int) -> None:
        loads = self._workloads()
        wants_rollout = self.run.spec.rollout.upstreams is None
        missing = loads.job is None or (wants_rollout and loads.deployment is None)
        if generation == self.applied_generation and not missing:
            return
        try:
            children = self.render_children(
                self.run, self.namespace, self.uid, self.config, store_url=self.store_url
            )
        except ValueError as error:  # the renderers name the field and the fix
            raise RunProblem(Reason.INVALID_SPEC, str(error)) from None
        for child in children:
            self._apply(child)
        if self.run.spec.harness.verifier is not None:
            token = secrets.token_urlsafe(32)
            self.apis.create_once(render_reward_secret(self.run, self.namespace, self.uid, token))
        self.applied_generation = generation

    def _apply(self, child: dict[str, Any]) -> None:
        """Apply one child; an object the API server refuses as invalid (422) is the spec's problem: fields
        such as ``scheduling.affinity`` are copied as written, and only the server checks their shape."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.apis.apply(child)
        except ApiException as exc:
            if exc.status != 422:
                raise
            try:
                said = json.loads(exc.body).get("message") or exc.body
            except (TypeError, ValueError):
                said = exc.body or exc.reason
            raise RunProblem(
                Reason.INVALID_SPEC,
                f"the API server refused {child['kind']} {child['metadata']['name']}: {said} — fix the spec "
                "field it names (spec.rollout, spec.learner or spec.harness; scheduling.affinity is copied as "
                "written)",
            ) from None

    def _check_checkpoint_claim(self, generation: int, observed: Observed) -> None:
        """Whether the learner and the vLLM pods can all mount the checkpoint claim. The CRD already requires
        one for a run whose vLLM the operator runs; its access modes decide whether pods on different nodes
        can share it. ReadWriteOnce can only be shared on one node (pods elsewhere would sit in
        ContainerCreating with a Multi-Attach error): reported in the CheckpointsShared condition.
        ReadWriteOncePod can never be shared: the run waits, naming the fix. Read once per generation (access
        modes are immutable) until it is found and shareable."""
        volume = self.run.spec.learner.checkpoint_volume
        if volume is None or self.run.spec.rollout.upstreams is not None:
            return
        if self.claim_checked is not None and self.claim_checked[0] == generation:
            observed.checkpoints_shared = self.claim_checked[1]
            return
        field = "spec.learner.checkpointVolume.pvc"
        claim = self.apis.claim(self.namespace, volume.pvc, field)
        modes = set(claim.spec.access_modes or [])
        fix = "use a ReadWriteMany claim (NFS, CephFS, a cloud file store) for the checkpoints"
        if "ReadWriteMany" in modes:
            finding = (True, "ReadWriteMany", f"claim {volume.pvc} is ReadWriteMany: the learner and every vLLM "
                       "replica can mount it on any node")
        elif modes == {"ReadWriteOncePod"}:
            raise RunProblem(
                Reason.INVALID_SPEC,
                f"{field}: claim {volume.pvc} is ReadWriteOncePod, so only one pod may mount it, but the learner "
                f"and every vLLM replica must — {fix}",
                terminal=False,
            )
        else:
            shown = ", ".join(sorted(modes)) or "no access mode"
            finding = (False, "NotShareableAcrossNodes", f"{field}: claim {volume.pvc} is {shown}: the learner "
                       "and vLLM pods can share it only on one node, and a pod placed on another stays in "
                       f"ContainerCreating (Multi-Attach) — {fix}, or keep them on one node with "
                       "spec.rollout.scheduling and spec.learner.scheduling")
        self.claim_checked = (generation, finding)
        observed.checkpoints_shared = finding

    def _observe_workloads(self, observed: Observed) -> None:
        loads = self._workloads()
        spec = self.run.spec
        if spec.rollout.upstreams is not None:
            observed.rollout_ready, observed.rollout_message = (
                True,
                "external upstreams (spec.rollout.upstreams)",
            )
        elif loads.deployment is not None:
            available = int((loads.deployment.get("status") or {}).get("availableReplicas") or 0)
            observed.rollout_ready = available > 0
            observed.rollout_message = f"{available}/{spec.rollout.replicas} vLLM replicas serve the model"
            observed.rollout_problem = workload_problem(loads.pods, naming.ROLLOUT)
            observed.rollout_kubelet_reason = kubelet_reason(loads.pods, naming.ROLLOUT)
            if observed.rollout_problem is not None:
                observed.rollout_message += f"; {observed.rollout_problem[1]}"
        else:
            observed.rollout_ready, observed.rollout_message = False, "the vLLM Deployment is being created"
        job_status = (loads.job or {}).get("status") or {}
        conditions = {
            c.get("type"): c for c in job_status.get("conditions") or [] if c.get("status") == "True"
        }
        if loads.job is not None:
            self._track_learner_job(loads.job)
        if "Failed" in conditions:
            self._recreate_learner_job(conditions["Failed"], observed)
            return
        # Ready, not active: a Pending pod is active. The learner has no readiness probe, so a ready pod is one
        # whose containers run.
        ready = int(job_status.get("ready") or 0)
        observed.learner_ready = loads.job is not None and ready > 0
        observed.learner_message = (
            f"{ready}/{self.run.spec.learner.nodes} learner pods running"
            if loads.job
            else "the learner Job is being created"
        )
        observed.learner_problem = workload_problem(loads.pods, naming.LEARNER) if loads.job else None
        observed.learner_kubelet_reason = kubelet_reason(loads.pods, naming.LEARNER) if loads.job else None
        if observed.learner_problem is not None:
            observed.learner_message += f"; {observed.learner_problem[1]}"

    def _track_learner_job(self, job: dict[str, Any]) -> None:
        """A learner Job seen for the first time (created now, recreated, or one an earlier operator made)
        counts its progress from the step committed now."""
        uid = (job.get("metadata") or {}).get("uid")
        if uid and self.learner_job.job_uid != uid:
            step = LearnerLedger(self.store, self.name).committed_step()
            self.learner_job = replace(self.learner_job, job_uid=uid, since_step=step)

    def _recreate_learner_job(self, failed: dict[str, Any], observed: Observed) -> None:
        """The learner Job failed past its ``backoffLimit``. If it committed steps since it was created, its
        failures were incidents of a long run (a node lost, a pod killed, a store restart), each resumed from
        the newest checkpoint: the Job is deleted and recreated with a fresh backoffLimit, so such incidents
        never add up to a lifetime limit. A Job that fails again and again without committing a step is not
        transient: the run fails (LearnerCrashed), releasing its accelerators."""
        record = self.learner_job
        said = f"{failed.get('reason')}: {failed.get('message')}"
        step = LearnerLedger(self.store, self.name).committed_step()
        since = record.since_step if record.since_step is not None else step
        if failed.get("reason") != "BackoffLimitExceeded" or step <= since:
            raise RunProblem(
                Reason.LEARNER_CRASHED,
                f"the learner Job failed beyond its backoff ({said}) without committing a step since it started "
                f"(at step {since}) — see `kubectl logs job/{naming.learner_name(self.name)}` and "
                f"`kubectl describe pods -l {RUN_LABEL}={self.name},{naming.COMPONENT_LABEL}={naming.LEARNER}`",
            )
        self.apis.delete_job(self.namespace, naming.learner_name(self.name))
        self.retired_jobs.add(record.job_uid or "")
        self.learner_job = LearnerJobRecord(restarts=record.restarts + 1, job_uid=None, since_step=step)
        observed.learner_ready = False
        observed.learner_message = (
            f"the learner Job failed ({said}) after committing steps {since + 1}-{step}: recreated, it resumes "
            f"from step {step}'s checkpoint (restart {record.restarts + 1})"
        )

    def _progress(self, observed: Observed, status: dict[str, Any]) -> None:
        spec = self.run.spec
        ledger = LearnerLedger(self.store, self.name)
        if spec.evaluation is not None:  # without one there is nothing to read (three queries a pass)
            observed.evaluation = evaluation_results(self.store, self.name, spec.evaluation)
        step = ledger.committed_step()  # trained or empty (a step with nothing to train makes no version)
        serving = self.store.latest_policy_version(self.name, synced_only=True)
        observed.policy_version = serving or 0
        observed.step = step
        metrics = ledger.step_metrics(step) if step else None
        if metrics and isinstance(metrics.get("reward_mean"), (int, float)):
            observed.reward_mean = float(metrics["reward_mean"])
        created = epoch(status.get("startTime")) or self.clock()
        observed.start_time = status.get("startTime") or now_iso()
        if (observed.step or 0) >= spec.learner.steps and self._evaluating_final_version(observed):
            return
        if step >= spec.learner.steps:
            self.stop("Cancelled: the run completed")
            observed.counts = self.store.count_attempts(self.name)
            observed.phase, observed.reason = Phase.SUCCEEDED, Reason.COMPLETED
            observed.message = f"trained {step} steps"
            observed.completion_time = now_iso()
            return
        deadline = spec.active_deadline_seconds
        if deadline is not None and self.clock() - created > deadline:
            self.stop("Cancelled: spec.activeDeadlineSeconds passed")
            raise RunProblem(
                Reason.DEADLINE_EXCEEDED,
                f"the run ran longer than spec.activeDeadlineSeconds="
                f"{deadline} — raise it (or remove it) and create the run again",
            )
        # No new harness pods while suspended or while no replica serves (they would only wait or fail);
        # pods already running are still settled by the reconcile.
        # A LoRA policy is served once the learner loaded version 0's adapter: calls before would find no model.
        self.backend.suspended = spec.suspend or not observed.rollout_ready or (is_lora(spec) and serving is None)
        if not observed.rollout_ready:
            waited = self.clock() - unavailable_since(status, created, self.clock())
            if waited > self.config.provisioning_timeout_seconds:
                raise RunProblem(
                    Reason.ROLLOUT_UNAVAILABLE,
                    f"no vLLM replica served the model for "
                    f"{self.config.provisioning_timeout_seconds} s ({observed.rollout_message}) — "
                    f"check `kubectl describe deployment {self.name}-rollout` (image, GPUs, model "
                    "path)",
                )
            observed.phase, observed.reason = Phase.PROVISIONING, Reason.PROVISIONING
            observed.message = observed.rollout_message
            if observed.rollout_problem is not None:
                observed.reason, observed.message = observed.rollout_problem
            passed = self.scheduler.reconcile(observed.policy_version)
        else:
            passed = self.scheduler.reconcile(observed.policy_version)
            if spec.suspend:
                observed.phase, observed.reason = Phase.SUSPENDED, Reason.SUSPENDED
                observed.message = "spec.suspend is true: no new rollouts start; running ones finish"
            else:
                observed.phase, observed.reason = Phase.RUNNING, Reason.RUNNING
                observed.message = f"step {step} of {spec.learner.steps}"
                if observed.learner_problem is not None:  # rollouts go on, but no step will come
                    observed.reason, observed.message = observed.learner_problem
        observed.counts = passed.counts

    def _evaluating_final_version(self, observed: Observed) -> bool:
        """Training is done: with spec.evaluation the final version is evaluated before the run succeeds, by
        scheduler passes that start no training rollout any more (as ``harnessrl run`` does). True while that
        evaluation runs; the run then completes as without one."""
        if self.run.spec.evaluation is None:
            return False
        self.scheduler.reconcile(observed.policy_version, finishing=True)
        observed.evaluation = evaluation_results(self.store, self.name, self.run.spec.evaluation)  # as it ends
        if not self.scheduler.evaluation_pending():
            return False
        observed.counts = self.store.count_attempts(self.name)
        observed.phase, observed.reason = Phase.RUNNING, Reason.RUNNING
        observed.message = f"trained {observed.step} steps; evaluating policy v{observed.policy_version}"
        return True

    def _finished(self, body: dict[str, Any], observed: Observed) -> Observed:
        status = body.get("status") or {}
        observed.phase, observed.reason = Phase(status["phase"]), Reason(status.get("reason") or "Completed")
        observed.message = status.get("message") or ""
        return observed

    def _fail(self, observed: Observed, reason: Reason, message: str) -> Observed:
        self.stop(f"Cancelled: the run failed ({reason.value})")
        observed.phase, observed.reason, observed.message = Phase.FAILED, reason, message
        observed.completion_time = now_iso()
        if self.store is not None:
            observed.counts = self.store.count_attempts(self.name)
        return observed

    def _render_pod(self, launch: Launch) -> dict[str, Any]:
        return self.render_pod(self.run, self.namespace, self.uid, self.config, launch)
