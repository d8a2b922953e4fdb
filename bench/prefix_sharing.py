"""Learner seconds per step and peak memory with a group's shared prefix computed once, against every row alone.

Steps of ``--groups`` task groups of 8 rows each (the rollouts of one task): every row is a common prompt
(``sharing`` of its tokens) followed by its own generated tail, 60% of whose tokens are trained. Rows of two
lengths, at 80% sharing and at 0% (no common prompt: the fallback path must cost what it did). A random
Qwen2-style model built locally (``--hidden``, ``--layers``; no download) is trained with the real
``PolicyEngine`` (DeepSpeed ZeRO-2, fp32 on the CPU).

Each (length, sharing, mode) runs in a process of its own, alternating shared and unshared, ``--repeat``
times: a fresh process makes the peak-memory figure that mode's own (on the CPU the peak resident set during
one step above the resident set before it, via ``/proc/self/clear_refs``; on a GPU ``max_memory_allocated``).
The first step warms up (optimizer state, allocator), later ones are timed; medians over processes. Seconds
are the process's CPU seconds with one torch thread (``--threads``): on a machine shared with other work, wall
time measures the neighbours; with one thread CPU time is the step's work (wall time is printed beside it).

    python bench/prefix_sharing.py                       # lengths 512 and 1024, 2 groups a step
    python bench/prefix_sharing.py --lengths 1024,4096 --repeat 3

Last line: ``speedup_at_80=... speedup_at_0=... peak_memory_ratio_at_80=...`` (unshared seconds / shared
seconds at the longer length; shared peak / unshared peak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GROUP = 8


def rows_for(length: int, sharing: float, groups: int, seed: int) -> list:
    from harnessrl.trainer.engine import TrainRow

    rng = np.random.default_rng(seed)
    rows = []
    total_generated = 0
    raw = []
    for _ in range(groups):
        prefix = rng.integers(3, 1000, int(length * sharing))
        for _ in range(GROUP):
            tail = rng.integers(3, 1000, length - len(prefix))
            ids = np.concatenate([prefix, tail]).astype(np.int64)
            mask = np.zeros(length, np.int8)
            start = max(len(prefix), 1)
            mask[start:] = rng.random(length - start) < 0.6
            raw.append((ids, mask, float(rng.normal())))
            total_generated += int(mask.sum())
    for i, (ids, mask, advantage) in enumerate(raw):
        rows.append(TrainRow(i, (f"r{i}", 0), ids, mask, (rng.normal(-2, 1, length) * mask).astype(np.float32),
                             mask.astype(np.float32) * advantage, mask.astype(np.float32) / total_generated))
    return rows


def reinforce(mb, logp, entropy):
    import torch

    return -(mb.weights * mb.advantages * logp).sum(), {"tokens": torch.tensor(float(mb.num_targets))}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(args: argparse.Namespace) -> None:
    """One mode in this process: a warm-up step measured for peak memory, then timed steps (JSON on stdout)."""
    import torch

    from harnessrl.trainer.engine import EngineSettings, PolicyEngine

    torch.set_num_threads(args.threads)
    fraction = 0.5 if args.mode == "shared" else None
    engine = PolicyEngine(args.model, EngineSettings(lr=1e-6, zero_stage=2, micro_batch_tokens=args.budget,
                                                     shared_prefix_min_fraction=fraction))
    rows = rows_for(args.length, args.sharing, args.groups, seed=1)
    cuda = engine.dist.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak resident set (VmHWM)
        base = _rss_kib("VmRSS") * 1024
    result = engine.train_step(rows, reinforce)
    peak = (torch.cuda.max_memory_allocated() if cuda else _rss_kib("VmHWM") * 1024) - base
    seconds, wall = [], []
    for _ in range(args.steps):
        started, cpu = time.perf_counter(), time.process_time()
        engine.train_step(rows, reinforce)
        if cuda:
            torch.cuda.synchronize()
        wall.append(time.perf_counter() - started)
        seconds.append(wall[-1] if cuda else time.process_time() - cpu)
    print(json.dumps({"seconds": statistics.median(seconds), "wall": statistics.median(wall), "peak": peak, "shared_rows": result.shared_prefix_rows,
                      "fallback_rows": result.prefix_fallback_rows, "saved": result.shared_prefix_tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,1024")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2, help="processes per mode")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=int, default=32768, help="micro_batch_tokens")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sharing", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from harnessrl.tiny_model import TinyModelConfig, build_tiny_model

    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", TinyModelConfig(
            hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_layers=args.layers,
            num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 128)))
        print(f"model: hidden {args.hidden}, {args.layers} layers; {args.groups} groups of {GROUP} rows a step, "
              f"{args.repeat} processes x {args.steps} timed steps per mode")
        print(f"{'length':>6} {'sharing':>7} {'mode':>8} {'s/step':>8} {'wall s':>7} {'peak MiB':>9} {'shared rows':>11} "
              f"{'alone rows':>10} {'saved tok':>9}")
        ratios: dict[tuple[int, float], tuple[float, float]] = {}
        for length in lengths:
            for sharing in (0.8, 0.0):
                runs: dict[str, list[dict]] = {"unshared": [], "shared": []}
                for _ in range(args.repeat):
                    for mode in ("unshared", "shared"):
                        out = subprocess.run(
                            [sys.executable, __file__, "--worker", "--model", str(model), "--mode", mode,
                             "--length", str(length), "--sharing", str(sharing), "--groups", str(args.groups),
                             "--steps", str(args.steps), "--threads", str(args.threads),
                             "--budget", str(args.budget)],
                            capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
                        if out.returncode:
                            sys.exit(f"worker failed ({mode}, length {length}):\n{out.stderr[-3000:]}")
                        runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
                med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
                for mode, m in med.items():
                    print(f"{length:>6} {sharing:>7.0%} {mode:>8} {m['seconds']:>8.3f} {m['wall']:>7.2f} {m['peak'] / 2**20:>9.1f} "
                          f"{int(m['shared_rows']):>11} {int(m['fallback_rows']):>10} {int(m['saved']):>9}")
                ratios[(length, sharing)] = (med["unshared"]["seconds"] / med["shared"]["seconds"],
                                             med["shared"]["peak"] / max(med["unshared"]["peak"], 1))
        for (length, sharing), (speedup, memory) in ratios.items():
            print(f"length {length}, sharing {sharing:.0%}: speedup {speedup:.2f}x, peak memory ratio {memory:.2f}")
        longest = max(lengths)
        print(f"speedup_at_80={ratios[(longest, 0.8)][0]:.2f} speedup_at_0={ratios[(longest, 0.0)][0]:.2f} "
              f"peak_memory_ratio_at_80={ratios[(longest, 0.8)][1]:.2f}")


if __name__ == "__main__":
    main()
