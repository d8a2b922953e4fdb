"""Policy-gradient losses over token log-probabilities, and how token losses are averaged into one number.

Inputs are ``[rows, tokens]`` tensors (padded rows; padding has ``loss_mask`` 0) plus, per row, the index of its
rollout. Three log-probabilities meet here for every generated token:

* ``new``: the learner's current policy, with gradient;
* ``old``: the *proximal* policy the update is measured against: the learner's weights at the start of the
  learner step, scored once before its first optimizer update (``old_logprobs``). A step makes one update per
  mini-batch, so from the second update on ``new`` has moved away from ``old`` and the clip acts; in the first
  update (and with a single mini-batch) the ratio is exactly 1 and nothing clips. Without ``old_logprobs`` the
  rollout log-probs are ``old`` (classic PPO, where the sampler is the proximal policy).
* ``rollout``: what the serving engine reported when it sampled the token (captured by the proxy): the
  *behaviour* policy, possibly some versions stale and with the engine's own numerics.

This is decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization", arXiv:2110.00641):
the clipping ratio ``new / old`` bounds how far one learner step moves the policy, and the separate behaviour
weight ``old / rollout`` (truncated importance sampling, below) corrects for tokens sampled by another policy.

Losses, with ``r = exp(new - old)`` and advantage ``A``:

* ``ppo-clip``: ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``; separate low/high bounds are DAPO's
  "clip-higher" (Yu et al. 2025, arXiv:2503.14476).
* ``cispo``: ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) A new`` (MiniMax-M1, arXiv:2506.13585): the clipped
  ratio only scales the REINFORCE gradient, so no token loses its gradient. MiniMax clip only from above: set
  ``clip_low >= 1`` for that.
* ``acpo``: ``ppo-clip`` whose bound is set per token group from the spread of the ratios (Adaptive Clip Policy
  Optimization, "What are Key Factors for Updates in RL for LLM Reasoning?", code in Control-derek/ACPO,
  ``compute_variance_adaptive_cliprange``). Exactly: generated tokens are binned by their probability under
  the new policy, ``p = exp(new)``, into ``acpo_bins`` equal-width bins of [0, 1] (the last one closed); in
  bin ``b``, ``sigma_b`` is the population standard deviation of ``r`` over the bin's tokens of the whole
  optimizer update, and every token of the bin is clipped to ``[1 - eps_b, 1 + eps_b]`` with
  ``eps_b = clamp(acpo_base_clip + acpo_alpha * sigma_b, acpo_min_clip, acpo_max_clip)``. Defaults are the
  paper's main setting (alpha 3, base 0.2, min 0, max 3, 5 bins). Bins, sigma and eps carry no gradient.
  "The whole update" matters: a statistic per micro-batch would make the update depend on how rows were
  split. So the learner sums :func:`acpo_bin_stats` over every micro-batch and rank of the update before it,
  turns them into widths with :func:`acpo_clip_widths` and passes them in (``acpo_widths``); a call without
  them uses its own tokens (one batch = one update).

Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training", fengyao.notion.site/off-policy-rl): when ``old_logprobs`` are given and ``tis_cap`` is set, each
token's policy-gradient term is multiplied by ``min(exp(old - rollout), tis_cap)`` (no gradient), correcting
for tokens sampled by a stale policy or by the serving engine's slightly different numerics; the cap bounds
the variance.

Rollout-KL penalty (``rollout_kl_coef > 0``): a penalty on the divergence from the *rollout* policy, not from
a frozen reference model (this learner holds none). Per token it is the k3 estimator (Schulman,
"Approximating KL divergence", 2020) ``exp(rollout - new) - (rollout - new) - 1``, i.e. ``(q - 1) - log q``
with ``q = pi_rollout / pi_new``: an estimate of the reverse KL, ``KL(pi_new || pi_rollout)``, as GRPO uses
against its reference. It is evaluated on the sampled tokens, which the rollout policy drew, so like GRPO's it
is exact in expectation only while the two policies agree. It is added with weight ``rollout_kl_coef`` and
aggregated like the policy term (not importance-weighted), and always measured (``rollout_kl``).

Aggregation: the loss is ``sum_t w_t * loss_t`` with per-token weights from :func:`aggregation_weights`. The
weights of a whole optimizer update can be computed once and passed in for every micro-batch, so gradient
accumulation over micro-batches sums to exactly the update's loss (the engine must then *not* divide by the
number of micro-batches again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from harnessrl.spec.learner import Algorithm

LossName = Literal["ppo-clip", "cispo", "acpo"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "per-rollout-mean"]
LOSSES: tuple[str, ...] = ("ppo-clip", "cispo", "acpo")
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "per-rollout-mean")
_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps a wild ratio finite without changing any realistic one


@dataclass(frozen=True)
class LossConfig:
    loss: LossName = "ppo-clip"
    aggregation: Aggregation = "per-rollout-mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float | None = 2.0
    rollout_kl_coef: float = 0.0  # weight of the k3 penalty on KL(new || rollout); 0: measured only
    sum_norm_tokens: int | None = None  # the fixed divisor of seq-mean-token-sum-norm (e.g. max row tokens)
    acpo_alpha: float = 3.0
    acpo_base_clip: float = 0.2
    acpo_min_clip: float = 0.0
    acpo_max_clip: float = 3.0
    acpo_bins: int = 5

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss: {self.loss!r} is not known; use one of {', '.join(LOSSES)}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation: {self.aggregation!r} is not known; use one of {', '.join(AGGREGATIONS)}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"clip: [{self.clip_low}, {self.clip_high}] has a negative bound; use values >= 0")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap: {self.tis_cap} is not positive; use e.g. 2.0, or None to turn it off")
        if self.rollout_kl_coef < 0:
            raise ValueError(f"rollout_kl_coef: {self.rollout_kl_coef} is negative; use 0 (off) or a positive weight")
        if self.aggregation == "seq-mean-token-sum-norm" and not (self.sum_norm_tokens and self.sum_norm_tokens > 0):
            raise ValueError(
                "sum_norm_tokens: seq-mean-token-sum-norm needs a fixed positive divisor; set it to the row "
                "token limit (e.g. rows.maxRowTokens)"
            )
        if self.acpo_bins < 1 or self.acpo_min_clip > self.acpo_max_clip:
            raise ValueError(
                f"acpo: bins {self.acpo_bins}, clip range [{self.acpo_min_clip}, {self.acpo_max_clip}]; "
                "use at least one bin and min <= max"
            )

    @classmethod
    def from_spec(cls, algorithm: Algorithm, *, max_row_tokens: int | None = None) -> LossConfig:
        return cls(
            loss=algorithm.loss,
            aggregation=algorithm.loss_aggregation,
            clip_low=algorithm.clip[0],
            clip_high=algorithm.clip[1],
            tis_cap=algorithm.tis_cap or None,  # the spec writes "off" as 0
            rollout_kl_coef=algorithm.rollout_kl_coef,
            sum_norm_tokens=max_row_tokens if algorithm.loss_aggregation == "seq-mean-token-sum-norm" else None,
        )


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, with gradient
    metrics: dict[str, float]  # token means over generated tokens, no gradient


def aggregation_weights(
    loss_mask: torch.Tensor,
    rollout_index: torch.Tensor,
    mode: Aggregation,
    *,
    sum_norm_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token weights (``[rows, tokens]``, float32) such that the loss is ``sum(weights * token_loss)``.

    Rows (and rollouts) without generated tokens do not count in any mean. With ``R`` rollouts, ``S`` rows and
    ``N`` generated tokens in the batch, ``n_s`` in row ``s`` and ``n_r`` in rollout ``r`` (over all its rows):
    token-mean ``1/N``; seq-mean-token-mean ``1/(S n_s)``; seq-mean-token-sum-norm ``1/(S C)`` with the fixed
    ``C = sum_norm_tokens`` (Dr. GRPO); per-rollout-mean ``1/(R n_r)``, so a rollout split into many rows
    weighs the same as one that merged into a single row.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"mode: {mode!r} is not known; use one of {', '.join(AGGREGATIONS)}")
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask: shape {tuple(loss_mask.shape)} is not [rows, tokens]")
    if rollout_index.shape != loss_mask.shape[:1]:
        raise ValueError(
            f"rollout_index: shape {tuple(rollout_index.shape)} does not match {loss_mask.shape[0]} rows; "
            "pass one rollout index per row"
        )
    mask = loss_mask.to(torch.float32)
    per_row = mask.sum(dim=1)
    if mode == "token-mean":
        return mask / per_row.sum().clamp_min(1.0)
    rows_with_tokens = (per_row > 0).sum().clamp_min(1).to(torch.float32)
    if mode == "seq-mean-token-mean":
        return mask / (per_row.clamp_min(1.0) * rows_with_tokens)[:, None]
    if mode == "seq-mean-token-sum-norm":
        if not sum_norm_tokens or sum_norm_tokens <= 0:
            raise ValueError("sum_norm_tokens: seq-mean-token-sum-norm needs a fixed positive divisor")
        return mask / (rows_with_tokens * float(sum_norm_tokens))
    index = rollout_index.to(device=mask.device, dtype=torch.long)
    _, dense = torch.unique(index, return_inverse=True)
    per_rollout = torch.zeros(int(dense.max()) + 1 if dense.numel() else 0, device=mask.device)
    per_rollout.index_add_(0, dense, per_row)
    rollouts_with_tokens = (per_rollout > 0).sum().clamp_min(1).to(torch.float32)
    return mask / (per_rollout[dense].clamp_min(1.0) * rollouts_with_tokens)[:, None]


def policy_loss(
    new_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rollout_index: torch.Tensor,
    config: LossConfig,
    *,
    old_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    acpo_widths: torch.Tensor | None = None,
) -> LossOutput:
    """The configured loss for one (micro-)batch; see the module docstring for every term.

    ``weights`` and ``acpo_widths`` are the step-wide parts: given, they make a micro-batch's loss its exact share
    of the whole update's; left out, they are computed from this call's tokens alone.
    """
    shape = new_logprobs.shape
    for name, tensor in (("rollout_logprobs", rollout_logprobs), ("advantages", advantages),
                         ("loss_mask", loss_mask), ("old_logprobs", old_logprobs),
                         ("entropy", entropy), ("weights", weights)):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} differs from new_logprobs {tuple(shape)}")
    if acpo_widths is not None and acpo_widths.shape != (config.acpo_bins,):
        raise ValueError(f"acpo_widths: {acpo_widths.numel()} values for {config.acpo_bins} bins; pass "
                         "acpo_clip_widths() of the update's acpo_bin_stats()")
    if weights is None:
        weights = aggregation_weights(loss_mask, rollout_index, config.aggregation,
                                      sum_norm_tokens=config.sum_norm_tokens)
    active = loss_mask.bool()
    mask = active.to(new_logprobs.dtype)
    zero = new_logprobs.new_zeros(())
    weights = torch.where(active, weights.to(new_logprobs.dtype), zero)  # padding never contributes
    rollout_logprobs = rollout_logprobs.detach()
    old = rollout_logprobs if old_logprobs is None else old_logprobs.detach()
    advantages = advantages.detach().to(new_logprobs.dtype)

    log_ratio = (new_logprobs - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    ratio_detached = ratio.detach()
    metrics: dict[str, float] = {}

    if config.loss == "cispo":
        lower, upper = 1.0 - config.clip_low, 1.0 + config.clip_high
        token_pg = -torch.clamp(ratio_detached, lower, upper) * advantages * new_logprobs
        clipped_low = ratio_detached < lower
        clipped_high = ratio_detached > upper
    else:
        if config.loss == "acpo":
            if acpo_widths is None:
                acpo_widths = acpo_clip_widths(acpo_bin_stats(new_logprobs, old, loss_mask, config), config)
            eps = acpo_widths.to(ratio.dtype)[_acpo_bins(new_logprobs.detach(), config)]
            lower, upper = 1.0 - eps, 1.0 + eps
            metrics["acpo_clip_mean"] = _masked_mean(eps, mask)
        else:
            lower, upper = 1.0 - config.clip_low, 1.0 + config.clip_high
        unclipped = ratio * advantages
        clipped = torch.clamp(ratio, lower, upper) * advantages
        token_pg = -torch.minimum(unclipped, clipped)
        # the clipped branch is taken (and the gradient is zero) exactly in these two cases
        clipped_low = (advantages < 0) & (ratio_detached < lower)
        clipped_high = (advantages > 0) & (ratio_detached > upper)

    if old_logprobs is not None and config.tis_cap is not None:
        behaviour_ratio = torch.exp((old - rollout_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        tis = torch.clamp(behaviour_ratio, max=config.tis_cap)
        token_pg = token_pg * tis
        metrics["tis_weight_mean"] = _masked_mean(tis, mask)
        metrics["tis_capped_frac"] = _masked_mean((behaviour_ratio > config.tis_cap).float(), mask)

    pg_loss = (weights * torch.where(active, token_pg, zero)).sum()
    loss = pg_loss
    delta = (rollout_logprobs - new_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    rollout_kl = torch.exp(delta) - delta - 1.0  # k3 of KL(new || rollout)
    metrics["rollout_kl"] = _masked_mean(rollout_kl, mask)
    if config.rollout_kl_coef > 0:
        kl_loss = (weights * torch.where(active, rollout_kl, zero)).sum()
        loss = loss + config.rollout_kl_coef * kl_loss
        metrics["rollout_kl_loss"] = float(kl_loss.detach())

    metrics["pg_loss"] = float(pg_loss.detach())
    metrics["loss"] = float(loss.detach())
    metrics["tokens"] = float(mask.sum())
    metrics["clip_frac_low"] = _masked_mean(clipped_low.float(), mask)
    metrics["clip_frac_high"] = _masked_mean(clipped_high.float(), mask)
    metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]  # the two sets are disjoint
    metrics["ratio_mean"] = _masked_mean(ratio_detached, mask)
    metrics["approx_kl"] = _masked_mean((ratio_detached - 1.0) - log_ratio.detach(), mask)  # k3 of KL(old||new)
    if old_logprobs is not None:
        metrics["old_rollout_abs_diff"] = _masked_mean((old - rollout_logprobs).abs(), mask)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy.detach(), mask)
    return LossOutput(loss, metrics)


def _acpo_bins(new_logprobs: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """Each token's probability bin: ``acpo_bins`` equal-width bins of [0, 1], the last one closed at 1."""
    probs = torch.exp(new_logprobs.detach()).clamp(0.0, 1.0)
    return torch.clamp((probs * config.acpo_bins).long(), max=config.acpo_bins - 1)


