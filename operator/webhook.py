"""Sidecar injection: agent pods that users run themselves get the capture proxy the operator's own harness
pods have.

A pod opts in with the label ``harnessrl.io/run=<TrainingRun>`` in the run's namespace. On CREATE the
mutating webhook adds, built by the same code as the operator's harness pods (``render_harness``):

- the proxy as a native sidecar (init container ``proxy``, ``restartPolicy: Always``), first among the init
  containers so it is up before any other starts. Attribution: the pod's own name (``HARNESSRL_ROLLOUT_ID``
  from ``fieldRef metadata.name``, resolved when the container starts, so ``generateName`` pods work too),
  attempt 0, and the run's ``status.policyVersion`` (0 before the first one);
- an emptyDir for the proxy's spool (``harnessrl-proxy-spool``);
- ``OPENAI_BASE_URL`` and ``HARNESSRL_REWARD_URL`` of the proxy in every regular container, each unless the
  container's ``env`` already names it: a container's own explicit value wins. A value from ``envFrom`` is
  not seen, and the injected ``env`` entry takes precedence over it (Kubernetes' rule);
- ``terminationGracePeriodSeconds`` raised to the operator's harness pods' (``TERMINATION_GRACE_SECONDS``) when
  the pod asks for less (Kubernetes' default is 30 s): a proxy whose pod ends while the store is down keeps
  flushing its spool for up to ``PROXY_FLUSH_SECONDS`` and is killed at the grace period, losing what is left.
  A proxy with nothing left to store exits at once, so the longer grace costs a pod nothing;
- the annotation ``harnessrl.io/proxy-injected: "true"``.

Idempotent: a pod that has the annotation or an init container named ``proxy`` is left as it is, and pods the
operator itself creates (any ``harnessrl.io/component`` label: harness, rollout and learner pods) never reach
the webhook. It fails open: when it cannot inject (no such TrainingRun in the namespace, an invalid spec,
unusable store settings, a bug here) the pod is admitted unchanged but for the annotation
``harnessrl.io/proxy-injection: "skipped: <why and the fix>"``, and when the webhook is down the API server
admits it untouched (``failurePolicy: Ignore``).

The run comes from a kopf index over TrainingRuns (no API call per admission); a pod created in the first
moments after the operator starts, before the index holds its run, is skipped with that reason.

Opt-in, from the environment (unset ``HARNESSRL_WEBHOOK_LISTEN``: nothing is served):

``HARNESSRL_WEBHOOK_LISTEN``         ``ADDR:PORT`` to serve HTTPS on (``0.0.0.0:9443`` in a pod).
``HARNESSRL_WEBHOOK_CERT``, ``_KEY``  the serving certificate and key (PEM files); both required.
``HARNESSRL_WEBHOOK_CA``             the CA bundle (PEM file) the API server verifies with; default the cert.
``HARNESSRL_WEBHOOK_CONFIGURATION``  a MutatingWebhookConfiguration name for the operator to keep current
                                     (server-side apply whenever it starts serving); unset, the installer
                                     owns it (the chart's, from :func:`render_mutating_webhook_configuration`).
``HARNESSRL_WEBHOOK_URL``            the URL the API server calls, for that configuration; default
                                     ``https://ADDR:PORT`` (``0.0.0.0`` read as ``127.0.0.1``).

The configuration is left in place when the operator stops: with ``failurePolicy: Ignore`` pods are then
admitted without a proxy, which is the point of failing open.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.naming import COMPONENT_LABEL, MANAGED_BY, RUN_LABEL
from harnessrl.operator.render_common import env, env_from_field, merge_env
from harnessrl.operator.render_harness import PROXY_CONTAINER, TERMINATION_GRACE_SECONDS, proxy_container
from harnessrl.scheduler import Launch
from harnessrl.spec.models import API_VERSION, GROUP, KIND, VERSION, TrainingRun
from harnessrl.spec.problems import InvalidSpec, parse_training_run

log = logging.getLogger(__name__)

WEBHOOK_ID = "inject-proxy"
"""The kopf handler id, and so the URL path (``/inject-proxy``) its webhook configuration must call."""
CONFIGURATION_NAME = "harnessrl-proxy-injector"
INJECTED_ANNOTATION = "harnessrl.io/proxy-injected"
INJECTION_ANNOTATION = "harnessrl.io/proxy-injection"
SPOOL_VOLUME = "harnessrl-proxy-spool"
"""Not the harness pods' ``spool``: a user's pod may well have a volume of that name."""
TIMEOUT_SECONDS = 5
"""Short: a slow webhook delays every opted-in pod, and a dead one is ignored anyway."""
FIELD_MANAGER = "harnessrl-operator"

_state: dict[str, Any] = {}


@dataclass(frozen=True)
class WebhookSettings:
    addr: str
    port: int
    certfile: str
    keyfile: str
    cafile: str | None = None
    configuration: str | None = None
    url: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WebhookSettings | None:
        environ = os.environ if environ is None else environ
        listen = environ.get("HARNESSRL_WEBHOOK_LISTEN", "")
        if not listen:
            return None
        addr, _, port = listen.rpartition(":")
        cert, key = environ.get("HARNESSRL_WEBHOOK_CERT", ""), environ.get("HARNESSRL_WEBHOOK_KEY", "")
        if not port.isdigit() or not cert or not key:
            raise ValueError(
                f"HARNESSRL_WEBHOOK_LISTEN={listen!r}: the webhook needs ADDR:PORT and both "
                "HARNESSRL_WEBHOOK_CERT and HARNESSRL_WEBHOOK_KEY (PEM files) — set them, or unset "
                "HARNESSRL_WEBHOOK_LISTEN to run without the webhook"
            )
        return cls(
            addr=addr or "0.0.0.0",
            port=int(port),
            certfile=cert,
            keyfile=key,
            cafile=environ.get("HARNESSRL_WEBHOOK_CA") or None,
            configuration=environ.get("HARNESSRL_WEBHOOK_CONFIGURATION") or None,
            url=environ.get("HARNESSRL_WEBHOOK_URL") or None,
        )


# --- the mutation, as a pure function -----------------------------------------------------------------------


def skipped(reason: str) -> dict[str, Any]:
    return {"metadata": {"annotations": {INJECTION_ANNOTATION: f"skipped: {reason}"}}}


def left_alone(pod: Mapping[str, Any]) -> bool:
    """Pods the webhook never changes: already injected, or created by the operator."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    return (
        INJECTED_ANNOTATION in (meta.get("annotations") or {})
        or COMPONENT_LABEL in (meta.get("labels") or {})
        or any(c.get("name") == PROXY_CONTAINER for c in spec.get("initContainers") or [])
    )


