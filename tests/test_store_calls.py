"""LLM calls: bit-exact round trips, compact arrays, duplicate writes, refusals, delta chains with gaps."""

from __future__ import annotations

import copy
import dataclasses
from datetime import timedelta

import numpy as np
import pytest
import torch
from sqlalchemy import select
from store_sizes import postgres_row_bytes, stored_call_bytes
from synthetic_calls import chat_trajectory, float32_logprobs, vllm_chat_response

from harnessrl.store import CallRecord, CallStatus, InvalidCall, RolloutState, StoredCall, TraceStore
from harnessrl.store.schema import LlmCall


def raw_row(store: TraceStore, call_id: str) -> dict:
    with store.engine.connect() as conn:
        return dict(conn.execute(select(LlmCall.__table__).where(LlmCall.call_id == call_id)).one()._mapping)


def full_prompt(calls_by_id: dict[str, StoredCall], call: StoredCall) -> list[int]:
    if call.parent_call_id is None:
        return list(call.prompt_suffix)
    parent = calls_by_id[call.parent_call_id]
    return full_prompt(calls_by_id, parent) + parent.completion_token_ids + call.prompt_suffix


def test_32k_prompt_4k_completion_round_trip_is_bit_exact(store: TraceStore) -> None:
    """A long call stores about 4 bytes per prompt token and 8 per completion token (id + log-prob)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 151_936, (32_768,), generator=g).tolist()
    completion = torch.randint(0, 151_936, (4_096,), generator=g).tolist()
    logits = torch.randn(4_096, 512, generator=g, dtype=torch.float32)
    chosen = torch.randint(0, 512, (4_096, 1), generator=g)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, chosen).squeeze(1)
    assert logprobs.dtype == torch.float32
    logprobs_list = logprobs.tolist()
    pieces = [f" t{t % 997}" for t in completion]
    response = vllm_chat_response(prompt, completion, pieces, logprobs_list, "".join(pieces), 1)
    call = CallRecord(
        call_id="long", run="run", rollout_id="r", attempt=0, seq=0, route="chat",
        request={"model": "m", "messages": [{"role": "user", "content": "x" * 100}]},
        response=response, prompt_token_ids=prompt, completion_token_ids=completion, logprobs=logprobs_list,
        policy_version=1, upstream="http://vllm:8000", latency_s=12.5, finish_reason="length",
    )  # fmt: skip
    snapshot = copy.deepcopy(call)
    assert store.add_calls([call]) == 1
    assert call == snapshot  # the caller's record is not modified
    back = store.get_call("long")
    assert back == snapshot
    assert back.response == response  # token arrays and log-prob entries put back exactly
    assert np.array_equal(np.asarray(back.logprobs, dtype=np.float32), logprobs.numpy())
    assert [type(x) for x in back.prompt_token_ids[:3]] == [int, int, int]

    row = raw_row(store, "long")
    assert len(row["prompt_suffix"]) == 4 * 32_768
    assert len(row["completion_ids"]) == 4 * 4_096 and len(row["logprobs"]) == 4 * 4_096
    assert row["logprobs_f64"] is False
    assert "prompt_token_ids" not in row["response"] and "token_ids" not in row["response"]["choices"][0]
    stored = stored_call_bytes(store, ["long"])
    arrays = 4 * (32_768 + 2 * 4_096)
    print(
        f"\n[{store.engine.dialect.name}] 32k+4k call: stored {stored} bytes "
        f"(arrays {arrays}, everything else {stored - arrays}; {stored / (32_768 + 4_096):.2f} bytes/token); "
        f"PostgreSQL row size {postgres_row_bytes(store, ['long'])}"
    )
    assert stored < arrays + 80_000  # the JSON holds the 4k log-prob tokens' text, not the arrays again


def test_non_float32_logprobs_fall_back_to_float64_exactly(store: TraceStore) -> None:
    values = [-0.1, -1e-300, -2.0, -0.0]  # -0.1 and -1e-300 are not float32-representable
    call = CallRecord(
        call_id="f64", run="run", rollout_id="r", attempt=0, seq=0, route="completions",
        request={"prompt": "hi"}, response=None, prompt_token_ids=[1], completion_token_ids=[2, 3, 4, 5],
        logprobs=values, policy_version=0,
    )  # fmt: skip
    store.add_calls([call])
    back = store.get_call("f64")
    assert (
        np.asarray(back.logprobs).tobytes() == np.asarray(values).tobytes()
    )  # bit-exact, sign of zero included
    assert raw_row(store, "f64")["logprobs_f64"] is True


def test_duplicate_call_id_leaves_the_stored_row_unchanged(store: TraceStore) -> None:
    first = chat_trajectory("dup", turns=3, system_tokens=20, observation_tokens=10, completion_tokens=5)
    assert store.add_calls(first) == 3
    before = {c.call_id: raw_row(store, c.call_id) for c in first}
    # A replay with the same ids but different content (and one new call) must not touch the stored rows.
    replay = [
        dataclasses.replace(c, prompt_token_ids=[7, 7, 7], latency_s=99.0, request={"x": 1}) for c in first
    ]
    extra = dataclasses.replace(first[0], call_id="dup-new", seq=9)
    assert store.add_calls([*replay, extra]) == 1
    assert store.add_calls(replay) == 0
    assert {c.call_id: raw_row(store, c.call_id) for c in first} == before
    assert store.read_calls("dup", 0)[:3] == first
    # The same id twice inside one batch is written once.
    again = dataclasses.replace(first[0], call_id="twice", seq=20)
    assert store.add_calls([again, dataclasses.replace(again, latency_s=5.0)]) == 1
    assert store.get_call("twice").latency_s == again.latency_s


def test_trajectory_reads_back_exact_and_rollout_calls_agree(store: TraceStore) -> None:
    calls = chat_trajectory("traj", turns=6, system_tokens=50, observation_tokens=20, completion_tokens=8)
    assert store.add_calls(calls) == 6
    assert store.read_calls("traj", 0) == calls
    for call in calls:
        assert store.get_call(call.call_id) == call
    stored = store.rollout_calls("traj", 0)
    assert [s.call_id for s in stored] == [c.call_id for c in calls]
    assert stored[0].parent_call_id is None
    assert all(s.parent_call_id == calls[i].call_id for i, s in enumerate(stored[1:]))
    by_id = {s.call_id: s for s in stored}
    for s, c in zip(stored, calls, strict=True):
        assert full_prompt(by_id, s) == c.prompt_token_ids
        assert (s.completion_token_ids, s.logprobs, s.policy_version) == (
            c.completion_token_ids,
            c.logprobs,
            3,
        )
        assert (s.status, s.finish_reason, s.seq, s.attempt) == (CallStatus.OK, "stop", c.seq, 0)
    # The delta form is linear: suffixes add up to the final prompt, not to the sum of all prompts.
    assert sum(len(s.prompt_suffix) for s in stored) + sum(
        len(s.completion_token_ids) for s in stored[:-1]
    ) == len(calls[-1].prompt_token_ids)


@pytest.mark.parametrize("order", ["one batch", "one call per batch", "reversed batches"])
def test_chain_is_exact_however_it_arrives(store: TraceStore, order: str) -> None:
    """Predecessors in the same batch, already stored, or not yet stored (then stored in full)."""
    calls = chat_trajectory("order", turns=5, system_tokens=30, observation_tokens=10, completion_tokens=6)
    if order == "one batch":
        store.add_calls(list(reversed(calls)))
    elif order == "one call per batch":
        for c in calls:
            store.add_calls([c])
    else:
        for c in reversed(calls):
            store.add_calls([c])
    assert store.read_calls("order", 0) == calls
    assert [store.get_call(c.call_id) for c in calls] == calls
    parents = [s.parent_call_id for s in store.rollout_calls("order", 0)]
    if order == "reversed batches":
        assert parents == [None] * 5  # each predecessor was missing when its successor arrived
    else:
        assert parents == [None, *[c.call_id for c in calls[:-1]]]


def test_gap_in_the_chain_stores_the_successor_against_the_latest_call_it_extends(store: TraceStore) -> None:
    calls = chat_trajectory("gap", turns=4, system_tokens=30, observation_tokens=10, completion_tokens=6)
    store.add_calls([calls[0], calls[1], calls[3]])  # seq 2 lost (say, a proxy crash)
    stored = {s.seq: s for s in store.rollout_calls("gap", 0)}
    context = len(calls[1].prompt_token_ids) + len(calls[1].completion_token_ids)
    assert stored[3].parent_call_id == calls[1].call_id
    assert stored[3].prompt_suffix == calls[3].prompt_token_ids[context:]
    store.add_calls([calls[2]])  # arrives late: it may use seq 1, and nothing else changes
    assert store.read_calls("gap", 0) == calls
    assert store.rollout_calls("gap", 0)[2].parent_call_id == calls[1].call_id


def test_edited_history_is_stored_in_full_and_read_back_exact(store: TraceStore) -> None:
    """A harness that rewrites earlier turns (summarises, truncates) does not extend: full storage."""
    calls = chat_trajectory("edit", turns=4, system_tokens=40, observation_tokens=10, completion_tokens=6)
    edited = calls[2]
    messages = copy.deepcopy(edited.request["messages"])
    messages[1]["content"] = "summary of the first observation"
    prompt = list(edited.prompt_token_ids)
    prompt[45] = 42  # a token in the middle of the history changes
    calls[2] = dataclasses.replace(
        edited, request={**edited.request, "messages": messages}, prompt_token_ids=prompt
    )
    store.add_calls(calls)
    assert store.read_calls("edit", 0) == calls
    stored = store.rollout_calls("edit", 0)
    assert stored[2].parent_call_id is None
    assert stored[2].prompt_suffix == prompt
    assert raw_row(store, calls[2].call_id)["request_reused"] == 0
    assert raw_row(store, calls[2].call_id)["request"]["messages"] == messages
    assert stored[1].parent_call_id == calls[0].call_id
    # seq 3 was built on the unedited history, so it does not extend the edited seq 2: it is stored as a delta
    # of seq 1, the latest call whose prompt + completion begins its prompt.
    assert stored[3].parent_call_id == calls[1].call_id
    assert stored[3].prompt_suffix == calls[3].prompt_token_ids[len(calls[1].prompt_token_ids)
                                                               + len(calls[1].completion_token_ids) :]


def test_rewritten_reply_still_reuses_the_history(store: TraceStore) -> None:
    """Harnesses that resend the reply as {role, content} only: the messages before it are still reused."""
    calls = chat_trajectory("rw", turns=4, system_tokens=30, observation_tokens=10, completion_tokens=6,
                            resend_reply="rewritten")  # fmt: skip
    store.add_calls(calls)
    assert store.read_calls("rw", 0) == calls
    reused = [raw_row(store, c.call_id)["request_reused"] for c in calls]
    assert reused == [0, 2, 4, 6]  # predecessor's messages, without its reply (which was resent rewritten)
    exact = chat_trajectory("ex", turns=4, system_tokens=30, observation_tokens=10, completion_tokens=6)
    store.add_calls(exact)
    assert [raw_row(store, c.call_id)["request_reused"] for c in exact] == [0, 3, 5, 7]


def test_completions_route_text_prompt_is_delta_encoded(store: TraceStore) -> None:
    calls = []
    prompt_text, prompt_ids = "You are a bot.\nTask: add 2+2\n", [5, 6, 7]
    for seq in range(3):
        completion_text = f" step {seq}"
        completion = [100 + seq, 200 + seq]
        lps = [-0.5, -0.25]
        logprobs = {
            "tokens": [" step", f" {seq}"],
            "token_logprobs": lps,
            "top_logprobs": None,
            "text_offset": [0, 5],
        }
        choice = {"index": 0, "text": completion_text, "logprobs": logprobs, "finish_reason": "stop",
                  "prompt_token_ids": list(prompt_ids), "token_ids": completion}  # fmt: skip
        calls.append(
            CallRecord(
                call_id=f"cmp-{seq}",
                run="run",
                rollout_id="cmp",
                attempt=0,
                seq=seq,
                route="completions",
                request={"model": "m", "prompt": prompt_text, "max_tokens": 8},
                response={"id": f"cmpl-{seq}", "choices": [choice]},
                prompt_token_ids=list(prompt_ids),
                completion_token_ids=completion,
                logprobs=lps,
                policy_version=0,
            )  # fmt: skip
        )
        prompt_text += completion_text + "\nObservation: ok\n"
        prompt_ids = prompt_ids + completion + [9]
    store.add_calls(calls)
    assert store.read_calls("cmp", 0) == calls
    rows = [raw_row(store, c.call_id) for c in calls]
    assert rows[2]["request"]["prompt"] == "\nObservation: ok\n"
    assert rows[2]["request_reused"] == len(calls[1].request["prompt"]) + len(" step 1")
    assert "token_logprobs" not in rows[1]["response"]["choices"][0]["logprobs"]
    assert [s.parent_call_id for s in store.rollout_calls("cmp", 0)] == [None, "cmp-0", "cmp-1"]


def test_response_that_differs_from_the_arrays_is_kept_verbatim(store: TraceStore) -> None:
    """Only exact duplicates are stripped; a response whose arrays differ round-trips untouched."""
    rng = np.random.default_rng(3)
    lps = float32_logprobs(rng, 3)
    response = vllm_chat_response([1, 2], [3, 4, 5], ["a", "b", "c"], lps, "abc", 9)
    response["choices"][0]["token_ids"] = [3, 4, 6]  # differs from completion_token_ids
    response["choices"][0]["logprobs"]["content"][1]["top_logprobs"] = [
        {"token": "x", "logprob": -3.0, "bytes": [120]}
    ]
    response["prompt_token_ids"] = [1, 2.0]  # a float where an int is expected: not the same JSON
    call = CallRecord(
        call_id="verbatim", run="run", rollout_id="v", attempt=0, seq=0, route="chat",
        request={"messages": []}, response=response, prompt_token_ids=[1, 2], completion_token_ids=[3, 4, 5],
        logprobs=lps, policy_version=0,
    )  # fmt: skip
    store.add_calls([call])
    back = store.get_call("verbatim")
    assert back.response == response
    assert type(back.response["prompt_token_ids"][1]) is float
    assert list(back.response) == list(response)  # key order kept too
    stripped = {name for name, _ in raw_row(store, "verbatim")["response_stripped"] or []}
    assert not stripped & {"prompt_token_ids", "choice.token_ids", "choice.logprobs.content",
                           "choice.logprobs.content_split"}  # only the constant fields (codec.DEFAULTS) went


def test_key_order_and_unicode_survive(store: TraceStore) -> None:
    request = {
        "z": 1,
        "messages": [{"content": "héllo ✓ 🙂 \u0000 \ud800", "role": "user"}],
        "a": [1.5, 1e-7, 10**20],
    }
    response = {
        "choices": [{"message": {"role": "assistant", "content": "ok"}}],
        "b": None,
        "a": {"y": 1, "x": 2},
    }
    call = CallRecord(
        call_id="order", run="run", rollout_id="o", attempt=0, seq=0, route="chat", request=request,
        response=response, prompt_token_ids=[], completion_token_ids=[], logprobs=[], policy_version=0,
        status=CallStatus.ABORTED, http_status=499,
    )  # fmt: skip
    store.add_calls([call])
    back = store.get_call("order")
    assert back == call
    assert list(back.request) == ["z", "messages", "a"] and list(back.request["messages"][0]) == [
        "content",
        "role",
    ]
    assert list(back.response["a"]) == ["y", "x"]


def test_invalid_calls_are_refused_and_nothing_is_written(store: TraceStore) -> None:
    good = chat_trajectory("bad", turns=2, system_tokens=10, observation_tokens=5, completion_tokens=3)
    cases = {
        "does not fit a 32-bit token id": dataclasses.replace(good[1], prompt_token_ids=[1, 2**31]),
        "prompt_token_ids must be a flat list of integers": dataclasses.replace(
            good[1], prompt_token_ids=[1.5]
        ),
        "not storable JSON": dataclasses.replace(
            good[1], request={"temperature": float("nan"), "messages": []}
        ),
        "seq must be an integer >= 0": dataclasses.replace(good[1], seq=-1),
        "call_id must be a non-empty string": dataclasses.replace(good[1], call_id=""),
        "status must be one of": dataclasses.replace(good[1], status="weird"),
    }
    for message, bad in cases.items():
        with pytest.raises(InvalidCall, match=message) as info:
            store.add_calls([good[0], bad])
        assert info.value.call_ids == [bad.call_id or "#1"]
        assert "\n" not in str(info.value)
        assert store.read_calls("bad", 0) == []  # the valid call of the batch was not written either
    assert store.add_calls(good) == 2


def test_calls_create_missing_rollout_rows(store: TraceStore) -> None:
    """A standalone proxy writes calls for rollouts nobody created: run, rollout and attempt appear."""
    calls = chat_trajectory("solo", turns=2, system_tokens=10, observation_tokens=5, completion_tokens=3,
                            run="adhoc", attempt=2)  # fmt: skip
    store.add_calls(calls)
    attempt = store.get_attempt("solo", 2)
    assert (attempt.run, attempt.state, attempt.task_id, attempt.policy_version_start) == (
        "adhoc", RolloutState.RUNNING, None, 3)  # fmt: skip
    assert attempt.reward is None


@pytest.mark.parametrize("split", [3, None], ids=["restart-batch-apart", "restart-same-batch"])
def test_calls_numbered_from_zero_again_after_a_proxy_restart_go_after_the_stored_ones(
    store: TraceStore, split: int | None
) -> None:
    """A restarted sidecar numbers its rollout's calls 0, 1, ... again; they must follow the stored ones."""
    calls = chat_trajectory("r", 6, seed=3)  # one conversation: each prompt extends the one before
    restarted = [dataclasses.replace(c, seq=c.seq - 3) for c in calls[3:]]  # the new process's 0, 1, 2
    expected = copy.deepcopy(calls)
    store.add_calls(calls[:3])
    if split is None:
        assert store.add_calls(restarted) == 3
    else:
        assert store.add_calls(restarted[:1]) == 1
        assert store.add_calls(restarted[1:]) == 2
    assert store.read_calls("r", 0) == expected  # seq 3, 4, 5 again, in the order they were made
    stored = store.rollout_calls("r", 0)
    assert [c.parent_call_id for c in stored] == [None] + [c.call_id for c in calls[:-1]]  # deltas chain on
    assert store.add_calls(restarted) == 0  # a replay of the same calls is still skipped by call_id
    assert [c.seq for c in store.read_calls("r", 0)] == list(range(6))


def test_two_calls_at_one_place_in_one_batch_are_both_kept_in_the_order_made(store: TraceStore) -> None:
    """The table holds one call per (rollout, attempt, seq); a batch with two (a forgotten counter, two spools
    replayed together) keeps the first made in place and stores the other after the attempt's last call."""
    calls = chat_trajectory("twins", 3, seed=7)
    late = dataclasses.replace(calls[2], call_id="late", seq=1, created_at=calls[2].created_at + timedelta(hours=1))
    assert store.add_calls([calls[0], late, calls[1], calls[2]]) == 4
    stored = store.read_calls("twins", 0)
    assert [c.call_id for c in stored] == [c.call_id for c in calls] + ["late"]
    assert [c.seq for c in stored] == [0, 1, 2, 3]
    assert stored[:3] == calls and stored[3] == dataclasses.replace(late, seq=3)
