"""A scheduler pass's cost with 2,000 and with 200,000 finished rollouts already in the PostgreSQL store.

The operator's pass is ``RolloutScheduler.reconcile``: settle ended harnesses, enforce deadlines, retry, create
groups, launch, count. Its harnesses here are an in-memory backend (every pass, ``--exits`` running harnesses
end with exit 0), so what is timed is the pass's own work: its store reads and writes, on a real PostgreSQL.

Each database is preloaded through the real writer (``create_rollouts``, ``try_transitions``, learner steps
consuming every finished group), then ``--concurrency`` attempts run. Passes on the two databases alternate,
in ``--rounds`` worker processes each, so load from other work on the machine falls on both alike. A worker
imports the store from ``--code`` (default: this checkout), so the code before a change runs side by side with
it from a ``git worktree`` of the older commit (``--before DIR``) on the same databases.

Printed per code and database: the median pass (wall ms), the pass's CPU in this process and in the PostgreSQL
backends serving it (ms a pass), and CPU per finished rollout. The pass cost compared is its CPU, client and
server together: on a machine shared with other work the wall time measures the neighbours too.

    python bench/scheduler_scale.py                                 # 2,000 and 200,000 finished rollouts
    git worktree add /tmp/before HEAD~1 && python bench/scheduler_scale.py --before /tmp/before

Last line: ``pass_cost_ratio_200k_2k=... cpu_per_rollout_ratio_200k_2k=...`` (this code; with ``--before``
also ``before_pass_cost_ratio_200k_2k=...``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = "scale"
GROUP = 8
TASKS = 16


def preload(url: str, finished: int, concurrency: int) -> None:
    """``finished`` rollouts ended and consumed by learner steps, then ``concurrency`` more running."""
    from harnessrl.rollout_ids import training_rollout_id
    from harnessrl.store import RolloutState, TraceStore
    from harnessrl.store.learner_ledger import LearnerLedger
    from harnessrl.store.states import Move

    s = RolloutState
    store = TraceStore.connect(url)
    store.upgrade()
    store.ensure_run(RUN)
    tasks = store.add_tasks(RUN, [{"id": f"t{i}"} for i in range(TASKS)])
    ledger = LearnerLedger(store, RUN)
    groups = finished // GROUP
    chunk = 250  # groups a batch: one create per task, two transitions, one learner step
    for first in range(0, groups, chunk):
        batch = range(first, min(groups, first + chunk))
        ids: list[str] = []
        for t, task in enumerate(tasks):
            mine = [(training_rollout_id(RUN, g, i), i) for g in batch if g % TASKS == t for i in range(GROUP)]
            if mine:
                ids += store.create_rollouts(RUN, task, mine)
        store.try_transitions([Move(r, 0, s.QUEUED, s.RUNNING) for r in ids])
        store.try_transitions([Move(r, 0, s.RUNNING, s.FAILED, "NoReward") for r in ids])
        ledger.consume(first // chunk + 1, {}, [(r, 0) for r in ids])
    store.close()


class InstantBackend:
    """Harnesses that run until ``exits_per_pass`` of them end at each pass (exit 0)."""

    def __init__(self, running: list[tuple[str, int]], exits_per_pass: int) -> None:
        self.running = list(running)
        self.ended: list = []
        self.per_pass = exits_per_pass

    def tick(self) -> None:
        from harnessrl.scheduler import HarnessExit

        done, self.running = self.running[: self.per_pass], self.running[self.per_pass:]
        self.ended += [HarnessExit(r, a, 0) for r, a in done]

    def launch_budget(self) -> int | None:
        return None

    def launch(self, launch) -> None:
        self.running.append((launch.rollout_id, launch.attempt))

    def alive(self) -> set[tuple[str, int]]:
        return set(self.running)

    def exits(self) -> list:
        return list(self.ended)

    def stop(self, rollout_id: str, attempt: int, reason: str) -> None:
        from harnessrl.scheduler import HarnessExit

        self.running.remove((rollout_id, attempt))
        self.ended.append(HarnessExit(rollout_id, attempt, None, reason))

    def release(self, rollout_id: str, attempt: int) -> None:
        self.ended = [e for e in self.ended if (e.rollout_id, e.attempt) != (rollout_id, attempt)]


def _cpu_of(pids: list[int]) -> float:
    """CPU seconds (user + system) of processes, from /proc."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def worker(args: argparse.Namespace) -> None:
    """Passes on one preloaded database with the code on sys.path; JSON on stdout."""
    from harnessrl.scheduler import RolloutScheduler, SchedulerSettings
    from harnessrl.store import RolloutState, TraceStore
    from harnessrl.store.scheduler_reads import active_attempts

    store = TraceStore.connect(args.url)
    settings = SchedulerSettings(run=RUN, group_size=GROUP, concurrency=args.concurrency, timeout_s=3600,
                                 tasks_per_step=1, max_staleness=10**6, lost_grace_s=3600)
    running = [(a.rollout_id, a.attempt) for a in active_attempts(store, RUN) if a.state is RolloutState.RUNNING]
    backend = InstantBackend(running, args.exits)
    scheduler = RolloutScheduler(store, settings, backend, [{"id": f"t{i}"} for i in range(TASKS)])
    scheduler.reconcile(0)  # fills the slots, warms the pool
    walls, finished = [], 0
    cpu_client = cpu_server = 0.0
    for _ in range(args.passes):
        backend.tick()
        pids = _pids(args.url)
        before_server, before_client, started = _cpu_of(pids), time.process_time(), time.perf_counter()
        status = scheduler.reconcile(0)
        walls.append(time.perf_counter() - started)
        cpu_client += time.process_time() - before_client
        cpu_server += _cpu_of(pids) - before_server
        finished += status.finished
    store.close()
    print(json.dumps({"pass_ms": 1000 * statistics.median(walls), "client_ms": 1000 * cpu_client / args.passes,
                      "server_ms": 1000 * cpu_server / args.passes, "finished": finished,
                      "cpu_ms_per_rollout": 1000 * (cpu_client + cpu_server) / max(finished, 1)}))


