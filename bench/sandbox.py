"""What the coding sandbox costs per command: ``true`` run plainly, in ``run_sandboxed`` (bubblewrap, and setpriv
as root), and through ``harnessrl swe sandbox`` as mini-swe-agent calls it (a Python start on top), side by side,
interleaved so that load on the machine falls on all three alike. Prints the medians and their ratios.

    python bench/sandbox.py [--runs 30]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harnessrl.swe.sandbox import run_sandboxed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    harnessrl = str(Path(sys.executable).with_name("harnessrl"))
    with tempfile.TemporaryDirectory() as work:
        kinds = {
            "plain": lambda: subprocess.run(["true"], check=True),
            "run_sandboxed": lambda: run_sandboxed(["true"], writable=[Path(work)]),
            "harnessrl swe sandbox": lambda: subprocess.run(
                [harnessrl, "swe", "sandbox", "--", "--bind", work, work, "--chdir", work, "bash", "-c", "true"],
                check=True),
        }
        seconds: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(args.runs):
            for name, run in kinds.items():
                started = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - started)
    plain = statistics.median(seconds["plain"])
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"{name:24s} median {median * 1000:7.1f} ms  ({median / plain:5.1f}x plain, "
              f"+{(median - plain) * 1000:.1f} ms)")


if __name__ == "__main__":
    main()
