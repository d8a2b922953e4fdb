"""A group's common prefix computed once (trainer/prefix_sharing.py): the same log-probs and the same parameter
gradients as every row computed in full, on the tiny model, with full weights, LoRA, gradient checkpointing,
DeepSpeed ZeRO-2 updates and allowed sets; rows sharing too little go row by row and are counted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from learner_helpers import flat, reinforce

from harnessrl.trainer import engine as engine_mod
from harnessrl.trainer.engine import EngineSettings, LoraSettings, PolicyEngine, TrainRow, shard_rows
from harnessrl.trainer.prefix_sharing import PrefixGroup, group_shared_prefixes, split_to_budget

LINEAR_ADAM = {"lr": 1.0, "eps": 1.0, "gradient_clip": 1.0e9}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harnessrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def group_rows(seed: int = 0) -> list[TrainRow]:
    """Two groups of rows with a common prompt (8 and 3 rows), plus 3 rows that share nothing.

    Generated spans lie in the suffixes, on the first suffix token (predicted from the last prefix position)
    and, for some rows, inside the shared prefix too (a prefix that holds an earlier completion); some targets
    carry a grammar's allowed set; advantages and weights differ per row.
    """
    rng = np.random.default_rng(seed)
    raw = []
    for size, prefix_len in ((8, 48), (3, 30), (1, 0), (1, 0), (1, 0)):
        prefix = rng.integers(3, 1000, prefix_len)
        for k in range(size):
            suffix = rng.integers(3, 1000, int(rng.integers(4, 14)) if prefix_len else int(rng.integers(20, 50)))
            ids = np.concatenate([prefix, suffix]).astype(np.int64)
            n = len(ids)
            mask = np.zeros(n, np.int8)
            mask[max(prefix_len, 2):n] = rng.random(n - max(prefix_len, 2)) < 0.7
            mask[prefix_len if prefix_len else 2] = 1
            if prefix_len and k % 2:
                mask[prefix_len - 10:prefix_len - 6] = 1
            allowed = {int(p): np.unique(np.append(rng.integers(3, 1000, 5), ids[p]))
                       for p in np.flatnonzero(mask)[::4]}
            raw.append((ids, mask, float(rng.choice([-1.0, 0.5, 2.0])), allowed))
    total = sum(int(m[1:].sum()) for _, m, _, _ in raw)
    return [
        TrainRow(i, (f"r{i}", 0), ids, mask, rng.normal(-6, 1, len(ids)).astype(np.float32) * mask,
                 mask.astype(np.float32) * a, mask.astype(np.float32) / total, allowed=allowed)
        for i, (ids, mask, a, allowed) in enumerate(raw)
    ]


def gradients(engine: PolicyEngine, rows: list[TrainRow], shared: bool) -> tuple[list[torch.Tensor], list[int]]:
    """The REINFORCE loss's parameter gradients over every micro-batch, and each batch's packed row count."""
    engine.shared_prefix_min_fraction = 0.5 if shared else None
    params = [p for p in engine.module.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    packed = []
    for mb in engine._padded_plan(rows):
        logp, entropy = engine.token_logprobs(mb)
        loss, _ = reinforce(mb, logp, entropy)
        for acc, g in zip(total, torch.autograd.grad(loss, params), strict=True):
            acc += g
        packed.append(mb.shared_rows)
    return total, packed


def assert_same_gradients(engine: PolicyEngine, rows: list[TrainRow]) -> None:
    full, packed_full = gradients(engine, rows, shared=False)
    shared, packed = gradients(engine, rows, shared=True)
    assert sum(packed_full) == 0 and sum(packed) == 11  # the two groups were packed, the 3 others not
    scale = max(float(g.abs().max()) for g in full)
    assert scale > 1e-4
    for a, b in zip(shared, full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)
    # the comparison is sensitive: packed under a plain causal mask (and sdpa's blocks one causal block), a
    # row's suffix sees the rows packed before it, and the gradient differs
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_mod, "shared_prefix_mask", causal_only)
        patch.setattr(engine_mod, "attention_blocks",
                      lambda layouts, length: tuple(((0, length, ((0, length),)),) for _ in layouts))
        wrong, _ = gradients(engine, rows, shared=True)
    assert any(not torch.allclose(a, b, rtol=1e-2, atol=1e-3 * scale) for a, b in zip(wrong, full))
    if engine.attn_implementation == "sdpa":  # and sdpa computes by the blocks: suffixes cut off the prefix differ
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(engine_mod, "attention_blocks", without_prefix(engine_mod.attention_blocks))
            wrong, _ = gradients(engine, rows, shared=True)
        assert any(not torch.allclose(a, b, rtol=1e-2, atol=1e-3 * scale) for a, b in zip(wrong, full))


def without_prefix(attention_blocks):
    """The blocks with each suffix's keys cut to the suffix itself (the mask alone would still allow the
    prefix): what sdpa computes only if the blocks are what it computes by."""
    def blocks(layouts, length):
        return tuple(tuple((q0, q1, ranges[-1:]) for q0, q1, ranges in row)
                     for row in attention_blocks(layouts, length))
    return blocks


def causal_only(segments: np.ndarray) -> np.ndarray:
    t = segments.shape[1]
    return np.broadcast_to(np.tril(np.ones((t, t), dtype=bool)), (segments.shape[0], 1, t, t)).copy()


def test_shared_prefix_gives_the_gradients_of_every_row_in_full(tiny: Path):
    engine = PolicyEngine(tiny, EngineSettings(zero_stage=0, micro_batch_tokens=4096))
    assert_same_gradients(engine, group_rows())


def test_shared_prefix_gives_the_same_lora_gradients(tiny: Path):
    engine = PolicyEngine(tiny, EngineSettings(zero_stage=0, lora=LoraSettings(rank=4, alpha=8.0)))
    with torch.no_grad():  # peft starts B at 0, which would leave A without gradient
        for name, p in engine.module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    assert_same_gradients(engine, group_rows())


def test_shared_prefix_gives_the_same_log_probs_with_sdpa_and_eager(tiny: Path):
    rows = group_rows(2)
    engine = PolicyEngine(tiny, EngineSettings(micro_batch_tokens=100))  # groups cut into several pieces
    for implementation in ("sdpa", "eager"):
        engine._causal_lm().set_attn_implementation(implementation)
        engine.attn_implementation = implementation
        engine.shared_prefix_min_fraction = None
        alone = engine.score(rows)
        engine.shared_prefix_min_fraction = 0.5
        shared = engine.score(rows)
        for a, b in zip(shared, alone, strict=True):
            np.testing.assert_allclose(a, b, atol=2e-5)


def test_zero2_update_with_gradient_checkpointing_equals_the_unshared_one(tiny: Path):
    rows = group_rows(3)
    updates, results = [], []
    for fraction in (None, 0.5):
        engine = PolicyEngine(tiny, EngineSettings(**LINEAR_ADAM, zero_stage=2, gradient_checkpointing=True,
                                                   shared_prefix_min_fraction=fraction))
        before = flat(engine)
        results.append(engine.train_step(rows, reinforce))
        updates.append(flat(engine) - before)
    alone, shared = results
    assert (alone.shared_prefix_rows, alone.prefix_fallback_rows) == (0, len(rows))
    assert (shared.shared_prefix_rows, shared.prefix_fallback_rows) == (11, 3)
    assert shared.shared_prefix_tokens == 7 * 48 + 2 * 30
    assert shared.row_tokens == alone.row_tokens and shared.target_tokens == alone.target_tokens
    assert shared.grad_norm == pytest.approx(alone.grad_norm, rel=1e-4)
    assert updates[0].abs().max() > 1e-4
    torch.testing.assert_close(updates[1], updates[0], rtol=1e-3, atol=1e-6)


def test_rows_sharing_less_than_the_threshold_go_alone():
    rows = group_rows()
    groups, alone = group_shared_prefixes(rows, 0.5)
    assert sorted(len(g.rows) for g in groups) == [3, 8]
    assert sorted(g.prefix for g in groups) == [30, 48]
    assert sorted(r.index for r in alone) == [11, 12, 13]
    # the 8-row group shares 48 tokens of rows up to 61 long: above 0.75 of its longest row it splits up
    strict, _ = group_shared_prefixes(rows, 0.8)
    assert all(g.prefix >= 0.8 * max(r.num_tokens for r in g.rows) for g in strict)
    assert sum(len(g.rows) for g in strict) < 11
    # a packed group longer than the budget is cut into pieces that each carry the prefix
    big = next(g for g in groups if len(g.rows) == 8)
    pieces = split_to_budget(big, 80)
    assert sorted(r.index for p in pieces for r in (p.rows if isinstance(p, PrefixGroup) else [p])) == \
        sorted(r.index for r in big.rows)
    assert all(p.num_tokens <= 80 for p in pieces if isinstance(p, PrefixGroup))
    # sharding keeps a group on one rank
    shards = shard_rows(rows, 2, 0.5)
    owner = {r.index: k for k, shard in enumerate(shards) for r in shard}
    assert len({owner[r.index] for r in big.rows}) == 1


def test_attention_blocks_hold_every_pair_the_mask_allows_and_few_others():
    """sdpa computes a packed batch block by block (shared_prefix_attention): every query-key pair the mask
    allows lies in one of its query's blocks, and the blocks hold about the pairs needed, not [T, T]."""
    from harnessrl.trainer.prefix_sharing import attention_blocks, pack, shared_prefix_mask

    rows = [r for r in group_rows() if r.index < 8]
    group = group_shared_prefixes(rows, 0.5)[0][0]
    layout = pack(group)
    length = len(layout.input_ids) + 5  # padded, as the shorter group of a batch is
    segments = np.full((1, length), -1, np.int64)
    segments[0, :len(layout.input_ids)] = layout.segment
    mask = shared_prefix_mask(segments)[0, 0]
    covered = np.zeros_like(mask)
    for q0, q1, ranges in attention_blocks([layout], length)[0]:
        assert not covered[q0:q1].any()  # each query in one block
        for s, e in ranges:
            covered[q0:q1, s:e] = True
    assert covered.any(axis=1).all()
    assert not (mask & ~covered).any()
    assert covered.sum() < 0.6 * length * length
