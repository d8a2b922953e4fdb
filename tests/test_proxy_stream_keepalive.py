"""A streamed call the proxy answers whole starts its stream before the answer is there (issue 26, item 6).

Messages and Responses calls (and chat calls a server parser must read) are generated whole and replayed as
their API's events. A harness that streams must not wait for the whole generation to see a byte: after
``stream_keepalive_s`` the proxy sends the 200 and the protocol's keep-alive events (Anthropic ``ping``; for
Responses the answer's ``response.created`` and then ``response.in_progress`` again, events a client's idle
timer counts) until the answer is whole; an error answered after that comes as the protocol's error event. The
fake upstream answers after a delay, as a long generation does.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from aiohttp import web

from harnessrl.proxy.fake_upstream import FakeUpstream, encode, render_chat
from harnessrl.store import CallStatus

pytest.register_assert_rewrite("proxy_servers")
from proxy_servers import RunningUpstream, metric_value

pytest_plugins = ["proxy_servers"]  # fixtures: loops, upstream, make_proxy

KEEPALIVE_S = 0.05
DELAY_S = 0.3  # six keep-alive intervals: a clear margin for at least one


def stream_lines(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url, json=body, timeout=30) as answer:
        assert answer.status_code == 200
        return [line for line in answer.iter_lines() if line]


def test_a_slow_messages_stream_gets_pings_first_and_the_client_reads_it(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url], stream_keepalive_s=KEEPALIVE_S)
    upstream.fake.response_delay_s = DELAY_S
    body = {"model": "m", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    lines = stream_lines(f"{proxy.url}/v1/messages", body)
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[0] == "ping" and events.index("message_start") > 0 and events[-1] == "message_stop"
    client = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    with client.messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as stream:
        message = stream.get_final_message()
    assert message.stop_reason in ("end_turn", "max_tokens") and message.content[0].text
    proxy.flush()
    assert len(store.read_calls("r-1", 0)) == 2


def test_a_slow_responses_stream_starts_with_its_events_and_a_late_error_is_an_event(upstream, make_proxy, store):
    proxy = make_proxy([upstream.url], stream_keepalive_s=KEEPALIVE_S, upstream_retries=2, upstream_backoff_s=0.2)
    upstream.fake.response_delay_s = DELAY_S
    body = {"model": "m", "input": "hi", "max_output_tokens": 4, "stream": True}
    lines = stream_lines(f"{proxy.url}/v1/responses", body)
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    # created once, then in_progress for every keep-alive interval (at least two), then the answer's own events
    assert kinds[0] == "response.created" and kinds.count("response.created") == 1
    assert kinds[1:3] == ["response.in_progress"] * 2 and kinds[-1] == "response.incomplete"  # max_output_tokens
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert {e["response"]["id"] for e in events if "response" in e} == {events[-1]["response"]["id"]}
    assert events[-1]["response"]["output"] and not events[0]["response"]["output"]
    client = openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    sdk_events = list(client.responses.create(**{k: v for k, v in body.items() if k != "stream"}, stream=True))
    assert sdk_events[-1].type == "response.incomplete" and sdk_events[-1].response.output
    # the SDK's stream helper refuses any event before response.created: it reads the whole stream
    with client.responses.stream(**{k: v for k, v in body.items() if k != "stream"}) as stream:
        final = list(stream)[-1].response
    assert final.status == "incomplete" and final.output
    proxy.flush()
    stored = [c.response["id"] for c in store.read_calls("r-1", 0)]
    assert stored == [events[-1]["response"]["id"], sdk_events[-1].response.id, final.id]  # what each stream named
    # an upstream failing for longer than the keep-alive interval: the stream is open, the error is an event
    upstream.fake.script.extend([500, 500, 500])
    lines = stream_lines(f"{proxy.url}/v1/responses", body)
    assert lines[0] == "event: response.created" and lines[-2:] == ["event: error", lines[-1]]
    assert '"scripted 500"' in lines[-1]
    numbers = [json.loads(line.removeprefix("data: "))["sequence_number"] for line in lines
               if line.startswith("data: ")]
    assert numbers == list(range(len(numbers))) and len(numbers) >= 3  # the error numbered on after the beats
    # an error before the first keep-alive keeps its status
    proxy_fast = make_proxy([upstream.url], stream_keepalive_s=30)
    upstream.fake.script.append(400)
    assert httpx.post(f"{proxy_fast.url}/v1/responses", json=body, timeout=30).status_code == 400


class HeldTokenize(FakeUpstream):
    """The fake upstream with a ``/tokenize`` (ChatML, one token per byte, as its chat route renders) that
    answers only once the test sets ``release``: token continuity's planning of a continued call waits on it,
    as it waits on a loaded server rendering Claude Code's ~46k-token prompt."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = threading.Event()  # planning reached the server
        self.release = threading.Event()

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/tokenize", self._tokenize)
        return app

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.asked.set()
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 60)
        text = render_chat(body["messages"])
        if body.get("add_generation_prompt") is False:
            text = text.removesuffix("<|im_start|>assistant\n")
        return web.json_response({"tokens": encode(text), "count": len(encode(text)), "max_model_len": 65536})


@pytest.fixture
def held(loops) -> Iterator[RunningUpstream]:
    running = RunningUpstream(loops, HeldTokenize())
    yield running
    running.fake.release.set()
    running.stop()


def first_event_while_planning(proxy, held: RunningUpstream, rollout: str, fail_with: int | None = None) -> list[str]:
    """A Messages conversation's second call, streamed, with its planning held: the stream's first event must
    come while the planning still waits (asserted), however long it waits. Returns the stream's event kinds."""
    return event_kinds(stream_while_planning(proxy, held, rollout, fail_with))


