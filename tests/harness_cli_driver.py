"""Driving Claude Code and Codex CLI, unchanged and headless, through a capture proxy (issue 26).

Shared by ``tests/test_harness_clis.py`` (which asserts on what the runs leave) and ``bench/harness_clis.py``
(which reports it): the pinned CLIs, the throwaway sandbox each runs in as an unprivileged user with its
executing tools off, the proxy's sampling overrides that steer the random model (empty answers, forced tool
calls, the Agent tool, Codex's spawn_agent), the scenarios both run, reading what each CLI recorded, and a
logging pass-through that sits between a CLI and the proxy to see every request as the CLI does (status, time
to the first byte of the answer, time to its end).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from aiohttp import web

from harnessrl.store import TraceStore
from harnessrl.trainer.rows import merge_calls_into_rows

ROOT = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 600
# Claude Code's tools that execute or reach out; what is left reads (Read, Glob, Grep) or plans (Agent, ...).
CLAUDE_DISALLOWED = "Bash Edit Write NotebookEdit WebFetch WebSearch KillShell BashOutput"
TASK = "fix the bug in calc.py"


def installed_clis() -> dict[str, Path]:
    """The pinned CLIs' native binaries, by name ("claude", "codex"): scripts/harness-clis.sh installs them once."""
    done = subprocess.run([str(ROOT / "scripts" / "harness-clis.sh")], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"scripts/harness-clis.sh failed:\n{done.stderr[-3000:]}"
    return {name: Path(path) for name, path in (line.split(" ", 1) for line in done.stdout.splitlines())}


# --------------------------------------------------------------------------------------------- steering


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


# ---------------------------------------------------------------------------------------------- sandbox


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

    def give_away(self, path: Path) -> None:
        """Files written into the sandbox after it was made belong to the user the CLI runs as, too."""
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "nobody:nogroup", str(path)], check=True)

    def transcripts(self, pattern: str) -> list[dict[str, Any]]:
        return [json.loads(line) for path in sorted(self.home.rglob(pattern)) for line in path.read_text().splitlines()
                if line.strip()]

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def run_until(process: subprocess.Popen[str], done: Callable[[], bool], what: str) -> None:
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


# ------------------------------------------------------------------------------------------------ proxy


def metrics(proxy: Any) -> str:
    return httpx.get(f"{proxy.url}/metrics", timeout=30).text


def answered_calls(exposition: str, route: str) -> int:
    """The calls the proxy answered on ``route``, the harness there to the end (200) or gone before it (499)."""
    from proxy_servers import metric_value

    return int(sum(metric_value(exposition, "harnessrl_proxy_requests_total", route=route, status=status) or 0
                   for status in ("200", "499")))


def stored_calls(proxy: Any, store: TraceStore, rollout: str, answered: int) -> list[Any]:
    """The rollout's stored calls once ``answered`` of them are there, or after a minute. A call the harness left
    (the CLI stopped mid-call) is counted (499) when the harness goes, and captured as aborted once its
    upstream request is cancelled, a moment later: flush (every item captured so far in the store) until it is
    there too."""
    deadline = time.monotonic() + 60
    while True:
        proxy.flush(120)
        calls = store.read_calls(rollout, 0)
        if len(calls) >= answered or time.monotonic() > deadline:
            return calls
        time.sleep(0.5)


def token_ratio(rows: list[Any], done: list[Any], conversations: list[list[str]] | None = None) -> float:
    """Tokens of the training ``rows`` over tokens of the conversations' final calls (each conversation: the
    ids of its answered calls in order; None: one conversation, every call in ``done``): 1.00 when every
    conversation became one row, about N/2 for N calls of which none merged."""
    by_id = {c.call_id: c for c in done}
    finals = [by_id[conv[-1]] for conv in conversations or [[c.call_id for c in done]] if conv]
    final = sum(len(c.prompt_token_ids) + len(c.completion_token_ids) for c in finals)
    return sum(row.num_tokens for row in rows) / final if final else float("nan")


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


# ------------------------------------------------------------------------------------------------ Codex


