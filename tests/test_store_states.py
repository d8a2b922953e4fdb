"""The rollout state machine, alone and as enforced by the database under concurrent writers."""

from __future__ import annotations

import itertools
import threading

import pytest

from harnessrl.store import IllegalTransition, NotFound, RolloutState, TraceStore, check_transition, is_legal
from harnessrl.store.states import LEGAL_MOVES, Move

S = RolloutState
EXPECTED_LEGAL = {
    (S.QUEUED, S.RUNNING),
    (S.QUEUED, S.CANCELLED),
    (S.RUNNING, S.SUCCEEDED),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.TIMED_OUT),
    (S.RUNNING, S.CANCELLED),
}
ALL_PAIRS = list(itertools.product(RolloutState, RolloutState))


def test_legal_moves_are_exactly_the_documented_ones() -> None:
    assert {(a, b) for a, b in ALL_PAIRS if is_legal(a, b)} == EXPECTED_LEGAL
    for state in RolloutState:
        assert (not LEGAL_MOVES[state]) == state.terminal  # terminal states are final, others are not


@pytest.mark.parametrize(("src", "dst"), [p for p in ALL_PAIRS if p not in EXPECTED_LEGAL])
def test_illegal_move_raises_naming_both_states(src: RolloutState, dst: RolloutState) -> None:
    with pytest.raises(IllegalTransition) as info:
        check_transition(src, dst, "rollout r attempt 0")
    assert (info.value.from_state, info.value.to_state) == (src, dst)
    assert f"{src.value} -> {dst.value}" in str(info.value)
    assert "rollout r attempt 0" in str(info.value)


def _rollout(store: TraceStore, rollout_id: str | None = None) -> str:
    store.add_tasks("run", [{"id": "t"}])
    return store.create_rollout("run", "t", 0, rollout_id)


def _drive_to(store: TraceStore, rollout_id: str, state: RolloutState) -> None:
    if state is S.QUEUED:
        return
    if state is S.CANCELLED:
        store.transition(rollout_id, 0, S.CANCELLED)
        return
    store.transition(rollout_id, 0, S.RUNNING)
    if state is not S.RUNNING:
        store.transition(rollout_id, 0, state)


def test_every_move_in_the_database(store: TraceStore) -> None:
    """Every (from, to) pair against real rows: legal ones apply, illegal ones raise and change nothing."""
    for number, (src, dst) in enumerate(ALL_PAIRS):
        rollout_id = _rollout(store, f"r{number}")
        _drive_to(store, rollout_id, src)
        assert store.get_attempt(rollout_id, 0).state is src
        if (src, dst) in EXPECTED_LEGAL:
            store.transition(rollout_id, 0, dst, reason=f"to {dst.value}")
            attempt = store.get_attempt(rollout_id, 0)
            assert attempt.state is dst
            assert attempt.reason == f"to {dst.value}"
            assert (attempt.finished_at is not None) == dst.terminal
        else:
            before = store.get_attempt(rollout_id, 0)
            with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
                store.transition(rollout_id, 0, dst)
            assert store.get_attempt(rollout_id, 0) == before


def test_running_records_start_time_and_policy_version(store: TraceStore) -> None:
    rollout_id = _rollout(store)
    queued = store.get_attempt(rollout_id, 0)
    assert (queued.state, queued.started_at, queued.policy_version_start) == (S.QUEUED, None, None)
    store.transition(rollout_id, 0, S.RUNNING, policy_version=7)
    running = store.get_attempt(rollout_id, 0)
    assert running.started_at is not None and running.policy_version_start == 7


def test_compare_and_set_loses_cleanly(store_url: str) -> None:
    """Two writers (separate connections, as separate pods would be) both saw 'queued'; only one wins."""
    with TraceStore.connect(store_url) as a, TraceStore.connect(store_url) as b:
        a.upgrade()
        rollout_id = _rollout(a)
        assert a.try_transition(rollout_id, 0, S.QUEUED, S.RUNNING, reason="pod a") is True
        assert b.try_transition(rollout_id, 0, S.QUEUED, S.RUNNING, reason="pod b") is False
        attempt = b.get_attempt(rollout_id, 0)
        assert (attempt.state, attempt.reason) == (S.RUNNING, "pod a")
        with pytest.raises(IllegalTransition, match="running -> running"):
            b.transition(rollout_id, 0, S.RUNNING)  # the loser re-checks against the state it lost to


