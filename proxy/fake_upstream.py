"""A fast, deterministic stand-in for a vLLM server, for tests and benchmarks (never for training).

It is a real aiohttp server speaking vLLM's wire format, with ``return_token_ids`` and log-probs, streamed
and not (see ``protocol.py`` for the field names), so the proxy is exercised over real HTTP without a model.
Tokenization is one token per UTF-8 byte of the ChatML-rendered prompt (id = byte + 3), so prompt ids
are exact and predictable; completion token ``i`` of a call is ``3 + (i * 7919 + seed) % 1000`` with
log-prob ``-((id % 97) + 1) / 10``. ``script`` makes the next requests fail with given statuses (or
``"drop"`` to close the connection), ``break_stream_after`` cuts a stream after that many chunks, and
``chunk_delay_s`` slows streams down; ``hits`` and ``aborted`` count requests and streams whose client
went away.

Run standalone (benchmarks): ``python -m harnessrl.proxy.fake_upstream --port N [--prompt-tokens K]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections import deque
from typing import Any

import msgspec
from aiohttp import web

VOCAB_OFFSET = 3


def render_chat(messages: list[dict[str, Any]]) -> str:
    out = []
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        out.append(f"<|im_start|>{message.get('role')}\n{content}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def encode(text: str) -> list[int]:
    return [b + VOCAB_OFFSET for b in text.encode()]


def completion_ids(n: int, seed: int) -> list[int]:
    return [VOCAB_OFFSET + (i * 7919 + seed) % 1000 for i in range(n)]


def token_logprob(token_id: int) -> float:
    return -((token_id % 97) + 1) / 10


def token_text(token_id: int) -> str:
    return f" t{token_id}"


class FakeUpstream:
    def __init__(
        self,
        *,
        fixed_prompt_tokens: int | None = None,
        default_max_tokens: int = 16,
        chunk_delay_s: float = 0.0,
        model: str = "fake-model",
    ) -> None:
        self.fixed_prompt_tokens = fixed_prompt_tokens
        self.default_max_tokens = default_max_tokens
        self.chunk_delay_s = chunk_delay_s
        self.response_delay_s = 0.0  # before a non-streamed answer
        self.finish_reason = "length"  # of a non-streamed chat answer ("stop": an answer that ended by itself)
        self.model = model
        self.script: deque[int | str] = deque()
        self.break_stream_after: int | None = None
        self.hits = 0
        self.aborted = 0
        self.completed_streams = 0
        self.bodies: deque[dict[str, Any]] = deque(maxlen=1000)
        self._seed = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "fake"}]}
        )

    async def _admit(self, request: web.Request) -> tuple[dict[str, Any] | None, web.StreamResponse | None]:
        self.hits += 1
        if self.script:
            action = self.script.popleft()
            if action == "drop":
                assert request.transport is not None
                request.transport.close()
                return None, web.Response(status=500)
            return None, web.json_response(
                {
                    "error": {
                        "message": f"scripted {action}",
                        "type": "ServiceUnavailable",
                        "param": None,
                        "code": action,
                    }
                },
                status=int(action),
                headers={"Retry-After": "0"} if action in (429, 503) else None,
            )
        try:
            body = msgspec.json.decode(await request.read())
        except (ValueError, RecursionError) as exc:
            body, problem = None, f"bad JSON: {exc}"
        else:
            problem = "the body must be a JSON object"
        if not isinstance(body, dict):
            return None, web.json_response(
                {"error": {"message": problem, "type": "BadRequestError", "param": None, "code": 400}},
                status=400,
            )
        self.bodies.append(body)
        return body, None

    def _prompt_ids(self, text: str) -> list[int]:
        if self.fixed_prompt_tokens is not None:
            ids = encode(text)[: self.fixed_prompt_tokens]
            return ids + [VOCAB_OFFSET] * (self.fixed_prompt_tokens - len(ids))
        return encode(text)

    def _plan(self, body: dict[str, Any]) -> tuple[list[int], int]:
        self._seed += 1
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 < max_tokens <= 4096:
            max_tokens = self.default_max_tokens
        return completion_ids(max_tokens, self._seed), self._seed

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body, early = await self._admit(request)
        if early is not None:
            return early
        assert body is not None
        messages = body.get("messages")
        if not isinstance(messages, list):
            return web.json_response(
                {
                    "error": {
                        "message": "messages required",
                        "type": "BadRequestError",
                        "param": "messages",
                        "code": 400,
                    }
                },
                status=400,
            )
        prompt = self._prompt_ids(render_chat([m for m in messages if isinstance(m, dict)]))
        ids, _ = self._plan(body)
        if self.response_delay_s and body.get("stream") is not True:
            await asyncio.sleep(self.response_delay_s)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        want_ids, want_lp = body.get("return_token_ids") is True, bool(body.get("logprobs"))

        def lp_entries(tokens: list[int]) -> dict[str, Any] | None:
            if not want_lp:
                return None
            return {
                "content": [
                    {
                        "token": token_text(t),
                        "logprob": token_logprob(t),
                        "bytes": list(token_text(t).encode()),
                        "top_logprobs": [],
                    }
                    for t in tokens
                ]
            }

        if body.get("stream") is True:
            return await self._stream_chat(request, body, rid, created, prompt, ids, want_ids, lp_entries)
        out = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": body.get("model", self.model),
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "".join(map(token_text, ids)),
                        "refusal": None,
                        "tool_calls": [],
                        "reasoning": None,
                    },
                    "logprobs": lp_entries(ids),
                    "finish_reason": self.finish_reason,
                    "stop_reason": None,
                    "token_ids": ids if want_ids else None,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if want_ids else None,
        }
        return _json(out)

    async def _stream_chat(
        self,
        request: web.Request,
        body: dict[str, Any],
        rid: str,
        created: int,
        prompt: list[int],
        ids: list[int],
        want_ids: bool,
        lp_entries: Any,
    ) -> web.StreamResponse:
        model = body.get("model", self.model)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        first: dict[str, Any] = {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if want_ids:
            first["prompt_token_ids"] = prompt
        chunks = [first]
        for i, tok in enumerate(ids):
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": token_text(tok)},
                "logprobs": lp_entries([tok]),
                "finish_reason": "length" if i == len(ids) - 1 else None,
            }
            if want_ids:
                choice["token_ids"] = [tok]
            chunks.append({**head, "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append(
                {
                    **head,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": len(prompt),
                        "completion_tokens": len(ids),
                        "total_tokens": len(prompt) + len(ids),
                    },
                }
            )
        return await self._send_stream(request, chunks)

    async def _send_stream(self, request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            for n, chunk in enumerate(chunks):
                if self.break_stream_after is not None and n >= self.break_stream_after:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.completed_streams += 1
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted += 1
            raise
        return resp

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body, early = await self._admit(request)
        if early is not None:
            return early
        assert body is not None
        prompt_in = body.get("prompt")
        if isinstance(prompt_in, list) and prompt_in and all(isinstance(t, int) for t in prompt_in):
            prompt = list(prompt_in)
        elif isinstance(prompt_in, str):
            prompt = self._prompt_ids(prompt_in)
        else:
            return web.json_response(
                {
                    "error": {
                        "message": "prompt must be a string or token ids",
                        "type": "BadRequestError",
                        "param": "prompt",
                        "code": 400,
                    }
                },
                status=400,
            )
        ids, _ = self._plan(body)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        want_ids = body.get("return_token_ids") is True
        k = body.get("logprobs")

        def lp(tokens: list[int]) -> dict[str, Any] | None:
            if k is None:
                return None
            return {
                "text_offset": list(range(len(tokens))),
                "token_logprobs": [token_logprob(t) for t in tokens],
                "tokens": [token_text(t) for t in tokens],
                "top_logprobs": [{token_text(t): token_logprob(t)} for t in tokens] if k else None,
            }

        model = body.get("model", self.model)
        if body.get("stream") is True:
            head = {"id": rid, "object": "text_completion", "created": created, "model": model}
            chunks = []
            for i, tok in enumerate(ids):
                choice: dict[str, Any] = {
                    "index": 0,
                    "text": token_text(tok),
                    "logprobs": lp([tok]),
                    "finish_reason": "length" if i == len(ids) - 1 else None,
                    "stop_reason": None,
                }
                if want_ids:
                    choice["token_ids"] = [tok]
                    if i == 0:
                        choice["prompt_token_ids"] = prompt
                chunks.append({**head, "choices": [choice]})
            return await self._send_stream(request, chunks)
        out = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(map(token_text, ids)),
                    "logprobs": lp(ids),
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt if want_ids else None,
                    "token_ids": ids if want_ids else None,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
        }
        return _json(out)


def _json(obj: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    fake = FakeUpstream(fixed_prompt_tokens=args.prompt_tokens, default_max_tokens=args.max_tokens)
    web.run_app(fake.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
