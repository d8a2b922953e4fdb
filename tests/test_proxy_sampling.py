"""In train mode the proxy sends every call with the run's sampling and neutral values for every other field
that reshapes the sampled distribution (``NEUTRAL_SAMPLING``): the learner trains softmax(logits /
temperature), so a harness's top_k, min_p, penalties or logit_bias (or a model's generation_config default
for a field left out) would draw tokens from a distribution nobody trains."""

from __future__ import annotations

import openai
from proxy_servers import loops, make_proxy, upstream  # noqa: F401 - pytest fixtures

from harnessrl.proxy.config import NEUTRAL_SAMPLING

MESSAGES = [{"role": "user", "content": "hi"}]
RESHAPING = {"top_k": 3, "min_p": 0.3, "presence_penalty": 1.5, "frequency_penalty": 1.5, "repetition_penalty": 1.8,
             "logit_bias": {"500": 100}, "temperature": 1.7, "top_p": 0.4}


def test_a_harness_cannot_reshape_the_sampled_distribution(upstream, make_proxy):  # noqa: F811
    proxy = make_proxy([upstream.url], sampling={"temperature": 0.7, "min_p": 0.05})
    client = openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, extra_body=RESHAPING)
    client.completions.create(model="m", prompt="hi", max_tokens=2, extra_body=RESHAPING)
    expected = {**NEUTRAL_SAMPLING, "temperature": 0.7, "min_p": 0.05}  # the run's own settings win
    for sent in list(upstream.fake.bodies)[-2:]:
        assert {key: sent.get(key) for key in expected} == expected


def test_observe_mode_forwards_the_harness_sampling(upstream, make_proxy):  # noqa: F811
    proxy = make_proxy([upstream.url], proxy_mode="observe", sampling={"temperature": 0.7})
    client = openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, extra_body=RESHAPING)
    sent = upstream.fake.bodies[-1]
    assert {key: sent.get(key) for key in RESHAPING} == RESHAPING


def test_the_stored_call_records_the_sampling_sent_upstream(upstream, make_proxy, store):  # noqa: F811
    """``llm_calls.sampling`` is what the log-probs were taken under: in train mode the run's sampling and
    the neutral fields (the harness's own values stay in the stored request); in observe mode the harness's."""
    train = make_proxy([upstream.url], sampling={"temperature": 0.7, "top_p": 0.9})
    client = openai.OpenAI(base_url=train.v1, api_key="unused", max_retries=0)
    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, extra_body=RESHAPING)
    client.completions.create(model="m", prompt="hi", max_tokens=2, extra_body=RESHAPING)
    train.flush()
    calls = store.read_calls("r-1", 0)
    assert len(calls) == 2
    for call, sent in zip(calls, list(upstream.fake.bodies)[-2:], strict=True):
        assert call.sampling == {**NEUTRAL_SAMPLING, "temperature": 0.7, "top_p": 0.9}
        assert call.sampling == {key: sent.get(key) for key in call.sampling}  # exactly what went upstream
        assert call.request["top_k"] == 3 and call.request["temperature"] == 1.7  # the harness's own request

    observe = make_proxy([upstream.url], proxy_mode="observe", rollout_id="r-2")
    client = openai.OpenAI(base_url=observe.v1, api_key="unused", max_retries=0)
    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, extra_body={"temperature": 0.3})
    observe.flush()
    (call,) = store.read_calls("r-2", 0)
    assert call.sampling == {"temperature": 0.3}
