"""The proxy's pure parts: wire-shape rules, stream assembly, spool, writer, ledger, config, pinning."""

from __future__ import annotations

import copy
import json
import math
import os
import time
from pathlib import Path

import pytest

from harnessrl.proxy.capture import ANCESTORS, Attribution, LastCall, RolloutLedger, build_call_record
from harnessrl.proxy.config import ConfigError, load_config
from harnessrl.proxy.continuity import choose_parent
from harnessrl.proxy.metrics import ProxyMetrics
from harnessrl.proxy.protocol import (
    ClientWants,
    RequestError,
    StreamAssembler,
    Tokens,
    client_wants,
    parse_sse_event,
    same_message,
    strip_unrequested,
    tokens_from_response,
    upstream_request,
    validate_request,
)
from harnessrl.proxy.spool import Spool
from harnessrl.proxy.upstreams import UpstreamPool
from harnessrl.proxy.writer import (
    CallItem,
    FinishItem,
    RewardItem,
    TraceWriter,
    UpstreamFailedItem,
    item_bytes,
    item_from_json,
    item_to_json,
    record_from_json,
    record_to_json,
)
from harnessrl.store import (
    CallRecord,
    CallStatus,
    NotFound,
    PreparedCall,
    RolloutState,
    TraceStore,
    prepare_call,
)

pytest.register_assert_rewrite("proxy_servers")
from proxy_servers import metric_value

WHO = Attribution("run", "r", 0)


def record(
    seq: int = 0,
    prompt: list[int] | None = None,
    completion: list[int] | None = None,
    logprobs: list[float] | None = None,
    rollout: str = "r",
):
    completion = [5, 6] if completion is None else completion
    return build_call_record(
        who=Attribution("run", rollout, 0),
        seq=seq,
        route="chat",
        request={"messages": [{"role": "user", "content": f"m{seq}"}]},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]},
        tokens=Tokens(prompt or [1, 2, 3], completion, logprobs or [-0.5] * len(completion), "stop"),
        policy_version=1,
        upstream="http://u",
        latency_s=0.01,
        status=CallStatus.OK,
        http_status=200,
    )


# ------------------------------------------------------------------------------------------- protocol


def test_train_mode_adds_token_ids_and_logprobs_and_enforces_the_run():
    chat = upstream_request(
        "chat",
        {"model": "x", "messages": [], "temperature": 0.1},
        train=True,
        model="served",
        sampling={"temperature": 1.0, "top_p": 1.0},
    )
    assert chat == {
        "model": "served",
        "messages": [],
        "temperature": 1.0,
        "top_p": 1.0,
        "return_token_ids": True,
        "logprobs": True,
    }
    assert (
        upstream_request("completions", {"prompt": "a"}, train=True, model=None, sampling={})["logprobs"] == 1
    )
    assert (
        upstream_request("completions", {"prompt": "a", "logprobs": 4}, train=True, model=None, sampling={})[
            "logprobs"
        ]
        == 4
    )
    assert (
        upstream_request("completions", {"prompt": "a", "logprobs": 0}, train=True, model=None, sampling={})[
            "logprobs"
        ]
        == 1
    )
    observed = upstream_request(
        "chat", {"model": "x", "messages": []}, train=False, model=None, sampling={"temperature": 1.0}
    )
    assert observed == {"model": "x", "messages": []}


def test_client_wants_reflects_only_what_the_harness_asked():
    assert client_wants("chat", {"logprobs": True}) == ClientWants(token_ids=False, logprobs=True)
    assert client_wants("chat", {"logprobs": False, "return_token_ids": True}) == ClientWants(True, False)
    assert client_wants("completions", {"logprobs": 0}) == ClientWants(False, True)
    assert client_wants("completions", {}) == ClientWants(False, False)


def test_strip_unrequested_copies_and_removes_only_unrequested_fields():
    body = {
        "prompt_token_ids": [1],
        "choices": [
            {"index": 0, "token_ids": [2], "logprobs": {"content": []}, "message": {"content": "hi"}}
        ],
    }
    before = copy.deepcopy(body)
    out = strip_unrequested(body, ClientWants(token_ids=False, logprobs=False))
    assert body == before  # untouched: the capture still needs it
    assert out == {"choices": [{"index": 0, "logprobs": None, "message": {"content": "hi"}}]}
    assert strip_unrequested(body, ClientWants(True, True)) is body
    kept = strip_unrequested(body, ClientWants(token_ids=True, logprobs=False))
    assert kept["prompt_token_ids"] == [1] and kept["choices"][0]["token_ids"] == [2]


