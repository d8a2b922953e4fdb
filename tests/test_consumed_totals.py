"""``harnessrl status``'s figures and the failures page's count read the totals each learner step kept
(``store.consumed_totals``) plus the open attempts: on both databases they equal what a scan of every attempt
gives, on a run with every state, zero and missing rewards, evaluation rollouts, several versions, consumed and
open attempts; and equal it again after migration 0011 totals the same steps from the stored rows.

Rewards are multiples of 1/8, so every sum is exact in any order and the comparison can be equality.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import case, func, or_, select

from harnessrl.local.report import _mean_std, summarize
from harnessrl.store import RolloutState, TraceStore, consumed_totals
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.store.migrate import downgrade, upgrade
from harnessrl.store.schema import TRAIN, Rollout, RolloutAttempt
from harnessrl.ui.failures import failure_groups

RUN = "figures"
S, F, T, C = RolloutState.SUCCEEDED, RolloutState.FAILED, RolloutState.TIMED_OUT, RolloutState.CANCELLED
# per task: (state, reward) of its four rollouts; None: no reward reported
GROUPS = [[(S, 0.5), (S, 0.0), (F, None), (S, None)],
          [(S, 0.875), (T, None), (S, 0.25), (C, None)],
          [(S, 0.125), (S, 0.0), (F, None), (S, 0.75)],
          [(S, 0.375), (F, None), (RolloutState.RUNNING, None), (RolloutState.QUEUED, None)]]  # left open


def _settle(store: TraceStore, rollout_id: str, state: RolloutState, reward: float | None, version: int | None
            ) -> None:
    if state is RolloutState.QUEUED:
        return
    store.transition(rollout_id, 0, RolloutState.RUNNING, policy_version=version)
    if reward is not None:
        store.set_reward(rollout_id, 0, reward)
    if state is not RolloutState.RUNNING:
        store.transition(rollout_id, 0, state, reason=None if state is S else f"HarnessFailed: exit code {reward}")


def _fill(store: TraceStore) -> None:
    """Four training groups at versions 0, None (counted as 0), 1 and 2; evaluation rollouts of versions 1
    and 2; step 1 consumes groups 0 and 1, step 2 group 2 and one evaluation attempt; the rest stays open."""
    ledger = LearnerLedger(store, RUN)
    ledger.ensure_base_version("/nowhere")
    store.add_tasks(RUN, [{"id": f"t{g}"} for g in range(len(GROUPS))])
    for g, members in enumerate(GROUPS):
        ids = store.create_rollouts(RUN, f"t{g}", [(f"r{g}-{i}", i) for i in range(len(members))])
        for rollout_id, (state, reward) in zip(ids, members, strict=True):
            _settle(store, rollout_id, state, reward, [0, None, 1, 2][g])
    for version in (1, 2):
        ids = store.create_rollouts(RUN, "t0", [(f"e{version}-{i}", i) for i in range(3)], evaluated_version=version)
        for rollout_id, (state, reward) in zip(ids, [(S, 0.625), (S, 0.0), (F, None)], strict=True):
            _settle(store, rollout_id, state, reward, version)
    ledger.commit(1, "/nowhere/v1", {"rows": 8}, [(f"r{g}-{i}", 0) for g in (0, 1) for i in range(4)])
    ledger.commit(2, "/nowhere/v2", {"rows": 5}, [(f"r2-{i}", 0) for i in range(4)] + [("e1-0", 0)])


def _scanned(store: TraceStore) -> dict[str, Any]:
    """The figures as a scan of every attempt of the run gives them (the queries summarize ran before 0011)."""
    a = RolloutAttempt
    rewarded = (a.state == S.value) & a.reward.is_not(None)
    reward = case((rewarded, a.reward))
    failing = or_(a.state.in_([F.value, T.value]), (a.state == S.value) & or_(a.reward == 0, a.reward.is_(None)))
    with store.engine.connect() as conn:
        per_step = conn.execute(
            select(a.consumed_by_step, func.count(), func.count(reward), func.sum(reward), func.sum(reward * reward))
            .where(a.run == RUN, a.consumed_by_step.is_not(None)).group_by(a.consumed_by_step)
            .order_by(a.consumed_by_step)).all()
        version = func.coalesce(a.policy_version_start, 0)
        by_version = conn.execute(select(version, func.avg(a.reward))
                                  .join(Rollout, Rollout.rollout_id == a.rollout_id)
                                  .where(a.run == RUN, rewarded, Rollout.kind == TRAIN).group_by(version)).all()
        ended = conn.execute(
            select(func.count(), func.min(a.finished_at), func.max(a.finished_at))
            .where(a.run == RUN, a.finished_at.is_not(None), a.state.in_([s.value for s in RolloutState
                                                                          if s.terminal]))).one()
        failing_count = conn.scalar(select(func.count()).where(a.run == RUN, failing))
    return {"steps": [(step, n, k, *_mean_std(k, total, squares)) for step, n, k, total, squares in per_step],
            "by_version": {int(v): float(mean) for v, mean in by_version}, "ended": tuple(ended),
            "failing": failing_count}


def _read(store: TraceStore) -> dict[str, Any]:
    summary = summarize(store, RUN)
    with store.engine.connect() as conn:
        ended = consumed_totals.ended(conn, RUN)
    failures = failure_groups(store.engine, RUN)
    assert failures["scanned"] == failures["total"]  # fewer than the page's limit: every failing attempt grouped
    return {"steps": [(s.step, s.rollouts, s.succeeded, s.reward_mean, s.reward_std) for s in summary.steps],
            "by_version": summary.reward_by_version, "ended": ended, "failing": failures["total"]}


def test_the_kept_totals_give_what_a_scan_of_every_attempt_gives(store: TraceStore) -> None:
    _fill(store)
    scanned = _scanned(store)
    assert scanned["steps"][1][1:3] == (5, 4)  # the run has what the comparison is about: step 2's 4 + 1 consumed
    assert set(scanned["by_version"]) == {0, 1, 2} and scanned["failing"] == 11 and scanned["ended"][0] == 20
    assert _read(store) == scanned
    downgrade(store.engine, "0010")  # as a store written before the totals: 0011 totals the same steps
    upgrade(store.engine)
    assert _read(store) == scanned
    LearnerLedger(store, RUN).commit(3, "/nowhere/v3", None, [(f"r3-{i}", 0) for i in range(2)])  # and goes on
    assert _read(store) == _scanned(store) != scanned
