"""Database connections of many harness pods: N real proxy processes writing to one PostgreSQL.

Every harness pod runs a ``harnessrl proxy`` sidecar, so a run's concurrent pods share the database's
``max_connections`` (the chart's ``postgresql.maxConnections``). This starts N proxy processes configured as
the operator configures sidecars (one rollout each, ``HARNESSRL_STORE_POOL_SIZE=1``), one fast fake upstream
(``harnessrl.proxy.fake_upstream``) and, here, one load generator in which each "pod" sends chat calls one
after another with a pause between them (the harness's tool time, ``--think``). PostgreSQL is the server at
``--pg`` (a fresh database on it); start it as the chart does, e.g.

    HARNESSRL_PG_MAX_CONNECTIONS=500 . scripts/postgres.sh && start_postgres
    python bench/db_connections.py --proxies 200

Printed: the proxies; the server's max_connections beside the chart's default; peak client connections to the
benchmark database (``pg_stat_activity``, sampled every 0.25 s) while the pods start, while they send calls,
and after ``--idle`` seconds with no calls (the proxies close idle connections after
``HARNESSRL_STORE_RELEASE_IDLE_S``, 5 s); calls answered, calls stored (after every proxy's flush) and stored
calls/s; errors (HTTP answers other than 200 and the proxies' ``write_errors_total`` by kind, outages
included); RSS of the proxies together and the PSS of the PostgreSQL backends at the peak. The last line is
for scripts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import yaml
from proxy_overhead import free_port, rss_mib, stored_calls, wait_healthy
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from store_write import add_pg_option, fresh_pg_database

from harnessrl.store import TraceStore
from harnessrl.store.engine import POOL_SIZE_ENV

CHART_VALUES = Path(__file__).resolve().parents[1] / "charts" / "harnessrl" / "values.yaml"
PROMPT_TOKENS = 300
COMPLETION_TOKENS = 50
START_BATCH = 16  # proxies started at once (each imports for ~1 s of CPU)


class ConnectionSampler:
    """Counts the client connections to one database every 0.25 s; keeps the peak of the current phase."""

    def __init__(self, url: str, database: str) -> None:
        self.engine = create_engine(url, pool_size=1)
        self.database = database
        self.peak = 0
        self.peak_pss_mib = 0.0
        self.last = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def phase(self) -> int:
        """The peak since the last call (and start a new phase)."""
        peak, self.peak = self.peak, 0
        return peak

    def _run(self) -> None:
        query = text(
            "SELECT pid FROM pg_stat_activity WHERE datname = :db AND backend_type = 'client backend' "
            "AND pid <> pg_backend_pid()"
        )
        while not self._stop.is_set():
            with self.engine.connect() as conn:
                pids = [row[0] for row in conn.execute(query, {"db": self.database})]
            self.last = len(pids)
            if self.last > self.peak:
                self.peak = self.last
                self.peak_pss_mib = max(self.peak_pss_mib, sum(pss_mib(pid) for pid in pids))
            self._stop.wait(0.25)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.engine.dispose()


def pss_mib(pid: int) -> float:
    """Proportional set size of a process (shared pages split among their users), 0 when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def start_proxies(n: int, upstream: str, url: str, tmp: Path) -> list[tuple[subprocess.Popen, str]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HARNESSRL_") or k.startswith("HARNESSRL_TEST")}
    proxies = []
    ports: set[int] = set()
    for i in range(n):
        port = free_port()
        while port in ports:  # free now, but not yet bound by the proxy given it a moment ago
            port = free_port()
        ports.add(port)
        env = {
            **base,
            "PYTHONUNBUFFERED": "1",
            "HARNESSRL_UPSTREAMS": upstream,
            "HARNESSRL_STORE_URL": url,
            "HARNESSRL_RUN": "bench",
            "HARNESSRL_ROLLOUT_ID": f"pod-{i}",
            "HARNESSRL_PROXY_PORT": str(port),
            "HARNESSRL_SPOOL_PATH": str(tmp / f"spool-{i}.jsonl"),
            POOL_SIZE_ENV: "1",  # as the operator sets it for every sidecar
        }
        cmd = [sys.executable, "-m", "harnessrl.cli", "proxy", "--log-level", "WARNING"]
        proxies.append((subprocess.Popen(cmd, env=env, cwd=tmp), f"http://127.0.0.1:{port}"))
    return proxies


async def wait_all_healthy(proxies: list[tuple[subprocess.Popen, str]]) -> None:
    for start in range(0, len(proxies), START_BATCH):
        await asyncio.gather(*(wait_healthy(f"{base}/healthz", 600) for _, base in proxies[start:start + START_BATCH]))


async def pods(bases: list[str], seconds: float, think: float) -> tuple[int, dict[str, int]]:
    """Each pod sends calls to its own proxy until ``seconds`` pass; (answered, errors by kind)."""
    body = {"model": "m", "max_tokens": COMPLETION_TOKENS, "messages": [{"role": "user", "content": "x" * PROMPT_TOKENS}]}
    answered = 0
    errors: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(bases) + 8)) as session:

        async def pod(i: int, base: str) -> None:
            nonlocal answered
            await asyncio.sleep(think * i / len(bases))  # spread the first calls over one pause
            while time.monotonic() < deadline:
                try:
                    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                        await resp.read()
                        kind = None if resp.status == 200 else f"http_{resp.status}"
                except aiohttp.ClientError as exc:
                    kind = type(exc).__name__
                if kind is None:
                    answered += 1
                else:
                    errors[kind] = errors.get(kind, 0) + 1
                await asyncio.sleep(think)

        await asyncio.gather(*(pod(i, base) for i, base in enumerate(bases)))
    return answered, errors


