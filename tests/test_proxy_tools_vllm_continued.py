"""A continued call answers what the first-call path answers for the same tokens (issue 26, item 2 and 4).

A call that extends an earlier one with tools goes through vLLM's render / generate / derender endpoints
(``proxy/continuity.py``), the first call of a conversation through the plain chat route. Whatever the model
generated, the harness must get the same answer either way, and the usage must count the prompt. The random
tiny model is steered through the proxy's sampling override, as an RL run on a weak model would be: a
``logit_bias`` on the stop token makes every answer end on it as soon as the grammar allows, so a forced call
is complete and ends with ``finish_reason`` "stop", and a free answer is the stop token alone.

Shares the tool server with ``test_proxy_tools_vllm.py`` and ``test_proxy_tools_vllm_apis.py``.
"""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai
import pytest

pytest.register_assert_rewrite("proxy_servers", "vllm_fixtures")
from proxy_servers import metric_value
from test_harness_clis import sampled_call
from test_proxy_stream_continued_vllm import continued_calls
from test_proxy_stream_tools_vllm import streams
from vllm_fixtures import VllmServer, proxy_in_front

from harnessrl.store import CallStatus

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, tool_server (shared)

pytestmark = pytest.mark.vllm

# Small strict schemas: a random model's forced call ends within max_tokens (without a schema it writes numbers
# of hundreds of digits as the arguments; Claude Code's tools are not strict, which ``tool_input`` answers).
TOOLS = [{"name": "Read", "description": "read a file", "strict": True, "input_schema": {
    "type": "object", "properties": {"file_path": {"type": "string", "enum": ["a.py", "b.py"]}},
    "required": ["file_path"], "additionalProperties": False}},
    {"name": "Bash", "description": "run the tests", "strict": True, "input_schema": {
        "type": "object", "properties": {}, "additionalProperties": False}}]


@pytest.fixture(scope="module")
def stop_token(tiny_model_dir: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids("<|im_end|>")


@pytest.fixture(scope="module")
def captured(tool_server: VllmServer, tmp_path_factory: pytest.TempPathFactory, stop_token: int):
    sampling = {"temperature": 1.0, "logit_bias": {str(stop_token): 100}}
    with proxy_in_front(tool_server, tmp_path_factory.mktemp("proxy-continued"), "test-run", sampling) as pair:
        yield pair


def continuity(url: str, outcome: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics").text, "harnessrl_proxy_token_continuity_total",
                        outcome=outcome) or 0


def test_continued_messages_answer_as_the_first_call_path_with_the_prompt_counted(captured):
    """Anthropic Messages, as Claude Code sends them: a forced tool (complete call, finish "stop"), then a
    continued forced tool and a continued free answer (the stop token alone). Each continued answer equals the
    first-call path's answer to the same messages (the tool the model picks aside), and ``usage.input_tokens`` is the stored prompt's length."""
    store, proxy = captured
    used = continuity(proxy.url, "used")

    def ask(rollout: str, messages: list[dict], choice: dict) -> anthropic.types.Message:
        c = anthropic.Anthropic(base_url=f"{proxy.url}/rollouts/{rollout}/attempts/0", api_key="unused",
                                max_retries=0, timeout=300)
        return c.messages.create(model="m", max_tokens=256, system="you are a coding agent", tools=TOOLS,
                                 messages=messages, tool_choice=choice)

    messages: list[dict] = [{"role": "user", "content": "fix the failing test"}]
    answers = []
    for turn, choice in enumerate([{"type": "tool", "name": "Read"}, {"type": "any"}, {"type": "auto"}]):
        message = ask("continued", messages, choice)
        answers.append(message)
        if turn < 2:
            (use,) = message.content
            assert use.type == "tool_use" and isinstance(use.input, dict) and message.stop_reason == "tool_use"
            messages = [*messages, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "ok"}]}]
        else:
            assert message.content == [] and message.stop_reason == "end_turn"
    assert continuity(proxy.url, "used") - used == 2
    proxy.flush(60)
    calls = store.read_calls("continued", 0)
    assert [c.status for c in calls] == [CallStatus.OK] * 3
    for call, message in zip(calls, answers, strict=True):
        assert call.finish_reason == "stop"
        assert message.usage.input_tokens == len(call.prompt_token_ids) > 0
        assert message.usage.output_tokens == len(call.completion_token_ids) == len(call.logprobs)
    # the first-call path, asked the last two questions afresh, answers the same way (the ids aside)
    for turn, choice in ((1, {"type": "any"}), (2, {"type": "auto"})):
        k = 1 + 2 * turn
        first = ask(f"first-{turn}", messages[:k], choice)
        assert first.stop_reason == answers[turn].stop_reason
        assert [(b.type, type(getattr(b, "input", None))) for b in first.content] == [
            (b.type, type(getattr(b, "input", None))) for b in answers[turn].content]


