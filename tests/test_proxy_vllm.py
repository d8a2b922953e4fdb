"""The proxy in front of a real vLLM server (CPU, tiny local model): what is stored is what the model did.

Stored completion token ids must decode, with the model's own tokenizer, to exactly the text the harness
received; stored prompt ids must be the chat template's rendering; stored log-probs must be the ones vLLM
reported -- for chat and completions, streamed and not.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import openai
import pytest

pytest.register_assert_rewrite("proxy_servers")  # also loaded as a plugin below
from proxy_servers import LoopThread, RunningProxy, metric_value, proxy_config

from harnessrl.store import CallStatus, TraceStore

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, vllm_server

pytestmark = pytest.mark.vllm

MESSAGES = [
    {"role": "system", "content": "you are a coding agent"},
    {"role": "user", "content": "read file 42 and fix the error in the test"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def captured(vllm_server, tmp_path_factory: pytest.TempPathFactory):
    """A proxy (train mode, temperature forced to 1.0) in front of the real server, on a SQLite store."""
    tmp = tmp_path_factory.mktemp("proxy-vllm")
    url = f"sqlite:///{tmp / 'store.db'}"
    store = TraceStore.connect(url)
    store.upgrade()
    loops = LoopThread()
    proxy = RunningProxy(
        loops,
        proxy_config(
            [vllm_server.base_url],
            url,
            tmp / "spool",
            rollout_id=None,
            model_name=vllm_server.model,
            sampling={"temperature": 1.0},
        ),
        store,
    )
    yield proxy, store
    proxy.stop()
    loops.close()
    store.close()


def decodes_to(tokenizer, ids: list[int], text: str, stream: bool) -> bool:
    """Whether ``ids`` decode to ``text``. An output that ends inside a multi-byte UTF-8 character never
    carries that partial character (vLLM's incremental detokenizer holds it back, streamed or not), while a
    full decode shows it as U+FFFD; the ids are still exactly what the model sampled."""
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    return decoded == text or decoded.rstrip("\ufffd") == text


def client(proxy: RunningProxy, rollout: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{proxy.url}/rollouts/{rollout}/attempts/0/v1", api_key="unused", max_retries=0, timeout=120
    )


def stored_call(proxy: RunningProxy, store: TraceStore, rollout: str):
    proxy.flush(60)
    [call] = store.read_calls(rollout, 0)
    assert call.status is CallStatus.OK
    return call


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_chat_capture_matches_what_the_harness_received(captured, tokenizer, stream):
    proxy, store = captured
    rollout = f"chat-{stream}"
    c = client(proxy, rollout)
    if stream:
        chunks = list(
            c.chat.completions.create(
                model="anything", messages=MESSAGES, max_tokens=24, logprobs=True, stream=True
            )
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        logprobs = [
            e.logprob
            for ch in chunks
            if ch.choices and ch.choices[0].logprobs
            for e in ch.choices[0].logprobs.content
        ]
        assert all("token_ids" not in ch.model_dump()["choices"][0] for ch in chunks if ch.choices)
    else:
        resp = c.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=24, logprobs=True)
        text = resp.choices[0].message.content
        logprobs = [e.logprob for e in resp.choices[0].logprobs.content]
        assert "prompt_token_ids" not in resp.model_dump()
    call = stored_call(proxy, store, rollout)
    expected_prompt = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert call.prompt_token_ids == list(expected_prompt)
    assert decodes_to(tokenizer, call.completion_token_ids, text, stream)
    assert call.logprobs == logprobs and len(logprobs) == len(call.completion_token_ids) > 0
    assert call.request["model"] == "anything"  # stored as the harness sent it; vLLM got the served name


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_completions_capture_matches_what_the_harness_received(captured, tokenizer, stream):
    proxy, store = captured
    rollout = f"cmpl-{stream}"
    prompt = "def fix(path):\n    return"
    c = client(proxy, rollout)
    if stream:
        chunks = list(c.completions.create(model="m", prompt=prompt, max_tokens=20, logprobs=1, stream=True))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        logprobs = [
            lp
            for ch in chunks
            if ch.choices and ch.choices[0].logprobs
            for lp in ch.choices[0].logprobs.token_logprobs
        ]
    else:
        resp = c.completions.create(model="m", prompt=prompt, max_tokens=20, logprobs=1)
        text = resp.choices[0].text
        logprobs = resp.choices[0].logprobs.token_logprobs
    call = stored_call(proxy, store, rollout)
    assert call.prompt_token_ids == tokenizer.encode(prompt)
    assert decodes_to(tokenizer, call.completion_token_ids, text, stream)
    assert call.logprobs == logprobs and len(logprobs) == len(call.completion_token_ids) > 0


def test_unrequested_logprobs_are_captured_but_not_returned(captured, tokenizer):
    proxy, store = captured
    resp = client(proxy, "quiet").chat.completions.create(model="m", messages=MESSAGES, max_tokens=16)
    assert resp.choices[0].logprobs is None
    call = stored_call(proxy, store, "quiet")
    assert decodes_to(tokenizer, call.completion_token_ids, resp.choices[0].message.content, stream=False)
    assert len(call.logprobs) == len(call.completion_token_ids) > 0
    assert all(lp <= 0 for lp in call.logprobs)


# ------------------------------------------------------------------------------------- token continuity


def chat_turn(c: openai.OpenAI, messages: list[dict], stream: bool) -> dict:
    """One agent turn; returns the assistant message as a harness would append it."""
    if stream:
        chunks = list(c.chat.completions.create(model="m", messages=messages, max_tokens=12, stream=True))
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        content = (
            c.chat.completions.create(model="m", messages=messages, max_tokens=12).choices[0].message.content
        )
    return {"role": "assistant", "content": content}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_token_continuity_makes_each_prompt_extend_the_last(captured, tokenizer, stream):
    """Three turns: turns 2 and 3 are sent as the previous call's exact tokens + the new messages, so every
    stored prompt starts with the previous prompt + completion (the learner can merge them into one row)."""
    proxy, store = captured
    rollout = f"continuity-{stream}"
    c = client(proxy, rollout)
    before = (
        metric_value(
            httpx.get(f"{proxy.url}/metrics").text, "harnessrl_proxy_token_continuity_total", outcome="used"
        )
        or 0
    )
    messages = list(MESSAGES)
    for turn in range(3):
        reply = chat_turn(c, messages, stream)
        messages += [reply, {"role": "user", "content": f"observation {turn}: tests failed in file {turn}"}]
    proxy.flush(60)
    calls = store.read_calls(rollout, 0)
    assert [call.status for call in calls] == [CallStatus.OK] * 3
    for prev, call in itertools.pairwise(calls):
        context = prev.prompt_token_ids + prev.completion_token_ids
        assert call.prompt_token_ids[: len(context)] == context
        assert len(call.prompt_token_ids) > len(context)
        # Apart from the model's own tokens, the prompt is the chat template's rendering: the new tail is
        # exactly what the plain chat path would have tokenized.
        tail = tokenizer.decode(call.prompt_token_ids[len(context) :])
        assert tail.endswith("<|im_start|>assistant\n") and f"observation {calls.index(prev)}" in tail
    for call in calls:
        assert decodes_to(
            tokenizer, call.completion_token_ids, call.response["choices"][0]["message"]["content"], stream
        )
        assert len(call.logprobs) == len(call.completion_token_ids)
    after = metric_value(
        httpx.get(f"{proxy.url}/metrics").text, "harnessrl_proxy_token_continuity_total", outcome="used"
    )
    assert after - before == 2
    deltas = store.rollout_calls(rollout, 0)
    assert [d.parent_call_id for d in deltas] == [None, calls[0].call_id, calls[1].call_id]


def test_token_continuity_falls_back_when_things_do_not_line_up(captured):
    proxy, store = captured
    c = client(proxy, "fallback")
    messages = list(MESSAGES)
    messages += [chat_turn(c, messages, False), {"role": "user", "content": "go on"}]
    edited = [dict(m) for m in messages]
    edited[2]["content"] += " (edited by the harness)"
    c.chat.completions.create(model="m", messages=edited, max_tokens=4)  # not an extension
    text = httpx.get(f"{proxy.url}/metrics").text
    assert (
        metric_value(text, "harnessrl_proxy_token_continuity_total", outcome="not_an_extension") or 0
    ) >= 1
    proxy.flush(60)
    calls = store.read_calls("fallback", 0)
    assert [call.status for call in calls] == [CallStatus.OK] * 2