def test_tokens_from_completions_with_echo_take_the_last_logprobs():
    body = {
        "choices": [
            {
                "index": 0,
                "prompt_token_ids": [7, 8],
                "token_ids": [9, 10],
                "logprobs": {"token_logprobs": [None, -1.0, -2.0, -3.0]},
                "finish_reason": "length",
            }
        ]
    }
    assert tokens_from_response("completions", body) == Tokens([7, 8], [9, 10], [-2.0, -3.0], "length")
    chat = {
        "prompt_token_ids": [1],
        "choices": [{"index": 0, "token_ids": [4], "logprobs": {"content": [{"logprob": -0.25}]}}],
    }
    assert tokens_from_response("chat", chat) == Tokens([1], [4], [-0.25], None)


def test_validate_request_names_the_bad_field():
    with pytest.raises(RequestError) as err:
        validate_request("chat", {"messages": [{"role": "user"}], "logprobs": 1})
    assert err.value.param == "logprobs"
    with pytest.raises(RequestError, match="messages\\[1\\]"):
        validate_request("chat", {"messages": [{"role": "user"}, "hi"]})
    with pytest.raises(RequestError, match="'n' must be an integer"):
        validate_request("completions", {"prompt": "x", "n": True})


def test_sse_events_parse_data_done_and_opaque_lines():
    assert parse_sse_event(b"data: [DONE]\n\n").done
    assert parse_sse_event(b'data: {"a": 1}\n\n').data == {"a": 1}
    assert parse_sse_event(b'data:{"a":2}\r\n\r\n').data == {"a": 2}
    opaque = parse_sse_event(b": keep-alive\n\n")
    assert opaque.data is None and not opaque.done
    assert parse_sse_event(b"data: {broken\n\n").data is None


def test_stream_assembler_rebuilds_tool_calls_and_several_choices():
    asm = StreamAssembler("chat")
    chunks = [
        {
            "id": "c1",
            "created": 1,
            "model": "m",
            "prompt_token_ids": [1, 2],
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}},
                {"index": 1, "delta": {"role": "assistant", "content": ""}},
            ],
        },
        {
            "id": "c1",
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "ls", "arguments": '{"pa'},
                            }
                        ]
                    },
                    "token_ids": [11],
                    "logprobs": {"content": [{"token": "a", "logprob": -0.1}]},
                }
            ],
        },
        {
            "id": "c1",
            "choices": [
                {
                    "index": 1,
                    "delta": {"content": "other"},
                    "token_ids": [21],
                    "logprobs": {"content": [{"token": "o", "logprob": -0.9}]},
                }
            ],
        },
        {
            "id": "c1",
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'th": "."}'}}]},
                    "token_ids": [12],
                    "logprobs": {"content": [{"token": "b", "logprob": -0.2}]},
                    "finish_reason": "tool_calls",
                }
            ],
        },
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}},
    ]
    for chunk in chunks:
        asm.feed(chunk)
    assert asm.tokens() == Tokens([1, 2], [11, 12], [-0.1, -0.2], "tool_calls")
    out = asm.response()
    msg = out["choices"][0]["message"]
    assert msg["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}
    ]
    assert out["choices"][1]["message"]["content"] == "other" and out["choices"][1]["token_ids"] == [21]
    assert out["usage"]["completion_tokens"] == 3 and out["prompt_token_ids"] == [1, 2]


def test_same_message_ignores_server_defaults():
    reply = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": [], "reasoning": None}
    assert same_message({"role": "assistant", "content": "hi"}, reply)
    assert not same_message({"role": "assistant", "content": "hi!"}, reply)
    assert not same_message({"role": "user", "content": "hi"}, reply)


# -------------------------------------------------------------------------------------- capture, ledger


def test_ledger_numbers_calls_and_bounds_last_calls_by_tokens():
    ledger = RolloutLedger(max_rollouts=10, max_tokens=20)
    a, b = ("a", 0), ("b", 0)
    assert [ledger.next_seq(a) for _ in range(3)] == [0, 1, 2] and ledger.next_seq(b) == 0
    ledger.remember(a, record(0, prompt=[1] * 8, completion=[2]))
    ledger.remember(b, record(0, prompt=[1] * 8, completion=[2], rollout="b"))
    assert ledger.held_tokens == 20
    second = record(1, prompt=[1] * 9, completion=[2])
    ledger.remember(a, second)
    last = ledger.last_call(a)
    assert last is not None and last.call_id == second.call_id and list(last.prompt_token_ids) == [1] * 9
    assert last.messages == second.request["messages"] and last.reply == {"role": "assistant", "content": "x"}
    assert ledger.last_call(b) is None  # evicted to stay within the token budget
    ledger.forget(a)
    assert ledger.last_call(a) is None and ledger.held_tokens == 0
    assert ledger.next_seq(a) == 3  # the counter survives: late calls never reuse a number


