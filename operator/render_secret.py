"""The run's own Secret, and how the proxy and the learner get the trace store's URL.

One Secret per run, ``<run>-config``, holds what the run's pods read that the cluster does not already hold:

- ``trainingrun.json``: the TrainingRun, which ``harnessrl learn --spec`` reads from a file, as in
  ``harnessrl run``. A mounted Secret key holds up to 1 MiB, as much as the TrainingRun object itself (inline
  tasks included); an env var (128 KiB per string on Linux) or a pod annotation (256 KiB for all of them)
  would refuse large runs. A Secret, not a ConfigMap, because ``spec.store.postgres.url`` may hold a password
  and because the operator already deletes its runs' Secrets with their other children.
- ``store-url``: only for runs that keep the SQLite default and so use the operator's own store
  (``OperatorConfig.store_url``, usually with a password): pods read it through a ``secretKeyRef`` and never
  carry it in plain text.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from harnessrl.operator import naming
from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.render_common import env, env_from_secret
from harnessrl.spec.models import API_VERSION, KIND, TrainingRun

CONFIG_COMPONENT = "config"
SPEC_KEY = "trainingrun.json"
STORE_URL_KEY = "store-url"
STORE_URL_ENV = "HARNESSRL_STORE_URL"
REWARD_COMPONENT = "reward"
REWARD_TOKEN_KEY = "token"
REWARD_TOKEN_ENV = "HARNESSRL_REWARD_TOKEN"


def run_secret_name(run: str) -> str:
    return f"{run}-config"


def reward_secret_name(run: str) -> str:
    return f"{run}-reward"


def reward_token_env(run: TrainingRun) -> dict[str, Any]:
    """``HARNESSRL_REWARD_TOKEN`` for the proxy and the verifier (never the harness), by reference."""
    return env_from_secret(REWARD_TOKEN_ENV, reward_secret_name(run.metadata.name), REWARD_TOKEN_KEY)


def render_reward_secret(run: TrainingRun, namespace: str, uid: str, token: str) -> dict[str, Any]:
    """The ``<run>-reward`` Secret of a run with a verifier: the token only the verifier may show the proxy.
    The token is random (``token``), so the Secret is created once and never re-applied, unlike the other
    children; it goes with the run by its owner reference."""
    name = run.metadata.name
    return _secret(reward_secret_name(name), namespace, name, uid, REWARD_COMPONENT, {REWARD_TOKEN_KEY: token})


def _secret(name: str, namespace: str, run: str, uid: str, component: str, data: dict[str, str]) -> dict[str, Any]:
    """A Secret owned by the run. ``data`` rather than ``stringData``: the API server stores only ``data``,
    so re-applying the same object is a no-op under server-side apply."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": naming.child_metadata(name, namespace, run, uid, component),
        "type": "Opaque",
        "data": {key: base64.b64encode(value.encode()).decode() for key, value in data.items()},
    }


def run_document(run: TrainingRun, namespace: str) -> dict[str, Any]:
    """The TrainingRun as the learner reads it: the spec as it was given (the API server has already filled
    in the CRD's defaults), and only the metadata that is not the API server's (a uid or resourceVersion
    would change the Secret for nothing)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": run.metadata.name, "namespace": namespace},
        "spec": run.spec.model_dump(mode="json", by_alias=True, exclude_unset=True),
    }


def uses_operator_store(run: TrainingRun) -> bool:
    """A run that names no PostgreSQL store: its SQLite default only works in ``harnessrl run``, so on a
    cluster it uses the operator's store."""
    return run.spec.store.postgres is None


def store_url_env(run: TrainingRun, config: OperatorConfig) -> dict[str, Any]:
    """``HARNESSRL_STORE_URL`` for a container, by reference wherever the URL may hold a password.

    ``harnessrl proxy``, ``harnessrl learn`` and ``harnessrl db upgrade`` all read this variable, so the URL
    never appears on a command line (visible to every process of the pod in ``/proc``).
    """
    postgres = run.spec.store.postgres
    if postgres is not None and postgres.secret_ref is not None:
        return env_from_secret(STORE_URL_ENV, postgres.secret_ref.name, postgres.secret_ref.key)
    if postgres is not None and postgres.url is not None:
        return env(STORE_URL_ENV, postgres.url)
    operator_store_url(config)
    return env_from_secret(STORE_URL_ENV, run_secret_name(run.metadata.name), STORE_URL_KEY)


def operator_store_url(config: OperatorConfig) -> str:
    if not config.store_url:
        raise ValueError(
            "spec.store: the SQLite store only works with `harnessrl run` — set spec.store.postgres.secretRef, "
            "or install the chart's PostgreSQL (the operator's default store)"
        )
    return config.store_url


def render_run_secret(run: TrainingRun, namespace: str, uid: str, config: OperatorConfig) -> dict[str, Any]:
    """The ``<run>-config`` Secret (see the module docstring)."""
    data = {SPEC_KEY: json.dumps(run_document(run, namespace), sort_keys=True, separators=(",", ":"))}
    if uses_operator_store(run):
        data[STORE_URL_KEY] = operator_store_url(config)
    name = run.metadata.name
    return _secret(run_secret_name(name), namespace, name, uid, CONFIG_COMPONENT, data)
