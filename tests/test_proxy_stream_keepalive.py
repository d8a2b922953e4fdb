"""A streamed call the proxy answers whole starts its stream before the answer is there (issue 26, item 6).

Messages and Responses calls (and chat calls a server parser must read) are generated whole and replayed as
their API's events. A harness that streams must not wait for the whole generation to see a byte: after
``stream_keepalive_s`` the proxy sends the 200 and the protocol's keep-alive events (Anthropic ``ping``; for
Responses the answer's ``response.created`` and then ``response.in_progress`` again, events a client's idle
timer counts) until the answer is whole; an error answered after that comes as the protocol's error event. The
fake upstream answers after a delay, as a long generation does.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

pytest.register_assert_rewrite("proxy_servers")

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
