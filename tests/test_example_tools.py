"""examples/flights end to end: an `openai-agents` agent doing forced function calls, trained by the real
`harnessrl run` (vLLM on the CPU with the example's tool flags, the capture proxy, the harness processes, the
DeepSpeed learner) on the tiny model, checked through the store.

What it shows: a harness written with an agent library, unchanged, trains on its whole conversation as one row
per rollout (its calls continue each other's exact tokens through vLLM's render/generate/derender, so training
tokens are the final trajectory's), the tokens stored are the tool calls the agent received and executed, and
the learner trains on the rewards. Small on purpose (2 steps, 2 tasks of 2 rollouts each): the example's
spec is kept apart from its size.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harnessrl.store import CallStatus, RolloutState, TraceStore
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.trainer.rows import merge_calls_into_rows

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples/flights"
RUN = "flights-e2e"
STEPS = 2


@pytest.fixture(scope="module")
def flights_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TraceStore:
    base = tmp_path_factory.mktemp("flights-run")
    spec = yaml.safe_load((EXAMPLE / "trainingrun.yaml").read_text())
    spec["metadata"]["name"] = RUN
    spec["spec"]["model"]["path"] = str(tiny_model_dir)
    harness = spec["spec"]["harness"]
    harness["command"] = ["python", str(EXAMPLE / "harness.py")]
    harness["tasks"] = {"inline": [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()[:4]]}
    harness.update(groupSize=2, concurrency=4)
    spec["spec"]["learner"].update(steps=STEPS, tasksPerStep=2, maxStaleness=0)
    (base / "run.yaml").write_text(yaml.safe_dump(spec))
    run_dir = base / "run"
    proc = subprocess.run([sys.executable, "-m", "harnessrl.cli", "run", str(base / "run.yaml"), "--run-dir",
                           str(run_dir), "--no-live"], capture_output=True, text=True, timeout=1200, check=False)
    print(proc.stdout[-4000:], proc.stderr[-3000:])
    assert proc.returncode == 0, f"harnessrl run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    store = TraceStore.connect(f"sqlite:///{run_dir / 'trace.sqlite'}")
    yield store
    store.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _succeeded(store: TraceStore) -> list:
    attempts = store.list_attempts(RUN)
    ended = {a.state for a in attempts if a.state.terminal} - {RolloutState.CANCELLED}  # cancelled: run over
    assert ended == {RolloutState.SUCCEEDED}, [(a.rollout_id, a.state, a.reason) for a in attempts]
    succeeded = [a for a in attempts if a.state is RolloutState.SUCCEEDED]
    assert len(succeeded) >= STEPS * 2 * 2  # every step's two groups of two
    return succeeded


def test_stored_tokens_are_the_tool_calls_the_agent_executed(flights_run, tokenizer) -> None:
    """Every call carries the agent's tools; each stored completion decodes to the answer the SDK got (a tool
    call in hermes' format, or the text), and the calls the harness executed (its reward info) are exactly
    the tool calls stored, in order."""
    forced: dict[str, int] = {}
    for attempt in _succeeded(flights_run):
        calls = flights_run.read_calls(attempt.rollout_id, attempt.attempt)
        assert len(calls) >= 2 and all(call.status is CallStatus.OK for call in calls)
        assert calls[0].request["tool_choice"] == {"type": "function", "function": {"name": "find"}}
        stored_tool_calls = []
        for call in calls:
            assert [tool["function"]["name"] for tool in call.request["tools"]] == ["find", "book"]
            assert len(call.logprobs) == len(call.completion_token_ids) > 0
            choice = call.request.get("tool_choice")
            if choice is not None:  # each Runner.run's first call names its tool, the SDK then resets it
                forced[choice["function"]["name"]] = forced.get(choice["function"]["name"], 0) + 1
            message = call.response["choices"][0]["message"]
            text = _answer_text(tokenizer, call)
            received = [tc["function"] for tc in message.get("tool_calls") or []]
            if not received:
                # the stop token's text may be in the content: the render/generate/derender path keeps it
                assert message["content"].rstrip("\ufffd") in (text, _answer_text(tokenizer, call, keep_stop=True))
                continue
            # hermes' format: text, then each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>
            # (after a free reply emits <tool_call>, the server's grammar makes the rest a valid call too)
            head, *segments = text.split("<tool_call>")
            assert head == (message.get("content") or "")
            sampled = [_json_prefix(segment) for segment in segments]
            assert [s for s in sampled if s is not None] == [
                {"name": f["name"], "arguments": json.loads(f["arguments"])} for f in received]
            assert choice is None or [f["name"] for f in received] == [choice["function"]["name"]]
            stored_tool_calls += [{"tool": f["name"], "arguments": json.loads(f["arguments"])} for f in received]
        assert attempt.reward_info["calls"] == stored_tool_calls
        assert attempt.reward == pytest.approx(_score(stored_tool_calls, attempt.task_id))
    assert forced["find"] == len(_succeeded(flights_run)) and forced["book"] >= 1


def _answer_text(tokenizer, call, keep_stop: bool = False) -> str:
    """The completion's text as the server answered it: special tokens kept (a tool parser turns vLLM's
    skip_special_tokens off), the stop token it ended on left out, and so are the bytes of a character left
    incomplete at the end (vLLM's detokenizer holds them back until the character is whole; compared without
    trailing replacement characters on both sides)."""
    ids = list(call.completion_token_ids)
    if not keep_stop and ids and ids[-1] in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=False).rstrip("\ufffd")


def _json_prefix(segment: str) -> dict | None:
    """The JSON object a tool-call segment starts with (whitespace allowed), or None if it was cut off."""
    try:
        value, _ = json.JSONDecoder().raw_decode(segment.lstrip())
    except json.JSONDecodeError:
        return None
    return value


def _score(tool_calls: list[dict], task_id: str) -> float:
    """The example's reward, recomputed from the stored calls and the task."""
    tasks = {t["id"]: t["data"] for t in map(json.loads, (EXAMPLE / "tasks.jsonl").read_text().splitlines())}
    made: dict = {}
    for call in tool_calls:
        made.update(call["arguments"])
    want = tasks[task_id]["want"]
    return sum(made.get(name) == value for name, value in want.items()) / len(want)


def test_each_rollout_trains_as_one_row(flights_run) -> None:
    """Token continuity through the tool flags: each rollout's calls merge into one row whose tokens are the
    final trajectory's (the `merge` ratio), both rebuilt from the store and as the learner recorded it."""
    for attempt in _succeeded(flights_run):
        calls = flights_run.read_calls(attempt.rollout_id, attempt.attempt)
        result = merge_calls_into_rows(flights_run.rollout_calls(attempt.rollout_id, attempt.attempt))
        assert len(result.rows) == 1 and result.stats.kept_calls == len(calls) >= 2
        final = len(calls[-1].prompt_token_ids) + len(calls[-1].completion_token_ids)
        assert result.stats.row_tokens / final <= 1.05
    ledger = LearnerLedger(flights_run, RUN)
    assert ledger.committed_step() == STEPS
    for step in range(1, STEPS + 1):
        metrics = ledger.step_metrics(step)
        assert metrics is not None
        if metrics["trained_rollouts"]:  # a step whose groups all tied trains nothing (and records no merge)
            assert metrics["rows_per_rollout"] == 1.0 and metrics["merge_token_ratio"] <= 1.05, metrics
