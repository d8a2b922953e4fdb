"""Proxy settings, from command-line flags and from environment variables.

A sidecar proxy is configured entirely by its pod's environment (the operator sets it); a gateway or a local
run mostly by flags. Flags win over the environment. Every setting has one environment variable:

=================================  =========================================================================
HARNESSRL_UPSTREAMS                vLLM base URLs, comma-separated (``http://vllm-0:8000,http://vllm-1:8000``);
                                   ``dns://NAME:PORT``: every address NAME resolves to, re-resolved every 10 s
HARNESSRL_STORE_URL                trace store URL (``postgresql+psycopg://...`` or ``sqlite:///path.db``)
HARNESSRL_STORE_UPGRADE            ``true``: run the store's migrations at start (local runs; default false)
HARNESSRL_RUN                      run name stored on every call (default ``default``)
HARNESSRL_ROLLOUT_ID               sidecar attribution: the rollout this pod serves. Unset: gateway mode,
                                   where calls use ``/rollouts/{rollout}/attempts/{attempt}/v1/...``
HARNESSRL_ATTEMPT                  sidecar attribution: the attempt number (default 0)
HARNESSRL_PROXY_HOST               listen address (default 127.0.0.1; a gateway uses 0.0.0.0)
HARNESSRL_PROXY_PORT               listen port (default 8100)
HARNESSRL_METRICS_PORT             a second listener, on every address, that serves ``GET /metrics`` only: a
                                   sidecar's proxy listens on loopback, where Prometheus cannot reach it
                                   (default: none; the main listener always serves /metrics too)
HARNESSRL_PROXY_MODE               ``train`` (default): add token ids + log-probs upstream and enforce the
                                   run's model and sampling; ``observe``: forward requests unchanged and
                                   record what comes back
HARNESSRL_POLICY_VERSION           policy version at start (default 0); later set by ``/admin/policy-version``
HARNESSRL_REPLICA_VERSIONS         ``true``: record each call under the weight label of the vLLM replica that
                                   serves it (``GET /weight_info``; ``upstreams.py``), the proxy's own version
                                   only where a replica cannot tell (default false)
HARNESSRL_REWARD_TOKEN             when set, ``/v1/reward`` needs ``Authorization: Bearer <token>``: a run with
                                   a verifier gives the token to the verifier only, never to the harness
HARNESSRL_ADMIN                    ``false``: no ``/admin/*`` routes (a sidecar: the harness shares its network
                                   and must not pause it or set its version); default true
HARNESSRL_MODEL_NAME               model name sent upstream whatever the harness asks for (default: as sent)
HARNESSRL_SAMPLING                 JSON object of sampling fields forced on every call in train mode,
                                   e.g. ``{"temperature": 1.0, "top_p": 1.0}``
HARNESSRL_EVALUATION_SAMPLING      JSON object of sampling fields for evaluation rollouts (``spec.evaluation``'s
                                   temperature and topP), over HARNESSRL_SAMPLING; a rollout is an evaluation
                                   when its id says so (``harnessrl.rollout_ids``). Unset: as training calls
HARNESSRL_TOKEN_CONTINUITY         chat calls that extend the previous call are sent as token ids (see
                                   ``continuity.py``); default: on in train mode
HARNESSRL_UPSTREAM_API_KEY         bearer token for the upstreams (vLLM ``--api-key``); default none
HARNESSRL_UPSTREAM_RETRIES         retries on connection errors, 429 and 5xx (default 3)
HARNESSRL_UPSTREAM_BACKOFF_S       first retry delay, doubled each retry (default 0.1)
HARNESSRL_UPSTREAM_BACKOFF_MAX_S   largest retry delay, also the cap on an upstream's Retry-After (default 5)
HARNESSRL_UPSTREAM_CONNECT_TIMEOUT_S  connect timeout per attempt (default 10)
HARNESSRL_UPSTREAM_READ_TIMEOUT_S  longest silence while reading an upstream answer (default 900)
HARNESSRL_UPSTREAM_CONNECTIONS     connection-pool size to all upstreams together (default 1024)
HARNESSRL_MAX_BODY_BYTES           largest request body accepted, larger -> 413 (default 64 MiB)
HARNESSRL_PAUSE_MODE               what ``/admin/pause`` does to new calls by default: ``reject`` (503 with
                                   Retry-After) or ``wait`` (held until resume); default: the spec's
                                   ``proxy.pause.mode`` default (wait)
HARNESSRL_PAUSE_RETRY_AFTER_S      Retry-After sent while paused in reject mode (default: the spec's
                                   ``proxy.pause.retryAfterSeconds`` default, 2)
HARNESSRL_DRAIN_TIMEOUT_S          how long ``/admin/pause`` waits for in-flight calls (default 30)
HARNESSRL_QUEUE_SIZE               captured items held in memory before new calls wait for the writer
                                   (default: the spec's ``proxy.queueSize`` default, 256)
HARNESSRL_QUEUE_MAX_BYTES          the same bound in estimated bytes (default: ``proxy.queueMaxBytes``'s,
                                   256 MiB)
HARNESSRL_WRITE_BATCH              most calls per store write (default 256)
HARNESSRL_WRITE_LINGER_S           how long the writer collects calls before a write, unless a reward waits
                                   or the queue is half full (default 0.1)
HARNESSRL_SPOOL_PATH               append-only file for items the store could not take (default
                                   ``$TMPDIR/harnessrl-proxy-<port>.spool``; a sidecar mounts an emptyDir)
HARNESSRL_SPOOL_MAX_BYTES          largest spool file; when full, items wait in memory and new calls wait
                                   (default: ``proxy.spoolMaxBytes``'s, 1 GiB)
HARNESSRL_SPOOL_RETRY_S            first delay before replaying the spool, doubled up to 5 s (default 0.2)
HARNESSRL_STORE_RELEASE_IDLE_S     after this long with nothing to write, the proxy closes its database
                                   connection (the next write opens one), so idle harness pods hold no
                                   server slots (default 5)
HARNESSRL_REWARD_TIMEOUT_S         how long ``/v1/reward`` waits for the reward to be stored before it
                                   answers 503 (the store is away; the reward stays in the spool); default 30
HARNESSRL_LIVE_ROLLOUTS            rollout attempts whose sequence counter is kept (default 100000)
HARNESSRL_LAST_CALL_TOKENS         token budget of the last-call-per-rollout map used by token continuity
                                   (default 8000000: 32 MB of int32 arrays plus the calls' messages)
HARNESSRL_SHUTDOWN_TIMEOUT_S       on SIGTERM, how long in-flight calls may finish (default 30)
HARNESSRL_STREAM_KEEPALIVE_S       a streamed call the proxy answers whole (Messages, Responses, chat with a
                                   server parser) that has no answer after this long gets its 200 and the
                                   protocol's keep-alive events at this interval until it has (default 5)
HARNESSRL_STREAM_DERENDER_TOKENS   a streamed call with tools relayed while generated (``served_stream.py``)
                                   asks the server's streaming derender for its text at its first token, then
                                   once at least this many new tokens came, then at its end: each call costs
                                   the server a whole chat request, so fewer, larger calls (default 16; 1: one
                                   call per read of the token stream)
=================================  =========================================================================
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from harnessrl.replica_targets import DNS_SCHEME, parse_dns_target
from harnessrl.rollout_ids import is_evaluation
from harnessrl.spec.models import Pause, Proxy

MIB = 1024 * 1024


def _spec_default(model: type, field: str) -> Any:
    """A default shared with the TrainingRun spec, so a proxy started by hand behaves like one the spec made."""
    return model.model_fields[field].default


# Flags whose name is not simply ``--field-name`` (see commands.py).
FLAG_NAMES = {
    "upstreams": "--upstream",
    "store_url": "--store",
    "proxy_port": "--port",
    "proxy_host": "--host",
    "proxy_mode": "--mode",
}


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names the flag/variable and the fix."""


