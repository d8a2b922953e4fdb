"""End to end with ``weightSync.method: lora``: `harnessrl run` with a real vLLM CPU server, the capture proxy,
harness processes and DeepSpeed training a LoRA adapter on the tiny model.

The run is made in two invocations of the real CLI: one step, then two more, resuming a run whose policy is an
adapter. Checked through the store and the adapter files the learner wrote:

* vLLM serves the base model under a name of its own and the adapter as "policy" (what the proxy sends); the
  learner's fresh adapter is version 0 and is loaded before any rollout, so every stored call carries an
  adapter version;
* the versions advance (0, 1, 2..., each an adapter directory, each synced; one per step that trained: the
  groups the first invocation's stop cancelled are consumed by a step of the second that trains nothing);
* the resumed invocation starts vLLM on the base model, loads version 1's adapter and serves the adapters:
  the calls it stored under a trained version have the log-probs of base + that adapter (peft), clearly not
  the base model's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from harnessrl.store import CallStatus, TraceStore
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.store.records import utcnow

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
RUN = "lora-e2e"


def _run(command: list[str], steps: int) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*command, "--steps", str(steps)], capture_output=True, text=True, timeout=1500,
                            check=False)
    print(result.stdout[-4000:], result.stderr[-4000:])
    assert result.returncode == 0, f"harnessrl run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory):
    from harnessrl.tiny_model import build_tiny_model

    base = tmp_path_factory.mktemp("local-run-lora")
    model = build_tiny_model(base / "model")
    spec = yaml.safe_load((ROOT / "examples/vowels/trainingrun.yaml").read_text())
    spec["metadata"]["name"] = RUN
    spec["spec"]["model"]["path"] = str(model)
    harness = spec["spec"]["harness"]
    harness["command"] = ["python", str(ROOT / "examples/vowels/harness.py")]
    harness["tasks"] = {"inline": [json.loads(line) for line in
                                   (ROOT / "examples/vowels/tasks.jsonl").read_text().splitlines()[:8]]}
    spec["spec"]["weightSync"] = {"method": "lora"}
    learner = spec["spec"]["learner"]
    # keepCheckpoints above the 4 versions three steps can make: every version's adapter stays to be checked
    learner.update(tasksPerStep=2, maxStaleness=0, keepCheckpoints=8)
    learner["lora"] = {"rank": 8, "alpha": 16.0}
    learner["algorithm"]["lr"] = 5.0e-2  # one LoRA step must move the policy clearly away from the base
    (base / "run.yaml").write_text(yaml.safe_dump(spec))
    run_dir = base / "run"
    command = [sys.executable, "-m", "harnessrl.cli", "run", str(base / "run.yaml"), "--run-dir", str(run_dir),
               "--no-live"]
    first = _run(command, 1)
    resumed_at = utcnow()
    second = _run(command, 3)  # the same run, two steps more: a resume on version 1's adapter
    store = TraceStore.connect(f"sqlite:///{run_dir / 'trace.sqlite'}")
    yield model, first.stdout, second.stdout, store, resumed_at
    store.close()


def _ok_calls(store: TraceStore) -> list:
    return [call for a in store.list_attempts(RUN) for call in store.read_calls(a.rollout_id, a.attempt)
            if call.status is CallStatus.OK]


def _logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_versions_are_adapters_and_advance(lora_run) -> None:
    _, first, second, store, _ = lora_run
    ledger = LearnerLedger(store, RUN)
    versions = ledger.versions()
    trained = [ledger.step_metrics(step)["empty_step"] == 0 for step in (1, 2, 3)]
    assert trained[0] and any(trained[1:])  # step 3 at least trains on rollouts of the resumed run
    assert [v.version for v in versions] == list(range(sum(trained) + 1)) and ledger.committed_step() == 3
    assert all(v.synced for v in versions)
    for v in versions:  # each version is the adapter the learner wrote, never the base model's directory
        assert (Path(v.checkpoint_path) / "adapter_config.json").is_file(), v
    assert "serving v0" in first
    assert "serving v1" in second and "loaded version 1's adapter" in second


def test_every_call_is_served_by_an_adapter_version(lora_run) -> None:
    _, _, _, store, _ = lora_run
    calls = _ok_calls(store)
    assert calls
    by_version: dict[int, int] = {}
    for call in calls:
        by_version[call.policy_version] = by_version.get(call.policy_version, 0) + 1
    # 0 is the fresh adapter (loaded by the learner before the first rollout), 1 the first trained one; harnesses
    # still running after a later sync are served (and stored) under the newer adapters, up to the last version
    versions = {v.version for v in LearnerLedger(store, RUN).versions()}
    assert set(by_version) <= versions and by_version.get(0) and by_version.get(1), (by_version, versions)


def test_the_resumed_server_serves_the_trained_adapter(lora_run) -> None:
    """Calls the resumed run stored under a trained version were answered by base + that version's adapter
    (peft's log-probs within 1e-2 on average), which here differ clearly from the base model's: vLLM served the adapter
    (loaded by the runner on resume, or by the learner's sync), not the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, _, _, store, resumed_at = lora_run
    resumed = [c for c in _ok_calls(store) if c.policy_version >= 1 and c.created_at > resumed_at]
    assert resumed
    version = min(c.policy_version for c in resumed)
    calls = [c for c in resumed if c.policy_version == version][:6]
    adapter = Path(LearnerLedger(store, RUN).version(version).checkpoint_path)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base_lp = [_logprobs(base, c.prompt_token_ids, c.completion_token_ids) for c in calls]
    tuned = PeftModel.from_pretrained(base, adapter).eval()
    tuned_lp = [_logprobs(tuned, c.prompt_token_ids, c.completion_token_ids) for c in calls]
    stored = [lp for c in calls for lp in c.logprobs]
    adapter_gaps = [abs(a - b) for a, b in zip(stored, [x for lp in tuned_lp for x in lp], strict=True)]
    base_gaps = [abs(a - b) for a, b in zip(stored, [x for lp in base_lp for x in lp], strict=True)]
    to_adapter, to_base = sum(adapter_gaps) / len(stored), sum(base_gaps) / len(stored)
    # vLLM's CPU LoRA kernels and peft sum in different orders: a single token's gap reached 1.04e-2 in CI
    # while the mean stays far below it, so the mean is compared with a margin and the worst token loosely.
    assert to_adapter < 1e-2 and max(adapter_gaps) < 5e-2, (to_adapter, max(adapter_gaps))
    assert to_base > 0.05 and to_base > 5 * to_adapter, (to_base, to_adapter)
