"""The proxy when things go wrong: upstream failures, retries, harness disconnects, SIGTERM, DB outages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

pytest.register_assert_rewrite("proxy_servers")  # also loaded as a plugin below
from pg_helpers import BlockableDatabase
from proxy_servers import RunningProxy, RunningUpstream, metric_value, proxy_config
from vllm_fixtures import free_port

from harnessrl.proxy.fake_upstream import FakeUpstream
from harnessrl.proxy.upstreams import UpstreamPool
from harnessrl.store import CallStatus, RolloutState, TraceStore

pytest_plugins = ["proxy_servers"]  # fixtures: loops, upstream, make_proxy

MESSAGES = [{"role": "user", "content": "fix the bug"}]


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=30)


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------- retries


@pytest.mark.parametrize("failure", [503, 429, 500, "drop"])
def test_retryable_failures_are_retried_until_success(upstream, make_proxy, store, failure):
    proxy = make_proxy([upstream.url])
    upstream.fake.script.extend([failure, failure])
    resp = client(proxy.v1).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert resp.choices[0].message.content
    assert upstream.fake.hits == 3
    proxy.flush()
    calls = store.read_calls("r-1", 0)
    assert [c.status for c in calls] == [CallStatus.OK]  # one call, not one per attempt
    metrics = httpx.get(f"{proxy.url}/metrics").text
    reason = "connection" if failure == "drop" else str(failure)
    assert metric_value(metrics, "harnessrl_proxy_upstream_retries_total", reason=reason) == 2


def test_streams_are_retried_before_the_first_byte(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url])
    upstream.fake.script.extend([503])
    chunks = list(
        client(proxy.v1).chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, stream=True)
    )
    assert len(chunks) == 4 and upstream.fake.hits == 2


def test_retries_run_out_and_the_last_error_passes_through(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url], upstream_retries=2)
    upstream.fake.script.extend([503] * 5)
    with pytest.raises(openai.InternalServerError) as err:
        client(proxy.v1).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert err.value.status_code == 503 and err.value.body["message"] == "scripted 503"
    assert upstream.fake.hits == 3
    proxy.flush()
    [call] = store.read_calls("r-1", 0)
    assert call.status is CallStatus.ERROR and call.http_status == 503
    assert not store.get_attempt("r-1", 0).upstream_failed  # the upstream answered: its error is the harness's


def test_connection_refused_is_retried_then_reported_as_502(make_proxy, store):
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = make_proxy([dead], upstream_retries=2)
    resp = httpx.post(f"{proxy.v1}/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_unavailable"
    assert dead in resp.json()["error"]["message"]
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert metric_value(metrics, "harnessrl_proxy_upstream_retries_total", reason="connection") == 2
    assert metric_value(metrics, "harnessrl_proxy_upstream_failures_total", route="chat", status="502",
                        code="upstream_unavailable") == 1
    proxy.flush()
    [call] = store.read_calls("r-1", 0)
    assert call.status is CallStatus.ERROR and call.http_status == 502 and call.upstream == dead
    # the attempt is marked: its failure is retried without using one of harness.maxAttempts
    assert store.get_attempt("r-1", 0).upstream_failed


def test_a_dead_pinned_upstream_fails_over_to_the_next(upstream, make_proxy, store):
    dead = f"http://127.0.0.1:{free_port()}"
    pool = UpstreamPool([dead, upstream.url], metrics=None, current_version=lambda: 0)  # type: ignore[arg-type]
    rollout = next(f"r{i}" for i in range(1000) if pool.ranked(f"r{i}")[0] == dead)
    other = next(f"r{i}" for i in range(1000) if pool.ranked(f"r{i}")[0] == upstream.url)
    proxy = make_proxy([dead, upstream.url], rollout_id=None)
    for r in (rollout, other, rollout):
        client(f"{proxy.url}/rollouts/{r}/attempts/0/v1").chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=1
        )
    assert upstream.fake.hits == 3
    proxy.flush()
    assert {c.upstream for c in store.read_calls(rollout, 0)} == {upstream.url}


def test_rollouts_are_pinned_to_one_upstream(loops, make_proxy, store):
    ups = [RunningUpstream(loops, FakeUpstream()) for _ in range(3)]
    try:
        proxy = make_proxy([u.url for u in ups], rollout_id=None)
        for i in range(12):
            client(f"{proxy.url}/rollouts/r{i % 4}/attempts/0/v1").chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=1
            )
        proxy.flush()
        for r in range(4):
            assert len({c.upstream for c in store.read_calls(f"r{r}", 0)}) == 1
        assert sum(u.fake.hits for u in ups) == 12
    finally:
        for u in ups:
            u.stop()


def test_no_retry_after_the_first_streamed_byte(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url])
    upstream.fake.break_stream_after = 3  # role chunk + 2 tokens, then the connection dies
    received: list[str] = []
    with httpx.stream(
        "POST",
        f"{proxy.v1}/chat/completions",
        json={"model": "m", "messages": MESSAGES, "max_tokens": 10, "stream": True},
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                received.append(line[6:])
    assert upstream.fake.hits == 1
    assert json.loads(received[-2])["error"]["code"] == "upstream_stream_broken" and received[-1] == "[DONE]"
    proxy.flush()
    [call] = store.read_calls("r-1", 0)
    assert call.status is CallStatus.ERROR and call.http_status == 502
    assert len(call.completion_token_ids) == 2 and len(call.logprobs) == 2


# ------------------------------------------------------------------------------------ harness disconnect


def test_harness_disconnect_mid_stream_cancels_upstream_and_stores_aborted(upstream, make_proxy, store):
    upstream.fake.chunk_delay_s = 0.05
    proxy = make_proxy([upstream.url])
    events = 0
    with httpx.stream(
        "POST",
        f"{proxy.v1}/chat/completions",
        json={"model": "m", "messages": MESSAGES, "max_tokens": 200, "stream": True},
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events += 1
                if events == 3:
                    break
    wait_for(lambda: upstream.fake.aborted == 1, what="the upstream stream to be cancelled")
    assert upstream.fake.completed_streams == 0
    proxy.flush()
    [call] = store.read_calls("r-1", 0)
    assert call.status is CallStatus.ABORTED and call.http_status == 499
    assert 2 <= len(call.completion_token_ids) < 200
    assert len(call.logprobs) == len(call.completion_token_ids)


def test_harness_timeout_on_a_unary_call_stores_aborted(upstream, make_proxy, store):
    upstream.fake.response_delay_s = 1.0
    proxy = make_proxy([upstream.url])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{proxy.v1}/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=0.2)
    proxy.flush()
    wait_for(lambda: len(store.read_calls("r-1", 0)) == 1, what="the aborted call")
    [call] = store.read_calls("r-1", 0)
    assert call.status is CallStatus.ABORTED and call.http_status == 499 and call.completion_token_ids == []


def test_harness_leaving_while_the_server_derenders_its_answer_stores_aborted(upstream, make_proxy, store):
    """A continued call with tools is generated, then turned into a chat completion by the server's derender
    endpoint (``continuity.ServedPlan``); a harness that leaves during that second request was counted as a
    499 but its call was never recorded, so the store missed a call the metrics showed (issue 26's CLI tests
    compare the two). The plan here is a real ServedPlan on the fake upstream's chat route whose derender
    step takes longer than the harness waits."""
    import asyncio

    from harnessrl.proxy.continuity import ServedPlan

    proxy = make_proxy([upstream.url])

    async def slow_derender(answer):
        await asyncio.sleep(5)
        return answer

    async def plan(who, body, recent, model, sampling):
        request = {"model": "m", "messages": MESSAGES, "return_token_ids": True, "logprobs": True}
        return ServedPlan(request, [1, 2], 0, False, path="/v1/chat/completions", derender=slow_derender)

    proxy.proxy.continuity.plan = plan
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{proxy.v1}/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=0.5)
    wait_for(lambda: len(store.read_calls("r-1", 0)) == 1, what="the aborted call")
    [call] = store.read_calls("r-1", 0)
    assert call.status is CallStatus.ABORTED and call.http_status == 499
    text = httpx.get(f"{proxy.url}/metrics").text
    assert metric_value(text, "harnessrl_proxy_requests_total", route="chat", status="499") == 1


def test_an_answer_the_server_does_not_derender_is_a_counted_502(upstream, make_proxy, store):
    """An error the proxy answers itself after a failed upstream step is stored and counted by its code."""
    from harnessrl.proxy.continuity import DerenderFailed, ServedPlan

    proxy = make_proxy([upstream.url])

    async def failing_derender(answer):
        raise DerenderFailed("the upstream's /v1/chat/completions/derender did not answer a chat completion")

    async def plan(who, body, recent, model, sampling):
        request = {"model": "m", "messages": MESSAGES, "return_token_ids": True, "logprobs": True}
        return ServedPlan(request, [1, 2], 0, False, path="/v1/chat/completions", derender=failing_derender)

    proxy.proxy.continuity.plan = plan
    resp = httpx.post(f"{proxy.v1}/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=30)
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_bad_response"
    text = httpx.get(f"{proxy.url}/metrics").text
    assert metric_value(text, "harnessrl_proxy_upstream_failures_total", route="chat", status="502",
                        code="upstream_bad_response") == 1
    proxy.flush()
    [call] = store.read_calls("r-1", 0)
    assert call.status is CallStatus.ERROR and call.http_status == 502


# ---------------------------------------------------------------------------------------------- SIGTERM


def test_sigterm_finishes_in_flight_calls_flushes_and_exits_0(loops, store, store_url, tmp_path):
    running = RunningUpstream(loops, FakeUpstream(chunk_delay_s=0.02))
    port = free_port()
    env = {
        **os.environ,
        "HARNESSRL_UPSTREAMS": running.url,
        "HARNESSRL_ROLLOUT_ID": "sig",
        "HARNESSRL_RUN": "sig-run",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harnessrl.cli",
            "proxy",
            "--store",
            store_url,
            "--port",
            str(port),
            "--spool",
            str(tmp_path / "spool.jsonl"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(base), 60, "the proxy to start")
        results: list[str] = []
        errors: list[BaseException] = []

        def call(i: int) -> None:
            try:
                c = client(f"{base}/v1")
                if i % 2:
                    chunks = c.chat.completions.create(
                        model="m", messages=MESSAGES, max_tokens=40, stream=True
                    )
                    results.append("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
                else:
                    results.append(
                        c.completions.create(model="m", prompt=f"p{i}", max_tokens=3).choices[0].text
                    )
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        wait_for(lambda: httpx.get(f"{base}/admin/state").json()["in_flight"] >= 3, what="calls in flight")
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        running.stop()
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    stored = store.read_calls("sig", 0)
    # Every call the proxy accepted is stored, each exactly once; calls it no longer accepted failed cleanly.
    assert len(stored) == len(results) and not [
        e for e in errors if not isinstance(e, openai.APIConnectionError)
    ]
    assert len(results) >= 3
    assert sorted(c.seq for c in stored) == list(range(len(stored)))
    assert all(c.status is CallStatus.OK for c in stored)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_cli_refuses_bad_settings_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESSRL_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harnessrl.cli",
            "proxy",
            "--upstream",
            "localhost:8000",
            "--store",
            f"sqlite:///{tmp_path}/x.db",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "upstreams (--upstream or HARNESSRL_UPSTREAMS)" in proc.stderr and "http://" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "harnessrl.cli", "proxy", "--upstream", "http://127.0.0.1:1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "store_url (--store or HARNESSRL_STORE_URL): is required" in proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harnessrl.cli",
            "proxy",
            "--upstream",
            "http://127.0.0.1:1",
            "--store",
            f"sqlite:///{tmp_path}/x.db",
        ],
        env={**env, "HARNESSRL_SAMPLING": "{temp"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "HARNESSRL_SAMPLING" in proc.stderr and "not JSON" in proc.stderr


def test_cli_refuses_a_store_that_was_never_migrated(tmp_path):
    """Serving on it would spool every call forever ("no such table"); the store answers, so say what to do."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESSRL_")}
    url = f"sqlite:///{tmp_path}/new.db"
    command = [sys.executable, "-m", "harnessrl.cli", "proxy", "--upstream", "http://127.0.0.1:1", "--store", url,
               "--port", str(free_port())]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert line == (f"Error: the store {url} has no harnessrl schema — run `harnessrl db upgrade --url {url}` "
                    "first, or start the proxy with --upgrade-db")


