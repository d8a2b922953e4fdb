"""What a harness gets for what the model generated, and what the store keeps of it (issue 26, items 2, 3, 5).

* A tool call's arguments become an Anthropic ``tool_use`` input as generated: read leniently (raw control
  characters in strings), numbers no float holds keep their literal, arguments that are no object are kept as
  text under ``_raw`` and turn back into the same text when the harness sends the input back.
* Nothing the harness got a 200 for is missing from the store: such an answer is stored with those values as
  text and their JSON pointers, and reads back to the same numbers (SQLite and PostgreSQL, which refuses NaN).
* Claude Code's ``tool_reference`` blocks are read; a block the proxy does not pass is refused with a 400
  that is logged with its rollout and counted by code.
"""

from __future__ import annotations

import json
import logging
import math

import httpx
import pytest

from harnessrl.proxy import anthropic_api
from harnessrl.proxy.capture import Attribution, build_call_record
from harnessrl.proxy.protocol import ClientWants, Tokens, dumps
from harnessrl.proxy.strict_json import NONSTRICT_KEY, restore
from harnessrl.proxy.writer import CallItem, TraceWriter
from harnessrl.proxy.metrics import ProxyMetrics
from harnessrl.proxy.spool import Spool
from harnessrl.store import CallStatus, TraceStore

pytest.register_assert_rewrite("proxy_servers")
from proxy_servers import metric_value

pytest_plugins = ["proxy_servers"]  # fixtures: loops, upstream, make_proxy

WHO = Attribution("run", "r-1", 0)


def chat_answer(arguments: str) -> dict:
    return {"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "Bash", "arguments": arguments}}]},
        "token_ids": [7, 8, 9], "logprobs": None}], "usage": {"prompt_tokens": 4, "completion_tokens": 3},
        "prompt_token_ids": [1, 2, 3, 4]}


def harness_gets(arguments: str) -> tuple[dict, bytes]:
    """The Anthropic message for a chat answer calling Bash with ``arguments``, and the bytes the harness gets."""
    message = anthropic_api.from_chat({"model": "m"}, chat_answer(arguments))
    return message, dumps(anthropic_api.strip_unrequested(message, ClientWants(False, False)))


def test_tool_input_is_what_the_model_generated():
    # a raw tab inside a string: a lenient reader takes it (the parsers that accepted the call do)
    message, sent = harness_gets('{"command": "ls\t-l"}')
    assert message["content"][0]["input"] == {"command": "ls\t-l"}
    assert json.loads(sent)["content"][0]["input"] == {"command": "ls\t-l"}
    # a number no float holds, as the model wrote it and as vLLM's parser re-dumps it (Infinity)
    for written, literal in (('{"timeout": 1e999}', b'"timeout":1e999'), ('{"timeout": -Infinity}', b'"timeout":-1e999')):
        _, sent = harness_gets(written)
        assert literal in sent
        assert math.isinf(json.loads(sent)["content"][0]["input"]["timeout"])
    # a big integer stays exact
    _, sent = harness_gets('{"n": 123456789012345678901234567890}')
    assert json.loads(sent)["content"][0]["input"] == {"n": 123456789012345678901234567890}
    # no object: kept as generated, and given back as the same arguments when the harness resends the input
    for arguments in ("4551570681456", '{"command": "ls"', '"a string"'):
        message, _ = harness_gets(arguments)
        (use,) = message["content"]
        assert use["input"] == {"_raw": arguments}
        resent = anthropic_api.chat_messages({"messages": [{"role": "assistant", "content": [use]}]})
        assert resent[-1]["tool_calls"][0]["function"]["arguments"] == arguments


