"""Kubernetes shapes the spec reuses: names, quantities, env vars, resources, volumes, secret references.

They follow the core API's spelling so that what a user knows from a Pod spec carries over, and so the
operator can copy them into rendered objects unchanged.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from harnessrl.spec.base import SpecModel
from harnessrl.spec.rules import Rule, exactly_one

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
ABSOLUTE_PATH = r"^/"
# Child objects are named "<run>-<suffix>" and Service names are DNS-1035 labels of at most 63 characters: the
# longest suffix, the vLLM replicas' headless Service "-rollout-pods" (operator/naming.py; a test checks every
# derived name), leaves 50. The CRD refuses a longer name with the same limit (crd.py).
RUN_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
RUN_NAME_MAX = 63 - len("-rollout-pods")
# Strings that CEL rules read carry a maxLength, so the API server's cost estimate for the rule stays small.
PATH_MAX = 4096
QUANTITY = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)

# What to tell a user whose string does not match one of the patterns above (problems.py looks them up).
PATTERN_HINTS: dict[str, str] = {
    DNS_SUBDOMAIN: "use a Kubernetes object name: lowercase letters, digits, '-' and '.', "
    "starting and ending with a letter or digit",
    ENV_NAME: "use letters, digits, '_', '-' and '.', not starting with a digit",
    ABSOLUTE_PATH: "use an absolute path, starting with '/'",
    RUN_NAME: "use lowercase letters, digits and '-', starting with a letter, e.g. swe-qwen-1",
}


def user_error(kind: str, message: str) -> PydanticCustomError:
    """A validation error whose message is already the one-line text a user should read."""
    # The message goes in as context, not as the template: pydantic templates do not understand {x!r}.
    return PydanticCustomError(kind, "{message}", {"message": message})


ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
"""The name of a Kubernetes object in the run's namespace (ConfigMap, Secret, PersistentVolumeClaim)."""


def _check_quantity(value: Any) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(QUANTITY, value):
        return value
    if isinstance(value, float):
        raise user_error(
            "quantity_type",
            f'{value} is not a Kubernetes quantity — quote it as a string, e.g. "{value}" or "500m"',
        )
    raise user_error(
        "quantity_type",
        f'{value!r} is not a Kubernetes quantity — use an integer or a string such as "500m", "2" or "4Gi"',
    )


