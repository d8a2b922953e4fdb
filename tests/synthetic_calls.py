"""Synthetic agent trajectories shaped like what the proxy captures from vLLM's OpenAI server.

A toy chat template renders messages to token ids the way real ones do (start marker, role, content, end
marker), so each call's prompt extends the previous prompt + completion exactly as with a real model. The
response has vLLM's fields (``prompt_token_ids``, ``choices[0].token_ids``, chat log-prob entries with token,
logprob, bytes and top_logprobs). Log-probs are float32 values from a real float32 log-softmax.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from harnessrl.store import CallRecord

START = datetime(2026, 1, 1, tzinfo=UTC)  # fixed, so the same trajectory can be rebuilt to compare
VOCAB = 151_936
IM_START, IM_END, NEWLINE = 151_644, 151_645, 198
ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77_091, "tool": 14_172}


def float32_logprobs(rng: np.random.Generator, n: int) -> list[float]:
    """Log-probs of sampled tokens from a float32 log-softmax: exactly what vLLM hands out."""
    logits = rng.standard_normal((n, 256), dtype=np.float32) * np.float32(3.0)
    shifted = logits - logits.max(axis=1, keepdims=True)
    logsoftmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    picked = rng.integers(0, 256, size=n)
    values = logsoftmax[np.arange(n), picked]
    assert values.dtype == np.float32
    return values.tolist()


@dataclass
class Tokenizer:
    """Random but fixed token strings (~4 characters, like BPE pieces of English text)."""

    rng: np.random.Generator
    strings: dict[int, str] = field(default_factory=dict)

    def piece(self, token: int) -> str:
        if token not in self.strings:
            letters = self.rng.integers(97, 123, size=int(self.rng.integers(2, 6)))
            self.strings[token] = " " + "".join(map(chr, letters))
        return self.strings[token]

    def sample(self, n: int) -> tuple[list[int], list[str]]:
        ids = self.rng.integers(1000, VOCAB - 1000, size=n).tolist()
        return ids, [self.piece(t) for t in ids]


def render(message: dict[str, Any], content_ids: list[int]) -> list[int]:
    return [IM_START, ROLE_IDS[message["role"]], NEWLINE, *content_ids, IM_END, NEWLINE]


def vllm_chat_response(
    prompt: list[int], completion: list[int], pieces: list[str], logprobs: list[float], text: str, serial: int
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.UUID(int=serial).hex}",
        "object": "chat.completion",
        "created": 1_760_000_000 + serial,
        "model": "qwen-test",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": {
                    "content": [
                        {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                        for p, lp in zip(pieces, logprobs, strict=True)
                    ]
                },
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": list(completion),
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + len(completion),
            "completion_tokens": len(completion),
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": list(prompt),
        "kv_transfer_params": None,
    }


def chat_trajectory(
    rollout_id: str,
    turns: int,
    system_tokens: int = 1000,
    observation_tokens: int = 500,
    completion_tokens: int = 100,
    seed: int = 0,
    run: str = "run",
    attempt: int = 0,
    resend_reply: str = "exact",
) -> list[CallRecord]:
    """One rollout attempt of ``turns`` chat calls; each call resends the whole history.

    ``resend_reply``: "exact" resends vLLM's reply message as received (OpenAI SDK ``messages.append(msg)``),
    "rewritten" resends only {role, content} (what many harnesses do).
    """
    rng = np.random.default_rng(seed)
    tok = Tokenizer(rng)
    sys_ids, sys_pieces = tok.sample(system_tokens)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "".join(sys_pieces)}]
    prompt = render(messages[0], sys_ids)
    calls: list[CallRecord] = []
    for turn in range(turns):
        obs_ids, obs_pieces = tok.sample(observation_tokens)
        observation = {"role": "user" if turn == 0 else "tool", "content": "".join(obs_pieces)}
        if observation["role"] == "tool":
            observation["tool_call_id"] = f"call_{turn}"
        messages = [*messages, observation]
        prompt = [*prompt, *render(observation, obs_ids), IM_START, ROLE_IDS["assistant"], NEWLINE]
        content_ids, pieces = tok.sample(completion_tokens - 1)
        completion = [*content_ids, IM_END]
        pieces = [*pieces, ""]  # the end marker decodes to nothing
        logprobs = float32_logprobs(rng, len(completion))
        text = "".join(pieces)
        response = vllm_chat_response(prompt, completion, pieces, logprobs, text, seed * 10_000 + turn)
        request = {"model": "qwen-test", "messages": messages, "temperature": 1.0, "max_tokens": 1024}
        calls.append(
            CallRecord(
                call_id=f"{rollout_id}-{attempt}-{turn}",
                run=run,
                rollout_id=rollout_id,
                attempt=attempt,
                seq=turn,
                route="chat",
                request=request,
                response=response,
                prompt_token_ids=list(prompt),
                completion_token_ids=completion,
                logprobs=logprobs,
                policy_version=3,
                upstream="http://vllm-0:8000",
                latency_s=0.25 + turn / 1000,
                finish_reason="stop",
                created_at=START + timedelta(seconds=seed * 10_000 + turn, microseconds=123),
            )
        )
        reply = response["choices"][0]["message"]
        if resend_reply == "rewritten":
            reply = {"role": "assistant", "content": reply["content"]}
        messages = [*messages, reply]
        prompt = [*prompt, *completion, NEWLINE]
    return calls
