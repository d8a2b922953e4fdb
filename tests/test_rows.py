"""Hand-written cases for the row builder: each rule once, with the exact rows it must produce."""

from __future__ import annotations

import numpy as np
import pytest

from harnessrl.store.records import CallRecord, CallStatus, StoredCall
from harnessrl.trainer.rows import RowStats, calls_from_records, merge_calls_into_rows

OK, ERROR, ABORTED = CallStatus.OK, CallStatus.ERROR, CallStatus.ABORTED


def call(call_id, seq, suffix, completion, parent=None, status=OK, version=3, rollout="r", attempt=0):
    logprobs = [-(seq + 1) - j / 10 for j in range(len(completion))]
    return StoredCall(call_id, rollout, attempt, seq, parent, suffix, completion, logprobs, version, status)


def arrays(row):
    return row.input_ids.tolist(), row.loss_mask.tolist(), row.rollout_logprobs.tolist()


def test_delta_calls_extend_one_row_with_masked_gaps():
    calls = [
        call("a", 0, [1, 2, 3], [4, 5]),
        call("b", 1, [6, 7], [8], parent="a"),
        call("c", 2, [], [9, 9], parent="b", version=4),
    ]
    result = merge_calls_into_rows(calls)
    (row,) = result.rows
    ids, mask, logprobs = arrays(row)
    assert ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 9]
    assert mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert logprobs == pytest.approx([0, 0, 0, -1, -1.1, 0, 0, -2, -3, -3.1])
    assert row.call_ids == ("a", "b", "c")
    assert row.completion_spans == ((3, 5), (7, 8), (8, 10))
    assert row.policy_versions == (3, 3, 4) and row.min_policy_version == 3
    assert (row.rollout_id, row.attempt) == ("r", 0)
    assert result.stats.rows == 1 and result.stats.merged_calls == 2 and result.stats.row_tokens == 10
    assert result.stats.generated_tokens == 5 and not result.stats.splits and not result.stats.dropped
    with pytest.raises(ValueError):  # rows are read-only: transition rows share memory
        row.input_ids[0] = 7


@pytest.mark.parametrize(
    ("third_prompt", "reason"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 9], "template_drift"),  # differs inside the previous completion [7, 8]
        ([1, 2, 3, 4, 5, 6, 7], "template_drift"),  # ends inside the previous completion
        ([1, 2, 3, 9, 5, 6, 7, 8, 10], "history_edited"),  # differs inside the previous prompt, not shorter
        ([1, 2, 3, 4, 9, 6, 7, 8], "history_edited"),  # as long as the row, differs in the previous prompt
        ([1, 2, 3, 4], "truncation"),  # shorter than the previous prompt
        ([1, 2, 3, 5, 6, 7, 8], "truncation"),  # a middle token cut out: shorter than the row it left
        ([1, 7, 3, 4, 5, 6, 7, 8], "new_conversation"),  # starts with no kept call's prompt
        ([1, 2], "new_conversation"),  # shorter than the first kept prompt [1, 2, 3]
        ([9, 9, 9], "new_conversation"),  # another conversation (a sub-agent)
    ],
)
def test_a_prompt_that_leaves_the_row_starts_a_new_one_and_counts_why(third_prompt, reason):
    calls = [call("a", 0, [1, 2, 3], [4, 5]), call("b", 1, [1, 2, 3, 4, 5, 6], [7, 8]), call("c", 2, third_prompt, [8])]
    result = merge_calls_into_rows(calls)
    assert [row.call_ids for row in result.rows] == [("a", "b"), ("c",)]
    assert result.rows[1].input_ids.tolist() == third_prompt + [8]
    assert dict(result.stats.splits) == {reason: 1}
    assert result.stats.merged_calls == 1
    # each row says why it began: the first none, the second this split, where it leaves the first row's content
    row_content = [1, 2, 3, 4, 5, 6, 7, 8]
    leaves = next((i for i, (a, b) in enumerate(zip(third_prompt, row_content)) if a != b),
                  min(len(third_prompt), len(row_content)))
    assert [(row.split_reason, row.split_at) for row in result.rows] == [(None, None), (reason, leaves)]
    transitions = merge_calls_into_rows(calls, mode="transition").rows
    assert [(row.split_reason, row.split_at) for row in transitions] == [(None, None), (None, None), (reason, leaves)]


def test_a_split_after_the_first_call_is_template_drift_or_a_new_conversation():
    """With one call in the row, a prompt that keeps that call's prompt but re-renders its answer drifted; one
    that does not start with it (edited, cut or another conversation) starts a new conversation."""
    for second_prompt, reason in (([1, 2, 3, 4, 9], "template_drift"), ([1, 2], "new_conversation"),
                                  ([1, 7, 3, 4, 5, 6], "new_conversation")):
        result = merge_calls_into_rows([call("a", 0, [1, 2, 3], [4, 5]), call("b", 1, second_prompt, [8])])
        assert dict(result.stats.splits) == {reason: 1}


