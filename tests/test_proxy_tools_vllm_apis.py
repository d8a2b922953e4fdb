"""Function-calling loops through the Anthropic SDK (``/v1/messages``) and the OpenAI Responses API
(``/v1/responses``), through the real proxy on the real vLLM with the tool flags: each call after the first
continues the previous call's exact tokens, so a rollout merges into one training row, as chat does
(``test_proxy_tools_vllm.py``, whose server this module shares).

The proxy serves both routes as the chat completions they amount to (``proxy/chat_served.py``); a streamed call
is answered whole, so it continues too; so is a streamed chat call the server's tool parser must read. Where
continuity cannot apply, the call says why: ``previous_response_id``
gets a 400 naming it, and a Responses call the translation cannot carry is served by vLLM's own route with its
reason counted.
"""

from __future__ import annotations

import itertools
import json
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

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, tool_server (shared)

pytestmark = pytest.mark.vllm

SYSTEM = "you are a coding agent"
TASK = "read file 42 and fix the error in the test"
# Small schemas, arguments pinned to them (strict): a random model's forced tool call ends well within max_tokens.
SCHEMAS = {
    "read_file": {"type": "object", "properties": {"path": {"type": "string", "enum": ["a.py", "tests/test_a.py"]}},
                  "required": ["path"], "additionalProperties": False},
    "run_tests": {"type": "object", "properties": {}, "additionalProperties": False},
}
# Forced tool calls for the first turns, then the model's own choice (short free text the parser reads).
CHOICES = ["read_file", "run_tests", "read_file", None]
STREAMED_TURN = 1  # answered whole by the proxy, so it continues like the others


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def captured(tool_server: VllmServer, tmp_path_factory: pytest.TempPathFactory):
    with proxy_in_front(tool_server, tmp_path_factory.mktemp("proxy-tools-apis"), "test-run",
                        {"temperature": 1.0}) as (store, proxy):
        yield proxy, store


def continuity(proxy: RunningProxy, outcome: str) -> float:
    text = httpx.get(f"{proxy.url}/metrics").text
    return metric_value(text, "harnessrl_proxy_token_continuity_total", outcome=outcome) or 0


def check_one_row(proxy: RunningProxy, store: TraceStore, rollout: str, route: str, tokenizer,
                  received: list[tuple[str | None, object]]) -> None:
    """Every call stored OK with a log-prob per token, each continuing the previous one's exact tokens, every
    completion decoding to what the client got (``received``: per call, the tool called and its arguments,
    or None and the text), and the rollout one training row of about the final trajectory's length."""
    proxy.flush(60)
    calls = store.read_calls(rollout, 0)
    assert [(c.status, c.route) for c in calls] == [(CallStatus.OK, route)] * len(received)
    for prev, call in itertools.pairwise(calls):
        context = prev.prompt_token_ids + prev.completion_token_ids
        assert call.prompt_token_ids[: len(context)] == context
    for call, (tool, got) in zip(calls, received, strict=True):
        assert len(call.logprobs) == len(call.completion_token_ids) > 0
        assert "_harnessrl_tokens" not in call.response
        if tool is None:  # with tools the parser reads special tokens too, so the text keeps any it sampled
            ids = call.completion_token_ids[:-1] if call.finish_reason == "stop" else call.completion_token_ids
            text = tokenizer.decode(ids, skip_special_tokens=False)
            assert text == got or text.rstrip("\ufffd") == got
        else:  # hermes: the sampled tokens are the call in the parser's format, exactly what the client got
            text = tokenizer.decode(call.completion_token_ids, skip_special_tokens=True)
            assert json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
                "name": tool, "arguments": got}
    result = merge_calls_into_rows(store.rollout_calls(rollout, 0))
    assert len(result.rows) == 1 and result.stats.kept_calls == len(received)
    final = len(calls[-1].prompt_token_ids) + len(calls[-1].completion_token_ids)
    assert result.stats.row_tokens / final <= 1.05


def test_anthropic_function_calling_loop_merges_into_one_row(captured, tokenizer):
    """The anthropic client: tools, tool_use and tool_result blocks, a tool forced for the first turns (one
    turn streamed), then the model's own choice."""
    proxy, store = captured
    c = anthropic.Anthropic(base_url=f"{proxy.url}/rollouts/messages-loop/attempts/0", api_key="unused",
                            max_retries=0, timeout=120)
    tools = [{"name": name, "description": f"{name} in the repository", "input_schema": schema, "strict": True}
             for name, schema in SCHEMAS.items()]
    used = continuity(proxy, "used")
    messages: list[dict] = [{"role": "user", "content": TASK}]
    received: list[tuple[str | None, object]] = []
    for turn, tool in enumerate(CHOICES):
        kwargs = {"model": "m", "max_tokens": 128 if tool else 8, "system": SYSTEM, "tools": tools,
                  "messages": messages, "tool_choice": {"type": "tool", "name": tool} if tool else {"type": "auto"}}
        if turn == STREAMED_TURN:
            with c.messages.stream(**kwargs) as events:
                message = events.get_final_message()
        else:
            message = c.messages.create(**kwargs)
        messages = [*messages, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}]
        if tool is None:
            received.append((None, "".join(b.text for b in message.content if b.type == "text")))
            break
        (use,) = message.content
        assert message.stop_reason == "tool_use" and use.type == "tool_use" and use.name == tool and use.id
        received.append((tool, use.input))
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": f"result {turn}: 3 tests failed"}]})
    assert continuity(proxy, "used") - used == len(CHOICES) - 1
    check_one_row(proxy, store, "messages-loop", "messages", tokenizer, received)


