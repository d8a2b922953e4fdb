"""Tables of the trace store as typed SQLAlchemy models.

The models are the single description of the schema: Alembic migrations are checked against this metadata
(a test runs ``compare_metadata`` on both databases), and the store's queries are built from these classes.
Column types are the portable subset that means the same thing on PostgreSQL and SQLite: token arrays are
``LargeBinary`` (``bytea`` / ``blob``), JSON is ``JSON`` (PostgreSQL ``json``, not ``jsonb``, because it keeps
the exact text, key order included), timestamps are timezone-aware UTC on both.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from harnessrl.store.records import RolloutState, utcnow

# Stable constraint names, so migrations (and SQLite batch mode, which recreates tables) can refer to them.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID = String(128)  # run names, task, rollout and call ids: Kubernetes names (<= 63/253) or UUIDs fit
STATE_VALUES = ", ".join(f"'{s.value}'" for s in RolloutState)
TRAIN, EVALUATION = "train", "evaluation"  # rollouts.kind
KIND_VALUES = f"'{TRAIN}', '{EVALUATION}'"
OPEN_ATTEMPTS = "consumed_by_step IS NULL"  # the partial index ix_rollout_attempts_open
# What the trace explorer's failures page lists (the partial index ix_rollout_attempts_failing): an attempt that
# failed or timed out, or succeeded with a reward of 0 or none. Queries name this same text, so both databases
# see that the index covers them.
FAILING_ATTEMPTS = "state IN ('failed', 'timed_out') OR (state = 'succeeded' AND (reward = 0 OR reward IS NULL))"


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that comes back timezone-aware (UTC) on SQLite as well as PostgreSQL.

    SQLite has no timezone type and would hand back naive datetimes, so a record written and read back would
    not compare equal. Naive input is taken to be UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def json_column(nullable: bool) -> Any:
    # none_as_null: Python None is SQL NULL, never the JSON text 'null': "no response" stays distinguishable.
    return mapped_column(JSON(none_as_null=True), nullable=nullable)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    """One TrainingRun; everything else hangs off its name."""

    __tablename__ = "runs"

    name: Mapped[str] = mapped_column(ID, primary_key=True)
    spec: Mapped[dict[str, Any] | None] = json_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    owner: Mapped[str | None] = mapped_column(ID, nullable=True)
    """``<namespace>/<name>`` of the TrainingRun whose operator uses this run (``TraceStore.ensure_run``); none
    for ``harnessrl run``'s runs and for runs stored before the column existed."""


