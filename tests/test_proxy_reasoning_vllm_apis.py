"""A reasoning model through the Anthropic SDK and the Responses API, through the real proxy on the real vLLM
with ``--reasoning-parser deepseek_r1`` (the server ``test_proxy_reasoning_vllm.py`` uses, shared).

Both routes are served as chat completions (``proxy/chat_served.py``), so the server's parser splits the
reasoning off (answered as a ``thinking`` block, or a ``reasoning`` item, as vLLM's own routes do) and a later
call that sends the answer back continues its exact tokens through the server's render / generate / derender,
the parser still at work: each conversation is one training row.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

pytest.register_assert_rewrite("proxy_servers", "vllm_fixtures")
from proxy_servers import RunningProxy, metric_value
from vllm_fixtures import VllmServer, proxy_in_front

from harnessrl.store import CallStatus, TraceStore
from harnessrl.trainer.rows import merge_calls_into_rows

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, reasoning_server (shared)

pytestmark = pytest.mark.vllm

TURNS = 3


@pytest.fixture(scope="module")
def captured(reasoning_server: VllmServer, tmp_path_factory: pytest.TempPathFactory):
    with proxy_in_front(reasoning_server, tmp_path_factory.mktemp("proxy-reasoning-apis"), "test-run",
                        {"temperature": 1.0}) as (store, proxy):
        yield proxy, store


def used(proxy: RunningProxy) -> float:
    text = httpx.get(f"{proxy.url}/metrics").text
    return metric_value(text, "harnessrl_proxy_token_continuity_total", outcome="used") or 0


def check_one_row(proxy: RunningProxy, store: TraceStore, rollout: str, route: str, tiny_model_dir: Path,
                  received: list[tuple[str, str]]) -> None:
    """Each completion is the reasoning + answer the client got, each call continues the previous one's
    tokens, and the rollout is one row exactly as long as its final call."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    proxy.flush(60)
    calls = store.read_calls(rollout, 0)
    assert [(c.status, c.route) for c in calls] == [(CallStatus.OK, route)] * TURNS
    assert any(reasoning for reasoning, _ in received)  # the parser split reasoning off
    for call, (reasoning, text) in zip(calls, received, strict=True):
        ids = call.completion_token_ids
        ids = ids[:-1] if ids[-1] == tokenizer.eos_token_id else ids  # a stop token is not in the text
        # the reasoning parser reads the text with special tokens; a cut character is held back (U+FFFD here)
        decoded = tokenizer.decode(ids, skip_special_tokens=False).replace("<think>", "").replace("</think>", "")
        assert decoded.removesuffix("\ufffd") == (reasoning + text).removesuffix("\ufffd")
        assert len(call.logprobs) == len(call.completion_token_ids) > 0
    for prev, call in itertools.pairwise(calls):
        context = prev.prompt_token_ids + prev.completion_token_ids
        assert call.prompt_token_ids[: len(context)] == context
    result = merge_calls_into_rows(store.rollout_calls(rollout, 0))
    assert len(result.rows) == 1 and not result.stats.splits
    assert result.stats.row_tokens == len(calls[-1].prompt_token_ids) + len(calls[-1].completion_token_ids)


def test_anthropic_thinking_continues_through_the_parser(captured, tiny_model_dir):
    """The anthropic client sends each answer back whole (thinking block included, one turn streamed)."""
    proxy, store = captured
    c = anthropic.Anthropic(base_url=f"{proxy.url}/rollouts/think-messages/attempts/0", api_key="unused",
                            max_retries=0, timeout=120)
    before = used(proxy)
    messages: list[dict] = [{"role": "user", "content": "fix the error in the test"}]
    received = []
    for turn in range(TURNS):
        if turn == 1:
            with c.messages.stream(model="m", max_tokens=12, messages=messages) as events:
                message = events.get_final_message()
        else:
            message = c.messages.create(model="m", max_tokens=12, messages=messages)
        thinking = "".join(b.thinking for b in message.content if b.type == "thinking")
        received.append((thinking, "".join(b.text for b in message.content if b.type == "text")))
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                     {"role": "user", "content": f"observation {turn}"}]
    assert used(proxy) - before == TURNS - 1
    check_one_row(proxy, store, "think-messages", "messages", tiny_model_dir, received)


def test_responses_reasoning_items_continue_through_the_parser(captured, tiny_model_dir):
    """The openai client appends each response's output items (its reasoning item included) to the input."""
    proxy, store = captured
    c = openai.OpenAI(base_url=f"{proxy.url}/rollouts/think-responses/attempts/0/v1", api_key="unused",
                      max_retries=0, timeout=120)
    before = used(proxy)
    items: list[dict] = [{"role": "user", "content": "fix the error in the test"}]
    received = []
    for turn in range(TURNS):
        response = c.responses.create(model="m", input=items, max_output_tokens=12)
        reasoning = "".join(part.text for item in response.output if item.type == "reasoning"
                            for part in item.content or [])
        received.append((reasoning, response.output_text))
        items += [*(item.model_dump(exclude_none=True) for item in response.output),
                  {"role": "user", "content": f"observation {turn}"}]
    assert used(proxy) - before == TURNS - 1
    check_one_row(proxy, store, "think-responses", "responses", tiny_model_dir, received)
