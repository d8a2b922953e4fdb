"""Numerical tests for the losses and aggregation modes: every expected number is worked out by hand here."""

from __future__ import annotations

import math

import pytest
import torch

from harnessrl.spec.learner import Algorithm
from harnessrl.trainer.losses import (
    LossConfig,
    acpo_bin_stats,
    acpo_clip_widths,
    aggregation_weights,
    policy_loss,
)

# Three rows of up to four tokens: rows 0 and 1 belong to rollout 7, row 2 to rollout 3.
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
ROLLOUT = torch.tensor([7, 7, 3])
ADV = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [5.0, 6.0, 0.0, 0.0]])


def log(x: float) -> float:
    return math.log(x)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4 + 5 + 6) / 6),
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1 + (5 + 6) / 2) / 3),
        ("seq-mean-token-sum-norm", ((1 + 2 + 3) / 4 + 4 / 4 + (5 + 6) / 4) / 3),  # fixed divisor 4
        ("per-rollout-mean", ((1 + 2 + 3 + 4) / 4 + (5 + 6) / 2) / 2),  # rollout 7 spans two rows
    ],
)
def test_each_aggregation_mode_by_hand(mode, expected):
    # With new == old the ratio is 1, nothing clips, and each token's loss is exactly -A.
    logprobs = torch.full(MASK.shape, log(0.5), requires_grad=True)
    config = LossConfig(loss="ppo-clip", aggregation=mode, sum_norm_tokens=4, tis_cap=None)
    out = policy_loss(logprobs, logprobs.detach().clone(), ADV, MASK, ROLLOUT, config)
    assert out.loss.item() == pytest.approx(-expected)

    weights = aggregation_weights(MASK, ROLLOUT, mode, sum_norm_tokens=4)
    assert (weights[MASK == 0] == 0).all()
    out.loss.backward()
    # d(-w A r)/d new = -w A at r = 1: the gradient raises the log-prob of every positive-advantage token
    assert torch.allclose(logprobs.grad, -weights * ADV)


def test_per_rollout_mean_weights_a_split_rollout_like_a_merged_one():
    weights = aggregation_weights(MASK, ROLLOUT, "per-rollout-mean")
    assert weights[0, 0].item() == pytest.approx(1 / 8) and weights[1, 0].item() == pytest.approx(1 / 8)
    assert weights[2, 0].item() == pytest.approx(1 / 4)
    assert weights.sum().item() == pytest.approx(1.0)
    # a row without generated tokens changes no mean
    padded = aggregation_weights(torch.cat([MASK, torch.zeros(1, 4, dtype=torch.long)]),
                                 torch.tensor([7, 7, 3, 9]), "per-rollout-mean")
    assert torch.allclose(padded[:3], weights)


# Four tokens, old p = 0.4: ratios 1.5, 0.5, 0.5, 1.5 (new p = 0.6, 0.2, 0.2, 0.6).
OLD4 = torch.full((1, 4), log(0.4))
NEW4 = torch.tensor([[log(0.6), log(0.2), log(0.2), log(0.6)]])
ONE_ROW = torch.tensor([0])
MASK4 = torch.ones(1, 4)


def test_ppo_clip_higher_by_hand():
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    new = NEW4.clone().requires_grad_(True)
    out = policy_loss(new, OLD4, adv, MASK4, ONE_ROW, LossConfig(loss="ppo-clip", clip_low=0.2, clip_high=0.28,
                                                                  aggregation="token-mean"))
    # min(rA, clip(r, 0.8, 1.28) A): 1.28 (capped above), 0.5, -0.8 (capped below), -1.5
    assert out.loss.item() == pytest.approx(-(1.28 + 0.5 - 0.8 - 1.5) / 4, abs=1e-6)
    out.loss.backward()
    # clipped tokens get no gradient; the others -A r / 4
    assert new.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 4, 0.0, 1.5 / 4], abs=1e-6)
    assert out.metrics["clip_frac_high"] == 0.25 and out.metrics["clip_frac_low"] == 0.25
    assert out.metrics["ratio_mean"] == pytest.approx(1.0)
    k3 = lambda r: (r - 1) - math.log(r)
    assert out.metrics["approx_kl"] == pytest.approx((2 * k3(1.5) + 2 * k3(0.5)) / 4, rel=1e-5)
    assert out.metrics["tokens"] == 4


