"""What turning generated tokens back into the answer costs on the continuation path, as prompts grow.

A continued call with tools (Claude Code's and Codex's usual call) is generated from token ids
(``/inference/v1/generate``) and turned back into the chat completion by vLLM's ``/v1/chat/completions/derender``
(``proxy/continuity.py``), whose payload carries the whole chat request (messages and tools) and the prompt's
token ids besides the generated tokens. Unstreamed, that is one derender call per answer; streamed and relayed
(``served_stream.ParsedStream``), one per read of the token stream, each with the same payload, then one for the
whole answer. This runs both through one in-process capture proxy on one vLLM server (the tiny model on the
CPU, a 64k context, hermes tool parser), for prompts of ``--lengths`` tokens, and reports the time spent in
derender calls (the proxy's encoding of the payload, the transfer, the server's work, the decoding of its
answer) against the whole continued call. The model is steered by a regex to ``--sentences`` sentences of
text and then one hermes tool call, so every answer has the same tokens.

    python bench/derender.py --lengths 1000,8000,32000 --repeat 3

Measured (2-core CPU shared with other work, load 3-4; three runs): an unstreamed continued call's one
derender call costs 21-33 ms whatever the prompt (payload 41 KB at 1,000 prompt tokens, 217 KB at 32,000): 1-3%
of the call (0.8-2.9 s), a share that falls as prompts grow (unary_share_ratio 0.35-0.66). Streamed, the calls
are many: 78-143 at 32,000 tokens, where a token comes about as often as a derender call ends (3.1-3.7 s of
them in a 3.5-5.0 s call; the streamed call ended 1.5-1.7x later than the unstreamed one on this CPU, where the
server's derender work competes with its engine for the cores), and 2-60 at 1,000-8,000 tokens depending on how
many tokens each read brings. So the payload's size is not the cost; the number of streaming derender calls is.

Per length and mode: the call's seconds, the derender calls, their seconds and share of the call, the payload
size. Last line: ``name=value`` pairs, the derender share per mode at the shortest and longest prompt, their
ratio (longest / shortest), and the streamed call's seconds over the unstreamed one's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

from stream_tools import CALL, SENTENCE, TOOLS, regex, streamed  # noqa: E402

FILLER = "the harness read the file and ran the tests again, then it wrote down what failed and why. "


def filler(tokenizer: Any, tokens: int) -> str:
    """Text of about ``tokens`` tokens (whole sentences)."""
    per = len(tokenizer.encode(FILLER))
    return FILLER * max(1, tokens // per)


Key = tuple[str, int]  # (mode, prompt length)


def measure(proxy: Any, tokenizer: Any, lengths: list[int], repeat: int, spent: list[tuple[float, int]]
            ) -> tuple[dict[Key, float], dict[Key, float]]:
    """Each length's continued calls, unstreamed and streamed, through ``proxy``, a line printed per length and
    mode; the derender share of each and the call's seconds (medians). ``spent`` collects the derender calls."""
    shares: dict[Key, float] = {}
    calls: dict[Key, float] = {}
    for length in lengths:
        runs: dict[str, list[tuple[float, int, float, int]]] = {"unary": [], "stream": []}
        for i in range(repeat):
            for mode in runs:
                url = f"{proxy.url}/rollouts/{mode}-{length}-{i}/attempts/0/v1/messages"
                body = {"model": "m", "system": filler(tokenizer, length), "tools": TOOLS, "max_tokens": 4000,
                        "messages": [{"role": "user", "content": f"fix the failing test {i}"}]}
                first = httpx.post(url, json=body, timeout=600).json()
                body["messages"] += [{"role": "assistant", "content": first["content"]},
                                     {"role": "user", "content": [{"type": "tool_result", "content": "ok",
                                                                   "tool_use_id": first["content"][-1]["id"]}]}]
                spent.clear()
                start = time.perf_counter()
                if mode == "unary":
                    answer = httpx.post(url, json=body, timeout=600).json()
                    assert answer["content"][-1]["type"] == "tool_use", answer
                else:
                    streamed(url, {**body, "stream": True})
                seconds = time.perf_counter() - start
                assert spent, "the continued call made no derender call (not continued?)"
                runs[mode].append((seconds, len(spent), sum(s for s, _ in spent), spent[-1][1]))
        for mode, rows in runs.items():
            call = statistics.median(r[0] for r in rows)
            derender = statistics.median(r[2] for r in rows)
            shares[(mode, length)] = derender / call
            calls[(mode, length)] = call
            print(f"prompt={length} mode={mode} call_s={call:.3f} derender_calls="
                  f"{statistics.median(r[1] for r in rows):.0f} derender_s={derender:.3f} "
                  f"share={derender / call:.3f} payload_kb={rows[0][3] / 1024:.0f}", flush=True)
    return shares, calls


def summary(shares: dict[Key, float], calls: dict[Key, float], short: int, long: int) -> str:
    return (
        " ".join(f"{mode}_share_{n}={shares[(mode, n)]:.3f}" for mode in ("unary", "stream") for n in (short, long))
        + "".join(f" {mode}_share_ratio={shares[(mode, long)] / shares[(mode, short)]:.2f}"
                  for mode in ("unary", "stream"))
        + "".join(f" stream_over_unary_{n}={calls[('stream', n)] / calls[('unary', n)]:.2f}" for n in (short, long)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1000,8000,32000", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=4)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]

    from transformers import AutoTokenizer
    from vllm_fixtures import LONG_MAX_MODEL_LEN, SERVED_NAME, TOOL_SERVER_ARGS, proxy_in_front

    from harnessrl.local.vllm_server import start_vllm
    from harnessrl.proxy.continuity import TokenContinuity
    from harnessrl.proxy.protocol import dumps
    from harnessrl.tiny_model import TinyModelConfig, build_tiny_model

    spent: list[tuple[float, int]] = []  # (seconds, payload bytes) of each derender call
    derendered = TokenContinuity._derendered

    async def timed(self, payload, key):
        start = time.perf_counter()
        try:
            return await derendered(self, payload, key)
        finally:
            spent.append((time.perf_counter() - start, len(dumps(payload))))

    TokenContinuity._derendered = timed
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", TinyModelConfig(max_position_embeddings=LONG_MAX_MODEL_LEN))
        tokenizer = AutoTokenizer.from_pretrained(model)
        server = start_vllm(model, Path(tmp) / "vllm.log", served_name=SERVED_NAME, max_model_len=LONG_MAX_MODEL_LEN,
                            extra_args=TOOL_SERVER_ARGS, timeout_s=600, cpu=True)
        sampling = {"temperature": 1.0, "structured_outputs": {"regex": regex(SENTENCE * args.sentences + CALL)}}
        try:
            with proxy_in_front(server, Path(tmp), "bench", sampling) as (_, proxy):
                shares, calls = measure(proxy, tokenizer, lengths, args.repeat, spent)
            print(summary(shares, calls, lengths[0], lengths[-1]))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
