"""Claude Code and Codex CLI, unchanged, through the capture proxy: what each call became (issue 26's report).

Runs the pinned CLIs (``scripts/harness-clis.sh``) headless, as ``tests/test_harness_clis.py`` does and with its
driver (``tests/harness_cli_driver.py``: the sandbox as an unprivileged user, executing tools off, no
permission-bypass flag, the random model steered through the proxy's sampling override), against vLLM on the
CPU with the tiny model (64k context, hermes tools, arguments pinned to their schemas) behind a train-mode proxy
with its default settings (keep-alives after 5 s). A logging pass-through sits between each CLI and the proxy,
as in the issue: every request the CLI made, its status, and the time to the first byte of the answer the CLI
read. Scenarios:

* ``codex-resume``: ``codex exec``, then ``codex exec resume --last``, every answer empty;
* ``codex-tools``: ``codex exec`` with a tool call forced on every answer, stopped after ``--codex-calls`` calls;
* ``codex-agents``: Codex's ``spawn_agent`` twice a turn, stopped once the session and two sub-agents each
  recorded two turns;
* ``claude-continue``: ``claude -p`` for 3 turns of forced tool calls, then ``--continue`` for 2 more;
* ``claude-agents``: ``claude -p`` whose 2 turns each start a sub-agent (Agent tool) that reads twice;
* ``claude-long``: ``claude -p`` then ``--continue``, no tools, every answer ``--tokens`` tokens of text (the
  stop token banned, the length forced): Claude Code goes on after an answer cut at its length, so a few calls
  each; long answers are where the time to the first byte matters.

Per scenario: the calls the CLI made (pass-through), stored (all, and answered), refused by the proxy and why
(``harnessrl_proxy_refused_total`` and ``..._upstream_failures_total`` by reason, and any answer other than 200
the CLI got), training rows against the CLI's conversations (the session's and each sub-agent's, from the CLI's
own transcripts), the token ratio (tokens of the training rows / tokens of the conversations' final calls: 1.00
when every conversation became one row), the answered calls whose every completion token has a log-prob, the
calls whose stored tokens spell exactly the tool calls the CLI recorded, and the time to the first byte of its
streamed answers (median and range) and to their end.

    timeout 3000 .venv/bin/python bench/harness_clis.py                  # starts vLLM (about a minute)
    .venv/bin/python bench/harness_clis.py --vllm-url URL --model DIR    # a running server on that model

Measured 2026-12-06 (2-core machine, about 5 min): every call the CLIs made stored, none refused, one row per
conversation (3 with sub-agents) at 1.00-1.01x, every answered call with its log-probs, every recorded tool call
spelled by the stored tokens; first byte 0.28-0.49 s (median) for tool calls, 0.31 s (0.20-5.40) for 4,000-token
answers, relayed as generated (at ce1239d, load 16-19: 0.3-0.75 s, and 5.5 s (5.05-10.0) for the long answers,
replayed because of Claude Code's ``output_config.effort``, their keep-alive clock started after planning). The
README has the table.

Last line: ``name=value`` pairs per scenario. The issue's "before" (its text, and the README's table): Codex
every call malformed, 0 log-probs, 18 calls stored 0 rows (exec + resume 2 rows, 1.85x); Claude Code 15 of 37
calls empty to the harness, 3 turns + --continue 12 calls refused (a ``system`` message), first byte 30-62 s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness_cli_driver import (  # noqa: E402
    LoggingPassThrough,
    Sandbox,
    agent_first,
    answered_calls,
    as_called,
    claude_subagents,
    claude_tool_uses,
    claude_transcripts,
    claude_turns_and_continue,
    codex_exec_resume,
    codex_function_calls,
    codex_subagents,
    codex_tool_calls,
    installed_clis,
    metrics,
    sampled_calls,
    spawning,
    steering,
    stored_calls,
    token_ratio,
)


@dataclass
class Outcome:
    """What a scenario left: the calls each conversation of the CLI's made (stored call ids, in order; None: one
    conversation, every answered call) and the tool calls the CLI recorded, per answered call id."""

    conversations: list[list[str]] | None
    received: dict[str, list[dict[str, Any]]]


Scenario = Callable[[Any, dict[str, Path], list[Sandbox], str, str, Any], Outcome]


def stored_ok(proxy, store, rollout: str) -> list[Any]:
    return [c for c in stored_calls(proxy, store, rollout, 0) if c.status.value == "ok"]


def codex_threads(box: Sandbox, done: list[Any]) -> Outcome:
    """Each Codex thread's calls and what it recorded, matched by the call ids in the stored answers."""
    call_of = {item["call_id"]: c.call_id for c in done for item in (c.response or {}).get("output", [])
               if item.get("type") == "function_call"}
    threads = codex_function_calls(box)
    received: dict[str, list[dict[str, Any]]] = {}
    for got in (got for thread in threads for got in thread if got["call_id"] in call_of):
        received.setdefault(call_of[got["call_id"]], []).append(as_called(got))
    conversations = [list(dict.fromkeys(call_of[g["call_id"]] for g in t if g["call_id"] in call_of)) for t in threads]
    return Outcome(conversations if len(threads) > 1 else None, received)