def test_cispo_by_hand_keeps_a_gradient_on_clipped_tokens():
    adv = torch.tensor([[1.0, 2.0, -1.0, -0.5]])
    new = NEW4.clone().requires_grad_(True)
    out = policy_loss(new, OLD4, adv, MASK4, ONE_ROW, LossConfig(loss="cispo", clip_low=0.2, clip_high=0.28,
                                                                  aggregation="token-mean"))
    # weight = clip(r, 0.8, 1.28), detached: 1.28, 0.8, 0.8, 1.28; loss_t = -weight * A * new
    expected = [-1.28 * 1 * log(0.6), -0.8 * 2 * log(0.2), -0.8 * -1 * log(0.2), -1.28 * -0.5 * log(0.6)]
    assert out.loss.item() == pytest.approx(sum(expected) / 4, rel=1e-5)
    out.loss.backward()
    assert new.grad.tolist()[0] == pytest.approx([-1.28 / 4, -1.6 / 4, 0.8 / 4, 0.64 / 4], rel=1e-5)
    assert out.metrics["clip_frac_low"] == 0.5 and out.metrics["clip_frac_high"] == 0.5


def test_acpo_widens_the_clip_where_ratios_spread():
    # Bin [0, 0.2): new p 0.1 and 0.14 from old 0.1 -> ratios 1.0 and 1.4, population std 0.2,
    #   eps = 0.2 + 3 * 0.2 = 0.8 -> bounds [0.2, 1.8]: nothing clips.
    # Bin [0.8, 1]: new p 0.9 twice with ratio 1.3 -> std 0, eps = 0.2 -> 1.3 clips to 1.2.
    new = torch.tensor([[log(0.1), log(0.14), log(0.9), log(0.9)]], requires_grad=True)
    old = torch.tensor([[log(0.1), log(0.1), log(0.9 / 1.3), log(0.9 / 1.3)]])
    adv = torch.ones(1, 4)
    out = policy_loss(new, old, adv, MASK4, ONE_ROW, LossConfig(loss="acpo", aggregation="token-mean"))
    assert out.loss.item() == pytest.approx(-(1.0 + 1.4 + 1.2 + 1.2) / 4, abs=1e-5)
    assert out.metrics["acpo_clip_mean"] == pytest.approx((0.8 + 0.8 + 0.2 + 0.2) / 4, abs=1e-5)
    assert out.metrics["clip_frac_high"] == 0.5
    out.loss.backward()
    assert new.grad.tolist()[0] == pytest.approx([-1.0 / 4, -1.4 / 4, 0.0, 0.0], abs=1e-5)
    # fixed PPO clipping at [0.8, 1.28] would have cut the 1.4 as well
    fixed = policy_loss(new.detach(), old, adv, MASK4, ONE_ROW, LossConfig(aggregation="token-mean"))
    assert fixed.loss.item() == pytest.approx(-(1.0 + 1.28 + 1.28 + 1.28) / 4, abs=1e-5)


def test_truncated_importance_sampling_by_hand():
    # Learner's old p 0.6 vs rollout engine's 0.2 -> behaviour ratio 3, capped at 2; 0.3 vs 0.6 -> 0.5.
    old = torch.tensor([[log(0.6), log(0.3)]])
    rollout = torch.tensor([[log(0.2), log(0.6)]])
    new = old.clone().requires_grad_(True)  # r = 1: the policy term per token is -A * tis
    out = policy_loss(new, rollout, torch.ones(1, 2), torch.ones(1, 2), ONE_ROW,
                      LossConfig(aggregation="token-mean", tis_cap=2.0), old_logprobs=old)
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) / 2, rel=1e-5)
    assert out.metrics["tis_weight_mean"] == pytest.approx(1.25, rel=1e-5)
    assert out.metrics["tis_capped_frac"] == 0.5
    assert out.metrics["old_rollout_abs_diff"] == pytest.approx((log(3) + log(2)) / 2, rel=1e-5)
    out.loss.backward()
    assert new.grad.tolist()[0] == pytest.approx([-2.0 / 2, -0.5 / 2], rel=1e-5)