def test_a_call_packed_once_is_remembered_and_prepared_as_packed_apart():
    """The proxy packs a call's token ids once, for its ledger and the store (``CallItem.packed``): what either
    keeps equals packing them on its own, and ids that are no int32 still reach the store unpacked, so it
    refuses them naming the field."""
    call = record(4, prompt=[0, 7, 2**31 - 1, -(2**31)], completion=[151643, 3])
    item = CallItem(call)
    assert item.packed is not None
    assert LastCall.of(call, packed=item.packed) == LastCall.of(call)
    item.prepare()
    alone = prepare_call(call)
    assert item.packed is None and isinstance(item.call, PreparedCall)
    assert (item.call.prompt_bytes, item.call.completion_bytes, item.call.anchor) == (
        alone.prompt_bytes, alone.completion_bytes, alone.anchor)  # fmt: skip
    bad = CallItem(record(5, prompt=[1, 2**31]))
    assert bad.packed is None
    bad.prepare()
    assert bad.call is not None and not isinstance(bad.call, PreparedCall)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        prepare_call(bad.record)


def chat_record(seq: int, messages: list[dict], reply: str, rollout: str = "r", prompt: list[int] | None = None,
                completion: list[int] | None = None):
    prompt, completion = prompt or [1, 2, 3], completion or [5, 6]
    return build_call_record(
        who=Attribution("run", rollout, 0), seq=seq, route="chat", request={"messages": messages},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]},
        tokens=Tokens(prompt, completion, [-0.5] * len(completion), "stop"), policy_version=1, upstream="http://u",
        latency_s=0.01, status=CallStatus.OK, http_status=200,
    )  # fmt: skip


def test_parent_is_the_recent_call_the_messages_extend_longest_and_extended_calls_are_superseded():
    """An agent (a) and its sub-agent (b) interleaved in one attempt: each call's parent is its own
    conversation's last call; a call supersedes the one it extends, so the ledger holds one call per
    conversation, and at most ``per_attempt`` in all."""
    ledger = RolloutLedger(max_rollouts=10, max_tokens=10_000, per_attempt=3)
    key = ("r", 0)
    a = [{"role": "system", "content": "agent"}, {"role": "user", "content": "task"}]
    b = [{"role": "system", "content": "sub-agent"}, {"role": "user", "content": "search"}]
    a1, b1 = chat_record(0, a, "A1"), chat_record(1, b, "B1")
    ledger.remember(key, a1)
    ledger.remember(key, b1)
    a2_messages = [*a, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "obs"}]
    b2_messages = [*b, {"role": "assistant", "content": "B1", "refusal": None}, {"role": "tool", "content": "o"}]
    recent = ledger.recent_calls(key)
    assert [c.call_id for c in recent] == [b1.call_id, a1.call_id]  # newest first
    assert choose_parent(recent, a2_messages).call_id == a1.call_id
    assert choose_parent(recent, b2_messages).call_id == b1.call_id
    assert choose_parent(recent, [*a, {"role": "assistant", "content": "edited"}, a2_messages[-1]]) is None
    assert choose_parent(recent, [*a, {"role": "assistant", "content": "A1"}]) is None  # nothing new after it
    a2 = chat_record(2, a2_messages, "A2")
    ledger.remember(key, a2)
    assert [c.call_id for c in ledger.recent_calls(key)] == [a2.call_id, b1.call_id]  # a1 superseded
    a3_messages = [*a2_messages, {"role": "assistant", "content": "A2"}, {"role": "user", "content": "more"}]
    assert choose_parent(ledger.recent_calls(key), a3_messages).call_id == a2.call_id
    # the longest wins: a call extending both a conversation's first and its second call continues the second
    ledger.remember(key, chat_record(3, a, "A1"))  # a retry of a1: nothing it extends, kept beside
    assert choose_parent(ledger.recent_calls(key), a3_messages).call_id == a2.call_id
    ledger.remember(key, chat_record(4, [{"role": "user", "content": "third"}], "C"))
    assert len(ledger.recent_calls(key)) == 3  # the oldest (b1) went
    assert b1.call_id not in {c.call_id for c in ledger.recent_calls(key)}


def test_a_call_that_got_no_answer_leaves_its_parent_for_the_retry():
    """A chat call that errored or was aborted (the harness timed out, the SDK retries) extends its parent but
    can never be extended itself (it has no reply): its retry, the same messages, must still continue the
    parent's tokens, so it supersedes nothing, nor takes a conversation's place among the recent calls; the
    answered retry then supersedes the parent."""
    ledger = RolloutLedger(max_rollouts=10, max_tokens=10_000)
    key = ("r", 0)
    a = [{"role": "system", "content": "agent"}, {"role": "user", "content": "task"}]
    parent = chat_record(0, a, "A1")
    ledger.remember(key, parent)
    messages = [*a, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "obs"}]
    for seq, status in enumerate((CallStatus.ABORTED, CallStatus.ERROR), start=1):
        failed = chat_record(seq, messages, "A2")
        failed.status, failed.response = status, None
        ledger.remember(key, failed)
        assert [c.call_id for c in ledger.recent_calls(key)] == [parent.call_id]
        assert choose_parent(ledger.recent_calls(key), messages).call_id == parent.call_id
    retry = chat_record(3, messages, "A2")
    ledger.remember(key, retry)
    assert [c.call_id for c in ledger.recent_calls(key)] == [retry.call_id]


