"""Property tests: whatever a harness does to its history (extend, edit, truncate, restart, resend the reply
rewritten), every call reads back exactly, and the delta form always rebuilds the true prompt."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harnessrl.store import CallRecord, StoredCall, TraceStore, codec, delta

tokens = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=6)
texts = st.text(max_size=6)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "tool", "system"]), "content": texts})
history_moves = st.sampled_from(["extend", "extend", "extend", "edit", "truncate", "fresh"])
message_moves = st.sampled_from(["exact", "exact", "rewritten", "edit", "drop", "fresh"])


@st.composite
def trajectories(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A list of calls (as plain dicts) built by random moves from each call to the next."""
    prompt = draw(tokens)
    messages = draw(st.lists(message, min_size=1, max_size=3))
    calls: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(min_value=1, max_value=6))):
        completion = draw(tokens)
        logprobs = [float(codec.np.float32(-x / 7)) for x in range(len(completion))]
        reply = {"role": "assistant", "content": draw(texts), "tool_calls": []}
        with_response = draw(st.booleans()) or len(calls) == 0
        response = (
            {"choices": [{"message": reply, "token_ids": completion}], "prompt_token_ids": prompt}
            if with_response
            else None
        )
        calls.append({"prompt": prompt, "completion": completion, "logprobs": logprobs,
                      "request": {"messages": messages, "n": 1}, "response": response})  # fmt: skip
        context = prompt + completion
        move = draw(history_moves)
        if move == "extend":
            prompt = context + draw(tokens)
        elif move == "edit" and context:
            i = draw(st.integers(min_value=0, max_value=len(context) - 1))
            prompt = context[:i] + [context[i] ^ 1] + context[i + 1 :] + draw(tokens)
        elif move == "truncate":
            prompt = context[: draw(st.integers(min_value=0, max_value=len(context)))] + draw(tokens)
        else:
            prompt = draw(tokens)
        mmove = draw(message_moves)
        if mmove == "exact" and response is not None:
            messages = [*messages, reply, draw(message)]
        elif mmove == "rewritten":
            messages = [*messages, {"role": "assistant", "content": reply["content"]}, draw(message)]
        elif mmove == "edit":
            i = draw(st.integers(min_value=0, max_value=len(messages) - 1))
            messages = [
                *messages[:i],
                {**messages[i], "content": messages[i]["content"] + "!"},
                *messages[i + 1 :],
            ]
        elif mmove == "drop" and len(messages) > 1:
            messages = messages[1:]
        else:
            messages = draw(st.lists(message, min_size=1, max_size=3))
    return calls


def as_records(rollout_id: str, calls: list[dict[str, Any]]) -> list[CallRecord]:
    return [
        CallRecord(
            call_id=f"{rollout_id}-{seq}",
            run="run",
            rollout_id=rollout_id,
            attempt=0,
            seq=seq,
            route="chat",
            request=c["request"],
            response=c["response"],
            prompt_token_ids=c["prompt"],
            completion_token_ids=c["completion"],
            logprobs=c["logprobs"],
            policy_version=seq,
        )  # fmt: skip
        for seq, c in enumerate(calls)
    ]


def rebuild_prompt(by_id: dict[str, StoredCall], call: StoredCall) -> list[int]:
    if call.parent_call_id is None:
        return call.prompt_suffix
    parent = by_id[call.parent_call_id]
    return rebuild_prompt(by_id, parent) + parent.completion_token_ids + call.prompt_suffix


@given(calls=trajectories())
@settings(max_examples=300, deadline=None)
def test_encode_decode_round_trip_without_a_database(calls: list[dict[str, Any]]) -> None:
    """The pure encoding: anchors from full records, decoding from the previous call's full values."""
    previous: tuple[delta.Anchor, list[int], Any] | None = None
    for c in calls:
        prompt_bytes = codec.pack_ids(c["prompt"])
        encoded = delta.encode(prompt_bytes, c["request"], previous[0] if previous else None)
        base_tokens, base_io = (previous[1], previous[2]) if encoded.base_call_id else ([], None)
        prompt = base_tokens[: encoded.prompt_offset] + codec.unpack_ids(encoded.prompt_suffix_bytes)
        assert prompt == c["prompt"]
        if encoded.prompt_offset:
            assert c["prompt"][: encoded.prompt_offset] == base_tokens  # only true extensions are deltas
        assert delta.decode_request(encoded.request, encoded.request_reused, base_io, "x") == c["request"]
        anchor = delta.make_anchor(
            "x", prompt_bytes, codec.pack_ids(c["completion"]), c["request"], c["response"]
        )
        request_in = delta.request_input(c["request"])
        output = delta.request_output(request_in, c["response"])
        previous = (
            anchor,
            c["prompt"] + c["completion"],
            request_in if output is None else request_in + [output],
        )


counter = itertools.count()


@given(calls=trajectories(), split=st.integers(min_value=1, max_value=6), backwards=st.booleans())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_store_round_trip_for_any_history(store: TraceStore, calls: list[dict[str, Any]], split: int,
                                          backwards: bool) -> None:  # fmt: skip
    rollout_id = f"h{next(counter)}"
    records = as_records(rollout_id, calls)
    batches = [records[i : i + split] for i in range(0, len(records), split)]
    for batch in reversed(batches) if backwards else batches:
        store.add_calls(batch)
    assert store.read_calls(rollout_id, 0) == records
    for record in records:
        assert store.get_call(record.call_id) == record
    stored = store.rollout_calls(rollout_id, 0)
    by_id = {s.call_id: s for s in stored}
    assert [rebuild_prompt(by_id, s) for s in stored] == [r.prompt_token_ids for r in records]


