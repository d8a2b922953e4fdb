"""Pushing a committed policy version to the rollout side: every vLLM replica loads it, the proxies learn it.

Order (DESIGN.md §4): pause the proxies (new calls wait or get 503 + Retry-After while in-flight calls drain),
load the checkpoint on every replica (in-place ``reload_weights``, or a LoRA adapter reloaded in place), check
that each replica answers a one-token request, set the new version on the proxies, resume. A replica that
fails is retried with exponential backoff; the result says which replicas failed and why. The version is
only announced (and the caller only marks it synced in the store) when *every* replica serves it; the
proxies are resumed whatever happens, so a failed sync never leaves harnesses hanging.

Two small interfaces keep the mechanism replaceable: :class:`RolloutGate` (pause, announce version, resume:
today the proxies' admin API, later one shared place such as the store or vLLM's own pause/version endpoints,
which hundreds of sidecars can watch) and :class:`Replica` (load, probe).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx

log = logging.getLogger(__name__)

PauseMode = Literal["wait", "reject"]


class SyncError(RuntimeError):
    """One replica or proxy refused an operation; the message names it and the HTTP answer."""


def check_inplace_reload(model_dir: Path) -> None:
    """Refuse a full-weight (``reload``) sync for a model whose LM head is tied to its input embeddings.

    vLLM 0.32's in-place ``reload_weights`` replaces the embedding parameter, but a tied LM head keeps the
    tensor it was built with: every replica would go on sampling from the initial head while the learner
    trains the new one, silently off-policy (measured with the tiny model tied: the Pearson correlation of
    served and learner log-probs fell to 0.5 within 10 steps). Failing before the first step says so.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "tie_word_embeddings", False):
        raise SyncError(
            f"{model_dir}: the model ties its LM head to its input embeddings (tie_word_embeddings: true), and "
            "vLLM's in-place weight reload would leave every replica sampling from the initial head. Set "
            "spec.weightSync.method to lora (with spec.learner.lora), or start from a checkpoint with untied "
            "embeddings (lm_head.weight saved as a copy of the embedding, tie_word_embeddings: false)"
        )


# -- the rollout side's gate -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateReport:
    """What pausing found: per proxy, calls still in flight when the drain wait ended (None: unreachable)."""

    in_flight: dict[str, int | None]
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def drained(self) -> bool:
        return not self.errors and all(v == 0 for v in self.in_flight.values())


class RolloutGate(Protocol):
    """Where the rollout side learns "hold new calls" and "this is the version now being served"."""

    def pause(self) -> GateReport: ...

    def set_version(self, version: int) -> dict[str, str]:
        """Announce ``version``; returns errors by endpoint (empty when all took it)."""
        ...

    def resume(self) -> dict[str, str]: ...


class NoGate:
    """No proxies in front of the replicas (direct use, some tests): nothing to pause or tell."""

    def pause(self) -> GateReport:
        return GateReport({})

    def set_version(self, version: int) -> dict[str, str]:
        return {}

    def resume(self) -> dict[str, str]:
        return {}


