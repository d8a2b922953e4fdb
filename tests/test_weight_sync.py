"""Weight sync against real capture proxies (their admin API over HTTP): pause, announce, always resume.

The replicas here are unreachable addresses (a real connection failure); the vLLM test loads real weights.
"""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
from proxy_servers import loops, make_proxy, upstream  # noqa: F401 - pytest fixtures

from harnessrl.trainer.weight_sync import (
    ProxyAdminGate,
    ReplicaSet,
    SyncError,
    VllmReplica,
    WeightSync,
    check_inplace_reload,
    resolve_replica_urls,
    retry,
    wait_for_replicas,
)


def dead_url() -> str:
    """An address nothing listens on: the port was free a moment ago and is closed again."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def state(url: str) -> dict:
    return httpx.get(f"{url}/admin/state", timeout=10).json()


def test_retry_backs_off_exponentially_then_gives_up():
    waits: list[float] = []
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return "loaded"

    assert retry(flaky, 4, 0.5, "flaky", sleep=waits.append) == "loaded"
    assert waits == [0.5, 1.0]

    waits.clear()
    with pytest.raises(ConnectionError):
        retry(lambda: (_ for _ in ()).throw(ConnectionError("down")), 3, 0.25, "down", sleep=waits.append)
    assert waits == [0.25, 0.5]


def test_a_failing_replica_is_retried_reported_and_the_proxies_resume_on_the_old_version(
    make_proxy, upstream
):
    proxies = [make_proxy([upstream.url]), make_proxy([upstream.url])]
    gate = ProxyAdminGate([p.url for p in proxies], mode="reject", drain_timeout_s=2)
    bad = dead_url()
    sync = WeightSync([VllmReplica(bad)], gate, tries=3, backoff_s=0.01)
    report = sync.sync(5, Path("/nonexistent/v000005"))

    assert not report.ok
    (result,) = report.replicas
    assert result.name == bad and result.tries == 3 and "ConnectError" in result.error
    assert report.failed == [bad]
    assert report.pause.drained and set(report.pause.in_flight) == {p.url for p in proxies}
    for proxy in proxies:
        assert state(proxy.url)["paused"] is False  # resumed although the sync failed
        assert state(proxy.url)["policy_version"] == 0  # the new version was not announced


@pytest.mark.parametrize("replicas", ["empty list", "resolves to none"])
def test_a_sync_that_finds_no_replica_fails_and_no_proxy_learns_the_version(make_proxy, upstream, replicas):
    """Syncing no replica is not a sync: an empty list fails like a name that resolves to nothing, the proxies
    are paused and resumed but never told the version (they would record calls under weights nothing loaded),
    and a dead proxy is still reported apart."""
    live = make_proxy([upstream.url])
    gone = dead_url()
    gate = ProxyAdminGate([live.url, gone], retries=2, backoff_s=0.01)
    targets = [] if replicas == "empty list" else ReplicaSet(["dns://nothing.invalid:8000"], resolve=lambda *a, **k: []).current
    report = WeightSync(targets, gate, tries=1, lookup_backoff_s=0).sync(3, Path("/ckpt/v000003"))
    assert not report.ok
    assert [r.ok for r in report.replicas] == [False]
    assert "no vLLM replica" in report.replicas[0].error
    assert state(live.url)["policy_version"] == 0 and state(live.url)["paused"] is False
    assert sorted(report.gate_errors) == [f"pause {gone}", f"resume {gone}"]
    assert all("ConnectError" in e for e in report.gate_errors.values())


class Accepting:
    """A replica that takes every request (the Replica protocol), to see what the sync asked of it."""

    name = "http://10.0.0.9:8001"

    def __init__(self) -> None:
        self.loaded: list[int] = []

    def pause(self) -> None: ...
    def load(self, checkpoint: Path, version: int) -> None:
        self.loaded.append(version)
    def set_version(self, version: int) -> None: ...
    def served_version(self) -> str | None:
        return None
    def resume(self) -> None: ...
    def probe(self) -> None: ...


def test_a_replica_that_reaches_the_dns_late_is_found_by_the_syncs_retries():
    """A sync right after a replica restarted: its address reaches the DNS seconds after it turned Ready, so
    finding none is retried (REPLICA_LOOKUP_TRIES, whatever the sync's tries)."""
    replica = Accepting()
    answers: list[list] = [[], [], [replica]]
    report = WeightSync(lambda: answers.pop(0), tries=1, lookup_backoff_s=0.01).sync(2, Path("/ckpt/v000002"))
    assert report.ok and replica.loaded == [2] and answers == []


@pytest.mark.parametrize("tied", [True, False])
def test_full_weight_sync_refuses_a_model_with_a_tied_lm_head(tmp_path: Path, tied: bool):
    """vLLM's in-place reload would leave a tied head on the initial weights: refuse before the first step."""
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=64, hidden_size=32, tie_word_embeddings=tied).save_pretrained(tmp_path)
    if not tied:
        check_inplace_reload(tmp_path)  # an untied model syncs by reload
        return
    with pytest.raises(SyncError, match=r"tie_word_embeddings: true.*spec\.weightSync\.method to lora"):
        check_inplace_reload(tmp_path)


