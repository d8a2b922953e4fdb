"""Pushing a committed policy version to the rollout side: every vLLM replica loads it, the proxies learn it.

Order: pause every replica (vLLM's own ``POST /pause?mode=keep``: requests in flight freeze and continue after
the resume, new ones queue, so no token is sampled from half-loaded weights, with nothing asked of the
hundreds of sidecar proxies), and the proxies that a gate names (``harnessrl run``'s one proxy: its pause
modes wait/reject); load the checkpoint on every replica (in-place ``reload_weights``, or a LoRA adapter
reloaded in place); label each replica with the version (``/update_weight_version``, which ``GET
/weight_info`` answers, so a proxy pinned to a replica knows what served each call) and tell the gate;
resume; check that each replica answers a one-token request. A replica that fails is retried with
exponential backoff, but no retry starts once the sync's time limit (``spec.weightSync.timeoutSeconds``) has
passed, and no single request waits longer than that limit; the result says which replicas failed and why.
A sync that fails after its retries stops the learner (:class:`SyncFailed`, raised by the learner): training
on while the rollout side serves an older version would pile up ever staler rollouts, which is not the run
the spec asked for. The version is only announced (and the
caller only marks it synced in the store) when *every* replica loaded it; replicas and proxies are resumed
whatever happens, so a failed sync never leaves harnesses hanging.

Replicas are a fixed list of base URLs or a DNS name re-resolved at every sync (``dns://NAME:PORT``, the
rollout's headless Service on a cluster: every Ready vLLM pod, however the Deployment was scaled). Syncing
no replica is not a successful sync: a name that resolves to nothing fails the sync, and so does an empty
list. A learner with no rollout side at all (offline training from a stored trace) has no weight sync: it
commits versions that nothing serves, and the store does not call them synced.

Two small interfaces keep the mechanism replaceable: :class:`RolloutGate` (pause, announce version, resume
for proxies) and :class:`Replica` (pause, load, label, resume, probe).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx

from harnessrl.policy_serving import label_request, load_request
from harnessrl.replica_targets import DNS_SCHEME, base_urls, parse_dns_target

log = logging.getLogger(__name__)

PauseMode = Literal["wait", "reject"]


class SyncError(RuntimeError):
    """One replica or proxy refused an operation; the message names it and the HTTP answer."""


class SyncFailed(SyncError):
    """A version did not reach every replica after its retries: the run cannot go on (the spec's
    ``weightSync.retries`` says a failed sync fails the run). The message names each failed replica and why."""

    def __init__(self, report: SyncReport, tries: int, timeout_s: float | None) -> None:
        failed = "; ".join(f"{r.name}: {r.error}" for r in report.replicas if not r.ok)
        limit = f", {timeout_s:g} s limit" if timeout_s is not None else ""
        super().__init__(
            f"weight sync of version {report.version} failed after {tries} tries{limit} on {failed}. The version is "
            "committed but not served; fix the replicas (are they running and reachable?) and start the learner "
            "again, which syncs it first; spec.weightSync.retries and spec.weightSync.timeoutSeconds set how "
            "long a sync may keep trying"
        )
        self.report = report


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

    def pause(self) -> None: ...

    def load(self, checkpoint: Path, version: int) -> None: ...

    def set_version(self, version: int) -> None: ...

    def served_version(self) -> str | None: ...

    def resume(self) -> None: ...

    def probe(self) -> None: ...


class VllmReplica:
    """One vLLM OpenAI server (started with ``VLLM_SERVER_DEV_MODE=1``; with ``--enable-lora`` for adapters).

    Full weights: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` loads
    the safetensors in place (~60 ms for the tiny model). LoRA: ``POST /v1/load_lora_adapter`` with
    ``load_inplace`` replaces the adapter ``lora_name`` under the same name, so harnesses keep asking for one
    model name across versions. ``timeout_s`` bounds each request (``spec.weightSync.timeoutSeconds``).
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

    def pause(self) -> None:
        """Freeze generation (``keep``: in-flight requests continue after :meth:`resume`, none is aborted)."""
        self._check(self.client.post(f"{self.base_url}/pause", params={"mode": "keep"}), "pause")

    def resume(self) -> None:
        self._check(self.client.post(f"{self.base_url}/resume"), "resume")

    def set_version(self, version: int) -> None:
        """The label ``GET /weight_info`` answers from now on: what a proxy records as the serving version."""
        path, body = label_request(version)
        self._check(self.client.post(f"{self.base_url}{path}", json=body), "update_weight_version")

    def served_version(self) -> str | None:
        return self._check(self.client.get(f"{self.base_url}/weight_info"), "weight_info").json()["weight_version"]

    def load(self, checkpoint: Path, version: int) -> None:
        path, body = load_request(str(checkpoint), self.lora_name)
        what = "reload_weights" if self.lora_name is None else "load_lora_adapter"
        self._check(self.client.post(f"{self.base_url}{path}", json=body), what)
        # The prefix cache holds keys/values computed by the old weights; a prompt sharing a cached prefix
        # (every agent turn does) would otherwise be served partly by the previous policy. Requests frozen by
        # the pause hold cache blocks, so they are sent back to the queue (their keys/values are recomputed
        # with the new weights); vLLM answers success false, with 200, when blocks stay held.
        reset = self.client.post(f"{self.base_url}/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not self._check(reset, "reset_prefix_cache").json().get("success", False):
            raise SyncError(f"{self.base_url} reset_prefix_cache did not free the cache: {reset.text[:200]}")

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


class SyncTimeout(SyncError):
    """The sync's time limit passed before this operation succeeded."""


def retry(fn: Callable[[], Any], tries: int, backoff_s: float, what: str,
          sleep: Callable[[float], None] = time.sleep, deadline: float | None = None) -> Any:
    """``fn()`` up to ``tries`` times, doubling the wait after each failure; the last error is raised.

    ``deadline`` (``time.monotonic()``): no retry starts after it, so retries cannot stretch a sync past its
    limit; the error then says so. The first try always runs (a resume must be sent even late).
    """
    for attempt in range(1, tries + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == tries:
                raise
            wait = backoff_s * 2 ** (attempt - 1)
            if deadline is not None and time.monotonic() + wait >= deadline:
                raise SyncTimeout(f"gave up after {attempt} of {tries} tries: the sync's time limit "
                                  f"(spec.weightSync.timeoutSeconds) passed; last error {_one_line(exc)}") from exc
            log.warning("%s failed (try %d of %d, next in %.1f s): %s", what, attempt, tries, wait, _one_line(exc))
            sleep(wait)
    raise AssertionError("unreachable")


def resolve_replica_urls(target: str, resolve: Callable[..., list] = socket.getaddrinfo) -> list[str]:
    """Base URLs for ``target``: itself for ``http(s)://...``; for ``dns://NAME:PORT`` one per address NAME
    resolves to now (a headless Service answers with its Ready pods), sorted, IPv6 in brackets."""
    try:
        parsed = parse_dns_target(target)
    except ValueError as exc:
        raise SyncError(str(exc)) from None
    if parsed is None:
        return [target.rstrip("/")]
    host, port = parsed
    try:
        answers = resolve(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise SyncError(f"{target}: {host} does not resolve ({exc}) — are the vLLM pods Ready?") from None
    return base_urls((answer[4][0] for answer in answers), port)


def wait_for_replicas(targets: Sequence[str], timeout_s: float, say: Callable[[str], None] = log.warning,
                      resolve: Callable[..., list] = socket.getaddrinfo, poll_s: float = 5.0,
                      clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                      ) -> list[str]:
    """Wait up to ``timeout_s`` until the DNS targets name at least one replica; the URLs found then (``[]``
    when the wait ran out: the first sync then fails and says why).

    A learner starts in seconds and vLLM in minutes (an image pull and a model load on a GPU node), and a LoRA
    run's first sync (the initial adapter) or a sync left unfinished by a crash comes before any step: without
    a replica it would fail after its retries, every rank would exit, and the restarts would use up the Job's
    backoffLimit while vLLM is still starting. Every rank waits, before the process group forms: a rank blocked
    in a collective would time out (DeepSpeed's default is 30 min) while rank 0 waited. Fixed URLs are not
    waited for (they always resolve; a replica that does not answer is the sync's to report)."""
    dynamic = [target for target in targets if target.startswith(DNS_SCHEME)]
    if not dynamic or timeout_s <= 0:
        return []
    started = clock()
    said = False
    while True:
        try:
            urls = [url for target in dynamic for url in resolve_replica_urls(target, resolve)]
        except SyncError as exc:
            urls, why = [], str(exc)
        else:
            why = f"no vLLM replica behind {dynamic} yet"
        waited = clock() - started
        if urls:
            if said:
                say(f"{len(urls)} vLLM replica(s) after {waited:.0f} s: {urls}")
            return urls
        if waited >= timeout_s:
            say(f"no vLLM replica after {waited:.0f} s ({why}); going on, the first sync will say why")
            return []
        if not said:
            say(f"waiting up to {timeout_s:.0f} s for a vLLM replica ({why})")
            said = True
        sleep(min(poll_s, max(0.0, timeout_s - waited)))


class ReplicaSet:
    """The replicas of the next sync: fixed URLs and DNS names, resolved again at each sync (a scaled
    Deployment gains and loses replicas between syncs); one :class:`VllmReplica` per URL, kept while it
    stays."""

    def __init__(self, targets: Sequence[str], lora_name: str | None = None,
                 resolve: Callable[..., list] = socket.getaddrinfo, timeout_s: float = 600.0) -> None:
        self.targets = list(targets)
        self.lora_name = lora_name
        self.resolve = resolve
        self.timeout_s = timeout_s
        self._known: dict[str, VllmReplica] = {}

    @property
    def dynamic(self) -> bool:
        return any(target.startswith(DNS_SCHEME) for target in self.targets)

    def current(self) -> list[VllmReplica]:
        urls = [url for target in self.targets for url in resolve_replica_urls(target, self.resolve)]
        if self.dynamic and not urls:
            raise SyncError(f"no vLLM replica behind {self.targets} — are the vLLM pods Ready?")
        replicas = {url: self._known.get(url) or VllmReplica(url, lora_name=self.lora_name, timeout_s=self.timeout_s)
                    for url in urls}
        for url in set(self._known) - set(replicas):
            self._known.pop(url).close()
        self._known.update(replicas)
        return list(replicas.values())


REPLICA_LOOKUP_TRIES = 7
"""Lookups of the replicas before a sync gives up finding one: 1 + 2 + ... + 32 = 63 s of waits, past the 30 s
for which the cluster's DNS may cache "no such name" (CoreDNS's ``ttl 30`` and ``cache 30``, as kubeadm and
kind set them) after a replica restarted."""


class WeightSync:
    """Loads a version on every replica behind paused replicas and gate (the module docstring has the rules).

    ``replicas``: a fixed list, or a callable giving the replicas of each sync (:meth:`ReplicaSet.current`).
    A sync that finds no replica fails: the gate would otherwise announce a version no replica loaded, and
    its proxies record calls under it. ``timeout_s``: no retry starts later than this after the
    sync began (``spec.weightSync.timeoutSeconds``; each replica's requests carry the same bound).
    """

    def __init__(self, replicas: Sequence[Replica] | Callable[[], Sequence[Replica]], gate: RolloutGate | None = None,
                 tries: int = 3, backoff_s: float = 1.0, timeout_s: float | None = None,
                 lookup_backoff_s: float = 1.0) -> None:
        if tries < 1:
            raise ValueError("tries must be >= 1")
        self.replicas = replicas
        self.gate = gate or NoGate()
        self.tries = tries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.lookup_backoff_s = lookup_backoff_s  # the first wait between REPLICA_LOOKUP_TRIES lookups
        self._deadline: float | None = None

    def _retry(self, fn: Callable[[], Any], what: str) -> Any:
        return retry(fn, self.tries, self.backoff_s, what=what, deadline=self._deadline)

    def _current(self) -> list[Replica]:
        return list(self.replicas() if callable(self.replicas) else self.replicas)

    def _each(self, replicas: Sequence[Replica], operation: Callable[[Replica], Any]) -> dict[str, str]:
        """``operation`` on every replica at once; errors by replica name (after retries)."""
        def one(replica: Replica) -> str | None:
            try:
                self._retry(lambda: operation(replica), what=f"{replica.name}")
            except Exception as exc:  # noqa: BLE001 - reported per replica, never fatal to the others
                return _one_line(exc)
            return None

        with ThreadPoolExecutor(max_workers=min(32, max(1, len(replicas)))) as pool:
            errors = dict(zip([r.name for r in replicas], pool.map(one, replicas), strict=True))
        return {name: error for name, error in errors.items() if error is not None}

    def _load_one(self, replica: Replica, checkpoint: Path, version: int) -> ReplicaResult:
        started = time.perf_counter()
        count = 0

        def attempt() -> None:
            nonlocal count
            count += 1
            replica.load(checkpoint, version)

        try:
            self._retry(attempt, what=f"weight sync of {replica.name}")
        except Exception as exc:  # noqa: BLE001 - any failure of a replica is reported, never fatal to the sync
            return ReplicaResult(replica.name, False, count, time.perf_counter() - started, _one_line(exc))
        return ReplicaResult(replica.name, True, count, time.perf_counter() - started)

    def sync(self, version: int, checkpoint: Path) -> SyncReport:
        started = time.perf_counter()
        self._deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        gate_errors: dict[str, str] = {}
        pause = GateReport({})
        results: list[ReplicaResult] = []
        replicas: list[Replica] = []
        resolved = True
        def found() -> list[Replica]:
            replicas = self._current()
            if not replicas:
                raise SyncError(f"no vLLM replica to load version {version} into: syncing none is not a sync")
            return replicas

        try:  # a replica that just turned Ready may reach the cluster's DNS 30 s later (a cached negative answer)
            replicas = retry(found, REPLICA_LOOKUP_TRIES, self.lookup_backoff_s, what="finding the vLLM replicas",
                             deadline=self._deadline)
        except SyncError as exc:
            resolved = False
            results.append(ReplicaResult(str(self.replicas), False, 1, 0.0, _one_line(exc)))
        try:
            pause = self.gate.pause()
            if pause.errors:
                log.warning("could not pause %s: calls may reach replicas mid-reload", sorted(pause.errors))
            gate_errors.update({f"pause {k}": v for k, v in self._each(replicas, lambda r: r.pause()).items()})
            with ThreadPoolExecutor(max_workers=min(32, max(1, len(replicas)))) as pool:
                results += list(pool.map(lambda r: self._load_one(r, checkpoint, version), replicas))
            if resolved and all(r.ok for r in results):
                labels = self._each(replicas, lambda r: r.set_version(version))
                gate_errors.update({f"version {k}": v for k, v in labels.items()})
                gate_errors.update({f"version {k}": v for k, v in self.gate.set_version(version).items()})
        finally:
            gate_errors.update({f"resume {k}": v for k, v in self._each(replicas, lambda r: r.resume()).items()})
            gate_errors.update({f"resume {k}": v for k, v in self.gate.resume().items()})
        # After the resume: a paused replica would hold the probe itself.
        probes = self._each(replicas, lambda r: r.probe()) if all(r.ok for r in results) else {}
        for result in results:
            if result.name in probes:
                result.ok, result.error = False, f"probe after loading: {probes[result.name]}"
        gate_errors.update({f"pause {k}": v for k, v in pause.errors.items()})
        ok = all(r.ok for r in results)
        report = SyncReport(version, ok, results, pause, gate_errors, time.perf_counter() - started)
        if not ok or gate_errors:
            log.error("weight sync of version %d: replicas failed %s, proxies failed %s", version,
                      {r.name: r.error for r in results if not r.ok}, gate_errors)
        return report


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
