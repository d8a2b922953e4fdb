"""A streamed, continued Messages or Responses call with tools is relayed while generated (issue 26, item 6).

Claude Code and Codex CLI always stream and always send tools. A continued call with ``tool_choice`` auto goes
through vLLM's render / generate / derender endpoints (``proxy/continuity.py``); streamed, its text reaches the
harness chunk by chunk through the server's streaming derender, whose tool parser (hermes here) holds back the
call's markup, and the tool call comes from the whole answer parsed as unstreamed
(``served_stream.ParsedStream``); a continued call with ``tool_choice`` none is answered whole and replayed, its
text as generated. The random tiny model is steered through the proxy's sampling override: a
regex (vLLM's ``structured_outputs``) makes every answer a sentence, then a hermes tool call; a fixed seed
(short prompts only: vLLM 0.32 on CPU kills its engine on a seeded request prefilled in chunks) makes the
streamed and unstreamed answers comparable token for token.

Shares the tool server with ``test_proxy_tools_vllm*.py``.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

pytest.register_assert_rewrite("proxy_servers", "vllm_fixtures")
from proxy_servers import metric_value
from test_proxy_stream_continued_vllm import continued_calls, used
from vllm_fixtures import VllmServer, proxy_in_front


pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, tool_server (shared)

pytestmark = pytest.mark.vllm

SENTENCE = "Let me look at the failing test first, then I will run the whole test file again. "
CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "pytest"}}\n</tool_call>'
REGEX = "".join("\\" + ch if ch in ".{}[]()*+?|^$\\" else ch for ch in SENTENCE + CALL)
SAMPLING = {"temperature": 1.0, "seed": 4321, "structured_outputs": {"regex": REGEX}}
TOOLS = [{"name": "Bash", "description": "run a command", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]
SYSTEM = "you are a coding agent"


@pytest.fixture(scope="module")
def captured(tool_server: VllmServer, tmp_path_factory: pytest.TempPathFactory):
    with proxy_in_front(tool_server, tmp_path_factory.mktemp("proxy-stream-tools"), "test-run", SAMPLING) as pair:
        yield pair


def streams(proxy, route: str) -> tuple[float, float]:
    """How many streamed calls of ``route`` were relayed while generated, and how many replayed."""
    text = httpx.get(f"{proxy.url}/metrics").text
    return tuple(metric_value(text, "harnessrl_proxy_streams_total", route=route, mode=mode) or 0
                 for mode in ("relayed", "replayed"))


def without_ids(obj):
    """``obj`` without the answers' ids and creation times, and the fields the SDK's stream helper adds."""
    if isinstance(obj, dict):
        return {k: without_ids(v) for k, v in obj.items()
                if k not in ("id", "created_at", "call_id", "parsed", "parsed_arguments")}
    return [without_ids(v) for v in obj] if isinstance(obj, list) else obj


def assert_same_capture(unary, streamed) -> None:
    assert streamed.prompt_token_ids == unary.prompt_token_ids
    assert streamed.completion_token_ids == unary.completion_token_ids
    assert streamed.logprobs == pytest.approx(unary.logprobs, abs=1e-4)
    assert streamed.finish_reason == unary.finish_reason == "stop"
    assert without_ids(streamed.response) == without_ids(unary.response)


def test_continued_messages_with_tools_stream_text_then_the_tool_call(captured, tiny_model_dir):
    store, proxy = captured
    before = used(proxy)
    finals = {}
    for stream in (False, True):
        c = anthropic.Anthropic(base_url=f"{proxy.url}/rollouts/tmsg-{stream}/attempts/0", api_key="unused",
                                max_retries=0, timeout=120)
        kwargs = {"model": "m", "system": SYSTEM, "tools": TOOLS, "max_tokens": 200}
        messages: list[dict] = [{"role": "user", "content": "fix the failing test"}]
        first = c.messages.create(**kwargs, messages=messages)
        use = first.content[-1]
        assert use.type == "tool_use"
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "ok"}]}]
        if not stream:
            finals[stream] = c.messages.create(**kwargs, messages=messages)
            continue
        relayed, replayed = streams(proxy, "messages")
        with c.messages.stream(**kwargs, messages=messages) as events:
            seen = list(events)
            finals[stream] = events.get_final_message()
        assert streams(proxy, "messages") == (relayed + 1, replayed)  # not answered whole, then replayed
        kinds = [e.type for e in seen]
        texts = [i for i, e in enumerate(seen) if e.type == "content_block_delta" and e.delta.type == "text_delta"]
        tool_start = next(i for i, e in enumerate(seen) if e.type == "content_block_start"
                          and e.content_block.type == "tool_use")
        # the text as the parser let it out (one delta per derender call: the tokens of one read go together),
        # all before the tool call; never the call's markup
        assert texts and texts[-1] < tool_start < kinds.index("message_delta")
        text = "".join(seen[i].delta.text for i in texts)
        assert "<tool" not in text and finals[stream].content[0].text == text
        print(f"messages with tools: {len(texts)} text deltas before the tool call ({len(seen)} events)")
    assert used(proxy) - before == 2
    message = finals[True]
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[1].name == "Bash" and message.content[1].input == {"command": "pytest"}
    assert message.stop_reason == "tool_use"
    assert without_ids(message.model_dump()) == without_ids(finals[False].model_dump())
    unary, streamed = continued_calls(store, proxy, ["tmsg-False", "tmsg-True"], tokens=None)
    assert_same_capture(unary, streamed)

    # The next streamed call continues it with tool_choice none: not relayed (the parser reads a non-auto
    # answer whole, served_stream.py) but answered whole and replayed, and the harness gets exactly the text
    # the model generated (the regex: the sentence, then the call's markup, which hermes leaves as text here)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": message.content[1].id,
                                               "content": "ok"}]}]
    relayed, replayed = streams(proxy, "messages")
    with c.messages.stream(**kwargs, messages=messages, tool_choice={"type": "none"}) as events:
        plain = events.get_final_message()
    assert streams(proxy, "messages") == (relayed, replayed + 1) and used(proxy) - before == 3
    assert [b.type for b in plain.content] == ["text"] and plain.stop_reason == "end_turn"
    proxy.flush(60)
    third = store.read_calls("tmsg-True", 0)[2]
    context = [*streamed.prompt_token_ids, *streamed.completion_token_ids]
    assert third.prompt_token_ids[: len(context)] == context  # it continued the streamed call's tokens
    assert third.finish_reason == "stop" and len(third.logprobs) == len(third.completion_token_ids)
    from transformers import AutoTokenizer

    generated = AutoTokenizer.from_pretrained(tiny_model_dir).decode(third.completion_token_ids[:-1])  # no stop
    assert plain.content[0].text == generated == SENTENCE + CALL


def test_continued_responses_with_tools_stream_text_then_the_function_call(captured):
    store, proxy = captured
    before = used(proxy)
    tools = [{"type": "function", "name": t["name"], "description": t["description"],
              "parameters": t["input_schema"]} for t in TOOLS]
    finals = {}
    for stream in (False, True):
        c = openai.OpenAI(base_url=f"{proxy.url}/rollouts/tresp-{stream}/attempts/0/v1", api_key="unused",
                          max_retries=0, timeout=120)
        kwargs = {"model": "m", "instructions": SYSTEM, "tools": tools, "max_output_tokens": 200}
        items: list[dict] = [{"role": "user", "content": "fix the failing test"}]
        first = c.responses.create(**kwargs, input=items)
        call = first.output[-1]
        assert call.type == "function_call"
        items += [*(i.model_dump(exclude_none=True) for i in first.output),
                  {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}]
        if not stream:
            finals[stream] = c.responses.create(**kwargs, input=items)
            continue
        relayed, replayed = streams(proxy, "responses")
        with c.responses.stream(**kwargs, input=items) as events:
            seen = list(events)
        assert streams(proxy, "responses") == (relayed + 1, replayed)  # not answered whole, then replayed
        finals[stream] = seen[-1].response
        assert [e.sequence_number for e in seen] == list(range(len(seen)))
        texts = [i for i, e in enumerate(seen) if e.type == "response.output_text.delta"]
        call_added = next(i for i, e in enumerate(seen) if e.type == "response.output_item.added"
                          and e.item.type == "function_call")
        assert texts and texts[-1] < call_added and seen[-1].type == "response.completed"
        text = "".join(seen[i].delta for i in texts)
        assert "<tool" not in text and finals[stream].output_text == text
        print(f"responses with tools: {len(texts)} text deltas before the function call ({len(seen)} events)")
    assert used(proxy) - before == 2
    response = finals[True]
    assert [i.type for i in response.output] == ["message", "function_call"]
    assert response.output[1].name == "Bash" and json.loads(response.output[1].arguments) == {"command": "pytest"}
    assert without_ids(response.model_dump()) == without_ids(finals[False].model_dump())
    unary, streamed = continued_calls(store, proxy, ["tresp-False", "tresp-True"], tokens=None)
    assert_same_capture(unary, streamed)