def event_kinds(lines: list[str]) -> list[str]:
    return [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]


def stream_while_planning(proxy, held: RunningUpstream, rollout: str,
                          fail_with: int | None = None) -> list[str]:
    """``first_event_while_planning``'s stream as its non-empty lines (events and their data)."""
    base = f"{proxy.url}/rollouts/{rollout}/attempts/0/v1/messages"
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    first = httpx.post(base, json=body, timeout=30).json()
    body["messages"] += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "go on"}]
    if fail_with is not None:
        held.fake.script.append(fail_with)
    safety = threading.Timer(30, held.fake.release.set)  # without keep-alives the stream would never begin
    safety.start()
    try:
        with httpx.stream("POST", base, json={**body, "stream": True}, timeout=60) as answer:
            assert answer.status_code == 200
            lines = answer.iter_lines()
            first_line = next(line for line in lines if line)
            assert held.fake.asked.is_set() and not held.fake.release.is_set()  # planning still held
            held.fake.release.set()
            rest = [line for line in lines if line]
    finally:
        safety.cancel()
    return [first_line, *rest]


def test_keepalives_start_while_a_continued_call_is_planned(held, make_proxy, store):
    """Issue 26: a continued streamed call's keep-alive clock started only once the call was planned, and under
    load Claude Code's first byte came up to 5 s past the keep-alive time. The clock now starts when the request
    arrives: the 200 and a ``ping`` go out while the planning waits on the server, then the planned call is
    relayed as generated on the same stream (``streams_total{mode="relayed"}``) and stored as continued."""
    proxy = make_proxy([held.url], stream_keepalive_s=KEEPALIVE_S, token_continuity=True)
    kinds = first_event_while_planning(proxy, held, "planned")
    start = kinds.index("message_start")
    assert start > 0 and set(kinds[:start]) == {"ping"} and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert metric_value(metrics, "harnessrl_proxy_token_continuity_total", outcome="used") == 1
    assert metric_value(metrics, "harnessrl_proxy_streams_total", route="messages", mode="relayed") == 1
    proxy.flush()
    first, second = store.read_calls("planned", 0)
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids


def test_a_continued_call_refused_after_its_keepalives_ends_with_the_error_event(held, make_proxy, store):
    """The planned call's upstream refuses it after the keep-alives opened the stream: the harness gets the
    route's error event on that stream (the 200 is sent), and the call is stored as the error it was."""
    proxy = make_proxy([held.url], stream_keepalive_s=KEEPALIVE_S, token_continuity=True)
    kinds = first_event_while_planning(proxy, held, "refused", fail_with=400)
    assert kinds[0] == "ping" and kinds[-1] == "error" and "message_start" not in kinds
    proxy.flush()
    assert [c.status for c in store.read_calls("refused", 0)] == [CallStatus.OK, CallStatus.ERROR]


def test_a_failure_of_the_proxys_own_while_planning_after_keepalives_ends_with_the_error_event(
        held, make_proxy, store, monkeypatch, caplog):
    """The proxy's own planning fails (a bug, not a refusal) after the keep-alives opened the stream: the
    harness gets the route's error event and the stream ends (without ``_failed_open`` the middleware's 500
    was written into the open stream's body, which the client read as a broken chunk). The failure is logged
    and counted as the middleware counts any other (``refused_total{code="internal_error"}``; no call is
    stored, as for every error the proxy answers itself), and the proxy serves the harness's retry, which
    continues the conversation."""
    proxy = make_proxy([held.url], stream_keepalive_s=KEEPALIVE_S, token_continuity=True)
    continuity = proxy.proxy.continuity
    plan = continuity.plan
    failures: list[object] = []

    async def plan_then_fail(*args: object, **kwargs: object) -> object:
        planned = await plan(*args, **kwargs)  # the real planning, held on the server's /tokenize
        if planned is not None and not failures:  # the continued call, once
            failures.append(planned)
            raise RuntimeError("planner bug")
        return planned

    monkeypatch.setattr(continuity, "plan", plan_then_fail)
    lines = stream_while_planning(proxy, held, "broken")
    kinds = event_kinds(lines)
    assert failures and kinds[0] == "ping" and kinds[-1] == "error" and "message_start" not in kinds
    assert json.loads(lines[-1].removeprefix("data: ")) == {
        "type": "error", "error": {"type": "server_error", "message": "internal proxy error: RuntimeError"}}
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert metric_value(metrics, "harnessrl_proxy_refused_total", route="messages", status="500",
                        code="internal_error") == 1
    assert "refused broken/0 messages 500 internal_error: RuntimeError: planner bug" in caplog.messages
    proxy.flush()
    assert [c.status for c in store.read_calls("broken", 0)] == [CallStatus.OK]
    # the harness retries the call on the same proxy: planned again, relayed, stored as continuing the first
    base = f"{proxy.url}/rollouts/broken/attempts/0/v1/messages"
    first = store.read_calls("broken", 0)[0]
    body = {"model": "m", "max_tokens": 4, "stream": True, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": first.response["content"]},
        {"role": "user", "content": "go on"}]}
    kinds = event_kinds(stream_lines(base, body))
    assert "message_start" in kinds and kinds[-1] == "message_stop" and "error" not in kinds
    proxy.flush()
    first, retry = store.read_calls("broken", 0)
    assert retry.status is CallStatus.OK
    assert retry.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