def test_an_answer_no_strict_json_holds_is_stored_and_reads_back(store: TraceStore, tmp_path):
    """The harness got ``1e999`` (and vLLM's ``Infinity``): the call is stored, not refused, its tokens
    included, and the stored answer reads back to the same values."""
    message = anthropic_api.from_chat({"model": "m"}, chat_answer('{"a": 1e999, "b": [1.5, -Infinity], "c/d": "x"}'))
    tokens = anthropic_api.tokens_from_response("messages", message)
    response = anthropic_api.strip_unrequested(message, ClientWants(False, False))
    record = build_call_record(who=WHO, seq=0, route="messages", request={"model": "m", "messages": []},
                               response=response, tokens=tokens, policy_version=0, upstream="u", latency_s=0.1,
                               status=CallStatus.OK, http_status=200)
    metrics = ProxyMetrics()
    writer = TraceWriter(store, Spool(tmp_path / "spool.jsonl", 1 << 20), metrics, batch_size=8)
    writer.start()
    try:
        writer.put(CallItem(record))
        assert writer.flush(30)
    finally:
        writer.close(10)
    exposition = metrics.exposition()[0].decode()
    assert metric_value(exposition, "harnessrl_proxy_write_errors_total", kind="rejected") is None
    assert metric_value(exposition, "harnessrl_proxy_write_errors_total", kind="nonstrict_json") == 1
    (call,) = store.read_calls("r-1", 0)
    assert call.prompt_token_ids == [1, 2, 3, 4] and call.completion_token_ids == [7, 8, 9]
    stored_input = call.response["content"][0]["input"]
    assert stored_input == {"a": "1e999", "b": [1.5, "-1e999"], "c/d": "x"}
    assert sorted(call.response[NONSTRICT_KEY]) == ["/content/0/input/a", "/content/0/input/b/1"]
    back = restore(call.response)["content"][0]["input"]
    assert back["a"] == math.inf and back["b"] == [1.5, -math.inf] and back["c/d"] == "x"


def test_tool_reference_blocks_are_read_and_refused_blocks_are_logged_and_counted(upstream, make_proxy, store, caplog):
    proxy = make_proxy([upstream.url])
    history = [{"role": "user", "content": "find a tool"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {"q": "x"}}]}]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
        {"type": "tool_reference", "tool_name": "WebFetch"}, {"type": "text", "text": "one found"}]}]}
    body = {"model": "m", "max_tokens": 4, "messages": [*history, result]}
    answer = httpx.post(f"{proxy.url}/v1/messages", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert upstream.fake.bodies[-1]["messages"][-1] == {"role": "tool", "tool_call_id": "t1",
                                                         "content": "Tool loaded: WebFetch\none found"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    refused = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]}
    with caplog.at_level(logging.WARNING, logger="harnessrl.proxy.calls"):
        answer = httpx.post(f"{proxy.url}/v1/messages", json={**body, "messages": [*history, refused]}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages[2].content[0].content[0]"
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    assert line.startswith("refused r-1/0 messages 400 unsupported_block: 'messages[2].content[0].content[0]' is a image")
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert metric_value(metrics, "harnessrl_proxy_refused_total", route="messages", status="400",
                        code="unsupported_block") == 1
    assert metric_value(metrics, "harnessrl_proxy_requests_total", route="messages", status="400") == 1


def test_claude_code_requests_translate_and_say_what_was_dropped(upstream, make_proxy, store):
    """What Claude Code 2.1 sends: a system message after the first user turn, thinking, context_management,
    cache_control, output_config.effort, metadata, a deferred tool, and (with web search on) a server tool."""
    proxy = make_proxy([upstream.url])
    body = {"model": "m", "max_tokens": 4, "metadata": {"user_id": "u"}, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "system": [{"type": "text", "text": "you are an agent", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "fix it"},
                         {"role": "system", "content": [{"type": "text", "text": "cwd: /w"}]}],
            "tools": [{"name": "Read", "input_schema": {"type": "object"}},
                      {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True},
                      {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}
    answer = httpx.post(f"{proxy.url}/v1/messages", json=body, headers={"anthropic-beta": "context-management-2025-06-27"},
                        timeout=30)
    assert answer.status_code == 200, answer.text
    sent = upstream.fake.bodies[-1]
    assert sent["messages"] == [{"role": "system", "content": "you are an agent"}, {"role": "user", "content": "fix it"},
                                {"role": "system", "content": "cwd: /w"}]
    assert [t["function"]["name"] for t in sent["tools"]] == ["Read", "Later"] and sent["reasoning_effort"] == "high"
    assert not {"thinking", "context_management", "metadata", "output_config"} & set(sent)
    metrics = httpx.get(f"{proxy.url}/metrics").text
    dropped = {field: metric_value(metrics, "harnessrl_proxy_dropped_fields_total", route="messages", field=field)
               for field in ("metadata", "thinking", "context_management", "cache_control", "tools.web_search_20250305")}
    assert dropped == dict.fromkeys(dropped, 1.0)