# Sampling fields that reshape the distribution a token is drawn from. The learner trains
# softmax(logits / spec.rollout.temperature); a harness's own temperature, top_p, top_k, min_p, penalties or
# logit_bias (or a default vLLM takes from the model's generation_config for a field the request leaves out,
# e.g. top_k 20) would draw the tokens from another distribution, which the importance weights can only partly
# correct. In train mode every call is sent with these neutral values, whatever the harness asked for; the
# run's sampling (--sampling / HARNESSRL_SAMPLING: spec.rollout.temperature and topP) wins over them, and a run
# may force any other of them for every call the same way.
NEUTRAL_SAMPLING: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
}


class ProxyConfig(BaseSettings):
    """All proxy settings; field ``x`` is read from ``HARNESSRL_X`` (see the module docstring)."""

    model_config = SettingsConfigDict(env_prefix="HARNESSRL_", extra="ignore", frozen=True)

    upstreams: Annotated[list[str], NoDecode] = Field(min_length=1)
    store_url: str
    store_upgrade: bool = False
    run: str = "default"
    rollout_id: str | None = None
    attempt: int = Field(default=0, ge=0)
    proxy_host: str = "127.0.0.1"
    proxy_port: int = Field(default=8100, ge=0, le=65535)
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    proxy_mode: Literal["train", "observe"] = "train"
    policy_version: int = Field(default=0, ge=0)
    replica_versions: bool = False
    admin: bool = True
    reward_token: str | None = Field(default=None, min_length=16, repr=False)
    model_name: str | None = None
    sampling: Annotated[dict[str, Any], NoDecode] = Field(default_factory=dict)
    evaluation_sampling: Annotated[dict[str, Any], NoDecode] = Field(default_factory=dict)
    token_continuity: bool | None = None
    upstream_api_key: str | None = None
    upstream_retries: int = Field(default=3, ge=0)
    upstream_backoff_s: float = Field(default=0.1, ge=0)
    upstream_backoff_max_s: float = Field(default=5.0, ge=0)
    upstream_connect_timeout_s: float = Field(default=10.0, gt=0)
    upstream_read_timeout_s: float = Field(default=900.0, gt=0)
    upstream_connections: int = Field(default=1024, ge=1)
    max_body_bytes: int = Field(default=64 * MIB, ge=1024)
    pause_mode: Literal["reject", "wait"] = _spec_default(Pause, "mode")
    pause_retry_after_s: int = Field(default=_spec_default(Pause, "retry_after_seconds"), ge=0)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    queue_size: int = Field(default=_spec_default(Proxy, "queue_size"), ge=1)
    queue_max_bytes: int = Field(default=_spec_default(Proxy, "queue_max_bytes"), ge=1)
    write_batch: int = Field(default=256, ge=1)
    write_linger_s: float = Field(default=0.1, ge=0)
    spool_path: Path | None = None
    spool_max_bytes: int = Field(default=_spec_default(Proxy, "spool_max_bytes"), ge=1)
    spool_retry_s: float = Field(default=0.2, gt=0)
    store_release_idle_s: float = Field(default=5.0, ge=0)
    reward_timeout_s: float = Field(default=30.0, ge=0)
    live_rollouts: int = Field(default=100_000, ge=1)
    last_call_tokens: int = Field(default=8_000_000, ge=0)
    shutdown_timeout_s: float = Field(default=30.0, ge=0)
    stream_keepalive_s: float = Field(default=5.0, gt=0)
    stream_derender_tokens: int = Field(default=16, ge=1)

    @field_validator("upstreams", mode="before")
    @classmethod
    def _split_upstreams(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part for part in value.split(",")]
        if isinstance(value, (list, tuple)):
            urls = [str(v).strip().rstrip("/") for v in value if str(v).strip()]
            for url in urls:
                if not url.startswith(("http://", "https://", DNS_SCHEME)):
                    raise ValueError(
                        f"upstream {url!r} is not an http(s) URL, e.g. http://127.0.0.1:8000, or dns://NAME:PORT "
                        "for every address of a name (a headless Service)"
                    )
                try:
                    parse_dns_target(url)
                except ValueError as exc:
                    raise ValueError(f"upstream {exc}") from None
                if url.endswith("/v1"):
                    raise ValueError(f"upstream {url!r}: give the server root, without /v1")
            return urls
        return value

    @field_validator("sampling", "evaluation_sampling", mode="before")
    @classmethod
    def _parse_sampling(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON ({exc.msg}); use e.g. '{{\"temperature\": 1.0}}'") from None
        if not isinstance(value, dict):  # pydantic turns ValueError (not TypeError) into a validation error
            raise ValueError('must be a JSON object of sampling fields, e.g. {"temperature": 1.0}')  # noqa: TRY004
        return value

    @property
    def train(self) -> bool:
        return self.proxy_mode == "train"

    @property
    def forced_sampling(self) -> dict[str, Any]:
        """What train mode sets on every call: the neutral values above, then the run's ``sampling``."""
        return {**NEUTRAL_SAMPLING, **self.sampling}

    def sampling_for(self, rollout_id: str | None) -> dict[str, Any]:
        """What train mode sets on a call of ``rollout_id``: an evaluation rollout's calls are sampled with
        the evaluation's settings (greedy, say), every other call with the run's."""
        if self.evaluation_sampling and is_evaluation(rollout_id):
            return {**self.forced_sampling, **self.evaluation_sampling}
        return self.forced_sampling

    def sampling_sent(self, rollout_id: str | None, body: Mapping[str, Any]) -> dict[str, Any]:
        """The sampling a call went upstream with, stored with it (``llm_calls.sampling``): in train mode what
        :meth:`sampling_for` forced, which replaces every field of ``NEUTRAL_SAMPLING`` the harness set; in
        observe mode the harness's own values of those fields (one it left out took the server's default)."""
        if self.train:
            return dict(self.sampling_for(rollout_id))
        return {name: body[name] for name in NEUTRAL_SAMPLING if name in body}

    @property
    def continuity_enabled(self) -> bool:
        return self.train if self.token_continuity is None else self.token_continuity

    @property
    def sidecar(self) -> bool:
        """Sidecar mode: attribution from the environment; gateway mode otherwise."""
        return self.rollout_id is not None

    @property
    def resolved_spool_path(self) -> Path:
        if self.spool_path is not None:
            return self.spool_path
        return Path(tempfile.gettempdir()) / f"harnessrl-proxy-{self.proxy_port}.spool"


def load_config(**overrides: Any) -> ProxyConfig:
    """Settings from the environment with ``overrides`` (flags) on top; ``None`` overrides are ignored.

    Raises ``ConfigError`` with one line per bad setting, naming its flag and environment variable.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return ProxyConfig(**given)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else "?"
            flag = FLAG_NAMES.get(field, "--" + field.replace("_", "-"))
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "missing":
                msg = "is required"
            lines.append(f"{field} ({flag} or HARNESSRL_{field.upper()}): {msg}")
        raise ConfigError("; ".join(lines)) from None
