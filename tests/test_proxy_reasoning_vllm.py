"""A reasoning model's harness through the real proxy on a real vLLM (CPU, tiny model, the ``openai`` client).

The server splits reasoning off the answer (``--reasoning-parser deepseek_r1``: everything up to ``</think>``
is reasoning, so the random tiny model's whole output is), and the harness drops the reasoning from the
history it resends, as many do. The rule (``proxy/continuity.py``): continue from the sampled tokens -- the
trajectory is one row, every token is trained exactly as sampled and none is re-encoded, and the harness still
gets the reasoning split off by the server's own parser (render / generate / derender, ``--enable-scale-out``).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import openai
import pytest

pytest.register_assert_rewrite("proxy_servers", "vllm_fixtures")
from proxy_servers import metric_value
from vllm_fixtures import VllmServer, proxy_in_front

from harnessrl.store import CallStatus
from harnessrl.trainer.rows import merge_calls_into_rows

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, reasoning_server (shared)

pytestmark = pytest.mark.vllm

def test_harness_that_drops_reasoning_still_trains_one_row_of_the_sampled_tokens(
    reasoning_server: VllmServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with proxy_in_front(reasoning_server, tmp_path, "test-run", {"temperature": 1.0}) as (store, proxy):
        c = openai.OpenAI(base_url=f"{proxy.url}/rollouts/think/attempts/0/v1", api_key="unused", max_retries=0,
                          timeout=120)  # fmt: skip
        messages = [{"role": "user", "content": "fix the error in the test"}]
        received = []
        for turn in range(3):
            message = c.chat.completions.create(model="m", messages=messages, max_tokens=12).choices[0].message
            extra = message.model_extra or {}
            reasoning = extra.get("reasoning") or extra.get("reasoning_content")
            received.append((reasoning, message.content))
            # the harness keeps the answer and drops the reasoning
            messages += [{"role": "assistant", "content": message.content or ""},
                         {"role": "user", "content": f"observation {turn}"}]  # fmt: skip
        metrics = httpx.get(f"{proxy.url}/metrics").text
        assert metric_value(metrics, "harnessrl_proxy_token_continuity_total", outcome="used") == 2
        proxy.flush(60)
        calls = store.read_calls("think", 0)
        assert [call.status for call in calls] == [CallStatus.OK] * 3
        assert any(reasoning for reasoning, _ in received)  # the parser split reasoning off
        for call, (reasoning, content) in zip(calls, received, strict=True):
            ids = call.completion_token_ids
            ids = ids[:-1] if ids[-1] == tokenizer.eos_token_id else ids  # a stop token is not in the text
            # the reasoning parser asks for the text with special tokens (vLLM: skip_special_tokens false)
            text = tokenizer.decode(ids, skip_special_tokens=False).replace("<think>", "").replace("</think>", "")
            # a partial UTF-8 character at the end is held back by the server's detokenizer (U+FFFD here)
            assert text.removesuffix("\ufffd") == ((reasoning or "") + (content or "")).removesuffix("\ufffd")
            assert len(call.logprobs) == len(call.completion_token_ids)
        for prev, call in itertools.pairwise(calls):  # the reasoning tokens stay in the history, as sampled
            context = prev.prompt_token_ids + prev.completion_token_ids
            assert call.prompt_token_ids[: len(context)] == context
        result = merge_calls_into_rows(store.rollout_calls("think", 0))
        assert len(result.rows) == 1 and not result.stats.splits
        assert result.stats.row_tokens == len(calls[-1].prompt_token_ids) + len(calls[-1].completion_token_ids)
