"""The rollout attempt state machine: which moves are legal.

Kept apart from the database code so the scheduler, the proxy and the operator can ask "may I?" without a
connection; the store enforces the same table with a conditional UPDATE so concurrent writers cannot race
past it.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class AttemptSettled(ValueError):
    """A reward for an attempt whose outcome is already decided (succeeded, failed, timed out, cancelled).

    Refused rather than stored: the scheduler settled the attempt without it (a harness that exited before
    its reward was stored is a NoReward failure), and a reward written afterwards would silently turn a
    failed rollout's row into a scored one that no state move ever accounted for.
    """

    def __init__(self, rollout_id: str, attempt: int, state: RolloutState) -> None:
        self.rollout_id = rollout_id
        self.attempt = attempt
        self.state = state
        super().__init__(
            f"rollout {rollout_id} attempt {attempt} is already {state.value}: a reward for a settled attempt "
            "is not stored; report the reward before the harness exits (POST /v1/reward returns once it is "
            "stored)"
        )


def is_legal(from_state: RolloutState, to_state: RolloutState) -> bool:
    return to_state in LEGAL_MOVES[from_state]


def check_transition(from_state: RolloutState, to_state: RolloutState, subject: str = "") -> None:
    """Raise ``IllegalTransition`` unless ``from_state -> to_state`` is a legal move."""
    if not is_legal(from_state, to_state):
        raise IllegalTransition(from_state, to_state, subject)


@dataclass(frozen=True)
class Move:
    """One compare-and-set move ``expected -> to`` of an attempt, for ``TraceStore.try_transitions``.

    ``policy_version`` is recorded as the version the attempt started under (moves to running)."""

    rollout_id: str
    attempt: int
    expected: RolloutState
    to: RolloutState
    reason: str | None = None
    policy_version: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.rollout_id, self.attempt

    def check(self) -> None:
        check_transition(self.expected, self.to, f"rollout {self.rollout_id} attempt {self.attempt}")