def continued_once(
    ledger: RolloutLedger, key: tuple[str, int]
) -> tuple[list[dict], CallRecord, list[dict], CallRecord]:
    """A first chat call and a second one continued from it, remembered: (first messages, first record,
    second messages, second record)."""
    a = [{"role": "system", "content": "agent"}, {"role": "user", "content": "task"}]
    first = chat_record(0, a, "A1", prompt=[1, 2, 3], completion=[5, 6])
    ledger.remember(key, first)
    messages = [*a, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "obs"}]
    # continued: first's prompt + completion + glue (4) + the tail; rendered: first's rendering + the rest
    answered = chat_record(1, messages, "A2", prompt=[1, 2, 3, 5, 6, 4, 9, 7], completion=[8, 8])
    ledger.remember(key, answered, rendered_prompt=[1, 2, 3, 0, 4, 9, 7], parent=first.call_id)
    return a, first, messages, answered


def test_a_retry_of_an_answered_call_continues_the_call_that_one_continued():
    """A harness sends again a call it already got an answer for (its SDK timed out after the answer came, or
    it retries): the same messages extend no recent call, since the answered call superseded the call it was
    continued from; the retry must continue that call, as the answered one did (same prompt tokens, so the
    row builder takes it for a retry), rebuilt from the answered call's tokens, rendering and messages."""
    ledger = RolloutLedger(max_rollouts=10, max_tokens=10_000)
    key = ("r", 0)
    a, first, messages, answered = continued_once(ledger, key)
    assert [c.call_id for c in ledger.recent_calls(key)] == [answered.call_id]  # first superseded
    held = ledger.held_tokens
    parent = choose_parent(ledger.recent_calls(key), messages)  # the retry: the same messages again
    assert parent is not None and parent.call_id == first.call_id and parent.status is CallStatus.OK
    assert list(parent.prompt_token_ids) == [1, 2, 3] and list(parent.completion_token_ids) == [5, 6]
    assert list(parent.rendered_prompt) == [1, 2, 3] and parent.messages == a
    assert parent.reply == {"role": "assistant", "content": "A1"}
    assert ledger.held_tokens == held  # kept as lengths: no tokens of its own
    # the next turn continues the answered call itself
    after = [*messages, {"role": "assistant", "content": "A2"}, {"role": "user", "content": "more"}]
    assert choose_parent(ledger.recent_calls(key), after).call_id == answered.call_id
    # the answered retry, sent on the same parent, keeps it too: a second retry still finds it
    retry = chat_record(2, messages, "A2'", prompt=[1, 2, 3, 5, 6, 4, 9, 7], completion=[3])
    ledger.remember(key, retry, rendered_prompt=[1, 2, 3, 0, 4, 9, 7], parent=first.call_id)
    assert [c.call_id for c in ledger.recent_calls(key)] == [retry.call_id, answered.call_id]
    assert choose_parent(ledger.recent_calls(key), messages).call_id == first.call_id
    assert choose_parent(ledger.recent_calls(key), [*messages, {"role": "assistant", "content": "A2'"},
                                                    {"role": "user", "content": "more"}]).call_id == retry.call_id
    # a call not sent with token continuity (no rendering of its own) keeps no parent
    plain = RolloutLedger(max_rollouts=10, max_tokens=10_000)
    plain.remember(key, first)
    plain.remember(key, chat_record(1, messages, "A2"), parent=first.call_id)
    assert choose_parent(plain.recent_calls(key), messages) is None


