"""The distribution the learner scores is the one the replicas sample from: softmax(logits / temperature), and
with top-p below 1 the nucleus renormalised by vLLM's rule (ascending order, drop while the cumulative
probability stays within 1 - top_p, keep the most likely token). Checked on small tensors by hand; the match
with a real vLLM's processed log-probs is in test_sampling_vllm.py."""

from __future__ import annotations

import math

import pytest
import torch

from harnessrl.trainer.engine import EngineSettings, _chunk_logprobs

PROBS = [0.5, 0.3, 0.15, 0.05]


def logprobs(targets: list[int], temperature: float = 1.0, top_p: float = 1.0) -> tuple[list[float], list[float]]:
    hidden = torch.eye(4)[: len(targets)]  # one-hot rows: the "head" maps row i to log(PROBS)
    head = torch.nn.Linear(4, 4, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(torch.log(torch.tensor(PROBS)))
    logp, entropy = _chunk_logprobs(head, hidden, torch.tensor(targets), temperature, top_p)
    return logp.tolist(), entropy.tolist()


def test_top_p_renormalises_over_the_nucleus() -> None:
    # top_p 0.8: ascending cumulative 0.05, 0.20, 0.50, 1.0 -> 0.05 and 0.15 drop, the nucleus holds 0.8
    (inside, sampled_outside), (entropy, _) = logprobs([1, 3], top_p=0.8)
    assert inside == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    nucleus = [0.5 / 0.8, 0.3 / 0.8]
    assert entropy == pytest.approx(-sum(p * math.log(p) for p in nucleus), abs=1e-6)
    # a sampled token just outside the cut (another engine's rounding) stays finite: nucleus + itself
    assert sampled_outside == pytest.approx(math.log(0.05 / 0.85), abs=1e-6)
    # top_p 1 is the plain softmax
    (plain,), _ = logprobs([1])
    assert plain == pytest.approx(math.log(0.3), abs=1e-6)


def test_temperature_then_top_p() -> None:
    scaled = [p ** (1 / 0.5) for p in PROBS]
    total = sum(scaled)
    scaled = [p / total for p in scaled]  # T=0.5 sharpens: 0.5 alone is above 0.6 of the mass
    assert scaled[0] > 0.6
    (top,), _ = logprobs([0], temperature=0.5, top_p=0.6)
    assert top == pytest.approx(0.0, abs=1e-6)  # the nucleus is that one token


def test_top_p_out_of_range_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"spec\.rollout\.topP"):
        EngineSettings(top_p=0.0)
