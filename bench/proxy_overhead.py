"""Capture-proxy overhead: the same calls sent straight to an upstream and through the proxy, in one run.

Setup (all real processes on this machine): a fast fixed-response upstream speaking vLLM's wire format
(``harnessrl.proxy.fake_upstream``: 1k prompt tokens, 200 completion tokens, token ids and log-probs) in its
own process; ``harnessrl proxy`` in its own process, capturing to PostgreSQL (a fresh database on the server
at ``HARNESSRL_BENCH_PG_URL``, else ``HARNESSRL_TEST_PG_URL``, else the local socket); the load generator
(aiohttp, N concurrent workers, each its own rollout) here.

Printed: p50/p99 latency and throughput, direct and proxied, at concurrency 1 and 64, unary and streamed,
with the ratios; at concurrency 1, how much of the added latency is the upstream's own work to return token
ids and log-probs (the same calls sent directly with the fields the proxy adds) and how much is the proxy's;
CPU milliseconds per call of each process (client, upstream, the process in the middle, PostgreSQL) at
concurrency 64, which is what bounds throughput when the 2 cores are shared, for four paths taking turns in
blocks: direct, a bare pass-through (``relay.py``), the proxy, and Agent Lightning 1.0's gateway where a
Python with ``agentlightning`` is given or found (``--agl-python``, below), and the proxy's CPU split into
its event loop's (main thread) and its other threads' (the trace writer); whether every proxied
call was stored; the raw PostgreSQL ceiling (COPY of the same rows, already encoded, from one client, into a
table like ``llm_calls``, in the binary and the text format; the faster counts) and the proxy's capture path
(prepare + write, no HTTP) as a fraction of it; the proxy's RSS after 1k and 20k calls. The last line is for
scripts: ``proxy_cpu_ms_per_call=... passthrough_cpu_ms_per_call=... proxy_loop_cpu_ms_per_call=...``
(``agent_lightning_cpu_ms_per_call``
too when measured).

Targets (issue 3): proxied throughput >= 0.8x direct at concurrency 64; p50 added latency <= 1 ms at
concurrency 1; every call stored; capture >= 0.7x the COPY ceiling; flat RSS. Issue 25: the proxy's CPU per
call at concurrency 64.

    python bench/proxy_overhead.py              # the full run (~20k proxied calls)
    python bench/proxy_overhead.py --quick      # fewer calls, for a smoke run

Agent Lightning 1.0 needs Python >= 3.12; its default place here:

    python3.12 -m venv ~/.cache/harnessrl/agl-1.0.2
    ~/.cache/harnessrl/agl-1.0.2/bin/pip install agentlightning==1.0.2
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from sqlalchemy import create_engine, text
from store_write import add_pg_option, copy_ceiling, fresh_pg_database

PROMPT_TOKENS = 1000
COMPLETION_TOKENS = 200


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_s(pids: list[int], main_thread: bool = False) -> float:
    """User + system CPU seconds used so far by these processes (those that exited count as 0); with
    ``main_thread``, by their main threads only (a Python process's first thread runs its event loop)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        stat = f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat"
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def postgres_pids() -> list[int]:
    """The PostgreSQL server's processes on this machine (the benchmark's database is local)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "postgres":
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@dataclass
class CpuShare:
    """CPU milliseconds per call, by process, over one measured load."""

    client: float
    upstream: float
    proxy: float
    postgres: float
    proxy_loop: float  # of ``proxy``, its main thread's (the event loop: HTTP, parsing, preparing captures)


class CpuMeter:
    """CPU seconds used by each process of a path (``proxy``: whatever sits between client and upstream)."""

    def __init__(self, upstream: int, proxy: int | None) -> None:
        middle = [] if proxy is None else [proxy]
        self.groups = {"client": lambda: [os.getpid()], "upstream": lambda: [upstream],
                       "proxy": lambda: middle, "postgres": postgres_pids}  # fmt: skip
        self.used = dict.fromkeys([*self.groups, "proxy_loop"], 0.0)
        self.calls = 0

    def measure(self) -> dict[str, float]:
        used = {name: cpu_s(pids()) for name, pids in self.groups.items()}
        used["proxy_loop"] = cpu_s(self.groups["proxy"](), main_thread=True)
        return used

    def add(self, before: dict[str, float], calls: int) -> None:
        after = self.measure()
        for name in self.used:
            self.used[name] += after[name] - before[name]
        self.calls += calls

    def per_call(self) -> CpuShare:
        return CpuShare(**{name: seconds / self.calls * 1e3 for name, seconds in self.used.items()})


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def wait_healthy(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy")


@dataclass
class Result:
    latencies: list[float]
    seconds: float

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# What the proxy adds to every request it sends upstream in train mode (protocol.upstream_request).
CAPTURE_FIELDS = {"logprobs": True, "return_token_ids": True}


async def load(
    base: str,
    calls: int,
    concurrency: int,
    stream: bool,
    gateway: bool,
    tag: str,
    extra: dict | None = None,
    prefix: str = "/rollouts/{rollout}/attempts/0",
) -> Result:
    """``calls`` chat calls from ``concurrency`` workers; each worker is one rollout (its gateway path:
    ``prefix``)."""
    body_template = {
        "model": "m",
        "max_tokens": COMPLETION_TOKENS,
        "stream": stream,
        "messages": [{"role": "user", "content": "x" * PROMPT_TOKENS}],
        **(extra or {}),
    }
    latencies: list[float] = []
    counter = iter(range(calls))
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(w: int) -> None:
            path = prefix.format(rollout=f"{tag}-{w}") if gateway else ""
            url = f"{base}{path}/v1/chat/completions"
            for _ in counter:
                start = time.perf_counter()
                async with session.post(url, json=body_template) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:200]}")
                    if stream:
                        async for _chunk in resp.content.iter_any():
                            pass
                    else:
                        await resp.read()
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return Result(latencies, time.perf_counter() - start)


async def flush(proxied: str) -> bool:
    """Wait until the proxy's captured calls are in the store (``/admin/flush``); whether they are."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{proxied}/admin/flush", json={"timeout_s": 600}) as resp,
    ):
        return bool((await resp.json())["flushed"])