def test_a_resend_of_an_older_call_after_a_later_turn_continues_that_call_s_parent():
    """A harness re-sends call k after call k+1 (which continued k) was answered (a retry that raced the next
    turn, a sub-agent re-sent): k+1 superseded k, and k had superseded k-1, so only k+1 is recent. The resend
    must still continue k-1, as k did, with k's prompt tokens, so the row builder drops it as k's duplicate.
    Before, k+1 remembered only k (its own parent): the resend extended nothing and was rendered afresh."""
    ledger = RolloutLedger(max_rollouts=10, max_tokens=10_000)
    key = ("r", 0)
    a, first, m1, second = continued_once(ledger, key)
    m2 = [*m1, {"role": "assistant", "content": "A2"}, {"role": "user", "content": "more"}]
    third = chat_record(2, m2, "A3", prompt=[1, 2, 3, 5, 6, 4, 9, 7, 8, 8, 4, 11], completion=[12])
    ledger.remember(key, third, rendered_prompt=[1, 2, 3, 0, 4, 9, 7, 0, 4, 11], parent=second.call_id)
    assert [c.call_id for c in ledger.recent_calls(key)] == [third.call_id]
    held = ledger.held_tokens
    parent = choose_parent(ledger.recent_calls(key), m1)  # the second call sent again, after the third's answer
    assert parent is not None and parent.call_id == first.call_id
    assert list(parent.prompt_token_ids) == [1, 2, 3] and list(parent.completion_token_ids) == [5, 6]
    assert list(parent.rendered_prompt) == [1, 2, 3] and parent.messages == a
    assert parent.reply == {"role": "assistant", "content": "A1"}
    assert ledger.held_tokens == held
    # the resend, answered on that parent, is remembered with it; the third call's turn stays continuable
    resend = chat_record(3, m1, "A2'", prompt=[1, 2, 3, 5, 6, 4, 9, 7], completion=[3])
    ledger.remember(key, resend, rendered_prompt=[1, 2, 3, 0, 4, 9, 7], parent=first.call_id)
    assert choose_parent(ledger.recent_calls(key), m1).call_id == first.call_id
    after = [*m2, {"role": "assistant", "content": "A3"}, {"role": "user", "content": "go"}]
    assert choose_parent(ledger.recent_calls(key), after).call_id == third.call_id
    # the chain is bounded: a call remembers at most ANCESTORS calls above it
    calls, messages, prompt, rendered = [first], a, [1, 2, 3], [1, 2, 3]
    deep = RolloutLedger(max_rollouts=10, max_tokens=10_000)
    deep.remember(key, first)
    for seq in range(1, ANCESTORS + 3):
        messages = [*messages, {"role": "assistant", "content": f"A{seq}"}, {"role": "user", "content": "o"}]
        prompt, rendered = [*prompt, 5, 6, 4, 9], [*rendered, 0, 4, 9]
        call = chat_record(seq, messages, f"A{seq + 1}", prompt=prompt, completion=[5, 6])
        deep.remember(key, call, rendered_prompt=rendered, parent=calls[-1].call_id)
        calls.append(call)
    (last,) = deep.recent_calls(key)
    assert last.continued is not None and len(list(last.continued.chain())) == ANCESTORS


def test_ledger_bounds_rollout_counters():
    ledger = RolloutLedger(max_rollouts=2, max_tokens=100)
    for name in "abc":
        ledger.next_seq((name, 0))
    assert len(ledger) == 2


def test_records_round_trip_through_spool_json_bit_exactly():
    rec = record(logprobs=[-0.1, math.nan], completion=[1, 2])
    rec.logprobs[0] = -1.2345678901234567e-07
    back = record_from_json(json.loads(json.dumps(record_to_json(rec))))
    assert back.logprobs[0] == rec.logprobs[0] and math.isnan(back.logprobs[1])
    assert back.created_at == rec.created_at and back.status is CallStatus.OK
    assert (back.call_id, back.request, back.prompt_token_ids) == (
        rec.call_id,
        rec.request,
        rec.prompt_token_ids,
    )
    for item in (RewardItem("r", 1, 0.5, {"a": 1}), FinishItem("r", 0, RolloutState.FAILED, "boom"),
                 UpstreamFailedItem("r", 2, "run")):
        assert item_from_json(json.loads(json.dumps(item_to_json(item)))) == item


# ------------------------------------------------------------------------------------------------ spool


def test_spool_appends_replays_in_order_and_truncates(tmp_path: Path):
    spool = Spool(tmp_path / "s.jsonl")
    spool.append([{"n": 1}, {"n": 2}])
    spool.append([{"n": 3}])
    assert spool.pending == 3
    first = spool.peek(2)
    assert [e["n"] for e, _ in first] == [1, 2]
    spool.consume([raw for _, raw in first[:1]])
    assert [e["n"] for e, _ in spool.peek(10)] == [2, 3]
    spool.consume([raw for _, raw in spool.peek(10)])
    assert spool.pending == 0 and (tmp_path / "s.jsonl").stat().st_size == 0
    spool.close()


