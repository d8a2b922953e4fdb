"""Claude Code and Codex CLI, unchanged, through the proxy on the real vLLM: every call trainable (issue 26).

The CLIs are the npm packages ``@anthropic-ai/claude-code`` and ``@openai/codex`` at the versions
``scripts/harness-clis.sh`` pins (it installs them into ``~/.cache/harnessrl``; scripts/test.sh runs it, and so
does the ``clis`` fixture, which is instant once they are there). Each runs headless:

* as an unprivileged user (``nobody`` when the tests run as root) in a throwaway directory holding its home,
  its working directory and a copy of its binary, with only the environment it is given;
* with its tools that execute disabled (Claude Code: ``--disallowedTools`` for Bash, Edit, Write and the
  rest; Codex: the ``shell_tool`` and ``unified_exec`` features off, read-only sandbox), never with a
  permission-bypass flag;
* against a vLLM server on the tiny model with a 64k context (Claude Code's prompt is about 29k tokens of the
  tiny tokenizer, Codex's 23k) and the tool flags, behind a train-mode proxy. The server pins every tool's
  argument schema (``--tool-strict-level parameter``): a forced call's arguments are valid, so the CLIs run
  the (read-only) tools they are left with, and Claude Code's Agent tool and Codex's spawn_agent start real
  sub-agents.

The random model is steered through the proxy's sampling override, as an RL run on a weak model would be:
``STOP`` (a ``logit_bias`` on the stop token: every answer is empty) for a conversation of plain turns, and
``FORCED`` (``tool_choice`` required, with biases that end the arguments' strings, objects and the answer as
soon as the grammar allows) for tool calls. The checks are the issue's: every call the CLI made (counted by a
logging pass-through between the CLI and the proxy, ``harness_cli_driver.LoggingPassThrough``) got a 200 and
is stored, every completion token has a log-prob, one training row per conversation (a sub-agent's
conversation is one of its own) of at most 1.05x its final trajectory's tokens, and the stored token ids decode
to exactly the tool calls the CLI received (read from the CLI's own transcripts). The scenarios and helpers are
``harness_cli_driver.py``'s, which ``bench/harness_clis.py`` runs too. The proxy sends its stream keep-alives after
50 ms, so both CLIs are shown to read them; a last test holds both CLIs through a generation longer than their
stream idle limits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.register_assert_rewrite("proxy_servers", "vllm_fixtures", "harness_cli_driver")
from harness_cli_driver import (
    CLI_TIMEOUT_S,
    TASK,
    LoggingPassThrough,
    Sandbox,
    agent_first,
    answered_calls,
    as_called,
    claude_env,
    claude_result,
    claude_subagents,
    claude_tool_uses,
    claude_transcripts,
    claude_turns_and_continue,
    codex_exec_resume,
    codex_function_calls,
    codex_sandbox,
    codex_subagents,
    codex_tool_calls,
    installed_clis,
    metrics,
    rows_of,
    sampled_call,
    sampled_calls,
    spawning,
    steering,
    stored_calls,
    token_ratio,
)
from proxy_servers import metric_value
from vllm_fixtures import proxy_in_front

from harnessrl.store import CallStatus, TraceStore
from harnessrl.trainer.rows import merge_calls_into_rows

pytest_plugins = ["vllm_fixtures"]

pytestmark = [pytest.mark.harness_cli]

# Every call takes longer than this, so each CLI reads its stream's keep-alive events (Anthropic's ping, SSE
# comments for Responses) before the answer, as it does on a long generation.
KEEPALIVE = {"stream_keepalive_s": 0.05}


@pytest.fixture(scope="module")
def clis() -> dict[str, Path]:
    """The pinned CLIs' native binaries (installed by scripts/harness-clis.sh, once)."""
    return installed_clis()


@pytest.fixture(scope="module")
def tokenizer(cli_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cli_model)


@pytest.fixture
def sandboxes() -> Iterator[list[Sandbox]]:
    made: list[Sandbox] = []
    yield made
    for box in made:
        box.remove()