def test_rollout_kl_penalty_is_k3_of_the_policy_against_the_rollout_policy_by_hand():
    new = torch.full((1, 2), log(0.25), requires_grad=True)
    rollout = torch.full((1, 2), log(0.5))
    out = policy_loss(new, rollout, torch.zeros(1, 2), torch.ones(1, 2), ONE_ROW,
                      LossConfig(aggregation="token-mean", rollout_kl_coef=0.1))
    # k3 with r = pi_rollout / pi_new = 2: (r - 1) - log r, an estimate of KL(pi_new || pi_rollout)
    k3 = 2.0 - log(2.0) - 1.0
    assert out.metrics["rollout_kl"] == pytest.approx(k3, rel=1e-5)
    assert out.metrics["rollout_kl_loss"] == pytest.approx(k3, rel=1e-5)
    assert out.loss.item() == pytest.approx(0.1 * k3, rel=1e-5)  # advantages 0: the penalty is the whole loss
    out.loss.backward()
    # d k3 / d new = 1 - exp(rollout - new) = -1: the penalty pulls new up towards the rollout policy
    assert new.grad.tolist()[0] == pytest.approx([-0.1 / 2, -0.1 / 2], rel=1e-5)
    # with the coefficient 0 the divergence is still measured, and the loss has no penalty
    off = policy_loss(new, rollout, torch.zeros(1, 2), torch.ones(1, 2), ONE_ROW, LossConfig(aggregation="token-mean"))
    assert off.loss.item() == 0.0 and off.metrics["rollout_kl"] == pytest.approx(k3, rel=1e-5)
    assert "rollout_kl_loss" not in off.metrics


# Decoupled PPO on the four tokens above: the clip ratio is new / old (1.5, 0.5, 0.5, 1.5), and the rollout engine
# sampled with p = 0.4/3, 0.8, 0.8, 0.4, so the behaviour weights old / rollout are 3 (capped at 2), 0.5, 0.5, 1.
ROLLOUT4 = torch.tensor([[log(0.4 / 3), log(0.8), log(0.8), log(0.4)]])
ADV4 = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
TIS4 = [2.0, 0.5, 0.5, 1.0]


@pytest.mark.parametrize(("loss", "terms", "grads", "clip_frac"), [
    # -min(r A, clip(r, 0.8, 1.28) A) * tis; a clipped token gets no gradient, the others -A r tis
    ("ppo-clip", [-1.28 * 2.0, -0.5 * 0.5, 0.8 * 0.5, 1.5 * 1.0], [0.0, -0.5 * 0.5, 0.0, 1.5 * 1.0], 0.5),
    # -sg(clip(r, 0.8, 1.28)) A new * tis: every token keeps a gradient, scaled by its clipped ratio
    ("cispo", [-1.28 * log(0.6) * 2.0, -0.8 * log(0.2) * 0.5, 0.8 * log(0.2) * 0.5, 1.28 * log(0.6) * 1.0],
     [-1.28 * 2.0, -0.8 * 0.5, 0.8 * 0.5, 1.28 * 1.0], 1.0),
    # the ratios are equal within each probability bin (p 0.2 -> bin 1, p 0.6 -> bin 3), so sigma is 0 there and
    # the bound is the base 0.2: ppo-clip within [0.8, 1.2]
    ("acpo", [-1.2 * 2.0, -0.5 * 0.5, 0.8 * 0.5, 1.5 * 1.0], [0.0, -0.5 * 0.5, 0.0, 1.5 * 1.0], 0.5),
])
def test_each_loss_clips_the_ratio_to_old_and_weights_by_the_rollout_correction_by_hand(loss, terms, grads,
                                                                                        clip_frac):
    new = NEW4.clone().requires_grad_(True)
    config = LossConfig(loss=loss, clip_low=0.2, clip_high=0.28, aggregation="token-mean", tis_cap=2.0)
    out = policy_loss(new, ROLLOUT4, ADV4, MASK4, ONE_ROW, config, old_logprobs=OLD4)
    assert out.loss.item() == pytest.approx(sum(terms) / 4, rel=1e-5)
    out.loss.backward()
    assert new.grad.tolist()[0] == pytest.approx([g / 4 for g in grads], rel=1e-5, abs=1e-7)
    assert out.metrics["clip_frac"] == pytest.approx(clip_frac)
    assert out.metrics["clip_frac"] == out.metrics["clip_frac_low"] + out.metrics["clip_frac_high"]
    assert out.metrics["tis_weight_mean"] == pytest.approx(sum(TIS4) / 4, rel=1e-5)
    assert out.metrics["ratio_mean"] == pytest.approx(1.0)