def test_responses_function_calling_loop_merges_into_one_row(captured, tokenizer):
    """The openai client on the Responses API: function tools, the previous output items and a
    function_call_output appended to the input each turn, a function forced for the first turns (one turn
    streamed), then the model's own choice."""
    proxy, store = captured
    c = openai.OpenAI(base_url=f"{proxy.url}/rollouts/responses-loop/attempts/0/v1", api_key="unused",
                      max_retries=0, timeout=120)
    tools = [{"type": "function", "name": name, "description": f"{name} in the repository", "parameters": schema,
              "strict": True} for name, schema in SCHEMAS.items()]
    used = continuity(proxy, "used")
    items: list[dict] = [{"role": "user", "content": TASK}]
    received: list[tuple[str | None, object]] = []
    for turn, tool in enumerate(CHOICES):
        kwargs = {"model": "m", "instructions": SYSTEM, "input": items, "tools": tools,
                  "max_output_tokens": 128 if tool else 8,
                  "tool_choice": {"type": "function", "name": tool} if tool else "auto"}
        if turn == STREAMED_TURN:
            events = list(c.responses.create(**kwargs, stream=True))
            assert events[0].type == "response.created"
            response = events[-1].response
        else:
            response = c.responses.create(**kwargs)
        items = [*items, *(item.model_dump(exclude_none=True) for item in response.output)]
        if tool is None:
            received.append((None, response.output_text))
            break
        (call,) = response.output
        assert response.status == "completed" and call.type == "function_call" and call.name == tool
        received.append((tool, json.loads(call.arguments)))
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": f"result {turn}: 3 failed"})
    assert continuity(proxy, "used") - used == len(CHOICES) - 1
    check_one_row(proxy, store, "responses-loop", "responses", tokenizer, received)


def test_streamed_chat_function_calling_loop_merges_into_one_row(captured, tokenizer):
    """The openai client streaming chat completions with tools: each call is served whole through the server's
    render/generate/derender and replayed as chunks, so it continues the previous call's tokens and the client
    assembles proper tool calls (and the usage it asked for) from the stream."""
    proxy, store = captured
    c = openai.OpenAI(base_url=f"{proxy.url}/rollouts/chat-stream-loop/attempts/0/v1", api_key="unused",
                      max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": name, "description": f"{name} in the repository",
                                                "parameters": schema, "strict": True}} for name, schema in SCHEMAS.items()]
    used, fallbacks = continuity(proxy, "used"), continuity(proxy, "stream_needs_parser")
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    received: list[tuple[str | None, object]] = []
    for turn, tool in enumerate(CHOICES[:3]):
        with c.chat.completions.stream(model="m", messages=messages, tools=tools, max_tokens=128,
                                       tool_choice={"type": "function", "function": {"name": tool}},
                                       stream_options={"include_usage": True}) as stream:
            completion = stream.get_final_completion()
        message = completion.choices[0].message
        (call,) = message.tool_calls
        assert call.function.name == tool and call.id and completion.usage.completion_tokens > 0
        received.append((tool, json.loads(call.function.arguments)))
        messages += [{"role": "assistant", "content": message.content, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": f"result {turn}: 3 tests failed"}]
    assert continuity(proxy, "used") - used == 2 and continuity(proxy, "stream_needs_parser") == fallbacks
    check_one_row(proxy, store, "chat-stream-loop", "chat", tokenizer, received)


def test_responses_previous_response_id_is_refused_and_untranslatable_calls_say_why(captured):
    """``previous_response_id``: a 400 naming it (the proxy keeps no responses); a call the translation cannot
    carry (an image input) is served by vLLM's own route and counted under its reason."""
    proxy, _ = captured
    c = openai.OpenAI(base_url=f"{proxy.url}/rollouts/responses-refused/attempts/0/v1", api_key="unused",
                      max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="previous_response_id") as caught:
        c.responses.create(model="m", input="go on", previous_response_id="resp_1", max_output_tokens=4)
    assert caught.value.body["param"] == "previous_response_id"
    before = continuity(proxy, "responses_input_item")
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA=="}
    with pytest.raises(openai.BadRequestError):  # the tiny model takes no images: vLLM's own route says so
        c.responses.create(model="m", max_output_tokens=4,
                           input=[{"role": "user", "content": [{"type": "input_text", "text": "see"}, image]}])
    assert continuity(proxy, "responses_input_item") - before == 1