def test_racing_threads_exactly_one_wins(store_url: str) -> None:
    """Eight threads, each with its own store, race to move the same attempt; one succeeds, seven refuse."""
    with TraceStore.connect(store_url) as setup:
        setup.upgrade()
        rollout_id = _rollout(setup)
    stores = [TraceStore.connect(store_url) for _ in range(8)]
    outcomes: list[str] = []
    barrier = threading.Barrier(len(stores))

    def race(s: TraceStore, target: RolloutState) -> None:
        barrier.wait()
        try:
            s.transition(rollout_id, 0, target)
            outcomes.append("won")
        except IllegalTransition:
            outcomes.append("refused")

    targets = [S.RUNNING] * 4 + [S.CANCELLED] * 4
    threads = [threading.Thread(target=race, args=(s, t)) for s, t in zip(stores, targets, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = stores[0].get_attempt(rollout_id, 0).state
    for s in stores:
        s.close()
    # Either one RUNNING won and then one CANCELLED (running -> cancelled is legal) may also win, or a
    # CANCELLED won first and everything else was refused. Never two winners of the same move.
    assert outcomes.count("won") in (1, 2)
    assert outcomes.count("won") + outcomes.count("refused") == 8
    if outcomes.count("won") == 2:
        assert final is S.CANCELLED
    assert final in (S.RUNNING, S.CANCELLED)


def test_finish_attempt_needs_a_terminal_state(store: TraceStore) -> None:
    rollout_id = _rollout(store)
    store.transition(rollout_id, 0, S.RUNNING)
    with pytest.raises(ValueError, match="terminal state"):
        store.finish_attempt(rollout_id, 0, S.QUEUED)
    store.finish_attempt(rollout_id, 0, S.TIMED_OUT, reason="1800 s")
    attempt = store.get_attempt(rollout_id, 0)
    assert (attempt.state, attempt.reason) == (S.TIMED_OUT, "1800 s")
    with pytest.raises(IllegalTransition, match="timed_out -> succeeded"):
        store.finish_attempt(rollout_id, 0, S.SUCCEEDED)


def test_new_attempt_only_after_a_failed_attempt(store: TraceStore) -> None:
    rollout_id = _rollout(store)
    with pytest.raises(IllegalTransition, match="queued -> queued"):
        store.new_attempt(rollout_id)
    store.transition(rollout_id, 0, S.RUNNING)
    store.finish_attempt(rollout_id, 0, S.FAILED, "harness exit 1")
    assert store.new_attempt(rollout_id) == 1
    assert store.get_attempt(rollout_id, 1).state is S.QUEUED
    assert store.get_attempt(rollout_id, 0).state is S.FAILED  # history kept
    with pytest.raises(IllegalTransition):
        store.new_attempt(rollout_id)  # attempt 1 is still queued
    store.transition(rollout_id, 1, S.RUNNING)
    store.finish_attempt(rollout_id, 1, S.SUCCEEDED)
    with pytest.raises(IllegalTransition, match="succeeded -> queued"):
        store.new_attempt(rollout_id)


def test_racing_new_attempts_add_exactly_one(store_url: str) -> None:
    with TraceStore.connect(store_url) as setup:
        setup.upgrade()
        rollout_id = _rollout(setup)
        setup.transition(rollout_id, 0, S.RUNNING)
        setup.finish_attempt(rollout_id, 0, S.FAILED)
    stores = [TraceStore.connect(store_url) for _ in range(4)]
    outcomes: list[object] = []
    barrier = threading.Barrier(len(stores))

    def retry(s: TraceStore) -> None:
        barrier.wait()
        try:
            outcomes.append(s.new_attempt(rollout_id))
        except IllegalTransition:
            outcomes.append("refused")

    threads = [threading.Thread(target=retry, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes, key=str) == [1, "refused", "refused", "refused"]
    with pytest.raises(NotFound):
        stores[0].get_attempt(rollout_id, 2)
    for s in stores:
        s.close()


def test_unknown_attempt_is_reported(store: TraceStore) -> None:
    with pytest.raises(NotFound, match="nope"):
        store.transition("nope", 0, S.RUNNING)
    with pytest.raises(NotFound):
        store.try_transition("nope", 0, S.QUEUED, S.RUNNING)
    with pytest.raises(NotFound):
        store.new_attempt("nope")


def test_many_moves_in_one_transaction_apply_only_where_the_state_still_matches(store: TraceStore) -> None:
    """try_transitions: each move is its own compare-and-set; the ones that lost or name no attempt are left."""
    queued, running, missing = _rollout(store, "q"), _rollout(store, "r"), "missing"
    store.transition(running, 0, S.RUNNING, policy_version=1)
    moved = store.try_transitions(
        [
            Move(queued, 0, S.QUEUED, S.RUNNING, policy_version=3),
            Move(running, 0, S.QUEUED, S.RUNNING),  # lost: it is running already
            Move(missing, 0, S.QUEUED, S.RUNNING),
        ]
    )
    assert moved == {(queued, 0)}
    claimed = store.get_attempt(queued, 0)
    assert (claimed.state, claimed.policy_version_start) == (S.RUNNING, 3)
    assert store.get_attempt(running, 0).policy_version_start == 1
    assert store.try_transitions([Move(running, 0, S.RUNNING, S.FAILED, "NoReward")]) == {(running, 0)}
    assert (store.get_attempt(running, 0).state, store.get_attempt(running, 0).reason) == (S.FAILED, "NoReward")


def test_grouped_moves_each_keep_their_own_compare_and_set(store: TraceStore) -> None:
    """Moves with the same values are one UPDATE per 500 attempts: every attempt still moves only from its
    expected state, with its own group's reason and version, across chunk boundaries."""
    store.add_tasks("run", [{"id": "t"}])
    ids = [f"g{i:04d}" for i in range(1100)]
    store.create_rollouts("run", "t", [(rollout_id, 0) for rollout_id in ids])
    lost = set(ids[::7])  # already running under version 1: their claim below must lose
    assert store.try_transitions([Move(i, 0, S.QUEUED, S.RUNNING, policy_version=1) for i in sorted(lost)]) == {
        (i, 0) for i in lost
    }
    claims = [Move(i, 0, S.QUEUED, S.RUNNING, policy_version=4) for i in ids]
    claimed = store.try_transitions(claims)
    assert claimed == {(i, 0) for i in ids if i not in lost}
    settled = store.try_transitions(
        [Move(i, 0, S.RUNNING, S.FAILED, "NoReward" if n % 2 else "HarnessFailed: exit code 3")
         for n, i in enumerate(ids)]
        + [Move("missing", 0, S.RUNNING, S.FAILED, "NoReward")]
    )
    assert settled == {(i, 0) for i in ids}
    attempts = store.get_attempts((i, 0) for i in ids)
    for n, rollout_id in enumerate(ids):
        attempt = attempts[(rollout_id, 0)]
        assert attempt.state is S.FAILED
        assert attempt.policy_version_start == (1 if rollout_id in lost else 4)
        assert attempt.reason == ("NoReward" if n % 2 else "HarnessFailed: exit code 3")
        assert attempt.finished_at is not None and attempt.started_at is not None


def test_an_attempt_moved_twice_in_one_call_sees_its_first_move(store: TraceStore) -> None:
    rollout_id = _rollout(store, "twice")
    moved = store.try_transitions(
        [Move(rollout_id, 0, S.QUEUED, S.RUNNING), Move(rollout_id, 0, S.RUNNING, S.SUCCEEDED)]
    )
    assert moved == {(rollout_id, 0)}
    assert store.get_attempt(rollout_id, 0).state is S.SUCCEEDED


def test_an_illegal_move_among_many_changes_nothing(store: TraceStore) -> None:
    first, second = _rollout(store, "a"), _rollout(store, "b")
    with pytest.raises(IllegalTransition, match="queued -> succeeded"):
        store.try_transitions([Move(first, 0, S.QUEUED, S.RUNNING), Move(second, 0, S.QUEUED, S.SUCCEEDED)])
    assert store.get_attempt(first, 0).state is S.QUEUED


def test_attempts_are_read_in_bulk_and_missing_keys_are_absent(store: TraceStore) -> None:
    ids = [_rollout(store, f"bulk{i}") for i in range(3)]
    store.transition(ids[1], 0, S.RUNNING)
    found = store.get_attempts([(ids[0], 0), (ids[1], 0), (ids[1], 5), ("nope", 0)])
    assert sorted(found) == [(ids[0], 0), (ids[1], 0)]
    assert found[(ids[1], 0)] == store.get_attempt(ids[1], 0)
    assert found[(ids[0], 0)].state is S.QUEUED