def sidecar(run: TrainingRun, config: OperatorConfig, policy_version: int) -> dict[str, Any]:
    """The operator's proxy container, attributed to the pod itself and spooling to :data:`SPOOL_VOLUME`.

    It runs as the harness pods' sandbox user whatever the pod says: the user's pod security context was
    written for its own images, and the proxy's restricted context needs a non-root uid."""
    launch = Launch(
        run=run.metadata.name,
        rollout_id="",
        attempt=0,
        task_id="",
        task={},
        policy_version=policy_version,
        timeout_s=0.0,
    )
    container = proxy_container(run, config, launch)
    own_name = env_from_field("HARNESSRL_ROLLOUT_ID", "metadata.name")
    container["env"] = [own_name if var["name"] == own_name["name"] else var for var in container["env"]]
    container["volumeMounts"] = [{**mount, "name": SPOOL_VOLUME} for mount in container["volumeMounts"]]
    return container


_parsed: dict[tuple[str, int], TrainingRun | InvalidSpec] = {}


def _parse(doc: Mapping[str, Any]) -> TrainingRun:
    """Parsed once per generation: runs may carry thousands of inline tasks, and pods come in bursts."""
    meta = doc.get("metadata") or {}
    key = (meta.get("uid") or "", int(meta.get("generation") or 0))
    parsed = _parsed.get(key) if key[0] else None
    if parsed is None:
        try:
            parsed = parse_training_run({k: v for k, v in doc.items() if k != "status"})
        except InvalidSpec as invalid:
            parsed = invalid
        if key[0]:
            if len(_parsed) >= 256:
                _parsed.clear()
            _parsed[key] = parsed
    if isinstance(parsed, InvalidSpec):
        raise parsed
    return parsed


