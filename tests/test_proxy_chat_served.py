"""The translations behind serving Anthropic Messages and Responses calls as chat completions
(``proxy/chat_served.py``): what a harness sends back of an answer translates to the reply token continuity
matches, and what cannot be translated says why. The end-to-end loops on the real vLLM are in
``test_proxy_tools_vllm_apis.py``."""

from __future__ import annotations

import pytest

from harnessrl.proxy import anthropic_api, responses_api
from harnessrl.proxy.protocol import ClientWants, RequestError, same_message
from harnessrl.proxy.responses_api import Untranslatable

CHAT_ANSWER = {
    "id": "chatcmpl-abc",
    "created": 7,
    "model": "tiny",
    "prompt_token_ids": [1, 2, 3],
    "choices": [{
        "index": 0,
        "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
        "logprobs": {"content": [{"token": "<tool_call>", "logprob": -0.5, "bytes": [60], "top_logprobs": []},
                                 {"token": "x", "logprob": -1.5, "bytes": [120], "top_logprobs": []}]},
        "finish_reason": "stop",
        "token_ids": [10, 11],
    }],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}  # fmt: skip
TEXT_ANSWER = {
    **CHAT_ANSWER,
    "choices": [{**CHAT_ANSWER["choices"][0], "message": {"role": "assistant", "content": "hello"},
                 "finish_reason": "length"}],
}  # fmt: skip


def test_responses_items_translate_as_vllm_builds_them():
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix "}, {"type": "input_text", "text": "it"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "looking", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "read_file", "arguments": "{}", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "x = 1"},
    ]  # fmt: skip
    assert responses_api.chat_messages("you are an agent", items) == [
        {"role": "system", "content": "you are an agent"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": "looking", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x = 1"},
    ]  # fmt: skip
    assert responses_api.chat_messages(None, "hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
         "responses_input_item"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "responses_input_item"),
        ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "responses_tool"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools"}},
         "responses_tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
         "responses_structured_output"),
        ({"input": "hi", "reasoning": {"effort": "low", "budget": 9}}, "responses_reasoning"),
        ({"input": "hi", "enable_response_messages": True}, "responses_unsupported_field"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "responses_unsupported_field"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAB-openai"}]},
         "responses_input_item"),
    ],
)  # fmt: skip
def test_untranslatable_responses_calls_name_their_reason(body, reason):
    with pytest.raises(Untranslatable) as caught:
        responses_api.chat_request(body)
    assert caught.value.reason == reason


def test_codex_requests_translate_and_say_what_was_dropped():
    """What Codex CLI sends on every call (client_metadata, reasoning {summary}, encrypted reasoning with store
    false, a namespace of functions, a hosted web_search): translated, the drops named; its answers (a
    namespaced call, reasoning with encrypted content) read back into the same chat messages when resent."""
    spawn = {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}, "strict": False}
    body = {"model": "m", "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]}],
            "stream": True, "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto", "effort": "high"}, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k", "client_metadata": {"session_id": "s"},
            "tools": [{"type": "function", "name": "view_image", "parameters": {"type": "object"}},
                      {"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": [spawn]},
                      {"type": "web_search", "external_web_access": False}]}
    chat = responses_api.chat_request(body)
    assert [t["function"]["name"] for t in chat["tools"]] == ["view_image", "multi_agent_v1.spawn_agent"]
    assert chat["reasoning_effort"] == "high" and "client_metadata" not in chat
    assert responses_api.dropped_fields(body) == ["client_metadata", "reasoning.summary", "tools.web_search"]
    answer = {"id": "chatcmpl-x", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "reasoning": "think first", "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "multi_agent_v1.spawn_agent", "arguments": "{}"}}]}}]}
    out = responses_api.from_chat(body, answer)["output"]
    assert out[0]["type"] == "reasoning" and out[0]["encrypted_content"].startswith("harnessrl-reasoning-v1:")
    assert (out[1]["namespace"], out[1]["name"]) == ("multi_agent_v1", "spawn_agent")
    # Codex resends the reasoning item without its text (store false: only the encrypted content)
    resent = [{**out[0], "content": None}, out[1]]
    assert responses_api.chat_messages(None, resent) == [{"role": "assistant", "content": None, "reasoning": "think first",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "multi_agent_v1.spawn_agent", "arguments": "{}"}}]}]
    assert responses_api.chat_reply({"output": out}) == responses_api.chat_messages(None, resent)[0]