def test_a_streamed_continued_messages_call_forced_to_any_tool_gets_the_call_generated(captured, tiny_model_dir):
    """Claude Code's forced call as it sends it: streamed, continued, ``tool_choice`` any (issue 26, item 2: the
    model generated a complete call, the harness got empty content and end_turn). The call is answered whole and
    replayed (the parser reads a forced answer whole, ``served_stream.py``); the harness gets one ``tool_use``
    block, the call the stored completion's tokens spell, and the stored answer is exactly the message it got."""
    from transformers import AutoTokenizer

    store, proxy = captured
    c = anthropic.Anthropic(base_url=f"{proxy.url}/rollouts/stream-any/attempts/0", api_key="unused",
                            max_retries=0, timeout=300)
    kwargs = {"model": "m", "max_tokens": 256, "system": "you are a coding agent", "tools": TOOLS}
    messages: list[dict] = [{"role": "user", "content": "fix the failing test"}]
    (use,) = c.messages.create(**kwargs, messages=messages, tool_choice={"type": "tool", "name": "Read"}).content
    messages += [{"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "ok"}]}]
    used = continuity(proxy.url, "used")
    relayed, replayed = streams(proxy, "messages")
    with c.messages.stream(**kwargs, messages=messages, tool_choice={"type": "any"}) as events:
        seen = [e.type for e in events]
        message = events.get_final_message()
    assert continuity(proxy.url, "used") - used == 1
    assert streams(proxy, "messages") == (relayed, replayed + 1)
    assert seen.count("content_block_start") == 1 and seen[-1] == "message_stop"
    (got,) = message.content
    assert got.type == "tool_use" and got.name in ("Read", "Bash") and message.stop_reason == "tool_use"
    assert "_raw" not in got.input  # the strict schema's arguments: a JSON object, as generated
    (call,) = continued_calls(store, proxy, ["stream-any"], tokens=None)
    assert call.finish_reason == "stop"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert sampled_call(tokenizer, call) == {"name": got.name, "arguments": got.input}
    assert {k: v for k, v in call.response.items() if v is not None} == message.model_dump(exclude_none=True)
    assert message.usage.input_tokens == len(call.prompt_token_ids)
    assert message.usage.output_tokens == len(call.completion_token_ids) == len(call.logprobs)


def test_a_continued_chat_answer_holds_no_stop_token_text(captured):
    """The chat route with tools: a continued answer that is the stop token alone is empty content, as the first
    call's (vLLM's engine leaves the stop token out of the text; derender decoded it: '<|im_end|>')."""
    store, proxy = captured
    c = openai.OpenAI(base_url=f"{proxy.url}/rollouts/chat-stop/attempts/0/v1", api_key="unused",
                      max_retries=0, timeout=300)
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in TOOLS]
    messages: list[dict] = [{"role": "user", "content": "hello"}]
    first = c.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=8)
    assert first.choices[0].message.content == "" and first.choices[0].finish_reason == "stop"
    messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": "go on"}]
    used = continuity(proxy.url, "used")
    second = c.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=8)
    assert continuity(proxy.url, "used") - used == 1
    assert second.choices[0].message.content == "" and second.choices[0].finish_reason == "stop"
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    proxy.flush(60)
    calls = store.read_calls("chat-stop", 0)
    assert [(c.status, len(c.completion_token_ids), len(c.logprobs)) for c in calls] == [(CallStatus.OK, 1, 1)] * 2
    assert second.usage.prompt_tokens == len(calls[1].prompt_token_ids)


def test_a_continued_answer_ends_where_a_stop_string_ends_it(tool_server, tiny_model_dir, tmp_path):
    """A stop string the model writes at once (a ``logit_bias`` on its token): the engine cuts the text before
    it, so the first call answers empty content; the continued call must too (derender decodes the token)."""
    from transformers import AutoTokenizer

    (token,) = AutoTokenizer.from_pretrained(tiny_model_dir).encode("def")
    with proxy_in_front(tool_server, tmp_path, "test-run", {"temperature": 1.0, "logit_bias": {str(token): 100}}) as (
            store, proxy):
        c = openai.OpenAI(base_url=f"{proxy.url}/rollouts/stop-string/attempts/0/v1", api_key="unused",
                          max_retries=0, timeout=300)
        tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in TOOLS]
        messages: list[dict] = [{"role": "user", "content": "hello"}]
        used = continuity(proxy.url, "used")
        for turn in range(2):
            answer = c.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=8, stop=["def"])
            assert answer.choices[0].message.content == "" and answer.choices[0].finish_reason == "stop"
            messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": f"go on {turn}"}]
        assert continuity(proxy.url, "used") - used == 1
        proxy.flush(60)
        assert [len(c.completion_token_ids) for c in store.read_calls("stop-string", 0)] == [1, 1]