def acpo_bin_stats(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                   config: LossConfig) -> torch.Tensor:
    """``[acpo_bins, 3]`` float64 sums per probability bin over the generated tokens: count, sum r, sum r^2.

    Sums, so the statistic of a whole update is the sum over its micro-batches and ranks (an all-reduce), and
    :func:`acpo_clip_widths` turns it into one clip width per bin. No gradient.
    """
    new = new_logprobs.detach()
    ratio = torch.exp((new - old_logprobs.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)).double()
    active = loss_mask.bool()
    bins = _acpo_bins(new, config)[active]
    ratio = ratio[active]
    stats = torch.zeros((config.acpo_bins, 3), dtype=torch.float64, device=new.device)
    stats.index_add_(0, bins, torch.stack([torch.ones_like(ratio), ratio, ratio * ratio], dim=1))
    return stats


def acpo_clip_widths(stats: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """Per-bin clip half-width ``clamp(base + alpha * sigma_b, min, max)`` from :func:`acpo_bin_stats` sums.

    ``sigma_b`` is the population standard deviation of the ratios in bin ``b`` (0 for an empty bin, whose width
    no token uses).
    """
    count = stats[:, 0].clamp_min(1.0)
    mean = stats[:, 1] / count
    sigma = (stats[:, 2] / count - mean * mean).clamp_min(0.0).sqrt()
    return (config.acpo_base_clip + config.acpo_alpha * sigma).clamp(config.acpo_min_clip, config.acpo_max_clip)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over generated tokens; padding is ignored even when it holds NaN."""
    total = mask.sum()
    if float(total) == 0:
        return 0.0
    values = values.detach()
    return float(torch.where(mask.bool(), values, values.new_zeros(())).sum() / total)
