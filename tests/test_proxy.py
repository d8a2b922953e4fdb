"""The capture proxy end to end: OpenAI SDK client -> proxy -> fake vLLM upstream -> trace store.

Every test runs on SQLite and on PostgreSQL (``store_url``). The fake upstream speaks vLLM's wire format; its
completion text is `` t<id>`` per token, so the token ids a harness never saw can still be checked against
the text it did see.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import threading

import httpx
import openai
import pytest

pytest.register_assert_rewrite("proxy_servers")  # also loaded as a plugin below
from proxy_servers import metric_value

from harnessrl.proxy.app import Exchange
from harnessrl.proxy.capture import Attribution
from harnessrl.proxy.fake_upstream import encode, render_chat, token_logprob
from harnessrl.proxy.protocol import client_wants, tokens_from_response
from harnessrl.store import CallStatus, PreparedCall, RolloutState, TraceStore

pytest_plugins = ["proxy_servers"]  # fixtures: loops, upstream, make_proxy

MESSAGES = [{"role": "system", "content": "you fix bugs"}, {"role": "user", "content": "fix file 42"}]


def ids_from_text(text: str) -> list[int]:
    return [int(word[1:]) for word in text.split()]


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=30)


def only_call(store: TraceStore, rollout: str = "r-1", attempt: int = 0):
    calls = store.read_calls(rollout, attempt)
    assert len(calls) == 1, calls
    return calls[0]


def test_chat_non_streaming_is_captured_exactly_and_unrequested_fields_are_removed(
    upstream, make_proxy, store
):
    proxy = make_proxy([upstream.url], sampling={"temperature": 1.0}, model_name="served-model")
    resp = client(proxy.v1).chat.completions.create(
        model="gpt-whatever", messages=MESSAGES, max_tokens=5, temperature=0.2
    )
    text = resp.choices[0].message.content
    raw = resp.model_dump()
    assert "prompt_token_ids" not in raw and "token_ids" not in raw["choices"][0]
    assert resp.choices[0].logprobs is None
    sent = upstream.fake.bodies[-1]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    assert sent["model"] == "served-model" and sent["temperature"] == 1.0  # the run's settings win

    proxy.flush()
    call = only_call(store)
    assert call.status is CallStatus.OK and call.route == "chat" and call.seq == 0 and call.run == "test-run"
    assert call.prompt_token_ids == encode(render_chat(MESSAGES))
    assert call.completion_token_ids == ids_from_text(text) and len(call.completion_token_ids) == 5
    assert call.logprobs == [token_logprob(t) for t in call.completion_token_ids]
    assert (
        call.request["messages"] == MESSAGES and call.request["temperature"] == 0.2
    )  # as the harness sent it
    assert "return_token_ids" not in call.request
    assert call.response["choices"][0]["message"]["content"] == text
    assert call.upstream == upstream.url and call.policy_version == 0 and call.http_status == 200
    # stored as the harness got it: what the proxy added for itself lives once, in the arrays above
    assert "prompt_token_ids" not in call.response and "token_ids" not in call.response["choices"][0]
    assert call.response["choices"][0]["logprobs"] is None


def test_chat_streaming_passes_chunks_through_and_assembles_the_call(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url])
    chunks = list(
        client(proxy.v1).chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, stream=True)
    )
    for chunk in chunks:
        extra = chunk.model_dump()
        assert "prompt_token_ids" not in extra
        for choice in extra["choices"]:
            assert "token_ids" not in choice and choice["logprobs"] is None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) == 7  # role chunk + one per token, as the upstream sent them

    proxy.flush()
    call = only_call(store)
    assert call.status is CallStatus.OK and call.finish_reason == "length"
    assert call.prompt_token_ids == encode(render_chat(MESSAGES))
    assert call.completion_token_ids == ids_from_text(text)
    assert call.logprobs == [token_logprob(t) for t in call.completion_token_ids]
    assert call.response["object"] == "chat.completion"
    assert call.response["choices"][0]["message"] == {"role": "assistant", "content": text}


@pytest.mark.parametrize("stream", [False, True])
def test_completions_with_requested_token_ids_and_logprobs(upstream, make_proxy, store, stream):
    proxy = make_proxy([upstream.url])
    kwargs = {
        "model": "m",
        "prompt": "def f(x):",
        "max_tokens": 4,
        "logprobs": 2,
        "extra_body": {"return_token_ids": True},
    }
    if stream:
        chunks = list(client(proxy.v1).completions.create(stream=True, **kwargs))
        got_ids = [t for c in chunks for t in c.model_dump()["choices"][0]["token_ids"]]
        got_lps = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
        got_prompt = chunks[0].model_dump()["choices"][0]["prompt_token_ids"]
    else:
        resp = client(proxy.v1).completions.create(**kwargs)
        choice = resp.model_dump()["choices"][0]
        got_ids, got_lps, got_prompt = (
            choice["token_ids"],
            choice["logprobs"]["token_logprobs"],
            choice["prompt_token_ids"],
        )
    assert upstream.fake.bodies[-1]["logprobs"] == 2  # the harness's larger value is kept

    proxy.flush()
    call = only_call(store)
    assert call.route == "completions"
    assert call.prompt_token_ids == got_prompt == encode("def f(x):")
    assert call.completion_token_ids == got_ids and len(got_ids) == 4
    assert call.logprobs == got_lps
    choice = call.response["choices"][0]  # the harness asked for them: the stored answer has them too
    assert choice["token_ids"] == got_ids and choice["logprobs"]["token_logprobs"] == got_lps


def test_calls_wait_in_the_writer_queue_prepared(upstream, make_proxy, store, monkeypatch):
    """Queued calls hold packed arrays (``PreparedCall``), not the decoded answer, so a long queue does not
    make the garbage collector's work grow (the proxy prepares each after its answer has gone out)."""
    seen: list[type] = []
    add_calls = store.add_calls
    monkeypatch.setattr(
        store, "add_calls", lambda calls: (seen.extend(map(type, calls)), add_calls(calls))[1]
    )
    proxy = make_proxy([upstream.url], write_linger_s=30.0)  # the writer takes them at the flush only
    for _ in range(3):
        client(proxy.v1).chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
    # The answer can reach the client in the loop iteration that queued the prepare callback; one more
    # iteration of the proxy's loop runs it (a writer taking the call earlier stores it unprepared: fine
    # for the store, but not what this test is about).
    proxy.loops.run(asyncio.sleep(0))
    proxy.flush()
    assert seen == [PreparedCall] * 3
    assert [c.seq for c in store.read_calls("r-1", 0)] == [0, 1, 2]


