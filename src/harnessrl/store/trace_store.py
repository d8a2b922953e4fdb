"""``TraceStore``: the one API the proxy, the scheduler and the learner use to read and write traces.

Every write is one short transaction. Anything several processes may do at once (state moves, duplicate
calls, creating the same rollout) is made safe by the database itself: conditional UPDATEs checked by
rowcount, ``INSERT ... ON CONFLICT DO NOTHING``, primary keys. No method holds state between calls, so any
number of stores may point at the same database.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, Engine, Row, func, literal, or_, select, tuple_, update
from sqlalchemy.engine import URL
from sqlalchemy.exc import IntegrityError

from harnessrl.store import attempt_budget, codec, migrate, run_counters
from harnessrl.store.call_copy import CopyConflict
from harnessrl.store.call_rows import (
    CallRebuilder,
    PreparedCall,
    check_id,
    stored_call_from_row,
    unpack_allowed,
)
from harnessrl.store.call_writer import prepare_batch, write_calls
from harnessrl.store.engine import WRITE_OPTION, StoreError, open_engine, safe_url
from harnessrl.store.records import AttemptRecord, CallRecord, RolloutState, StoredCall, utcnow
from harnessrl.store.schema import (
    EVALUATION,
    TRAIN,
    LlmCall,
    PolicyVersion,
    Rollout,
    RolloutAttempt,
    Run,
    Task,
)
from harnessrl.store.statements import (
    NotFound,
    RunOwnedElsewhere,
    attempt_row,
    chunks,
    dialect_insert,
    ensure_attempts,
    ensure_runs,
)
from harnessrl.store.states import AttemptSettled, IllegalTransition, Move, check_transition

DELTA_COLUMNS = (
    LlmCall.call_id, LlmCall.rollout_id, LlmCall.attempt, LlmCall.seq, LlmCall.base_call_id,
    LlmCall.prompt_offset, LlmCall.prompt_suffix, LlmCall.completion_ids, LlmCall.logprobs,
    LlmCall.logprobs_f64, LlmCall.policy_version, LlmCall.status, LlmCall.finish_reason,
)  # fmt: skip


KNOWN_ATTEMPTS_MAX = 200_000
OPEN_STATES = [s.value for s in RolloutState if not s.terminal]  # an attempt takes a reward only while open


class TraceStore:
    """Runs, tasks, rollouts, attempts, LLM calls, policy versions and learner steps on one database."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # Writes start with BEGIN IMMEDIATE on SQLite (see engine.py); PostgreSQL ignores the option.
        self._writer = engine.execution_options(**{WRITE_OPTION: True})
        self._insert = dialect_insert(engine.dialect.name)
        # Attempts whose rows this store saw committed: their calls skip the parent-row inserts (three
        # statements a batch). Cleared when large; only ever a shortcut, never a source of truth.
        self._known_attempts: set[tuple[str, int]] = set()

    @classmethod
    def connect(cls, url: str | URL, *, check: bool = True) -> TraceStore:
        """Open the store at ``url`` (raises ``StoreError`` with one line naming the URL and the fix).
        ``check=False`` skips the first connection: a proxy sidecar starts, and spools, while its database is
        down (a bad URL still fails here)."""
        return cls(open_engine(url, check=check))

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def url(self) -> str:
        return safe_url(self._engine.url)

    def upgrade(self) -> str | None:
        """Apply the migrations up to head (idempotent, safe when many processes start at once)."""
        return migrate.upgrade(self._engine)

    def close(self) -> None:
        self._engine.dispose()

    def release(self) -> None:
        """Close the connections the pool keeps idle; the next call opens one again (a proxy between its
        writes: ``proxy/writer.py``)."""
        self._engine.dispose()

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- runs and tasks ------------------------------------------------------------------------------------

    def ensure_run(self, run: str, spec: dict[str, Any] | None = None, owner: str | None = None) -> None:
        """Create the run if missing; a given ``spec`` replaces the stored one. With ``owner`` (an operator's
        ``<namespace>/<name>``) the run must be that owner's or nobody's yet (then it becomes the owner's):
        the store names runs by name alone, and two namespaces' runs of one name must not share rows.
        Raises RunOwnedElsewhere, changing nothing, when another owner has it."""
        check_id(run, "run")
        with self._writer.begin() as conn:
            if spec is None and owner is None:
                ensure_runs(conn, self._insert, [run])
                return
            if spec is not None:
                _require_json(spec, "spec")
            values = {"spec": spec} if spec is not None else {}
            if owner is not None:
                values["owner"] = owner
            stmt = self._insert(Run).values(name=run, created_at=utcnow(), **values)
            mine = or_(Run.owner.is_(None), Run.owner == owner) if owner is not None else None
            conn.execute(stmt.on_conflict_do_update(index_elements=[Run.name], set_=values, where=mine))
            if owner is not None:
                holder = conn.scalar(select(Run.owner).where(Run.name == run))
                if holder != owner:
                    raise RunOwnedElsewhere(run, holder)

    def add_tasks(self, run: str, tasks: Sequence[dict[str, Any]]) -> list[str]:
        """Store tasks (idempotent) and return their ids in order.

        A task's id is its ``"id"`` field when it has one, else a digest of its JSON, so loading the same
        task set twice (a restarted scheduler) adds nothing and returns the same ids.
        """
        check_id(run, "run")
        ids: list[str] = []
        rows: dict[str, dict[str, Any]] = {}
        for index, task in enumerate(tasks):
            if not isinstance(task, dict):
                raise ValueError(f"tasks[{index}] must be a JSON object, got {type(task).__name__}")
            text = _require_json(task, f"tasks[{index}]")
            task_id = str(task["id"]) if "id" in task else hashlib.sha256(text.encode()).hexdigest()[:32]
            check_id(task_id, f"tasks[{index}].id")
            ids.append(task_id)
            rows.setdefault(
                task_id, {"run": run, "task_id": task_id, "payload": task, "created_at": utcnow()}
            )
        with self._writer.begin() as conn:
            ensure_runs(conn, self._insert, [run])
            ordered = [rows[k] for k in sorted(rows)]
            for chunk in chunks(ordered):
                conn.execute(self._insert(Task).on_conflict_do_nothing(), list(chunk))
        return ids

    def get_task(self, run: str, task_id: str) -> dict[str, Any]:
        with self._engine.connect() as conn:
            payload = conn.scalar(select(Task.payload).where(Task.run == run, Task.task_id == task_id))
        if payload is None:
            raise NotFound(f"task {task_id!r} of run {run!r} does not exist; add it with add_tasks")
        return payload

    # --- rollouts and attempts -----------------------------------------------------------------------------

    def create_rollout(self, run: str, task_id: str, group_index: int, rollout_id: str | None = None,
                       evaluated_version: int | None = None) -> str:
        """Create a rollout with attempt 0 queued; creating the same ``rollout_id`` again is a no-op.

        With ``evaluated_version`` it is an evaluation rollout of that policy version (never trained on)."""
        [created] = self.create_rollouts(
            run, task_id, [(rollout_id or uuid.uuid4().hex, group_index)], evaluated_version
        )
        return created

    def create_rollouts(
        self,
        run: str,
        task_id: str,
        rollouts: Sequence[tuple[str, int]],
        evaluated_version: int | None = None,
    ) -> list[str]:
        """``create_rollout`` for several (rollout_id, group_index) of one task in one transaction: a whole
        group at once, as the scheduler creates them (one transaction per rollout was a fifth of the
        operator's CPU at concurrency 60)."""
        ids = [check_id(rollout_id, "rollout_id") for rollout_id, _ in rollouts]
        wanted = {
            rollout_id: (run, task_id, index, evaluated_version)
            for rollout_id, (_, index) in zip(ids, rollouts, strict=True)
        }
        with self._writer.begin() as conn:
            if conn.scalar(select(Task.task_id).where(Task.run == run, Task.task_id == task_id)) is None:
                raise NotFound(f"task {task_id!r} of run {run!r} does not exist; add it with add_tasks first")
            now = utcnow()
            kind = TRAIN if evaluated_version is None else EVALUATION
            inserted = conn.execute(
                self._insert(Rollout).on_conflict_do_nothing().returning(Rollout.rollout_id),
                [
                    {
                        "rollout_id": rollout_id,
                        "run": run,
                        "task_id": task_id,
                        "group_index": index,
                        "created_at": now,
                        "kind": kind,
                        "evaluated_version": evaluated_version,
                    }
                    for rollout_id, (_, _, index, _) in wanted.items()
                ],
            ).all()
            if kind == TRAIN:
                run_counters.add(conn, run, {run_counters.TRAINING_ROLLOUTS: len(inserted)})
            stored = conn.execute(
                select(
                    Rollout.rollout_id, Rollout.run, Rollout.task_id, Rollout.group_index, Rollout.evaluated_version
                ).where(Rollout.rollout_id.in_(ids))
            )
            for row in stored:
                if tuple(row)[1:] != wanted[row.rollout_id]:
                    raise ValueError(
                        f"rollout {row.rollout_id!r} already exists for run {row.run!r}, task {row.task_id!r}, "
                        f"group index {row.group_index}; pick another rollout_id"
                    )
            conn.execute(
                self._insert(RolloutAttempt).on_conflict_do_nothing(),
                [attempt_row(rollout_id, 0, run, RolloutState.QUEUED, now) for rollout_id in wanted],
            )
        return ids

    def _state(self, conn: Connection, rollout_id: str, attempt: int) -> RolloutState:
        state = conn.scalar(
            select(RolloutAttempt.state).where(
                RolloutAttempt.rollout_id == rollout_id, RolloutAttempt.attempt == attempt
            )
        )
        if state is None:
            raise NotFound(f"rollout {rollout_id!r} attempt {attempt} does not exist")
        return RolloutState(state)

    def try_transition(
        self,
        rollout_id: str,
        attempt: int,
        expected: RolloutState,
        to: RolloutState,
        reason: str | None = None,
        policy_version: int | None = None,
    ) -> bool:
        """Move ``expected -> to`` only if the attempt is still in ``expected`` (compare-and-set).

        Returns False when another writer moved it first (the scheduler uses this to claim a queued rollout);
        raises ``IllegalTransition`` if the move itself is illegal and ``NotFound`` if there is no such
        attempt. ``policy_version`` is recorded as the version the attempt started under (moves to running).
        """
        move = Move(rollout_id, attempt, RolloutState(expected), RolloutState(to), reason, policy_version)
        move.check()
        with self._writer.begin() as conn:
            if _apply_move(conn, move, utcnow()):
                return True
            self._state(conn, rollout_id, attempt)  # raises NotFound when it does not exist at all
            return False

    def try_transitions(self, moves: Sequence[Move]) -> set[tuple[str, int]]:
        """Many compare-and-set moves in one transaction; returns the keys of the attempts that moved.

        What one scheduler pass does: settle every harness that ended and claim every queued attempt it
        launches. One transaction (and one commit) per attempt made a pass of ~70 settlements and ~70 claims
        take many seconds on a busy database (bench/operator_scale.py at concurrency 200). Each move is still
        a conditional UPDATE, so concurrent writers cannot race past the state machine; an attempt that is not
        in ``expected`` (or does not exist) is left as it is and is not in the result.
        """
        for move in moves:
            move.check()
        moved: set[tuple[str, int]] = set()
        if not moves:
            return moved
        now = utcnow()
        with self._writer.begin() as conn:
            if len({move.key for move in moves}) < len(moves):
                # An attempt moved twice in one call: each move must see the one before it, in order.
                return {move.key for move in moves if _apply_move(conn, move, now)}
            # Moves that set the same values are one UPDATE ... RETURNING: a settle or a claim of 200 attempts
            # is a few statements, not 200 round trips (bench/operator_scale.py: the per-move UPDATEs were
            # most of a reconcile pass's wall time on a busy database).
            groups: dict[tuple[Any, ...], list[tuple[str, int]]] = {}
            for move in moves:
                groups.setdefault((move.expected, move.to, move.reason, move.policy_version), []).append(move.key)
            for (expected, to, reason, version), keys in groups.items():
                values = _move_values(to, reason, version, now)
                for chunk in chunks(keys, 500):
                    rows = conn.execute(
                        update(RolloutAttempt)
                        .where(
                            tuple_(RolloutAttempt.rollout_id, RolloutAttempt.attempt).in_(chunk),
                            RolloutAttempt.state == expected.value,
                        )
                        .values(**values)
                        .returning(RolloutAttempt.rollout_id, RolloutAttempt.attempt)
                    )
                    moved.update((row.rollout_id, row.attempt) for row in rows)
        return moved

    def transition(
        self,
        rollout_id: str,
        attempt: int,
        to: RolloutState,
        reason: str | None = None,
        policy_version: int | None = None,
    ) -> None:
        """Move the attempt to ``to`` from whatever state it is in, if that move is legal.

        Race-safe: the UPDATE only applies while the state is still the one checked; if another writer moved
        it in between, the move is re-checked against the new state (and usually then refused).
        """
        to = RolloutState(to)
        while True:  # terminates: every successful competing move goes forward in a finite DAG
            with self._engine.connect() as conn:
                current = self._state(conn, rollout_id, attempt)
            check_transition(current, to, f"rollout {rollout_id} attempt {attempt}")
            if self.try_transition(rollout_id, attempt, current, to, reason, policy_version):
                return

    def finish_attempt(
        self,
        rollout_id: str,
        attempt: int,
        state: RolloutState,
        reason: str | None = None,
        *,
        run: str | None = None,
    ) -> None:
        """Move the attempt to a terminal ``state`` (checked like ``transition``). With ``run``, an attempt
        not stored yet is created first (running), as a call would create it: a harness may end a rollout
        before its first LLM call reached the store, or without making one."""
        state = RolloutState(state)
        if not state.terminal:
            raise ValueError(
                "finish_attempt needs a terminal state (succeeded, failed, timed_out, cancelled), "
                f"got {state.value}"
            )
        if run is not None:
            check_id(run, "run")
            with self._writer.begin() as conn:
                ensure_attempts(
                    conn, self._insert, {(check_id(rollout_id, "rollout_id"), attempt): (run, None)}
                )
        self.transition(rollout_id, attempt, state, reason)

    def new_attempt(self, rollout_id: str) -> int:
        """Queue the next attempt of a rollout whose latest attempt failed, timed out or was cancelled; it carries
        the rollout's retries for upstream failures forward (``attempt_budget.next_infra_retries``)."""
        for _ in range(2):  # a second pass only after losing a race with another caller
            with self._writer.begin() as conn:
                latest = conn.execute(
                    select(RolloutAttempt.attempt, RolloutAttempt.state, RolloutAttempt.run,
                           RolloutAttempt.upstream_failed, RolloutAttempt.infra_retries)
                    .where(RolloutAttempt.rollout_id == rollout_id)
                    .order_by(RolloutAttempt.attempt.desc())
                    .limit(1)
                ).first()
                if latest is None:
                    raise NotFound(f"rollout {rollout_id!r} does not exist")
                state = RolloutState(latest.state)
                if not state.terminal or state is RolloutState.SUCCEEDED:
                    raise IllegalTransition(
                        state,
                        RolloutState.QUEUED,
                        f"rollout {rollout_id}: a new attempt after attempt {latest.attempt}, "
                        f"which is {state.value}",
                    )
                number = latest.attempt + 1
                row = attempt_row(rollout_id, number, latest.run, RolloutState.QUEUED, utcnow())
                row["infra_retries"] = attempt_budget.next_infra_retries(
                    latest.state, bool(latest.upstream_failed), latest.infra_retries
                )
                try:
                    with conn.begin_nested():
                        conn.execute(self._insert(RolloutAttempt), [row])
                except IntegrityError:
                    continue
                return number
        raise StoreError(f"rollout {rollout_id}: could not add an attempt (another writer keeps adding them)")

    def set_reward(
        self,
        rollout_id: str,
        attempt: int,
        value: float,
        info: dict[str, Any] | None = None,
        *,
        run: str | None = None,
    ) -> None:
        """Record the attempt's reward; a later call replaces it (last reward wins). With ``run``, an
        attempt not stored yet is created first (running), as a call would create it.

        Only while the attempt is queued or running: a settled attempt raises ``AttemptSettled`` (checked in
        the same conditional UPDATE, so a reward racing the scheduler's settlement either lands before it or
        is refused, never written over a decided outcome)."""
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"reward must be a finite number, got {value!r}")
        if info is not None:
            _require_json(info, "reward info")
        if run is not None:
            check_id(run, "run")
            check_id(rollout_id, "rollout_id")
        now = utcnow()
        with self._writer.begin() as conn:
            if run is not None:
                ensure_attempts(conn, self._insert, {(rollout_id, attempt): (run, None)})
            result = conn.execute(
                update(RolloutAttempt)
                .where(
                    RolloutAttempt.rollout_id == rollout_id,
                    RolloutAttempt.attempt == attempt,
                    RolloutAttempt.state.in_(OPEN_STATES),
                )
                .values(reward=float(value), reward_info=info, reward_at=now, updated_at=now)
            )
            if result.rowcount != 1:
                state = conn.scalar(
                    select(RolloutAttempt.state).where(
                        RolloutAttempt.rollout_id == rollout_id, RolloutAttempt.attempt == attempt
                    )
                )
                if state is None:
                    raise NotFound(f"rollout {rollout_id!r} attempt {attempt} does not exist; reward not stored")
                raise AttemptSettled(rollout_id, attempt, RolloutState(state))

    def mark_upstream_failed(self, rollout_id: str, attempt: int, *, run: str | None = None) -> None:
        """Record that the LLM upstream failed one of the attempt's calls (the proxy's upstream_unavailable or
        upstream_timeout), so its failure is retried without using an attempt (``attempt_budget``). With
        ``run``, an attempt not stored yet is created first (running), as a call would create it.

        Idempotent (a spool replay or the next failed call changes nothing), and in whatever state the attempt
        is: the mark may reach the store after the scheduler settled the attempt (the proxy's writer lingers,
        or spooled it through a store outage); a failure settled before it then gets its reason's prefix here.
        """
        check_id(rollout_id, "rollout_id")
        with self._writer.begin() as conn:
            if run is not None:
                ensure_attempts(conn, self._insert, {(rollout_id, attempt): (check_id(run, "run"), None)})
            settled = RolloutAttempt.state.in_(attempt_budget.RETRIED_STATES)
            conn.execute(
                update(RolloutAttempt)
                .where(RolloutAttempt.rollout_id == rollout_id, RolloutAttempt.attempt == attempt,
                       ~RolloutAttempt.upstream_failed)
                .values(upstream_failed=True, updated_at=utcnow(),
                        reason=attempt_budget.infrastructure_reason(RolloutAttempt.reason, when=settled))
            )

    def get_attempt(self, rollout_id: str, attempt: int) -> AttemptRecord:
        with self._engine.connect() as conn:
            row = conn.execute(
                _attempt_query().where(
                    RolloutAttempt.rollout_id == rollout_id, RolloutAttempt.attempt == attempt
                )
            ).first()
        if row is None:
            raise NotFound(f"rollout {rollout_id!r} attempt {attempt} does not exist")
        return _attempt_record(row)

    def get_attempts(self, keys: Iterable[tuple[str, int]]) -> dict[tuple[str, int], AttemptRecord]:
        """The attempts with these (rollout_id, attempt) keys, in one query per 500; missing ones are absent."""
        wanted = sorted(set(keys))
        found: dict[tuple[str, int], AttemptRecord] = {}
        with self._engine.connect() as conn:
            for chunk in chunks(wanted, 500):
                ids = sorted({rollout_id for rollout_id, _ in chunk})
                rows = conn.execute(_attempt_query().where(RolloutAttempt.rollout_id.in_(ids)))
                for row in rows:
                    record = _attempt_record(row)
                    found[(record.rollout_id, record.attempt)] = record
        return {key: found[key] for key in wanted if key in found}

    def list_attempts(
        self, run: str, states: Iterable[RolloutState] | None = None, unconsumed: bool = False
    ) -> list[AttemptRecord]:
        """Attempts of a run, optionally only in ``states`` and only those no learner step consumed yet."""
        query = _attempt_query().where(RolloutAttempt.run == run)
        if states is not None:
            query = query.where(RolloutAttempt.state.in_([RolloutState(s).value for s in states]))
        if unconsumed:
            query = query.where(RolloutAttempt.consumed_by_step.is_(None))
        query = query.order_by(RolloutAttempt.created_at, RolloutAttempt.rollout_id, RolloutAttempt.attempt)
        with self._engine.connect() as conn:
            return [_attempt_record(row) for row in conn.execute(query)]

    def count_attempts(self, run: str) -> dict[RolloutState, int]:
        """Attempts per state (every state present, zero included), for status and metrics."""
        with self._engine.connect() as conn:
            return run_counters.attempt_counts(conn, run)

    # --- policy versions (the learner's commits live in learner_ledger.py) ----------------------------------

    def mark_policy_synced(self, run: str, version: int) -> None:
        """Mark a version as served by every rollout replica."""
        with self._writer.begin() as conn:
            result = conn.execute(
                update(PolicyVersion)
                .where(PolicyVersion.run == run, PolicyVersion.version == version)
                .values(synced=True, synced_at=utcnow())
            )
            if result.rowcount != 1:
                raise NotFound(f"policy version {version} of run {run!r} does not exist")

    def latest_policy_version(self, run: str, synced_only: bool = True) -> int | None:
        query = select(func.max(PolicyVersion.version)).where(PolicyVersion.run == run)
        if synced_only:
            query = query.where(PolicyVersion.synced.is_(True))
        with self._engine.connect() as conn:
            return conn.scalar(query)

    # --- LLM calls -----------------------------------------------------------------------------------------

    def add_calls(self, calls: Sequence[CallRecord | PreparedCall]) -> int:
        """Store calls, skipping call_ids already stored; returns how many were newly inserted.

        Each call is delta-encoded against its predecessor (same rollout attempt, seq - 1; or, when that one's
        tokens do not begin its prompt, the earlier call whose prompt + completion is the longest token prefix
        of it: ``call_writer``) when that is in this batch or already stored; a predecessor not yet stored
        means the call is stored in full, so a
        delta never references a row that does not exist (stored rows carry the digests a successor is
        checked against, so no predecessor is needed in memory). A call may come already prepared
        (``prepare_call``; the proxy does that as it captures). Invalid calls raise ``InvalidCall`` naming
        them; then nothing of the batch is written. Missing run, rollout and attempt rows are created
        (attempt state running).
        """
        prepared = prepare_batch(calls)
        if not prepared:
            return 0
        try:
            with self._writer.begin() as conn:
                inserted = write_calls(conn, self._insert, prepared, self._known_attempts)
        except CopyConflict:  # another writer stored some of these calls meanwhile: once more, skipping them
            with self._writer.begin() as conn:
                inserted = write_calls(conn, self._insert, prepared, self._known_attempts, conflict_safe=True)
        if len(self._known_attempts) > KNOWN_ATTEMPTS_MAX:
            self._known_attempts.clear()
        self._known_attempts.update((p.record.rollout_id, p.record.attempt) for p in prepared.values())
        return inserted

    def get_call(self, call_id: str) -> CallRecord:
        """One call, full and bit-exact (rebuilt along its chain of bases)."""
        with self._engine.connect() as conn:
            target = conn.execute(select(LlmCall.__table__).where(LlmCall.call_id == call_id)).first()
            if target is None:
                raise NotFound(f"call {call_id!r} does not exist")
            rows = {target.call_id: target}
            if target.base_call_id is not None:
                query = select(LlmCall.__table__).where(
                    LlmCall.rollout_id == target.rollout_id,
                    LlmCall.attempt == target.attempt,
                    LlmCall.seq < target.seq,
                )
                rows.update((row.call_id, row) for row in conn.execute(query))
        chain = [target]
        while chain[-1].base_call_id is not None and chain[-1].base_call_id in rows:
            chain.append(rows[chain[-1].base_call_id])
        rebuilder = CallRebuilder()
        return [rebuilder.rebuild(row) for row in reversed(chain)][-1]

    def read_calls(self, rollout_id: str, attempt: int) -> list[CallRecord]:
        """All calls of an attempt, full and bit-exact, in seq order (one query)."""
        query = (
            select(LlmCall.__table__)
            .where(LlmCall.rollout_id == rollout_id, LlmCall.attempt == attempt)
            .order_by(LlmCall.seq, LlmCall.call_id)
        )
        with self._engine.connect() as conn:
            rows = list(conn.execute(query))
        rebuilder = CallRebuilder()
        return [rebuilder.rebuild(row) for row in rows]

    def rollout_calls(self, rollout_id: str, attempt: int) -> list[StoredCall]:
        """All calls of an attempt in delta form, in seq order: one query, linear in the final length."""
        query = (
            select(*DELTA_COLUMNS)
            .where(LlmCall.rollout_id == rollout_id, LlmCall.attempt == attempt)
            .order_by(LlmCall.seq, LlmCall.call_id)
        )
        with self._engine.connect() as conn:
            return [stored_call_from_row(row) for row in conn.execute(query)]

    def allowed_token_ids(self, rollout_id: str, attempt: int) -> dict[str, list[list[int]]]:
        """Per constrained call of an attempt (call_id), the token ids its grammar allowed at each completion
        token (``CallRecord.allowed_token_ids``). Apart from :meth:`rollout_calls` so that only the calls that have
        sets are read, and the delta read stays what it was on every store revision."""
        query = select(LlmCall.call_id, LlmCall.allowed_ids).where(
            LlmCall.rollout_id == rollout_id, LlmCall.attempt == attempt, LlmCall.allowed_ids.is_not(None)
        )
        with self._engine.connect() as conn:
            return {row.call_id: unpack_allowed(row.allowed_ids) or [] for row in conn.execute(query)}