class Task(Base):
    """One task of a run's task set (the JSON the harness receives). Ids are unique per run."""

    __tablename__ = "tasks"

    run: Mapped[str] = mapped_column(ID, ForeignKey("runs.name"), primary_key=True)
    task_id: Mapped[str] = mapped_column(ID, primary_key=True)
    payload: Mapped[dict[str, Any]] = json_column(nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Rollout(Base):
    """One member of a task's group; its attempts are the retries.

    ``task_id`` is NULL for rollouts a standalone proxy created on first sight of a call. ``kind`` is
    ``evaluation`` for a rollout that scores policy ``evaluated_version`` on a held-out task: never trained on.
    """

    __tablename__ = "rollouts"
    __table_args__ = (
        ForeignKeyConstraint(["run", "task_id"], ["tasks.run", "tasks.task_id"]),
        CheckConstraint(f"kind IN ({KIND_VALUES})", name="kind"),
        Index(None, "run", "task_id"),
        Index(None, "run", "kind", "evaluated_version"),
    )

    rollout_id: Mapped[str] = mapped_column(ID, primary_key=True)
    run: Mapped[str] = mapped_column(ID, ForeignKey("runs.name"))
    task_id: Mapped[str | None] = mapped_column(ID)
    group_index: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    kind: Mapped[str] = mapped_column(String(16), default=TRAIN, server_default=TRAIN)
    evaluated_version: Mapped[int | None] = mapped_column(Integer)


class LearnerStep(Base):
    """One optimizer step: the policy version it produced and the attempts it trained on."""

    __tablename__ = "learner_steps"

    run: Mapped[str] = mapped_column(ID, ForeignKey("runs.name"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    policy_version: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any] | None] = json_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class RolloutAttempt(Base):
    """One execution of a rollout: its state, its reward and which learner step consumed it.

    ``run`` is repeated here (it is also on the rollout) because the scheduler and the learner select attempts
    by (run, state) and that must be one indexed lookup, not a join.
    """

    __tablename__ = "rollout_attempts"
    __table_args__ = (
        CheckConstraint(f"state IN ({STATE_VALUES})", name="state"),
        ForeignKeyConstraint(["run", "consumed_by_step"], ["learner_steps.run", "learner_steps.step"]),
        Index(None, "run", "state"),
        # The attempts a scheduler pass can still care about: the active ones, the finished ones no learner
        # step consumed yet (and a retried rollout's earlier attempts). Its reads name the same condition, so
        # they walk this index and cost what is open, not every attempt the run ever made.
        Index("ix_rollout_attempts_open", "run", "state", postgresql_where=text(OPEN_ATTEMPTS),
              sqlite_where=text(OPEN_ATTEMPTS)),
        # What the trace explorer's rollout list sorts by (harnessrl.ui.queries.SORTS): a page is an index walk.
        Index(None, "run", "created_at"),
        Index(None, "run", "reward"),
        Index(None, "run", "policy_version_start"),
        Index(None, "run", "consumed_by_step"),
        Index(None, "run", "train_rows"),
        Index(None, "run", "reason"),
        # The failures page's latest failing attempts: a walk of what it shows, however rare failures are.
        Index("ix_rollout_attempts_failing", "run", "created_at", postgresql_where=text(FAILING_ATTEMPTS),
              sqlite_where=text(FAILING_ATTEMPTS)),
    )

    rollout_id: Mapped[str] = mapped_column(ID, ForeignKey("rollouts.rollout_id"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    run: Mapped[str] = mapped_column(ID, ForeignKey("runs.name"))
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    reward: Mapped[float | None] = mapped_column(Float)  # NULL = no reward reported (never 0)
    reward_info: Mapped[dict[str, Any] | None] = json_column(nullable=True)
    reward_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    policy_version_start: Mapped[int | None] = mapped_column(Integer)
    consumed_by_step: Mapped[int | None] = mapped_column(Integer)
    # The training rows the learner built from the attempt at the step that consumed it (trained or not);
    # NULL until a step consumed it, and for attempts consumed before schema revision 0008.
    train_rows: Mapped[int | None] = mapped_column(Integer)
    # The proxy answered one of the attempt's calls upstream_unavailable or upstream_timeout; and how many of
    # the rollout's earlier attempts were retried for that without using one of harness.maxAttempts
    # (``store.attempt_budget``: the one rule that counts them).
    upstream_failed: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    infra_retries: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class LearnerLogprobs(Base):
    """The learner's own log-probs of one training row's trained tokens, as the step that consumed the attempt
    computed them with its starting weights (the proximal policy the loss compares with): what the serving
    engine's log-probs should agree with. ``logprobs``: little-endian float32, one per trained position in
    order (``decision_mask``'s ones past position 0); ``row_index`` is the row's place among the attempt's rows
    as ``merge_calls_into_rows`` orders them. Rows that trained no token have no entry.
    """

    __tablename__ = "learner_logprobs"
    __table_args__ = (
        ForeignKeyConstraint(
            ["rollout_id", "attempt"], ["rollout_attempts.rollout_id", "rollout_attempts.attempt"]
        ),
    )

    rollout_id: Mapped[str] = mapped_column(ID, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    row_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    run: Mapped[str] = mapped_column(ID, ForeignKey("runs.name"))
    step: Mapped[int] = mapped_column(Integer)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)


class RunCounter(Base):
    """Running totals of a run that a scheduler pass reads instead of counting rows it can no longer change.

    ``training_rollouts``: training rollouts the scheduler created (their number names the next group);
    ``consumed:<state>``: attempts in that state a learner step consumed (consumed attempts are final). Both
    only grow, in the transaction that adds what they count (``store.run_counters``).
    """

    __tablename__ = "run_counters"

    run: Mapped[str] = mapped_column(ID, ForeignKey("runs.name"), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)


class ConsumedTotals(Base):
    """What a learner step consumed, totalled per rollout kind and starting policy version (NULL counted as 0,
    as ``harnessrl status`` shows it), written in the step's own transaction (``LearnerLedger``): consumed
    attempts are final, so the run overview and the failures page add these rows and count only the open
    attempts (``ix_rollout_attempts_open``) instead of every attempt the run made.

    ``rewarded``: succeeded attempts with a reward, whose rewards ``reward_sum`` and ``reward_squares`` add up
    (NULL when none); ``failing``: attempts ``FAILING_ATTEMPTS`` selects; ``ended``: terminal attempts with a
    ``finished_at``, the first and last of which are ``first_finished`` and ``last_finished``.
    """

    __tablename__ = "consumed_totals"
    __table_args__ = (ForeignKeyConstraint(["run", "step"], ["learner_steps.run", "learner_steps.step"]),)

    run: Mapped[str] = mapped_column(ID, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempts: Mapped[int] = mapped_column(Integer)
    rewarded: Mapped[int] = mapped_column(Integer)
    reward_sum: Mapped[float | None] = mapped_column(Float)
    reward_squares: Mapped[float | None] = mapped_column(Float)
    failing: Mapped[int] = mapped_column(Integer)
    ended: Mapped[int] = mapped_column(Integer)
    first_finished: Mapped[datetime | None] = mapped_column(UTCDateTime())
    last_finished: Mapped[datetime | None] = mapped_column(UTCDateTime())


class LlmCall(Base):
    """One captured LLM call, possibly stored as a delta against its predecessor ``base_call_id``.

    Encoding (see ``harnessrl.store.delta``): the full prompt is ``base context[:prompt_offset] +
    prompt_suffix`` where a base's context is its full prompt + completion; the full request input (chat
    ``messages`` or a text ``prompt``) is ``base input+output[:request_reused] + stored tail``. The
    ``context_*`` / ``input_*`` / ``io_*`` lengths and digests describe *this* call's full values so a later
    call can check "do I extend it?" from this row alone, without rebuilding its chain.
    Token arrays are little-endian int32; log-probs float32 (``logprobs_f64`` marks the float64 fallback used
    only when a value is not float32-representable). ``response_stripped`` lists what was cut out of the
    response JSON because it equals the arrays (see ``harnessrl.store.codec``).
    """

    __tablename__ = "llm_calls"
    __table_args__ = (
        ForeignKeyConstraint(
            ["rollout_id", "attempt"], ["rollout_attempts.rollout_id", "rollout_attempts.attempt"]
        ),
        # One call per place in a trajectory: two calls at one (rollout, attempt, seq) make its order
        # undefined and the learner cannot build its rows. Also the index the per-attempt reads use.
        UniqueConstraint("rollout_id", "attempt", "seq"),
        Index(None, "run", "created_at"),
    )

    call_id: Mapped[str] = mapped_column(ID, primary_key=True)
    run: Mapped[str] = mapped_column(ID, ForeignKey("runs.name"))
    rollout_id: Mapped[str] = mapped_column(ID)
    attempt: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(Integer)
    route: Mapped[str] = mapped_column(String(32))

    base_call_id: Mapped[str | None] = mapped_column(ID)
    prompt_offset: Mapped[int] = mapped_column(Integer)
    prompt_suffix: Mapped[bytes] = mapped_column(LargeBinary)
    completion_ids: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs_f64: Mapped[bool] = mapped_column(Boolean)
    request: Mapped[dict[str, Any]] = json_column(nullable=False)
    request_reused: Mapped[int] = mapped_column(Integer)
    response: Mapped[dict[str, Any] | None] = json_column(nullable=True)
    response_stripped: Mapped[list[Any] | None] = json_column(nullable=True)
    # The sampling parameters the proxy sent upstream (temperature, top_p and, in train mode, the neutral
    # top_k/min_p/penalties/logit_bias), what the log-probs were taken under; NULL when not recorded.
    sampling: Mapped[dict[str, Any] | None] = json_column(nullable=True)
    # For calls a structured-output grammar constrained (a forced tool call, a JSON schema): per completion
    # token, the token ids the grammar left (as the proxy saw them in vLLM's processed top log-probs), packed by
    # ``call_rows.pack_allowed``; NULL for every other call.
    allowed_ids: Mapped[bytes | None] = mapped_column(LargeBinary)

    context_len: Mapped[int] = mapped_column(Integer)
    context_digest: Mapped[bytes] = mapped_column(LargeBinary)
    input_len: Mapped[int | None] = mapped_column(Integer)
    input_digest: Mapped[bytes | None] = mapped_column(LargeBinary)
    io_len: Mapped[int | None] = mapped_column(Integer)
    io_digest: Mapped[bytes | None] = mapped_column(LargeBinary)

    policy_version: Mapped[int] = mapped_column(Integer)
    upstream: Mapped[str] = mapped_column(Text)
    latency_s: Mapped[float] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(16))
    http_status: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(64))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class PolicyVersion(Base):
    """A checkpoint the learner wrote; ``synced`` once every rollout replica serves it."""

    __tablename__ = "policy_versions"

    run: Mapped[str] = mapped_column(ID, ForeignKey("runs.name"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    synced: Mapped[bool] = mapped_column(Boolean, default=False)
    synced_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