def test_a_parent_less_prompt_that_extends_the_row_is_merged():
    calls = [call("a", 0, [1, 2, 3], [4, 5]), call("b", 1, [1, 2, 3, 4, 5, 6], [7])]
    (row,) = merge_calls_into_rows(calls).rows
    assert arrays(row)[0] == [1, 2, 3, 4, 5, 6, 7] and row.call_ids == ("a", "b")


def test_retry_keeps_the_last_one_unless_the_next_call_extends_an_earlier_one():
    first, retry = call("a", 0, [1, 2], [3]), call("a2", 1, [1, 2], [4])
    result = merge_calls_into_rows([first, retry])
    assert [r.call_ids for r in result.rows] == [("a2",)]
    assert dict(result.stats.dropped) == {"duplicate": 1}

    # The harness went on with the first answer: the next call extends "a", so "a" is the one kept.
    following = call("b", 2, [1, 2, 3, 5], [6])
    result = merge_calls_into_rows([first, retry, following])
    (row,) = result.rows
    assert row.call_ids == ("a", "b")
    assert arrays(row)[:2] == ([1, 2, 3, 5, 6], [0, 0, 1, 0, 1])
    assert dict(result.stats.dropped) == {"duplicate": 1} and not result.stats.splits


def test_an_errored_call_is_dropped_and_its_retry_extends_the_row_through_it():
    calls = [
        call("a", 0, [1, 2], [3]),
        call("e", 1, [4], [], parent="a", status=ERROR),  # the server failed; the harness resends
        call("a2", 2, [], [5, 6], parent="e"),  # same prompt as "e", stored as its delta
    ]
    result = merge_calls_into_rows(calls)
    (row,) = result.rows
    assert arrays(row)[:2] == ([1, 2, 3, 4, 5, 6], [0, 0, 1, 0, 1, 1])
    assert row.call_ids == ("a", "a2")
    assert dict(result.stats.dropped) == {"error": 1}


def test_tokens_of_a_dropped_call_the_harness_went_on_with_are_context_with_mask_zero():
    calls = [
        call("a", 0, [1], [2]),
        call("x", 1, [3], [4, 5], parent="a", status=ABORTED),  # partial answer the harness kept
        call("b", 2, [6], [7], parent="x"),
    ]
    (row,) = merge_calls_into_rows(calls).rows
    assert arrays(row)[:2] == ([1, 2, 3, 4, 5, 6, 7], [0, 1, 0, 0, 0, 0, 1])


def test_an_errored_call_with_an_edited_history_is_set_aside_and_its_retry_starts_a_new_row():
    calls = [
        call("a", 0, [1, 2], [3]),
        call("e", 1, [1, 9, 3, 4], [], status=ERROR),
        call("b", 2, [5], [6], parent="e"),
    ]
    result = merge_calls_into_rows(calls)
    assert [arrays(r)[0] for r in result.rows] == [[1, 2, 3], [1, 9, 3, 4, 5, 6]]
    assert dict(result.stats.splits) == {"new_conversation": 1}  # it no longer starts with [1, 2]


def test_a_call_whose_parent_is_unknown_is_dropped_with_its_descendants():
    calls = [
        call("a", 0, [1], [2]),
        call("b", 1, [3], [4], parent="not-stored"),
        call("c", 2, [5], [6], parent="b"),
        call("d", 3, [1, 2, 7], [8]),
    ]
    result = merge_calls_into_rows(calls)
    assert [r.call_ids for r in result.rows] == [("a", "d")]
    assert dict(result.stats.dropped) == {"missing_parent": 2}


def test_a_parent_whose_tokens_were_overwritten_is_rebuilt_from_its_own_tokens():
    # "e" sat past the kept content; the retry "a2" of "a" cut the row back to "a"'s prompt. "f" names "e" as
    # parent (a store delta-encodes a call against any earlier call it extends): "e" is rebuilt from its own
    # tokens and its parent's, and the rows are those of the full records.
    calls = [
        call("a", 0, [1], [2]),
        call("e", 1, [3], [], parent="a", status=ERROR),
        call("a2", 2, [1], [4]),
        call("f", 3, [5], [6], parent="e"),
    ]
    result = merge_calls_into_rows(calls)
    assert [r.call_ids for r in result.rows] == [("a", "f")]  # "f" extends "a", which is swapped back in
    assert arrays(result.rows[0])[0] == [1, 2, 3, 5, 6]
    assert dict(result.stats.dropped) == {"error": 1, "duplicate": 1}
    full = [call("a", 0, [1], [2]), call("e", 1, [1, 2, 3], [], status=ERROR), call("a2", 2, [1], [4]),
            call("f", 3, [1, 2, 3, 5], [6])]
    assert merge_calls_into_rows(full).stats == result.stats


