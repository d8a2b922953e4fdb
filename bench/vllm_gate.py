"""What the gate in front of an operator-run vLLM (``harnessrl vllm-gate``) costs a call, in one run.

The same chat calls sent straight to a fast fixed-response upstream speaking vLLM's wire format
(``harnessrl.proxy.fake_upstream``: 1k prompt tokens, 200 completion tokens, token ids and log-probs) and through
the gate's public port, each server its own process. Printed: p50 latency and throughput, direct and gated, at
concurrency 1 and 64, unary and streamed, with the ratios, and the gate's CPU milliseconds per call. Against a
real vLLM, whose own cost per call is far larger than this upstream's, the ratios only get closer to 1.

    python bench/vllm_gate.py            # 2,000 calls per measurement
    python bench/vllm_gate.py --quick    # 300
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys

from proxy_overhead import COMPLETION_TOKENS, PROMPT_TOKENS, cpu_s, free_port, load, wait_healthy


def start(args: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESSRL_")}
    return subprocess.Popen([sys.executable, "-m", *args], env=env, cwd="/")


async def measure(direct: str, gated: str, gate_pid: int, calls: int) -> None:
    print(f"{'':22}{'direct p50':>12}{'gated p50':>12}{'added':>10}{'throughput':>12}{'gate CPU/call':>15}")
    for concurrency in (1, 64):
        for stream in (False, True):
            plain = await load(direct, calls, concurrency, stream, False, "d")
            before = cpu_s([gate_pid])
            through = await load(gated, calls, concurrency, stream, False, "g")
            gate_ms = (cpu_s([gate_pid]) - before) / calls * 1e3
            label = f"c={concurrency} {'streamed' if stream else 'unary'}"
            added = (through.pct(0.5) - plain.pct(0.5)) * 1e3
            print(f"{label:22}{plain.pct(0.5) * 1e3:10.2f}ms{through.pct(0.5) * 1e3:10.2f}ms{added:8.2f}ms"
                  f"{through.throughput / plain.throughput:11.2f}x{gate_ms:13.2f}ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    calls = 300 if parser.parse_args().quick else 2000
    up_port, public, control = free_port(), free_port(), free_port()
    upstream = start(["harnessrl.proxy.fake_upstream", "--port", str(up_port), "--prompt-tokens",
                      str(PROMPT_TOKENS), "--max-tokens", str(COMPLETION_TOKENS)])
    gate = start(["harnessrl.cli", "vllm-gate", "--upstream", f"http://127.0.0.1:{up_port}", "--host", "127.0.0.1",
                  "--port", str(public), "--control-port", str(control)])
    direct, gated = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{public}"
    try:
        asyncio.run(wait_healthy(f"{direct}/health"))
        asyncio.run(wait_healthy(f"{gated}/health"))
        asyncio.run(measure(direct, gated, gate.pid, calls))
    finally:
        for process in (gate, upstream):
            process.terminate()
            process.wait(30)


if __name__ == "__main__":
    main()
