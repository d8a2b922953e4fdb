"""Evaluation calls are sampled with ``spec.evaluation``'s settings, training calls with the run's: the proxy
tells them apart by the rollout id its attribution already carries (gateway path or sidecar environment)."""

from __future__ import annotations

import openai
from proxy_servers import loops, make_proxy, upstream  # noqa: F401 - pytest fixtures

from harnessrl.proxy.config import NEUTRAL_SAMPLING
from harnessrl.rollout_ids import evaluation_rollout_id, training_rollout_id

RUN_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 24}
EVALUATION = {"temperature": 0.0, "top_p": 1.0}


def sent_sampling(upstream, keys) -> dict:  # noqa: F811
    sent = upstream.fake.bodies[-1]
    return {key: sent.get(key) for key in keys}


def test_gateway_samples_each_rollout_by_its_kind(upstream, make_proxy) -> None:  # noqa: F811
    proxy = make_proxy([upstream.url], rollout_id=None, sampling=RUN_SAMPLING, evaluation_sampling=EVALUATION)
    expected_train = {**NEUTRAL_SAMPLING, **RUN_SAMPLING}
    expected_eval = {**expected_train, **EVALUATION}  # the run's max_tokens still caps evaluation calls
    for rollout_id, expected in ((training_rollout_id("r", 3, 1), expected_train),
                                 (evaluation_rollout_id("r", 20, 4, 0), expected_eval)):
        client = openai.OpenAI(base_url=f"{proxy.url}/rollouts/{rollout_id}/attempts/0/v1", api_key="unused",
                               max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"temperature": 1.5, "top_p": 0.3})
        assert sent_sampling(upstream, expected) == expected, rollout_id
        client.completions.create(model="m", prompt="hi", extra_body={"temperature": 1.5})
        assert sent_sampling(upstream, expected) == expected, rollout_id


def test_a_sidecar_of_an_evaluation_pod_samples_as_the_evaluation(upstream, make_proxy) -> None:  # noqa: F811
    proxy = make_proxy([upstream.url], rollout_id=evaluation_rollout_id("r", 0, 0, 0), sampling=RUN_SAMPLING,
                       evaluation_sampling=EVALUATION)
    client = openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert sent_sampling(upstream, ("temperature", "top_p", "max_tokens")) == {**RUN_SAMPLING, **EVALUATION}


def test_without_evaluation_sampling_an_evaluation_id_samples_as_training(upstream, make_proxy) -> None:  # noqa: F811
    proxy = make_proxy([upstream.url], rollout_id=evaluation_rollout_id("r", 0, 0, 0), sampling=RUN_SAMPLING)
    client = openai.OpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert sent_sampling(upstream, RUN_SAMPLING) == RUN_SAMPLING
