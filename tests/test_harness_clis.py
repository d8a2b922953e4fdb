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
soon as the grammar allows) for tool calls. The checks are the issue's: every call the CLI made is stored,
every completion token has a log-prob, one training row per conversation (a sub-agent's conversation is one of
its own) of at most 1.05x its final trajectory's tokens, and the stored token ids decode to exactly the tool
calls the CLI received (read from the CLI's own transcripts). The proxy sends its stream keep-alives after
50 ms, so both CLIs are shown to read them; a last test holds both CLIs through a generation longer than their
stream idle limits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.register_assert_rewrite("proxy_servers", "vllm_fixtures")
from proxy_servers import metric_value
from vllm_fixtures import proxy_in_front

from harnessrl.store import CallStatus, TraceStore
from harnessrl.trainer.rows import merge_calls_into_rows

pytest_plugins = ["vllm_fixtures"]

pytestmark = [pytest.mark.harness_cli]

ROOT = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 600
# Claude Code's tools that execute or reach out; what is left reads (Read, Glob, Grep) or plans (Agent, ...).
CLAUDE_DISALLOWED = "Bash Edit Write NotebookEdit WebFetch WebSearch KillShell BashOutput"
TASK = "fix the bug in calc.py"
# Every call takes longer than this, so each CLI reads its stream's keep-alive events (Anthropic's ping, SSE
# comments for Responses) before the answer, as it does on a long generation.
KEEPALIVE = {"stream_keepalive_s": 0.05}


@pytest.fixture(scope="module")
def clis() -> dict[str, Path]:
    """The pinned CLIs' native binaries (installed by scripts/harness-clis.sh, once)."""
    done = subprocess.run([str(ROOT / "scripts" / "harness-clis.sh")], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"scripts/harness-clis.sh failed:\n{done.stderr[-3000:]}"
    return {name: Path(path) for name, path in (line.split(" ", 1) for line in done.stdout.splitlines())}


@pytest.fixture(scope="module")
def tokenizer(cli_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cli_model)


def steering(tokenizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sampling overrides: ``STOP`` ends every answer at once; ``FORCED`` forces a tool call whose arguments
    (valid for the tool's schema: the server pins them) end each string, number, array and object as soon as
    the grammar allows, and the answer after it (a string's end weighs most: inside a string ``0``, ``]`` and
    ``}`` are allowed too, and would make it ``"}0"``)."""
    stop = str(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    ends = {str(tokenizer.encode(text)[0]): weight for text, weight in (("0", 90), ("]", 90), ("}", 90), ('"', 100))}
    return ({"temperature": 1.0, "logit_bias": {stop: 100}},
            {"temperature": 1.0, "tool_choice": "required", "logit_bias": {stop: 100, **ends}})


def agent_first(tokenizer) -> dict[str, Any]:
    """``FORCED``, and the tokens that begin a name with "A" weighted (less than the ends), so that a forced call
    is to the Agent tool wherever the tools offer it (of Agent and Read, the names part at their first letter;
    checked offline on the server's grammar for Claude Code's tools with random logits: Agent every time, its
    input ``{"description": "", "prompt": ""}``)."""
    _, forced = steering(tokenizer)
    bias = dict(forced["logit_bias"])
    for token_id in range(len(tokenizer)):
        if tokenizer.decode([token_id]).lstrip(' ":{').startswith("A"):
            bias.setdefault(str(token_id), 50)
    return {**forced, "logit_bias": bias}


@dataclass
class Sandbox:
    """A throwaway directory for one CLI run, owned by the user it runs as (nobody when we are root)."""

    root: Path

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def work(self) -> Path:
        return self.root / "work"

    @classmethod
    def create(cls, binary: Path) -> Sandbox:
        root = Path(tempfile.mkdtemp(prefix="harnessrl-cli-"))
        box = cls(root)
        box.home.mkdir()
        box.work.mkdir()
        (box.work / "calc.py").write_text("def add(a, b):\n    return a - b\n")
        shutil.copy2(binary, root / binary.name)  # the cache under /root is not readable by nobody
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "nobody:nogroup", str(root)], check=True)
        return box

    def command(self, binary: str, args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        argv = [str(self.root / binary), *args]
        if os.geteuid() == 0:
            argv = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv]
        return argv, {"HOME": str(self.home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **env}

    def run(self, binary: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        argv, environ = self.command(binary, args, env)
        return subprocess.run(argv, cwd=self.work, env=environ, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)

    def start(self, binary: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        argv, environ = self.command(binary, args, env)
        return subprocess.Popen(argv, cwd=self.work, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    def transcripts(self, pattern: str) -> list[dict[str, Any]]:
        return [json.loads(line) for path in sorted(self.home.rglob(pattern)) for line in path.read_text().splitlines()
                if line.strip()]

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def sandboxes() -> Iterator[list[Sandbox]]:
    made: list[Sandbox] = []
    yield made
    for box in made:
        box.remove()


def metrics(proxy: Any) -> str:
    return httpx.get(f"{proxy.url}/metrics", timeout=30).text


def check_trainable(proxy: Any, store: TraceStore, rollout: str, route: str, conversations: int = 1) -> list[Any]:
    """Every call the proxy answered is stored, none refused; every completed call has a log-prob per token;
    the completed calls are ``conversations`` training rows, each of at most 1.05x its final trajectory. Returns
    the completed calls."""
    text = metrics(proxy)
    answered = sum(metric_value(text, "harnessrl_proxy_requests_total", route=route, status=status) or 0
                   for status in ("200", "499"))
    # A call the harness left (the CLI stopped mid-call) is counted (499) when the harness goes, and captured as
    # aborted once its upstream request is cancelled, a moment later: flush (every item captured so far in the
    # store) until it is there too.
    deadline = time.monotonic() + 60
    while True:
        proxy.flush(120)
        calls = store.read_calls(rollout, 0)
        if len(calls) >= answered or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    seen = [line for line in text.splitlines() if line.startswith(("harnessrl_proxy_requests_total",
                                                                  "harnessrl_proxy_refused_total"))]
    seen.append(str([(c.status.value, c.http_status, c.response if c.status is not CallStatus.OK else None)
                     for c in calls])[:3000])
    assert "harnessrl_proxy_refused_total{" not in text, seen
    assert len(calls) == answered > 0, seen
    done = [c for c in calls if c.status is CallStatus.OK]
    assert [c.route for c in done] == [route] * len(done)
    assert all(len(c.logprobs) == len(c.completion_token_ids) > 0 for c in done)
    result = merge_calls_into_rows(store.rollout_calls(rollout, 0))
    assert len(result.rows) == conversations and result.stats.kept_calls == len(done), result.stats
    by_id = {c.call_id: c for c in done}
    for row in result.rows:
        last = by_id[row.call_ids[-1]]
        assert row.num_tokens / (len(last.prompt_token_ids) + len(last.completion_token_ids)) <= 1.05
    return done


def rows_of(store: TraceStore, rollout: str) -> list[tuple[str, ...]]:
    """The call ids of each training row of the rollout."""
    return [row.call_ids for row in merge_calls_into_rows(store.rollout_calls(rollout, 0)).rows]


def sampled_calls(tokenizer, call: Any) -> list[dict[str, Any]]:
    """The tool calls a completion's tokens spell (hermes: ``<tool_call>{"name": .., "arguments": ..}</tool_call>``,
    one or more, a line apart)."""
    ids = call.completion_token_ids[:-1] if call.finish_reason in ("stop", "tool_calls") else call.completion_token_ids
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>"), text
    inner = text.removeprefix("<tool_call>").removesuffix("</tool_call>")
    return [json.loads(part) for part in inner.split("</tool_call>\n<tool_call>")]


def sampled_call(tokenizer, call: Any) -> dict[str, Any]:
    """The one tool call a completion's tokens spell."""
    (one,) = sampled_calls(tokenizer, call)
    return one


# ----------------------------------------------------------------------------------------------------- Codex


def codex_sandbox(clis: dict[str, Path], sandboxes: list[Sandbox], proxy: Any, rollout: str, provider: str = "",
                  features: str = "") -> tuple[Sandbox, dict[str, str]]:
    """A sandbox for Codex and its environment: its config names the proxy as a Responses provider for
    ``rollout`` (``provider``: more of its settings, TOML lines), its tools that execute are off (``features``:
    more feature lines), its sandbox read-only, approvals never asked."""
    box = Sandbox.create(clis["codex"])
    sandboxes.append(box)
    base_url = f"{proxy.url}/rollouts/{rollout}/attempts/0/v1"
    config = box.home / ".codex" / "config.toml"
    config.parent.mkdir()
    config.write_text(f"""model = "tiny"
model_provider = "harnessrl"
approval_policy = "never"
sandbox_mode = "read-only"
[model_providers.harnessrl]
name = "harnessrl"
base_url = "{base_url}"
wire_api = "responses"
env_key = "HARNESSRL_API_KEY"
{provider}
[features]
shell_tool = false
unified_exec = false
{features}
""")
    if os.geteuid() == 0:
        subprocess.run(["chown", "-R", "nobody:nogroup", str(config.parent)], check=True)
    return box, {"CODEX_HOME": str(config.parent), "HARNESSRL_API_KEY": "unused"}


def run_until(process: subprocess.Popen[str], done: Any, what: str) -> None:
    """Let a started CLI run until ``done()`` (it goes on for ever when every answer calls a tool), then stop it
    with its process group."""
    try:
        deadline = time.monotonic() + CLI_TIMEOUT_S
        while not done():
            assert process.poll() is None, process.stdout.read()[-3000:] if process.stdout else ""
            assert time.monotonic() < deadline, what
            time.sleep(0.5)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)


def codex_function_calls(box: Sandbox) -> list[list[dict[str, Any]]]:
    """The function calls Codex recorded, per thread (its session's and each sub-agent's rollout file), in order."""
    return [[item["payload"] for item in map(json.loads, filter(str.strip, path.read_text().splitlines()))
             if item.get("type") == "response_item" and item["payload"].get("type") == "function_call"]
            for path in sorted(box.home.rglob("rollout-*.jsonl"))]


def as_called(got: dict[str, Any]) -> dict[str, Any]:
    """A function call Codex recorded as the chat call the model generated (a namespace's function is
    ``<namespace>.<name>``, ``responses_api.py``)."""
    name = f"{got['namespace']}.{got['name']}" if got.get("namespace") else got["name"]
    return {"name": name, "arguments": json.loads(got["arguments"])}


@pytest.mark.vllm
def test_codex_conversation_resumed_is_one_row(clis, cli_server, tokenizer, tmp_path, sandboxes):
    """``codex exec`` then ``codex exec resume --last``: every call is served as a chat completion (Codex's
    client_metadata, reasoning, encrypted reasoning, namespace and web_search tools decided, the drops counted),
    and the resumed call continues the first one's tokens."""
    stop, _ = steering(tokenizer)
    with proxy_in_front(cli_server, tmp_path, "codex", stop, **KEEPALIVE) as (store, proxy):
        box, env = codex_sandbox(clis, sandboxes, proxy, "codex-conversation")
        first = box.run("codex", ["exec", "--skip-git-repo-check", TASK], env)
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        second = box.run("codex", ["exec", "--skip-git-repo-check", "resume", "--last", "and add a test"], env)
        assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
        done = check_trainable(proxy, store, "codex-conversation", "responses")
        assert len(done) == 2
        text = metrics(proxy)
        assert metric_value(text, "harnessrl_proxy_token_continuity_total", outcome="used") == 1
        for field in ("client_metadata", "reasoning.summary", "tools.web_search"):
            assert metric_value(text, "harnessrl_proxy_dropped_fields_total", route="responses", field=field) == 2


@pytest.mark.vllm
def test_codex_forced_tool_calls_are_trainable_and_what_it_received(clis, cli_server, tokenizer, tmp_path, sandboxes):
    """Tool calls forced on every turn: Codex runs its tools and goes on for ever, so it is stopped after a few
    calls. Each stored completion spells the function call Codex recorded. Its sub-agents (multi_agent) and goals
    are off: with valid arguments the random model would start sub-agents, which this conversation of one row
    is not about."""
    _, forced = steering(tokenizer)
    with proxy_in_front(cli_server, tmp_path, "codex", forced, **KEEPALIVE) as (store, proxy):
        box, env = codex_sandbox(clis, sandboxes, proxy, "codex-tools", features="multi_agent = false\ngoals = false")
        process = box.start("codex", ["exec", "--skip-git-repo-check", TASK], env)
        run_until(process, lambda: (metric_value(metrics(proxy), "harnessrl_proxy_calls_total", route="responses",
                                                 status="ok") or 0) >= 4, "Codex made fewer than 4 calls in time")
        done = check_trainable(proxy, store, "codex-tools", "responses")
        (received,) = codex_function_calls(box)
        assert len(received) >= len(done) - 1 >= 3  # the last answer may not have reached the transcript
        for call, got in zip(done, received, strict=False):
            assert sampled_call(tokenizer, call) == as_called(got)


# ----------------------------------------------------------------------------------------------- Claude Code


def claude_env(base_url: str) -> dict[str, str]:
    """Claude Code's environment: the proxy, no traffic elsewhere, and every tool in the prompt from the start
    (no ToolSearch and its placeholder tool, which a forced call could name)."""
    return {"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "unused", "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
            "ENABLE_TOOL_SEARCH": "false"}


def assistant_messages(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The content blocks of each assistant message of a Claude Code transcript, by message id, in order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        item = json.loads(line) if line.strip() else {}
        if item.get("type") == "assistant":
            out.setdefault(item["message"]["id"], []).extend(item["message"]["content"])
    return out


@pytest.mark.vllm
def test_claude_code_forced_tool_calls_and_continue_are_one_row(clis, cli_server, tokenizer, tmp_path, sandboxes):
    """``claude -p`` with tool calls forced for 3 turns (``--max-turns``), then ``--continue`` for 2 more: one row,
    every completion spelling the tool_use Claude Code recorded, its input as generated, and usage.input_tokens
    the prompt's length. Its tools are Read, Glob and Grep (the Agent tool starts sub-agents: the next test)."""
    _, forced = steering(tokenizer)
    with proxy_in_front(cli_server, tmp_path, "claude", forced, **KEEPALIVE) as (store, proxy):
        box = Sandbox.create(clis["claude"])
        sandboxes.append(box)
        env = claude_env(f"{proxy.url}/rollouts/claude-tools/attempts/0")
        common = ["--model", "tiny", "--tools", "Read,Glob,Grep", "--disallowedTools", CLAUDE_DISALLOWED,
                  "--output-format", "json"]
        for args in (["-p", TASK, "--max-turns", "3"], ["-p", "--continue", "go on", "--max-turns", "2"]):
            run = box.run("claude", [*args, *common], env)
            result = json.loads(run.stdout.strip().splitlines()[-1])
            assert result["subtype"] == "error_max_turns", run.stdout[-3000:] + run.stderr[-2000:]
        done = check_trainable(proxy, store, "claude-tools", "messages")
        assert len(done) == 5
        received = [block for item in box.transcripts("*.jsonl") if item.get("type") == "assistant"
                    for block in item["message"]["content"] if block.get("type") == "tool_use"]
        assert len(received) == len(done)
        for call, got in zip(done, received, strict=True):
            arguments = json.loads(got["input"]["_raw"]) if set(got["input"]) == {"_raw"} else got["input"]
            assert sampled_call(tokenizer, call) == {"name": got["name"], "arguments": arguments}
            assert call.response["usage"]["input_tokens"] == len(call.prompt_token_ids)


# A sub-agent that reads: Claude Code's general-purpose agent redefined (a user agent of the same name wins over
# the built-in one) with only Read and a turn limit, so that each sub-conversation is two calls.
GENERAL_PURPOSE = """---
name: general-purpose
description: Reads files for the task it is given.
tools: Read
maxTurns: 2
---
Read the files the task names.
"""


@pytest.mark.vllm
def test_claude_code_subagents_are_rows_of_their_own(clis, cli_server, tokenizer, tmp_path, sandboxes):
    """Claude Code's Agent tool: the model calls it on both of its turns (``agent_first``; its tools are Agent and
    Read), each call runs a sub-agent (in the foreground: CLAUDE_CODE_DISABLE_BACKGROUND_TASKS) whose own
    conversation, its prompt and tools its own, makes two forced Read calls in the same rollout. The rollout's
    calls are three training rows, and each row is exactly the calls of one of Claude Code's transcripts (the
    session's and one per sub-agent), matched by the message ids Claude Code recorded; every completion spells
    the tool call that transcript recorded."""
    with proxy_in_front(cli_server, tmp_path, "claude", agent_first(tokenizer), **KEEPALIVE) as (store, proxy):
        box = Sandbox.create(clis["claude"])
        sandboxes.append(box)
        agents = box.home / ".claude" / "agents"
        agents.mkdir(parents=True)
        (agents / "general-purpose.md").write_text(GENERAL_PURPOSE)
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "nobody:nogroup", str(box.home / ".claude")], check=True)
        env = {**claude_env(f"{proxy.url}/rollouts/claude-agents/attempts/0"),
               "CLAUDE_CODE_DISABLE_BACKGROUND_TASKS": "1"}
        run = box.run("claude", ["-p", TASK, "--model", "tiny", "--tools", "Agent,Read", "--max-turns", "2",
                                 "--output-format", "json"], env)
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["subtype"] == "error_max_turns", run.stdout[-3000:] + run.stderr[-2000:]
        assert result["subagent_stats"]["completed"] == 2, result["subagent_stats"]
        done = check_trainable(proxy, store, "claude-agents", "messages", conversations=3)
        projects = box.home / ".claude" / "projects"
        transcripts = [assistant_messages(path) for path in sorted(projects.rglob("*.jsonl"))]
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
        codex, env = codex_sandbox(clis, sandboxes, proxy, "codex-slow", provider=(
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



def spawning(tokenizer, message: str) -> dict[str, Any]:
    """Every answer is two calls of Codex's ``spawn_agent`` (in its namespace ``multi_agent_v1``: the chat function
    ``multi_agent_v1.spawn_agent`` through the proxy) with ``message`` as their task: a random model never writes
    the message the tool needs (none of its fields is required, so a forced call's arguments end at ``{}``).
    Under ``tool_choice`` auto the server's grammar is its tool-call grammar OR the request's structured output
    (vLLM's ``_apply_structural_tag``), here a regex of the hermes calls with ``arguments`` first: it parts from
    every call of the tool grammar (``{"name": ...`` first) at its first key, where a bias on that key's first
    token picks it (and on ``{`` and ``"`` before it, which the tool grammar may replace by white space); the
    stop token's bias ends the answer there."""
    call = "<tool_call>" + json.dumps({"arguments": {"message": message}, "name": "multi_agent_v1.spawn_agent"})
    text = f"{call}</tool_call>\n{call}</tool_call>"
    regex = "".join("\\" + ch if ch in ".{}[]()*+?|^$\\" else ch for ch in text)
    ours, theirs = tokenizer.encode('<tool_call>{"arguments"'), tokenizer.encode('<tool_call>{"name"')
    first = next(a for a, b in zip(ours, theirs, strict=False) if a != b)
    bias = {str(t): 100 for t in (first, tokenizer.encode("{")[0], tokenizer.encode('"')[0],
                                   tokenizer.convert_tokens_to_ids("<|im_end|>"))}
    return {"temperature": 1.0, "structured_outputs": {"regex": regex}, "logit_bias": bias}


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
    with proxy_in_front(cli_server, tmp_path, "codex", spawning(tokenizer, "read calc.py"), **KEEPALIVE) as (
            store, proxy):
        box, env = codex_sandbox(clis, sandboxes, proxy, "codex-agents", features="goals = false")
        config = box.home / ".codex" / "config.toml"
        config.write_text(config.read_text() + "[agents]\nmax_threads = 2\n")
        process = box.start("codex", ["exec", "--skip-git-repo-check", TASK], env)
        run_until(process, lambda: sum(len(t) >= 4 for t in codex_function_calls(box)) >= 3,
                  "Codex's session and two sub-agents did not each record two turns in time")
        threads = codex_function_calls(box)
        assert len(threads) == 3
        done = check_trainable(proxy, store, "codex-agents", "responses", conversations=3)
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