def fake_dns(answers: dict[str, list[str]]):
    """A resolver with getaddrinfo's signature and answer shape, for names this machine cannot serve."""

    def resolve(host: str, port: int, type: int = 0) -> list:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, type, 6, "", (ip, port)) for ip in answers[host]]

    return resolve


def test_a_dns_replica_set_is_resolved_again_at_each_sync():
    dns = {"run-rollout-pods": ["10.0.0.2", "10.0.0.1", "10.0.0.2"]}
    replicas = ReplicaSet(["dns://run-rollout-pods:8000", "http://fixed:9000/"], resolve=fake_dns(dns))
    first = replicas.current()
    assert [r.name for r in first] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://fixed:9000"]
    dns["run-rollout-pods"] = ["10.0.0.2", "fd00::3"]  # scaled: one replica gone, one new (IPv6)
    second = replicas.current()
    assert [r.name for r in second] == ["http://10.0.0.2:8000", "http://[fd00::3]:8000", "http://fixed:9000"]
    assert second[0] is first[1]  # a replica that stays keeps its client
    assert resolve_replica_urls("dns://localhost:8000") == ["http://127.0.0.1:8000"]  # the real resolver


@pytest.mark.parametrize("answers", [{}, {"run-rollout-pods": []}])
def test_a_dns_name_with_no_replica_behind_it_fails_the_sync(answers):
    """A headless Service with no Ready pod (or no DNS name at all) is not a successful sync of nothing."""
    replicas = ReplicaSet(["dns://run-rollout-pods:8000"], resolve=fake_dns(answers))
    report = WeightSync(replicas.current, tries=1, lookup_backoff_s=0).sync(4, Path("/ckpt/v000004"))
    assert not report.ok
    (result,) = report.replicas
    assert "run-rollout-pods" in result.error and "Ready" in result.error


class FakeClock:
    """Time that passes only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_starting_learner_waits_for_the_first_replica_and_not_past_its_limit():
    """vLLM starts in minutes, the learner in seconds: the learner's first sync waits for a replica behind the
    headless Service instead of failing on every rank while vLLM loads; past the limit it goes on (the sync
    then fails naming the Service). Fixed URLs and a limit of 0 are not waited for."""
    dns: dict[str, list[str]] = {}
    clock, said = FakeClock(), []
    asked = []

    def resolve(host: str, port: int, type: int = 0) -> list:
        asked.append(clock.now)
        if clock.now >= 30:  # the replica's pod turns Ready 30 s after the learner started
            dns["run-rollout-pods"] = ["10.0.0.7"]
        return fake_dns(dns)(host, port, type)

    found = wait_for_replicas(["dns://run-rollout-pods:8001"], 600, said.append, resolve=resolve, poll_s=5,
                              clock=clock, sleep=clock.sleep)
    assert found == ["http://10.0.0.7:8001"]
    assert clock.now == 30 and asked == [0, 5, 10, 15, 20, 25, 30]
    assert len(said) == 2 and "waiting up to 600 s" in said[0] and "does not resolve" in said[0]
    assert "1 vLLM replica(s) after 30 s" in said[1]

    dns.clear()
    clock, said = FakeClock(), []
    assert wait_for_replicas(["dns://run-rollout-pods:8001"], 12, said.append, resolve=fake_dns(dns), poll_s=5,
                             clock=clock, sleep=clock.sleep) == []
    assert clock.now == 12 and "no vLLM replica after 12 s" in said[-1]
    for targets, limit in ((["http://fixed:8001"], 600), (["dns://run-rollout-pods:8001"], 0)):
        assert wait_for_replicas(targets, limit, said.append, resolve=fake_dns(dns), clock=clock,
                                 sleep=clock.sleep) == []
    assert clock.now == 12


def test_a_replica_set_written_wrong_names_the_form():
    with pytest.raises(SyncError, match=r"dns://NAME:PORT"):
        resolve_replica_urls("dns://run-rollout-pods")


def test_the_time_limit_bounds_a_sync_whose_replica_never_answers():
    """spec.weightSync.timeoutSeconds: a replica that accepts connections and never answers (a listening
    socket nobody accepts from) fails the sync once the limit passed, not after tries × request timeouts."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        replica = VllmReplica(url, timeout_s=0.5)
        report = WeightSync([replica], tries=50, backoff_s=0.01, timeout_s=1.0).sync(2, Path("/ckpt/v000002"))
    assert not report.ok
    (result,) = report.replicas
    assert result.tries < 50 and "spec.weightSync.timeoutSeconds" in result.error and "ReadTimeout" in result.error
