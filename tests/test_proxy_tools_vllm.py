"""Harnesses as they are, through the real proxy on a real vLLM (CPU, tiny model, the ``openai`` client):
a function-calling loop and two interleaved conversations each merge into one training row per conversation.

The server runs the way a function-calling deployment does: ``--enable-auto-tool-choice --tool-call-parser
hermes`` (the tiny model's template is Qwen2.5's, with its tool markers), plus ``--enable-scale-out`` for the
render/derender endpoints the proxy continues tool calls through. A random model still calls tools validly
when ``tool_choice`` names a function: vLLM constrains the output to the parser's format and (``strict``) the
schema; small schemas (an enum, no parameters) let it finish well within ``max_tokens``.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import httpx
import openai
import pytest

pytest.register_assert_rewrite("proxy_servers", "vllm_fixtures")
from proxy_servers import RunningProxy, metric_value
from vllm_fixtures import VllmServer, proxy_in_front

from harnessrl.store import CallStatus
from harnessrl.trainer.rows import merge_calls_into_rows

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, tool_server (shared)

pytestmark = pytest.mark.vllm

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "read a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "enum": ["a.py", "tests/test_a.py"]}},
                "required": ["path"],
                "additionalProperties": False,
            },
            # arguments pinned to the schema (else only the call's envelope is constrained); last, where
            # vLLM's request model puts it before the template renders the tools
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "run the test suite",
            "parameters": {
                "type": "object",
                "properties": {},
                "additionalProperties": False,
            },
            "strict": True,
        },
    },
]
TASK = [
    {"role": "system", "content": "you are a coding agent"},
    {"role": "user", "content": "read file 42 and fix the error in the test"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def captured(tool_server: VllmServer, tmp_path_factory: pytest.TempPathFactory):
    with proxy_in_front(tool_server, tmp_path_factory.mktemp("proxy-tools"), "test-run",
                        {"temperature": 1.0}) as (store, proxy):
        yield proxy, store


def client(proxy: RunningProxy, rollout: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{proxy.url}/rollouts/{rollout}/attempts/0/v1", api_key="unused", max_retries=0, timeout=120
    )


def continuity(proxy: RunningProxy, outcome: str) -> float:
    text = httpx.get(f"{proxy.url}/metrics").text
    return metric_value(text, "harnessrl_proxy_token_continuity_total", outcome=outcome) or 0


def test_template_with_tools_renders_the_same_in_transformers_and_vllm(tool_server, tokenizer):
    history = [
        *TASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "def f(): pass"},
    ]  # fmt: skip
    for messages, tools in ((TASK, None), (TASK, TOOLS), (history, TOOLS)):
        payload = {"model": tool_server.model, "messages": messages, "add_generation_prompt": True}
        if tools:
            payload["tools"] = tools
        served = httpx.post(f"{tool_server.base_url}/tokenize", json=payload, timeout=60).json()["tokens"]
        local = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
        assert served == local
    assert len(tokenizer.apply_chat_template(TASK, tools=TOOLS, tokenize=True, return_dict=False)) > len(
        tokenizer.apply_chat_template(TASK, tokenize=True, return_dict=False)) + 50


def test_function_calling_loop_merges_into_one_row_per_rollout(captured, tokenizer):
    """The openai client in a function-calling loop (tools, forced tool calls, tool results, five turns,
    two rollouts): every call after the first continues the previous one's exact tokens through the server's
    render/derender, the client gets proper tool calls, and each rollout is one training row."""
    proxy, store = captured
    used = continuity(proxy, "used")
    for rollout in ("tools-0", "tools-1"):
        c = client(proxy, rollout)
        messages = list(TASK)
        received = []
        for turn in range(5):
            tool = TOOLS[turn % 2]["function"]["name"]
            resp = c.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, max_tokens=256,
                tool_choice={"type": "function", "function": {"name": tool}},
            )  # fmt: skip
            message = resp.choices[0].message
            (call,) = message.tool_calls
            assert call.function.name == tool and call.id
            json.loads(call.function.arguments)  # constrained to the schema: valid JSON arguments
            received.append(message)
            messages += [
                message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": f"result {turn}: 3 tests failed in file {turn}"},
            ]
        proxy.flush(60)
        calls = store.read_calls(rollout, 0)
        assert [call.status for call in calls] == [CallStatus.OK] * 5
        for prev, call in itertools.pairwise(calls):
            context = prev.prompt_token_ids + prev.completion_token_ids
            assert call.prompt_token_ids[: len(context)] == context
        for call, message in zip(calls, received, strict=True):
            text = tokenizer.decode(call.completion_token_ids, skip_special_tokens=True)
            (tool_call,) = message.tool_calls
            # hermes: the sampled tokens are the call in the parser's format, exactly what the client got
            assert json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
                "name": tool_call.function.name, "arguments": json.loads(tool_call.function.arguments)}
            stored = call.response["choices"][0]["message"]["tool_calls"][0]
            assert stored["function"] == {"name": tool_call.function.name, "arguments": tool_call.function.arguments}
            assert len(call.logprobs) == len(call.completion_token_ids) > 0
        result = merge_calls_into_rows(store.rollout_calls(rollout, 0))
        assert len(result.rows) == 1 and result.stats.kept_calls == 5
        final = len(calls[-1].prompt_token_ids) + len(calls[-1].completion_token_ids)
        assert result.stats.row_tokens / final <= 1.05
    assert continuity(proxy, "used") - used == 8


def test_two_interleaved_conversations_make_two_rows(captured, tokenizer):
    """An agent and a sub-agent take turns in one rollout: each call continues its own conversation's last
    call (not the rollout's previous call), and the rollout trains as two rows."""
    proxy, store = captured
    c = client(proxy, "interleaved")
    used = continuity(proxy, "used")
    conversations = [list(TASK), [{"role": "system", "content": "you are a sub agent"},
                                  {"role": "user", "content": "search the code for the error"}]]
    for turn in range(3):
        for i, messages in enumerate(conversations):
            reply = c.chat.completions.create(model="m", messages=messages, max_tokens=8).choices[0].message
            messages += [{"role": "assistant", "content": reply.content},
                         {"role": "user", "content": f"observation {turn} for agent {i}"}]
    assert continuity(proxy, "used") - used == 4
    proxy.flush(60)
    calls = store.read_calls("interleaved", 0)
    for earlier, call in zip(calls, calls[2:]):  # each extends the call two before it: its own conversation's
        context = earlier.prompt_token_ids + earlier.completion_token_ids
        assert call.prompt_token_ids[: len(context)] == context
    result = merge_calls_into_rows(store.rollout_calls("interleaved", 0))
    assert [len(row.call_ids) for row in result.rows] == [3, 3]
    finals = [calls[-2], calls[-1]]
    assert result.stats.row_tokens == sum(len(c.prompt_token_ids) + len(c.completion_token_ids) for c in finals)


def test_tools_with_automatic_choice_continue_and_answer_what_the_parser_reads(captured, tokenizer):
    """``tool_choice`` left to the model (the default with tools), tools without ``strict``: free text the
    hermes parser reads. Each later call continues the previous one's tokens, and the client gets what the
    server's parser made of them."""
    proxy, store = captured
    c = client(proxy, "auto")
    used = continuity(proxy, "used")
    loose = [{**tool, "function": {k: v for k, v in tool["function"].items() if k != "strict"}} for tool in TOOLS]
    messages = list(TASK)
    for turn in range(3):
        message = c.chat.completions.create(model="m", messages=messages, tools=loose, max_tokens=8).choices[0].message
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": f"go on {turn}"}]
    assert continuity(proxy, "used") - used == 2
    proxy.flush(60)
    calls = store.read_calls("auto", 0)
    for prev, call in itertools.pairwise(calls):
        context = prev.prompt_token_ids + prev.completion_token_ids
        assert call.prompt_token_ids[: len(context)] == context
    for call in calls:
        message = call.response["choices"][0]["message"]
        # with tools the parser reads special tokens too (vLLM keeps them in the text), the stop token aside; a
        # character cut by max_tokens decodes to U+FFFD here and is held back by vLLM's detokenizer
        ids = call.completion_token_ids[:-1] if call.finish_reason == "stop" else call.completion_token_ids
        text = tokenizer.decode(ids, skip_special_tokens=False)
        assert message.get("tool_calls") or (message["content"] or "") in (text, text.rstrip("\ufffd"))
