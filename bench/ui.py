"""Trace explorer server time on a large store: the rollout list and a rollout page at p50 and p95.

A store is filled with synthetic chat trajectories (``tests/synthetic_calls.py``: vLLM-shaped requests and
responses, each call resending the whole history, so all but the first call of a rollout are deltas) through
the store's real writer, in groups of 8 rollouts per task; rollouts are settled succeeded (a reward) or failed
and consumed by learner steps of 8 groups (``LearnerLedger.commit``, with each attempt's row count), so every
filter and sort of the list has something to select. To write fast, 64 trajectories are prepared once with
``prepare_call`` (what the proxy runs on each call as it captures it) and relabelled per rollout; every call
then goes through ``TraceStore.add_calls`` as a proxy's would: delta search against its predecessor, digests
checked, rows inserted (binary COPY on PostgreSQL), one learner step's 640 calls a batch.

Then the UI's aiohttp application answers real HTTP requests on localhost (``harnessrl.ui.app.make_app`` over a
read-only engine) and each request's wall time is taken: the rollout list under several filters, sorts and a
deep page, the rollout page of random rollouts (conversation, the learner's rows and its group's advantages),
and the run overview and failures pages. Goal (issue 23): p95 under 300 ms on 2 cores. Ratios side by side:
each p95 to the goal, and the list without migration 0007's indexes to with them. The last line is
``name=value`` pairs.

    python bench/ui.py                          # 1,000,000 calls on SQLite
    python bench/ui.py --calls 100000 --postgresql   # a smaller store, on PostgreSQL
    python bench/ui.py --store sqlite:///big.db --keep   # fill once, measure again later with --store
"""

from __future__ import annotations

import argparse
import asyncio
import copy
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
from harnessrl.store.call_rows import PreparedCall, prepare_call
from harnessrl.store.learner_ledger import LearnerLedger, StepRows
from harnessrl.store.records import utcnow
from harnessrl.store.schema import LlmCall, RolloutAttempt
from harnessrl.store.states import Move

RUN = "bench"
GROUP, GROUPS_PER_STEP = 8, 8
GOAL_MS = 300.0


def relabel(template: PreparedCall, rollout_id: str, version: int) -> PreparedCall:
    """A prepared call as another rollout's: ids, version and time; its packed arrays and digests are the
    template's (they do not depend on the ids), so the proxy's capture-time work is not paid per call here."""
    record = copy.copy(template.record)
    record.call_id, record.rollout_id = f"{rollout_id}-{record.seq}", rollout_id
    record.policy_version, record.created_at = version, utcnow()
    return replace(template, record=record, anchor=replace(template.anchor, call_id=record.call_id))