def test_spool_cuts_a_torn_line_and_counts_what_survived(tmp_path: Path):
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"n":1}\n{"n":2}\n{"n":3, "trunc')
    spool = Spool(path)
    assert spool.pending == 2 and [e["n"] for e, _ in spool.peek(10)] == [1, 2]
    spool.append([{"n": 4}])
    assert [e["n"] for e, _ in spool.peek(10)] == [1, 2, 4]
    spool.close()


# ----------------------------------------------------------------------------------------------- writer


@pytest.fixture
def sqlite_store(tmp_path: Path):
    store = TraceStore.connect(f"sqlite:///{tmp_path / 'w.db'}")
    store.upgrade()
    yield store
    store.close()


def test_writer_keeps_order_and_sets_rejected_items_aside(sqlite_store: TraceStore, tmp_path: Path):
    writer = TraceWriter(sqlite_store, Spool(tmp_path / "s.jsonl"), ProxyMetrics(), batch_size=4)
    writer.start()
    for seq in range(6):
        writer.put(CallItem(record(seq)))
    writer.put(RewardItem("no-such-rollout", 0, 1.0))  # the store refuses it for good
    writer.put(RewardItem("r", 0, 0.75))
    writer.put(FinishItem("r", 0, RolloutState.SUCCEEDED))
    assert writer.flush(30)
    assert writer.close(5)
    assert [c.seq for c in sqlite_store.read_calls("r", 0)] == list(range(6))
    attempt = sqlite_store.get_attempt("r", 0)
    assert attempt.reward == 0.75 and attempt.state is RolloutState.SUCCEEDED
    [rejected] = [json.loads(line) for line in (tmp_path / "s.jsonl.rejected").read_text().splitlines()]
    assert rejected["item"]["rollout_id"] == "no-such-rollout" and "does not exist" in rejected["error"]


def test_writer_replays_a_spool_left_by_an_earlier_process(sqlite_store: TraceStore, tmp_path: Path):
    calls = [record(seq) for seq in range(3)]
    spool = Spool(tmp_path / "s.jsonl")
    spool.append([item_to_json(CallItem(c)) for c in calls] + [item_to_json(RewardItem("r", 0, 2.0))])
    spool.append([item_to_json(CallItem(calls[1]))])  # a duplicate replay is harmless
    spool.append([item_to_json(UpstreamFailedItem("r", 0))])  # the mark outlives a store outage as calls do
    spool.close()
    writer = TraceWriter(sqlite_store, Spool(tmp_path / "s.jsonl"), ProxyMetrics())
    writer.start()
    writer.put(CallItem(record(3)))  # queued behind the spool, so order holds
    assert writer.flush(30)
    writer.close(5)
    assert [c.call_id for c in sqlite_store.read_calls("r", 0)] == [c.call_id for c in calls] + [
        sqlite_store.read_calls("r", 0)[3].call_id
    ]
    assert sqlite_store.get_attempt("r", 0).reward == 2.0
    assert sqlite_store.get_attempt("r", 0).upstream_failed


def test_an_upstream_failure_mark_is_written_at_once(sqlite_store: TraceStore, tmp_path: Path):
    """The harness exits right after its 502, so the mark (and the call before it) must not linger for a batch:
    with a 60 s linger, both are in the store long before it ends."""
    writer = TraceWriter(sqlite_store, Spool(tmp_path / "s.jsonl"), ProxyMetrics(), linger_s=60.0)
    writer.start()
    try:
        writer.put(CallItem(record(0)))
        writer.put(UpstreamFailedItem("r", 0, "run"))
        deadline = time.monotonic() + 30
        while not _flagged(sqlite_store) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _flagged(sqlite_store) and len(sqlite_store.read_calls("r", 0)) == 1
    finally:
        writer.close(5)


def _flagged(store: TraceStore) -> bool:
    try:
        return store.get_attempt("r", 0).upstream_failed
    except NotFound:
        return False


def test_the_queue_is_bounded_by_bytes_as_well_as_by_count(sqlite_store: TraceStore, tmp_path: Path):
    """Three big calls fill a byte bound far below the count bound; the writer draining them makes room."""
    big = [record(seq, prompt=list(range(1, 2001))) for seq in range(3)]
    one = item_bytes(CallItem(big[0]))
    writer = TraceWriter(sqlite_store, Spool(tmp_path / "s.jsonl"), ProxyMetrics(), queue_size=1000,
                         queue_max_bytes=3 * one)
    for call in big[:2]:
        writer.put(CallItem(call))
        assert writer.has_room()
    writer.put(CallItem(big[2]))
    assert not writer.has_room() and writer.queued == 3 and writer.queued_bytes == 3 * one
    writer.start()
    assert writer.flush(30)
    assert writer.has_room() and writer.queued_bytes == 0
    writer.close(5)
    assert [c.seq for c in sqlite_store.read_calls("r", 0)] == [0, 1, 2]


def test_a_half_full_queue_wakes_a_lingering_writer(sqlite_store: TraceStore, tmp_path: Path):
    """The writer lingers 30 s to batch calls, but a queue half full (here 4 of 8) is written at once, so new
    calls never wait for room while the writer sleeps; fewer calls wait for the linger."""
    writer = TraceWriter(sqlite_store, Spool(tmp_path / "s.jsonl"), ProxyMetrics(), queue_size=8, linger_s=30.0)
    writer.start()
    for seq in range(3):
        writer.put(CallItem(record(seq)))
    time.sleep(0.5)  # time enough to write them, had anything woken the writer
    assert len(sqlite_store.read_calls("r", 0)) == 0 and writer.queued == 3
    writer.put(CallItem(record(3)))
    wait_until(lambda: len(sqlite_store.read_calls("r", 0)) == 4, "the half-full queue to be written", 10.0)
    assert writer.has_room() and writer.queued == 0
    writer.close(5)


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_full_spool_holds_the_rest_in_memory_says_so_and_replays_everything(tmp_path: Path):
    """A store with no tables yet is away for the writer (every write fails "no such table"): the spool takes
    what its byte bound allows, the writer reports it full and keeps the rest, and once the store is
    migrated everything is stored, in order."""
    store = TraceStore.connect(f"sqlite:///{tmp_path / 'late.db'}")
    calls = [record(seq) for seq in range(20)]
    line = len(json.dumps(item_to_json(CallItem(calls[0])))) + 40  # ticket and epoch fields, some slack
    spool = Spool(tmp_path / "s.jsonl", max_bytes=5 * line)
    metrics = ProxyMetrics()
    writer = TraceWriter(store, spool, metrics, batch_size=4, retry_s=0.01, retry_max_s=0.05, linger_s=0.0)
    writer.start()
    for call in calls:
        writer.put(CallItem(call))
    wait_until(lambda: (writer.problem() or "").startswith("SpoolFull"), "the spool to fill")
    assert "is full" in writer.problem() and "HARNESSRL_SPOOL_MAX_BYTES" in writer.problem()
    assert 0 < spool.pending < 20 and spool.size == spool.path.stat().st_size <= 5 * line
    exposition = metrics.exposition()[0].decode()
    assert metric_value(exposition, "harnessrl_proxy_writer_failing") == 1
    assert metric_value(exposition, "harnessrl_proxy_write_errors_total", kind="spool_full") >= 1
    store.upgrade()
    assert writer.flush(30)
    assert writer.problem() is None and spool.pending == 0 and spool.size == 0
    assert writer.close(5)
    assert [c.seq for c in store.read_calls("r", 0)] == list(range(20))
    store.close()


def test_a_spool_the_disk_refuses_holds_the_items_reports_it_and_recovers(tmp_path: Path):
    """The store is away and the spool's disk is full (its descriptor points at /dev/full: every write fails
    with ENOSPC): the writer thread must not die. It reports the error, keeps the items, and stores them all
    once the store is back."""
    store = TraceStore.connect(f"sqlite:///{tmp_path / 'late.db'}")  # no tables yet: an outage to the writer
    spool = Spool(tmp_path / "s.jsonl")
    writer = TraceWriter(store, spool, ProxyMetrics(), batch_size=4, retry_s=0.01, retry_max_s=0.05,
                         linger_s=0.0)
    fd = spool._append.fileno()
    saved = os.dup(fd)
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, fd)
    os.close(full)
    writer.start()
    for seq in range(6):
        writer.put(CallItem(record(seq)))
    wait_until(lambda: "No space left on device" in (writer.problem() or ""), "the writer to report ENOSPC")
    assert spool.pending == 0 and writer.depth == 6
    os.dup2(saved, fd)  # the disk has room again
    os.close(saved)
    store.upgrade()
    assert writer.flush(30)
    assert writer.problem() is None
    assert writer.close(5)
    assert [c.seq for c in store.read_calls("r", 0)] == list(range(6))
    store.close()


