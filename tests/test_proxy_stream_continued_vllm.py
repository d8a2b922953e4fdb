"""A streamed, continued Messages or Responses call is relayed while generated (``proxy/served_stream.py``).

Claude Code and Codex CLI always stream. A continued call without tools goes to vLLM's ``/v1/completions``
with its parent's exact tokens; streamed, its text reaches the harness chunk by chunk (one text event per
chunk, the first long before the closing events), and the call is stored exactly as the same call unstreamed:
same prompt and completion token ids, same log-probs, same answer (ids aside). The runs are made comparable by
the proxy's sampling override: a fixed seed, and ``ignore_eos`` so that every answer has ``max_tokens`` tokens.
The real ``anthropic`` and ``openai`` clients read the streams, which proves them valid for the SDKs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import anthropic
import httpx
import openai
import pytest

pytest.register_assert_rewrite("proxy_servers", "vllm_fixtures")
from proxy_servers import metric_value

from harnessrl.store import CallStatus

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, vllm_server (the plain server, shared)

pytestmark = pytest.mark.vllm

SYSTEM = "you are a coding agent"
FIRST = "read file 42"
NEXT = "now fix the error in the test"
TOKENS = 128  # the continued answer's length (ignore_eos)
SAMPLING = {"temperature": 1.0, "seed": 1234, "ignore_eos": True}


@pytest.fixture(scope="module")
def captured(vllm_server, tmp_path_factory: pytest.TempPathFactory):
    from vllm_fixtures import proxy_in_front

    with proxy_in_front(vllm_server, tmp_path_factory.mktemp("proxy-stream"), "test-run", SAMPLING) as pair:
        yield pair


def used(proxy) -> float:
    return metric_value(httpx.get(f"{proxy.url}/metrics").text, "harnessrl_proxy_token_continuity_total",
                        outcome="used") or 0


def streams(proxy, mode: str) -> float:
    return metric_value(httpx.get(f"{proxy.url}/metrics").text, "harnessrl_proxy_streams_total", route="messages",
                        mode=mode) or 0


def continued_calls(store, proxy, rollouts: list[str], tokens: int | None = TOKENS) -> list:
    """The second (continued) call of each rollout, checked complete: ``tokens`` generated with their log-probs
    (None: any number but 0)."""
    proxy.flush(60)
    out = []
    for rollout in rollouts:
        first, second = store.read_calls(rollout, 0)[:2]
        assert first.status is second.status is CallStatus.OK
        assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.completion_token_ids)] == [
            *first.prompt_token_ids, *first.completion_token_ids]  # it continued the first call's tokens
        assert len(second.completion_token_ids) == len(second.logprobs) > 0
        assert tokens is None or len(second.completion_token_ids) == tokens
        out.append(second)
    return out


def without_ids(obj):
    """``obj`` without the answers' ids and creation times (each call has its own)."""
    if isinstance(obj, dict):
        return {k: without_ids(v) for k, v in obj.items() if k not in ("id", "created_at")}
    return [without_ids(v) for v in obj] if isinstance(obj, list) else obj


def assert_same_capture(unary, streamed) -> None:
    assert streamed.prompt_token_ids == unary.prompt_token_ids
    assert streamed.completion_token_ids == unary.completion_token_ids
    assert streamed.logprobs == pytest.approx(unary.logprobs, abs=1e-4)
    assert streamed.finish_reason == unary.finish_reason == "length"
    assert without_ids(streamed.request) == without_ids({**unary.request, "stream": True})
    assert without_ids(streamed.response) == without_ids(unary.response)