# ------------------------------------------------------------------------------- settings from the spec


RUN_SPEC = """
apiVersion: harnessrl.io/v1alpha1
kind: TrainingRun
metadata: {name: knobs}
spec:
  model: {path: model}
  harness:
    command: [python, -c, "pass"]
    tasks: {inline: [{id: t, data: {}}]}
  proxy:
    queueSize: 3
    queueMaxBytes: 123456
    spoolDir: my-spool
    spoolMaxBytes: 654321
    pause: {mode: reject, retryAfterSeconds: 7}
"""


def test_harnessrl_run_starts_its_proxy_with_the_specs_proxy_settings(upstream, tmp_path):
    """queueSize, queueMaxBytes, spoolDir, spoolMaxBytes and pause.retryAfterSeconds were validated and then
    dropped by `harnessrl run`; the proxy it starts must act on each."""
    import yaml

    from harnessrl.local.runner import LocalRun, LocalRunOptions
    from harnessrl.spec.models import TrainingRun

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    spec_path = tmp_path / "run.yaml"
    spec_path.write_text(RUN_SPEC)
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    TraceStore.connect(store_url).upgrade()
    run_dir = tmp_path / "runs" / "knobs"
    run_dir.mkdir(parents=True)
    local = LocalRun(TrainingRun.model_validate(yaml.safe_load(RUN_SPEC)),
                     LocalRunOptions(spec_path=spec_path, run_dir=run_dir, store_url=store_url))
    url = local._start_proxy(upstream.url, 0)
    try:
        state = httpx.get(f"{url}/admin/state").json()
        assert (state["queue_size"], state["queue_max_bytes"], state["spool_max_bytes"]) == (3, 123456, 654321)
        assert state["spool_path"] == str(run_dir / "my-spool" / "proxy.spool")
        assert (run_dir / "my-spool" / "proxy.spool").exists()
        assert httpx.post(f"{url}/admin/pause", json={}).json()["mode"] == "reject"
        paused = httpx.post(f"{url}/rollouts/r/attempts/0/v1/chat/completions",
                            json={"model": "m", "messages": MESSAGES})
        assert paused.status_code == 503 and paused.headers["Retry-After"] == "7"
    finally:
        local._stop_children()


