"""Grammar-constrained calls on the real vLLM: the proxy records each token's allowed set, and the learner's
log-prob over that set is vLLM's.

What vLLM 0.32 does (checked first, since everything rests on it): with ``--logprobs-mode processed_logprobs``
and ``top_logprobs`` K on a call whose ``tool_choice`` forces a function, the top entries are those of the
grammar-masked distribution; the tokens the grammar forbids come back at -9999.0 (-inf, clamped), so at a
position with such an entry the finite entries are the whole allowed set and their probabilities sum to 1.
Without a grammar no entry is forbidden.

Then through the proxy, a harness that asks for no log-probs (as the flights example's SDK): two forced tool
calls, the second continued through render/generate/derender; the harness gets no log-probs back, and every
stored call has per completion token the allowed set (or [] where more than K tokens were legal), holding the
sampled token, a single token exactly where vLLM's log-prob is 0. The learner's masked log-prob (``engine``'s
``_chunk_logprobs`` over the rows and sets the learner builds from the store) agrees with vLLM's stored
log-probs, where the whole-vocabulary one does not.
"""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

pytest.register_assert_rewrite("proxy_servers", "vllm_fixtures")
from vllm_fixtures import VllmServer, proxy_in_front

from harnessrl.proxy.protocol import CONSTRAINED_TOP_LOGPROBS, FORBIDDEN_LOGPROB
from harnessrl.trainer.engine import TrainRow, _chunk_logprobs, collate
from harnessrl.trainer.learner import row_allowed_sets
from harnessrl.trainer.rows import merge_calls_into_rows

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, tool_server (shared)

pytestmark = pytest.mark.vllm


def _tool(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"{name} a flight",
        "parameters": {"type": "object", "properties": properties, "required": list(properties),
                       "additionalProperties": False},
        "strict": True,
    }}  # fmt: skip


TOOLS = [
    _tool("find", {"to": {"type": "string", "enum": ["Rome", "Oslo", "Paris"]},
                   "day": {"type": "string", "enum": ["Mon", "Tue", "Fri"]}}),
    _tool("book", {"seats": {"type": "integer", "enum": [1, 2, 3]},
                   "cabin": {"type": "string", "enum": ["eco", "first"]}}),
]
USER = [{"role": "user", "content": "Find me a flight to Paris on Tue."}]