@pytest.mark.parametrize("effort", [None, "high"])
def test_continued_messages_stream_while_generated_and_store_what_unstreamed_stores(captured, effort):
    """``effort``: Claude Code sends ``output_config.effort`` on every call, which becomes chat's
    ``reasoning_effort``; it kept every continued answer off the relayed path (its first byte the whole answer).
    On a server without a reasoning parser (this one) the effort changes no token: vLLM's chat route gives it to
    the chat template only (``reasoning_effort``, ``enable_thinking``), and so do the proxy's renderings. So the
    call is relayed while generated, and stores exactly what the unstreamed one stores."""
    store, proxy = captured
    before, relayed, replayed = used(proxy), streams(proxy, "relayed"), streams(proxy, "replayed")
    extra = {} if effort is None else {"output_config": {"effort": effort}}  # as Claude Code sends it
    kwargs = {"model": "m", "system": SYSTEM, "extra_body": extra}
    finals = {}
    for stream in (False, True):
        c = anthropic.Anthropic(base_url=f"{proxy.url}/rollouts/msg-{effort}-{stream}/attempts/0",
                                api_key="unused", max_retries=0, timeout=120)
        messages: list[dict] = [{"role": "user", "content": FIRST}]
        first = c.messages.create(**kwargs, max_tokens=16, messages=messages)
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": NEXT}]
        if not stream:
            finals[stream] = c.messages.create(**kwargs, max_tokens=TOKENS, messages=messages)
            continue
        with c.messages.stream(**kwargs, max_tokens=TOKENS, messages=messages) as events:
            seen = list(events)
            finals[stream] = events.get_final_message()
        kinds = [e.type for e in seen]
        deltas = [i for i, e in enumerate(seen) if e.type == "content_block_delta"]
        # streamed: one text delta per chunk, all before the stop reason and usage (a replay sends one)
        assert len(deltas) > 1 and deltas[-1] < kinds.index("message_delta")
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert seen[0].message.usage.input_tokens > 0
        text = "".join(seen[i].delta.text for i in deltas)
        assert [b.text for b in finals[stream].content] == [text]
        print(f"messages: {len(deltas)} text deltas before message_delta for a {TOKENS}-token answer")
    assert used(proxy) - before == 2
    # the streamed continued call was relayed, not replayed (the first calls are not streamed)
    assert (streams(proxy, "relayed") - relayed, streams(proxy, "replayed") - replayed) == (1, 0)
    unary, streamed = continued_calls(store, proxy, [f"msg-{effort}-False", f"msg-{effort}-True"])
    assert unary.request.get("output_config") == extra.get("output_config")  # as the harness sent
    assert_same_capture(unary, streamed)
    message = finals[True]
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == TOKENS
    assert message.usage.input_tokens == len(streamed.prompt_token_ids)
    assert message.model_dump(exclude={"id"}) == finals[False].model_dump(exclude={"id"})
    assert streamed.response == message.model_dump(exclude_none=True) | {"stop_sequence": None}
    # the next call continues the streamed one (the ledger kept its tokens and reply), streamed in turn
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                 {"role": "user", "content": "thanks"}]
    with c.messages.stream(**kwargs, max_tokens=8, messages=messages) as events:
        assert events.get_final_message().usage.output_tokens == 8
    assert used(proxy) - before == 3
    proxy.flush(60)
    third = store.read_calls(f"msg-{effort}-True", 0)[2]
    assert third.prompt_token_ids[: len(streamed.prompt_token_ids) + TOKENS] == [
        *streamed.prompt_token_ids, *streamed.completion_token_ids]