def long_answer(tokenizer, tokens: int) -> dict[str, Any]:
    """Every answer ``tokens`` tokens of text: the stop token banned, the length forced (no structured output,
    which would keep the call on the replay path, ``proxy/served_stream.py``)."""
    return {"temperature": 1.0, "logit_bias": {str(tokenizer.convert_tokens_to_ids("<|im_end|>")): -100},
            "max_tokens": tokens}


def make_scenarios(calls: int, tokens: int = 0
                   ) -> dict[str, tuple[str, Callable[[Any], dict[str, Any]], Scenario]]:
    """Name: (route, the sampling override for a tokenizer, the run)."""

    def codex_resume(proxy, clis, boxes, url, rollout, store) -> Outcome:
        for run in codex_exec_resume(clis, boxes, url, rollout):
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        return Outcome(None, {})

    def codex_tools(proxy, clis, boxes, url, rollout, store) -> Outcome:
        box = codex_tool_calls(clis, boxes, url, rollout, lambda: len(stored_ok(proxy, store, rollout)) >= calls)
        return codex_threads(box, stored_ok(proxy, store, rollout))

    def codex_agents(proxy, clis, boxes, url, rollout, store) -> Outcome:
        box = codex_subagents(clis, boxes, url, rollout)
        return codex_threads(box, stored_ok(proxy, store, rollout))

    def claude_continue(proxy, clis, boxes, url, rollout, store) -> Outcome:
        box, _ = claude_turns_and_continue(clis, boxes, url, rollout)
        done = stored_ok(proxy, store, rollout)
        return Outcome(None, {c.call_id: [got] for c, got in zip(done, claude_tool_uses(box), strict=False)})

    def claude_long(proxy, clis, boxes, url, rollout, store) -> Outcome:
        claude_turns_and_continue(clis, boxes, url, rollout, tools="", turns=(1, 1))
        return Outcome(None, {})

    def claude_agents(proxy, clis, boxes, url, rollout, store) -> Outcome:
        box, _ = claude_subagents(clis, boxes, url, rollout)
        call_of = {c.response["id"]: c.call_id for c in stored_ok(proxy, store, rollout)}
        transcripts = claude_transcripts(box)
        received = {call_of[i]: [{"name": b["name"], "arguments": b["input"]} for b in blocks
                                 if b.get("type") == "tool_use"]
                    for t in transcripts for i, blocks in t.items() if i in call_of}
        return Outcome([[call_of[i] for i in t if i in call_of] for t in transcripts], received)

    return {
        "codex-resume": ("responses", lambda tok: steering(tok)[0], codex_resume),
        "codex-tools": ("responses", lambda tok: steering(tok)[1], codex_tools),
        "codex-agents": ("responses", lambda tok: spawning(tok, "read calc.py"), codex_agents),
        "claude-continue": ("messages", lambda tok: steering(tok)[1], claude_continue),
        "claude-agents": ("messages", agent_first, claude_agents),
        "claude-long": ("messages", lambda tok: long_answer(tok, tokens), claude_long),
    }


