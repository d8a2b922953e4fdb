"""Several optimizer updates per learner step (decoupled PPO): the clip acts, and the update stays exact.

One learner step claims two task groups holding the same four sampled completions (rewards 1, 1, 0, 0). With
``mini_batches=2`` the step makes two updates, one per group. The old log-probs come from one no-grad pass
before the first update, so the second update trains on tokens the first one already moved in the direction of
their advantage: its ratio new/old is no longer 1, and the clip bounds it. With one mini-batch (the default)
the ratio is exactly 1 and nothing clips, which is today's single on-policy update.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from learner_helpers import Sample, flat, record_group, sample_completions, two_turn

from harnessrl.store import TraceStore
from harnessrl.trainer.engine import EngineSettings, PolicyEngine
from harnessrl.trainer.learner import Learner, LearnerSettings, split_mini_batches
from harnessrl.trainer.losses import LossConfig

PROMPT = list(range(40, 64))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harnessrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def samples(tiny: Path) -> list[Sample]:
    """Four completions, the second and fourth with a second call (rows of 30 and 40 tokens)."""
    first = sample_completions(tiny, PROMPT, 4, 6, seed=3)
    out = []
    for i, (completion, logprobs) in enumerate(first):
        reward = 1.0 if i < 2 else 0.0
        if i % 2 == 0:
            out.append(Sample(((PROMPT, completion, logprobs),), reward))
        else:
            (second,) = sample_completions(tiny, PROMPT + completion + [7, 8, 9, 10, 11], 1, 5, seed=10 + i)
            out.append(Sample(two_turn(PROMPT, (completion, logprobs), [7, 8, 9, 10, 11], second), reward))
    return out


def one_step(tiny: Path, tmp_path: Path, samples: list[Sample], *, loss: LossConfig, mini_batches: int,
             micro_batch_tokens: int = 32768):
    """One learner step over two identical groups; returns its metrics and the engine."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = TraceStore.connect(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    for task in ("t0", "t1"):
        record_group(store, "mb", task, samples)
    # Adam with a large epsilon: the update follows the gradient's size (see test_engine.py), so a wrong
    # clip width shows in the weights.
    settings = LearnerSettings(run="mb", model_dir=tiny, output_dir=tmp_path / "out", steps=1, tasks_per_step=2,
                               group_size=4, wait_timeout_s=0, mini_batches=mini_batches,
                               engine=EngineSettings(lr=0.05, eps=1.0, micro_batch_tokens=micro_batch_tokens),
                               loss=loss)
    engine = PolicyEngine(tiny, settings.engine)
    (outcome,) = Learner(settings, engine, store).run()
    store.close()
    return outcome.metrics, engine


def check_stored_rows(tmp_path: Path) -> None:
    """The step's commit kept what it made of each attempt: one row each (the second call extends the first),
    and the learner's own log-probs on exactly the trained tokens of each row, as the trace explorer places
    them. Step 1 trains from the weights that sampled the completions, so they equal the behaviour log-probs;
    in a second update they come from the scoring pass before the first, in the first from its own forward."""
    from sqlalchemy import select

    from harnessrl.store.schema import RolloutAttempt
    from harnessrl.ui.training_view import training_view

    store = TraceStore.connect(f"sqlite:///{tmp_path / 'store.db'}")
    with store.engine.connect() as conn:
        assert conn.execute(select(RolloutAttempt.train_rows)).scalars().all() == [1] * 8
    for attempt in store.list_attempts("mb"):
        (row,) = training_view(store.engine, "mb", attempt.rollout_id, attempt.attempt).rows
        trained = np.flatnonzero(row.trained)
        assert row.learner_logprobs is not None and trained.size >= 5
        np.testing.assert_allclose(row.learner_logprobs[trained], row.rollout_logprobs[trained], atol=1e-3)
        assert np.isnan(np.delete(row.learner_logprobs, trained)).all()
    store.close()


# ACPO with the paper's alpha 3 widens its bound past every ratio here; alpha 0.5 keeps it narrow enough to act.
ACPO = LossConfig(loss="acpo", acpo_alpha=0.5)


@pytest.mark.parametrize("loss", [LossConfig(loss="ppo-clip"), LossConfig(loss="cispo"), ACPO],
                         ids=["ppo-clip", "cispo", "acpo"])
def test_the_second_update_of_a_step_sees_a_ratio_and_clips(tiny: Path, tmp_path: Path, samples, loss: LossConfig):
    metrics, _ = one_step(tiny, tmp_path, samples, loss=loss, mini_batches=2)
    assert metrics["updates"] == 2 and metrics["trained_rollouts"] == 8
    check_stored_rows(tmp_path)
    assert metrics["clip_frac"] > 0, metrics
    assert metrics["clip_frac"] == pytest.approx(metrics["clip_frac_low"] + metrics["clip_frac_high"])
    assert metrics["approx_kl"] > 1e-4
    # The agreement with the serving engine is measured against the log-probs before the step's first update.
    assert metrics["logprob_abs_diff"] < 1e-4 and metrics["logprob_pearson"] > 0.9999
    if loss.loss == "acpo":  # the ratios of the second update spread, so ACPO widened its bound past the base 0.2
        assert metrics["acpo_clip_mean"] > 0.2


def test_one_mini_batch_is_one_on_policy_update_without_clipping(tiny: Path, tmp_path: Path, samples):
    metrics, _ = one_step(tiny, tmp_path, samples, loss=LossConfig(), mini_batches=1)
    assert metrics["updates"] == 1
    check_stored_rows(tmp_path)
    assert metrics["clip_frac"] == 0 and metrics["approx_kl"] == 0 and metrics["ratio_mean"] == pytest.approx(1.0)


def test_acpo_update_does_not_depend_on_the_micro_batch_split(tiny: Path, tmp_path: Path, samples):
    # 40 tokens per micro-batch: every row alone. ACPO's spread statistic is one number per update over all of
    # them, so the weights end the same as with all rows in one micro-batch.
    whole, e1 = one_step(tiny, tmp_path / "whole", samples, loss=ACPO, mini_batches=2)
    split, e2 = one_step(tiny, tmp_path / "split", samples, loss=ACPO, mini_batches=2, micro_batch_tokens=40)
    assert whole["micro_batches"] == 2 and split["micro_batches"] == 8
    assert split["acpo_clip_mean"] == pytest.approx(whole["acpo_clip_mean"], rel=1e-5)
    assert split["clip_frac"] == pytest.approx(whole["clip_frac"], rel=1e-6) and whole["clip_frac"] > 0
    torch.testing.assert_close(flat(e2), flat(e1), rtol=1e-4, atol=1e-6)


def test_mini_batches_keep_a_rollouts_rows_together_and_split_rollouts_evenly():
    keys = ["a", "a", "b", "c", "c", "d", "e"]
    assert split_mini_batches(keys, 2) == [[0, 1, 2], [3, 4, 5, 6]]  # rollouts a b | c d e
    assert split_mini_batches(keys, 5) == [[0, 1], [2], [3, 4], [5], [6]]
    assert split_mini_batches(keys, 9) == [[0, 1], [2], [3, 4], [5], [6]]  # at most one rollout each
    assert split_mini_batches(keys, 1) == [list(range(7))]
    assert [len(part) for part in split_mini_batches(list(range(10)), 4)] == [2, 3, 2, 3]
    assert split_mini_batches([], 3) == []


def test_mini_batches_below_one_are_refused(tiny: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="mini_batches: 0 must be >= 1"):
        LearnerSettings(run="x", model_dir=tiny, output_dir=tmp_path, mini_batches=0)