# ------------------------------------------------------------------------------------ writer failures


def test_a_writer_that_cannot_write_says_so_keeps_everything_and_recovers(upstream, make_proxy, store):
    """A real disk-full error on the writer thread (its .rejected file is /dev/full): /healthz answers 503
    with the reason and the metric shows it, items wait in memory instead of vanishing with a dead thread,
    and once the disk takes writes again everything reaches the store."""
    proxy = make_proxy([upstream.url], rollout_id=None, spool_retry_s=0.01)
    rejected = proxy.config.spool_path.with_name(proxy.config.spool_path.name + ".rejected")
    rejected.symlink_to("/dev/full")
    base = f"{proxy.url}/rollouts/late/attempts/0/v1"
    store.finish_attempt("late", 0, RolloutState.CANCELLED, run="test-run")
    assert httpx.post(f"{base}/reward", json={"value": 1.0}).status_code == 409  # refused, set aside: ENOSPC
    wait_for(lambda: httpx.get(f"{proxy.url}/healthz").status_code == 503, what="/healthz to say 503")
    health = httpx.get(f"{proxy.url}/healthz").json()
    assert health["status"] == "failing" and "No space left on device" in health["reason"]
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert metric_value(metrics, "harnessrl_proxy_writer_failing") == 1
    assert metric_value(metrics, "harnessrl_proxy_write_errors_total", kind="writer") >= 1
    client(f"{proxy.url}/rollouts/other/attempts/0/v1").chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=2
    )  # still answered; its record waits behind the held item
    assert store.read_calls("other", 0) == []
    rejected.unlink()  # room on the disk again
    wait_for(lambda: httpx.get(f"{proxy.url}/healthz").status_code == 200, what="/healthz to recover")
    proxy.flush()
    assert len(store.read_calls("other", 0)) == 1
    [kept] = [json.loads(line) for line in rejected.read_text().splitlines()]
    assert kept["item"]["rollout_id"] == "late" and kept["error"].startswith("AttemptSettled")
    assert metric_value(httpx.get(f"{proxy.url}/metrics").text, "harnessrl_proxy_writer_failing") == 0


