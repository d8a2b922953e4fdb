"""``llm_calls.allowed_ids``: the packing of a constrained call's allowed sets, and the errors that name the field."""

from __future__ import annotations

import pytest

from harnessrl.store.call_rows import ALLOWED_MAX, pack_allowed, unpack_allowed


def test_sets_round_trip_and_a_call_without_known_sets_stores_null():
    sets = [[5, 9], [], [6], [1, 2, 3]]
    assert unpack_allowed(pack_allowed(sets, 4)) == sets
    assert pack_allowed([[], [], []], 3) is None and pack_allowed(None, 3) is None
    assert unpack_allowed(None) is None


@pytest.mark.parametrize(("sets", "message"), [
    ([[1]], r"one list per completion token \(2\)"),
    ([[1], "x"], r"allowed_token_ids\[1\] must be a list"),
    ([[1], list(range(ALLOWED_MAX + 1))], f"at most {ALLOWED_MAX}"),
    ([[1], [2**40]], "allowed_token_ids hold"),
])  # fmt: skip
def test_a_malformed_set_is_refused_naming_the_field(sets, message):
    with pytest.raises(ValueError, match=message):
        pack_allowed(sets, 2)