def test_previous_response_id_is_a_400_naming_it():
    with pytest.raises(RequestError) as caught:
        responses_api.chat_request({"input": "go on", "previous_response_id": "resp_1"})
    assert caught.value.param == "previous_response_id" and "input" in caught.value.message


def test_responses_request_becomes_the_chat_request_it_amounts_to():
    body = {"model": "m", "input": "hi", "instructions": "sys", "max_output_tokens": 9, "temperature": 0.5,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"}, "include": ["message.output_text.logprobs"],
            "top_logprobs": 2, "stream": True, "store": False, "text": {"format": {"type": "text"}}}
    assert responses_api.chat_request(body) == {
        "model": "m", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
        "max_tokens": 9, "temperature": 0.5,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "logprobs": True, "top_logprobs": 2,
    }  # fmt: skip


@pytest.mark.parametrize("chat", [CHAT_ANSWER, TEXT_ANSWER], ids=["function-call", "text"])
def test_responses_answer_sent_back_is_the_reply_continuity_matches(chat):
    body = {"input": "hi", "include": ["message.output_text.logprobs"]}
    answer = responses_api.from_chat(body, chat)
    tokens = responses_api.tokens_from_response("responses", answer)
    assert (tokens.prompt_token_ids, tokens.completion_token_ids, tokens.logprobs) == ([1, 2, 3], [10, 11], [-0.5, -1.5])
    got = responses_api.strip_unrequested(answer, ClientWants(token_ids=False, logprobs=True))
    assert "_harnessrl_tokens" not in got and answer["id"] == "resp_abc"
    reply = chat["choices"][0]["message"]
    resent = responses_api.chat_messages(None, got["output"])  # what the harness appends to its next input
    assert resent == [responses_api.chat_reply(got)] and same_message(resent[0], reply)
    if reply.get("tool_calls"):
        assert got["status"] == "completed" and [i["type"] for i in got["output"]] == ["function_call"]
    else:
        assert got["status"] == "incomplete" and got["incomplete_details"] == {"reason": "max_output_tokens"}
        assert [e["logprob"] for e in got["output"][0]["content"][0]["logprobs"]] == [-0.5, -1.5]


def test_anthropic_answer_sent_back_is_the_reply_continuity_matches():
    answer = anthropic_api.from_chat({"model": "m"}, CHAT_ANSWER)
    assert answer["stop_reason"] == "tool_use"  # a forced tool ends with chat's "stop"
    got = anthropic_api.strip_unrequested(answer, ClientWants(token_ids=False, logprobs=False))
    resent = anthropic_api.chat_messages({"messages": [{"role": "assistant", "content": got["content"]}]})
    assert resent == [anthropic_api.chat_reply(got)]
    assert same_message(resent[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]})


REASONED_ANSWER = {
    **CHAT_ANSWER,
    "choices": [{**CHAT_ANSWER["choices"][0], "message": {"role": "assistant", "content": "done", "reasoning": "hm"}}],
}


def test_reasoning_is_answered_and_read_back_as_vllm_does():
    """A reasoning parser's split: a thinking block (Anthropic) or reasoning item (Responses) that, sent back,
    gives the reply with its reasoning (so continuity knows the server's parser must read the next answer)."""
    reply = {"role": "assistant", "content": "done", "reasoning": "hm"}
    message = anthropic_api.from_chat({"model": "m"}, REASONED_ANSWER)
    assert [b["type"] for b in message["content"]] == ["thinking", "text"] and message["content"][0]["signature"]
    resent = anthropic_api.chat_messages({"messages": [{"role": "assistant", "content": message["content"]}]})
    assert resent == [reply] == [anthropic_api.chat_reply(message)]
    events = anthropic_api.replay_events(message)
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "signature_delta", "text_delta"]
    answer = responses_api.from_chat({"input": "hi"}, REASONED_ANSWER)
    assert [i["type"] for i in answer["output"]] == ["reasoning", "message"]
    assert responses_api.chat_messages(None, answer["output"]) == [reply] == [responses_api.chat_reply(answer)]
    assert responses_api.chat_messages(None, [{"type": "reasoning", "summary": [], "content": [
        {"type": "reasoning_text", "text": "hm"}]}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]) == [
        {"role": "assistant", "content": None, "reasoning": "hm", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]  # fmt: skip