async def upstream_answer(direct: str) -> bytes:
    """One chat answer from the fake upstream, as the proxy asks for it (token ids and log-probs)."""
    body = {
        "model": "m",
        "max_tokens": COMPLETION_TOKENS,
        "messages": [{"role": "user", "content": "x" * PROMPT_TOKENS}],
        "logprobs": True,
        "return_token_ids": True,
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{direct}/v1/chat/completions", json=body) as resp,
    ):
        return await resp.read()


def captured_records(answer: bytes, calls: int, tag: str) -> list:
    """``calls`` records of the proxy's benchmark call, as its capture builds them from ``answer`` (each
    decoded afresh, so none shares objects with another): 64 rollouts, interleaved by turn."""
    from harnessrl.proxy.capture import Attribution, build_call_record
    from harnessrl.proxy.protocol import ClientWants, loads, strip_unrequested, tokens_from_response
    from harnessrl.store import CallStatus

    records = []
    for i in range(calls):
        # stored as the harness (which asked for neither) got it: see CaptureProxy.capture
        response = strip_unrequested(loads(answer), ClientWants(token_ids=False, logprobs=False))
        records.append(
            build_call_record(
                who=Attribution("bench", f"{tag}-{i % 64}", 0),
                seq=i // 64,
                route="chat",
                request={"model": "m", "messages": [{"role": "user", "content": "x" * PROMPT_TOKENS}]},
                response=response,
                tokens=tokens_from_response("chat", loads(answer)),
                policy_version=0,
                upstream="http://u",
                latency_s=0.01,
                status=CallStatus.OK,
                http_status=200,
            )
        )
    return records


def capture_costs(pg_url: str, answer: bytes, calls: int) -> tuple[float, float]:
    """Microseconds per call of the proxy's capture path without HTTP: preparing each call (the event loop's
    callback after the answer went out) and writing it (the writer thread's ``add_calls``, batches of 256).

    Each batch is prepared just before it is written, as in the proxy, where a call waits at most the
    writer's linger (20 ms) between the two; preparing everything first and writing later would measure
    cold caches instead.
    """
    from harnessrl.proxy.writer import CallItem
    from harnessrl.store import TraceStore

    store = TraceStore.connect(pg_url)
    prepare_s = write_s = 0.0
    for start in range(0, calls, 256):
        records = captured_records(answer, min(256, calls - start), f"capture{start // 256}")
        begin = time.perf_counter()
        items = [CallItem(record) for record in records]
        for item in items:
            item.prepare()
        prepared = time.perf_counter()
        store.add_calls([item.call for item in items])
        prepare_s += prepared - begin
        write_s += time.perf_counter() - prepared
    store.close()
    return prepare_s / calls * 1e6, write_s / calls * 1e6