def _require_json(value: Any, what: str) -> str:
    try:
        return codec.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not storable JSON ({exc})") from None


def _move_values(to: RolloutState, reason: str | None, policy_version: int | None, now: Any) -> dict[str, Any]:
    """The columns a move to ``to`` sets. A failure's reason says so when the upstream failed during the attempt
    (``attempt_budget.infrastructure_reason``)."""
    values: dict[str, Any] = {"state": to.value, "updated_at": now}
    if reason is not None:
        retried = to.value in attempt_budget.RETRIED_STATES
        values["reason"] = attempt_budget.infrastructure_reason(literal(reason)) if retried else reason
    if to is RolloutState.RUNNING:
        values["started_at"] = now
        if policy_version is not None:
            values["policy_version_start"] = policy_version
    if to.terminal:
        values["finished_at"] = now
    return values


def _apply_move(conn: Connection, move: Move, now: Any) -> bool:
    """The conditional UPDATE of one move; True when the attempt was in ``expected`` and moved."""
    result = conn.execute(
        update(RolloutAttempt)
        .where(
            RolloutAttempt.rollout_id == move.rollout_id,
            RolloutAttempt.attempt == move.attempt,
            RolloutAttempt.state == move.expected.value,
        )
        .values(**_move_values(move.to, move.reason, move.policy_version, now))
    )
    return result.rowcount == 1


def _attempt_query() -> Any:
    return select(RolloutAttempt.__table__, Rollout.task_id, Rollout.group_index).join(
        Rollout, Rollout.rollout_id == RolloutAttempt.rollout_id
    )


def _attempt_record(a: Row[Any]) -> AttemptRecord:
    return AttemptRecord(
        rollout_id=a.rollout_id,
        attempt=a.attempt,
        run=a.run,
        task_id=a.task_id,
        group_index=a.group_index,
        state=RolloutState(a.state),
        reason=a.reason,
        reward=a.reward,
        reward_info=a.reward_info,
        policy_version_start=a.policy_version_start,
        consumed_by_step=a.consumed_by_step,
        created_at=a.created_at,
        started_at=a.started_at,
        finished_at=a.finished_at,
        updated_at=a.updated_at,
        upstream_failed=bool(a.upstream_failed),
        infra_retries=a.infra_retries,
    )