def codex_sandbox(clis: dict[str, Path], sandboxes: list[Sandbox], base_url: str, rollout: str, provider: str = "",
                  features: str = "") -> tuple[Sandbox, dict[str, str]]:
    """A sandbox for Codex and its environment: its config names the proxy at ``base_url`` as a Responses provider
    for ``rollout`` (``provider``: more of its settings, TOML lines), its tools that execute are off
    (``features``: more feature lines), its sandbox read-only, approvals never asked."""
    box = Sandbox.create(clis["codex"])
    sandboxes.append(box)
    config = box.home / ".codex" / "config.toml"
    config.parent.mkdir()
    config.write_text(f"""model = "tiny"
model_provider = "harnessrl"
approval_policy = "never"
sandbox_mode = "read-only"
[model_providers.harnessrl]
name = "harnessrl"
base_url = "{base_url}/rollouts/{rollout}/attempts/0/v1"
wire_api = "responses"
env_key = "HARNESSRL_API_KEY"
{provider}
[features]
shell_tool = false
unified_exec = false
{features}
""")
    box.give_away(config.parent)
    return box, {"CODEX_HOME": str(config.parent), "HARNESSRL_API_KEY": "unused"}


def codex_exec_resume(clis: dict[str, Path], sandboxes: list[Sandbox], base_url: str, rollout: str
                      ) -> list[subprocess.CompletedProcess[str]]:
    """``codex exec`` then ``codex exec resume --last``: a conversation of two calls (with ``STOP``)."""
    box, env = codex_sandbox(clis, sandboxes, base_url, rollout)
    return [box.run("codex", ["exec", "--skip-git-repo-check", TASK], env),
            box.run("codex", ["exec", "--skip-git-repo-check", "resume", "--last", "and add a test"], env)]


def codex_tool_calls(clis: dict[str, Path], sandboxes: list[Sandbox], base_url: str, rollout: str,
                     enough: Callable[[], bool]) -> Sandbox:
    """``codex exec`` with tool calls forced (``FORCED``) goes on for ever: stopped once ``enough()``. Its
    sub-agents (multi_agent) and goals are off: with valid arguments the random model would start sub-agents,
    which this conversation of one row is not about."""
    box, env = codex_sandbox(clis, sandboxes, base_url, rollout, features="multi_agent = false\ngoals = false")
    run_until(box.start("codex", ["exec", "--skip-git-repo-check", TASK], env), enough,
              "Codex did not make its calls in time")
    return box


def codex_subagents(clis: dict[str, Path], sandboxes: list[Sandbox], base_url: str, rollout: str) -> Sandbox:
    """``codex exec`` with ``spawning`` (two spawn_agent calls a turn, two threads at most), stopped once the
    session and two sub-agents each recorded two turns."""
    box, env = codex_sandbox(clis, sandboxes, base_url, rollout, features="goals = false")
    config = box.home / ".codex" / "config.toml"
    config.write_text(config.read_text() + "[agents]\nmax_threads = 2\n")
    run_until(box.start("codex", ["exec", "--skip-git-repo-check", TASK], env),
              lambda: sum(len(t) >= 4 for t in codex_function_calls(box)) >= 3,
              "Codex's session and two sub-agents did not each record two turns in time")
    return box


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


# ------------------------------------------------------------------------------------------ Claude Code


def claude_env(base_url: str) -> dict[str, str]:
    """Claude Code's environment: the proxy, no traffic elsewhere, and every tool in the prompt from the start
    (no ToolSearch and its placeholder tool, which a forced call could name)."""
    return {"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "unused", "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
            "ENABLE_TOOL_SEARCH": "false"}


def claude_turns_and_continue(clis: dict[str, Path], sandboxes: list[Sandbox], base_url: str, rollout: str,
                              tools: str = "Read,Glob,Grep", turns: tuple[int, int] = (3, 2)
                              ) -> tuple[Sandbox, list[subprocess.CompletedProcess[str]]]:
    """``claude -p`` for ``turns[0]`` turns (``--max-turns``), then ``--continue`` for ``turns[1]`` more, its tools
    ``tools``."""
    box = Sandbox.create(clis["claude"])
    sandboxes.append(box)
    env = claude_env(f"{base_url}/rollouts/{rollout}/attempts/0")
    common = ["--model", "tiny", "--tools", tools, "--disallowedTools", CLAUDE_DISALLOWED, "--output-format", "json"]
    return box, [box.run("claude", [*args, *common], env)
                 for args in (["-p", TASK, "--max-turns", str(turns[0])],
                              ["-p", "--continue", "go on", "--max-turns", str(turns[1])])]


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


def claude_subagents(clis: dict[str, Path], sandboxes: list[Sandbox], base_url: str, rollout: str
                     ) -> tuple[Sandbox, subprocess.CompletedProcess[str]]:
    """``claude -p`` for 2 turns with the tools Agent and Read (with ``agent_first``: each turn starts a sub-agent,
    in the foreground, that reads twice: ``GENERAL_PURPOSE``)."""
    box = Sandbox.create(clis["claude"])
    sandboxes.append(box)
    agents = box.home / ".claude" / "agents"
    agents.mkdir(parents=True)
    (agents / "general-purpose.md").write_text(GENERAL_PURPOSE)
    box.give_away(box.home / ".claude")
    env = {**claude_env(f"{base_url}/rollouts/{rollout}/attempts/0"), "CLAUDE_CODE_DISABLE_BACKGROUND_TASKS": "1"}
    return box, box.run("claude", ["-p", TASK, "--model", "tiny", "--tools", "Agent,Read", "--max-turns", "2",
                                   "--output-format", "json"], env)