def labelled(exposition: str, family: str) -> dict[str, float]:
    """The samples of one counter family, as ``route/status/code`` -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {"/".join(s.labels.values()): s.value for f in text_string_to_metric_families(exposition)
            for s in f.samples if s.name == family + "_total" and s.value}


def measure(name: str, route: str, outcome: Outcome, relay: LoggingPassThrough, proxy: Any, store: Any,
            rollout: str, tokenizer: Any) -> dict[str, Any]:
    """The scenario's figures, from the pass-through, the proxy's metrics and the store."""
    from harnessrl.trainer.rows import merge_calls_into_rows

    made = relay.settle()
    text = metrics(proxy)
    calls = stored_calls(proxy, store, rollout, answered_calls(text, route))
    done = [c for c in calls if c.status.value == "ok"]
    by_id = {c.call_id: c for c in done}
    rows = merge_calls_into_rows(store.rollout_calls(rollout, 0)).rows
    spelled = 0
    for call_id, got in outcome.received.items():
        try:
            spelled += sampled_calls(tokenizer, by_id[call_id]) == got
        except (AssertionError, ValueError):
            pass
    streamed = [x for x in made if x.streamed and x.first_byte_s is not None]
    firsts = sorted(x.first_byte_s for x in streamed)
    ends = sorted(x.total_s for x in streamed if not x.left)
    not_ok = [f"{x.status}{' (left)' if x.left else ''} {x.method} {x.path}" for x in made if x.status != 200]
    refused = {**labelled(text, "harnessrl_proxy_refused"),
               **{f"upstream {k}": v for k, v in labelled(text, "harnessrl_proxy_upstream_failures").items()}}
    return {
        "scenario": name, "made": len(made), "stored": len(calls), "answered": len(done),
        "refused": int(sum(refused.values())), "why": refused, "not_200": not_ok,
        "conversations": len(outcome.conversations or [done]), "rows": len(rows),
        "token_ratio": token_ratio(rows, done, outcome.conversations),
        "logprob_calls": sum(len(c.logprobs) == len(c.completion_token_ids) > 0 for c in done),
        "spelled": spelled, "recorded": len(outcome.received),
        "ttfb_median_s": statistics.median(firsts) if firsts else float("nan"),
        "ttfb_min_s": firsts[0] if firsts else float("nan"), "ttfb_max_s": firsts[-1] if firsts else float("nan"),
        "end_median_s": statistics.median(ends) if ends else float("nan"),
        "answers": " ".join(f"{x.first_byte_s:.1f}/{x.total_s:.1f}/{x.chunks}" for x in streamed),
        "continuity": labelled(text, "harnessrl_proxy_token_continuity"),
        "streams": labelled(text, "harnessrl_proxy_streams"),
    }


def table(results: list[dict[str, Any]]) -> str:
    head = ("| scenario | calls made / stored / answered | refused (why) | rows / conversations | token ratio "
            "| calls with log-probs | tokens spell what the CLI got | first byte, median (range) "
            "| answer end, median |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        why = ", ".join(f"{k}: {v:g}" for k, v in r["why"].items()) or "-"
        lines.append(
            f"| {r['scenario']} | {r['made']} / {r['stored']} / {r['answered']} | {r['refused']} ({why}) "
            f"| {r['rows']} / {r['conversations']} | {r['token_ratio']:.2f} | {r['logprob_calls']} / {r['answered']} "
            f"| {r['spelled']} / {r['recorded']} | {r['ttfb_median_s']:.2f} s ({r['ttfb_min_s']:.2f}-"
            f"{r['ttfb_max_s']:.2f}) | {r['end_median_s']:.2f} s |")
    return "\n".join(lines)


def main() -> None:
    scenarios_of = make_scenarios(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(scenarios_of), help="scenarios, comma-separated")
    parser.add_argument("--codex-calls", type=int, default=20, help="answered calls before codex-tools is stopped")
    parser.add_argument("--tokens", type=int, default=4000, help="tokens of each claude-long answer")
    parser.add_argument("--vllm-url", help="a running server (STRICT_TOOL_SERVER_ARGS, 64k, served as 'tiny')")
    parser.add_argument("--model", type=Path, help="with --vllm-url: the model directory it serves")
    args = parser.parse_args()
    scenarios = make_scenarios(args.codex_calls, args.tokens)
    names = args.only.split(",")

    from proxy_servers import LoopThread
    from transformers import AutoTokenizer
    from vllm_fixtures import LONG_MAX_MODEL_LEN, SERVED_NAME, STRICT_TOOL_SERVER_ARGS, proxy_in_front

    from harnessrl.local.vllm_server import VllmServer, start_vllm
    from harnessrl.tiny_model import TinyModelConfig, build_tiny_model

    clis = installed_clis()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.vllm_url:
            model, server = args.model, VllmServer(args.vllm_url.rstrip("/"), SERVED_NAME, args.model, None)
        else:
            model = build_tiny_model(Path(tmp) / "model",
                                     TinyModelConfig(max_position_embeddings=LONG_MAX_MODEL_LEN))
            server = start_vllm(model, Path(tmp) / "vllm" / "vllm.log", served_name=SERVED_NAME,
                                max_model_len=LONG_MAX_MODEL_LEN, extra_args=STRICT_TOOL_SERVER_ARGS,
                                timeout_s=900, cpu=True)
        tokenizer = AutoTokenizer.from_pretrained(model)
        relay_loop = LoopThread()
        try:
            for name in names:
                route, sampling, run = scenarios[name]
                work = Path(tmp) / name
                work.mkdir()
                boxes: list[Sandbox] = []
                with proxy_in_front(server, work, name, sampling(tokenizer)) as (store, proxy):
                    relay = LoggingPassThrough(relay_loop, proxy.url)
                    try:
                        outcome = run(proxy, clis, boxes, relay.url, name, store)
                        results.append(measure(name, route, outcome, relay, proxy, store, name, tokenizer))
                    finally:
                        relay.stop()
                        for box in boxes:
                            box.remove()
                r = results[-1]
                print(f"{name}: {r['made']} calls made, not 200: {r['not_200'] or 'none'}; streamed answers "
                      f"(first byte s / end s / reads) {r['answers']}; continuity {r['continuity']}; streams {r['streams']}", flush=True)
        finally:
            relay_loop.close()
            if server.process is not None:
                server.stop()
    print(table(results))
    print(" ".join(f"{r['scenario']}_{key}={r[key]:.2f}" if isinstance(r[key], float) else
                   f"{r['scenario']}_{key}={r[key]}"
                   for r in results for key in ("made", "stored", "refused", "rows", "conversations", "token_ratio",
                                                "logprob_calls", "spelled", "ttfb_median_s", "ttfb_max_s")))


if __name__ == "__main__":
    main()