def pod_patch(
    pod: Mapping[str, Any], run_name: str, run_doc: Mapping[str, Any] | None, config: OperatorConfig
) -> dict[str, Any]:
    """The merge patch that injects the proxy into ``pod`` (empty: leave it), or only the skipped
    annotation naming why and the fix. ``run_doc`` is the TrainingRun the pod names, None if there is none."""
    if left_alone(pod):
        return {}
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    namespace = meta.get("namespace") or ""
    if run_doc is None:
        return skipped(
            f"no TrainingRun {run_name!r} in namespace {namespace!r} — create it before its pods, or set the "
            f"pod's {RUN_LABEL} label to a run of this namespace"
        )
    try:
        run = _parse(run_doc)
    except InvalidSpec as invalid:
        problems = "; ".join(str(problem) for problem in invalid.problems)
        return skipped(f"TrainingRun {run_name!r} is invalid ({problems}) — fix its spec")
    policy_version = int((run_doc.get("status") or {}).get("policyVersion") or 0)
    try:
        proxy = sidecar(run, config, policy_version)
    except ValueError as error:
        return skipped(str(error))
    volumes = list(spec.get("volumes") or [])
    if any(volume.get("name") == SPOOL_VOLUME for volume in volumes):
        return skipped(f"the pod already has a volume named {SPOOL_VOLUME!r} — rename it")
    base = f"http://127.0.0.1:{run.spec.proxy.port}/v1"
    wanted = [env("OPENAI_BASE_URL", base), env("HARNESSRL_REWARD_URL", f"{base}/reward")]
    containers = []
    for container in copy.deepcopy(spec.get("containers") or []):
        own = container.get("env") or []
        names = {var.get("name") for var in own}
        containers.append({**container, "env": merge_env(own, [v for v in wanted if v["name"] not in names])})
    grace = spec.get("terminationGracePeriodSeconds")
    return {
        "metadata": {"annotations": {INJECTED_ANNOTATION: "true"}},
        "spec": {
            "initContainers": [proxy, *copy.deepcopy(spec.get("initContainers") or [])],
            "containers": containers,
            "volumes": [*volumes, {"name": SPOOL_VOLUME, "emptyDir": {}}],
            "terminationGracePeriodSeconds": max(TERMINATION_GRACE_SECONDS, grace or 0),
        },
    }


def render_mutating_webhook_configuration(
    target: str | Mapping[str, Any], ca_bundle: str, name: str = CONFIGURATION_NAME
) -> dict[str, Any]:
    """The MutatingWebhookConfiguration of the injector.

    ``target`` is the webhook server's base URL (``https://127.0.0.1:9443``) or a Service reference
    (``{"namespace", "name", "port"}``); the handler's path is added. ``ca_bundle`` is the CA's PEM, base64
    encoded (the ``caBundle`` field). Only opted-in pods that the operator did not create reach the webhook
    (objectSelector), never in kube-system; its failures and timeouts admit the pod unchanged."""
    path = f"/{WEBHOOK_ID}"
    if isinstance(target, str):
        client: dict[str, Any] = {"url": target.rstrip("/") + path}
    else:
        client = {"service": {**target, "path": path}}
    client["caBundle"] = ca_bundle
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name, "labels": {MANAGED_BY[0]: MANAGED_BY[1]}},
        "webhooks": [
            {
                "name": "proxy-injector.harnessrl.io",
                "admissionReviewVersions": ["v1"],
                "clientConfig": client,
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                        "scope": "Namespaced",
                    }
                ],
                "objectSelector": {
                    "matchExpressions": [
                        {"key": RUN_LABEL, "operator": "Exists"},
                        {"key": COMPONENT_LABEL, "operator": "DoesNotExist"},
                    ]
                },
                "namespaceSelector": {
                    "matchExpressions": [
                        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}
                    ]
                },
                "failurePolicy": "Ignore",
                "matchPolicy": "Equivalent",
                "sideEffects": "None",
                "timeoutSeconds": TIMEOUT_SECONDS,
                "reinvocationPolicy": "Never",
            }
        ],
    }


