"""Capture-proxy overhead: the same calls sent straight to an upstream and through the proxy, in one run.

Setup (all real processes on this machine): a fast fixed-response upstream speaking vLLM's wire format
(``harnessrl.proxy.fake_upstream``: 1k prompt tokens, 200 completion tokens, token ids and log-probs) in its
own process; ``harnessrl proxy`` in its own process, capturing to PostgreSQL (a fresh database on the server
at ``HARNESSRL_BENCH_PG_URL``, else ``HARNESSRL_TEST_PG_URL``, else the local socket); the load generator
(aiohttp, N concurrent workers, each its own rollout) here.

Printed: p50/p99 latency and throughput, direct and proxied, at concurrency 1 and 64, unary and streamed,
with the ratios; whether every proxied call was stored; the raw PostgreSQL ceiling (COPY of the same rows,
already encoded, from one client, no proxy) and the proxy's sustained capture rate as a fraction of it;
the proxy's RSS after 1k and after 20k calls.

Targets (issue 3): proxied throughput >= 0.8x direct at concurrency 64; p50 added latency <= 1 ms at
concurrency 1; every call stored; capture >= 0.7x the COPY ceiling; flat RSS.

    python bench/proxy_overhead.py              # the full run (~20k proxied calls)
    python bench/proxy_overhead.py --quick      # fewer calls, for a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

PROMPT_TOKENS = 1000
COMPLETION_TOKENS = 200
DEFAULT_PG = "postgresql+psycopg://postgres@/postgres?host=/var/run/postgresql"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


async def load(base: str, calls: int, concurrency: int, stream: bool, gateway: bool, tag: str) -> Result:
    """``calls`` chat calls from ``concurrency`` workers; each worker is one rollout (gateway path)."""
    body_template = {
        "model": "m",
        "max_tokens": COMPLETION_TOKENS,
        "stream": stream,
        "messages": [{"role": "user", "content": "x" * PROMPT_TOKENS}],
    }
    latencies: list[float] = []
    counter = iter(range(calls))
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(w: int) -> None:
            prefix = f"/rollouts/{tag}-{w}/attempts/0" if gateway else ""
            url = f"{base}{prefix}/v1/chat/completions"
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


def copy_ceiling(pg_url: str, rows: int) -> float:
    """Calls/s for COPY of already-encoded llm_calls rows of the benchmark's size into a scratch table."""
    import psycopg

    from harnessrl.proxy.capture import Attribution, build_call_record
    from harnessrl.proxy.fake_upstream import completion_ids, encode, render_chat, token_logprob
    from harnessrl.proxy.protocol import Tokens
    from harnessrl.store import CallStatus, codec
    from harnessrl.store.call_rows import prepare_call

    messages = [{"role": "user", "content": "x" * PROMPT_TOKENS}]
    prompt = encode(render_chat(messages))[:PROMPT_TOKENS]
    encoded = []
    for i in range(rows):
        ids = completion_ids(COMPLETION_TOKENS, i)
        response = {
            "id": f"c{i}",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(f" t{t}" for t in ids)},
                    "finish_reason": "length",
                    "token_ids": ids,
                }
            ],
            "prompt_token_ids": prompt,
        }
        rec = build_call_record(
            who=Attribution("bench", f"copy-{i % 64}", 0),
            seq=i // 64,
            route="chat",
            request={"model": "m", "messages": messages, "max_tokens": COMPLETION_TOKENS},
            response=response,
            tokens=Tokens(prompt, ids, [token_logprob(t) for t in ids], "length"),
            policy_version=0,
            upstream="http://u",
            latency_s=0.01,
            status=CallStatus.OK,
            http_status=200,
        )
        encoded.append(prepare_call(rec).encode(None))
    columns = list(encoded[0])
    json_cols = {"request", "response", "response_stripped"}
    conninfo = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo) as conn:
        conn.execute("CREATE TEMP TABLE copy_ceiling (LIKE llm_calls)")
        start = time.perf_counter()
        with conn.cursor() as cur, cur.copy(f"COPY copy_ceiling ({', '.join(columns)}) FROM STDIN") as copy:
            for row in encoded:
                copy.write_row(
                    [
                        codec.dumps(row[c]) if c in json_cols and row[c] is not None else row[c]
                        for c in columns
                    ]
                )
        conn.commit()
        return rows / (time.perf_counter() - start)


