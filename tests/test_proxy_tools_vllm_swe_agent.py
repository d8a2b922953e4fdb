"""The coding example's harness on the real vLLM: mini-swe-agent, unchanged (``scripts/swe-agent.sh`` installs it
in its own environment), through a train-mode capture proxy on the tiny model with the tool flags,
then the verifier on the tree it left.

The random model is steered as in the CLI tests, through the proxy's sampling override: ``tool_choice``
required, so every answer is a ``bash`` call. What must hold: every call the agent made is stored with its
log-probs, how they become training rows is what the learner would see (one per call here: mini-swe-agent
drops an answer it cannot parse from its history), and the verifier scores the untouched bug 0. The random model's arguments are never a
command (see the test), so no command reaches the sandbox here; test_swe_sandbox.py runs the sandbox as
mini-swe-agent calls it. (This module's name puts it beside the other tool-server modules, so the shared server
starts once.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_fixtures import proxy_in_front

from harnessrl.store import CallStatus, RolloutState
from harnessrl.swe.verifier import verify
from harnessrl.trainer.rows import merge_calls_into_rows

pytest_plugins = ["vllm_fixtures"]  # fixtures: tiny_model_dir, tool_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "swe"
MINI = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "harnessrl/mini-swe-agent-2.4.6/bin/mini"
RUN = "swe-agent"
STEPS = 6  # more than it takes: mini-swe-agent stops after 3 format errors in a row


@pytest.fixture(scope="module")
def mini() -> Path:
    subprocess.run([str(ROOT / "scripts" / "swe-agent.sh")], check=True, capture_output=True, timeout=900)
    assert MINI.is_file()
    return MINI


def test_mini_swe_agent_runs_unchanged_through_the_proxy(mini, tool_server, tiny_model_dir,
                                                                        tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    stop = str(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    quote = str(tokenizer.encode('"')[0])
    sampling = {"temperature": 1.0, "tool_choice": "required", "logit_bias": {stop: 100, quote: 4}}
    task = min((json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()),
               key=lambda row: len(row["data"]["problem_statement"]))
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "task.json").write_text(json.dumps(task))
    with proxy_in_front(tool_server, tmp_path, RUN, sampling) as (store, proxy):
        store.add_tasks(RUN, [task])
        rollout = store.create_rollout(RUN, task["id"], 0, rollout_id="r0")
        store.transition(rollout, 0, RolloutState.RUNNING, policy_version=0)
        env = {**os.environ, "HARNESSRL_TASK_FILE": str(workspace / "task.json"),
               "HARNESSRL_WORKSPACE": str(workspace), "OPENAI_API_KEY": "unused",
               "OPENAI_BASE_URL": f"{proxy.url}/rollouts/{rollout}/attempts/0/v1",
               "HARNESSRL_MODEL_NAME": tool_server.model, "HARNESSRL_MINI_SWE_AGENT": str(mini)}
        done = subprocess.run([sys.executable, str(EXAMPLE / "harness.py"), "--step-limit", str(STEPS),
                               "--command-timeout", "20"], env=env, capture_output=True, text=True, timeout=600,
                              check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        proxy.flush(60)
        calls = store.read_calls(rollout, 0)
        rows = merge_calls_into_rows(store.rollout_calls(rollout, 0))

    trajectory = json.loads((workspace / "trajectory.json").read_text())
    # Under ``tool_choice`` required vLLM keeps every answer a ``bash`` call, but mini-swe-agent's tool is not
    # strict, so the grammar leaves its arguments any JSON: the random model writes numbers, mini-swe-agent
    # answers each with its format error, and after three in a row it stops, as it would with any model.
    assert trajectory["info"]["exit_status"] == "RepeatedFormatError"
    assert trajectory["info"]["model_stats"]["api_calls"] == len(calls) == 3
    assert all(call.status is CallStatus.OK and len(call.logprobs) == len(call.completion_token_ids) > 0
               for call in calls)
    assert [t["function"]["name"] for t in calls[0].request["tools"]] == ["bash"]
    assert all(call.response["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "bash"
               for call in calls)
    # mini-swe-agent keeps an answer it could not parse out of its history (only its error message goes in), so
    # each next prompt starts anew: one row per call, split as a new conversation. (Valid calls are kept and
    # continue one another; that needs a model whose arguments parse.)
    assert rows.stats.rows == len(rows.rows) == 3 and rows.stats.splits == {"new_conversation": 2}, rows.stats
    assert verify(task["data"], workspace).reward == 0.0  # the bug is still there
