"""Sampling at temperature 0.7 through the capture proxy into the learner: the log-probs agree.

The policy the learner trains is softmax(logits / spec.rollout.temperature). For its importance weights to be
right, the log-probs stored with each token must be those of the distribution the token was drawn from:
vLLM runs with ``--logprobs-mode processed_logprobs`` (temperature applied; vLLM's default reports the raw
model's), and the proxy sends neutral values for the fields a harness could use to reshape that distribution
(top_k, min_p, penalties, logit_bias), here all set by the "harness" to values that would change the samples.
On the tokens its own weights produced, the learner then agrees with the serving engine (Pearson >= 0.99).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from vllm_fixtures import captured_group, proxy_in_front, tiny_model_dir, vllm_server  # noqa: F401 - fixtures

from harnessrl.trainer.engine import EngineSettings, PolicyEngine
from harnessrl.trainer.learner import Learner, LearnerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUN = "sampling"
TEMPERATURE = 0.7
MESSAGES = [{"role": "user", "content": "list three prime numbers and explain why"}]
BIASED = 500  # the token the harness's logit_bias would force


def hf_logprobs(model_dir: Path, prompt: list[int], tokens: list[int], temperature: float) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return np.array([logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)])


def test_rollout_and_learner_logprobs_agree_at_temperature_0_7(vllm_server, tiny_model_dir: Path, tmp_path: Path):
    def reshaping_call(client) -> None:
        client.chat.completions.create(
            model="policy", messages=MESSAGES, max_tokens=24, temperature=1.5, top_p=0.5,
            extra_body={"top_k": 3, "min_p": 0.3, "repetition_penalty": 1.8, "presence_penalty": 1.5,
                        "frequency_penalty": 1.5, "logit_bias": {str(BIASED): 100}},
        )

    with proxy_in_front(vllm_server, tmp_path, RUN, {"temperature": TEMPERATURE}) as (store, proxy):
        rollouts = captured_group(store, proxy, RUN, reshaping_call)
        calls = [store.read_calls(r, 0)[0] for r in rollouts]

        # The stored log-probs are the temperature-0.7 model's, with nothing of the harness's reshaping
        # (top_k 3 would raise them, a +100 bias would make every token 500).
        tokens = [t for c in calls for t in c.completion_token_ids]
        assert tokens.count(BIASED) < len(tokens) / 2
        for call in calls:
            expected = hf_logprobs(tiny_model_dir, call.prompt_token_ids, call.completion_token_ids, TEMPERATURE)
            assert np.abs(np.array(call.logprobs) - expected).max() < 2e-2, (call.logprobs, expected)

        settings = LearnerSettings(run=RUN, model_dir=tiny_model_dir, output_dir=tmp_path / "ckpt", steps=1,
                                   tasks_per_step=1, group_size=4, wait_timeout_s=0,
                                   engine=EngineSettings(lr=1e-3, temperature=TEMPERATURE))
        (outcome,) = Learner(settings, PolicyEngine(tiny_model_dir, settings.engine), store).run()
        metrics = outcome.metrics
        print(f"vLLM vs learner log-probs at T={TEMPERATURE}: pearson {metrics['logprob_pearson']:.6f}, "
              f"mean |diff| {metrics['logprob_abs_diff']:.2e}, tokens {metrics['logprob_tokens']:.0f}")
        assert metrics["logprob_tokens"] == len(tokens) == metrics["trained_target_tokens"]
        assert metrics["logprob_pearson"] >= 0.99 and metrics["logprob_abs_diff"] < 1e-2


TOP_P = 0.8


def test_with_top_p_the_learner_trains_the_nucleus_vllm_sampled_from(vllm_server, tiny_model_dir: Path,
                                                                     tmp_path: Path):
    """spec.rollout.topP 0.8: the stored (processed) log-probs are of the renormalised nucleus, above the plain
    softmax's by -log(nucleus mass) on every token, and the learner, told the same top-p, agrees with them."""
    def call(client) -> None:
        client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=24)

    with proxy_in_front(vllm_server, tmp_path, "nucleus", {"temperature": TEMPERATURE, "top_p": TOP_P}) as (
        store, proxy
    ):
        rollouts = captured_group(store, proxy, "nucleus", call)
        calls = [store.read_calls(r, 0)[0] for r in rollouts]
        lifted = np.concatenate([
            np.array(c.logprobs) - hf_logprobs(tiny_model_dir, c.prompt_token_ids, c.completion_token_ids, TEMPERATURE)
            for c in calls
        ])
        print(f"processed minus plain log-probs at top_p {TOP_P}: mean {lifted.mean():.3f}, min {lifted.min():.3f}")
        assert lifted.min() > -2e-2 and lifted.mean() > 0.05  # renormalised: never below, clearly above on average

        settings = LearnerSettings(run="nucleus", model_dir=tiny_model_dir, output_dir=tmp_path / "ckpt", steps=1,
                                   tasks_per_step=1, group_size=4, wait_timeout_s=0,
                                   engine=EngineSettings(lr=1e-3, temperature=TEMPERATURE, top_p=TOP_P))
        (outcome,) = Learner(settings, PolicyEngine(tiny_model_dir, settings.engine), store).run()
        metrics = outcome.metrics
        print(f"vLLM vs learner log-probs at T={TEMPERATURE}, top_p {TOP_P}: pearson {metrics['logprob_pearson']:.6f},"
              f" mean |diff| {metrics['logprob_abs_diff']:.2e}")
        assert metrics["logprob_pearson"] >= 0.99 and metrics["logprob_abs_diff"] < 1e-2
