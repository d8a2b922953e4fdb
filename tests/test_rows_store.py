"""The row builder on calls read back from the real trace store (SQLite and PostgreSQL), and on numpy input.

The store decides on its own which calls become deltas; rows built from ``rollout_calls`` must be exactly the
rows built from the full records the proxy wrote.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, given, settings
from test_rows_properties import Sent, as_records, check_rows, delta_encode, limits, trajectories

from harnessrl.store import CallStatus, TraceStore
from harnessrl.trainer.rows import calls_from_records, merge_calls_into_rows

OK, ERROR = CallStatus.OK, CallStatus.ERROR


def assert_same_rows(a, b) -> None:
    assert len(a.rows) == len(b.rows)
    for x, y in zip(a.rows, b.rows):
        assert x.call_ids == y.call_ids and x.completion_spans == y.completion_spans
        np.testing.assert_array_equal(x.input_ids, y.input_ids)
        np.testing.assert_array_equal(x.loss_mask, y.loss_mask)
        np.testing.assert_array_equal(x.rollout_logprobs, y.rollout_logprobs)
    assert a.stats == b.stats


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
    history = [1, 2, 99] + history[3:]  # the harness rewrote an early message
    script.append((history, [18], OK))
    sent = [Sent(f"s{seq}", seq, prompt, completion, [-0.25 * (j + 1) for j in range(len(completion))], status, 1)
            for seq, (prompt, completion, status) in enumerate(script)]
    records = as_records(sent, rollout="store-r")
    store.add_calls(records[:3])
    store.add_calls(records[3:])  # this batch's predecessors come from the database
    stored = store.rollout_calls("store-r", 0)
    assert [c.parent_call_id for c in stored] == [None, "s0", "s1", None, "s3", None]

    from_store = merge_calls_into_rows(stored)
    assert_same_rows(from_store, merge_calls_into_rows(calls_from_records(records)))
    assert [r.call_ids for r in from_store.rows] == [("s0", "s3", "s4"), ("s5",)]
    assert dict(from_store.stats.dropped) == {"error": 1, "duplicate": 1}
    assert dict(from_store.stats.splits) == {"history_edited": 1}
    check_rows(from_store, sent, None)


_counter = itertools.count()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sent=trajectories(), max_row=limits)
def test_random_trajectories_through_sqlite_store(tmp_path_factory, sent, max_row):
    path = tmp_path_factory.getbasetemp() / "rows_store.db"
    store = TraceStore.connect(f"sqlite:///{path}")
    try:
        store.upgrade()
        rollout = f"h{next(_counter)}"
        records = as_records(sent, rollout=rollout)
        for record in records:
            record.call_id = f"{rollout}-{record.call_id}"
        store.add_calls(records)
        stored = store.rollout_calls(rollout, 0)
    finally:
        store.close()
    from_store = merge_calls_into_rows(stored, max_row_tokens=max_row)
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
