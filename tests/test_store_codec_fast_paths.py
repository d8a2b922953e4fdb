"""The codec's faster checks decide exactly as the plain per-element rules do, edge cases included.

``strip_response`` and ``pack_ids`` run for every captured call on the proxy's writer thread, so they compare
whole lists (``set(map(type, ...))``, ``array``, ``bytes``) where they can. These tests hold them to the
per-element rules they replaced: a value is stripped only if putting it back gives the same JSON.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harnessrl.store import codec


def reference_same_ints(value: object, expected: list[int]) -> bool:
    return isinstance(value, list) and len(value) == len(expected) and all(type(v) is int for v in value) \
        and value == expected  # fmt: skip


def reference_chat_tokens(content: object, logprobs: list[float]) -> list[str] | None:
    if not isinstance(content, list) or len(content) != len(logprobs) or not content:
        return None
    tokens = []
    for entry in content:
        if not isinstance(entry, dict) or list(entry) != codec.CHAT_LOGPROB_KEYS:
            return None
        token = entry["token"]
        if (
            type(token) is not str
            or entry["top_logprobs"] != []
            or entry["bytes"] != codec.token_bytes(token)
        ):
            return None
        if any(type(b) is float for b in entry["bytes"]):  # stricter than equality: 104.0 stays verbatim
            return None
        if type(entry["logprob"]) is not float:
            return None
        tokens.append(token)
    got = np.asarray([e["logprob"] for e in content], np.float64).tobytes()
    return tokens if got == np.asarray(logprobs, np.float64).tobytes() else None


json_ints = st.one_of(st.integers(-5, 5), st.booleans(), st.sampled_from([1.0, 0.0, -0.0]))


@given(ids=st.lists(st.integers(-5, 5), max_size=6), value=st.lists(json_ints, max_size=6))
def test_same_ints_matches_the_per_element_rule(ids: list[int], value: list[object]) -> None:
    assert codec._same_ints(value, ids) == reference_same_ints(value, ids)
    assert codec._same_ints(list(ids), ids) == reference_same_ints(list(ids), ids)


entries = st.fixed_dictionaries(
    {
        "token": st.one_of(st.text(max_size=3), st.integers(0, 2)),
        "logprob": st.one_of(st.sampled_from([-0.5, 0.0, -0.0, -1.25]), st.integers(-1, 0)),
        "bytes": st.one_of(st.lists(st.one_of(st.integers(0, 300), st.floats(0, 2)), max_size=4),
                           st.integers(0, 3), st.text(max_size=2)),
        "top_logprobs": st.one_of(st.just([]), st.just([{}]), st.just({})),
    }
)  # fmt: skip


@given(content=st.lists(entries, min_size=1, max_size=4), data=st.data())
def test_chat_logprob_check_matches_the_per_element_rule(content: list[dict], data: st.DataObject) -> None:
    logprobs = data.draw(st.lists(st.sampled_from([-0.5, 0.0, -0.0, -1.25]), min_size=len(content),
                                  max_size=len(content)))  # fmt: skip
    assert codec._chat_logprob_tokens(content, logprobs) == reference_chat_tokens(content, logprobs)
    # the same content made consistent with the arrays must be recognised (and only then stripped)
    good = [{"token": t, "logprob": lp, "bytes": codec.token_bytes(t), "top_logprobs": []}
            for t, lp in zip(["a", "é", "\ud800"] * 2, logprobs, strict=False)]  # fmt: skip
    expected = reference_chat_tokens(good, logprobs[: len(good)])
    assert expected is not None and codec._chat_logprob_tokens(good, logprobs[: len(good)]) == expected


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ([True, False], "all-bool list"),
        ([1, 2.0], "float"),
        ([1, "2"], "string"),
        ([[1, 2]], "nested"),
        ([1, None], "None"),
    ],
)
def test_pack_ids_refuses_what_is_not_a_flat_int_list(bad: list[object], why: str) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids must be a flat list of integers"):
        codec.pack_ids(bad, "prompt_token_ids")  # type: ignore[arg-type]


def test_pack_ids_names_an_out_of_range_value_and_packs_int32_little_endian() -> None:
    with pytest.raises(ValueError, match=r"hold 2147483648, which does not fit a 32-bit token id"):
        codec.pack_ids([1, 2**31], "prompt_token_ids")
    with pytest.raises(ValueError, match=r"hold -2147483649"):
        codec.pack_ids([-(2**31) - 1, 0], "prompt_token_ids")
    values = [0, 1, -1, 2**31 - 1, -(2**31), 151_645]
    assert codec.pack_ids(values) == np.asarray(values, dtype="<i4").tobytes()
    assert codec.pack_ids([True, 7]) == np.asarray([1, 7], dtype="<i4").tobytes()  # as numpy always took it
    assert codec.pack_ids(np.arange(5, dtype=np.int64).tolist()) == np.arange(5, dtype="<i4").tobytes()


def test_odd_response_arrays_are_kept_verbatim_and_restored_exactly() -> None:
    """A bool, a float or a non-list ``bytes`` that compares equal to the arrays must not be stripped."""
    prompt, completion, logprobs = [1, 0], [104], [-0.5]
    response = {
        "prompt_token_ids": [True, False],
        "choices": [
            {
                "token_ids": [104.0],
                "logprobs": {
                    "content": [{"token": "h", "logprob": -0.5, "bytes": [104.0], "top_logprobs": []}]
                },
            }
        ],
    }
    stored, stripped = codec.strip_response(response, prompt, completion, logprobs)
    assert stripped is None and stored is response
    text_only = {"choices": [{"logprobs": {"content": [
        {"token": "\x00", "logprob": -0.5, "bytes": 1, "top_logprobs": []}]}}]}  # fmt: skip
    assert codec.strip_response(text_only, [], [0], logprobs)[1] is None
    # and the regular shape is stripped and put back to the identical JSON text
    regular = {"prompt_token_ids": prompt, "choices": [{"token_ids": completion, "logprobs": {"content": [
        {"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": []}]}}]}  # fmt: skip
    before = json.dumps(regular)
    stored, stripped = codec.strip_response(regular, prompt, completion, logprobs)
    assert stripped is not None and json.dumps(regular) == before  # the input is never mutated
    back = codec.restore_response(json.loads(json.dumps(stored)), stripped, prompt, completion, logprobs)
    assert json.dumps(back) == before
    assert not math.isnan(back["choices"][0]["logprobs"]["content"][0]["logprob"])


@pytest.mark.postgres
def test_postgres_copy_skips_a_call_another_writer_stored_in_between(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer stores two of the batch's calls after the batch's lookup: the direct COPY meets the
    unique violation, and the batch is written again, conflict-safe, with only the two new calls."""
    from synthetic_calls import chat_trajectory

    from harnessrl.store import TraceStore, call_writer
    from harnessrl.store.call_copy import CopyConflict, copy_insert
    from harnessrl.store.call_writer import prepare_batch

    calls = chat_trajectory("race", 4, system_tokens=30, observation_tokens=10, completion_tokens=5)
    lookup = call_writer._lookup
    lookups: list[set[str]] = []

    def late_lookup(conn, call_ids, keys):
        lookups.append(lookup(conn, call_ids, keys)[0])
        if len(lookups) == 1:  # the first lookup ran before the other writer committed: it saw nothing
            return set(), {}
        return lookup(conn, call_ids, keys)

    with TraceStore.connect(pg_url) as store:
        store.upgrade()
        assert store.add_calls(calls[:2]) == 2  # "the other writer"
        monkeypatch.setattr(call_writer, "_lookup", late_lookup)
        assert store.add_calls(calls) == 2
        stored_first = {c.call_id for c in calls[:2]}
        assert lookups == [stored_first, stored_first]  # the direct COPY failed; the batch was written again
        assert store.read_calls("race", 0) == calls  # the stored two untouched, the new two exact
        monkeypatch.undo()
        assert store.add_calls(calls) == 0
        # the conflict-safe insert on its own, and the direct COPY's refusal, in the caller's transaction
        prepared = prepare_batch(
            chat_trajectory("race2", 4, system_tokens=30, observation_tokens=10, completion_tokens=5)
        )
        rows = [(p, p.encode(None)) for _, p in sorted(prepared.items())]
        assert store.add_calls([p for p, _ in rows[:2]]) == 2
        with pytest.raises(CopyConflict), store._writer.begin() as conn:
            copy_insert(conn, rows)
        with store._writer.begin() as conn:
            assert copy_insert(conn, rows, conflict_safe=True) == {p.record.call_id for p, _ in rows[2:]}