def test_continued_responses_stream_while_generated_and_store_what_unstreamed_stores(captured):
    store, proxy = captured
    before = used(proxy)
    kwargs = {"model": "m", "instructions": SYSTEM, "include": ["message.output_text.logprobs"]}
    finals = {}
    for stream in (False, True):
        c = openai.OpenAI(base_url=f"{proxy.url}/rollouts/resp-{stream}/attempts/0/v1", api_key="unused",
                          max_retries=0, timeout=120)
        items: list[dict] = [{"role": "user", "content": FIRST}]
        first = c.responses.create(**kwargs, input=items, max_output_tokens=16)
        items += [*(item.model_dump(exclude_none=True) for item in first.output), {"role": "user", "content": NEXT}]
        if not stream:
            finals[stream] = c.responses.create(**kwargs, input=items, max_output_tokens=TOKENS)
            continue
        with c.responses.stream(**kwargs, input=items, max_output_tokens=TOKENS) as events:  # the SDK's helper
            seen = list(events)  # (its get_final_response wants response.completed: this answer is incomplete)
        assert [e.sequence_number for e in seen] == list(range(len(seen)))
        assert [e.type for e in seen[:2]] == ["response.created", "response.in_progress"]
        deltas = [i for i, e in enumerate(seen) if e.type == "response.output_text.delta"]
        assert len(deltas) > 1 and deltas[-1] < len(seen) - 1 and seen[-1].type == "response.incomplete"
        finals[stream] = seen[-1].response
        assert finals[stream].id == seen[0].response.id
        text = "".join(seen[i].delta for i in deltas)
        assert finals[stream].output_text == seen[deltas[-1]].snapshot == text  # the SDK's accumulated text
        delta_logprobs = [lp.logprob for i in deltas for lp in seen[i].logprobs]
        print(f"responses: {len(deltas)} text deltas before the final event for a {TOKENS}-token answer")
    assert used(proxy) - before == 2
    unary, streamed = continued_calls(store, proxy, ["resp-False", "resp-True"])
    assert delta_logprobs == streamed.logprobs  # the harness's own log-probs, chunk by chunk, are the stored ones
    assert_same_capture(unary, streamed)
    response = finals[True]
    assert response.usage.input_tokens == len(streamed.prompt_token_ids)
    assert response.usage.output_tokens == TOKENS
    assert without_ids(response.model_dump()) == without_ids(finals[False].model_dump())


def sse_data(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=120) as answer:
        assert answer.status_code == 200
        return [json.loads(line.removeprefix("data: ")) for line in answer.iter_lines() if line.startswith("data: ")]