def test_an_answer_with_several_choices_is_stored_whole(upstream, make_proxy, store):
    """Only choice 0 has token arrays, so what the proxy added to the others is not dropped."""
    proxy = make_proxy([upstream.url])
    body = {"model": "m", "messages": MESSAGES, "n": 2}
    wants = client_wants("chat", body)
    x = Exchange("chat", Attribution("test-run", "r-1", 0), body, wants, b"{}", "/v1/chat/completions", 0.0)
    choices = [
        {"index": i, "message": {"role": "assistant", "content": f"c{i}"}, "token_ids": [i, 9],
         "logprobs": {"content": [{"token": "t", "logprob": -0.5, "bytes": [116], "top_logprobs": []}] * 2}}
        for i in range(2)
    ]  # fmt: skip
    answer = {"id": "x", "choices": choices, "prompt_token_ids": [1, 2]}
    tokens = tokens_from_response("chat", answer)
    proxy.loops.run(_capture_on_loop(proxy.proxy, x, copy.deepcopy(answer), tokens))
    proxy.flush()
    assert only_call(store).response == answer


async def _capture_on_loop(capture_proxy, x, answer, tokens) -> None:
    capture_proxy.capture(
        x, answer, tokens, policy_version=0, upstream="u", status=CallStatus.OK, http_status=200
    )


