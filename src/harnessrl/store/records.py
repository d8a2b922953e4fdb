"""Plain records exchanged between the proxy, the trace store and the learner.

They are dataclasses, not ORM rows, so the proxy can build and queue them without a database session and
the learner can consume them without knowing how they are stored. The store owns the mapping to tables
(including the prefix-delta encoding); everything else only ever sees full, exact values here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any


class RolloutState(str, enum.Enum):
    """Lifecycle of one rollout attempt; legal moves live in ``harnessrl.store.states``."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (RolloutState.SUCCEEDED, RolloutState.FAILED, RolloutState.TIMED_OUT, RolloutState.CANCELLED)


class CallStatus(str, enum.Enum):
    """Outcome of one LLM call as seen by the proxy."""

    OK = "ok"  # upstream answered 2xx and the whole body reached the harness
    ERROR = "error"  # upstream answered non-2xx or the connection failed after retries
    ABORTED = "aborted"  # the harness disconnected before the response was complete


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class CallRecord:
    """One LLM request/response pair exactly as the model saw and produced it.

    ``prompt_token_ids`` is always the *full* prompt; the store decides whether to keep it as a delta
    against the previous call of the same rollout attempt. ``call_id`` is the idempotency key: writing the
    same ``call_id`` twice stores it once (proxy spool replays rely on this).
    """

    call_id: str
    run: str
    rollout_id: str
    attempt: int
    seq: int  # position of the call within its rollout attempt, 0-based, assigned by the proxy
    route: str  # "chat" | "completions"
    request: dict[str, Any]  # the request body the harness sent (before the proxy's additions)
    response: dict[str, Any] | None  # the upstream response body (streamed responses assembled)
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]  # one per completion token, from the serving engine
    policy_version: int
    upstream: str = ""
    latency_s: float = 0.0
    status: CallStatus = CallStatus.OK
    http_status: int = 200
    finish_reason: str | None = None
    created_at: datetime = field(default_factory=utcnow)
    # the sampling parameters sent upstream, as sent (None: not recorded; the harness's request keeps its own)
    sampling: dict[str, Any] | None = None
    # Per completion token, the token ids the sampler could draw there when a structured-output grammar
    # constrained the call and the serving engine showed the whole allowed set ([] where it did not: the
    # learner then scores that token over the whole vocabulary). None: not a constrained call, or not recorded.
    allowed_token_ids: list[list[int]] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.completion_token_ids)


@dataclass
class StoredCall:
    """A call read back for training, in delta form, so reading a trajectory is linear in its final length.

    When ``parent_call_id`` is set, the full prompt is ``parent.prompt + parent.completion + prompt_suffix``;
    the learner's prefix merge uses that fact instead of comparing prompts again. When it is ``None``,
    ``prompt_suffix`` is the whole prompt.
    """

    call_id: str
    rollout_id: str
    attempt: int
    seq: int
    parent_call_id: str | None
    prompt_suffix: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    status: CallStatus
    finish_reason: str | None = None


@dataclass
class AttemptRecord:
    """One rollout attempt as the scheduler and the learner see it (state, reward, bookkeeping)."""

    rollout_id: str
    attempt: int
    run: str
    task_id: str | None
    group_index: int | None
    state: RolloutState
    reason: str | None
    reward: float | None  # None: no reward was reported (never read as zero)
    reward_info: dict[str, Any] | None
    policy_version_start: int | None
    consumed_by_step: int | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime
    upstream_failed: bool = False  # the LLM upstream failed one of its calls (``store.attempt_budget``)
    infra_retries: int = 0  # earlier attempts of the rollout retried for that without using an attempt
