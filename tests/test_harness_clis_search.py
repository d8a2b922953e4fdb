"""The search example's harness on the real vLLM: examples/search/harness.py as ``spec.harness`` runs it (the
runner's process backend, then ``harnessrl search verify`` with the reward token only it gets), through a
train-mode capture proxy.

The server is the CLI tests' (``cli_server``: hermes, every tool's arguments pinned to its schema; this
module's name puts it beside test_harness_clis.py so the shared server starts once). Every call names the
``search`` tool (``--forced-searches`` = ``--max-calls``), and the random model is steered through the proxy's
sampling override (test only: a fixed seed, a logit bias towards the string's end and the answer's), so every
answer is a valid ``search`` call whose ``query`` is a few random tokens. Steered so, a call is 40-70 tokens
(the template's ``<tool_call>`` preamble and the random whitespace the JSON grammar allows take most of them):
``--max-tokens 256`` leaves room, where the example's old ``maxTokens: 48`` cut every call, so its rollouts
made one call each. Unsteered, a forced query runs a median of about 330 tokens, and a third of them hold the
text ``</tool_call>``, which vLLM's hermes parser takes for the call's end (README, the search example).

What must hold: each query the model wrote is answered by the BM25 index and that answer is what the next call
sees (the seed fixes the query, the same few random tokens in each call, which match no document; the scripted
oracle of test_search_example.py shows documents found); every call is stored with its log-probs and offered
the tool with the forced choice; the harness keeps every call in its history, so the calls of a rollout are one
training row as the learner builds it; the verifier's reward for the answer is stored (a forced call has no
text, so the answer is empty and scores 0).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import harness_modes
import numpy as np
import pytest
from harness_modes import TOKEN
from vllm_fixtures import proxy_in_front

from harnessrl.search.index import SearchIndex
from harnessrl.store import CallStatus, RolloutState
from harnessrl.trainer.rows import merge_calls_into_rows

pytest_plugins = ["vllm_fixtures"]  # fixtures: cli_model, cli_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "search"
RUN = "search-agent"
CALLS = 3  # every call searches, so the harness stops at --max-calls
TOP_K = 2
FORCED = {"type": "function", "function": {"name": "search"}}


def load_harness():
    spec = importlib.util.spec_from_file_location("search_harness", EXAMPLE / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    return harness


def test_the_search_harness_searches_with_every_call_and_trains_as_one_row(cli_server, cli_model,
                                                                           tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cli_model)
    stop = str(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    quote = str(tokenizer.encode('"')[0])
    # The string's end weighted a little, so a query is a few tokens; the answer ends after the call.
    sampling = {"temperature": 1.0, "seed": 7, "logit_bias": {stop: 100, quote: 6}}
    task = json.loads((EXAMPLE / "tasks.jsonl").read_text().splitlines()[0])
    rollout = f"agent-{task['id']}"  # harness_modes.run_mode's name for it
    with proxy_in_front(cli_server, tmp_path, RUN, sampling, reward_token=TOKEN) as (store, proxy):
        store.add_tasks(RUN, [task])
        store.create_rollout(RUN, task["id"], 0, rollout_id=rollout)
        store.transition(rollout, 0, RolloutState.RUNNING, policy_version=0)
        harness_modes.run_mode(EXAMPLE, ["search", "verify"], RUN, "agent", [task], proxy, tmp_path,
                               timeout_s=300, args=["--max-calls", str(CALLS), "--forced-searches", str(CALLS),
                                                    "--max-tokens", "256", "--top-k", str(TOP_K)])
        proxy.flush(60)
        calls = store.read_calls(rollout, 0)
        stored = store.rollout_calls(rollout, 0)
        attempt = store.get_attempt(rollout, 0)

    assert len(calls) == CALLS
    assert all(call.status is CallStatus.OK and call.finish_reason == "stop"
               and len(call.logprobs) == len(call.completion_token_ids) > 0 for call in calls)
    assert all([tool["function"]["name"] for tool in call.request["tools"]] == ["search"]
               and call.request["tool_choice"] == FORCED for call in calls)
    # Each query the model wrote (as the proxy stored it) was searched, and the index's answer, under the
    # call's id, is the last message of the next call's prompt.
    harness, index = load_harness(), SearchIndex.from_file(EXAMPLE / "corpus.jsonl")
    tool_calls = [call.response["choices"][0]["message"]["tool_calls"] for call in calls]
    assert all(len(made) == 1 and made[0]["function"]["name"] == "search" for made in tool_calls)
    for before, after in zip(tool_calls, calls[1:]):
        arguments = before[0]["function"]["arguments"]
        assert isinstance(json.loads(arguments)["query"], str)
        assert after.request["messages"][-1] == {"role": "tool", "tool_call_id": before[0]["id"],
                                                 "content": harness.search_result(index, arguments, TOP_K)}
    roles = [message["role"] for message in calls[-1].request["messages"]]
    assert roles == ["system", "user", *["assistant", "tool"] * (CALLS - 1)]
    # The learner's merge: one row, the last call's whole conversation, each call's completion trained with
    # the log-probs it was sampled with.
    rows = merge_calls_into_rows(stored)
    assert rows.stats.rows == len(rows.rows) == 1
    assert rows.stats.kept_calls == rows.stats.merged_calls + 1 == CALLS
    row = rows.rows[0]
    last = calls[-1]
    assert row.input_ids.tolist() == last.prompt_token_ids + last.completion_token_ids
    assert row.call_ids == tuple(call.call_id for call in calls)
    spans = [row.input_ids[start:end].tolist() for start, end in row.completion_spans]
    assert spans == [call.completion_token_ids for call in calls]
    trained = row.loss_mask.astype(bool)
    assert trained.sum() == sum(len(call.completion_token_ids) for call in calls)
    sampled = np.concatenate([call.logprobs for call in calls])
    np.testing.assert_allclose(row.rollout_logprobs[trained], sampled, rtol=0, atol=1e-6)
    # The verifier's reward, posted with its token: the answer is the last reply's text, empty.
    assert attempt.reward == 0.0 and attempt.reward_info["answered"] is True
    assert attempt.reward_info["gold"] == task["data"]["answer"] and attempt.reward_info["answer"] == ""
    assert (tmp_path / "rollouts" / f"{rollout}-a0" / "answer.txt").read_text() == ""
