"""Row builder throughput: synthetic agent trajectories written to a SQLite trace store, read back in delta form,
merged into training rows. Only ``merge_calls_into_rows`` is timed, in CPU seconds of this process (the rate
per core, unaffected by other processes waiting for the CPU; wall time is shown for reference).

Each trajectory starts with a 500-token observation; every turn the model answers ~100 tokens (80-120) and the
environment adds a 500-token observation, so turn ``n``'s prompt is ~600 n tokens and a 200-turn trajectory
merges into one row of ~120k tokens. Row tokens are counted once per row (what the learner trains on). Linear
scaling shows as a constant ns per row token across lengths; a builder that re-compared every prompt would
grow with the number of turns.

Two input forms are timed on the same calls: ``lists`` is what ``TraceStore.rollout_calls`` returns today
(``StoredCall`` holds Python lists, so every token is converted from a Python int once); ``arrays`` gives the
builder the same tokens as int32/float32 numpy arrays, i.e. ``np.frombuffer`` over the store's packed bytes
without ``.tolist()``, which the builder appends at memory speed.

    python bench/rows.py                 # 10, 50 and 200 turns, ~1M row tokens per length
    python bench/rows.py --scale 4 --repeat 9
    python bench/rows.py --no-store      # build StoredCalls directly (no database)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from harnessrl.store import CallRecord, StoredCall, TraceStore
from harnessrl.trainer.rows import calls_from_records, merge_calls_into_rows

TURNS = (10, 50, 200)
OBSERVATION = 500
COMPLETION = (80, 120)
VOCAB = 150_000
TARGET_TOKENS_PER_S = 10e6


def trajectory(rng: np.random.Generator, rollout_id: str, turns: int) -> list[CallRecord]:
    history = rng.integers(0, VOCAB, OBSERVATION).tolist()
    calls = []
    for seq in range(turns):
        completion = rng.integers(0, VOCAB, int(rng.integers(COMPLETION[0], COMPLETION[1] + 1))).tolist()
        logprobs = (-rng.exponential(0.5, len(completion))).tolist()
        calls.append(
            CallRecord(
                call_id=f"{rollout_id}-{seq}",
                run="bench",
                rollout_id=rollout_id,
                attempt=0,
                seq=seq,
                route="completions",
                request={"prompt": "..."},
                response=None,
                prompt_token_ids=history,
                completion_token_ids=completion,
                logprobs=logprobs,
                policy_version=0,
            )
        )
        history = history + completion + rng.integers(0, VOCAB, OBSERVATION).tolist()
    return calls


def stored_calls(records: list[CallRecord]) -> list[StoredCall]:
    """Delta form without a database, the way the store encodes it (fallback for --no-store)."""
    out = calls_from_records(records)
    for previous, call in zip(records, out[1:]):
        call.parent_call_id = previous.call_id
        call.prompt_suffix = call.prompt_suffix[
            len(previous.prompt_token_ids) + len(previous.completion_token_ids) :
        ]
    return out


def load(
    turns: int, rollouts: int, store: TraceStore | None, rng: np.random.Generator
) -> list[list[StoredCall]]:
    loaded = []
    for i in range(rollouts):
        rollout_id = f"t{turns}-r{i}"
        records = trajectory(rng, rollout_id, turns)
        if store is None:
            loaded.append(stored_calls(records))
            continue
        for start in range(0, turns, 25):  # the proxy writes batches; keeps memory bounded too
            store.add_calls(records[start : start + 25])
        del records
        calls = store.rollout_calls(rollout_id, 0)
        delta = sum(c.parent_call_id is not None for c in calls)
        if delta != turns - 1:
            sys.exit(f"store returned {delta} delta calls for {turns} turns; expected {turns - 1}")
        loaded.append(calls)
    return loaded


def as_arrays(calls: list[StoredCall]) -> list[StoredCall]:
    """The same calls with numpy fields, as ``np.frombuffer`` over the store's bytes would give them."""
    return [
        replace(
            c,
            prompt_suffix=np.asarray(c.prompt_suffix, dtype="<i4"),
            completion_token_ids=np.asarray(c.completion_token_ids, dtype="<i4"),
            logprobs=np.asarray(c.logprobs, dtype="<f4"),
        )
        for c in calls
    ]


def measure(rollouts: list[list[StoredCall]], repeat: int) -> tuple[list[float], list[float], int, int]:
    """CPU and wall seconds per pass over all rollouts, and the rows and row tokens of one pass."""
    cpu, wall = [], []
    rows = tokens = 0
    for _ in range(repeat):
        rows = tokens = 0
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        for calls in rollouts:
            result = merge_calls_into_rows(calls)
            rows += result.stats.rows
            tokens += result.stats.row_tokens
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start_wall)
    return cpu, wall, rows, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the number of rollouts per length")
    parser.add_argument(
        "--repeat", type=int, default=7, help="timed passes per length (best and median shown)"
    )
    parser.add_argument(
        "--no-store", action="store_true", help="build StoredCalls directly instead of via SQLite"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    # ~1M row tokens per length at scale 1
    counts = {turns: max(1, round(args.scale * 1_000_000 / (turns * 600 + OBSERVATION))) for turns in TURNS}
    with tempfile.TemporaryDirectory() as tmp:
        store = None
        if not args.no_store:
            store = TraceStore.connect(f"sqlite:///{Path(tmp) / 'bench.db'}")
            store.upgrade()
        print(
            f"source: {'SQLite TraceStore.rollout_calls (delta form)' if store else 'StoredCalls built directly'}"
        )
        print(
            f"{'turns':>5} {'input':>6} {'rollouts':>8} {'rows':>5} {'row tokens':>10} {'cpu s':>7} "
            f"{'rows/s':>8} {'Mtok/s':>7} {'median':>7} {'wall':>6} {'ns/tok':>6} {'target':>6}"
        )
        try:
            for turns in TURNS:
                loaded = load(turns, counts[turns], store, rng)
                for form, rollouts in (("lists", loaded), ("arrays", [as_arrays(c) for c in loaded])):
                    cpu, wall, rows, tokens = measure(rollouts, args.repeat)
                    best = min(cpu)
                    rate = tokens / best
                    print(
                        f"{turns:>5} {form:>6} {len(rollouts):>8} {rows:>5} {tokens:>10,} {best:>7.4f} "
                        f"{rows / best:>8,.0f} {rate / 1e6:>7.1f} {tokens / statistics.median(cpu) / 1e6:>7.1f} "
                        f"{tokens / min(wall) / 1e6:>6.1f} {best / tokens * 1e9:>6.1f} "
                        f"{'ok' if rate >= TARGET_TOKENS_PER_S else 'MISS':>6}"
                    )
                del loaded
        finally:
            if store is not None:
                store.close()
    print(
        f"Mtok/s: row tokens per CPU second, best of {args.repeat} (median next to it; wall: per wall second)"
    )
    print(f"target: >= {TARGET_TOKENS_PER_S / 1e6:.0f}M row tokens/s on one core at every length")


if __name__ == "__main__":
    main()
