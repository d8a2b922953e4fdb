"""The Responses API (``/v1/responses``) and Anthropic Messages (``/v1/messages``) through the proxy on a real
vLLM, with the ``openai`` and ``anthropic`` clients.

Every call is stored token-exactly, as chat calls are: the prompt ids are the chat template's rendering, the
completion ids decode to the text the harness received, one log-prob per completion token (vLLM's own), the
call attributed to its rollout; and the harness gets back only what it asked for. vLLM's own ``/v1/messages``
returns no token ids or log-probs, so the proxy serves a Messages call as the chat completion it amounts to.
"""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai
import pytest

pytest.register_assert_rewrite("proxy_servers")
from proxy_servers import RunningProxy

from harnessrl.store import CallStatus, TraceStore

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, vllm_server

pytestmark = pytest.mark.vllm

PROMPT = "read file 42 and fix the error in the test"

SYSTEM = "you are a coding agent"
TOOLS = [{"name": "read_file", "description": "read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def captured(vllm_server, tmp_path_factory: pytest.TempPathFactory):
    from vllm_fixtures import proxy_in_front

    with proxy_in_front(vllm_server, tmp_path_factory.mktemp("proxy-responses"), "test-run",
                        {"temperature": 1.0}) as (store, proxy):
        yield proxy, store


def stored_call(proxy: RunningProxy, store: TraceStore, rollout: str):
    proxy.flush(60)
    [call] = store.read_calls(rollout, 0)
    assert call.status is CallStatus.OK and call.route == "responses"
    return call


def check_tokens(call, tokenizer, text: str) -> None:
    expected_prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False)
    assert call.prompt_token_ids == list(expected_prompt)
    decoded = tokenizer.decode(call.completion_token_ids, skip_special_tokens=True)
    assert decoded == text or decoded.rstrip("\ufffd") == text
    assert len(call.logprobs) == len(call.completion_token_ids) > 0
    assert all(lp <= 0 for lp in call.logprobs)


@pytest.mark.parametrize("asks_logprobs", [False, True], ids=["plain", "with-logprobs"])
def test_responses_are_captured_token_exactly(captured, tokenizer, asks_logprobs):
    proxy, store = captured
    rollout = f"responses-{asks_logprobs}"
    client = openai.OpenAI(base_url=f"{proxy.url}/rollouts/{rollout}/attempts/0/v1", api_key="unused",
                           max_retries=0, timeout=120)
    extra = {"include": ["message.output_text.logprobs"]} if asks_logprobs else {}
    response = client.responses.create(model="anything", input=PROMPT, max_output_tokens=16, **extra)
    call = stored_call(proxy, store, rollout)
    check_tokens(call, tokenizer, response.output_text)
    [part] = response.output[0].content
    if asks_logprobs:  # the harness's own log-probs are the stored ones
        assert [e.logprob for e in part.logprobs] == call.logprobs
    else:
        assert not part.logprobs
    raw = response.model_dump()
    assert raw.get("input_messages") is None and raw.get("output_messages") is None  # not asked for
    assert call.response.get("input_messages") is None  # stored as the harness got it
    assert call.request == {"model": "anything", "input": PROMPT, "max_output_tokens": 16, **extra}


def test_streamed_responses_are_captured_and_relayed_as_events(captured, tokenizer):
    proxy, store = captured
    rollout = "responses-stream"
    base = f"{proxy.url}/rollouts/{rollout}/attempts/0/v1"
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    for attempt in range(3):  # vLLM's own stream would lose log-probs of tokens with empty text (often, here)
        events = list(client.responses.create(model="anything", input=PROMPT, max_output_tokens=16, stream=True))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
        assert events[-1].response.output_text == text
        proxy.flush(60)
        call = store.read_calls(rollout, 0)[attempt]
        assert call.status is CallStatus.OK and call.request["stream"] is True
        check_tokens(call, tokenizer, text)

    raw = httpx.post(f"{base}/responses", json={"model": "m", "input": PROMPT, "max_output_tokens": 4,
                                                "stream": True}, timeout=120).text
    assert "event: response.created\ndata: " in raw  # vLLM's framing, event lines kept
    assert "raw_message_tokens" not in raw and '"logprob"' not in raw  # nothing the harness did not ask for


# ------------------------------------------------------------------------------------ Anthropic Messages


def anthropic_client(proxy, rollout: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{proxy.url}/rollouts/{rollout}/attempts/0", api_key="unused",
                               max_retries=0, timeout=120)


def check_message(call, tokenizer, chat_messages: list[dict], text: str, tools: list | None = None) -> None:
    assert call.status is CallStatus.OK and call.route == "messages"
    expected = tokenizer.apply_chat_template(chat_messages, tools=tools, add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert call.prompt_token_ids == list(expected)
    decoded = tokenizer.decode(call.completion_token_ids, skip_special_tokens=True)
    assert decoded == text or decoded.rstrip("\ufffd") == text
    assert len(call.logprobs) == len(call.completion_token_ids) > 0 and all(lp <= 0 for lp in call.logprobs)
    assert "_harnessrl_tokens" not in call.response


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_messages_are_captured_token_exactly(captured, tokenizer, stream):
    proxy, store = captured
    rollout = f"messages-{stream}"
    c = anthropic_client(proxy, rollout)
    kwargs = {"model": "anything", "max_tokens": 16, "system": SYSTEM,
              "messages": [{"role": "user", "content": "read file 42"}]}
    if stream:
        with c.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = c.messages.create(**kwargs)
    [block] = message.content
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 16
    proxy.flush(60)
    [call] = store.read_calls(rollout, 0)
    check_message(call, tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "read file 42"}],
          block.text)
    assert call.request == kwargs | ({"stream": True} if stream else {})
    assert call.response["content"] == [{"type": "text", "text": block.text}]


def test_tool_use_history_is_rendered_as_tool_calls(captured, tokenizer):
    """A history with a tool use and its result: the prompt is the template's rendering of the same
    conversation in chat form (tools included)."""
    proxy, store = captured
    history = [
        {"role": "user", "content": "read file 42"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                           "input": {"path": "42"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x = 1"}]},
    ]
    message = anthropic_client(proxy, "messages-tools").messages.create(model="anything", max_tokens=8, system=SYSTEM,
                                                             tools=TOOLS, tool_choice={"type": "none"},
                                                             messages=history)  # auto needs a tool parser
    proxy.flush(60)
    [call] = store.read_calls("messages-tools", 0)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "read file 42"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                "name": "read_file", "arguments": '{"path": "42"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "x = 1"}]
    chat_tools = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
                                                    "parameters": TOOLS[0]["input_schema"]}}]
    text = "".join(b.text for b in message.content if b.type == "text")
    check_message(call, tokenizer, chat, text, chat_tools)


def test_unsupported_blocks_get_a_400_naming_them(captured):
    proxy, _ = captured
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]' is a image block"):
        anthropic_client(proxy, "messages-bad").messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
