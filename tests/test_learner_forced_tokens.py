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
