"""``served_stream.ServedStream`` on vLLM-shaped ``/v1/completions`` chunks, without a server (fast).

The real-server tests (``test_proxy_stream_continued_vllm.py``) cannot choose what the model generates; these
feed the cases a random model rarely gives on demand: a token whose text is empty (a UTF-8 character cut
between tokens), an answer that is the stop token alone, and an error in the stream. Each streamed answer must
be the unary path's translation of the same completion, and the events must carry all of it.
"""

from __future__ import annotations

import pytest

from harnessrl.proxy import anthropic_api, responses_api
from harnessrl.proxy.continuity import Plan
from harnessrl.proxy.served_stream import ServedStream

PROMPT = [1, 2, 3]
# (text, token id, log-prob): the second token's text is empty, its character ends with the third
HELLO = [("He", 10, -0.5), ("", 11, -1.5), ("llo wé", 12, -0.25), ("", 13, -0.75)]  # the last: the stop token


def chunk(text: str, token: int, logprob: float, first: bool, finish: str | None) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish, "stop_reason": None, "token_ids": [token],
              "logprobs": {"tokens": [text], "token_logprobs": [logprob], "top_logprobs": [{text: logprob}],
                           "text_offset": [0]}}
    if first:
        choice["prompt_token_ids"] = PROMPT
    return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "tiny", "choices": [choice]}


def usage(n: int) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "tiny", "choices": [],
            "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": n, "total_tokens": len(PROMPT) + n}}


def stream_chunks(tokens: list[tuple[str, int, float]]) -> list[dict]:
    last = len(tokens) - 1
    return [*(chunk(t, i, lp, k == 0, "stop" if k == last else None) for k, (t, i, lp) in enumerate(tokens)),
            usage(len(tokens))]


def unary(tokens: list[tuple[str, int, float]]) -> dict:
    """The unstreamed /v1/completions answer of the same completion."""
    texts = [t for t, _, _ in tokens]
    choice = {"index": 0, "text": "".join(texts), "finish_reason": "stop", "stop_reason": None,
              "prompt_token_ids": PROMPT, "token_ids": [i for _, i, _ in tokens],
              "logprobs": {"tokens": texts, "token_logprobs": [lp for _, _, lp in tokens],
                           "top_logprobs": [{t: lp} for t, _, lp in tokens], "text_offset": [0] * len(tokens)}}
    return {**usage(len(tokens)), "choices": [choice]}


def served(wire, body: dict, tokens: list[tuple[str, int, float]]) -> tuple[ServedStream, list[dict], dict]:
    """The stream's events, and the unary path's answer for the same completion."""
    answer_as = wire.converter(body)
    live = ServedStream(Plan({}, PROMPT, 0, True).convert_chunk, answer_as, wire.live_events(body, answer_as))
    events = [e for c in stream_chunks(tokens) for e in live.feed(c)] + live.finish()
    return live, events, answer_as(Plan({}, PROMPT, 0, False).convert_response(unary(tokens)))


@pytest.mark.parametrize("tokens", [HELLO, HELLO[-1:]], ids=["text", "stop-token-alone"])
def test_messages_events_carry_the_unary_answer(tokens):
    live, events, expected = served(anthropic_api, {"model": "m", "max_tokens": 8}, tokens)
    assert live.response() == expected and live.tokens() == anthropic_api.tokens_from_response("messages", expected)
    text = "".join(t for t, _, _ in tokens)
    kinds = [e["type"] for e in events]
    if text:
        assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                         "content_block_stop", "message_delta", "message_stop"]  # one delta per text chunk
        assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == text
    else:  # what the replay of the same answer sends: no block at all
        assert kinds == ["message_start", "message_delta", "message_stop"] and expected["content"] == []
    assert events[0]["message"]["usage"]["input_tokens"] == len(PROMPT)
    assert events[-2]["usage"]["output_tokens"] == len(tokens)


@pytest.mark.parametrize("tokens", [HELLO, HELLO[-1:]], ids=["text", "stop-token-alone"])
def test_responses_events_carry_the_unary_answer_and_every_logprob(tokens):
    body = {"model": "m", "input": "hi", "include": [responses_api.LOGPROBS_INCLUDE]}
    live, events, expected = served(responses_api, body, tokens)
    assert live.response() == expected
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"] == responses_api.strip_unrequested(expected, responses_api.client_wants("", body))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    if tokens == HELLO:
        # the empty token's log-prob goes with the next text, the stop token's in an empty delta at the end
        assert [d["delta"] for d in deltas] == ["He", "llo wé", ""]
        assert [[lp["logprob"] for lp in d["logprobs"]] for d in deltas] == [[-0.5], [-1.5, -0.25], [-0.75]]
    else:
        assert deltas == [] and expected["output"][0]["content"] == []
        assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                               "response.output_item.added", "response.output_item.done",
                                               "response.completed"]


def test_an_error_in_the_stream_ends_it_and_keeps_the_tokens_so_far():
    answer_as = anthropic_api.converter({"model": "m", "max_tokens": 8})
    live = ServedStream(Plan({}, PROMPT, 0, True).convert_chunk, answer_as, anthropic_api.LiveMessage({}))
    live.feed(chunk("He", 10, -0.5, True, None))
    assert live.feed({"error": {"message": "engine died", "type": "InternalServerError"}}) == []
    assert live.error is not None and live.response()["error"]["message"] == "engine died"
    assert live.tokens().completion_token_ids == [10] and live.tokens().prompt_token_ids == PROMPT