@contextmanager
def cli_proxy(server: Any, tmp_path: Path, run: str, sampling: dict[str, Any]
              ) -> Iterator[tuple[TraceStore, Any, LoggingPassThrough]]:
    """The proxy in front of ``server`` (``sampling`` forced, keep-alives after ``KEEPALIVE``), and the logging
    pass-through in front of it that the CLI is given: it sees every request the CLI made, as the CLI did."""
    with proxy_in_front(server, tmp_path, run, sampling, **KEEPALIVE) as (store, proxy):
        relay = LoggingPassThrough(proxy.loops, proxy.url)
        try:
            yield store, proxy, relay
        finally:
            relay.stop()


def check_trainable(proxy: Any, store: TraceStore, relay: LoggingPassThrough, rollout: str, route: str,
                    conversations: int = 1) -> list[Any]:
    """Every request the CLI made (the pass-through saw) was answered 200 and is stored, none refused; every
    completed call has a log-prob per token; the completed calls are ``conversations`` training rows, each of
    at most 1.05x its final trajectory (and with one conversation, the row against the last call the CLI got).
    Returns the completed calls."""
    made = relay.settle()
    text = metrics(proxy)
    answered = answered_calls(text, route)
    calls = stored_calls(proxy, store, rollout, answered)
    seen = [line for line in text.splitlines() if line.startswith(("harnessrl_proxy_requests_total",
                                                                  "harnessrl_proxy_refused_total"))]
    seen.append(str([(c.status.value, c.http_status, c.response if c.status is not CallStatus.OK else None)
                     for c in calls])[:3000])
    seen.append(str(made)[:3000])
    assert "harnessrl_proxy_refused_total{" not in text, seen
    assert [x.status for x in made] == [200] * len(made), seen
    assert len(calls) == answered == len(made) > 0, seen
    done = [c for c in calls if c.status is CallStatus.OK]
    assert [c.route for c in done] == [route] * len(done)
    assert all(len(c.logprobs) == len(c.completion_token_ids) > 0 for c in done)
    result = merge_calls_into_rows(store.rollout_calls(rollout, 0))
    assert len(result.rows) == conversations and result.stats.kept_calls == len(done), result.stats
    by_id = {c.call_id: c for c in done}
    for row in result.rows:
        assert token_ratio([row], done, [list(row.call_ids)]) <= 1.05
    if conversations == 1:
        assert token_ratio(result.rows, done) <= 1.05
    return done


# ----------------------------------------------------------------------------------------------------- Codex


@pytest.mark.vllm
def test_codex_conversation_resumed_is_one_row(clis, cli_server, tokenizer, tmp_path, sandboxes):
    """``codex exec`` then ``codex exec resume --last``: every call is served as a chat completion (Codex's
    client_metadata, reasoning, encrypted reasoning, namespace and web_search tools decided, the drops counted),
    and the resumed call continues the first one's tokens."""
    stop, _ = steering(tokenizer)
    with cli_proxy(cli_server, tmp_path, "codex", stop) as (store, proxy, relay):
        for run in codex_exec_resume(clis, sandboxes, relay.url, "codex-conversation"):
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        done = check_trainable(proxy, store, relay, "codex-conversation", "responses")
        assert len(done) == 2
        text = metrics(proxy)
        assert metric_value(text, "harnessrl_proxy_token_continuity_total", outcome="used") == 1
        for field in ("client_metadata", "reasoning.summary", "tools.web_search"):
            assert metric_value(text, "harnessrl_proxy_dropped_fields_total", route="responses", field=field) == 2


@pytest.mark.vllm
def test_codex_forced_tool_calls_are_trainable_and_what_it_received(clis, cli_server, tokenizer, tmp_path, sandboxes):
    """Tool calls forced on every turn: Codex runs its tools and goes on for ever, so it is stopped after a few
    calls (``codex_tool_calls``). Each stored completion spells the function call Codex recorded."""
    _, forced = steering(tokenizer)
    with cli_proxy(cli_server, tmp_path, "codex", forced) as (store, proxy, relay):
        box = codex_tool_calls(clis, sandboxes, relay.url, "codex-tools", lambda: (metric_value(
            metrics(proxy), "harnessrl_proxy_calls_total", route="responses", status="ok") or 0) >= 4)
        done = check_trainable(proxy, store, relay, "codex-tools", "responses")
        (received,) = codex_function_calls(box)
        assert len(received) >= len(done) - 1 >= 3  # the last answer may not have reached the transcript
        for call, got in zip(done, received, strict=False):
            assert sampled_call(tokenizer, call) == as_called(got)