def writer_drain_rate(pg_url: str, calls: int, tmp: Path) -> float:
    """Calls/s the proxy's writer thread sustains into the store (its queue pre-filled, no HTTP)."""
    from harnessrl.proxy.capture import Attribution, build_call_record
    from harnessrl.proxy.fake_upstream import completion_ids, encode, render_chat, token_logprob
    from harnessrl.proxy.metrics import ProxyMetrics
    from harnessrl.proxy.protocol import Tokens
    from harnessrl.proxy.spool import Spool
    from harnessrl.proxy.writer import CallItem, TraceWriter
    from harnessrl.store import CallStatus, TraceStore

    messages = [{"role": "user", "content": "x" * PROMPT_TOKENS}]
    prompt = encode(render_chat(messages))[:PROMPT_TOKENS]
    store = TraceStore.connect(pg_url)
    writer = TraceWriter(store, Spool(tmp / "drain.spool"), ProxyMetrics(), batch_size=256)
    items = []
    for i in range(calls):
        ids = completion_ids(COMPLETION_TOKENS, i)
        response = {
            "id": f"c{i}",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(f" t{t}" for t in ids)},
                    "finish_reason": "length",
                    "token_ids": ids,
                }
            ],
            "prompt_token_ids": prompt,
        }
        items.append(
            CallItem(
                build_call_record(
                    who=Attribution("bench", f"drain-{i % 64}", 0),
                    seq=i // 64,
                    route="chat",
                    request={"model": "m", "messages": messages, "max_tokens": COMPLETION_TOKENS},
                    response=response,
                    tokens=Tokens(prompt, ids, [token_logprob(t) for t in ids], "length"),
                    policy_version=0,
                    upstream="http://u",
                    latency_s=0.01,
                    status=CallStatus.OK,
                    http_status=200,
                )
            )
        )
    for item in items:
        writer.put(item)
    start = time.perf_counter()
    writer.start()
    if not writer.flush(600):
        raise RuntimeError("writer did not drain")
    rate = calls / (time.perf_counter() - start)
    writer.close(10)
    store.close()
    return rate


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


async def run(args: argparse.Namespace, pg_url: str, tmp: Path) -> None:
    upstream, proxy, direct, proxied = start_servers(pg_url, tmp)
    sent = 0
    rss: dict[str, float] = {}
    try:
        await wait_healthy(f"{direct}/health")
        await wait_healthy(f"{proxied}/healthz")
        await load(direct, 50, 8, False, False, "warm")
        await load(proxied, 50, 8, False, True, "warm")
        sent += 50
        rows = []
        plan = [(1, False), (1, True), (64, False), (64, True)]
        for concurrency, stream in plan:
            n = args.calls_c1 if concurrency == 1 else args.calls_c64
            d = await load(direct, n, concurrency, stream, False, "d")
            p = await load(proxied, n, concurrency, stream, True, f"p{concurrency}{int(stream)}")
            sent += n
            rows.append((concurrency, stream, d, p))
            if "1k" not in rss and sent >= 1000:
                rss["1k"] = rss_mib(proxy.pid)
        soak_start, soak_calls = time.perf_counter(), max(0, args.total - sent)
        soak = await load(proxied, soak_calls, 64, False, True, "soak") if soak_calls else None
        sent += soak_calls
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{proxied}/admin/flush", json={"timeout_s": 600}) as resp,
        ):
            flushed = (await resp.json())["flushed"]
        capture_seconds = time.perf_counter() - soak_start
        rss[f"{sent // 1000}k"] = rss_mib(proxy.pid)
    finally:
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
    stored = stored_calls(pg_url)
    print(
        f"\nproxied calls sent: {sent}; stored: {stored} ({'all' if stored == sent else 'MISSING SOME'}); "
        f"flush ok: {flushed}; proxy exit code on SIGTERM: {proxy_rc}"
    )
    ceiling = copy_ceiling(pg_url, args.copy_rows)
    drain = writer_drain_rate(pg_url, args.copy_rows, tmp)
    print(f"PostgreSQL COPY ceiling (pre-encoded rows, one client): {ceiling:,.0f} calls/s")
    print(
        f"proxy writer sustained rate (encode + add_calls batches, queue pre-filled): {drain:,.0f} calls/s "
        f"= {drain / ceiling:.2f}x the ceiling"
    )
    if soak is not None:
        end_to_end = soak_calls / capture_seconds
        print(
            f"end-to-end capture during the soak (HTTP in, stored in PostgreSQL, concurrency 64): "
            f"{end_to_end:,.0f} calls/s = {end_to_end / ceiling:.2f}x the ceiling"
        )
    print("proxy RSS: " + ", ".join(f"after {k} calls {v:.0f} MiB" for k, v in rss.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (smoke run)")
    parser.add_argument(
        "--pg",
        default=os.environ.get("HARNESSRL_BENCH_PG_URL")
        or os.environ.get("HARNESSRL_TEST_PG_URL")
        or DEFAULT_PG,
    )
    args = parser.parse_args()
    args.calls_c1, args.calls_c64, args.total, args.copy_rows = (
        (100, 500, 2000, 1000) if args.quick else (500, 3000, 20000, 3000)
    )
    admin = create_engine(
        make_url(args.pg).set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT"
    )
    name = f"harnessrl_bench_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    pg_url = (
        make_url(args.pg)
        .set(drivername="postgresql+psycopg", database=name)
        .render_as_string(hide_password=False)
    )
    try:
        from harnessrl.store import TraceStore

        store = TraceStore.connect(pg_url)
        store.upgrade()
        store.close()
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(run(args, pg_url, Path(tmp)))
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


if __name__ == "__main__":
    main()