def test_completions_without_logprobs_get_none_but_are_captured(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url])
    resp = client(proxy.v1).completions.create(model="m", prompt="hello", max_tokens=3)
    assert resp.choices[0].logprobs is None and "token_ids" not in resp.model_dump()["choices"][0]
    assert upstream.fake.bodies[-1]["logprobs"] == 1
    proxy.flush()
    call = only_call(store)
    assert call.completion_token_ids == ids_from_text(resp.choices[0].text)
    assert call.logprobs == [token_logprob(t) for t in call.completion_token_ids]


def test_observe_mode_forwards_the_request_unchanged(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url], proxy_mode="observe", sampling={"temperature": 1.0})
    client(proxy.v1).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, temperature=0.3)
    sent = upstream.fake.bodies[-1]
    assert "return_token_ids" not in sent and "logprobs" not in sent and sent["temperature"] == 0.3
    proxy.flush()
    call = only_call(store)
    assert call.completion_token_ids == [] and call.status is CallStatus.OK


def test_sequence_numbers_follow_the_calls_of_an_attempt(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url])
    c = client(proxy.v1)
    messages = list(MESSAGES)
    for _ in range(3):
        reply = c.chat.completions.create(model="m", messages=messages, max_tokens=2).choices[0].message
        messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "go on"}]
    proxy.flush()
    calls = store.read_calls("r-1", 0)
    assert [c.seq for c in calls] == [0, 1, 2]
    assert calls[2].request["messages"] == messages[:-2]


