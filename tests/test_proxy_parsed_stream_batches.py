"""How many streaming derender calls a relayed stream with tools makes (``served_stream.ParsedStream``; fast, no
server).

Each call costs the server a request with the whole chat request in it, and their number is what makes a long
prompt's stream slow (``bench/derender.py``), so the tokens go in batches: the first read's at once (the first
text as soon as it exists), then at least ``derender_tokens`` new tokens a call, and what is left when the
answer ends in one last call. Only the server's derender answers are fakes (the ``ServedPlan`` callables that
would fetch them: each token's text is ``t<id> ``); they count the calls and the tokens each got.
"""

from __future__ import annotations

import asyncio

import pytest

from harnessrl.proxy import anthropic_api
from harnessrl.proxy.continuity import ServedPlan
from harnessrl.proxy.served_stream import ParsedStream

PROMPT = [1, 2, 3]
STOP = 7  # the stop token that ends every answer here: no text


def chunk(ids: list[int], last: bool) -> dict:
    return {"request_id": "gen-1", "choices": [{
        "index": 0, "token_ids": ids, "finish_reason": "stop" if last else None, "stop_reason": None,
        "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.5, "top_logprobs": []} for t in ids]}}]}


def text(ids: list[int]) -> str:
    return "".join(f"t{t} " for t in ids if t != STOP)


def relayed(reads: list[list[int]], derender_tokens: int) -> tuple[list[int], str, dict]:
    """The reads of one answer (token ids, the last ending with the stop token) relayed as ``CaptureProxy._relay``
    relays them: the tokens each streaming derender call got, the text the harness got, the stored answer."""
    sizes: list[int] = []

    async def derender_chunk(generated: dict, state):
        ids = generated["choices"][0]["token_ids"]
        sizes.append(len(ids))
        return text(ids), generated["choices"][0]["logprobs"], state

    async def derender(whole: dict) -> dict:
        ids = whole["choices"][0]["token_ids"]
        return {"id": "chatcmpl-gen-1", "object": "chat.completion", "model": "tiny", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text(ids)}, "logprobs": None,
            "finish_reason": "stop", "token_ids": ids}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)},
            "prompt_token_ids": PROMPT}

    plan = ServedPlan({"token_ids": PROMPT, "stream": True}, PROMPT, 0, False, path="/inference/v1/generate",
                      chat_request={"model": "tiny"}, derender=derender, live=True, derender_chunk=derender_chunk)
    body = {"model": "m", "max_tokens": 100, "stream": True}
    answer_as = anthropic_api.converter(body)
    live = ParsedStream(plan, answer_as, anthropic_api.live_events(body, answer_as), derender_tokens=derender_tokens)

    async def run() -> list[dict]:
        events: list[dict] = []
        for k, ids in enumerate(reads):
            started = live.take([chunk(ids, k == len(reads) - 1)])
            assert bool(started) == (k == 0)  # the start events go out with the first token, before its call
            events += started + await live.derender_taken()
        return events + await live.settle() + live.finish()

    events = asyncio.run(run())
    assert live.error is None and live.derender_calls == len(sizes)
    sent = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    return sizes, sent, live.response()


def test_derender_calls_take_the_first_read_then_batches_then_the_rest():
    tokens = [*range(100, 144), STOP]  # 45 tokens, one per read
    sizes, sent, answer = relayed([[t] for t in tokens], derender_tokens=16)
    assert sizes == [1, 16, 16, 11]  # first read; 16 each; the rest at the end (the stop token has no text)
    assert len(sizes) <= 2 + (len(tokens) - 2) // 16
    assert sent == text(tokens) == answer["content"][0]["text"]  # every token's text, once, in order
    # one call per read, as before the batching
    sizes, sent, _ = relayed([[t] for t in tokens], derender_tokens=1)
    assert sizes == [1] * 44 and sent == text(tokens)


@pytest.mark.parametrize("derender_tokens", [4, 16, 32])
def test_a_read_of_many_tokens_is_one_call_and_small_reads_wait_for_a_batch(derender_tokens):
    """A read bringing more than ``derender_tokens`` (40 here) goes whole in one call; reads of 3 tokens wait
    until at least ``derender_tokens`` are taken, but at the end."""
    tokens = [*range(100, 160), STOP]
    reads = [tokens[:1], tokens[1:41], *(tokens[i : i + 3] for i in range(41, len(tokens), 3))]
    sizes, sent, _ = relayed(reads, derender_tokens)
    assert sizes[:2] == [1, 40] and all(n >= derender_tokens for n in sizes[2:-1])
    assert sum(sizes) == len(tokens) - 1 and sent == text(tokens)
    assert len(sizes) <= 2 + (len(tokens) - 2) // derender_tokens + 1