def fill(url: str, calls: int, turns: int, log_every: int = 100_000) -> None:
    """``calls`` calls in ``calls / turns`` rollouts, written by ``add_calls`` one learner step at a time."""
    store = TraceStore.connect(url)
    store.upgrade()
    ledger = LearnerLedger(store, RUN)
    ledger.ensure_base_version("/bench/v0")
    groups = calls // turns // GROUP
    store.add_tasks(RUN, [{"id": f"task-{g}", "data": {"n": g}} for g in range(groups)])
    rng = random.Random(0)
    templates = [[prepare_call(call) for call in chat_trajectory(
        "t", turns, system_tokens=300, observation_tokens=40, completion_tokens=40, seed=seed, run=RUN)]
        for seed in range(64)]
    written, started, version = 0, time.perf_counter(), 0
    for first in range(0, groups, GROUPS_PER_STEP):
        ids = [rollout for g in range(first, min(first + GROUPS_PER_STEP, groups))
               for rollout in store.create_rollouts(RUN, f"task-{g}", [(f"r{g:07d}-{i}", i) for i in range(GROUP)])]
        store.try_transitions([Move(r, 0, RolloutState.QUEUED, RolloutState.RUNNING, None, version) for r in ids])
        batch = [relabel(call, rollout_id, version) for n, rollout_id in enumerate(ids)
                 for call in templates[(first * GROUP + n) % len(templates)]]
        store.add_calls(batch)
        failed = {r for r in ids if rng.random() < 0.15}
        rewards = [{"k": r, "v": round(rng.random(), 3)} for r in ids if r not in failed]
        with store.engine.begin() as conn:  # a step's rewards at once (the harness path is one per call)
            conn.execute(update(RolloutAttempt).where(RolloutAttempt.rollout_id == bindparam("k"),
                                                      RolloutAttempt.attempt == 0)
                         .values(reward=bindparam("v")), rewards)
        store.try_transitions([Move(r, 0, RolloutState.RUNNING, RolloutState.FAILED if r in failed else
                                    RolloutState.SUCCEEDED, "HarnessFailed: exit code 1" if r in failed else None)
                               for r in ids])
        if len(ids) == GROUP * GROUPS_PER_STEP:  # a whole step's groups: a learner step consumes them
            counts = {(r, 0): 1 + (rng.random() < 0.1) for r in ids}  # a tenth split into two rows
            version = ledger.commit(first // GROUPS_PER_STEP + 1, f"/bench/v{version + 1}",
                                    {"rows": sum(counts.values())}, list(counts), rows=StepRows(counts=counts))
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
    "rows >= 2 (split rollouts), by rows": "rows_min=2&sort=rows",
    "sort by task (a join: sorted, no index walk)": "sort=task&order=asc",
    "sort by failure reason": "sort=reason",
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
        print("rollout list (/runs/RUN/rollouts?...)   [p95 / goal]" + (
            "   [without 0007's indexes: p50 p95, p95 ratio without/with]" if without else ""))
        for name, (p50, p95) in with_indexes.items():
            line = f"  {name:44s} p50 {p50:7.1f}   p95 {p95:7.1f}   [{p95 / GOAL_MS:4.2f}]"
            if name in without:
                w50, w95 = without[name]
                line += f"   [{w50:7.1f} {w95:7.1f}, {w95 / p95:5.1f}x]"
            print(line)
        rollout = await timed(rollout_paths)
        print("rollout page (/runs/RUN/rollouts/ID: conversation, learner rows, group advantages):")
        print(f"  {'random rollout':44s} p50 {rollout[0]:7.1f}   p95 {rollout[1]:7.1f}   [{rollout[1] / GOAL_MS:4.2f}]")
        others = {}
        print(f"the other pages ({max(samples // 4, 5)} requests each):")
        for key, name, path in (("runs", "runs page", "/"),
                                ("overview", "run overview (harnessrl status's summary)", f"/runs/{RUN}"),
                                ("failures", "failures (latest 200 grouped)", f"/runs/{RUN}/failures")):
            others[key] = await timed([path] * max(samples // 4, 5))
            print(f"  {name:44s} p50 {others[key][0]:7.1f}   p95 {others[key][1]:7.1f}   "
                  f"[{others[key][1] / GOAL_MS:4.2f}]")
    engine.dispose()
    worst = max(with_indexes, key=lambda name: with_indexes[name][1])
    pairs = {"db": engine.dialect.name, "calls": calls, "attempts": attempts,
             "list_p50_ms_median": statistics.median(v[0] for v in with_indexes.values()),
             "list_p95_ms_worst": with_indexes[worst][1], "rollout_p50_ms": rollout[0], "rollout_p95_ms": rollout[1],
             **{f"{key}_p95_ms": value[1] for key, value in others.items()}, "goal_p95_ms": GOAL_MS,
             "list_p95_to_goal": with_indexes[worst][1] / GOAL_MS, "rollout_p95_to_goal": rollout[1] / GOAL_MS}
    if without:
        pairs["list_p95_without_0007_ratio_median"] = statistics.median(
            without[name][1] / with_indexes[name][1] for name in without)
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in pairs.items()))


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
