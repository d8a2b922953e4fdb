"""Trace-store write throughput: ``TraceStore.add_calls`` on SQLite and PostgreSQL beside the raw COPY ceiling.

The proxy's writer thread runs ``add_calls`` and shares the GIL with the request path, so every millisecond of
Python it spends per call is taken from serving. This measures that cost on realistic calls: chat trajectories
from ``tests/synthetic_calls.py`` (a 1k-token system prompt, short observations, 200-token completions,
vLLM-shaped request/response with token ids and chat log-probs), each call resending the whole history, so all
but the first call of a rollout are stored as deltas. Calls are written in batches (default 256) ordered by
turn across rollouts, the way the proxy's queue interleaves live rollouts; each call's predecessor is either
in the same batch or already stored.

Printed per database: calls/s by wall time and CPU ms per call of this process (the GIL cost), for the whole
capture path (``add_calls`` on ``CallRecord``s: ``prepare_call`` then the writer) and for the writer
alone (``add_calls`` on calls ``prepare_call`` made beforehand, as the proxy hands them over). For
PostgreSQL also the ceiling: COPY of the rows the writer stored (read back, deltas as stored), already
encoded, from one client, in the text and binary formats; ratios are to the faster of the two. The three
PostgreSQL measurements take turns, ``--rounds`` times, each into a fresh database, and the medians are
compared: the machine is shared, so only rates measured side by side count.
The last line is ``name=value`` pairs for scripts.

    python bench/store_write.py                       # SQLite and PostgreSQL, 2048 calls each
    python bench/store_write.py --quick               # PostgreSQL only, 1024 calls, 3 rounds
    python bench/store_write.py --profile postgresql  # cProfile of the add_calls batches, top 25 by tottime
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
import uuid
from typing import Any
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from synthetic_calls import chat_trajectory

from harnessrl.store import CallRecord, TraceStore, codec
from harnessrl.store.call_rows import PreparedCall, prepare_call

DEFAULT_PG = "postgresql+psycopg://postgres@/postgres?host=/var/run/postgresql"


def make_calls(rollouts: int, turns: int) -> list[CallRecord]:
    """``rollouts`` x ``turns`` calls, interleaved by turn (what a proxy serving many rollouts writes)."""
    per_rollout = [
        chat_trajectory(
            f"r{r}", turns, system_tokens=1000, observation_tokens=60, completion_tokens=200, seed=r
        )
        for r in range(rollouts)
    ]
    return [trajectory[t] for t in range(turns) for trajectory in per_rollout]


def write_rate(
    url: str, calls: Sequence[CallRecord | PreparedCall], batch: int, profile: bool
) -> tuple[float, float]:
    """(calls/s by wall time, CPU ms per call) of ``add_calls`` over ``calls`` in batches of ``batch``."""
    store = TraceStore.connect(url)
    store.upgrade()
    profiler = cProfile.Profile() if profile else None
    wall, cpu = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    for start in range(0, len(calls), batch):
        inserted = store.add_calls(calls[start : start + batch])
        assert inserted == len(calls[start : start + batch]), "benchmark calls must all be new"
    if profiler:
        profiler.disable()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    store.close()
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return len(calls) / wall, cpu / len(calls) * 1e3


FOREIGN_KEYS = (
    "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
    "WHERE conrelid = 'llm_calls'::regclass AND contype = 'f'"
)


def copy_ceiling(url: str, calls: list[CallRecord], *, as_stored: bool = False) -> dict[str, float]:
    """Calls/s for COPY of the same calls' rows (encoded in full beforehand), from one client, into a table
    shaped like ``llm_calls`` with its indexes, in PostgreSQL's text and binary COPY formats (the store writes
    binary). Not a temp table: that writes no WAL, so it measured a rate no write to ``llm_calls`` can reach
    (foreign keys are left out: their checks count against the store).

    ``as_stored``: the rows are the ones the writer stored for ``calls`` in ``url`` (most of them deltas),
    read back as they are, so the ceiling copies exactly the bytes the writer did; otherwise every call is
    encoded in full, which copies several times the bytes of a delta and is no ceiling for the writer."""
    if as_stored:
        columns, values = _stored_rows(url, [c.call_id for c in calls])
    else:
        rows = [prepare_call(c).encode(None) for c in calls]
        columns = list(rows[0])
        json_cols = {"request", "response", "response_stripped"}
        values = [
            [codec.dumps(row[c]) if c in json_cols and row[c] is not None else row[c] for c in columns]
            for row in rows
        ]
    conninfo = _conninfo(url)
    found = {fmt: len(values) / _copy_seconds(conninfo, columns, values, fmt) for fmt in ("text", "binary")}
    if as_stored:  # what the schema's foreign keys cost: the store pays it, the ceiling does not
        seconds = _copy_seconds(conninfo, columns, values, "binary", foreign_keys=True)
        found["binary_fk"] = len(values) / seconds
    return found


def _conninfo(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _stored_rows(url: str, call_ids: list[str]) -> tuple[list[str], list[list[Any]]]:
    """(columns, values) of the stored ``llm_calls`` rows of ``call_ids``, JSON columns as their text."""
    import psycopg
    from psycopg.types.string import TextLoader

    with psycopg.connect(_conninfo(url)) as conn:
        for name in ("json", "jsonb"):
            conn.adapters.register_loader(name, TextLoader)
        cur = conn.execute("SELECT * FROM llm_calls WHERE call_id = ANY(%s) ORDER BY call_id", [call_ids])
        columns = [d.name for d in cur.description]
        values = [list(row) for row in cur.fetchall()]
    assert len(values) == len(call_ids), "the calls must be stored first"
    return columns, values


def _copy_seconds(
    conninfo: str, columns: list[str], values: list[list], fmt: str, foreign_keys: bool = False
) -> float:
    """Seconds to COPY ``values`` into a fresh table like ``llm_calls``; ``foreign_keys``: with its foreign
    keys too (to the rows the writer made), which the store must check for every row."""
    import psycopg
    from psycopg.types.json import set_json_dumps

    from harnessrl.store.call_copy import COLUMN_TYPES

    table = f"copy_ceiling_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(conninfo, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {table} (LIKE llm_calls INCLUDING ALL)")
        types = dict(admin.execute(COLUMN_TYPES).fetchall())
        if foreign_keys:
            for (definition,) in admin.execute(FOREIGN_KEYS).fetchall():
                admin.execute(f"ALTER TABLE {table} ADD {definition}")
    try:
        with psycopg.connect(conninfo) as conn, conn.cursor() as cur:
            set_json_dumps(lambda text: text, cur)  # the JSON values are text already
            start = time.perf_counter()
            with cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN (FORMAT {fmt.upper()})") as copy:
                if fmt == "binary":
                    copy.set_types([types[c] for c in columns])
                for row in values:
                    copy.write_row(row)
            conn.commit()
            return time.perf_counter() - start
    finally:
        with psycopg.connect(conninfo, autocommit=True) as admin:
            admin.execute(f"DROP TABLE {table}")


def add_pg_option(parser: argparse.ArgumentParser) -> None:
    """``--pg``: the server a fresh benchmark database is made on (env, else the local socket)."""
    parser.add_argument(
        "--pg",
        default=os.environ.get("HARNESSRL_BENCH_PG_URL")
        or os.environ.get("HARNESSRL_TEST_PG_URL")
        or DEFAULT_PG,
    )


@contextmanager
def fresh_pg_database(admin_url: str) -> Iterator[str]:
    admin = create_engine(
        make_url(admin_url).set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT"
    )
    name = f"harnessrl_bench_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield (
            make_url(admin_url)
            .set(drivername="postgresql+psycopg", database=name)
            .render_as_string(hide_password=False)
        )
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def postgres_rounds(
    admin_url: str, calls: list[CallRecord], batch: int, rounds: int, profile: bool
) -> dict[str, float]:
    """Medians over ``rounds`` of: the whole capture path, the writer alone, and the COPY ceiling (text and
    binary), taking turns, each into a fresh database."""
    found: dict[str, list[float]] = {}
    for round_ in range(rounds):
        with fresh_pg_database(admin_url) as url:
            rate, cpu_ms = write_rate(url, calls, batch, profile and round_ == 0)
        found.setdefault("capture", []).append(rate)
        found.setdefault("capture_cpu_ms", []).append(cpu_ms)
        prepared = [prepare_call(c) for c in calls]  # a fresh PreparedCall each round: encode() fills it in
        with fresh_pg_database(admin_url) as url:
            rate, cpu_ms = write_rate(url, prepared, batch, False)
            ceilings = copy_ceiling(url, calls, as_stored=True)
        found.setdefault("writer", []).append(rate)
        found.setdefault("writer_cpu_ms", []).append(cpu_ms)
        for fmt, value in ceilings.items():
            found.setdefault(fmt, []).append(value)
    return {name: statistics.median(values) for name, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=256, help="rollouts written side by side")
    parser.add_argument("--turns", type=int, default=8, help="calls per rollout")
    parser.add_argument("--batch", type=int, default=256, help="calls per add_calls")
    parser.add_argument("--rounds", type=int, default=3, help="PostgreSQL measurements, taking turns")
    parser.add_argument("--only", choices=["sqlite", "postgresql"], help="measure one database")
    parser.add_argument("--quick", action="store_true", help="PostgreSQL only, 128 rollouts")
    parser.add_argument("--profile", choices=["sqlite", "postgresql"], help="cProfile this database's run")
    add_pg_option(parser)
    args = parser.parse_args()
    if args.quick:
        args.only, args.rollouts = args.only or "postgresql", 128
    calls = make_calls(args.rollouts, args.turns)
    prompt = sum(len(c.prompt_token_ids) for c in calls) / len(calls)
    print(
        f"{len(calls)} calls ({args.rollouts} rollouts x {args.turns} turns), mean prompt {prompt:.0f} tokens, "
        f"200 completion tokens, batches of {args.batch}, {os.cpu_count()} CPUs (shared), "
        f"load {os.getloadavg()[0]:.1f}"
    )
    targets = [args.only] if args.only else ["sqlite", "postgresql"]
    summary = ""
    for db in targets:
        if db == "sqlite":
            with tempfile.TemporaryDirectory() as tmp:
                rate, cpu_ms = write_rate(f"sqlite:///{tmp}/store.db", calls, args.batch, args.profile == db)
            print(f"sqlite      add_calls: {rate:8,.0f} calls/s, {cpu_ms:.3f} CPU ms/call in this process")
            summary = f"sqlite_calls_per_s={rate:.0f}"
        else:
            m = postgres_rounds(args.pg, calls, args.batch, args.rounds, args.profile == db)
            ceiling = max(m["text"], m["binary"])
            print(
                f"postgresql  binary COPY of the stored rows into a table with llm_calls' foreign keys: "
                f"{m['binary_fk']:8,.0f} calls/s = {m['binary_fk'] / ceiling:.2f}x of the ceiling"
            )
            print(
                f"postgresql  COPY ceiling (the stored rows, pre-encoded): {ceiling:8,.0f} calls/s "
                f"(binary {m['binary']:,.0f}, text {m['text']:,.0f}); medians of {args.rounds} rounds"
            )
            for name, label in (("capture", "capture path (prepare + write)"), ("writer", "writer alone")):
                print(
                    f"postgresql  {label:31s}: {m[name]:8,.0f} calls/s, {m[name + '_cpu_ms']:.3f} CPU "
                    f"ms/call in this process = {m[name] / ceiling:.2f}x of the ceiling"
                )
            summary = (
                f"writer_over_copy={m['writer'] / ceiling:.3f} "
                f"capture_over_copy={m['capture'] / ceiling:.3f} "
                f"writer_cpu_ms_per_call={m['writer_cpu_ms']:.3f} "
                f"capture_cpu_ms_per_call={m['capture_cpu_ms']:.3f} copy_calls_per_s={ceiling:.0f} "
                f"copy_fk_over_copy={m['binary_fk'] / ceiling:.3f}"
            )
    print(summary)


if __name__ == "__main__":
    main()
