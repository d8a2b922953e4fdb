"""The rollout attempt state machine: which moves are legal.

Kept apart from the database code so the scheduler, the proxy and the operator can ask "may I?" without a
connection; the store enforces the same table with a conditional UPDATE so concurrent writers cannot race
past it.
"""

from __future__ import annotations

from harnessrl.store.records import RolloutState

S = RolloutState

LEGAL_MOVES: dict[RolloutState, frozenset[RolloutState]] = {
    S.QUEUED: frozenset({S.RUNNING, S.CANCELLED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.TIMED_OUT, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.TIMED_OUT: frozenset(),
    S.CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    """A state move the machine does not allow; names both ends so the log line explains itself."""

    def __init__(self, from_state: RolloutState, to_state: RolloutState, subject: str = "") -> None:
        self.from_state = from_state
        self.to_state = to_state
        allowed = ", ".join(sorted(s.value for s in LEGAL_MOVES[from_state])) or "nothing (it is final)"
        where = f"{subject}: " if subject else ""
        super().__init__(
            f"{where}illegal rollout state move {from_state.value} -> {to_state.value}; "
            f"from {from_state.value} the allowed moves are: {allowed}"
        )


def is_legal(from_state: RolloutState, to_state: RolloutState) -> bool:
    return to_state in LEGAL_MOVES[from_state]


def check_transition(from_state: RolloutState, to_state: RolloutState, subject: str = "") -> None:
    """Raise ``IllegalTransition`` unless ``from_state -> to_state`` is a legal move."""
    if not is_legal(from_state, to_state):
        raise IllegalTransition(from_state, to_state, subject)
