"""Message prefix digests per call: from scratch (``delta.prefix_digests``) against ``PrefixDigestCache``.

The proxy computes a call's message prefix digests to delta-encode it against its predecessor. Every call of
an agent loop resends the whole history, so from scratch a call at n messages serialises and hashes n
messages; with the cache it serialises and hashes the two new ones (the last reply and the tool result) and
compares the earlier ones with the kept copies of the previous call's.

The conversation is a tool-calling loop: a 2 kB system prompt, then per turn an assistant message with a
tool call (~300 characters of text, ~200 of arguments) and a ~1.5 kB tool result. Each timed call gets fresh
objects parsed from JSON (as the proxy parses a request body); the parse is not timed. The incremental call
is timed right after the same conversation's call two messages shorter, which is not timed. Median of
``--reps`` calls, both ways in the same run.

    python bench/prefix_digests.py [--reps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from harnessrl.store import delta
from harnessrl.store.digest_cache import PrefixDigestCache

LENGTHS = (10, 50, 200)


def conversation(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 85}]
    turn = 0
    while len(out) < n:
        command = json.dumps({"command": f"grep -rn foo{turn} " + "src/ " * 40})
        call = {"id": f"call_{turn}", "type": "function", "function": {"name": "bash", "arguments": command}}
        out.append({"role": "assistant", "content": f"Step {turn}: " + "let me look at this. " * 14,
                    "tool_calls": [call]})  # fmt: skip
        result = f"line {turn}: " + "x = y + 1\n" * 150
        out.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": result})
        turn += 1
    return out[:n]


def median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1000


def measure(n: int, reps: int) -> tuple[float, float, int]:
    text_short, text_full = json.dumps(conversation(n - 2)), json.dumps(conversation(n))
    scratch, incremental = [], []
    cache = PrefixDigestCache()
    for rep in range(reps):
        items = json.loads(text_full)
        t0 = time.perf_counter_ns()
        expected = delta.prefix_digests(items)
        scratch.append(time.perf_counter_ns() - t0)
        cache.digests(rep, json.loads(text_short))
        items = json.loads(text_full)
        t0 = time.perf_counter_ns()
        got = cache.digests(rep, items)
        incremental.append(time.perf_counter_ns() - t0)
        assert got == expected
        cache.forget(rep)
    cache.digests("held", json.loads(text_full))
    return median_us(scratch), median_us(incremental), cache.held_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    print(f"{'messages':>8} {'scratch_us':>11} {'incremental_us':>15} {'speedup':>8} {'held_kB':>8}")
    pairs = []
    for n in LENGTHS:
        scratch, incremental, held = measure(n, args.reps)
        speedup = scratch / incremental
        print(f"{n:>8} {scratch:>11.1f} {incremental:>15.1f} {speedup:>8.2f} {held / 1024:>8.0f}")
        pairs.append(f"speedup_at_{n}={speedup:.2f}")
        pairs.append(f"scratch_us_at_{n}={scratch:.1f} incremental_us_at_{n}={incremental:.1f}")
    print(" ".join(pairs))


if __name__ == "__main__":
    main()
