"""How many of ``harness.maxAttempts`` a rollout has used: the one rule the scheduler and the learner share.

An attempt that failed because the LLM upstream did (the proxy answered one of its calls with
upstream_unavailable or upstream_timeout: vLLM restarting, crash-looping or too slow) says nothing about the
harness, so retrying it does not use one of the rollout's attempts; otherwise a vLLM restart could use up every
attempt of the rollouts running through it and lose them. Attempts are numbered from 0 and
``rollout_attempts.infra_retries`` counts the rollout's earlier attempts retried that way, so the harness
attempts an attempt has used are ``attempt + 1 - infra_retries``.

The scheduler asks it in SQL (``scheduler_reads.latest_ended``: which failed rollouts get a new attempt), the
learner in Python (``learner_ledger``: whether a failed member makes its group final); both call
:func:`retried`, which builds the same expression from SQL columns or from plain values, so the two can never
disagree about a row.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import case

from harnessrl.store.records import RolloutState
from harnessrl.store.schema import RolloutAttempt

MAX_INFRA_RETRIES = 10
"""Retries a rollout gets for upstream failures without using an attempt. Bounded because an upstream that never
comes back (a model that cannot load, a wrong URL) must not retry its rollouts forever: past the bound an
upstream failure counts against ``harness.maxAttempts`` like any other. Ten covers the restarts a run meets
(each outage costs a running rollout one retry however long it lasts, as its next attempt waits in the queue
while no replica serves) and still ends a run whose upstream is gone after a bounded number of pods."""

INFRASTRUCTURE = "Infrastructure: the LLM upstream was unavailable or timed out; "
"""The prefix of a failed attempt's reason when the upstream failed during it (``kubectl describe``, status and
the trace explorer then say why the rollout was retried without using an attempt)."""

RETRIED_STATES = (RolloutState.FAILED.value, RolloutState.TIMED_OUT.value)


def free_retry(upstream_failed: Any, infra_retries: Any) -> Any:
    """Whether retrying this attempt uses no harness attempt; plain values or SQL columns alike."""
    return upstream_failed & (infra_retries < MAX_INFRA_RETRIES)


def retried(attempt: Any, upstream_failed: Any, infra_retries: Any, max_attempts: int) -> Any:
    """Whether a failed or timed-out attempt gets another one: a free retry, or harness attempts left
    (``attempt + 1 - infra_retries`` used of ``max_attempts``). Plain values give a bool, SQL columns an
    expression for a WHERE clause."""
    return free_retry(upstream_failed, infra_retries) | (attempt + 1 - infra_retries < max_attempts)


def next_infra_retries(state: str, upstream_failed: bool, infra_retries: int) -> int:
    """``infra_retries`` of the attempt that follows one in ``state``: carried forward, one more when the
    attempt before failed from the upstream within the bound (a cancelled attempt's retry adds nothing)."""
    return infra_retries + int(state in RETRIED_STATES and bool(free_retry(upstream_failed, infra_retries)))


def infrastructure_reason(reason: Any, when: Any = RolloutAttempt.upstream_failed) -> Any:
    """A failure's reason as an UPDATE sets it (SQL): with the ``INFRASTRUCTURE`` prefix where ``when`` holds,
    by default where the attempt's ``upstream_failed`` is set."""
    return case((when, INFRASTRUCTURE + reason), else_=reason)