def test_acpo_takes_step_wide_clip_widths_when_given():
    # The widths of the whole update (all micro-batches, all ranks) replace this call's own statistic: the bins
    # of p in [0.4, 0.8] (where p 0.6 lies) get 0.6, so 1.5 stays unclipped for tokens 0 (A > 0) and 3 (A < 0).
    new = NEW4.clone().requires_grad_(True)
    config = LossConfig(loss="acpo", aggregation="token-mean", tis_cap=2.0)
    widths = torch.tensor([0.2, 0.2, 0.6, 0.6, 0.2])
    out = policy_loss(new, ROLLOUT4, ADV4, MASK4, ONE_ROW, config, old_logprobs=OLD4, acpo_widths=widths)
    assert out.loss.item() == pytest.approx((-1.5 * 2.0 - 0.5 * 0.5 + 0.8 * 0.5 + 1.5) / 4, rel=1e-5)
    out.loss.backward()
    assert new.grad.tolist()[0] == pytest.approx([-1.5 * 2.0 / 4, -0.25 / 4, 0.0, 1.5 / 4], rel=1e-5, abs=1e-7)
    assert out.metrics["acpo_clip_mean"] == pytest.approx((0.6 + 0.2 + 0.2 + 0.6) / 4, rel=1e-5)
    # widths come from summable per-bin sums: count, sum r, sum r^2 (population std within each bin)
    stats = acpo_bin_stats(torch.tensor([[log(0.1), log(0.14)]]), torch.full((1, 2), log(0.1)), torch.ones(1, 2),
                           config)
    assert stats[0].tolist() == pytest.approx([2.0, 2.4, 1.0 + 1.96], rel=1e-6)
    assert acpo_clip_widths(stats, config).tolist() == pytest.approx([0.8, 0.2, 0.2, 0.2, 0.2], rel=1e-5)
    with pytest.raises(ValueError, match="acpo_widths: 3 values for 5 bins"):
        policy_loss(new, ROLLOUT4, ADV4, MASK4, ONE_ROW, config, old_logprobs=OLD4, acpo_widths=torch.ones(3))


def test_metrics_report_entropy_and_ignore_nan_padding():
    new = torch.tensor([[log(0.5), float("nan")]], requires_grad=True)
    old = torch.tensor([[log(0.5), 0.0]])
    mask = torch.tensor([[1, 0]])
    out = policy_loss(new, old, torch.tensor([[2.0, float("nan")]]), mask, ONE_ROW, LossConfig(),
                      entropy=torch.tensor([[0.7, float("nan")]]))
    assert out.loss.item() == pytest.approx(-2.0)
    assert out.metrics["entropy"] == pytest.approx(0.7)
    out.loss.backward()
    assert new.grad.tolist()[0][0] == pytest.approx(-2.0) and not math.isnan(new.grad.tolist()[0][1])


