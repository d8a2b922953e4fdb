"""Running totals of a run (``run_counters``), kept in the transactions that change what they count.

A scheduler pass needs how many training rollouts exist (the next group's number) and how many attempts are in
each state (status and metrics). Counted over the rows, both cost every rollout the run ever made, so an
operator pass grew with the run (at 200,000 finished rollouts the counts were most of a pass). Rows a pass can
no longer change are counted once instead: a training rollout when it is created, an attempt when a learner
step consumes it (consumed attempts are final). What is still open is counted over the partial index
``ix_rollout_attempts_open``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from sqlalchemy import Connection, func, select

from harnessrl.store.records import RolloutState
from harnessrl.store.schema import RolloutAttempt, RunCounter
from harnessrl.store.statements import dialect_insert

TRAINING_ROLLOUTS = "training_rollouts"
CONSUMED = "consumed:"  # + state


def add(conn: Connection, run: str, amounts: Mapping[str, int]) -> None:
    """Add to counters inside the caller's transaction; names in sorted order, so two writers that touch the
    same counters lock them in the same order and never deadlock."""
    insert = dialect_insert(conn.dialect.name)
    for name in sorted(amounts):
        if amounts[name]:
            stmt = insert(RunCounter).values(run=run, name=name, value=amounts[name])
            conn.execute(stmt.on_conflict_do_update(index_elements=[RunCounter.run, RunCounter.name],
                                                    set_={"value": RunCounter.value + stmt.excluded.value}))


def add_consumed(conn: Connection, run: str, states: list[str]) -> None:
    add(conn, run, {CONSUMED + state: n for state, n in Counter(states).items()})


def read(conn: Connection, run: str) -> dict[str, int]:
    return {name: int(value) for name, value in
            conn.execute(select(RunCounter.name, RunCounter.value).where(RunCounter.run == run))}


def attempt_counts(conn: Connection, run: str) -> dict[RolloutState, int]:
    """Attempts per state (every state, zero included): the consumed ones from the counters, the open ones
    over the partial index."""
    counts = dict.fromkeys(RolloutState, 0)
    for name, value in read(conn, run).items():
        if name.startswith(CONSUMED):
            counts[RolloutState(name[len(CONSUMED):])] += value
    query = (select(RolloutAttempt.state, func.count())
             .where(RolloutAttempt.run == run, RolloutAttempt.consumed_by_step.is_(None))
             .group_by(RolloutAttempt.state))
    for state, value in conn.execute(query):
        counts[RolloutState(state)] += value
    return counts
