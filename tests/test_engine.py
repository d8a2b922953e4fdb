"""The DeepSpeed policy engine on the CPU (one process): log-probs, and updates independent of the batch split.

Adam's first step is nearly ``lr * sign(g)``, which hides gradient scale errors; these tests use Adam with a
large epsilon (``eps = 1``), so the first update is ``lr * g / (|g| + 1)``: a monotone, nearly linear map of the
gradient, and a wrong normalisation shows up in the weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from learner_helpers import flat, make_rows, reinforce

from harnessrl.trainer import engine as engine_mod
from harnessrl.trainer.engine import (
    EngineSettings,
    LoraSettings,
    PolicyEngine,
    collate,
    plan_micro_batches,
    shard_rows,
)

LINEAR_ADAM = {"lr": 1.0, "eps": 1.0, "gradient_clip": 1.0e9}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harnessrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def one_step(tiny: Path, rows, loss_fn=reinforce, **settings):
    engine = PolicyEngine(tiny, EngineSettings(**{**LINEAR_ADAM, **settings}))
    before = flat(engine)
    result = engine.train_step(rows, loss_fn)
    return flat(engine) - before, result


def test_token_logprobs_equal_a_full_log_softmax_in_chunks(tiny: Path, monkeypatch: pytest.MonkeyPatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(engine_mod, "LOGPROB_CHUNK_TOKENS", 5)  # several chunks per micro-batch
    rows = make_rows(1, 4)
    engine = PolicyEngine(tiny, EngineSettings())
    got = engine.score(rows)
    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for row, values in zip(rows, got):
        with torch.no_grad():
            logits = reference(torch.tensor(row.input_ids[None])).logits[0]
        positions = np.flatnonzero(row.loss_mask[1:]) + 1
        expected = torch.log_softmax(logits[positions - 1], -1)[np.arange(len(positions)), row.input_ids[positions]]
        np.testing.assert_allclose(values, expected.numpy(), atol=2e-5)


def test_one_micro_batch_or_many_give_the_same_update(tiny: Path):
    rows = make_rows()
    whole, r1 = one_step(tiny, rows, micro_batch_tokens=10_000)
    split, r2 = one_step(tiny, rows, micro_batch_tokens=64)
    assert r1.micro_batches == 1 and r2.micro_batches >= 4
    assert r1.grad_norm == pytest.approx(r2.grad_norm, rel=1e-5)
    assert r1.loss == pytest.approx(r2.loss, rel=1e-5, abs=1e-7)
    assert r1.stats["tokens"] == r2.stats["tokens"] == sum(int(r.loss_mask[1:].sum()) for r in rows)
    assert whole.abs().max() > 1e-4  # the step moved the weights
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-7)

    # The comparison is sensitive: a loss normalised per micro-batch (the usual accumulation mistake) differs.
    def per_micro_batch_mean(mb, logp, entropy):
        loss, stats = reinforce(mb, logp, entropy)
        return loss / mb.weights.sum().clamp_min(1e-12) / r2.micro_batches, stats

    wrong, _ = one_step(tiny, rows, per_micro_batch_mean, micro_batch_tokens=64)
    assert not torch.allclose(wrong, whole, rtol=1e-2, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_update(tiny: Path):
    rows = make_rows(2, 4)
    plain, r1 = one_step(tiny, rows)
    checkpointed, r2 = one_step(tiny, rows, gradient_checkpointing=True)
    assert r1.grad_norm == pytest.approx(r2.grad_norm, rel=1e-5)
    torch.testing.assert_close(checkpointed, plain, rtol=1e-4, atol=1e-7)


def test_gradient_clipping_bounds_the_update(tiny: Path):
    rows = make_rows(3, 4)
    free, r1 = one_step(tiny, rows)
    clipped, r2 = one_step(tiny, rows, gradient_clip=r1.grad_norm / 10)
    assert r2.grad_norm == pytest.approx(r1.grad_norm, rel=1e-5)  # reported before clipping
    assert clipped.norm() < free.norm() / 5


def test_lora_trains_only_the_adapter_and_saves_it(tiny: Path, tmp_path: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = LoraSettings(rank=4, alpha=8.0)
    engine = PolicyEngine(tiny, EngineSettings(lr=1e-2, lora=lora))
    named = dict(engine.module.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen_before = {n: p.detach().clone() for n, p in named.items() if n not in trainable}
    lora_before = {n: named[n].detach().clone() for n in trainable}
    engine.train_step(make_rows(4, 4), reinforce)
    engine.train_step(make_rows(5, 4), reinforce)  # B starts at 0: the second step moves A as well
    for n, value in frozen_before.items():
        assert torch.equal(named[n], value), n
    assert all(not torch.equal(named[n], lora_before[n]) for n in trainable)

    engine.save_pretrained(tmp_path / "adapter")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    rows = make_rows(6, 2)
    ours = engine.score(rows)
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    for row, values in zip(rows, ours):
        with torch.no_grad():
            logits = loaded(torch.tensor(row.input_ids[None])).logits[0]
        positions = np.flatnonzero(row.loss_mask[1:]) + 1
        expected = torch.log_softmax(logits[positions - 1], -1)[np.arange(len(positions)), row.input_ids[positions]]
        np.testing.assert_allclose(values, expected.numpy(), atol=2e-5)

    # A restarted learner without engine state loads the published adapter back.
    restarted = PolicyEngine(tiny, EngineSettings(lr=1e-2, lora=lora, seed=1))  # another random init
    restarted.load_published(tmp_path / "adapter")
    for mine, theirs in zip(restarted.score(rows), ours):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)


def test_a_process_without_launcher_variables_is_a_world_of_one(tiny: Path):
    import os

    engine = PolicyEngine(tiny, EngineSettings())
    assert (engine.dist.rank, engine.dist.world_size) == (0, 1)
    assert "WORLD_SIZE" not in os.environ and "RANK" not in os.environ  # the test process is left as it was


def test_micro_batch_plan_respects_the_budget_and_keeps_every_row():
    rows = make_rows(7, 20)
    plan = plan_micro_batches(rows, 100)
    assert sorted(r.index for group in plan for r in group) == list(range(20))
    for group in plan:
        assert len(group) == 1 or len(group) * max(r.num_tokens for r in group) <= 100
    mb = collate(plan[0])
    assert mb.input_ids.shape[0] == len(plan[0])
    assert mb.num_targets == sum(int(r.loss_mask[1:].sum()) for r in plan[0])


def test_shards_balance_tokens_over_ranks():
    rows = make_rows(8, 30)
    shards = shard_rows(rows, 3)
    loads = [sum(r.num_tokens for r in shard) for shard in shards]
    assert sorted(r.index for shard in shards for r in shard) == list(range(30))
    assert max(loads) - min(loads) <= max(r.num_tokens for r in rows)