@pytest.mark.parametrize("loss", ["ppo-clip", "cispo", "acpo"])
def test_step_weights_make_micro_batches_sum_to_the_full_batch(loss):
    torch.manual_seed(0)
    new = (torch.rand(3, 4).log() * 0.5).requires_grad_(True)
    old = new.detach() + 0.5 * torch.randn(3, 4)  # ratios spread enough that some clip
    config = LossConfig(loss=loss, acpo_alpha=0.5)  # per-rollout-mean
    full = policy_loss(new, old, ADV, MASK, ROLLOUT, config)
    assert full.metrics["clip_frac"] > 0
    full_grad, = torch.autograd.grad(full.loss, new)
    weights = aggregation_weights(MASK, ROLLOUT, config.aggregation)
    slices = (slice(0, 1), slice(1, 3))  # rollout 7 straddles both micro-batches
    # ACPO's widths are one statistic of the whole update: summed over the parts, as the learner sums them over
    # micro-batches and ranks
    widths = acpo_clip_widths(sum(acpo_bin_stats(new[s].detach(), old[s], MASK[s], config) for s in slices), config)
    parts = [policy_loss(new[s], old[s], ADV[s], MASK[s], ROLLOUT[s], config, weights=weights[s], acpo_widths=widths)
             for s in slices]
    summed = parts[0].loss + parts[1].loss
    assert summed.item() == pytest.approx(full.loss.item(), rel=1e-6)
    split_grad, = torch.autograd.grad(summed, new)
    assert torch.allclose(split_grad, full_grad)
    if loss == "acpo":  # each part's own statistic would have changed the update
        alone = sum(policy_loss(new[s], old[s], ADV[s], MASK[s], ROLLOUT[s], config, weights=weights[s]).loss
                    for s in slices)
        assert alone.item() != pytest.approx(full.loss.item(), rel=1e-4)


@pytest.mark.parametrize(
    ("loss", "aggregation"),
    [("ppo-clip", "per-rollout-mean"), ("cispo", "per-rollout-mean"), ("acpo", "per-rollout-mean"),
     ("ppo-clip", "token-mean"), ("ppo-clip", "seq-mean-token-mean"), ("ppo-clip", "seq-mean-token-sum-norm")],
)
def test_a_few_steps_raise_positive_advantage_tokens_and_lower_negative_ones(loss, aggregation):
    torch.manual_seed(1)
    vocab = 6
    tokens = torch.randint(0, vocab, (3, 4))
    logits = torch.zeros(3, 4, vocab, requires_grad=True)
    sign = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])  # per rollout
    adv = sign * 0.5

    def logprobs():
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]

    before = logprobs().detach()
    config = LossConfig(loss=loss, aggregation=aggregation, sum_norm_tokens=4, tis_cap=None)
    optimizer = torch.optim.SGD([logits], lr=0.5)
    for _ in range(4):
        optimizer.zero_grad()
        policy_loss(logprobs(), before, adv, MASK, ROLLOUT, config).loss.backward()
        optimizer.step()
    change = logprobs().detach() - before
    assert (change[sign > 0] > 0).all()
    assert (change[sign < 0] < 0).all()
    assert (change[MASK == 0] == 0).all()  # padding tokens get no gradient


def test_config_from_spec_and_bad_values():
    config = LossConfig.from_spec(Algorithm(loss="cispo", clip=[0.25, 0.3], tis_cap=0, rollout_kl_coef=0.01))
    assert (config.loss, config.clip_low, config.clip_high, config.tis_cap, config.rollout_kl_coef) == (
        "cispo", 0.25, 0.3, None, 0.01)
    assert config.aggregation == "per-rollout-mean"
    with pytest.raises(ValueError, match="sum_norm_tokens"):
        LossConfig(aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss: 'ppo' is not known"):
        LossConfig(loss="ppo")
    with pytest.raises(ValueError, match="advantages: shape"):
        policy_loss(NEW4, OLD4, torch.ones(2, 2), MASK4, ONE_ROW, LossConfig())
    with pytest.raises(ValueError, match="rollout_index: shape"):
        aggregation_weights(MASK, torch.tensor([0, 1]), "per-rollout-mean")