def forced(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def top_entries(server: VllmServer, **extra) -> list[dict]:
    body = {"model": server.model, "messages": USER, "max_tokens": 40, "temperature": 1.0, "seed": 3,
            "logprobs": True, "top_logprobs": CONSTRAINED_TOP_LOGPROBS, "return_tokens_as_token_ids": True, **extra}
    answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["logprobs"]["content"]


def test_vllm_reports_forbidden_tokens_at_minus_9999_so_the_legal_ones_are_all_shown(tool_server: VllmServer):
    shown = 0
    for entry in top_entries(tool_server, tools=TOOLS, tool_choice=forced("find")):
        tops = entry["top_logprobs"]
        assert len(tops) == CONSTRAINED_TOP_LOGPROBS
        legal = [t for t in tops if t["logprob"] > FORBIDDEN_LOGPROB]
        if len(legal) == len(tops):
            continue  # more legal tokens than K: not all shown
        shown += 1
        assert {t["logprob"] for t in tops if t not in legal} == {FORBIDDEN_LOGPROB}
        assert entry["token"] in {t["token"] for t in legal}  # the sampled token is one of them
        assert math.fsum(math.exp(t["logprob"]) for t in legal) == pytest.approx(1.0, abs=1e-4)
        if len(legal) == 1:
            assert entry["logprob"] == 0.0
    assert shown >= 10  # the call's skeleton and enum values: small sets
    # without a grammar every top entry is a token the sampler could draw
    free = top_entries(tool_server)
    assert all(t["logprob"] > FORBIDDEN_LOGPROB for entry in free for t in entry["top_logprobs"])


@pytest.fixture(scope="module")
def captured(tool_server: VllmServer, tmp_path_factory: pytest.TempPathFactory):
    with proxy_in_front(tool_server, tmp_path_factory.mktemp("proxy-constrained"), "constrained",
                        {"temperature": 1.0}) as (store, proxy):
        yield proxy, store


def client(proxy, rollout: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/rollouts/{rollout}/attempts/0/v1", api_key="unused",
                         max_retries=0, timeout=120)


def test_forced_calls_store_their_allowed_sets_and_the_learner_scores_them_as_vllm_did(captured, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    proxy, store = captured
    c = client(proxy, "forced")
    messages = list(USER)
    for turn, (name, follow_up) in enumerate((("find", None), ("book", "Yes, 2 seats in first."))):
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
        resp = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice=forced(name),
                                         max_tokens=120)
        choice = resp.choices[0]
        assert choice.logprobs is None  # not asked for: the proxy's top log-probs stay with the proxy
        message = choice.message
        messages += [message.model_dump(exclude_none=True)]
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"done {turn}"})
        if not message.tool_calls:  # cut off at max_tokens: the next call still continues this one
            messages.append({"role": "user", "content": "go on"})
    # an unconstrained call (auto tool choice) in between asks for nothing more and stores no sets
    c.chat.completions.create(model="m", messages=USER, max_tokens=8)
    proxy.flush(60)

    calls = store.read_calls("forced", 0)
    constrained, free = calls[:2], calls[2]
    assert free.allowed_token_ids is None and "top_logprobs" not in (free.sampling or {})
    shown = forced_tokens = 0
    for call in constrained:
        sets = call.allowed_token_ids
        assert sets is not None and len(sets) == len(call.completion_token_ids)
        for token, logprob, ids in zip(call.completion_token_ids, call.logprobs, sets, strict=True):
            if ids:
                shown += 1
                assert token in ids and len(ids) < CONSTRAINED_TOP_LOGPROBS
                assert (len(ids) == 1) == (logprob == 0.0)
                forced_tokens += logprob == 0.0
    assert shown >= 20 and forced_tokens >= 5
    # the second call was continued through render/generate/derender (one row): its sets came that way
    assert constrained[1].prompt_token_ids[: len(constrained[0].prompt_token_ids)] == constrained[0].prompt_token_ids

    # the learner's view: the rows and sets it builds from the store, scored by the engine's log-prob function
    sets = store.allowed_token_ids("forced", 0)
    assert set(sets) == {call.call_id for call in constrained}
    rows = merge_calls_into_rows([c for c in store.rollout_calls("forced", 0) if c.call_id in sets]).rows
    assert len(rows) == 1
    (row,) = rows
    allowed = row_allowed_sets(row, sets)
    zeros = np.zeros(row.num_tokens, np.float32)
    train_row = TrainRow(0, ("forced", 0), row.input_ids, row.loss_mask, row.rollout_logprobs, zeros, zeros,
                         allowed=allowed)
    masked_batch, full_batch = collate([train_row]), collate([TrainRow(**{**vars(train_row), "allowed": None})])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=masked_batch.input_ids).last_hidden_state[0]
        selected = hidden[masked_batch.target_pos]
        head = model.get_output_embeddings()
        masked, _ = _chunk_logprobs(head, selected, masked_batch.targets, 1.0, 1.0, masked_batch.allowed)
        full, _ = _chunk_logprobs(head, selected, full_batch.targets, 1.0, 1.0)
    vllm = masked_batch.rollout_logprobs
    on_set = masked_batch.allowed[:, 0] >= 0
    assert int(on_set.sum()) == shown
    masked_diff = (masked - vllm)[on_set].abs()
    full_diff = (full - vllm)[on_set].abs()
    print(f"constrained tokens {int(on_set.sum())}: |learner - vLLM| masked mean {masked_diff.mean():.2e} "
          f"max {masked_diff.max():.2e}; whole vocabulary mean {full_diff.mean():.3f}")
    assert float(masked_diff.max()) < 1e-2 and float(masked_diff.mean()) < 2e-3
    assert float(full_diff.mean()) > 0.5  # the whole vocabulary is another distribution altogether
    # elsewhere (not shown, or no grammar) the whole vocabulary is the learner's and vLLM's distribution
    assert torch.equal(masked[~on_set], full[~on_set])
