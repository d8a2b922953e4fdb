"""The row builder on calls read back from the real trace store (SQLite and PostgreSQL), and on numpy input.

The store decides on its own which calls become deltas and against which earlier call (the longest prefix it
has stored); rows built from ``rollout_calls`` must be exactly the rows built from the full records the proxy
wrote. ``HARNESSRL_ROWS_STORE_EXAMPLES`` raises the number of random trajectories (CI keeps the default).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rows_properties import (
    Sent,
    as_records,
    assert_same_rows,
    check_rows,
    delta_encode,
    interleaved_trajectories,
    limits,
    trajectories,
)

from harnessrl.store import CallStatus, TraceStore
from harnessrl.trainer.rows import calls_from_records, merge_calls_into_rows

OK, ERROR = CallStatus.OK, CallStatus.ERROR


def test_rows_from_store_deltas_equal_rows_from_full_records(store: TraceStore):
    """A fixed multi-turn trajectory with an error, retries and an edited history, through the real store."""
    history = [1, 2, 3]
    script = [(history, [10, 11], OK)]
    history = history + [10, 11] + [4, 5]
    script += [
        (history, [], ERROR),  # the server failed
        (history, [13, 14], OK),  # the retry: same prompt, stored as a delta of the errored call
        (history, [15], OK),  # the SDK retried again; the harness went on with this answer
    ]
    history = history + [15] + [6]
    script.append((history, [16, 17], OK))
    history = history + [16, 17] + [7]
    history = history[:4] + [99] + history[5:]  # the harness rewrote an early message (the first reply)
    script.append((history, [18], OK))
    sent = [Sent(f"s{seq}", seq, prompt, completion, [-0.25 * (j + 1) for j in range(len(completion))], status, 1)
            for seq, (prompt, completion, status) in enumerate(script)]
    records = as_records(sent, rollout="store-r")
    store.add_calls(records[:3])
    store.add_calls(records[3:])  # this batch's predecessors come from the database
    stored = store.rollout_calls("store-r", 0)
    # s3 retries s2: it extends the errored s1 (the latest call whose prompt + completion begins its prompt)
    assert [c.parent_call_id for c in stored] == [None, "s0", "s1", "s1", "s3", None]

    from_store = merge_calls_into_rows(stored)
    assert_same_rows(from_store, merge_calls_into_rows(calls_from_records(records)))
    assert [r.call_ids for r in from_store.rows] == [("s0", "s3", "s4"), ("s5",)]
    assert dict(from_store.stats.dropped) == {"error": 1, "duplicate": 1}
    assert dict(from_store.stats.splits) == {"history_edited": 1}
    check_rows(from_store, sent, None)


def test_a_retry_stored_against_an_older_call_than_the_row_it_repeats(store: TraceStore):
    """Found by the property test when the store first chose longest-prefix bases: c2 and c3 are stored as
    deltas of c0 (c1's prompt + completion is longer than their prompt), but c3 repeats c2, the last call of
    the row c2 started; rows must follow the prompt, not the base."""
    script = [([0], [0]), ([0, 0], [0, 0]), ([0, 0, 0], [0]), ([0, 0, 0], [1])]
    sent = [Sent(f"x{seq}", seq, prompt, completion, [-0.5] * len(completion), OK, 1)
            for seq, (prompt, completion) in enumerate(script)]
    records = as_records(sent, rollout="older-base")
    store.add_calls(records)
    stored = store.rollout_calls("older-base", 0)
    assert [c.parent_call_id for c in stored] == [None, "x0", "x0", "x0"]
    from_store = merge_calls_into_rows(stored)
    assert_same_rows(from_store, merge_calls_into_rows(calls_from_records(records)))
    assert [r.call_ids for r in from_store.rows] == [("x0", "x1"), ("x3",)]
    assert dict(from_store.stats.splits) == {"template_drift": 1}
    assert dict(from_store.stats.dropped) == {"duplicate": 1}


def test_interleaved_conversations_are_stored_as_deltas_and_merge_into_a_row_each(store: TraceStore):
    """An agent and its sub-agent alternate; each call is stored against its own conversation's last call (not
    the call just before it), so only new tokens are stored, and the rows are those of the full records: one
    per conversation, the sub-agent's first call counted as ``new_conversation``."""
    histories = [[1, 2], [1, 7]]
    sent = []
    for seq in range(8):
        history = histories[seq % 2]
        completion = [50 + seq, 60 + seq]
        sent.append(Sent(f"i{seq}", seq, list(history), completion, [-0.5, -0.25], OK, 1))
        histories[seq % 2] = history + completion + [3, seq]
    records = as_records(sent, rollout="interleaved")
    store.add_calls(records[:3])
    store.add_calls(records[3:])
    stored = store.rollout_calls("interleaved", 0)
    assert [c.parent_call_id for c in stored] == [None, None] + [f"i{seq}" for seq in range(6)]
    assert [len(c.prompt_suffix) for c in stored] == [2, 2] + [2] * 6
    from_store = merge_calls_into_rows(stored)
    assert_same_rows(from_store, merge_calls_into_rows(calls_from_records(records)))
    assert [r.call_ids for r in from_store.rows] == [("i0", "i2", "i4", "i6"), ("i1", "i3", "i5", "i7")]
    assert dict(from_store.stats.splits) == {"new_conversation": 1}


_counter = itertools.count()


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory) -> Iterator[TraceStore]:
    """One migrated SQLite store for every random trajectory (each under its own rollout id)."""
    store = TraceStore.connect(f"sqlite:///{tmp_path_factory.mktemp('rows_store') / 'rows_store.db'}")
    store.upgrade()
    yield store
    store.close()


@settings(max_examples=int(os.environ.get("HARNESSRL_ROWS_STORE_EXAMPLES", "40")), deadline=None)
@given(sent=st.one_of(trajectories(), interleaved_trajectories()), max_row=limits, data=st.data())
def test_random_trajectories_through_sqlite_store(sqlite_store, sent, max_row, data):
    """Written in batches of drawn sizes, so some calls find their best base stored and some do not."""
    rollout = f"h{next(_counter)}"
    records = as_records(sent, rollout=rollout)
    for record in records:
        record.call_id = f"{rollout}-{record.call_id}"
    start = 0
    while start < len(records):
        size = data.draw(st.integers(1, len(records) - start), label="batch")
        sqlite_store.add_calls(records[start : start + size])
        start += size
    from_store = merge_calls_into_rows(sqlite_store.rollout_calls(rollout, 0), max_row_tokens=max_row)
    assert_same_rows(from_store, merge_calls_into_rows(calls_from_records(records), max_row_tokens=max_row))


@settings(max_examples=150, deadline=None)
@given(sent=trajectories(), max_prompt=limits, max_row=limits)
def test_numpy_token_arrays_give_the_same_rows_as_lists(sent, max_prompt, max_row):
    """int32/float32 arrays (``np.frombuffer`` over the store's bytes) are accepted as they are."""
    calls = delta_encode(sent)
    arrays = [replace(c, prompt_suffix=np.asarray(c.prompt_suffix, dtype="<i4"),
                      completion_token_ids=np.asarray(c.completion_token_ids, dtype="<i4"),
                      logprobs=np.asarray(c.logprobs, dtype="<f4")) for c in calls]
    for mode in ("merge", "transition"):
        assert_same_rows(
            merge_calls_into_rows(calls, mode=mode, max_prompt_tokens=max_prompt, max_row_tokens=max_row),
            merge_calls_into_rows(arrays, mode=mode, max_prompt_tokens=max_prompt, max_row_tokens=max_row),
        )