# ------------------------------------------------------------------------------------------ config, pins


def test_config_reads_the_sidecar_environment_and_flags_win(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HARNESSRL_UPSTREAMS", "http://a:8000, http://b:8000/")
    monkeypatch.setenv("HARNESSRL_STORE_URL", "sqlite:///x.db")
    monkeypatch.setenv("HARNESSRL_ROLLOUT_ID", "r-9")
    monkeypatch.setenv("HARNESSRL_ATTEMPT", "2")
    monkeypatch.setenv("HARNESSRL_PROXY_PORT", "9100")
    monkeypatch.setenv("HARNESSRL_SAMPLING", '{"temperature": 1.0}')
    monkeypatch.setenv("HARNESSRL_POLICY_VERSION", "7")
    cfg = load_config()
    assert cfg.upstreams == ["http://a:8000", "http://b:8000"] and cfg.sidecar
    assert (cfg.rollout_id, cfg.attempt, cfg.proxy_port, cfg.policy_version) == ("r-9", 2, 9100, 7)
    assert cfg.sampling == {"temperature": 1.0} and cfg.continuity_enabled
    assert load_config(proxy_port=9200, upstreams=["http://c:1"]).proxy_port == 9200
    monkeypatch.setenv("HARNESSRL_ATTEMPT", "-1")
    with pytest.raises(ConfigError, match=r"attempt \(--attempt or HARNESSRL_ATTEMPT\)"):
        load_config()


def test_rendezvous_pinning_is_stable_and_moves_few_rollouts():
    three = UpstreamPool(["http://a", "http://b", "http://c"], None, lambda: 0)  # type: ignore[arg-type]
    four = UpstreamPool(["http://a", "http://b", "http://c", "http://d"], None, lambda: 0)  # type: ignore[arg-type]
    keys = [f"rollout-{i}" for i in range(2000)]
    before = {k: three.ranked(k)[0] for k in keys}
    assert before == {k: three.ranked(k)[0] for k in keys}
    moved = [k for k in keys if four.ranked(k)[0] != before[k]]
    assert all(four.ranked(k)[0] == "http://d" for k in moved)  # only to the new upstream
    counts = {u: list(before.values()).count(u) for u in three.urls}
    assert min(counts.values()) > 500  # spread over all three


def _vllm_chat_record(seq: int = 0, rollout: str = "r"):
    """A record the way capture builds it from a vLLM chat answer with token ids and log-probs."""
    tokens, logprobs = [" a", "é", "\U0001f600"], [-0.25, -1.5, -0.0]
    response = {
        "id": "c",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(tokens)},
                "logprobs": {
                    "content": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs, strict=True)
                    ]
                },
                "token_ids": [7, 8, 9],
            }
        ],
        "prompt_token_ids": [1, 2, 3],
    }
    return build_call_record(
        who=Attribution("run", rollout, 0),
        seq=seq,
        route="chat",
        request={"messages": [{"role": "user", "content": f"m{seq}"}]},
        response=response,
        tokens=tokens_from_response("chat", response),
        policy_version=1,
        upstream="http://u",
        latency_s=0.01,
        status=CallStatus.OK,
        http_status=200,
    )


