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

Merge quality is shown for four kinds of trajectory, beside the speed: ``rows/ro`` (training rows per
rollout; 1 is a perfect merge), ``tok/final`` (row tokens / final trajectory tokens, the distinct prefixes
of the rollout's rows; 1.00 is a perfect merge) and the split reasons the row builder gave:

* ``plain``: one conversation, each call extends the previous prompt + completion (as above);
* ``tools``: a function-calling loop as the proxy stores it with token continuity: each completion is a
  ``<tool_call>...</tool_call>`` of 20-60 tokens, each next prompt adds the tool's result (100-400 tokens)
  in template tokens, and the sampled call stays in the history exactly as sampled;
* ``tools-rerendered``: the same loop where the history carries the server's re-rendering of each parsed
  tool call instead (a few tokens differ inside every call: what a server-side chat template gives without
  token continuity);
* ``interleaved``: an agent and its sub-agent, two conversations sharing the first tokens of the template,
  whose calls alternate in one rollout (``turns`` calls in all); the store keeps each call as a delta of its
  own conversation's previous call (checked), and the sub-agent's first call counts as ``new_conversation``.

    python bench/rows.py                 # 10, 50 and 200 turns, ~1M row tokens per length
    python bench/rows.py --scale 4 --repeat 9
    python bench/rows.py --no-store      # build StoredCalls directly (no database)
    python bench/rows.py --kinds plain,interleaved
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from harnessrl.store import CallRecord, StoredCall, TraceStore
from harnessrl.trainer.metrics import final_trajectory_tokens
from harnessrl.trainer.rows import calls_from_records, merge_calls_into_rows

TURNS = (10, 50, 200)
OBSERVATION = 500
COMPLETION = (80, 120)
VOCAB = 150_000
TARGET_TOKENS_PER_S = 10e6
KINDS = ("plain", "tools", "tools-rerendered", "interleaved")


# template tokens of the synthetic tool-calling trajectories (ids above the random text's range)
IM_START, IM_END, NEWLINE, ASSISTANT, USER = VOCAB + 1, VOCAB + 2, VOCAB + 3, VOCAB + 4, VOCAB + 5
TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END = VOCAB + 6, VOCAB + 7, VOCAB + 8, VOCAB + 9
TOOL_CALL_TOKENS = (20, 60)
TOOL_RESULT_TOKENS = (100, 400)
# the turn's observation (after the first) and completion of a conversation, given the sampled completion
Turn = Callable[[np.random.Generator], tuple[list[int], list[int]]]


def record(rollout_id: str, seq: int, prompt: list[int], completion: list[int], rng) -> CallRecord:
    return CallRecord(
        call_id=f"{rollout_id}-{seq}",
        run="bench",
        rollout_id=rollout_id,
        attempt=0,
        seq=seq,
        route="completions",
        request={"prompt": "..."},
        response=None,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=(-rng.exponential(0.5, len(completion))).tolist(),
        policy_version=0,
    )


def text(rng: np.random.Generator, low: int, high: int | None = None) -> list[int]:
    return rng.integers(0, VOCAB, low if high is None else int(rng.integers(low, high + 1))).tolist()


def plain_turn(rng: np.random.Generator) -> tuple[list[int], list[int], list[int]]:
    """(completion, the completion as resent in the history, the observation that follows)."""
    completion = text(rng, *COMPLETION)
    return completion, completion, text(rng, OBSERVATION)


def tool_turn(rng: np.random.Generator, rerendered: bool) -> tuple[list[int], list[int], list[int]]:
    body = text(rng, *TOOL_CALL_TOKENS)
    completion = [TOOL_CALL, NEWLINE, *body, NEWLINE, TOOL_CALL_END, IM_END]
    resent = completion
    if rerendered:  # the parsed call rendered again: other token boundaries in its JSON
        cut = len(body) // 2
        resent = [TOOL_CALL, NEWLINE, *body[:cut], *text(rng, 2), *body[cut + 1 :], NEWLINE, TOOL_CALL_END,
                  IM_END]
    result = [NEWLINE, IM_START, USER, NEWLINE, TOOL_RESPONSE, *text(rng, *TOOL_RESULT_TOKENS), TOOL_RESPONSE_END,
              IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE]
    return completion, resent, result


def trajectory(rng: np.random.Generator, rollout_id: str, turns: int, kind: str = "plain") -> list[CallRecord]:
    """One rollout's calls as the proxy stores them (full prompts; the store encodes the deltas)."""
    if kind == "interleaved":  # two conversations with a common template start, calls alternating
        histories = [[IM_START, NEWLINE, *text(rng, OBSERVATION)] for _ in range(2)]
        step = plain_turn
    else:
        histories = [text(rng, OBSERVATION)]
        step = plain_turn if kind == "plain" else (lambda r: tool_turn(r, kind == "tools-rerendered"))
    calls = []
    for seq in range(turns):
        conversation = seq % len(histories)
        history = histories[conversation]
        completion, resent, observation = step(rng)
        calls.append(record(rollout_id, seq, history, completion, rng))
        histories[conversation] = history + resent + observation
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
    turns: int, rollouts: int, store: TraceStore | None, rng: np.random.Generator, kind: str = "plain"
) -> list[list[StoredCall]]:
    loaded = []
    for i in range(rollouts):
        rollout_id = f"{kind}-t{turns}-r{i}"
        records = trajectory(rng, rollout_id, turns, kind)
        if store is None:
            if kind != "plain":
                sys.exit(f"--no-store builds the plain kind only (its delta form is the previous call); drop {kind}")
            loaded.append(stored_calls(records))
            continue
        for start in range(0, turns, 25):  # the proxy writes batches; keeps memory bounded too
            store.add_calls(records[start : start + 25])
        del records
        calls = store.rollout_calls(rollout_id, 0)
        delta = sum(c.parent_call_id is not None for c in calls)
        expected = {"plain": turns - 1, "interleaved": turns - 2}.get(kind)  # each conversation's first is full
        if expected is not None and delta != expected:
            sys.exit(f"store returned {delta} delta calls for {turns} {kind} turns; expected {expected}")
        loaded.append(calls)
    return loaded