def test_length_limits_drop_or_cut_and_count():
    calls = [
        call("a", 0, [1, 2], [3, 4]),
        call("b", 1, [5], [6, 7, 8], parent="a"),  # prompt 5, completion cut to 2 by max_row_tokens=7
        call("c", 2, [9], [10], parent="b"),  # prompt 9 >= 7: no room
    ]
    result = merge_calls_into_rows(calls, max_row_tokens=7)
    (row,) = result.rows
    assert arrays(row)[:2] == ([1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 0, 1, 1])
    assert row.completion_spans == ((2, 4), (5, 7))
    assert result.stats.truncated_completions == 1 and result.stats.truncated_tokens == 1
    assert dict(result.stats.dropped) == {"row_too_long": 1}

    result = merge_calls_into_rows(calls, max_prompt_tokens=4)
    assert [r.call_ids for r in result.rows] == [("a",)]
    assert dict(result.stats.dropped) == {"prompt_too_long": 2}


def test_empty_errored_and_malformed_calls_make_no_rows():
    bad = call("m", 2, [1], [2, 3])
    bad.logprobs = [-1.0]
    calls = [call("e", 0, [1], [], status=ERROR), call("z", 1, [1], []), bad]
    result = merge_calls_into_rows(calls)
    assert result.rows == []
    assert dict(result.stats.dropped) == {"error": 1, "empty": 1, "malformed": 1}
    assert result.stats.calls == 3 and result.stats.rows == 0


def test_transition_mode_one_row_per_call_sharing_the_prefix():
    calls = [call("a", 0, [1, 2], [3]), call("b", 1, [4], [5, 6], parent="a")]
    result = merge_calls_into_rows(calls, mode="transition")
    assert [arrays(r)[:2] for r in result.rows] == [([1, 2, 3], [0, 0, 1]), ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 1, 1])]
    assert result.stats.rows == 2 and result.stats.merged_calls == 0 and result.stats.row_tokens == 9


def test_calls_out_of_seq_order_are_sorted():
    calls = [call("b", 1, [3], [4], parent="a"), call("a", 0, [1], [2])]
    (row,) = merge_calls_into_rows(calls).rows
    assert row.call_ids == ("a", "b")


def test_calls_from_records_feeds_full_records_through_the_same_builder():
    record = CallRecord(call_id="a", run="x", rollout_id="r", attempt=1, seq=0, route="chat", request={},
                        response=None, prompt_token_ids=[1, 2], completion_token_ids=[3], logprobs=[-0.5],
                        policy_version=2, status=OK, finish_reason="stop")
    (stored,) = calls_from_records([record])
    assert stored.parent_call_id is None and stored.prompt_suffix == [1, 2]
    assert (stored.rollout_id, stored.attempt, stored.policy_version, stored.finish_reason) == ("r", 1, 2, "stop")
    (row,) = merge_calls_into_rows([stored]).rows
    assert arrays(row) == ([1, 2, 3], [0, 0, 1], [0, 0, -0.5])