# ----------------------------------------------------------------------------------------------- Claude Code


@pytest.mark.vllm
def test_claude_code_forced_tool_calls_and_continue_are_one_row(clis, cli_server, tokenizer, tmp_path, sandboxes):
    """``claude -p`` with tool calls forced for 3 turns (``--max-turns``), then ``--continue`` for 2 more: one row,
    every completion spelling the tool_use Claude Code recorded, its input as generated, and usage.input_tokens
    the prompt's length. Its tools are Read, Glob and Grep (the Agent tool starts sub-agents: the next test)."""
    _, forced = steering(tokenizer)
    with cli_proxy(cli_server, tmp_path, "claude", forced) as (store, proxy, relay):
        box, runs = claude_turns_and_continue(clis, sandboxes, relay.url, "claude-tools")
        for run in runs:
            assert claude_result(run)["subtype"] == "error_max_turns", run.stdout[-3000:] + run.stderr[-2000:]
        done = check_trainable(proxy, store, relay, "claude-tools", "messages")
        assert len(done) == 5
        received = claude_tool_uses(box)
        assert len(received) == len(done)
        for call, got in zip(done, received, strict=True):
            assert sampled_call(tokenizer, call) == got
            assert call.response["usage"]["input_tokens"] == len(call.prompt_token_ids)


@pytest.mark.vllm
def test_claude_code_subagents_are_rows_of_their_own(clis, cli_server, tokenizer, tmp_path, sandboxes):
    """Claude Code's Agent tool: the model calls it on both of its turns (``agent_first``; its tools are Agent and
    Read), each call runs a sub-agent (in the foreground: CLAUDE_CODE_DISABLE_BACKGROUND_TASKS) whose own
    conversation, its prompt and tools its own, makes two forced Read calls in the same rollout. The rollout's
    calls are three training rows, and each row is exactly the calls of one of Claude Code's transcripts (the
    session's and one per sub-agent), matched by the message ids Claude Code recorded; every completion spells
    the tool call that transcript recorded."""
    with cli_proxy(cli_server, tmp_path, "claude", agent_first(tokenizer)) as (store, proxy, relay):
        box, run = claude_subagents(clis, sandboxes, relay.url, "claude-agents")
        result = claude_result(run)
        assert result["subtype"] == "error_max_turns", run.stdout[-3000:] + run.stderr[-2000:]
        assert result["subagent_stats"]["completed"] == 2, result["subagent_stats"]
        done = check_trainable(proxy, store, relay, "claude-agents", "messages", conversations=3)
        transcripts = claude_transcripts(box)
        assert sorted(len(t) for t in transcripts) == [2, 2, 2]  # the session, two sub-agents
        call_of = {c.response["id"]: c for c in done}
        assert len(call_of) == len(done) == 6
        conversations = sorted(tuple(call_of[i].call_id for i in t) for t in transcripts)
        assert conversations == sorted(rows_of(store, "claude-agents"))
        for transcript in transcripts:
            for message_id, blocks in transcript.items():
                [got] = [b for b in blocks if b.get("type") == "tool_use"]
                assert sampled_call(tokenizer, call_of[message_id]) == {"name": got["name"], "arguments": got["input"]}
        names = sorted([b["name"] for blocks in t.values() for b in blocks if b.get("type") == "tool_use"]
                       for t in transcripts)
        assert names == [["Agent", "Agent"], ["Read", "Read"], ["Read", "Read"]]


# -------------------------------------------------------------------------------------- a slow generation


