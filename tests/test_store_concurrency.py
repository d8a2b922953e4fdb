"""Several processes writing the same store at once, as proxies, the scheduler and the local runner do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pathlib import Path

from sqlalchemy import text
from synthetic_calls import chat_trajectory

from harnessrl.store import TraceStore

WORKER = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
from harnessrl.store import TraceStore, RolloutState
from synthetic_calls import chat_trajectory

url, worker = sys.argv[1], int(sys.argv[2])
store = TraceStore.connect(url)
inserted = 0
# Every worker writes its own rollout and replays the two shared ones (a proxy spool replay racing the
# original writer): same call ids, so each shared call must end up stored exactly once.
sizes = dict(turns=6, system_tokens=40, observation_tokens=20, completion_tokens=8)
mine = chat_trajectory(f"own-{worker}", **sizes)
shared = [c for r in ("shared-a", "shared-b") for c in chat_trajectory(r, **sizes)]
calls = mine + shared
order = calls if worker % 2 == 0 else list(reversed(calls))
for start in range(0, len(order), 3):
    inserted += store.add_calls(order[start:start + 3])
won = store.try_transition("shared-a", 0, RolloutState.RUNNING, RolloutState.SUCCEEDED)
store.close()
print(json.dumps({"inserted": inserted, "won": won}))
"""


def test_processes_writing_at_once_store_every_call_once(store: TraceStore, store_url: str) -> None:
    if store.engine.dialect.name == "sqlite":
        with store.engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
    tests_dir = str(Path(__file__).parent)
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, store_url, str(n), tests_dir],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for n in range(4)
    ]
    results = []
    for proc in workers:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["inserted"] for r in results) == 4 * 6 + 2 * 6
    assert sum(r["won"] for r in results) == 1  # one conditional update won, three lost cleanly
    for rollout_id in ["own-0", "own-1", "own-2", "own-3", "shared-a", "shared-b"]:
        expected = chat_trajectory(
            rollout_id, turns=6, system_tokens=40, observation_tokens=20, completion_tokens=8
        )
        assert store.read_calls(rollout_id, 0) == expected


@pytest.mark.postgres
def test_a_proxy_sidecar_keeps_one_connection(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """HARNESSRL_STORE_POOL_SIZE (the operator sets 1 for every proxy sidecar) bounds the connections a
    process keeps: hundreds of harness pods then hold one each, within the chart's max_connections."""
    from harnessrl.store.engine import POOL_SIZE_ENV, open_engine

    monkeypatch.setenv(POOL_SIZE_ENV, "1")
    engine = open_engine(pg_url)
    try:
        assert (engine.pool.size(), engine.pool._max_overflow) == (1, 1)
    finally:
        engine.dispose()
    monkeypatch.delenv(POOL_SIZE_ENV)
    default = open_engine(pg_url)
    assert default.pool.size() == 5  # SQLAlchemy's own, for the operator and the learner
    default.dispose()
