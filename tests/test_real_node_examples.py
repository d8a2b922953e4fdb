"""The search and coding examples' cluster halves on the real node, as a user applies them: the chart (installed as
test_real_node_e2e.py installs it, from the images built from images/), then each example's
trainingrun-cluster.yaml: its tiny-model Job, its tasks ConfigMap and its TrainingRun, for 1 step, twice.

- As written (the agent, the tiny random model): the harness pods' calls are captured with their token ids, and
  each rollout's reward is the verifier's (its info names what it checked), posted from the pod's verifier
  container after the harness ran to completion; the run ends Succeeded.
- With ``--mode oracle`` (the known fix applied; the scripted two searches): every rollout's reward is 1, so the
  verifier ran on the tree or answer the harness left, in the pod, and scored it; the run ends Succeeded.

Slow (vLLM and a learner on 2 cores, four runs): 1 step of few rollouts each."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import yaml
from test_real_node_e2e import (  # noqa: F401 - the chart installed as the end-to-end test installs it
    ROOT,
    TEAM,
    diagnose,
    installed,
    store_url,
    wait_succeeded,
)

from harnessrl.devcluster import Cluster
from harnessrl.store import TraceStore

pytestmark = [
    pytest.mark.real_node,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("HARNESSRL_TEST_EXAMPLES") != "1",
        reason="set HARNESSRL_TEST_EXAMPLES=1 (four runs, each starting vLLM and a learner on the node: about 20 "
        "minutes, which CI's hour has no room for beside the end-to-end run)",
    ),
]

VERIFIED = {"search": "exact_match", "swe": "fail_to_pass"}
"""A key of each verifier's reward info: the reward came from the verifier, not from the harness."""
AGENT_ARGS = {"search": ["--max-calls", "2"], "swe": ["--step-limit", "2"]}
"""Fewer calls than the examples' own settings (the tiny model's calls are long): still several per rollout."""


@pytest.fixture(scope="module")
def namespace(installed: Cluster) -> str:  # noqa: F811
    installed.kubectl("create", "namespace", TEAM)
    return TEAM


def prepared(cluster: Cluster, example: str) -> dict[str, Any]:
    """The example's tasks ConfigMap, claims and tiny model (its Job); returns its TrainingRun."""
    folder = ROOT / "examples" / example
    cluster.kubectl("create", "configmap", f"{example}-tasks", "-n", TEAM,
                    f"--from-file=tasks.jsonl={folder / 'tasks.jsonl'}")
    *prepare, run = yaml.safe_load_all((folder / "trainingrun-cluster.yaml").read_text())
    cluster.kubectl("apply", "-n", TEAM, "-f", "-", input=yaml.safe_dump_all(prepare))
    done = cluster.kubectl("wait", "-n", TEAM, "--for=condition=complete", f"job/{example}-tiny-model",
                           "--timeout=600s", check=False, timeout=660)
    assert done.returncode == 0, done.stderr + diagnose(cluster)
    return run


def one_step(cluster: Cluster, run: dict[str, Any], name: str, args: list[str], tasks: int) -> list[Any]:
    """The run as ``name`` for 1 step of ``tasks`` tasks x 2 with the harness's args extended; its attempts once
    it Succeeded."""
    run = json.loads(json.dumps(run))
    run["metadata"]["name"] = name
    run["spec"]["harness"]["args"] = [*run["spec"]["harness"]["args"], *args]
    run["spec"]["harness"]["groupSize"] = 2
    run["spec"]["learner"].update(steps=1, tasksPerStep=tasks, checkpointDir=f"/checkpoints/{name}")
    cluster.kubectl("apply", "-n", TEAM, "-f", "-", input=json.dumps(run))
    status = wait_succeeded(cluster, name)
    assert status["step"] == 1, status
    store = TraceStore.connect(store_url(cluster))
    try:
        attempts = [a for a in store.list_attempts(name) if a.state.value == "succeeded"]
        calls = {(a.rollout_id, a.attempt): store.read_calls(a.rollout_id, a.attempt) for a in attempts}
    finally:
        store.close()
    # Its vLLM and learner go, so the next run has the node's 2 cores; what it stored stays in the store.
    cluster.kubectl("delete", "tr", name, "-n", TEAM, "--wait=true", "--timeout=300s", check=False, timeout=360)
    assert len(attempts) >= tasks * 2, (attempts, diagnose(cluster))
    return [(a, calls[(a.rollout_id, a.attempt)]) for a in attempts]


@pytest.mark.parametrize("example", ["search", "swe"])
def test_the_example_runs_through_the_operator_with_verifier_rewards(namespace: str, example: str,
                                                                     installed: Cluster) -> None:  # noqa: F811
    cluster = installed
    run = prepared(cluster, example)

    agent = one_step(cluster, run, f"{example}-agent", AGENT_ARGS[example], tasks=1)
    for attempt, calls in agent:
        assert calls, f"{attempt.rollout_id}: no call captured"
        for call in calls:
            assert call.prompt_token_ids and call.completion_token_ids, call.call_id
            assert len(call.logprobs) == len(call.completion_token_ids), call.call_id
        assert attempt.reward is not None and VERIFIED[example] in (attempt.reward_info or {}), attempt

    oracle = one_step(cluster, run, f"{example}-oracle", ["--mode", "oracle"], tasks=2)
    rewards = {attempt.rollout_id: (attempt.reward, attempt.reward_info) for attempt, _ in oracle}
    assert all(reward == 1.0 and VERIFIED[example] in info for reward, info in rewards.values()), rewards
