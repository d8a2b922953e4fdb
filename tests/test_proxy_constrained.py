"""Which chat requests the proxy treats as grammar-constrained, what it adds to them, and how it reads the allowed
sets back from vLLM's top log-probs (pure functions of ``proxy/protocol.py``; the real vLLM behaviour they rest
on is checked in ``test_proxy_tools_vllm_constrained.py``)."""

from __future__ import annotations

import pytest

from harnessrl.proxy.protocol import (
    CONSTRAINED_TOP_LOGPROBS,
    FORBIDDEN_LOGPROB,
    allowed_sets,
    ask_allowed,
    client_wants,
    constrained,
    strip_unrequested,
    tokens_from_response,
    upstream_request,
)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
STRICT = {"type": "function", "function": {**TOOL["function"], "strict": True}}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, False),
    ({"tools": [TOOL]}, False),  # auto, loose tools: free text the parser reads
    ({"tools": [TOOL], "tool_choice": "auto"}, False),
    ({"tools": [TOOL], "tool_choice": "required"}, True),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, True),
    ({"tools": [STRICT]}, True),  # vLLM constrains a strict tool's call once the model starts one
    ({"tools": [STRICT], "tool_choice": "none"}, False),
    ({"tool_choice": "required"}, False),  # no tools: nothing to force
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, True),
    ({"response_format": {"type": "json_object"}}, True),
    ({"response_format": {"type": "text"}}, False),
    ({"structured_outputs": {"choice": ["a", "b"]}}, True),
    ({"guided_regex": "[ab]"}, True),
])  # fmt: skip
def test_constrained_requests(extra: dict, expected: bool):
    assert constrained({"messages": MESSAGES, **extra}) is expected


def test_top_log_probs_as_token_ids_are_asked_for_only_when_the_harness_asked_for_no_log_probs():
    body = {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "required"}
    sent = upstream_request("chat", body, train=True, model="m", sampling={"temperature": 1.0})
    assert sent["top_logprobs"] == CONSTRAINED_TOP_LOGPROBS and sent["return_tokens_as_token_ids"] is True
    own = {**body, "logprobs": True, "top_logprobs": 2}
    assert upstream_request("chat", own, train=True, model="m", sampling={})["top_logprobs"] == 2
    assert "return_tokens_as_token_ids" not in upstream_request("chat", own, train=True, model="m", sampling={})
    plain = {"messages": MESSAGES}
    assert not ask_allowed(dict(plain), plain)
    assert "top_logprobs" not in upstream_request("chat", plain, train=True, model="m", sampling={})
    assert "top_logprobs" not in upstream_request("chat", body, train=False, model="m", sampling={})


def _entry(token: int, logprob: float, tops: list[tuple[int, float]]) -> dict:
    return {"token": f"token_id:{token}", "logprob": logprob,
            "top_logprobs": [{"token": f"token_id:{t}", "logprob": v} for t, v in tops]}


def test_sets_are_read_where_a_forbidden_entry_shows_every_legal_token():
    entries = [
        _entry(5, -0.7, [(5, -0.7), (9, -0.69), (1, FORBIDDEN_LOGPROB), (2, FORBIDDEN_LOGPROB)]),
        _entry(6, 0.0, [(6, 0.0), (1, FORBIDDEN_LOGPROB)]),
        _entry(7, -3.0, [(7, -3.0), (8, -0.1), (3, -0.2)]),  # no forbidden entry: more legal tokens than shown
    ]
    assert allowed_sets(entries) == [[5, 9], [6], []]
    assert allowed_sets([_entry(7, -3.0, [(7, -3.0), (8, -0.1)])]) is None  # nothing shown: no sets at all
    text = [{"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1},
                                                              {"token": "b", "logprob": FORBIDDEN_LOGPROB}]}]
    assert allowed_sets(text) is None  # tokens as text name no id: no sets
    response = {"prompt_token_ids": [1, 2], "choices": [{
        "index": 0, "message": {"role": "assistant", "content": "x"}, "token_ids": [5, 6, 7],
        "logprobs": {"content": entries}, "finish_reason": "stop"}]}  # fmt: skip
    assert tokens_from_response("chat", response).allowed == [[5, 9], [6], []]
    # the harness that asked for no log-probs gets none back
    wants = client_wants("chat", {"messages": MESSAGES})
    assert strip_unrequested(response, wants)["choices"][0]["logprobs"] is None


def test_a_streamed_call_gives_the_same_sets_as_the_whole_answer():
    from harnessrl.proxy.protocol import StreamAssembler

    entries = [
        _entry(5, -0.7, [(5, -0.7), (9, -0.69), (1, FORBIDDEN_LOGPROB)]),
        _entry(6, 0.0, [(6, 0.0), (1, FORBIDDEN_LOGPROB)]),
        _entry(7, -3.0, [(7, -3.0), (8, -0.1), (3, -0.2)]),
    ]
    assembler = StreamAssembler("chat")
    assembler.feed({"id": "c", "prompt_token_ids": [1, 2], "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
    for token, entry in zip((5, 6, 7), entries, strict=True):
        assembler.feed({"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [token],
                                                "logprobs": {"content": [entry]}, "finish_reason": None}]})
    assembler.feed({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    tokens = assembler.tokens()
    assert tokens.completion_token_ids == [5, 6, 7] and tokens.allowed == [[5, 9], [6], []]