class ProxyAdminGate:
    """The proxies' admin API (``/admin/pause``, ``/admin/policy-version``, ``/admin/resume``), one by one."""

    def __init__(self, urls: Sequence[str], mode: PauseMode = "wait", drain_timeout_s: float = 30.0,
                 retries: int = 3, backoff_s: float = 0.5, client: httpx.Client | None = None) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.mode = mode
        self.drain_timeout_s = drain_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.client = client or httpx.Client(timeout=httpx.Timeout(drain_timeout_s + 30.0, connect=5.0))

    def _post(self, url: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        def call() -> dict[str, Any]:
            resp = self.client.post(f"{url}{path}", json=body or {})
            if resp.status_code >= 400:
                raise SyncError(f"{url}{path} answered {resp.status_code}: {resp.text[:300]}")
            return resp.json()

        return retry(call, self.retries, self.backoff_s, what=f"{url}{path}")

    def _each(self, path: str, body: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, str]]:
        answers: dict[str, Any] = {}
        errors: dict[str, str] = {}
        with ThreadPoolExecutor(max_workers=min(32, max(1, len(self.urls)))) as pool:
            futures = {url: pool.submit(self._post, url, path, body) for url in self.urls}
            for url, future in futures.items():
                try:
                    answers[url] = future.result()
                except Exception as exc:  # noqa: BLE001 - reported, not raised: the other proxies still need handling
                    errors[url] = _one_line(exc)
        return answers, errors

    def pause(self) -> GateReport:
        answers, errors = self._each("/admin/pause", {"mode": self.mode, "timeout_s": self.drain_timeout_s})
        in_flight: dict[str, int | None] = {url: None for url in errors}
        for url, answer in answers.items():
            in_flight[url] = int(answer.get("in_flight", 0))
        return GateReport(in_flight, errors)

    def set_version(self, version: int) -> dict[str, str]:
        return self._each("/admin/policy-version", {"version": version})[1]

    def resume(self) -> dict[str, str]:
        return self._each("/admin/resume", None)[1]

    def close(self) -> None:
        self.client.close()


# -- the replicas ----------------------------------------------------------------------------------------------


class Replica(Protocol):
    name: str

    def load(self, checkpoint: Path, version: int) -> None: ...

    def probe(self) -> None: ...


class VllmReplica:
    """One vLLM OpenAI server (started with ``VLLM_SERVER_DEV_MODE=1``; with ``--enable-lora`` for adapters).

    Full weights: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` loads
    the safetensors in place (~60 ms for the tiny model). LoRA: ``POST /v1/load_lora_adapter`` with
    ``load_inplace`` replaces the adapter ``lora_name`` under the same name, so harnesses keep asking for one
    model name across versions.
    """

    def __init__(self, base_url: str, lora_name: str | None = None, timeout_s: float = 600.0,
                 client: httpx.Client | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = self.base_url
        self.lora_name = lora_name
        self.client = client or httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self._model: str | None = None

    def _check(self, resp: httpx.Response, what: str) -> httpx.Response:
        if resp.status_code >= 400:
            raise SyncError(f"{self.base_url} {what} answered {resp.status_code}: {resp.text[:300]}")
        return resp

    def load(self, checkpoint: Path, version: int) -> None:
        if self.lora_name is None:
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}}
            self._check(self.client.post(f"{self.base_url}/collective_rpc", json=body), "reload_weights")
        else:
            body = {"lora_name": self.lora_name, "lora_path": str(checkpoint), "load_inplace": True}
            self._check(self.client.post(f"{self.base_url}/v1/load_lora_adapter", json=body), "load_lora_adapter")
        # The prefix cache holds keys/values computed by the old weights; a prompt sharing a cached prefix
        # (every agent turn does) would otherwise be served partly by the previous policy.
        self._check(self.client.post(f"{self.base_url}/reset_prefix_cache"), "reset_prefix_cache")

    def served_model(self) -> str:
        if self.lora_name is not None:
            return self.lora_name
        if self._model is None:
            data = self._check(self.client.get(f"{self.base_url}/v1/models"), "GET /v1/models").json()
            models = [m["id"] for m in data.get("data", [])]
            if not models:
                raise SyncError(f"{self.base_url} serves no model")
            self._model = models[0]
        return self._model

    def probe(self) -> None:
        """One generated token from token id 0: the replica is up and the loaded weights produce output."""
        body = {"model": self.served_model(), "prompt": [0], "max_tokens": 1, "temperature": 0.0}
        answer = self._check(self.client.post(f"{self.base_url}/v1/completions", json=body), "probe").json()
        if not answer.get("choices"):
            raise SyncError(f"{self.base_url} probe returned no choices: {str(answer)[:200]}")

    def close(self) -> None:
        self.client.close()


# -- the sync --------------------------------------------------------------------------------------------------


