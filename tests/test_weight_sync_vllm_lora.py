"""LoRA weight sync against a real vLLM server started with ``--enable-lora``.

The learner publishes version 0 (the fresh adapter, whose B matrices are zero) and loads it on the server at
start; harnesses then ask for the adapter's name. After one step the adapter is reloaded in place under the
same name: the server's greedy output for that name changes, its log-probs equal transformers + peft with the
published adapter on the same tokens, and the base model's output stays as it was. (Log-probs, not token
equality: after a large LoRA step the greedy choice can sit on a near-tie that CPU numerics decide either way.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from learner_helpers import Sample, record_group, sample_completions
from test_weight_sync_vllm import PROBE_PROMPTS, greedy_agreement, server_greedy, server_logprobs
from vllm_fixtures import start_test_vllm, tiny_model_dir  # noqa: F401 - pytest fixture

from harnessrl.store import TraceStore
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.trainer.engine import EngineSettings, LoraSettings, PolicyEngine
from harnessrl.trainer.learner import Learner, LearnerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUN = "vllm-lora"
ADAPTER = "policy"


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        server = start_test_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm-lora") / "vllm.log",
                                 extra_args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"])
    try:
        yield server
    finally:
        server.stop()


def peft_logprobs(base: Path, adapter: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_lora_adapter_sync(lora_server, tiny_model_dir: Path, tmp_path: Path):
    store = TraceStore.connect(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    prompt = list(range(60, 80))
    samples = sample_completions(tiny_model_dir, prompt, 4, 8, seed=7)
    record_group(store, RUN, "task", [Sample(((prompt, c, lp),), float(i < 2)) for i, (c, lp) in enumerate(samples)])

    base_out = [server_greedy(lora_server.base_url, lora_server.model, p) for p in PROBE_PROMPTS]
    # vLLM serves the base model: its greedy tokens are transformers' argmax wherever that is clear.
    assert sum(greedy_agreement(tiny_model_dir, p, tokens) for p, tokens in zip(PROBE_PROMPTS, base_out)) > 0

    settings = LearnerSettings(run=RUN, model_dir=tiny_model_dir, output_dir=tmp_path / "ckpt", steps=1,
                               tasks_per_step=1, group_size=4, wait_timeout_s=0,
                               engine=EngineSettings(lr=5e-2, lora=LoraSettings(rank=8, alpha=16.0)),
                               replicas=(lora_server.base_url,), lora_name=ADAPTER, sync_backoff_s=0.1)
    learner = Learner(settings, PolicyEngine(tiny_model_dir, settings.engine), store)
    assert learner.resume() == 0
    ledger = LearnerLedger(store, RUN)
    v0 = ledger.version(0)
    assert v0.synced and Path(v0.checkpoint_path) == tmp_path / "ckpt" / "versions" / "v000000"
    # the fresh adapter changes nothing
    assert [server_greedy(lora_server.base_url, ADAPTER, p) for p in PROBE_PROMPTS] == base_out

    outcome = learner.step()
    assert outcome is not None and outcome.synced and ledger.version(1).synced
    adapter = tmp_path / "ckpt" / "versions" / "v000001"
    assert (adapter / "adapter_model.safetensors").is_file()
    tuned = [server_greedy(lora_server.base_url, ADAPTER, p) for p in PROBE_PROMPTS]
    assert tuned != base_out
    for prompt in PROBE_PROMPTS:
        tokens, served = server_logprobs(lora_server.base_url, ADAPTER, prompt)
        assert served == pytest.approx(peft_logprobs(tiny_model_dir, adapter, prompt, tokens), abs=1e-2)
    assert [server_greedy(lora_server.base_url, lora_server.model, p) for p in PROBE_PROMPTS] == base_out
    store.close()