def test_gateway_attribution_from_the_path(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url], rollout_id=None)
    with pytest.raises(openai.BadRequestError) as err:
        client(proxy.v1).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert err.value.body["code"] == "missing_attribution"
    client(f"{proxy.url}/rollouts/task-7.g3/attempts/2/v1").chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=2
    )
    bad = httpx.post(
        f"{proxy.url}/rollouts/x/attempts/first/v1/chat/completions",
        json={"model": "m", "messages": MESSAGES},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "attempt"
    proxy.flush()
    call = only_call(store, "task-7.g3", 2)
    assert call.attempt == 2 and call.seq == 0
    assert store.get_attempt("task-7.g3", 2).state is RolloutState.RUNNING


def test_rewards_last_one_wins_and_missing_stays_missing(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url], rollout_id=None)
    for rollout in ("a", "b"):
        client(f"{proxy.url}/rollouts/{rollout}/attempts/0/v1").chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=1
        )
    base = f"{proxy.url}/rollouts/a/attempts/0/v1"
    assert httpx.post(f"{base}/reward", json={"value": 0.25}).status_code == 200
    assert httpx.post(f"{base}/reward", json={"value": 1, "info": {"tests_passed": 3}}).status_code == 200
    for bad in ("1.0", True, None, [1], {"x": 1}):
        resp = httpx.post(f"{base}/reward", json={"value": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "value", bad
    nan = httpx.post(
        f"{base}/reward", content=b'{"value": NaN}', headers={"Content-Type": "application/json"}
    )
    assert nan.status_code == 400
    assert httpx.post(f"{base}/rollout/finish", json={"status": "done"}).status_code == 400
    assert httpx.post(f"{base}/rollout/finish", json={"status": "succeeded"}).status_code == 200
    proxy.flush()
    a = store.get_attempt("a", 0)
    assert a.reward == 1.0 and a.reward_info == {"tests_passed": 3} and a.state is RolloutState.SUCCEEDED
    assert store.get_attempt("b", 0).reward is None


def test_a_reward_is_stored_when_its_answer_arrives(upstream, make_proxy, store):
    """The harness may exit the moment it has the answer: by then the store must have the reward (the
    writer lingers 30 s here, so an answer given on queueing alone would find nothing stored)."""
    proxy = make_proxy([upstream.url], write_linger_s=30.0)
    client(proxy.v1).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    resp = httpx.post(f"{proxy.v1}/reward", json={"value": 0.5, "info": {"k": 1}}, timeout=60)
    assert resp.status_code == 200 and resp.json()["stored"] is True
    attempt = store.get_attempt("r-1", 0)
    assert (attempt.reward, attempt.reward_info) == (0.5, {"k": 1})
    assert len(store.read_calls("r-1", 0)) == 1  # the call before it went in first


def test_a_reward_for_a_settled_attempt_gets_409_and_changes_nothing(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url], rollout_id=None)
    base = f"{proxy.url}/rollouts/done/attempts/1/v1"
    assert httpx.post(f"{base}/reward", json={"value": 0.25}).status_code == 200
    store.finish_attempt("done", 1, RolloutState.TIMED_OUT, "Timeout: settled by the scheduler")
    late = httpx.post(f"{base}/reward", json={"value": 1.0, "info": {"late": True}})
    assert late.status_code == 409
    error = late.json()["error"]
    assert error["code"] == "attempt_settled" and error["param"] == "attempt"
    assert "rollout done attempt 1 is already timed_out" in error["message"]
    attempt = store.get_attempt("done", 1)
    assert (attempt.state, attempt.reward, attempt.reward_info) == (RolloutState.TIMED_OUT, 0.25, None)
    assert httpx.get(f"{proxy.url}/healthz").status_code == 200  # a refused reward is not a sick proxy


def test_reward_and_finish_of_a_rollout_that_made_no_call_are_stored(upstream, make_proxy, store, tmp_path):
    """A harness may score and end a rollout whose LLM calls all failed before reaching the proxy."""
    proxy = make_proxy([upstream.url], rollout_id=None)
    base = f"{proxy.url}/rollouts/silent/attempts/3/v1"
    assert httpx.post(f"{base}/reward", json={"value": -1, "info": {"why": "no answer"}}).status_code == 200
    assert (
        httpx.post(f"{base}/rollout/finish", json={"status": "failed", "error": "crashed"}).status_code == 200
    )
    proxy.flush()
    attempt = store.get_attempt("silent", 3)
    assert (attempt.run, attempt.reward, attempt.reward_info) == ("test-run", -1.0, {"why": "no answer"})
    assert attempt.state is RolloutState.FAILED and attempt.reason == "crashed"
    assert store.read_calls("silent", 3) == []
    assert not list(tmp_path.rglob("*.rejected"))  # nothing was set aside


def test_a_restarted_sidecar_continues_its_rollout_after_the_stored_calls(upstream, make_proxy, store):
    """The new process numbers from 0 again; the store keeps the calls in the order they were made."""
    first = make_proxy([upstream.url])
    contents = []
    for i in range(2):
        contents.append(f"before restart {i}")
        client(first.v1).chat.completions.create(
            model="m", messages=[{"role": "user", "content": contents[-1]}], max_tokens=2
        )
    first.flush()
    first.stop()
    second = make_proxy([upstream.url])  # same rollout (the sidecar's env), empty ledger
    for i in range(2):
        contents.append(f"after restart {i}")
        client(second.v1).chat.completions.create(
            model="m", messages=[{"role": "user", "content": contents[-1]}], max_tokens=2
        )
    second.flush()
    calls = store.read_calls("r-1", 0)
    assert [c.seq for c in calls] == [0, 1, 2, 3]
    assert [c.request["messages"][0]["content"] for c in calls] == contents


def test_reward_never_overtakes_the_calls_before_it(upstream, make_proxy, store):
    """A reward posted right after a stream ends is applied after that stream's call is stored."""
    proxy = make_proxy([upstream.url])
    c = client(proxy.v1)
    for i in range(20):
        list(c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, stream=True))
        assert httpx.post(f"{proxy.v1}/reward", json={"value": i}).status_code == 200
    assert (
        httpx.post(f"{proxy.v1}/rollout/finish", json={"status": "failed", "error": "boom"}).status_code
        == 200
    )
    proxy.flush()
    assert [c.seq for c in store.read_calls("r-1", 0)] == list(range(20))
    attempt = store.get_attempt("r-1", 0)
    assert attempt.reward == 19.0 and attempt.state is RolloutState.FAILED and attempt.reason == "boom"