def test_a_queued_call_holds_its_prepared_form_and_rebuilds_bit_exact(tmp_path: Path):
    original = _vllm_chat_record()
    expected = copy.deepcopy(original)
    item = CallItem(original)
    item.prepare()
    # queued: packed arrays and the stripped response, not the decoded log-prob entries
    assert item.call is not original and item.call.record.response is None
    # the log-prob entries' tokens spell the reply's text, so only their lengths are kept (store/codec.py)
    content = item.call.response["choices"][0]["logprobs"]["content"]
    assert isinstance(content, str) and len(content) == 3
    assert item.record == expected and original == expected  # capture's record is left as it was
    # through the spool (an outage) and back: still the same call, to the bit
    again = item_from_json(json.loads(json.dumps(item_to_json(item))))
    assert again.record == expected
    assert math.copysign(1.0, again.record.logprobs[2]) == -1.0


def test_a_call_the_store_would_refuse_is_queued_as_captured(sqlite_store: TraceStore, tmp_path: Path):
    bad = _vllm_chat_record(rollout="r" * 200)  # longer than the store allows
    item = CallItem(bad)
    item.prepare()
    assert item.call is bad  # not prepared: the writer hands it over and the store names the problem
    writer = TraceWriter(sqlite_store, Spool(tmp_path / "s.jsonl"), ProxyMetrics())
    writer.start()
    writer.put(item)
    good = _vllm_chat_record()
    expected = copy.deepcopy(good)
    writer.put(CallItem(good))  # not prepared yet: the store prepares it
    assert writer.flush(30)
    writer.close(5)
    [rejected] = [json.loads(line) for line in (tmp_path / "s.jsonl.rejected").read_text().splitlines()]
    assert "rollout_id" in rejected["error"] and rejected["item"]["record"]["rollout_id"] == "r" * 200
    [stored] = sqlite_store.read_calls("r", 0)  # the prepared call next to it was stored, bit-exact
    assert (stored.call_id, stored.response, stored.logprobs) == (
        expected.call_id,
        expected.response,
        expected.logprobs,
    )


@pytest.mark.parametrize(
    ("body", "forced", "rendered", "expected"),
    [
        ({"max_tokens": 16}, {}, {}, 16),  # vLLM's render leaves out a limit equal to its default
        ({"max_completion_tokens": 40}, {}, {"max_tokens": 40}, 40),
        ({}, {}, {"max_tokens": 7000}, 90),  # sized by the server for its own rendering: the room left here
        ({"max_tokens": 16}, {"max_tokens": 8}, {"max_tokens": 8}, 8),  # the run's sampling override
    ],
)
def test_a_served_continuation_keeps_the_requests_own_token_limit(body, forced, rendered, expected) -> None:
    from types import SimpleNamespace

    from harnessrl.proxy.continuity import TokenContinuity

    chat = {**body, **forced}  # what the server rendered: the request with the run's sampling
    plan = TokenContinuity._served(
        SimpleNamespace(), body, chat, {"sampling_params": rendered}, list(range(10)), [0, 1], 100, "r"
    )
    assert plan.request["sampling_params"]["max_tokens"] == expected