# --- kopf: the index, the handler, the server ---------------------------------------------------------------


@kopf.index(GROUP, VERSION, "trainingruns")
def proxy_injection_runs(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    meta = body.get("metadata") or {}
    return {
        (namespace, name): {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": meta.get("uid"),
                "generation": meta.get("generation"),
            },
            "spec": dict(body.get("spec") or {}),
            "status": {"policyVersion": (body.get("status") or {}).get("policyVersion")},
        }
    }


@kopf.on.mutate(
    "pods",
    id=WEBHOOK_ID,
    operations=["CREATE"],
    labels={RUN_LABEL: kopf.PRESENT, COMPONENT_LABEL: kopf.ABSENT},
    ignore_failures=True,
    side_effects=False,
)
def inject_proxy(
    body: kopf.Body,
    patch: kopf.Patch,
    namespace: str,
    labels: Mapping[str, str],
    proxy_injection_runs: kopf.Index,
    **_: Any,
) -> None:
    """Any error becomes a skipped annotation: a raising kopf handler would refuse the pod."""
    run_name = labels[RUN_LABEL]
    run_doc = next(iter(proxy_injection_runs.get((namespace, run_name), [])), None)
    try:
        changes = pod_patch(body, run_name, run_doc, _state.get("config") or OperatorConfig.from_env())
    except Exception as exc:  # fail open: a raising handler refuses the pod
        log.exception("injecting the proxy into a pod of run %s/%s failed", namespace, run_name)
        changes = skipped(f"internal error ({exc.__class__.__name__}: {exc}) — report it to harnessrl")
    if changes:
        note = ((changes.get("metadata") or {}).get("annotations") or {}).get(INJECTION_ANNOTATION)
        if note:
            log.warning("not injecting the proxy into a pod of run %s/%s: %s", namespace, run_name, note)
        patch.update(changes)


async def _not_served(_: Any) -> AsyncIterator[Any]:
    """No webhook server: kopf refuses to start when admission handlers exist but no server is set."""
    await asyncio.Event().wait()
    yield {}


class InjectorServer(kopf.WebhookServer):
    """kopf's HTTPS server, which also applies :func:`render_mutating_webhook_configuration` when asked to.

    kopf's own managed configuration (``settings.admission.managed``) cannot set a namespaceSelector or a
    timeout below 30 s, and removes the webhook when the operator stops."""

    def __init__(self, webhook: WebhookSettings) -> None:
        super().__init__(
            addr=webhook.addr,
            port=webhook.port,
            certfile=webhook.certfile,
            pkeyfile=webhook.keyfile,
            cafile=webhook.cafile,
        )
        self.webhook = webhook

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async for client_config in super().__call__(fn):
            if self.webhook.configuration:
                target = self.webhook.url or client_config["url"]
                body = render_mutating_webhook_configuration(
                    target, client_config["caBundle"], self.webhook.configuration
                )
                try:
                    await asyncio.to_thread(apply_configuration, body)
                except Exception:  # keep serving: an installed one may exist
                    log.exception("cannot apply MutatingWebhookConfiguration %s", self.webhook.configuration)
            yield client_config


def apply_configuration(body: dict[str, Any]) -> None:
    from kubernetes import client, config, dynamic

    try:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        api = client.ApiClient(configuration)
    except config.ConfigException:
        api = config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))
    with api:
        resource = dynamic.DynamicClient(api).resources.get(api_version=body["apiVersion"], kind=body["kind"])
        resource.server_side_apply(body=body, field_manager=FIELD_MANAGER, force_conflicts=True)
    log.info("applied MutatingWebhookConfiguration %s", body["metadata"]["name"])


@kopf.on.startup()
def configure_webhook(settings: kopf.OperatorSettings, **_: Any) -> None:
    _state["config"] = OperatorConfig.from_env()
    webhook = WebhookSettings.from_env()
    settings.admission.managed = None
    settings.admission.server = _not_served if webhook is None else InjectorServer(webhook)
    if webhook is not None:
        log.info("serving the proxy-injection webhook on %s:%d", webhook.addr, webhook.port)
