"""``served_stream.ParsedStream`` when the server's streaming derender and its whole-answer derender disagree
(fast, no server).

vLLM's hermes parser splits the text alike on both paths, so the real-server tests never reach this case: the
streaming derender let text out that the whole answer, parsed as unstreamed, does not begin with. That text
cannot be taken back, so the stream must end with the route's error event, send no tool call or closing
success event after it, and the call must be stored as an error that keeps its tokens. Only the server's
derender answers are fakes (the ``ServedPlan`` callables that would fetch them); the plan, the route's live
events, its converter and error event are the proxy's own.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from harnessrl.proxy import anthropic_api, responses_api
from harnessrl.proxy.continuity import ServedPlan
from harnessrl.proxy.served_stream import ParsedStream

PROMPT = [1, 2, 3]
TOKENS = [(10, -0.5), (11, -1.5), (12, -0.25), (13, -0.75)]  # the last: the stop token
STREAMED = ["I will ", "run it"]  # what the streaming derender lets out, one piece per token chunk
CALL = {"id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "pytest"}'}}


def generate_chunk(k: int) -> dict:
    token, logprob = TOKENS[k]
    last = k == len(TOKENS) - 1
    return {"request_id": "gen-1", "choices": [{
        "index": 0, "token_ids": [token], "finish_reason": "stop" if last else None, "stop_reason": None,
        "logprobs": {"content": [{"token": f"token_id:{token}", "logprob": logprob, "top_logprobs": []}]}}]}


def plan() -> ServedPlan:
    """A continued call's plan whose server answers disagree: the whole answer's content is not the text the
    streaming derender let out."""

    async def derender_chunk(chunk: dict, state):
        index = state or 0
        return (STREAMED[index] if index < len(STREAMED) else ""), chunk["choices"][0]["logprobs"], index + 1

    async def derender(whole: dict) -> dict:
        choice = whole["choices"][0]
        return {"id": "chatcmpl-gen-1", "object": "chat.completion", "model": "tiny", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "Let me run it", "tool_calls": [CALL]},
            "logprobs": None, "finish_reason": "tool_calls", "token_ids": choice["token_ids"]}],
            "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": len(choice["token_ids"]),
                      "total_tokens": len(PROMPT) + len(choice["token_ids"])},
            "prompt_token_ids": PROMPT}

    return ServedPlan({"token_ids": PROMPT, "stream": True}, PROMPT, 0, False, path="/inference/v1/generate",
                      chat_request={"model": "tiny"}, derender=derender, live=True, derender_chunk=derender_chunk)


START = {anthropic_api: "message_start", responses_api: "response.created"}


async def relay(live: ParsedStream, shapes) -> list[dict]:
    """What the harness receives, in the order ``CaptureProxy._relay`` sends it: each read's events (the start
    events on the first token, before its derender call), the settled text, then the route's error event, or the closing events."""
    events: list[dict] = []
    for k in range(len(TOKENS)):
        started = live.take([generate_chunk(k)])  # sent before the derender call is awaited
        assert [e["type"] for e in started][:1] == ([] if k else [START[shapes]]) and live.state == (k or None)
        events += started + await live.derender_taken()
    events += await live.settle()
    ending = (live.live.error(live.error.get("error", live.error)) if live.error is not None
              else b"".join(shapes.sse_bytes(e) for e in live.finish()))
    return events + [json.loads(line.removeprefix(b"data: ")) for line in ending.splitlines()
                     if line.startswith(b"data: ")]


@pytest.mark.parametrize("shapes,body,success_events,call_events", [
    (anthropic_api, {"model": "m", "max_tokens": 8, "stream": True},
     {"message_delta", "message_stop", "content_block_stop"}, set()),  # tool_use: its block start, below
    (responses_api, {"model": "m", "input": "hi", "stream": True},
     {"response.completed", "response.incomplete", "response.output_text.done", "response.output_item.done"},
     {"response.function_call_arguments.delta", "response.function_call_arguments.done"}),
], ids=["messages", "responses"])
def test_a_parse_that_withdraws_sent_text_ends_with_the_error_event_and_is_stored_as_an_error(
        shapes, body, success_events, call_events):
    answer_as = shapes.converter(body)
    live = ParsedStream(plan(), answer_as, shapes.live_events(body, answer_as),
                        derender_tokens=1)  # a derender call per read, as the relay below reads one token each
    events = asyncio.run(relay(live, shapes))
    kinds = [e["type"] for e in events]

    # the text went out as generated, then the stream ends with the protocol's error event, nothing after it
    sent = [e["delta"]["text"] if shapes is anthropic_api else e["delta"] for e in events
            if e["type"] in ("content_block_delta", "response.output_text.delta")]
    assert "".join(sent) == "".join(STREAMED) and kinds[0] in ("message_start", "response.created")
    assert kinds[-1] == "error" and kinds.count("error") == 1
    error = events[-1]
    if shapes is anthropic_api:
        assert error["error"]["type"] == "upstream_error" and "retry the call" in error["error"]["message"]
    else:  # numbered on after the events sent (the Codex CLI and the openai SDK read sequence_number)
        assert error["code"] == "streamed_text_not_parsed" and "retry the call" in error["message"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert not success_events & set(kinds) and not call_events & set(kinds)
    assert not any(e.get("content_block", {}).get("type") == "tool_use" for e in events)
    assert not any((e.get("item") or {}).get("type") == "function_call" for e in events)

    # what the capture records (``_relay``: status ERROR when the stream's error is set): the error, every token
    stored = live.response()
    assert live.error is not None and stored["error"]["code"] == "streamed_text_not_parsed"
    tokens = live.tokens()
    assert tokens.prompt_token_ids == PROMPT and tokens.completion_token_ids == [t for t, _ in TOKENS]
