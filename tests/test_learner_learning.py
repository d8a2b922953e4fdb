"""The whole learner loop on the CPU learns from recorded rollouts: rewarded completions become more likely.

Four completions of one prompt are sampled from the tiny model (two of them two-turn trajectories whose second
call extends the first, merged into one row). Two get reward 1, two reward 0. The same group is recorded for
three tasks, one task per step, so three steps train on it; the published weights of the last version then
give the rewarded completions a higher log-probability than the base model did, and the others a lower one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from learner_helpers import Sample, record_group, sample_completions, two_turn

from harnessrl.store import TraceStore
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.trainer.engine import EngineSettings, PolicyEngine
from harnessrl.trainer.learner import Learner, LearnerSettings
from harnessrl.trainer.losses import LossConfig
from harnessrl.trainer.metrics import LearnerMetrics
from harnessrl.trainer.weight_sync import GateReport, SyncReport, WeightSync

PROMPT = list(range(40, 64))
OBSERVATION = [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harnessrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def trajectories(tiny: Path) -> list[Sample]:
    first = sample_completions(tiny, PROMPT, 4, 6, seed=3)
    samples = []
    for i, (completion, logprobs) in enumerate(first):
        reward = 1.0 if i < 2 else 0.0
        if i % 2 == 0:  # single call
            samples.append(Sample(((PROMPT, completion, logprobs),), reward))
        else:  # two calls; the second continues after an observation
            context = PROMPT + completion + OBSERVATION
            (second,) = sample_completions(tiny, context, 1, 5, seed=10 + i)
            samples.append(Sample(two_turn(PROMPT, (completion, logprobs), OBSERVATION, second), reward))
    return samples


def generated_logprob(model, sample: Sample) -> float:
    """Sum of log-probs of every generated token of the trajectory under ``model``."""
    prompt, completion, _ = sample.turns[-1]
    ids = prompt + completion
    mask = np.zeros(len(ids), bool)
    for p, c, _ in sample.turns:
        mask[len(p):len(p) + len(c)] = True
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    positions = np.flatnonzero(mask)
    return float(logp[positions - 1, torch.tensor(ids)[positions]].sum())


@pytest.mark.parametrize(("loss", "aggregation", "mini_batches"), [
    ("ppo-clip", "per-rollout-mean", 1),  # the defaults: one update per step + truncated IS
    ("cispo", "token-mean", 2),  # two updates per step, the second clipped against the step's start
])
def test_a_few_steps_raise_rewarded_completions_and_lower_the_others(tiny: Path, tmp_path: Path, loss: str,
                                                                     aggregation: str, mini_batches: int):
    from transformers import AutoModelForCausalLM

    store = TraceStore.connect(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    samples = trajectories(tiny)
    for task in ("t0", "t1", "t2"):
        record_group(store, "learn", task, samples)

    settings = LearnerSettings(run="learn", model_dir=tiny, output_dir=tmp_path / "out", steps=3, tasks_per_step=1,
                               group_size=4, engine=EngineSettings(lr=5e-4), wait_timeout_s=0,
                               loss=LossConfig(loss=loss, aggregation=aggregation), mini_batches=mini_batches)
    metrics = LearnerMetrics()
    learner = Learner(settings, PolicyEngine(tiny, settings.engine), store, metrics=metrics)
    outcomes = learner.run()

    assert [o.version for o in outcomes] == [1, 2, 3]
    first = outcomes[0].metrics
    assert first["trained_rollouts"] == 4 and first["trained_rows"] == 4  # two-call trajectories merged
    assert first["updates"] == mini_batches
    assert first["merged_calls"] == 2 and first["generated_tokens"] == 4 * 6 + 2 * 5
    # Not an engine comparison (sampler and learner are both transformers here; the learner against vLLM is
    # test_weight_sync_vllm.py and, at temperature 0.7, test_sampling_vllm.py): the learner's merged rows and
    # masks line up with the sampled tokens, since a token scored one position off would not get the
    # sampler's log-prob.
    assert first["logprob_abs_diff"] < 1e-4 and first["logprob_pearson"] > 0.9999
    # Step 2 trains on rollouts of version 0 with version-1 weights: no token is on-policy, so no agreement is
    # claimed (stale tokens differ by design); the drift shows in the gap between the learner's step-start and
    # the rollout log-probs, which the truncated importance weights correct.
    assert "logprob_abs_diff" not in outcomes[1].metrics and outcomes[1].metrics["staleness_max"] == 1
    assert outcomes[1].metrics["old_rollout_abs_diff"] > 1e-3

    before = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "versions" / "v000003", dtype=torch.float32).eval()
    change = [generated_logprob(after, s) - generated_logprob(before, s) for s in samples]
    assert change[0] > 0 and change[1] > 0, change
    assert change[2] < 0 and change[3] < 0, change

    exposition = metrics.exposition()[0].decode()
    assert "harnessrl_learner_steps_total 3.0" in exposition
    assert "harnessrl_learner_rollouts_consumed_total 12.0" in exposition
    assert "harnessrl_learner_policy_version 3.0" in exposition
    store.close()


class RecordingSync(WeightSync):
    """A rollout side that only notes which versions it was asked to load (every load succeeds)."""

    def __init__(self) -> None:
        super().__init__([])
        self.calls: list[int] = []

    def sync(self, version: int, checkpoint: Path) -> SyncReport:
        self.calls.append(version)
        return SyncReport(version, True, [], GateReport({}), {}, 0.0)


def test_a_step_without_trainable_rollouts_consumes_them_without_a_new_version(tiny: Path, tmp_path: Path):
    """A step whose groups all have equal rewards trains nothing: it consumes its rollouts, saves and syncs
    nothing and takes no version number (the step record keeps version 0 and says why); the next step that
    trains makes version 1, and both count towards ``steps``."""
    store = TraceStore.connect(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    prompt = list(range(20, 30))
    flat = record_group(store, "flat", "same", [Sample(((prompt, [300 + i] * 4, [-2.0] * 4),), 1.0) for i in range(3)])
    varied = record_group(store, "flat", "varied",
                          [Sample(((prompt, [400 + i] * 4, [-2.0] * 4),), float(i)) for i in range(3)])
    settings = LearnerSettings(run="flat", model_dir=tiny, output_dir=tmp_path / "out", steps=2, tasks_per_step=1,
                               group_size=3, wait_timeout_s=0)
    sync = RecordingSync()
    metrics = LearnerMetrics()
    empty, trained = Learner(settings, PolicyEngine(tiny, settings.engine), store, sync=sync, metrics=metrics).run()
    assert (empty.step, empty.version, empty.synced) == (1, 0, False)
    assert empty.metrics["empty_step"] == 1 and empty.metrics["zero_variance_groups"] == 1
    assert empty.metrics["skipped_reason"].startswith("1 of 1 groups had equal rewards")
    assert (trained.step, trained.version, trained.synced) == (2, 1, True)
    ledger = LearnerLedger(store, "flat")
    assert ledger.step_metrics(1)["skipped_reason"] == empty.metrics["skipped_reason"]
    assert ledger.step_metrics(1)["policy_version"] == 0 and ledger.step_metrics(2)["policy_version"] == 1
    assert set(ledger.consumed_by(1)) == set(flat) and set(ledger.consumed_by(2)) == set(varied)
    assert [v.version for v in ledger.versions()] == [0, 1] and ledger.committed_step() == 2
    assert sorted(p.name for p in (tmp_path / "out" / "versions").iterdir()) == ["v000001"]  # nothing saved for step 1
    assert sync.calls == [1]
    assert "harnessrl_learner_empty_steps_total 1.0" in metrics.exposition()[0].decode()
    store.close()
