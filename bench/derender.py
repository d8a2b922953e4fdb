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

    python bench/derender.py --lengths 1000,8000,32000 --repeat 3 --batches 1,16

Measured (2-core CPU shared with other work, load 3-4; three runs): an unstreamed continued call's one
derender call costs 21-33 ms whatever the prompt (payload 41 KB at 1,000 prompt tokens, 217 KB at 32,000): 1-3%
of the call (0.8-2.9 s), a share that falls as prompts grow (unary_share_ratio 0.35-0.66). Streamed, the calls
are many: 78-143 at 32,000 tokens, where a token comes about as often as a derender call ends (3.1-3.7 s of
them in a 3.5-5.0 s call; the streamed call ended 1.5-1.7x later than the unstreamed one on this CPU, where the
server's derender work competes with its engine for the cores), and 2-60 at 1,000-8,000 tokens depending on how
many tokens each read brings. So the payload's size is not the cost; the number of streaming derender calls is.

Streamed calls now batch their derender calls (``served_stream.ParsedStream``: the first read's tokens at once,
then at least ``HARNESSRL_STREAM_DERENDER_TOKENS`` new tokens a call, then the rest at the end). ``--batches``
runs the streamed mode once per setting, each through its own proxy on the same server, taking turns with the
unstreamed call: 1 is one call per read (before the batching), 16 the default.

    python bench/derender.py --lengths 1000,32000 --repeat 5 --batches 1,16

Measured, both in one run (2-core CPU, load 15-24; medians of 5): at 32,000 prompt tokens 64 derender calls
per read against 8 batched (7 streaming + the whole answer's), 2.47 s of them against 0.48 s, and the streamed
call 3.54 s against 2.42 s (1.40x the unstreamed call's 2.53 s against 0.96x), its first text at 0.69 s against
0.63 s; at 1,000 tokens 4 calls against 3, where the loaded server already brought many tokens per read. An
earlier run (load 9, 3 rounds, 1,000 / 8,000 / 32,000): 64 against 16 calls and 2.21 s against 1.03 s at 32,000
tokens, the streamed calls 2.80 and 2.93 s (1.13x and 1.18x the unstreamed one).

Per length and mode: the call's seconds, the derender calls, their seconds and share of the call, the payload
size; streamed, the seconds to the first text and the text events before the tool call. Last line: ``name=value`` pairs, the derender share per mode at the shortest and longest prompt, their
ratio (longest / shortest), the streamed call's seconds over the unstreamed one's, and per batch setting the
derender calls at the longest prompt and the streamed call's seconds over the first setting's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
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


def measure(proxies: dict[str, Any], tokenizer: Any, lengths: list[int], repeat: int, spent: list[tuple[float, int]]
            ) -> tuple[dict[Key, float], dict[Key, float], dict[Key, float]]:
    """Each length's continued calls per mode (``unary``, or ``stream<N>``: streamed through the proxy whose
    ``stream_derender_tokens`` is N), taking turns, a line printed per length and mode; the derender share of
    each, the call's seconds and the derender calls (medians). ``spent`` collects the derender calls."""
    shares: dict[Key, float] = {}
    calls: dict[Key, float] = {}
    counts: dict[Key, float] = {}
    for length in lengths:
        runs: dict[str, list[tuple[float, int, float, int, float, int]]] = {mode: [] for mode in proxies}
        for i in range(repeat):
            for mode, proxy in proxies.items():
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
                    first_text, deltas = 0.0, 0
                else:
                    timing = streamed(url, {**body, "stream": True})
                    first_text, deltas = timing["first_text"] or 0.0, timing["text_deltas"]
                seconds = time.perf_counter() - start
                assert spent, "the continued call made no derender call (not continued?)"
                runs[mode].append((seconds, len(spent), sum(s for s, _ in spent), spent[-1][1], first_text, deltas))
        for mode, rows in runs.items():
            call = statistics.median(r[0] for r in rows)
            derender = statistics.median(r[2] for r in rows)
            shares[(mode, length)] = derender / call
            calls[(mode, length)] = call
            counts[(mode, length)] = statistics.median(r[1] for r in rows)
            print(f"prompt={length} mode={mode} call_s={call:.3f} derender_calls={counts[(mode, length)]:.0f} "
                  f"derender_s={derender:.3f} share={derender / call:.3f} payload_kb={rows[0][3] / 1024:.0f}"
                  + ("" if mode == "unary" else f" first_text_s={statistics.median(r[4] for r in rows):.3f} "
                     f"text_deltas={statistics.median(r[5] for r in rows):.0f}"), flush=True)
    return shares, calls, counts


def summary(shares: dict[Key, float], calls: dict[Key, float], counts: dict[Key, float], modes: list[str],
            short: int, long: int) -> str:
    streams = [m for m in modes if m != "unary"]
    return (
        " ".join(f"{mode}_share_{n}={shares[(mode, n)]:.3f}" for mode in modes for n in (short, long))
        + "".join(f" {mode}_share_ratio={shares[(mode, long)] / shares[(mode, short)]:.2f}" for mode in modes)
        + "".join(f" {mode}_over_unary_{n}={calls[(mode, n)] / calls[('unary', n)]:.2f}"
                  for mode in streams for n in (short, long))
        + "".join(f" {mode}_derender_calls_{long}={counts[(mode, long)]:.0f}" for mode in streams)
        + "".join(f" {mode}_over_{streams[0]}_{long}={calls[(mode, long)] / calls[(streams[0], long)]:.2f}"
                  for mode in streams[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1000,8000,32000", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=4)
    parser.add_argument("--batches", default="1,16",
                        help="stream_derender_tokens settings of the streamed mode, comma-separated (1: per read)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    batches = [int(n) for n in args.batches.split(",")]

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
            with ExitStack() as stack:
                proxies = {"unary": stack.enter_context(proxy_in_front(server, Path(tmp), "bench", sampling))[1]}
                for n in batches:
                    folder = Path(tmp) / f"stream{n}"
                    folder.mkdir()
                    proxies[f"stream{n}"] = stack.enter_context(
                        proxy_in_front(server, folder, "bench", sampling, stream_derender_tokens=n))[1]
                shares, calls, counts = measure(proxies, tokenizer, lengths, args.repeat, spent)
            print(summary(shares, calls, counts, list(proxies), lengths[0], lengths[-1]))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
