"""Trace explorer server time on a large store: the rollout list and a rollout page at p50 and p95.

A store is filled with synthetic chat trajectories (``tests/synthetic_calls.py``: vLLM-shaped requests and
responses, each call resending the whole history, so all but the first call of a rollout are deltas) through
the store's real writer (``TraceStore.add_calls``), in groups of 8 rollouts per task; rollouts are settled
succeeded (a reward) or failed and consumed by learner steps of 8 groups (``LearnerLedger.commit``), so every
filter and sort of the list has something to select. Then the UI's aiohttp application answers real HTTP
requests on localhost (``harnessrl.ui.app.make_app`` over a read-only engine) and each request's wall time is
taken: the rollout list under several filters, sorts and a deep page, and the rollout page of random rollouts
(conversation, the learner's rows and its group's advantages). Goal (issue 23): p95 under 300 ms on 2 cores.

    python bench/ui.py                          # 1,000,000 calls on SQLite (the fill takes a long while)
    python bench/ui.py --calls 100000 --pg      # a smaller store, on PostgreSQL as well
    python bench/ui.py --store sqlite:///big.db --keep   # fill once, measure again later with --store
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from sqlalchemy import bindparam, func, select, update

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_write import add_pg_option, fresh_pg_database
from synthetic_calls import chat_trajectory

from harnessrl.store import RolloutState, TraceStore
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.store.schema import LlmCall, RolloutAttempt
from harnessrl.store.states import Move

RUN = "bench"
GROUP, GROUPS_PER_STEP = 8, 8


def fill(url: str, calls: int, turns: int, log_every: int = 50_000) -> None:
    """``calls`` calls in ``calls / turns`` rollouts, written by ``add_calls`` in batches of whole groups."""
    store = TraceStore.connect(url)
    store.upgrade()
    ledger = LearnerLedger(store, RUN)
    ledger.ensure_base_version("/bench/v0")
    rollouts = calls // turns
    groups = rollouts // GROUP
    store.add_tasks(RUN, [{"id": f"task-{g}", "data": {"n": g}} for g in range(groups)])
    rng = random.Random(0)
    # 64 distinct trajectories, relabelled per rollout: generating each one would cost more than storing it
    templates = [chat_trajectory("t", turns, system_tokens=300, observation_tokens=40, completion_tokens=40,
                                 seed=seed, run=RUN) for seed in range(64)]
    written, started, pending = 0, time.perf_counter(), []
    version = 0
    for g in range(groups):
        ids = store.create_rollouts(RUN, f"task-{g}", [(f"r{g:07d}-{i}", i) for i in range(GROUP)])
        store.try_transitions([Move(r, 0, RolloutState.QUEUED, RolloutState.RUNNING, None, version) for r in ids])
        batch = [replace(call, call_id=f"{rollout_id}-{call.seq}", rollout_id=rollout_id, policy_version=version)
                 for i, rollout_id in enumerate(ids) for call in templates[(g * GROUP + i) % len(templates)]]
        store.add_calls(batch)
        failed = {r for r in ids if rng.random() < 0.15}
        rewards = [{"k": r, "v": round(rng.random(), 3)} for r in ids if r not in failed]
        with store.engine.begin() as conn:  # the rewards of a group at once (the harness path is one per call)
            conn.execute(update(RolloutAttempt).where(RolloutAttempt.rollout_id == bindparam("k"),
                                                      RolloutAttempt.attempt == 0)
                         .values(reward=bindparam("v")), rewards)
        store.try_transitions([Move(r, 0, RolloutState.RUNNING, RolloutState.FAILED if r in failed else
                                    RolloutState.SUCCEEDED, "HarnessFailed: exit code 1" if r in failed else None)
                               for r in ids])
        pending += [(r, 0) for r in ids]
        if (g + 1) % GROUPS_PER_STEP == 0:
            version = ledger.commit((g + 1) // GROUPS_PER_STEP, f"/bench/v{version + 1}", {"rows": len(pending)},
                                    pending)
            pending = []
        written += len(batch)
        if written // log_every != (written - len(batch)) // log_every:
            rate = written / (time.perf_counter() - started)
            print(f"  {written:,} calls written, {rate:,.0f} calls/s", flush=True)
    store.close()


LIST_QUERIES = {
    "newest first (default)": "",
    "state=failed": "state=failed",
    "sort by reward": "sort=reward",
    "reward >= 0.9, by reward ascending": "reward_min=0.9&sort=reward&order=asc",
    "step=N (middle)": "step={step}",
    "version=N, by step": "version={version}&sort=step",
    "task=T": "task=task-{group}",
    "page 200 of the default": "page=200",
}


INDEXES_0007 = ("ix_rollout_attempts_run_created_at", "ix_rollout_attempts_run_reward",
                "ix_rollout_attempts_run_policy_version_start", "ix_rollout_attempts_run_consumed_by_step")


async def measure(url: str, samples: int, compare_indexes: bool) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from harnessrl.store.engine import open_engine
    from harnessrl.ui.app import make_app
    from harnessrl.ui.store_access import open_read_only

    engine = open_read_only(url)
    with engine.connect() as conn:
        steps = conn.scalar(select(func.max(RolloutAttempt.consumed_by_step)).where(RolloutAttempt.run == RUN))
        calls = conn.scalar(select(func.count()).select_from(LlmCall))
        attempts = conn.scalar(select(func.count()).select_from(RolloutAttempt))
    print(f"store: {calls:,} calls, {attempts:,} rollout attempts, {steps} learner steps; {os.cpu_count()} CPUs "
          f"(shared), {samples} requests per line, times in ms")
    rng = random.Random(1)
    groups = attempts // GROUP
    list_paths = {name: [f"/runs/{RUN}/rollouts?" + query.format(
        step=rng.randint(1, steps), version=rng.randint(0, steps), group=rng.randrange(groups))
        for _ in range(samples)] for name, query in LIST_QUERIES.items()}
    rollout_paths = [f"/runs/{RUN}/rollouts/r{rng.randrange(groups):07d}-{rng.randrange(GROUP)}"
                     for _ in range(samples)]
    async with TestClient(TestServer(make_app(engine))) as client:
        await client.get(f"/runs/{RUN}/rollouts/r0000000-0")  # the first rollout page imports the learner (torch)

        async def timed(paths: list[str]) -> tuple[float, float]:
            times = []
            for path in paths:
                start = time.perf_counter()
                response = await client.get(path)
                await response.read()
                assert response.status == 200, (path, response.status)
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times), statistics.quantiles(times, n=20)[18]

        with_indexes = {name: await timed(paths) for name, paths in list_paths.items()}
        without: dict[str, tuple[float, float]] = {}
        if compare_indexes:  # the same requests on the same store without migration 0007's indexes
            writer = open_engine(url)
            with writer.begin() as conn:
                for index in INDEXES_0007:
                    conn.exec_driver_sql(f"DROP INDEX {index}")
            try:
                without = {name: await timed(paths) for name, paths in list_paths.items()}
            finally:
                with writer.begin() as conn:
                    for index, (_, columns) in zip(INDEXES_0007, _index_columns(), strict=True):
                        conn.exec_driver_sql(f"CREATE INDEX {index} ON rollout_attempts ({columns})")
                writer.dispose()
        print("rollout list (/runs/RUN/rollouts?...)" + ("   [without 0007's indexes: p50 p95, p95 ratio]"
                                                         if without else ""))
        for name, (p50, p95) in with_indexes.items():
            line = f"  {name:40s} p50 {p50:7.1f}   p95 {p95:7.1f}"
            if name in without:
                w50, w95 = without[name]
                line += f"   [{w50:7.1f} {w95:7.1f}, {w95 / p95:5.1f}x]"
            print(line)
        p50, p95 = await timed(rollout_paths)
        print("rollout page (/runs/RUN/rollouts/ID: conversation, learner rows, group advantages):")
        print(f"  {'random rollout':40s} p50 {p50:7.1f}   p95 {p95:7.1f}")
        print("not goals of the issue, for scale (5 requests each):")
        for name, path in (("runs page", "/"), ("run overview (harnessrl status's summary)", f"/runs/{RUN}"),
                           ("failures (latest 200 grouped)", f"/runs/{RUN}/failures")):
            p50, p95 = await timed([path] * 5)
            print(f"  {name:40s} p50 {p50:7.1f}   p95 {p95:7.1f}")
    engine.dispose()


def _index_columns() -> list[tuple[str, str]]:
    return [(index, "run, " + index.removeprefix("ix_rollout_attempts_run_")) for index in INDEXES_0007]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000, help="calls in the store")
    parser.add_argument("--turns", type=int, default=10, help="calls per rollout")
    parser.add_argument("--samples", type=int, default=40, help="requests per measured line")
    parser.add_argument("--store", help="measure this filled store (a URL) instead of filling a new one")
    parser.add_argument("--keep", action="store_true", help="fill --store (SQLite) and keep it")
    parser.add_argument("--postgresql", action="store_true", help="on a fresh PostgreSQL database (--pg)")
    parser.add_argument("--no-index-comparison", action="store_true",
                        help="skip measuring the list again without migration 0007's indexes")
    add_pg_option(parser)
    args = parser.parse_args()
    if args.store and not args.keep:
        asyncio.run(measure(args.store, args.samples, not args.no_index_comparison))
        return
    print(f"filling a store with {args.calls:,} calls ({args.turns} per rollout) through TraceStore.add_calls ...")
    if args.postgresql:
        with fresh_pg_database(args.pg) as url:
            started = time.perf_counter()
            fill(url, args.calls, args.turns)
            print(f"filled in {time.perf_counter() - started:.0f} s")
            asyncio.run(measure(url, args.samples, not args.no_index_comparison))
        return
    with tempfile.TemporaryDirectory() as tmp:
        url = args.store or f"sqlite:///{tmp}/ui-bench.db"
        started = time.perf_counter()
        fill(url, args.calls, args.turns)
        print(f"filled in {time.perf_counter() - started:.0f} s")
        asyncio.run(measure(url, args.samples, not args.no_index_comparison))


if __name__ == "__main__":
    main()