@pytest.mark.parametrize(
    ("calls", "kwargs", "message"),
    [
        ([call("a", 0, [1], [2]), call("b", 1, [1], [2], rollout="other")], {}, r"calls\[1\]: belongs to rollout"),
        ([call("a", 0, [1], [2]), call("a", 1, [1], [2])], {}, r"calls\[1\]\.call_id: 'a' appears twice"),
        ([], {"mode": "rows"}, "mode: 'rows' is not a row mode"),
        ([], {"max_row_tokens": 0}, "max_row_tokens: 0 is below 1"),
    ],
)
def test_bad_input_is_a_one_line_error_naming_the_field(calls, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        merge_calls_into_rows(calls, **kwargs)
    assert "\n" not in str(info.value)


def test_an_attempt_with_two_calls_at_one_seq_is_skipped_with_a_warning_naming_it(caplog):
    """Which of the two came first is unknown, so the attempt trains nothing; the learner goes on."""
    calls = [call("a", 1, [1], [2], rollout="r9", attempt=2), call("b", 1, [1], [3], rollout="r9", attempt=2),
             call("c", 0, [1], [2], rollout="r9", attempt=2)]
    with caplog.at_level("WARNING", logger="harnessrl.trainer.rows"):
        result = merge_calls_into_rows(calls)
    assert result.rows == []
    metrics = result.stats.as_metrics()
    assert (metrics["calls"], metrics["dropped_duplicate_seq"], metrics["kept_calls"]) == (3, 3, 0)
    [record] = caplog.records
    assert "rollout r9 attempt 2" in record.getMessage() and "'a' and 'b' share seq 1" in record.getMessage()


def test_stats_add_up_and_flatten_for_metrics():
    one = merge_calls_into_rows([call("a", 0, [1], [2]), call("b", 1, [5], [6])]).stats
    two = merge_calls_into_rows([call("a", 0, [1], [], status=ERROR)]).stats
    total = RowStats()
    total.add(one)
    total.add(two)
    metrics = total.as_metrics()
    assert metrics["calls"] == 3 and metrics["rows"] == 2 and metrics["dropped_error"] == 1
    assert metrics["split_new_conversation"] == 1 and metrics["split_history_edited"] == 0
    assert np.isclose(metrics["row_tokens"], 4)


def test_interleaved_conversations_merge_into_one_row_each():
    """An agent (1, 2, ...) and its sub-agent (7, 7, ...) interleaved in one attempt: parent-less (full
    records) or as deltas against the call each one extends, every call continues its own conversation's
    row, and a retry of the other conversation's last call is recognised as a duplicate."""
    full = [
        call("a1", 0, [1, 2], [3]),
        call("b1", 1, [7, 7], [8]),
        call("a2", 2, [1, 2, 3, 4], [5]),
        call("b2", 3, [7, 7, 8, 9], [6]),
        call("b2-retry", 4, [7, 7, 8, 9], [6, 6]),
        call("a3", 5, [1, 2, 3, 4, 5, 0], [1]),
        call("b3", 6, [7, 7, 8, 9, 6, 6, 0], [2]),
    ]
    deltas = [
        call("a1", 0, [1, 2], [3]),
        call("b1", 1, [7, 7], [8]),
        call("a2", 2, [4], [5], parent="a1"),
        call("b2", 3, [9], [6], parent="b1"),
        call("b2-retry", 4, [9], [6, 6], parent="b1"),
        call("a3", 5, [0], [1], parent="a2"),
        call("b3", 6, [0], [2], parent="b2-retry"),
    ]
    for calls in (full, deltas):
        result = merge_calls_into_rows(calls)
        assert [row.call_ids for row in result.rows] == [("a1", "a2", "a3"), ("b1", "b2-retry", "b3")]
        assert [row.input_ids.tolist() for row in result.rows] == [[1, 2, 3, 4, 5, 0, 1], [7, 7, 8, 9, 6, 6, 0, 2]]
        assert result.rows[1].loss_mask.tolist() == [0, 0, 1, 0, 1, 1, 0, 1]
        assert result.stats.dropped == {"duplicate": 1}
        assert result.stats.row_tokens == 15 and result.stats.generated_tokens == 7


def test_sub_agents_started_side_by_side_with_one_task_are_rows_of_their_own():
    """Two sub-agents an agent started at once with the same task (Codex's spawn_agent): their first prompts are
    equal, so the second looks like a retry of the first and holds it out; once each goes on with its own
    answer, each is a row that trains its first answer (not a duplicate whose answer is context, mask 0)."""
    full = [
        call("a1", 0, [1, 2], [3]),
        call("c1", 1, [7, 7], [8]),
        call("a2", 2, [1, 2, 3, 4], [5]),
        call("d1", 3, [7, 7], [9]),
        call("c2", 4, [7, 7, 8, 0], [6]),
        call("d2", 5, [7, 7, 9, 0], [6]),
        call("a3", 6, [1, 2, 3, 4, 5, 0], [1]),
    ]
    deltas = [
        call("a1", 0, [1, 2], [3]),
        call("c1", 1, [7, 7], [8]),
        call("a2", 2, [4], [5], parent="a1"),
        call("d1", 3, [7, 7], [9]),
        call("c2", 4, [0], [6], parent="c1"),
        call("d2", 5, [0], [6], parent="d1"),
        call("a3", 6, [0], [1], parent="a2"),
    ]
    for calls in (full, deltas):
        result = merge_calls_into_rows(calls)
        assert [row.call_ids for row in result.rows] == [("a1", "a2", "a3"), ("c1", "c2"), ("d1", "d2")]
        assert [arrays(row)[:2] for row in result.rows[1:]] == [([7, 7, 8, 0, 6], [0, 0, 1, 0, 1]),
                                                                 ([7, 7, 9, 0, 6], [0, 0, 1, 0, 1])]
        assert not result.stats.dropped and result.stats.kept_calls == 7
    # a retry nobody went on with stays a duplicate
    result = merge_calls_into_rows(full[:4] + full[6:])
    assert dict(result.stats.dropped) == {"duplicate": 1} and [r.call_ids for r in result.rows][1] == ("d1",)