def claude_result(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The result Claude Code printed last (``--output-format json``)."""
    return json.loads(run.stdout.strip().splitlines()[-1])


def assistant_messages(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The content blocks of each assistant message of a Claude Code transcript, by message id, in order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        item = json.loads(line) if line.strip() else {}
        if item.get("type") == "assistant":
            out.setdefault(item["message"]["id"], []).extend(item["message"]["content"])
    return out


def claude_transcripts(box: Sandbox) -> list[dict[str, list[dict[str, Any]]]]:
    """Each of Claude Code's transcripts (the session's, one per sub-agent): its assistant messages by id."""
    return [assistant_messages(path) for path in sorted((box.home / ".claude" / "projects").rglob("*.jsonl"))]


def claude_tool_uses(box: Sandbox) -> list[dict[str, Any]]:
    """The tool calls Claude Code received, as the model's calls (an input it could not read as JSON is kept as
    ``{"_raw": text}``: the text is the arguments)."""
    blocks = [block for item in box.transcripts("*.jsonl") if item.get("type") == "assistant"
              for block in item["message"]["content"] if block.get("type") == "tool_use"]
    return [{"name": b["name"], "arguments": json.loads(b["input"]["_raw"]) if set(b["input"]) == {"_raw"}
             else b["input"]} for b in blocks]


# ------------------------------------------------------------------------------------- the pass-through


@dataclass
class Exchange:
    """One request a CLI made, as the CLI saw it: its answer's status, whether it streamed, the seconds from the
    request to the answer's first body byte (None: no body) and to its end, the reads the body came in (many:
    relayed as generated; a few: keep-alives, then the answer whole), and whether the CLI left first."""

    method: str
    path: str
    status: int
    streamed: bool
    first_byte_s: float | None
    total_s: float
    chunks: int
    left: bool


# Headers a relay does not pass on: each hop sets its own (bodies pass as they are, encoded or not).
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class LoggingPassThrough:
    """An HTTP relay in front of the proxy, on its own event loop, that passes every request and answer on
    unchanged, the answer chunk by chunk as it arrives, and logs each as an ``Exchange``: how the issue counted
    the calls a CLI made (every one, the proxy's own refusals included) and measured the time to the first
    byte it read."""

    def __init__(self, loops: Any, upstream: str) -> None:
        self.loops = loops
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.in_flight = 0
        app = web.Application(client_max_size=1 << 28)
        app.router.add_route("*", "/{tail:.*}", self.relay)
        self.runner = web.AppRunner(app, access_log=None)

        async def start() -> str:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

        self.url = loops.run(start())

    async def relay(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        start = time.monotonic()
        self.in_flight += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        first: float | None = None
        status, streamed, left, chunks = 0, False, False, 0
        response = web.StreamResponse(status=499)
        try:
            async with self.session.request(request.method, self.upstream + request.path_qs, data=body,
                                            headers=headers) as answer:
                status = answer.status
                streamed = answer.content_type == "text/event-stream"
                response = web.StreamResponse(status=answer.status, headers={
                    k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS})
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    if first is None:
                        first = time.monotonic() - start
                    chunks += 1
                    await response.write(chunk)
                try:
                    await response.write_eof()
                except ConnectionResetError:
                    pass  # the CLI closed once it had the whole answer (Codex does, at response.completed)
                return response
        except ConnectionResetError:
            left = True  # the CLI went away mid-answer (stopped); leaving the request tells the proxy, too
            return response
        except asyncio.CancelledError:
            left = True
            raise
        finally:
            self.exchanges.append(Exchange(request.method, request.path, status, streamed, first,
                                           time.monotonic() - start, chunks, left))
            self.in_flight -= 1

    def settle(self, timeout: float = 60.0) -> list[Exchange]:
        """Every exchange, once none is in flight (a stopped CLI's last call ends when the relay next writes to
        it, or when the proxy's answer is done)."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not self.in_flight, f"{self.in_flight} requests still in flight after {timeout} s"
        return list(self.exchanges)

    def stop(self) -> None:
        async def stop() -> None:
            await self.runner.cleanup()
            await self.session.close()

        self.loops.run(stop())