def test_interleaved_conversations_are_each_stored_as_deltas_of_their_own(store: TraceStore) -> None:
    """An agent and its sub-agent take turns in one attempt: each call's parent is the call of its own
    conversation whose prompt + completion is the longest prefix of its prompt (not the call just before it),
    in one batch or call by call, so only new tokens are stored and the learner sees each call's real parent."""
    agent, sub = [1, 2], [7, 7]
    calls = []
    for turn in range(4):
        for conversation, observation in ((agent, [3, turn]), (sub, [8, turn])):
            completion = [50 + turn, 60 + turn]
            calls.append({"prompt": list(conversation), "completion": completion, "logprobs": [-0.5, -0.25],
                          "request": {"messages": [{"role": "user", "content": str(conversation[:2])}]},
                          "response": None})  # fmt: skip
            conversation += completion + observation
    for batch_size in (len(calls), 1):
        rollout_id = f"interleaved-{batch_size}"
        records = as_records(rollout_id, calls)
        for i in range(0, len(records), batch_size):
            store.add_calls(records[i : i + batch_size])
        stored = store.rollout_calls(rollout_id, 0)
        assert [s.parent_call_id for s in stored] == [None, None] + [f"{rollout_id}-{i}" for i in range(6)]
        assert all(len(s.prompt_suffix) == 2 for s in stored)  # each stores its observation only
        assert store.read_calls(rollout_id, 0) == records


def test_parent_search_skips_calls_longer_than_the_prompt_yet_finds_one_that_fits(store: TraceStore) -> None:
    """The search for a parent reads only the stored calls short enough to begin a searching prompt (by the
    longest such prompt per call): two calls of one batch search the same stored calls, a short one (a prompt
    resent, a compacted history: nothing fits) and a long one that extends the first call, which it finds."""
    first = {"prompt": [1, 2], "completion": [3, 4]}
    calls = [
        first,
        {"prompt": [9, 9, 9], "completion": [5]},  # another conversation: no extension of the first
        {"prompt": [9], "completion": [6]},  # shorter than every call before it
        {"prompt": [1, 2, 3, 4, 7, 7], "completion": [8]},  # extends the first call, three calls back
    ]
    for c in calls:
        c.update(logprobs=[-0.5] * len(c["completion"]), response=None,
                 request={"messages": [{"role": "user", "content": str(c["prompt"])}]})  # fmt: skip
    records = as_records("search", calls)
    store.add_calls(records[:2])
    store.add_calls(records[2:])  # both search the two stored calls, with different prompt lengths
    stored = store.rollout_calls("search", 0)
    assert [s.parent_call_id for s in stored] == [None, None, None, "search-0"]
    assert [s.prompt_suffix for s in stored] == [[1, 2], [9, 9, 9], [9], [7, 7]]
    assert store.read_calls("search", 0) == records


def reference_item_text(item: Any) -> bytes:
    """What every stored prefix digest hashed before msgspec: json.dumps, compact, ensure_ascii off."""
    import json

    return json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


any_text = st.text(st.characters(blacklist_categories=()), max_size=12)  # surrogates and controls included
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats() | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=20,
)


@given(json_values)
@settings(max_examples=400, deadline=None)
def test_item_text_is_json_dumps_byte_for_byte(item: Any) -> None:
    """Prefix digests hash each message's JSON text; plain messages go through msgspec, which must write the
    very bytes json.dumps did (the digests already stored were made from them): every control character,
    quote, backslash, U+2028, lone surrogate, 64-bit-overflowing integer and float alike."""
    assert delta._item_text(item) == reference_item_text(item)
    message = {"role": "tool", "content": item, "tool_call_id": "c1"}
    assert delta._item_text(message) == reference_item_text(message)


def test_item_text_of_every_ascii_and_line_separator() -> None:
    text = "".join(map(chr, range(0x80))) + "\u2028\u2029\ufeff\U0001f600 \\\"/"
    for item in (text, {text: [text, 2**64, -(2**63) - 1, True, None]}, {"content": "\ud800x"}):
        assert delta._item_text(item) == reference_item_text(item)


def test_plain_messages_skip_json_dumps(monkeypatch) -> None:
    """A message of strings, ints, bools and None is written by msgspec (json.dumps, 3-25 us a message, is
    not called); one holding a float still is, since msgspec spells some floats differently."""
    import json

    calls: list[Any] = []
    dumps = json.dumps
    monkeypatch.setattr(json, "dumps", lambda *a, **k: calls.append(a) or dumps(*a, **k))
    plain = {"role": "assistant", "content": "x", "tool_calls": [{"id": "c", "index": 0}], "refusal": None}
    expected = b'{"role":"assistant","content":"x","tool_calls":[{"id":"c","index":0}],"refusal":null}'
    assert delta._item_text(plain) == expected
    assert calls == []
    assert delta._item_text({"content": 1e16}) == b'{"content":1e+16}' and len(calls) == 1