@dataclass
class ReplicaResult:
    name: str
    ok: bool
    tries: int
    seconds: float
    error: str | None = None


@dataclass
class SyncReport:
    """``ok``: every replica serves ``version`` (what "synced" in the store means). Proxy errors are reported
    apart: a proxy that missed the version labels its calls with the older one, which is conservative."""

    version: int
    ok: bool
    replicas: list[ReplicaResult]
    pause: GateReport
    gate_errors: dict[str, str]  # "pause URL" / "version URL" / "resume URL" -> error
    seconds: float

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.replicas if not r.ok]

    def as_metrics(self) -> dict[str, Any]:
        return {
            "sync_ok": self.ok,
            "sync_seconds": round(self.seconds, 4),
            "sync_failed": self.failed,
            "sync_gate_errors": len(self.gate_errors),
            "sync_tries": {r.name: r.tries for r in self.replicas},
            "sync_drained": self.pause.drained,
        }


def retry(fn: Callable[[], Any], tries: int, backoff_s: float, what: str,
          sleep: Callable[[float], None] = time.sleep) -> Any:
    """``fn()`` up to ``tries`` times, doubling the wait after each failure; the last error is raised."""
    for attempt in range(1, tries + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == tries:
                raise
            wait = backoff_s * 2 ** (attempt - 1)
            log.warning("%s failed (try %d of %d, next in %.1f s): %s", what, attempt, tries, wait, _one_line(exc))
            sleep(wait)
    raise AssertionError("unreachable")


class WeightSync:
    """Loads a version on every replica behind a paused gate (see the module docstring for the rules)."""

    def __init__(self, replicas: Sequence[Replica], gate: RolloutGate | None = None, tries: int = 3,
                 backoff_s: float = 1.0) -> None:
        if tries < 1:
            raise ValueError("tries must be >= 1")
        self.replicas = list(replicas)
        self.gate = gate or NoGate()
        self.tries = tries
        self.backoff_s = backoff_s

    def _sync_one(self, replica: Replica, checkpoint: Path, version: int) -> ReplicaResult:
        started = time.perf_counter()
        count = 0

        def attempt() -> None:
            nonlocal count
            count += 1
            replica.load(checkpoint, version)
            replica.probe()

        try:
            retry(attempt, self.tries, self.backoff_s, what=f"weight sync of {replica.name}")
        except Exception as exc:  # noqa: BLE001 - any failure of a replica is reported, never fatal to the sync
            return ReplicaResult(replica.name, False, count, time.perf_counter() - started, _one_line(exc))
        return ReplicaResult(replica.name, True, count, time.perf_counter() - started)

    def sync(self, version: int, checkpoint: Path) -> SyncReport:
        started = time.perf_counter()
        gate_errors: dict[str, str] = {}
        pause = GateReport({})
        results: list[ReplicaResult] = []
        try:
            pause = self.gate.pause()
            if pause.errors:
                log.warning("could not pause %s: calls may reach replicas mid-reload", sorted(pause.errors))
            with ThreadPoolExecutor(max_workers=min(32, max(1, len(self.replicas)))) as pool:
                results = list(pool.map(lambda r: self._sync_one(r, checkpoint, version), self.replicas))
            if all(r.ok for r in results):
                gate_errors.update({f"version {k}": v for k, v in self.gate.set_version(version).items()})
        finally:
            gate_errors.update({f"resume {k}": v for k, v in self.gate.resume().items()})
        gate_errors.update({f"pause {k}": v for k, v in pause.errors.items()})
        ok = bool(results) or not self.replicas
        ok = ok and all(r.ok for r in results)
        report = SyncReport(version, ok, results, pause, gate_errors, time.perf_counter() - started)
        if not ok or gate_errors:
            log.error("weight sync of version %d: replicas failed %s, proxies failed %s", version,
                      {r.name: r.error for r in results if not r.ok}, gate_errors)
        return report


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