def test_a_continued_stream_sends_keepalives_until_its_first_token(vllm_server, tmp_path):
    """The upstream reading the prompt (about 2,000 tokens here) sends nothing: the route's keep-alive events go
    out every ``stream_keepalive_s`` (1 ms: a clear margin under the prompt's reading) until the first token."""
    from vllm_fixtures import proxy_in_front

    long_turn = " ".join(f"line {i} of the failing test output" for i in range(250))
    # no seed: vLLM 0.32 on CPU kills its engine on a seeded request whose prompt is prefilled in chunks
    # ("CPU Generator does not use offset"), which would take the shared server down
    sampling = {"temperature": 1.0, "ignore_eos": True}
    with proxy_in_front(vllm_server, tmp_path, "test-run", sampling, stream_keepalive_s=0.001) as (store, proxy):
        base = f"{proxy.url}/rollouts/keepalive/attempts/0/v1"
        c = anthropic.Anthropic(base_url=f"{proxy.url}/rollouts/keepalive/attempts/0", api_key="unused",
                                max_retries=0, timeout=120)
        messages: list[dict] = [{"role": "user", "content": FIRST}]
        first = c.messages.create(model="m", system=SYSTEM, max_tokens=8, messages=messages)
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": long_turn}]
        before = used(proxy)
        events = sse_data(f"{base}/messages", {"model": "m", "system": SYSTEM, "max_tokens": 8, "stream": True,
                                               "messages": messages})
        kinds = [e["type"] for e in events]
        start = kinds.index("message_start")
        assert start > 0 and set(kinds[:start]) == {"ping"} and "ping" not in kinds[start:]
        assert kinds[-1] == "message_stop" and events[start]["message"]["usage"]["input_tokens"] > 2000

        items: list[dict] = [{"role": "user", "content": FIRST}]
        answer = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120).responses.create(
            model="m", input=items, max_output_tokens=8)
        items += [*(item.model_dump(exclude_none=True) for item in answer.output), {"role": "user", "content": long_turn}]
        events = sse_data(f"{base}/responses", {"model": "m", "input": items, "max_output_tokens": 8, "stream": True})
        kinds = [e["type"] for e in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.in_progress"]
        assert kinds.count("response.created") == 1 and kinds[-1] == "response.incomplete"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert {e["response"]["id"] for e in events if "response" in e} == {events[-1]["response"]["id"]}
        assert used(proxy) - before == 2
        print(f"keep-alives before the first token: {start} pings, {kinds.count('response.in_progress')} in_progress")
        proxy.flush(60)
        calls = store.read_calls("keepalive", 0)
        assert [c.status for c in calls] == [CallStatus.OK] * 4
        assert all(len(c.completion_token_ids) == len(c.logprobs) == 8 for c in calls)


def test_the_retry_of_a_timed_out_chat_call_continues_the_tokens_it_extended(captured):
    """The openai SDK retries a call that timed out: the aborted call has no answer to be continued, so it must
    leave the call it extended to its retry (``LastCall.supersedes``), which then continues that call's exact
    tokens, and the conversation stays one training row (before, the retry's prompt was rendered afresh)."""
    from harnessrl.trainer.rows import merge_calls_into_rows

    store, proxy = captured
    c = openai.OpenAI(base_url=f"{proxy.url}/rollouts/retried/attempts/0/v1", api_key="unused", max_retries=0,
                      timeout=120)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    first = c.chat.completions.create(model="m", messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": NEXT}]
    before = used(proxy)
    with pytest.raises(openai.APITimeoutError):  # ignore_eos: 4,000 tokens take far longer
        c.with_options(timeout=0.5).chat.completions.create(model="m", messages=messages, max_tokens=4000)
    deadline = time.monotonic() + 60
    while not metric_value(httpx.get(f"{proxy.url}/metrics").text, "harnessrl_proxy_calls_total", route="chat",
                           status="aborted"):  # captured, so remembered before the retry is planned
        assert time.monotonic() < deadline, "the timed-out call was not captured as aborted"
        time.sleep(0.1)
    c.chat.completions.create(model="m", messages=messages, max_tokens=8)
    assert used(proxy) - before == 2  # the aborted call and its retry both continued the first call
    proxy.flush(60)
    calls = store.read_calls("retried", 0)
    assert [call.status for call in calls] == [CallStatus.OK, CallStatus.ABORTED, CallStatus.OK]
    context = [*calls[0].prompt_token_ids, *calls[0].completion_token_ids]
    assert calls[2].prompt_token_ids[: len(context)] == context
    (row,) = merge_calls_into_rows(store.rollout_calls("retried", 0)).rows
    assert row.call_ids == (calls[0].call_id, calls[2].call_id)


def _turn(route: str, conversation: list[dict], answer: dict) -> list[dict]:
    """``conversation`` + the answer as the harness sends it back (``route``'s shape)."""
    if route == "chat":
        return [*conversation, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}]
    if route == "messages":
        return [*conversation, {"role": "assistant", "content": answer["content"]}]
    return [*conversation, *answer["output"]]


def _sender(proxy, rollout: str, route: str) -> tuple[Callable[[list[dict]], dict], list[dict]]:
    """A function sending a conversation on ``route`` (8 tokens, answered 200) and the first turn's head (the
    system message where the route takes it in the conversation)."""
    base = f"{proxy.url}/rollouts/{rollout}/attempts/0/v1"
    path, system, size = {"chat": ("/chat/completions", {}, "max_tokens"),
                          "messages": ("/messages", {"system": SYSTEM}, "max_tokens"),
                          "responses": ("/responses", {"instructions": SYSTEM}, "max_output_tokens")}[route]
    key = "input" if route == "responses" else "messages"

    def send(conversation: list[dict]) -> dict:
        answer = httpx.post(base + path, json={"model": "m", **system, size: 8, key: conversation}, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()

    return send, [{"role": "system", "content": SYSTEM}] if route == "chat" else []


def _answered(store, proxy, rollout: str, n: int) -> list:
    """The rollout's stored calls, checked to be ``n``, all OK."""
    proxy.flush(60)
    calls = store.read_calls(rollout, 0)
    assert [c.status for c in calls] == [CallStatus.OK] * n
    return calls


@pytest.mark.parametrize("route", ["chat", "messages", "responses"])
def test_a_call_sent_again_after_its_answer_continues_what_the_answered_one_continued(captured, route):
    """A harness sends again a call it already got a 200 for (an SDK that timed out after the answer came, a
    CLI re-sending it): the answered call superseded its parent among the attempt's recent calls, so the
    repeat must continue that parent as the answered call did (``LastCall.continued``): the same prompt tokens,
    which the row builder takes for a retry, and the conversation stays one row. Before, the repeat extended no
    recent call, was rendered afresh (counted ``not_an_extension``) and split the rollout into two rows."""
    from harnessrl.trainer.rows import merge_calls_into_rows

    store, proxy = captured
    rollout = f"resent-{route}"
    send, first_turn = _sender(proxy, rollout, route)
    conversation = [*first_turn, {"role": "user", "content": FIRST}]
    conversation = [*_turn(route, conversation, send(conversation)), {"role": "user", "content": NEXT}]
    before = used(proxy)
    send(conversation)  # answered; the harness sends it again
    conversation = [*_turn(route, conversation, send(conversation)), {"role": "user", "content": "thanks"}]
    send(conversation)
    assert used(proxy) - before == 3  # the answered call, its repeat and the next one were all continued
    first, answered, repeat, nxt = calls = _answered(store, proxy, rollout, 4)
    assert repeat.prompt_token_ids == answered.prompt_token_ids  # the same continuation, token for token
    assert answered.prompt_token_ids[: len(first.prompt_token_ids) + 8] == [*first.prompt_token_ids,
                                                                           *first.completion_token_ids]
    assert nxt.prompt_token_ids[: len(repeat.prompt_token_ids) + 8] == [*repeat.prompt_token_ids,
                                                                       *repeat.completion_token_ids]
    merged = merge_calls_into_rows(store.rollout_calls(rollout, 0))
    (row,) = merged.rows  # the repeat is a retry of the answered call (a duplicate), not a new conversation
    assert row.call_ids == (first.call_id, repeat.call_id, nxt.call_id)


def test_a_call_sent_again_after_a_later_turn_continues_what_it_continued(captured):
    """A harness sends call k again after call k+1 (which continued k) was answered: a retry that raced the
    next turn, a sub-agent re-sent. k+1 superseded k, which had superseded k-1; the resend must continue k-1 as
    k did (``ContinuedFrom.up``): k's prompt tokens, exactly. Before, the resend extended no recent call and was rendered afresh
    (``not_an_extension``: 2 of 3 continued)."""
    from harnessrl.trainer.rows import merge_calls_into_rows

    store, proxy = captured
    rollout = "resent-older"
    send, first_turn = _sender(proxy, rollout, "chat")
    conversation = [*first_turn, {"role": "user", "content": FIRST}]
    conversation = [*_turn("chat", conversation, send(conversation)), {"role": "user", "content": NEXT}]
    before = used(proxy)
    second = conversation
    conversation = [*_turn("chat", second, send(second)), {"role": "user", "content": "thanks"}]
    send(conversation)
    send(second)  # the second call again, after the third was answered
    assert used(proxy) - before == 3  # the second call, the third and the resend were all continued
    first, answered, third, resend = _answered(store, proxy, rollout, 4)
    assert resend.prompt_token_ids == answered.prompt_token_ids  # the same continuation, token for token
    assert third.prompt_token_ids[: len(answered.prompt_token_ids) + 8] == [*answered.prompt_token_ids,
                                                                           *answered.completion_token_ids]
    # The row builder takes a repeat of a row's last kept call for a retry, not one of an earlier call: this
    # resend still starts a row of its own, (first, answered, third) and (resend,), the same tokens as before.
    rows = merge_calls_into_rows(store.rollout_calls(rollout, 0)).rows
    assert [r.call_ids for r in rows][0] == (first.call_id, answered.call_id, third.call_id)
