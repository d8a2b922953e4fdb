"""What the stored response leaves out beyond the token arrays (issue 25, part 4): a plain reply's log-prob tokens
as one length character each, vLLM's constant fields and a ``usage`` equal to the arrays' lengths; each only
when exact, and every response comes back equal, key order and types included."""

from __future__ import annotations

import json

import pytest
from synthetic_calls import vllm_chat_response

from harnessrl.store import codec

PROMPT, COMPLETION = [1, 2, 3], [4, 5, 6]
LOGPROBS = [-0.5, -1.25, -0.125]


def round_trip(response: dict) -> tuple[dict | None, list | None]:
    original = json.loads(json.dumps(response))
    stored, stripped = codec.strip_response(response, PROMPT, COMPLETION, LOGPROBS)
    assert response == original  # never mutated
    text = codec.dumps(stored)
    back = codec.restore_response(codec.loads(text), stripped, PROMPT, COMPLETION, LOGPROBS)
    assert back == original and json.dumps(back) == json.dumps(original)  # key order too
    return stored, stripped


def test_a_plain_reply_stores_its_tokens_as_lengths_and_no_constant_fields():
    response = vllm_chat_response(PROMPT, COMPLETION, ["He", "llo", " wörld"], LOGPROBS, "Hello wörld", 1)
    stored, stripped = round_trip(response)
    names = [name for name, _ in stripped]
    assert {"choice.logprobs.content_split", "usage", "defaults", "choice.message.defaults"} <= set(names)
    assert stored["choices"][0]["logprobs"]["content"] == "236"
    assert "usage" not in stored and "service_tier" not in stored
    assert list(stored["choices"][0]["message"]) == ["role", "content"]
    assert len(codec.dumps(stored)) < len(codec.dumps(response)) / 3


@pytest.mark.parametrize("change", ["tool_call", "long_token", "usage", "false_not_none", "missing_default"])
def test_anything_else_is_kept_as_it_came(change: str):
    pieces, text = ["He", "llo", " w"], "Hello w"
    if change == "long_token":
        pieces, text = ["x" * 70, "y", "z"], "x" * 70 + "yz"
    response = vllm_chat_response(PROMPT, COMPLETION, pieces, LOGPROBS, text, 2)
    message = response["choices"][0]["message"]
    if change == "tool_call":  # the tokens spell the call, not the (empty) content
        message["content"] = ""
    elif change == "usage":
        response["usage"]["prompt_tokens"] = 4
    elif change == "false_not_none":
        message["refusal"] = False
    elif change == "missing_default":
        del response["service_tier"]
    stored, stripped = round_trip(response)
    names = {name for name, _ in stripped}
    split = "choice.logprobs.content_split" in names
    assert split == (change in ("usage", "false_not_none", "missing_default"))
    assert ("usage" in names) == (change != "usage")
    assert ("choice.message.defaults" in names) == (change != "false_not_none")
    assert ("defaults" in names) == (change != "missing_default")


def test_a_response_stored_by_the_earlier_format_still_reads():
    response = vllm_chat_response(PROMPT, COMPLETION, ["a", "b", "c"], LOGPROBS, "abc", 3)
    stored = json.loads(json.dumps(response))
    stored["choices"][0].pop("token_ids")
    stored["choices"][0]["logprobs"]["content"] = ["a", "b", "c"]
    back = codec.restore_response(stored, [["choice.token_ids", 5], ["choice.logprobs.content", 0]], PROMPT,
                                  COMPLETION, LOGPROBS)
    assert back == response
