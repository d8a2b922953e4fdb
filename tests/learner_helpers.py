"""Helpers for the learner tests.

Recorded rollouts: real samples of the tiny model, written through the real store API. Completions are
sampled with transformers (token IDs and log-probs exactly as sampled), then stored as a scheduler + proxy
would: task, rollouts, calls, reward, terminal state. Multi-turn rollouts have a second call whose prompt
extends the first call's prompt + completion (an "observation" in between), so the store keeps it as a delta
and the row builder merges it. Also random engine rows and a REINFORCE loss for the engine tests.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from harnessrl.store import CallRecord, RolloutState, TraceStore
from harnessrl.trainer.engine import PolicyEngine, TrainRow


@dataclass(frozen=True)
class Sample:
    """One rollout's calls: (prompt ids, completion ids, log-probs) per turn, and its reward."""

    turns: tuple[tuple[list[int], list[int], list[float]], ...]
    reward: float


def sample_completions(model_dir: Path, prompt_ids: list[int], n: int, max_new_tokens: int, seed: int
                       ) -> list[tuple[list[int], list[float]]]:
    """``n`` sampled completions with their log-probs under the model (temperature 1, like vLLM's default)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for _ in range(n):
            ids = list(prompt_ids)
            completion, logprobs = [], []
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                logp = torch.log_softmax(logits, -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                completion.append(token)
                logprobs.append(float(logp[token]))
                ids.append(token)
            out.append((completion, logprobs))
    return out


def record_group(store: TraceStore, run: str, task_id: str, samples: list[Sample], policy_version: int = 0,
                 state: RolloutState = RolloutState.SUCCEEDED) -> list[tuple[str, int]]:
    """Store one task group (task, rollouts, calls, rewards, finished); returns the (rollout, attempt) keys."""
    store.add_tasks(run, [{"id": task_id, "prompt": task_id}])
    keys = []
    for index, sample in enumerate(samples):
        rollout = store.create_rollout(run, task_id, index, rollout_id=f"{task_id}-{index}-{uuid.uuid4().hex[:6]}")
        store.transition(rollout, 0, RolloutState.RUNNING, policy_version=policy_version)
        calls = [
            CallRecord(
                call_id=f"{rollout}-c{seq}", run=run, rollout_id=rollout, attempt=0, seq=seq, route="completions",
                request={"model": "tiny", "prompt": prompt}, response={"choices": [{"text": ""}]},
                prompt_token_ids=list(prompt), completion_token_ids=list(completion), logprobs=list(logprobs),
                policy_version=policy_version, finish_reason="length",
            )
            for seq, (prompt, completion, logprobs) in enumerate(sample.turns)
        ]
        store.add_calls(calls)
        store.set_reward(rollout, 0, sample.reward)
        store.finish_attempt(rollout, 0, state)
        keys.append((rollout, 0))
    return keys


def two_turn(prompt: list[int], first: tuple[list[int], list[float]], observation: list[int],
             second: tuple[list[int], list[float]]) -> tuple[tuple[list[int], list[int], list[float]], ...]:
    """A two-call trajectory: the second prompt is the first prompt + completion + an observation."""
    second_prompt = prompt + first[0] + observation
    return ((prompt, first[0], first[1]), (second_prompt, second[0], second[1]))


# -- engine-level helpers -------------------------------------------------------------------------------------


def make_rows(seed: int = 0, count: int = 7) -> list[TrainRow]:
    """Random rows: different lengths, two generated spans of different lengths, advantages of both signs,
    token-mean weights over all rows."""
    rng = np.random.default_rng(seed)
    raw = []
    for i in range(count):
        n = int(rng.integers(12, 60))
        ids = rng.integers(3, 1000, n).astype(np.int64)
        mask = np.zeros(n, np.int8)
        for start in sorted(rng.choice(np.arange(2, n - 3), 2, replace=False)):
            mask[start:start + int(rng.integers(1, 9))] = 1  # spans of different lengths
        raw.append((ids, mask, rng.normal(-6, 1, n).astype(np.float32), float(rng.choice([-1.0, 0.5, 2.0]))))
    total = sum(int(m[1:].sum()) for _, m, _, _ in raw)
    return [
        TrainRow(i, (f"r{i % 3}", 0), ids, mask, lp * mask, mask.astype(np.float32) * a,
                 mask.astype(np.float32) / total)
        for i, (ids, mask, lp, a) in enumerate(raw)
    ]


def reinforce(mb, logp, entropy):
    return -(mb.weights * mb.advantages * logp).sum(), {"tokens": torch.tensor(float(mb.num_targets))}


def flat(engine: PolicyEngine) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