# ------------------------------------------------------------------------------------ database outages


@pytest.fixture
def pg_store(pg_url: str):
    store = TraceStore.connect(pg_url)
    store.upgrade()
    db = BlockableDatabase(pg_url)
    yield pg_url, store, db
    db.close()
    store.close()


@pytest.mark.postgres
def test_database_outage_mid_stream_of_calls_loses_nothing(loops, upstream, pg_store, tmp_path):
    pg_url, store, db = pg_store
    config = proxy_config([upstream.url], pg_url, tmp_path / "spool.jsonl", reward_timeout_s=2.0)
    proxy = RunningProxy(loops, config, store)
    c = client(proxy.v1)
    try:
        for i in range(45):
            if i == 15:
                proxy.flush()
                db.block()
            if i == 30:
                state = httpx.get(f"{proxy.url}/admin/state").json()
                assert state["spool_pending"] > 0  # the proxy kept serving from the spool
                db.unblock()
            if i == 35:
                proxy.flush(60)  # the spool is replayed with backoff: a reward waits behind it
            messages = [{"role": "user", "content": f"call {i}"}]
            if i % 3 == 0:
                list(c.chat.completions.create(model="m", messages=messages, max_tokens=2, stream=True))
            else:
                c.chat.completions.create(model="m", messages=messages, max_tokens=2)
            if i % 10 == 5:
                reward = httpx.post(f"{proxy.v1}/reward", json={"value": i})
                if 15 <= i < 30:  # not stored yet: the harness is told so, the proxy keeps it in the spool
                    assert reward.status_code == 503 and reward.json()["error"]["code"] == "reward_not_stored"
                else:
                    assert reward.status_code == 200, reward.text
        proxy.flush(60)
        metrics = httpx.get(f"{proxy.url}/metrics").text
    finally:
        proxy.stop()
    calls = store.read_calls("r-1", 0)
    assert [call.seq for call in calls] == list(range(45))  # every call exactly once, in order
    assert [call.request["messages"][0]["content"] for call in calls] == [f"call {i}" for i in range(45)]
    assert len({call.call_id for call in calls}) == 45
    assert store.get_attempt("r-1", 0).reward == 35.0
    spooled = metric_value(metrics, "harnessrl_proxy_spooled_items_total")
    replayed = metric_value(metrics, "harnessrl_proxy_replayed_items_total")
    assert spooled is not None and spooled >= 15 and replayed == spooled
    assert (metric_value(metrics, "harnessrl_proxy_write_errors_total", kind="outage") or 0) >= 1
    assert not (tmp_path / "spool.jsonl.rejected").exists()
    assert (tmp_path / "spool.jsonl").stat().st_size == 0