def test_policy_version_is_the_one_current_when_the_call_was_sent(upstream, make_proxy, store):
    upstream.fake.chunk_delay_s = 0.02
    proxy = make_proxy([upstream.url], policy_version=4)
    c = client(proxy.v1)
    c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    stream = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, stream=True)
    first = next(iter(stream))  # the upstream is serving it now
    assert httpx.post(f"{proxy.url}/admin/policy-version", json={"version": 5}).json() == {
        "policy_version": 5
    }
    rest = list(stream)
    assert first and rest
    c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    assert httpx.post(f"{proxy.url}/admin/policy-version", json={"version": -1}).status_code == 400
    proxy.flush()
    assert [call.policy_version for call in store.read_calls("r-1", 0)] == [4, 4, 5]
    assert httpx.get(f"{proxy.url}/admin/state").json()["policy_version"] == 5


def test_upstream_errors_pass_through_and_are_recorded(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url])
    upstream.fake.script.extend([400])
    with pytest.raises(openai.BadRequestError) as err:
        client(proxy.v1).chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    assert err.value.body["message"] == "scripted 400"
    assert upstream.fake.hits == 1  # a 400 is not retried
    proxy.flush()
    call = only_call(store)
    assert call.status is CallStatus.ERROR and call.http_status == 400
    assert call.response["error"]["message"] == "scripted 400"


def test_models_and_health_and_metrics(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url])
    assert [m.id for m in client(proxy.v1).models.list()] == ["fake-model"]
    assert httpx.get(f"{proxy.url}/healthz").json()["status"] == "ok"
    client(proxy.v1).chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
    httpx.post(f"{proxy.v1}/chat/completions", content=b"{", headers={"Content-Type": "application/json"})
    proxy.flush()
    text = httpx.get(f"{proxy.url}/metrics").text
    assert metric_value(text, "harnessrl_proxy_requests_total", route="chat", status="200") == 1
    assert metric_value(text, "harnessrl_proxy_requests_total", route="chat", status="400") == 1
    assert metric_value(text, "harnessrl_proxy_completion_tokens_total") == 3
    assert metric_value(text, "harnessrl_proxy_prompt_tokens_total") == len(encode(render_chat(MESSAGES)))
    assert metric_value(text, "harnessrl_proxy_calls_total", route="chat", status="ok") == 1
    assert metric_value(text, "harnessrl_proxy_write_batch_size_count") >= 1
    assert metric_value(text, "harnessrl_proxy_paused") == 0
    assert metric_value(text, "harnessrl_proxy_queue_depth") == 0
    assert metric_value(text, "harnessrl_proxy_in_flight") == 0
    assert metric_value(text, "harnessrl_proxy_request_seconds_count", route="chat") == 2
    assert metric_value(text, "harnessrl_proxy_upstream_seconds_count", route="chat") == 1


def test_bad_requests_get_clear_openai_shaped_errors(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url], max_body_bytes=4096)
    url = f"{proxy.v1}/chat/completions"
    cases = [
        (
            httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"}),
            400,
            "invalid_json",
        ),
        (
            httpx.post(url, content=b"hello", headers={"Content-Type": "text/plain"}),
            415,
            "unsupported_media_type",
        ),
        (httpx.post(url, json={"model": "m", "messages": "hi"}), 400, None),
        (httpx.post(url, json={"model": "m", "messages": MESSAGES, "stream": "yes"}), 400, None),
        (httpx.post(url, json=[1, 2]), 400, None),
        (httpx.post(url, content=b"", headers={"Content-Type": "application/json"}), 400, None),
        (
            httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": "x" * 8000}]}),
            413,
            "body_too_large",
        ),
        (httpx.get(url), 405, "method_not_allowed"),
        (httpx.post(f"{proxy.url}/v2/anything", json={}), 404, "not_found"),
        (httpx.post(f"{proxy.v1}/completions", json={"model": "m", "prompt": 3}), 400, None),
    ]
    for resp, status, code in cases:
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if code:
            assert error["code"] == code
    assert upstream.fake.hits == 0
    assert httpx.get(f"{proxy.url}/healthz").status_code == 200


