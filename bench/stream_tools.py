"""Time to the first text of a streamed, continued call with tools: relayed while generated against replayed.

Claude Code and Codex CLI always stream and always send tools. A continued call with ``tool_choice`` auto is
either replayed (the whole answer generated and parsed, then sent as a stream: the harness's first text comes
after the last token) or relayed while generated (``proxy/served_stream.py``'s ``ParsedStream``: text as the
server's tool parser lets it out, the tool call from the whole answer). Both run here side by side on one vLLM
server (the tiny model on the CPU, hermes tool parser), alternating, through one in-process capture proxy;
``replay`` turns the relay off for a call. The model is steered by a regex (vLLM's ``structured_outputs``) to
``--sentences`` sentences of text and then one hermes tool call, as an agent's answer looks.

    python bench/stream_tools.py --repeat 2 --sentences 20

Per mode: seconds to the first byte that is not a keep-alive, to the first text delta, to the end; the number
of text deltas before the tool call. Measured (2-core shared CPU, 20 sentences, ~1,200 tokens): replay first
text 3.98 s = end 3.98 s, 1 delta; relay first text 2.04 s, end 4.59 s, 3.5 deltas; first_text_ratio=1.95.
Last line: ``first_text_ratio=...`` (replay / relay, medians).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SENTENCE = "Let me look at the failing test first, then I will run the whole test file again. "
CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "pytest"}}\n</tool_call>'
TOOLS = [{"name": "Bash", "description": "run a command", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]


def regex(text: str) -> str:
    return "".join("\\" + ch if ch in ".{}[]()*+?|^$\\" else ch for ch in text)


def streamed(url: str, body: dict) -> dict[str, float]:
    """One streamed Messages call: seconds to the first non-ping event, to the first text delta, to the end."""
    import json

    start = time.perf_counter()
    first = first_text = None
    texts = break_at = 0
    with httpx.stream("POST", url, json=body, timeout=600) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line.removeprefix("data: "))
            now = time.perf_counter() - start
            if event["type"] == "ping":
                continue
            first = now if first is None else first
            if event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
                first_text = now if first_text is None else first_text
                texts += 1
            if event["type"] == "content_block_start" and event["content_block"]["type"] == "tool_use":
                break_at = texts
    return {"first_event": first, "first_text": first_text, "end": time.perf_counter() - start,
            "text_deltas": break_at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=20)
    args = parser.parse_args()

    from proxy_servers import LoopThread, RunningProxy, proxy_config
    from vllm_fixtures import TOOL_SERVER_ARGS, start_test_vllm

    from harnessrl.store import TraceStore
    from harnessrl.tiny_model import build_tiny_model
    from harnessrl.proxy.continuity import TokenContinuity

    replay = {"on": False}
    plan = TokenContinuity.plan

    async def planned(self, *a, **kw):  # the replay mode: the relay turned off for the call
        out = await plan(self, *a, **kw)
        if out is not None and replay["on"]:
            out.live = False
        return out

    TokenContinuity.plan = planned
    with tempfile.TemporaryDirectory() as tmp:
        server = start_test_vllm(build_tiny_model(Path(tmp) / "model"), Path(tmp) / "vllm.log", TOOL_SERVER_ARGS)
        store = TraceStore.connect(f"sqlite:///{tmp}/store.db")
        store.upgrade()
        loops = LoopThread()
        sampling = {"temperature": 1.0, "structured_outputs": {"regex": regex(SENTENCE * args.sentences + CALL)}}
        proxy = RunningProxy(loops, proxy_config([server.base_url], f"sqlite:///{tmp}/store.db", Path(tmp) / "spool",
                                                 rollout_id=None, run="bench", model_name=server.model,
                                                 sampling=sampling), store)
        try:
            results: dict[str, list[dict[str, float]]] = {"replay": [], "relay": []}
            for i in range(args.repeat):
                for mode in ("replay", "relay"):
                    replay["on"] = mode == "replay"
                    base = f"{proxy.url}/rollouts/{mode}-{i}/attempts/0/v1/messages"
                    body = {"model": "m", "system": "you are a coding agent", "tools": TOOLS, "max_tokens": 4000,
                            "messages": [{"role": "user", "content": "fix the failing test"}]}
                    first = httpx.post(base, json=body, timeout=600).json()
                    use = first["content"][-1]
                    body["messages"] += [{"role": "assistant", "content": first["content"]},
                                         {"role": "user", "content": [{"type": "tool_result",
                                                                       "tool_use_id": use["id"], "content": "ok"}]}]
                    results[mode].append(streamed(base, {**body, "stream": True}))
            for mode, runs in results.items():
                print(mode, " ".join(f"{k}={statistics.median(r[k] for r in runs):.2f}" for k in runs[0]))
            ratio = (statistics.median(r["first_text"] for r in results["replay"])
                     / statistics.median(r["first_text"] for r in results["relay"]))
            print(f"first_text_ratio={ratio:.2f}")
        finally:
            proxy.stop()
            loops.close()
            store.close()
            server.stop()


if __name__ == "__main__":
    main()