def _pids(url: str) -> list[int]:
    """The PostgreSQL backends connected to this database (the worker's pool and nobody else's)."""
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(url)
    with psycopg.connect(host=u.host, port=u.port, user=u.username, password=u.password, dbname="postgres",
                         autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (u.database,)).fetchall()
    return [r[0] for r in rows]


@contextlib.contextmanager
def copy_of(admin_url: str, url: str) -> Iterator[str]:
    """A copy of a database (CREATE DATABASE ... TEMPLATE: a file copy), dropped afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    admin = create_engine(make_url(admin_url).set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT")
    source = make_url(url).database
    name = f"{source}_copy"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{source}"'))
    try:
        yield make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def main() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from store_write import add_pg_option, fresh_pg_database

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pg_option(parser)
    parser.add_argument("--finished", default="2000,200000", help="finished rollouts preloaded, two sizes")
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--exits", type=int, default=20, help="harnesses ending before each pass")
    parser.add_argument("--passes", type=int, default=30, help="timed passes per worker")
    parser.add_argument("--rounds", type=int, default=3, help="workers per code and database")
    parser.add_argument("--before", type=Path, help="a checkout of the code before, run side by side")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sizes = [int(x) for x in args.finished.split(",")]
    codes = {"after": ROOT} | ({"before": args.before.resolve()} if args.before else {})
    with contextlib.ExitStack() as stack:
        urls: dict[tuple[str, int], str] = {}
        for size in sizes:
            url = urls[("after", size)] = stack.enter_context(fresh_pg_database(args.pg))
            started = time.perf_counter()
            preload(url, size, args.concurrency)
            print(f"preloaded {size} finished rollouts in {time.perf_counter() - started:.0f} s", flush=True)
            if args.before:  # each code its own copy: they must not see each other's groups
                urls[("before", size)] = stack.enter_context(copy_of(args.pg, url))
        results: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.rounds):
            for code, path in codes.items():
                for size in sizes:
                    url = urls[(code, size)]
                    env = os.environ | {"PYTHONPATH": str(path / "src")}
                    out = subprocess.run([sys.executable, str(path / "bench" / "scheduler_scale.py")
                                          if (path / "bench" / "scheduler_scale.py").exists() else __file__,
                                          "--worker", "--url", url, "--passes", str(args.passes),
                                          "--concurrency", str(args.concurrency), "--exits", str(args.exits)],
                                         capture_output=True, text=True, env=env, cwd="/tmp")
                    if out.returncode:
                        sys.exit(f"worker failed ({code}, {size}):\n{out.stderr[-3000:]}")
                    results.setdefault((code, size), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'code':>6} {'finished':>9} {'wall ms':>8} {'client ms':>9} {'server ms':>9} {'pass cpu ms':>11} "
          f"{'cpu ms/rollout':>14}")
    med: dict[tuple[str, int], dict[str, float]] = {}
    for (code, size), runs in sorted(results.items()):
        med[(code, size)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        m = med[(code, size)]
        m["cost"] = m["client_ms"] + m["server_ms"]
        print(f"{code:>6} {size:>9} {m['pass_ms']:>8.2f} {m['client_ms']:>9.2f} {m['server_ms']:>9.2f} "
              f"{m['cost']:>11.2f} {m['cpu_ms_per_rollout']:>14.3f}")
    small, big = sizes
    line = (f"pass_cost_ratio_200k_2k={med[('after', big)]['cost'] / med[('after', small)]['cost']:.2f} "
            f"cpu_per_rollout_ratio_200k_2k="
            f"{med[('after', big)]['cpu_ms_per_rollout'] / med[('after', small)]['cpu_ms_per_rollout']:.2f}")
    if args.before:
        line += (f" before_pass_cost_ratio_200k_2k="
                 f"{med[('before', big)]['cost'] / med[('before', small)]['cost']:.2f} before_cpu_per_rollout_ratio_200k_2k="
                 f"{med[('before', big)]['cpu_ms_per_rollout'] / med[('before', small)]['cpu_ms_per_rollout']:.2f}")
    print(line)


if __name__ == "__main__":
    main()
