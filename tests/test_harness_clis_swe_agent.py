"""The coding example's harness on the real vLLM: mini-swe-agent, unchanged (``scripts/swe-agent.sh`` installs it
in its own environment), through a train-mode capture proxy, then the verifier on the tree it left.

The server is the CLI tests' (``cli_server``: hermes, every tool's arguments pinned to its schema, a 64k context;
this module's name puts it beside test_harness_clis.py so the shared server starts once). The harness runs with
the example's ``--tool-choice bash`` (in mini-swe-agent's own config: every call names its tool), and the random
model is steered through the proxy's sampling override (test only: a logit bias towards the string's end and the
answer's), so every answer is a valid ``bash`` call whose ``command`` is a few random tokens. What must hold:
mini-swe-agent sends the tool choice on every call, runs every command in the sandbox (``harnessrl swe sandbox``,
its bubblewrap environment's executable) and keeps each call in its history, so the calls of a rollout are one
training row as the learner builds it; every call is stored with its log-probs; the verifier scores the untouched
bug 0.
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

pytest_plugins = ["vllm_fixtures"]  # fixtures: cli_model, cli_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "swe"
MINI = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "harnessrl/mini-swe-agent-2.4.6/bin/mini"
HARNESSRL = Path(sys.executable).with_name("harnessrl")
RUN = "swe-agent"
STEPS = 4  # every call is valid, so mini-swe-agent stops at its step limit
COMMAND_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def mini() -> Path:
    subprocess.run([str(ROOT / "scripts" / "swe-agent.sh")], check=True, capture_output=True, timeout=900)
    assert MINI.is_file()
    return MINI


def sandboxed(command: str, repository: str) -> dict:
    """``command`` run as mini-swe-agent's bubblewrap environment runs it: returncode and output."""
    done = subprocess.run([str(HARNESSRL), "swe", "sandbox", "--timeout", str(COMMAND_TIMEOUT_S), "--",
                           "--bind", repository, repository, "--chdir", repository, "bash", "-c", command],
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S + 30, check=False)
    return {"returncode": done.returncode, "output": done.stdout + done.stderr}


def test_mini_swe_agent_runs_the_models_commands_in_the_sandbox_as_one_row(mini, cli_server, cli_model,
                                                                            tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cli_model)
    stop = str(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    quote = str(tokenizer.encode('"')[0])
    # The string's end weighted a little, so a command is a few tokens; the answer ends after the call.
    sampling = {"temperature": 1.0, "logit_bias": {stop: 100, quote: 6}}
    task = min((json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()),
               key=lambda row: len(row["data"]["problem_statement"]))
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "task.json").write_text(json.dumps(task))
    with proxy_in_front(cli_server, tmp_path, RUN, sampling) as (store, proxy):
        store.add_tasks(RUN, [task])
        rollout = store.create_rollout(RUN, task["id"], 0, rollout_id="r0")
        store.transition(rollout, 0, RolloutState.RUNNING, policy_version=0)
        env = {**os.environ, "HARNESSRL_TASK_FILE": str(workspace / "task.json"),
               "HARNESSRL_WORKSPACE": str(workspace), "OPENAI_API_KEY": "unused",
               "OPENAI_BASE_URL": f"{proxy.url}/rollouts/{rollout}/attempts/0/v1",
               "HARNESSRL_MODEL_NAME": cli_server.model, "HARNESSRL_MINI_SWE_AGENT": str(mini)}
        done = subprocess.run([sys.executable, str(EXAMPLE / "harness.py"), "--step-limit", str(STEPS),
                               "--command-timeout", str(COMMAND_TIMEOUT_S), "--tool-choice", "bash"], env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        proxy.flush(60)
        calls = store.read_calls(rollout, 0)
        rows = merge_calls_into_rows(store.rollout_calls(rollout, 0))

    trajectory = json.loads((workspace / "trajectory.json").read_text())
    assert trajectory["info"]["exit_status"] == "LimitsExceeded", trajectory["info"]
    assert trajectory["info"]["model_stats"]["api_calls"] == len(calls) == STEPS
    assert all(call.status is CallStatus.OK and len(call.logprobs) == len(call.completion_token_ids) > 0
               for call in calls)
    assert all(call.request["tool_choice"] == {"type": "function", "function": {"name": "bash"}} for call in calls)
    environment = trajectory["info"]["config"]["environment"]
    assert environment["executable"] == str(HARNESSRL) and environment["wrapper_args"][:2] == ["swe", "sandbox"]
    # Each command the model wrote (as the proxy stored it) was run, and what mini-swe-agent observed is what the
    # sandbox answers for it.
    messages = trajectory["messages"]
    commands = [json.loads(call.response["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
                ["command"] for call in calls]
    ran = [json.loads(m["tool_calls"][0]["function"]["arguments"])["command"]
           for m in messages if m["role"] == "assistant"]
    observed = [json.loads(m["content"]) for m in messages if m["role"] == "tool"]
    assert ran == commands and len(observed) == STEPS
    repository = environment["cwd"]
    assert [sandboxed(command, repository) for command in commands] == observed
    # mini-swe-agent keeps each valid call and its observation in its history: one conversation, one row.
    assert rows.stats.rows == len(rows.rows) == 1 and rows.stats.kept_calls == STEPS, rows.stats
    assert verify(task["data"], workspace).reward == 0.0  # the bug is still there
