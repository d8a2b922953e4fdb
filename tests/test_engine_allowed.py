"""The learner scores a grammar-constrained token over the tokens the grammar allowed (``TrainRow.allowed``).

Pure torch: a linear head on random hidden states stands in for the model's output layer, so the masked
log-prob is checked against a hand computation, the whole-vocabulary fallback against the plain one, and a
one-token set (a forced token) against its zero gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harnessrl.trainer.engine import TrainRow, _chunk_logprobs, collate

VOCAB, HIDDEN = 32, 8


@pytest.fixture
def head() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(HIDDEN, VOCAB, bias=False)


def test_restricted_positions_take_log_softmax_over_the_allowed_ids_only(head: torch.nn.Linear):
    hidden = torch.randn(3, HIDDEN)
    targets = torch.tensor([4, 7, 9])
    allowed = torch.tensor([[4, 5, 6], [-1, -1, -1], [9, 2, -1]])
    for temperature in (1.0, 0.7):
        logp, entropy = _chunk_logprobs(head, hidden, targets, temperature, 1.0, allowed)
        logits = head(hidden).detach() / temperature
        full = torch.log_softmax(logits, -1)
        want0 = logits[0, 4] - torch.logsumexp(logits[0, [4, 5, 6]], -1)
        want2 = logits[2, 9] - torch.logsumexp(logits[2, [9, 2]], -1)
        assert torch.allclose(logp.detach(), torch.stack([want0, full[1, 7], want2]), atol=1e-6)
        masked = torch.log_softmax(logits[0, [4, 5, 6]], -1)
        assert entropy[0] == pytest.approx(float(-(masked.exp() * masked).sum()), abs=1e-5)
        assert entropy[1] == pytest.approx(float(-(full[1].exp() * full[1]).sum()), abs=1e-5)


def test_without_sets_nothing_changes(head: torch.nn.Linear):
    hidden = torch.randn(4, HIDDEN)
    targets = torch.tensor([1, 2, 3, 4])
    plain, _ = _chunk_logprobs(head, hidden, targets, 1.0, 0.9)
    none, _ = _chunk_logprobs(head, hidden, targets, 1.0, 0.9, torch.full((4, 2), -1))
    assert torch.equal(plain, none)


def test_a_one_token_set_is_log_prob_zero_with_no_gradient(head: torch.nn.Linear):
    hidden = torch.randn(1, HIDDEN, requires_grad=True)
    logp, _ = _chunk_logprobs(head, hidden, torch.tensor([3]), 1.0, 1.0, torch.tensor([[3]]))
    assert float(logp.detach()) == 0.0
    logp.sum().backward()
    assert float(head.weight.grad.abs().sum()) == 0.0 and float(hidden.grad.abs().sum()) == 0.0


def test_collate_lines_sets_up_with_targets_and_drops_a_set_without_the_sampled_token():
    ids = np.array([10, 11, 12, 13, 14, 15], np.int64)
    mask = np.array([0, 0, 1, 1, 1, 0], np.int8)
    row = TrainRow(0, ("r", 0), ids, mask, np.zeros(6, np.float32), np.zeros(6, np.float32),
                   np.zeros(6, np.float32),
                   allowed={2: np.array([12, 20]), 3: np.array([21, 22]), 4: np.array([14])})
    plain = TrainRow(1, ("s", 0), ids, mask, np.zeros(6, np.float32), np.zeros(6, np.float32),
                     np.zeros(6, np.float32))
    mb = collate([row, plain])
    assert mb.targets.tolist() == [12, 13, 14, 12, 13, 14]
    assert mb.allowed.tolist() == [[12, 20], [-1, -1], [14, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert collate([plain]).allowed is None