Quantity = Annotated[
    int | str,
    PlainValidator(_check_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
"""A Kubernetes resource quantity: an integer or a string like ``500m`` or ``4Gi``."""


def _check_cidr(value: str) -> str:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise user_error(
            "cidr", f"{value!r} is not a CIDR block — write it like 10.0.0.0/8 or 2001:db8::/32"
        ) from None
    return value


Cidr = Annotated[str, AfterValidator(_check_cidr), Field(json_schema_extra={"format": "cidr"})]


def _check_http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise user_error(
            "http_url", f"{value!r} is not an http(s) URL — write it like http://vllm.example:8000/v1"
        )
    return value


HttpUrl = Annotated[str, AfterValidator(_check_http_url), Field(json_schema_extra={"format": "uri"})]
"""An http or https URL, kept as the user wrote it (no trailing slash added)."""


class KeyRef(SpecModel):
    """One key of a Secret or ConfigMap in the run's namespace."""

    name: ObjectName
    """The object's name."""
    key: str = Field(min_length=1)
    """The key inside the object."""


class FieldRef(SpecModel):
    """A field of the pod itself, as in the Kubernetes downward API."""

    field_path: str = Field(min_length=1)
    """For example ``metadata.name`` or ``status.podIP``."""


class EnvVarSource(SpecModel):
    """Where an environment variable's value comes from; exactly one source."""

    secret_key_ref: KeyRef | None = None
    """A key of a Secret."""
    config_map_key_ref: KeyRef | None = None
    """A key of a ConfigMap."""
    field_ref: FieldRef | None = None
    """A field of the pod."""

    rules = (
        exactly_one(
            "valueFrom",
            {
                "secretKeyRef": "secret_key_ref",
                "configMapKeyRef": "config_map_key_ref",
                "fieldRef": "field_ref",
            },
            fix="set one of them, and only one",
        ),
    )


class EnvVar(SpecModel):
    """An environment variable, spelled as in a Kubernetes container."""

    name: str = Field(min_length=1, pattern=ENV_NAME)
    """The variable's name."""
    value: str | None = None
    """A literal value; numbers must be quoted, as in any Kubernetes env var."""
    value_from: EnvVarSource | None = None
    """Take the value from a Secret, a ConfigMap or the pod."""

    rules = (
        Rule(
            cel="!(has(self.value) && has(self.valueFrom))",
            holds=lambda e: not (e.value is not None and e.value_from is not None),
            problem="an env var takes either value or valueFrom, not both",
            fix="remove one of them",
        ),
    )


class Resources(SpecModel):
    """CPU, memory and accelerator requests and limits, as in a Kubernetes container."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """What the scheduler reserves, e.g. ``{cpu: "4", memory: 16Gi}``."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """The most the container may use, e.g. ``{memory: 32Gi}``."""


class Volume(SpecModel):
    """A PersistentVolumeClaim mounted into the pods that need it."""

    pvc: ObjectName
    """The claim's name, in the run's namespace."""
    mount_path: str = Field(max_length=PATH_MAX, pattern=ABSOLUTE_PATH)
    """Where the claim is mounted; paths that use this volume must lie inside it."""
    sub_path: str | None = None
    """Mount only this folder of the claim."""
    read_only: bool = True
    """Mount read-only (models, task files); checkpoint volumes must set this to false."""


class Toleration(SpecModel):
    """A taint the pods tolerate (GPU pools are usually tainted), spelled as in a Kubernetes pod."""

    key: str | None = Field(default=None, min_length=1, max_length=317)
    """The taint's key; unset with operator Exists tolerates every taint."""
    operator: Literal["Exists", "Equal"] | None = None
    """Exists or Equal; unset means Equal, as in Kubernetes."""
    value: str | None = Field(default=None, max_length=63)
    """The taint's value, for operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """The effect tolerated; unset tolerates every effect."""
    toleration_seconds: int | None = None
    """With effect NoExecute: how long a pod stays bound after the taint appears; unset: for ever."""

    rules = (
        Rule(
            field="value",
            cel="!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
            holds=lambda t: t.operator != "Exists" or not t.value,
            problem="a toleration with operator Exists takes no value",
            fix="remove value, or set operator to Equal",
        ),
        Rule(
            field="operator",
            cel="has(self.key) || (has(self.operator) && self.operator == 'Exists')",
            holds=lambda t: t.key is not None or t.operator == "Exists",
            problem="a toleration without a key must have operator Exists (it then tolerates every taint)",
            fix="set key, or set operator to Exists",
        ),
        Rule(
            field="tolerationSeconds",
            cel="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            holds=lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
            problem="tolerationSeconds only applies to effect NoExecute",
            fix="set effect to NoExecute, or remove tolerationSeconds",
        ),
    )


class LocalObjectReference(SpecModel):
    """An object in the run's namespace, by name (as a pod's imagePullSecrets lists them)."""

    name: ObjectName
    """The object's name."""


class Scheduling(SpecModel):
    """Where one component's pods may run and with which identity; each field is copied into the pod spec as
    Kubernetes spells it, and an unset field leaves the namespace's and cluster's defaults alone. The same
    object, with the same meaning, sits on the vLLM servers (``rollout.scheduling``), the learner
    (``learner.scheduling``) and the harness pods (``harness.scheduling``, which also hold the verifier)."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the pods need, e.g. ``{nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}``."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Taints the pods tolerate, e.g. ``[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]``."""
    affinity: Annotated[
        dict[str, Any] | None,
        WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
    ] = None
    """A Kubernetes pod affinity (nodeAffinity, podAffinity, podAntiAffinity), copied as written; the API
    server checks its shape when the pods are created, and the run's status names this field if it refuses
    it."""
    priority_class_name: ObjectName | None = None
    """A PriorityClass, so the scheduler may preempt lower-priority pods for these (or not)."""
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    """Secrets with registry credentials for the component's images, e.g. ``[{name: regcred}]``."""
    service_account_name: ObjectName | None = None
    """The ServiceAccount the pods run as (its imagePullSecrets apply too); unset: the namespace's default.
    Its API token is never mounted: no harnessrl pod calls the Kubernetes API."""