def stop_servers(proxy: subprocess.Popen, upstream: subprocess.Popen) -> tuple[int, int]:
    """SIGTERM both; the proxy flushes its queue before it exits (its exit code is reported)."""
    proxy.terminate()
    upstream.terminate()
    return proxy.wait(60), upstream.wait(10)


def stored_calls(pg_url: str) -> int:
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        count = conn.execute(text("SELECT count(*) FROM llm_calls")).scalar_one()
    engine.dispose()
    return int(count)


def start_servers(pg_url: str, tmp: Path) -> tuple[subprocess.Popen, subprocess.Popen, str, str]:
    """The fake upstream and ``harnessrl proxy`` (gateway mode, capturing to ``pg_url``), as processes."""
    up_port, proxy_port = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("HARNESSRL_") or k.startswith("HARNESSRL_TEST")}
    upstream = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harnessrl.proxy.fake_upstream",
            "--port",
            str(up_port),
            "--prompt-tokens",
            str(PROMPT_TOKENS),
            "--max-tokens",
            str(COMPLETION_TOKENS),
        ],
        env=env,
    )
    proxy = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harnessrl.cli",
            "proxy",
            "--upstream",
            f"http://127.0.0.1:{up_port}",
            "--store",
            pg_url,
            "--port",
            str(proxy_port),
            "--spool",
            str(tmp / "spool"),
            "--run",
            "bench",
            "--log-level",
            "WARNING",
        ],
        env=env,
    )
    return upstream, proxy, f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{proxy_port}"


C1_BLOCKS = 5
AGL_PREFIX = "/proxy/rollout/{rollout}/attempt/0/mode/train/openai"  # Agent Lightning 1.0's gateway path


