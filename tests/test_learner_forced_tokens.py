"""Forced tokens are no decision: a generated token whose behaviour log-prob is exactly 0 trains nothing.

vLLM's processed log-probs are those of the distribution the token was drawn from, after the structured-output
grammar's mask; a token that was the only legal one has log-prob 0 and no policy gradient under that
distribution. The learner keeps such tokens as context but takes them out of the loss, its normalisation and
the log-prob agreement metrics (``learner.decision_mask``). Checked on the batch the learner builds from a real
store (no engine needed: ``_build_batch`` is rank 0's bookkeeping).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from learner_helpers import Sample, record_group

from harnessrl.store import TraceStore
from harnessrl.trainer.engine import DistInfo
from harnessrl.trainer.learner import Learner, LearnerSettings, decision_mask
from harnessrl.trainer.losses import LossConfig

PROMPT = list(range(40, 50))


def test_decision_mask_drops_only_generated_tokens_with_log_prob_zero():
    loss_mask = np.array([0, 0, 1, 1, 1, 1, 0], np.int8)
    logprobs = np.array([0, 0, -0.5, 0.0, -2.0, 0.0, 0], np.float32)
    assert decision_mask(loss_mask, logprobs).tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert decision_mask(loss_mask, logprobs).dtype == np.int8


@pytest.mark.parametrize("aggregation", ["per-rollout-mean", "token-mean"])
def test_forced_tokens_carry_no_loss_and_do_not_count_in_the_normalisation(tmp_path: Path, aggregation: str):
    store = TraceStore.connect(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    # rollout 0: 6 tokens, 3 of them forced (log-prob 0); rollout 1: 4 free tokens; rollout 2: only forced tokens
    samples = [
        Sample(((PROMPT, [5, 6, 7, 8, 9, 10], [-1.0, 0.0, 0.0, -0.5, 0.0, -2.0]),), 1.0),
        Sample(((PROMPT, [11, 12, 13, 14], [-1.0, -1.5, -0.1, -3.0]),), 0.0),
        Sample(((PROMPT, [15, 16], [0.0, 0.0]),), 1.0),
    ]
    record_group(store, "forced", "t0", samples)
    settings = LearnerSettings(run="forced", model_dir=tmp_path, output_dir=tmp_path / "out", steps=1,
                               tasks_per_step=1, group_size=3, wait_timeout_s=0,
                               loss=LossConfig(aggregation=aggregation))
    engine = SimpleNamespace(dist=DistInfo(0, 1, 0, torch.device("cpu")))
    learner = Learner(settings, engine, store)  # type: ignore[arg-type]
    claim = learner.ledger.claim(1, 3)
    assert claim is not None
    (part,), info = learner._build_batch(claim)

    assert info["forced_tokens"] == 3 + 2 and info["generated_tokens"] == 12
    # the all-forced rollout trains no row: nothing in it was a decision
    assert info["trained_rows"] == 2
    by_len = {int(row.loss_mask.sum()): row for row in part}
    assert sorted(by_len) == [3, 4]
    forced_row = by_len[3]
    generated = np.flatnonzero(forced_row.input_ids >= 0)[len(PROMPT):]
    assert forced_row.loss_mask[generated].tolist() == [1, 0, 0, 1, 0, 1]
    # forced positions stay in the sequence (context), with no advantage and no weight
    assert forced_row.input_ids[generated].tolist() == [5, 6, 7, 8, 9, 10]
    assert forced_row.advantages[generated][[1, 2, 4]].tolist() == [0.0, 0.0, 0.0]
    assert forced_row.weights[generated][[1, 2, 4]].tolist() == [0.0, 0.0, 0.0]
    total = sum(float(row.weights.sum()) for row in part)
    assert total == pytest.approx(1.0)
    if aggregation == "per-rollout-mean":  # each rollout weighs 1/2, spread over its decisions only
        assert forced_row.weights[generated][0] == pytest.approx(1 / (2 * 3))
    else:  # one weight per decision of the batch: 3 + 4
        assert forced_row.weights[generated][0] == pytest.approx(1 / 7)


def test_stored_allowed_sets_reach_the_train_rows_on_their_completion_positions(tmp_path: Path):
    """A constrained call's sets (CallRecord.allowed_token_ids) land on the row positions of its tokens; forced
    ones (a one-token set, log-prob 0) are not trained, the others are scored over their set."""
    from harnessrl.store import CallRecord, RolloutState

    store = TraceStore.connect(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    store.add_tasks("sets", [{"id": "t"}])
    completion = [5, 6, 7, 8]
    allowed = [[5, 9], [6], [], [8, 3, 2]]
    for i, reward in enumerate((1.0, 0.0)):
        rollout = store.create_rollout("sets", "t", i, rollout_id=f"r{i}")
        store.transition(rollout, 0, RolloutState.RUNNING, policy_version=0)
        store.add_calls([CallRecord(
            call_id=f"{rollout}-c0", run="sets", rollout_id=rollout, attempt=0, seq=0, route="chat",
            request={"messages": [{"role": "user", "content": "x"}]}, response=None,
            prompt_token_ids=PROMPT, completion_token_ids=completion, logprobs=[-0.5, 0.0, -3.0, -1.0],
            policy_version=0, allowed_token_ids=allowed if i == 0 else None,
        )])  # fmt: skip
        store.set_reward(rollout, 0, reward)
        store.finish_attempt(rollout, 0, RolloutState.SUCCEEDED)
    assert store.read_calls("r0", 0)[0].allowed_token_ids == allowed
    assert store.read_calls("r1", 0)[0].allowed_token_ids is None
    assert store.allowed_token_ids("r0", 0) == {"r0-c0": allowed} and store.allowed_token_ids("r1", 0) == {}

    settings = LearnerSettings(run="sets", model_dir=tmp_path, output_dir=tmp_path / "out", steps=1,
                               tasks_per_step=1, group_size=2, wait_timeout_s=0)
    learner = Learner(settings, SimpleNamespace(dist=DistInfo(0, 1, 0, torch.device("cpu"))), store)  # type: ignore[arg-type]
    (part,), info = learner._build_batch(learner.ledger.claim(1, 2))
    rows = {row.key[0]: row for row in part}
    start = len(PROMPT)
    assert {p: v.tolist() for p, v in rows["r0"].allowed.items()} == {start: [5, 9], start + 1: [6],
                                                                       start + 3: [8, 3, 2]}
    assert rows["r1"].allowed is None
    assert info["forced_tokens"] == 2 and info["constrained_tokens"] == 2  # the forced one is no decision