@pytest.mark.postgres
def test_spool_left_at_shutdown_is_replayed_by_the_next_proxy(loops, upstream, pg_store, tmp_path):
    pg_url, store, db = pg_store
    spool = tmp_path / "spool.jsonl"
    db.block()
    config = proxy_config([upstream.url], pg_url, spool, shutdown_timeout_s=0.3, reward_timeout_s=0.3)
    first = RunningProxy(loops, config, store)
    c = client(first.v1)
    for i in range(10):
        c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"call {i}"}], max_tokens=2
        )
    assert httpx.post(f"{first.v1}/reward", json={"value": 0.5}).status_code == 503  # spooled, not stored
    first.stop()  # the database is still away: everything stays in the spool
    assert len(spool.read_text().splitlines()) == 11
    db.unblock()
    second = RunningProxy(loops, proxy_config([upstream.url], pg_url, spool), store)
    try:
        wait_for(lambda: second.proxy.writer.spool.pending == 0, 30, "the spool replay")
    finally:
        second.stop()
    calls = store.read_calls("r-1", 0)
    assert [call.request["messages"][0]["content"] for call in calls] == [f"call {i}" for i in range(10)]
    assert store.get_attempt("r-1", 0).reward == 0.5
    assert store.get_attempt("r-1", 0).state is RolloutState.RUNNING


@pytest.mark.postgres
def test_a_proxy_started_while_its_database_is_down_serves_and_stores_everything_later(
    loops, upstream, pg_store, tmp_path
):
    """A harness pod started while the chart's PostgreSQL restarts: its proxy sidecar comes up anyway, answers
    the harness's calls from the spool, and stores every call once the database is back (it used to exit on
    its first connection, and the pod crash-looped until the database returned)."""
    pg_url, store, db = pg_store
    port = free_port()
    env = {**os.environ, "HARNESSRL_UPSTREAMS": upstream.url, "HARNESSRL_ROLLOUT_ID": "down-at-start",
           "HARNESSRL_RUN": "down-run"}
    db.block()
    proc = subprocess.Popen(
        [sys.executable, "-m", "harnessrl.cli", "proxy", "--store", pg_url, "--port", str(port),
         "--spool", str(tmp_path / "spool.jsonl")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(base) or proc.poll() is not None, 60, "the proxy to start")
        assert proc.poll() is None, proc.communicate()[0]
        c = client(f"{base}/v1")
        for i in range(5):
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"call {i}"}], max_tokens=2)
        wait_for(lambda: httpx.get(f"{base}/admin/state").json()["spool_pending"] > 0, 30, "calls in the spool")
        db.unblock()
        store.engine.dispose()  # the block ended this test's own pooled connections too
        wait_for(lambda: len(store.read_calls("down-at-start", 0)) == 5, 60, "the spooled calls to be stored")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        db.unblock()
    assert proc.returncode == 0, out
    calls = store.read_calls("down-at-start", 0)
    assert [call.request["messages"][0]["content"] for call in calls] == [f"call {i}" for i in range(5)]