def test_the_writer_hashes_each_shared_prefix_once(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Choosing a call's anchor and encoding against it both ask whether the prompt begins with the anchor's
    prompt + completion (a blake2b of that prefix); the writer asks the hash once per call. The rows stored
    are the same deltas either way (each call read back exactly)."""
    from synthetic_calls import chat_trajectory

    from harnessrl.store import TraceStore, delta
    from harnessrl.store.call_writer import prepare_batch

    calls = chat_trajectory("once", 5, system_tokens=40, observation_tokens=10, completion_tokens=8)
    prepared = list(prepare_batch(calls).values())  # prepared first: describe() hashes each own context
    hashed: list[int] = []
    digest = delta.tokens_digest

    def counted(token_bytes: bytes) -> bytes:
        hashed.append(len(token_bytes))
        return digest(token_bytes)

    monkeypatch.setattr(delta, "tokens_digest", counted)
    with TraceStore.connect(f"sqlite:///{tmp_path}/store.db") as store:
        store.upgrade()
        assert store.add_calls(prepared) == 5
        assert len(hashed) == 4  # the four calls with a predecessor, once each (was twice)
        monkeypatch.undo()
        assert store.read_calls("once", 0) == calls
        assert all(p.encoded is not None and p.encoded.base_call_id for p in prepared[1:])
