"""Token continuity is on when the spec asks for it (issue 22, item 14): a ``rollout.args`` naming a tool-call
or reasoning parser gets ``--enable-scale-out`` from ``harnessrl run`` and the operator alike
(``policy_serving.continuity_flags``), once, and no other spec gets it; a proxy whose server cannot continue
calls says so once, with the fix, and counts the calls that fell back."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import httpx
import pytest
import yaml

from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.render_rollout import render_rollout_deployment
from harnessrl.policy_serving import continuity_flags
from harnessrl.spec.problems import parse_training_run

pytest.register_assert_rewrite("proxy_servers")
from proxy_servers import metric_value

pytest_plugins = ["proxy_servers"]  # fixtures: loops, upstream, make_proxy

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("args", "added"), [
    (["--tool-call-parser", "hermes", "--enable-auto-tool-choice"], ["--enable-scale-out"]),
    (["--reasoning-parser=deepseek_r1"], ["--enable-scale-out"]),
    (["--enable-scale-out", "--tool-call-parser", "hermes"], []),
    (["--enable-auto-tool-choice"], []),
    (["--max-num-seqs", "8"], []),
    ([], []),
])
def test_a_named_parser_brings_scale_out(args, added):
    assert continuity_flags(args) == added


def test_the_operator_serves_a_parser_spec_with_scale_out_once():
    doc = yaml.safe_load((ROOT / "examples" / "trainingrun-cluster.yaml").read_text())

    def served_args(rollout_args: list[str]) -> list[str]:
        changed = copy.deepcopy(doc)
        changed["spec"].setdefault("rollout", {})["args"] = rollout_args
        run = parse_training_run(changed)
        pod = render_rollout_deployment(run, "team-a", "uid", OperatorConfig())["spec"]["template"]["spec"]
        return pod["containers"][0]["args"]

    args = served_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.count("--enable-scale-out") == 1 and args[-1] == "--enable-scale-out"
    assert served_args(["--enable-scale-out", "--reasoning-parser", "qwen3"]).count("--enable-scale-out") == 1
    assert "--enable-scale-out" not in served_args([])


def test_a_configuration_fallback_is_logged_once_with_the_fix_and_counted(upstream, make_proxy, store, caplog):
    """A server without /tokenize (the fake upstream) cannot continue any call: the proxy says so once, with
    the fix, and counts every call that fell back."""
    proxy = make_proxy([upstream.url], rollout_id=None, token_continuity=True)
    with caplog.at_level(logging.WARNING, logger="harnessrl.proxy.continuity"):
        for rollout in ("a", "b"):
            messages = [{"role": "user", "content": "hi"}]
            for _ in range(2):
                url = f"{proxy.url}/rollouts/{rollout}/attempts/0/v1/chat/completions"
                reply = httpx.post(url, json={"model": "m", "messages": messages, "max_tokens": 2}, timeout=30)
                messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "go on"}]
    told = [r.getMessage() for r in caplog.records if "tokenize_unsupported" in r.getMessage()]
    assert len(told) == 1 and "no /tokenize" in told[0] and "--no-token-continuity" in told[0]
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert metric_value(metrics, "harnessrl_proxy_token_continuity_total", outcome="tokenize_unsupported") == 2