async def c1_paths(direct: str, relayed: str, proxied: str, calls: int, stream: bool) -> dict[str, Result]:
    """Concurrency-1 calls by each path: direct; direct asking for what the proxy adds (token ids and
    log-probs); through the relay (unary only: it reads whole bodies); through the proxy. The paths take turns
    in blocks, so the drift of a shared machine falls on all of them alike."""
    paths: dict[str, tuple[str, bool, dict | None]] = {
        "direct": (direct, False, None),
        "fields": (direct, False, CAPTURE_FIELDS),
        "proxy": (proxied, True, None),
    }
    if not stream:
        paths["relay"] = (relayed, True, CAPTURE_FIELDS)
    pooled = {name: Result([], 0.0) for name in paths}
    for block in range(C1_BLOCKS):
        for name, (base, gateway, extra) in paths.items():
            tag = f"c1{'s' if stream else 'u'}-{name}-{block}"
            result = await load(base, calls // C1_BLOCKS, 1, stream, gateway, tag, extra)
            pooled[name].latencies.extend(result.latencies)
            pooled[name].seconds += result.seconds
    return pooled


def start_relay(upstream: str) -> tuple[subprocess.Popen, str]:
    """``relay.py`` in front of ``upstream``: one extra hop that does nothing."""
    port = free_port()
    relay = subprocess.Popen([sys.executable, str(Path(__file__).with_name("relay.py")), upstream, str(port)])
    return relay, f"http://127.0.0.1:{port}"


AGL_PYTHON = Path.home() / ".cache/harnessrl/agl-1.0.2/bin/python"


def agl_python(given: str | None) -> str | None:
    """The Python that has Agent Lightning: ``given``, else this one if it has it, else ``AGL_PYTHON`` if
    present, else None (not measured)."""
    if given:
        return given
    if importlib.util.find_spec("agentlightning") is not None:
        return sys.executable
    return str(AGL_PYTHON) if AGL_PYTHON.exists() else None


def start_agl(python: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    """Agent Lightning 1.0's server (its gateway: an LLM proxy capturing every call into its in-memory store)
    as its own entry point starts it, with its shipped settings but the address; its log lines (three a call)
    go to a file."""
    port = free_port()
    overrides = ["host=127.0.0.1", f"port={port}", "default_proxy.model_name=m", f"hydra.run.dir={tmp}/agl"]
    log = (tmp / "agl.log").open("wb")
    command = [python, "-m", "agentlightning.server", *overrides]
    agl = subprocess.Popen(command, stdout=log, stderr=log, cwd=tmp)
    return agl, f"http://127.0.0.1:{port}"


async def agl_ready(base: str, upstream: str, rollouts: list[str]) -> None:
    """Register ``upstream`` as Agent Lightning's model server and create ``rollouts`` (its proxy refuses
    calls of rollouts it does not know), through its API."""
    await wait_healthy(f"{base}/healthz", timeout=180)
    async with aiohttp.ClientSession() as session:
        for path, body in (
            ("/api/models", [{"model": "m", "endpoint": f"{upstream}/v1"}]),
            ("/api/rollouts", [{"input": None, "rollout_id": rollout} for rollout in rollouts]),
        ):
            async with session.post(base + path, json=body) as resp:
                if resp.status != 201:
                    problem = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    raise RuntimeError(f"Agent Lightning {path}: {problem}")


@dataclass
class CpuPath:
    """One way to the upstream for ``cpu_paths``: its base URL, the process in the middle (None: direct), the
    fields the client adds, and its gateway path (None: none)."""

    base: str
    middle: int | None
    extra: dict | None = None
    prefix: str | None = "/rollouts/{rollout}/attempts/0"
    flush: bool = False  # the harnessrl proxy: its writer's work for a block is counted with the block


CPU_BLOCKS = 3


async def cpu_paths(paths: dict[str, CpuPath], upstream: int, calls: int) -> dict[str, CpuShare]:
    """CPU ms per call of each process, at concurrency 64, unary, ``calls`` per path; the paths take turns in
    ``CPU_BLOCKS`` blocks, so the drift of a shared machine falls on all of them alike."""
    meters = {name: CpuMeter(upstream, path.middle) for name, path in paths.items()}
    for block in range(CPU_BLOCKS):
        for name, path in paths.items():
            before = meters[name].measure()
            gateway = path.prefix is not None
            n = calls // CPU_BLOCKS
            await load(path.base, n, 64, False, gateway, f"cpu-{name}-{block}", path.extra, path.prefix or "")
            if path.flush:
                await flush(path.base)
            meters[name].add(before, n)
    return {name: meter.per_call() for name, meter in meters.items()}


async def run(args: argparse.Namespace, pg_url: str, tmp: Path) -> None:
    upstream, proxy, direct, proxied = start_servers(pg_url, tmp)
    relay, relayed = start_relay(direct)
    agl = None if args.agl_python is None else start_agl(args.agl_python, tmp)
    sent = 0
    rss: dict[str, float] = {}
    try:
        await wait_healthy(f"{direct}/health")
        await wait_healthy(f"{proxied}/healthz")
        await load(direct, 50, 8, False, False, "warm")
        await load(proxied, 50, 8, False, True, "warm")
        answer = await upstream_answer(direct)
        sent += 50
        rows = []
        await wait_healthy(f"{relayed}/healthz")
        c1 = {s: await c1_paths(direct, relayed, proxied, args.calls_c1, s) for s in (False, True)}
        for stream, paths in c1.items():
            rows.append((1, stream, paths["direct"], paths["proxy"]))
            sent += len(paths["proxy"].latencies)
        plan = [(64, False), (64, True)]
        for concurrency, stream in plan:
            n = args.calls_c64
            d = await load(direct, n, concurrency, stream, False, "d")
            p = await load(proxied, n, concurrency, stream, True, f"p{concurrency}{int(stream)}")
            sent += n
            rows.append((concurrency, stream, d, p))
            if "1k" not in rss and sent >= 1000:
                rss["1k"] = rss_mib(proxy.pid)
        # The relay gets the request as the proxy sends it upstream, so the upstream's work and the answer it
        # relays are the same; Agent Lightning's proxy adds token ids and log-probs itself, as ours does.
        cpu_plan = {
            "direct": CpuPath(direct, None, prefix=None),
            "relay": CpuPath(relayed, relay.pid, CAPTURE_FIELDS),
            "harnessrl": CpuPath(proxied, proxy.pid, flush=True),
        }
        if agl is not None:
            tags = ["warm", *(f"cpu-agent-lightning-{block}" for block in range(CPU_BLOCKS))]
            await agl_ready(agl[1], direct, [f"{tag}-{w}" for tag in tags for w in range(64)])
            await load(agl[1], 50, 8, False, True, "warm", None, AGL_PREFIX)
            cpu_plan["agent-lightning"] = CpuPath(agl[1], agl[0].pid, None, AGL_PREFIX)
        cpu = await cpu_paths(cpu_plan, upstream.pid, args.calls_c64)
        sent += args.calls_c64 // CPU_BLOCKS * CPU_BLOCKS
        soak_start, soak_calls = time.perf_counter(), max(0, args.total - sent)
        soak = await load(proxied, soak_calls, 64, False, True, "soak") if soak_calls else None
        sent += soak_calls
        flushed = await flush(proxied)
        capture_seconds = time.perf_counter() - soak_start
        rss[f"{sent // 1000}k"] = rss_mib(proxy.pid)
    finally:
        relay.terminate()
        relay.wait()
        if agl is not None:
            agl[0].terminate()
            agl[0].wait(30)
        proxy_rc, _ = await asyncio.to_thread(stop_servers, proxy, upstream)

    print(
        f"\nproxy overhead: {PROMPT_TOKENS} prompt + {COMPLETION_TOKENS} completion tokens per call, "
        f"capture to PostgreSQL, {os.cpu_count()} CPUs shared by client, proxy, upstream and database\n"
    )
    header = ("conc", "mode", "direct p50", "p99", "calls/s", "proxy p50", "p99", "calls/s", "added", "ratio")
    print("{:>4} {:>6} | {:>10} {:>8} {:>8} | {:>10} {:>8} {:>8} | {:>9} {:>7}".format(*header))
    timing = "{:>8.2f}ms {:>6.1f}ms {:>8.0f}"
    row = "{:>4} {:>6} | " + timing + " | " + timing + " | {:>7.2f}ms {:>6.2f}x"
    for concurrency, stream, d, p in rows:
        mode = "stream" if stream else "unary"
        added = (p.pct(0.5) - d.pct(0.5)) * 1e3
        direct_cells = (d.pct(0.5) * 1e3, d.pct(0.99) * 1e3, d.throughput)
        proxy_cells = (p.pct(0.5) * 1e3, p.pct(0.99) * 1e3, p.throughput)
        print(row.format(concurrency, mode, *direct_cells, *proxy_cells, added, p.throughput / d.throughput))
    for stream, paths in c1.items():
        p50 = {name: result.pct(0.5) * 1e3 for name, result in paths.items()}
        split = (
            f"concurrency 1, {'stream' if stream else 'unary'}, the added p50 split (the paths took turns in "
            f"{C1_BLOCKS} blocks): the upstream answering with token ids and log-probs (asked for directly) "
            f"{p50['fields'] - p50['direct']:.2f} ms"
        )
        if "relay" in p50:
            split += (
                f"; one more hop, through a relay that only forwards the bytes (aiohttp on uvloop, as the proxy) "
                f"{p50['relay'] - p50['fields']:.2f} ms; the proxy's own work beyond such a hop "
                f"{p50['proxy'] - p50['relay']:.2f} ms"
            )
        else:
            split += f"; the proxy itself {p50['proxy'] - p50['fields']:.2f} ms"
        print(split)
    print(
        f"\nCPU ms per call at concurrency 64, unary, by process (the paths took turns in {CPU_BLOCKS} "
        "blocks; relay: a bare aiohttp pass-through; harnessrl: the capture proxy, its capture to PostgreSQL "
        "included; "
        + (
            "agent-lightning: Agent Lightning 1.0's gateway as shipped (FastAPI, httpx, three log lines a "
            "call), capturing into its in-memory store"
            if "agent-lightning" in cpu
            else "Agent Lightning not installed (--agl-python)"
        )
        + "):"
    )
    columns = ("", "client", "upstream", "proxy", "postgres", "sum")
    print("{:>15} | {:>7} {:>8} {:>7} {:>8} | {:>7}".format(*columns))
    for name, share in cpu.items():
        parts = (share.client, share.upstream, share.proxy, share.postgres)
        print("{:>15} | {:>7.3f} {:>8.3f} {:>7.3f} {:>8.3f} | {:>7.3f}".format(name, *parts, sum(parts)))
    d, p, r = cpu["direct"], cpu["harnessrl"], cpu["relay"]
    base = d.client + d.upstream
    print(
        f"with every core busy, throughput goes as 1 / CPU per call: a proxy costing nothing, with the "
        f"database's measured share, would reach {base / (base + p.postgres):.2f}x direct here; the proxy's "
        f"own {p.proxy:.3f} ms per call is {p.proxy / base:.1f}x what client and upstream spend together and "
        f"{p.proxy / r.proxy:.1f}x a bare pass-through's {r.proxy:.3f} ms"
    )
    print(
        f"the proxy's {p.proxy:.3f} ms by thread: its event loop {p.proxy_loop:.3f} ms (HTTP in and out, "
        f"parsing, preparing each capture; the pass-through's whole {r.proxy:.3f} ms is such a loop), its "
        f"other threads {p.proxy - p.proxy_loop:.3f} ms (the trace writer: writing to PostgreSQL)"
    )
    stored = stored_calls(pg_url)
    print(
        f"\nproxied calls sent: {sent}; stored: {stored} ({'all' if stored == sent else 'MISSING SOME'}); "
        f"flush ok: {flushed}; proxy exit code on SIGTERM: {proxy_rc}"
    )
    ceilings = copy_ceiling(pg_url, captured_records(answer, args.copy_rows, "copy"))
    ceiling = max(ceilings.values())
    prepare_us, write_us = capture_costs(pg_url, answer, args.copy_rows)
    print(
        f"PostgreSQL COPY ceiling (pre-encoded rows, one client): {ceiling:,.0f} calls/s "
        f"(binary format {ceilings['binary']:,.0f}, text format {ceilings['text']:,.0f})"
    )
    capture = 1e6 / (prepare_us + write_us)
    print(
        f"proxy capture path, no HTTP: prepare {prepare_us:.0f} us + write {write_us:.0f} us per call = "
        f"{capture:,.0f} calls/s = {capture / ceiling:.2f}x the ceiling (the writer alone: "
        f"{1e6 / write_us:,.0f} calls/s = {1e6 / write_us / ceiling:.2f}x)"
    )
    if soak is not None:
        end_to_end = soak_calls / capture_seconds
        print(
            f"end-to-end capture during the soak (HTTP in, stored in PostgreSQL, concurrency 64): "
            f"{end_to_end:,.0f} calls/s = {end_to_end / ceiling:.2f}x the ceiling"
        )
    print("proxy RSS: " + ", ".join(f"after {k} calls {v:.0f} MiB" for k, v in rss.items()))
    last = (
        f"proxy_cpu_ms_per_call={p.proxy:.3f} passthrough_cpu_ms_per_call={r.proxy:.3f} "
        f"proxy_loop_cpu_ms_per_call={p.proxy_loop:.3f}"
    )
    if "agent-lightning" in cpu:
        last += f" agent_lightning_cpu_ms_per_call={cpu['agent-lightning'].proxy:.3f}"
    print(last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (smoke run)")
    add_pg_option(parser)
    parser.add_argument(
        "--agl-python",
        default=os.environ.get("HARNESSRL_BENCH_AGL_PYTHON"),
        help="a Python with agentlightning installed, to measure its proxy beside ours (default: this one if "
        f"it has it, else {AGL_PYTHON} if present)",
    )
    args = parser.parse_args()
    args.agl_python = agl_python(args.agl_python)
    args.calls_c1, args.calls_c64, args.total, args.copy_rows = (
        (100, 500, 2000, 1000) if args.quick else (500, 3000, 20000, 3000)
    )
    from harnessrl.store import TraceStore

    with fresh_pg_database(args.pg) as pg_url:
        store = TraceStore.connect(pg_url)
        store.upgrade()
        store.close()
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(run(args, pg_url, Path(tmp)))


if __name__ == "__main__":
    main()