def test_both_clis_read_the_keepalives_of_a_slow_generation(clis, tmp_path, sandboxes):
    """A generation longer than each CLI's stream idle limit: both wait for it, one request each, because the
    proxy's keep-alives are events their idle timers count (Codex's does not count SSE comments: it gave up
    on them, then retried, so that a call slower than its idle limit became several requests; with its
    default limit of 300 s, which a CLI call reached under load). The upstream is the fake vLLM answering
    after ``SLOW_S``, beyond both limits (Codex's set to 5 s, Claude Code's byte watchdog to its 10 s
    minimum), so no model is needed; the CLIs run at once."""
    from proxy_servers import LoopThread, RunningProxy, RunningUpstream, proxy_config

    from harnessrl.proxy.fake_upstream import FakeUpstream

    slow_s = 12.0
    loops = LoopThread()
    fake = FakeUpstream()
    fake.response_delay_s, fake.finish_reason = slow_s, "stop"
    upstream = RunningUpstream(loops, fake)
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = TraceStore.connect(store_url)
    store.upgrade()
    proxy = RunningProxy(loops, proxy_config([upstream.url], store_url, tmp_path / "spool", rollout_id=None,
                                             run="slow", stream_keepalive_s=0.2), store)
    try:
        codex, env = codex_sandbox(clis, sandboxes, proxy.url, "codex-slow", provider=(
            "stream_idle_timeout_ms = 5000\nstream_max_retries = 0\nrequest_max_retries = 0"))
        claude = Sandbox.create(clis["claude"])
        sandboxes.append(claude)
        started = [codex.start("codex", ["exec", "--skip-git-repo-check", TASK], env),
                   claude.start("claude", ["-p", TASK, "--model", "tiny", "--tools", "", "--max-turns", "1"],
                                {**claude_env(f"{proxy.url}/rollouts/claude-slow/attempts/0"),
                                 "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "10000"})]
        outputs = [process.communicate(timeout=CLI_TIMEOUT_S)[0] for process in started]
        assert [process.returncode for process in started] == [0, 0], [out[-2000:] for out in outputs]
        proxy.flush(60)
        text = metrics(proxy)
        for rollout, route in (("codex-slow", "responses"), ("claude-slow", "messages")):
            assert metric_value(text, "harnessrl_proxy_requests_total", route=route, status="200") == 1, text
            assert metric_value(text, "harnessrl_proxy_requests_total", route=route, status="499") is None
            assert [c.status for c in store.read_calls(rollout, 0)] == [CallStatus.OK]
    finally:
        proxy.stop()
        upstream.stop()
        loops.close()
        store.close()



@pytest.mark.vllm
def test_codex_subagents_are_rows_of_their_own(clis, cli_server, tokenizer, tmp_path, sandboxes):
    """Codex's multi_agent tools: the model calls ``spawn_agent`` twice on every turn (``spawning``), one task for
    all, and Codex runs each sub-agent as a thread of its own, at once, through the same provider, so in the
    same rollout (two at most: ``agents.max_threads``; at the default depth limit a sub-agent has no multi_agent
    tools, so its own spawn_agent calls are answered "unsupported call" and it goes on). The two sub-agents
    start together with equal first prompts (their task, their tools), so the second looks like a retry of the
    first (``trainer/rows.py``). Stopped once each thread recorded two turns: every call is stored with its
    log-probs, the calls are three training rows, each exactly one thread's calls (matched by the call ids
    Codex recorded), and every completion spells the calls its thread recorded."""
    with cli_proxy(cli_server, tmp_path, "codex", spawning(tokenizer, "read calc.py")) as (store, proxy, relay):
        box = codex_subagents(clis, sandboxes, relay.url, "codex-agents")
        threads = codex_function_calls(box)
        assert len(threads) == 3
        done = check_trainable(proxy, store, relay, "codex-agents", "responses", conversations=3)
        call_of = {item["call_id"]: c for c in done for item in c.response["output"] if item["type"] == "function_call"}
        rows = {row[0]: row for row in rows_of(store, "codex-agents")}
        for thread in threads:
            turns = tuple(dict.fromkeys(call_of[got["call_id"]].call_id for got in thread))
            # the row is the thread's calls (then any answer it had not recorded when Codex was stopped)
            assert rows[turns[0]][: len(turns)] == turns
            for call in {call_of[got["call_id"]].call_id: call_of[got["call_id"]] for got in thread}.values():
                assert sampled_calls(tokenizer, call) == [
                    as_called(got) for got in thread if call_of[got["call_id"]] is call]
        assert [got["name"] for got in threads[0]][:2] == ["spawn_agent"] * 2  # the session's own, namespaced