def merge_quality(rollouts: list[list[StoredCall]]) -> tuple[float, float, str]:
    """Rows per rollout, row tokens / final trajectory tokens, and the split reasons, over ``rollouts``."""
    rows = row_tokens = final = 0
    splits: Counter[str] = Counter()
    for calls in rollouts:
        result = merge_calls_into_rows(calls)
        rows += result.stats.rows
        row_tokens += result.stats.row_tokens
        final += final_trajectory_tokens([row.input_ids for row in result.rows])
        splits.update(result.stats.splits)
    reasons = ",".join(f"{reason} {n / len(rollouts):g}" for reason, n in sorted(splits.items())) or "-"
    return rows / len(rollouts), row_tokens / final, reasons


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
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: {', '.join(unknown)} unknown; pick from {', '.join(KINDS)}")

    rng = np.random.default_rng(args.seed)
    # ~1M row tokens per length at scale 1 (of a merged trajectory: ~600 tokens a turn)
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
            f"{'kind':>16} {'turns':>5} {'rows/ro':>7} {'tok/final':>9} {'splits per rollout':>22} {'input':>6} "
            f"{'rollouts':>8} {'rows':>5} {'row tokens':>11} {'cpu s':>7} {'rows/s':>8} {'Mtok/s':>7} "
            f"{'median':>7} {'wall':>6} {'ns/tok':>6} {'target':>6}"
        )
        try:
            for kind in kinds:
                for turns in TURNS:
                    loaded = load(turns, counts[turns], store, rng, kind)
                    per_rollout, ratio, splits = merge_quality(loaded)
                    for form, rollouts in (("lists", loaded), ("arrays", [as_arrays(c) for c in loaded])):
                        cpu, wall, rows, tokens = measure(rollouts, args.repeat)
                        best = min(cpu)
                        rate = tokens / best
                        print(
                            f"{kind:>16} {turns:>5} {per_rollout:>7.2f} {ratio:>9.2f} {splits:>22} {form:>6} "
                            f"{len(rollouts):>8} {rows:>5} {tokens:>11,} {best:>7.4f} {rows / best:>8,.0f} "
                            f"{rate / 1e6:>7.1f} {tokens / statistics.median(cpu) / 1e6:>7.1f} "
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
    print("rows/ro: training rows per rollout; tok/final: row tokens / final trajectory tokens (1.00: perfect merge)")
    print(f"target: >= {TARGET_TOKENS_PER_S / 1e6:.0f}M row tokens/s on one core at every length")


if __name__ == "__main__":
    main()