async def flush_all(bases: list[str]) -> tuple[int, dict[str, float]]:
    """Flush every proxy; (proxies not flushed, write errors by kind summed over the proxies)."""
    from prometheus_client.parser import text_string_to_metric_families

    unflushed = 0
    write_errors: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for base in bases:
            async with session.post(f"{base}/admin/flush", json={"timeout_s": 300}) as resp:
                unflushed += not (await resp.json())["flushed"]
            async with session.get(f"{base}/metrics") as resp:
                for family in text_string_to_metric_families(await resp.text()):
                    for sample in family.samples:
                        if sample.name == "harnessrl_proxy_write_errors_total":
                            kind = sample.labels.get("kind", "")
                            write_errors[kind] = write_errors.get(kind, 0) + sample.value
    return unflushed, write_errors


def run(args: argparse.Namespace, url: str, tmp: Path) -> None:
    chart_default = yaml.safe_load(CHART_VALUES.read_text())["postgresql"]["maxConnections"]
    store = TraceStore.connect(url)
    store.upgrade()
    with store.engine.connect() as conn:
        server_max = int(conn.execute(text("SHOW max_connections")).scalar_one())
    store.close()
    print(f"proxies={args.proxies}  server max_connections={server_max}  (chart default {chart_default})")
    database = make_url(url).database
    sampler = ConnectionSampler(url, database)
    sampler.start()
    up_port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "harnessrl.proxy.fake_upstream", "--port", str(up_port),
         "--prompt-tokens", str(PROMPT_TOKENS), "--max-tokens", str(COMPLETION_TOKENS)],
        cwd=tmp,
    )
    proxies = start_proxies(args.proxies, f"http://127.0.0.1:{up_port}", url, tmp)
    bases = [base for _, base in proxies]
    try:
        started = time.monotonic()
        asyncio.run(wait_healthy(f"http://127.0.0.1:{up_port}/health", 120))
        asyncio.run(wait_all_healthy(proxies))
        print(f"started in {time.monotonic() - started:.0f} s; peak connections while starting: {sampler.phase()}")
        pss = sum(pss_mib(p.pid) for p, _ in proxies)
        answered, http_errors = asyncio.run(pods(bases, args.seconds, args.think))
        load_peak = sampler.phase()
        load_pss = sampler.peak_pss_mib
        unflushed, write_errors = asyncio.run(flush_all(bases))
        stored = stored_calls(url)
        rss_after = sum(rss_mib(p.pid) for p, _ in proxies)
        pss_after = sum(pss_mib(p.pid) for p, _ in proxies)
        time.sleep(args.idle)
        idle_now = sampler.last
        print(f"calls: answered={answered} stored={stored} stored/s={stored / args.seconds:.0f} "
              f"({args.seconds:g} s of calls, {args.think:g} s between a pod's calls)")
        print(f"peak connections: {load_peak} while the pods sent calls ({load_peak / args.proxies:.2f} per proxy, "
              f"{load_peak / server_max:.0%} of max_connections); {idle_now} after {args.idle:g} s idle")
        print(f"errors: http={sum(http_errors.values())} {http_errors}  proxy write errors {write_errors}  "
              f"proxies not flushed={unflushed}")
        print(f"memory: proxies PSS {pss / 1024:.1f} GiB after start, {pss_after / 1024:.1f} GiB after the calls "
              f"({pss_after / args.proxies:.0f} MiB each, RSS {rss_after / args.proxies:.0f} MiB counting shared "
              f"pages); PostgreSQL backends PSS {load_pss:.0f} MiB at the peak")
        print(f"proxies={args.proxies} peak_connections={load_peak} idle_connections={idle_now} "
              f"stored_calls_per_s={stored / args.seconds:.1f} lost={answered - stored} "
              f"http_errors={sum(http_errors.values())} write_errors={sum(write_errors.values()):.0f} "
              f"proxies_pss_gib={pss_after / 1024:.1f}")
    finally:
        for proc, _ in proxies:
            proc.terminate()
        for proc, _ in proxies:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        upstream.terminate()
        upstream.wait(10)
        sampler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxies", type=int, default=200, help="proxy processes (harness pods); the operator "
                        "benchmark's concurrency by default")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the pods send calls")
    parser.add_argument("--think", type=float, default=2.0, help="seconds between a pod's calls (tool time)")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds without calls before the last count")
    add_pg_option(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="harnessrl-db-connections-") as tmp, fresh_pg_database(args.pg) as url:
        run(args, url, Path(tmp))


if __name__ == "__main__":
    main()