def test_pause_reject_answers_503_with_retry_after(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url], pause_retry_after_s=7)
    report = httpx.post(f"{proxy.url}/admin/pause", json={"mode": "reject"}).json()
    assert report["paused"] and report["drained"] and report["in_flight"] == 0
    resp = httpx.post(f"{proxy.v1}/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "7"
    assert resp.json()["error"]["code"] == "paused"
    assert httpx.get(f"{proxy.url}/admin/state").json()["paused"] is True
    assert metric_value(httpx.get(f"{proxy.url}/metrics").text, "harnessrl_proxy_paused") == 1
    httpx.post(f"{proxy.url}/admin/resume")
    client(proxy.v1).chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    assert upstream.fake.hits == 1


def test_pause_wait_drains_in_flight_calls_and_holds_new_ones(upstream, make_proxy, store):
    upstream.fake.chunk_delay_s = 0.03
    proxy = make_proxy([upstream.url])
    c = client(proxy.v1)
    stream = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=30, stream=True)
    next(iter(stream))
    short = httpx.post(f"{proxy.url}/admin/pause", json={"mode": "wait", "timeout_s": 0.01}).json()
    assert short["in_flight_at_pause"] == 1 and short["in_flight"] == 1 and short["drained"] is False

    held: list[str] = []
    waiter = threading.Thread(
        target=lambda: held.append(
            c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1).choices[0].message.content
        )
    )
    waiter.start()
    full = httpx.post(f"{proxy.url}/admin/pause", json={"mode": "wait", "timeout_s": 30}, timeout=40).json()
    list(stream)  # (already finished upstream-side: the drain waited for it)
    assert full["drained"] is True and full["in_flight"] == 0
    state = httpx.get(f"{proxy.url}/admin/state").json()
    assert state["waiting"] == 1 and held == []  # the new call is held, not sent
    hits_while_paused = upstream.fake.hits
    httpx.post(f"{proxy.url}/admin/resume")
    waiter.join(10)
    assert len(held) == 1 and upstream.fake.hits == hits_while_paused + 1
    proxy.flush()
    assert [c.status for c in store.read_calls("r-1", 0)] == [CallStatus.OK, CallStatus.OK]


def test_logprobs_are_bit_exact(upstream, make_proxy, store):
    """Floats the upstream sent survive proxy, JSON and store without rounding."""
    proxy = make_proxy([upstream.url])
    resp = client(proxy.v1).chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, logprobs=True)
    sent = [entry.logprob for entry in resp.choices[0].logprobs.content]
    proxy.flush()
    stored = only_call(store).logprobs
    assert [math.copysign(1, x) for x in stored] == [math.copysign(1, x) for x in sent]
    assert json.dumps(stored) == json.dumps(sent)


def test_calls_are_written_in_batches_without_waiting(upstream, make_proxy, store):
    """Answers never wait for the store, and the writer stores many calls per write: with a 30 s linger, 60
    concurrent calls are all answered while none is stored yet (a call waiting for its write would time out),
    and the flush writes them in one batch (one write per call would count 60)."""
    proxy = make_proxy([upstream.url], rollout_id=None, write_linger_s=30.0)
    n = 60
    answers: list[object] = []

    def call(i: int) -> None:
        base = f"{proxy.url}/rollouts/r{i % 6}/attempts/0/v1"
        try:
            answers.append(client(base).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2))
        except openai.OpenAIError as exc:  # e.g. a timeout: asserted below
            answers.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == n and not [a for a in answers if isinstance(a, Exception)]
    assert all(store.read_calls(f"r{r}", 0) == [] for r in range(6))  # answered, not yet written
    proxy.flush()
    for r in range(6):
        calls = store.read_calls(f"r{r}", 0)
        assert sorted(call.seq for call in calls) == list(range(10))
    batches = metric_value(httpx.get(f"{proxy.url}/metrics").text, "harnessrl_proxy_write_batch_size_count")
    assert batches == 1
