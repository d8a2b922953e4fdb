"""Token continuity for chat: a call extending the previous one is sent as the previous call's exact tokens.

Why: re-tokenizing the model's own output does not give back its token ids (ENVIRONMENT.md: 48 generated
tokens re-encoded became 118-149), so in an agent loop the chat template's rendering of the next request is
usually *not* previous prompt + previous completion + new tail, and the learner cannot merge the calls of a
trajectory into one training row. (The same idea as rLLM's gateway "cumulative token mode".)

How: when a chat request's ``messages`` are exactly the previous call's messages + its reply + new tail
messages, the prompt is built as

    previous prompt ids + previous completion ids + glue + tail ids

and sent to the upstream's ``/v1/completions`` with ``prompt: [ids]`` and the same sampling settings; the
answer is converted back into a chat completion (chunks when streaming). Everything comes from the
upstream's own ``/tokenize`` (chat template and tokenizer of the served model), three renderings at once:

* ``A`` = previous messages + generation prompt (kept from the previous call, not re-asked),
* ``E`` = previous messages + the reply with empty content: ``E = A + glue``, the template text that closes
  an assistant message (ChatML: ``<|im_end|>`` ``\\n``); if the model's last token is the glue's first (it
  stopped on ``<|im_end|>``), that token is not repeated,
* ``P`` = previous messages + reply, and ``F`` = all messages + generation prompt: ``F = P + tail``.

Only the reply's re-tokenized content is replaced by the model's own tokens; every token the template adds
is exactly what the plain chat path would have sent. Whenever something does not line up -- no previous
chat call, tools or structured output, n > 1, a request field this conversion does not know, messages that
do not extend, any of the prefix checks -- the call takes the plain chat path, and the reason is counted in
``harnessrl_proxy_token_continuity_total{outcome=...}``.

Limits: a server-side reasoning or tool parser post-processes chat output; with one configured, turn this
off (``--no-token-continuity``) -- the completions route does not run it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from harnessrl.store.records import CallStatus

from .capture import Attribution, LastCall
from .metrics import ProxyMetrics
from .protocol import dumps, loads, same_message
from .upstreams import UpstreamPool, UpstreamUnavailable

# Chat request fields that mean the same on /v1/completions (vLLM sampling parameters included).
CARRIED = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "stream",
        "stream_options",
        "user",
        "min_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "priority",
        "cache_salt",
        "truncate_prompt_tokens",
        "length_penalty",
    }
)
# Chat fields the conversion handles itself.
HANDLED = frozenset(
    {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "return_token_ids", "n"}
)


class _Fallback(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Plan:
    """A chat call to be served through /v1/completions."""

    request: dict[str, Any]  # the /v1/completions body
    rendered_prompt: list[int]  # F: the chat template's rendering, the next call's A
    top_logprobs: int
    stream: bool
    _started: bool = field(default=False, repr=False)

    @property
    def payload(self) -> bytes:
        return dumps(self.request)

    def convert_response(self, data: dict[str, Any]) -> dict[str, Any]:
        """A /v1/completions answer as the chat completion the harness asked for."""
        choices = []
        prompt_ids = None
        for choice in data.get("choices") or []:
            prompt_ids = prompt_ids or choice.get("prompt_token_ids")
            choices.append(
                {
                    "index": choice.get("index", 0),
                    "message": {"role": "assistant", "content": choice.get("text", "")},
                    "logprobs": self._logprobs(choice.get("logprobs")),
                    "finish_reason": choice.get("finish_reason"),
                    "stop_reason": choice.get("stop_reason"),
                    "token_ids": choice.get("token_ids"),
                }
            )
        out = {
            "id": _chat_id(data.get("id")),
            "object": "chat.completion",
            "created": data.get("created"),
            "model": data.get("model"),
            "choices": choices,
            "usage": data.get("usage"),
            "prompt_token_ids": prompt_ids,
        }
        return out

    def convert_chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """One /v1/completions stream chunk as chat completion chunks (the first one adds the role chunk)."""
        if "error" in chunk and not chunk.get("choices"):
            return [chunk]
        head = {
            "id": _chat_id(chunk.get("id")),
            "object": "chat.completion.chunk",
            "created": chunk.get("created"),
            "model": chunk.get("model"),
        }
        out: list[dict[str, Any]] = []
        choices = chunk.get("choices") or []
        if not self._started and choices:
            self._started = True
            first = {
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
            prompt_ids = choices[0].get("prompt_token_ids")
            if prompt_ids is not None:
                first["prompt_token_ids"] = prompt_ids
            out.append(first)
        converted = []
        for choice in choices:
            item: dict[str, Any] = {
                "index": choice.get("index", 0),
                "delta": {"content": choice.get("text", "")},
                "logprobs": self._logprobs(choice.get("logprobs")),
                "finish_reason": choice.get("finish_reason"),
            }
            if choice.get("stop_reason") is not None:
                item["stop_reason"] = choice["stop_reason"]
            if choice.get("token_ids") is not None:
                item["token_ids"] = choice["token_ids"]
            converted.append(item)
        if converted or chunk.get("usage") is not None:
            body = {**head, "choices": converted}
            if chunk.get("usage") is not None:
                body["usage"] = chunk["usage"]
            out.append(body)
        return out

    def _logprobs(self, lp: Any) -> dict[str, Any] | None:
        if not isinstance(lp, dict):
            return None
        tokens = lp.get("tokens") or []
        values = lp.get("token_logprobs") or []
        tops = lp.get("top_logprobs") or [None] * len(tokens)
        content = []
        for token, value, top in zip(tokens, values, tops):
            entry = {
                "token": token,
                "logprob": value,
                "bytes": list(token.encode("utf-8", "replace")),
                "top_logprobs": [],
            }
            if self.top_logprobs and isinstance(top, dict):
                best = sorted(top.items(), key=lambda kv: kv[1], reverse=True)[: self.top_logprobs]
                entry["top_logprobs"] = [
                    {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))} for t, v in best
                ]
            content.append(entry)
        return {"content": content}


def _chat_id(upstream_id: Any) -> str:
    text = str(upstream_id or "")
    return "chatcmpl-" + text.removeprefix("cmpl-")


class TokenContinuity:
    """Decides, per chat call, whether it can be sent as token ids, and builds the completions request."""

    def __init__(self, upstreams: UpstreamPool, metrics: ProxyMetrics) -> None:
        self.upstreams = upstreams
        self.metrics = metrics
        self._unsupported: set[str] = set()  # upstreams without /tokenize: never asked again

    async def plan(
        self,
        who: Attribution,
        body: dict[str, Any],
        last: LastCall | None,
        model: str | None,
        sampling: dict[str, Any],
    ) -> Plan | None:
        try:
            plan = await self._plan(who, body, last, model, sampling)
        except _Fallback as fb:
            self.metrics.continuity.labels(outcome=fb.reason).inc()
            return None
        self.metrics.continuity.labels(outcome="used").inc()
        return plan

    async def _plan(
        self,
        who: Attribution,
        body: dict[str, Any],
        last: LastCall | None,
        model: str | None,
        sampling: dict[str, Any],
    ) -> Plan:
        if last is None or last.route != "chat" or last.messages is None or last.reply is None:
            raise _Fallback("no_previous_chat_call")
        if last.status is not CallStatus.OK or not last.completion_token_ids or not last.rendered_prompt:
            raise _Fallback("previous_call_incomplete")
        unknown = set(body) - CARRIED - HANDLED
        if unknown:
            raise _Fallback("unsupported_field")
        if body.get("n") not in (None, 1):
            raise _Fallback("n_above_1")
        messages = body["messages"]
        k = len(last.messages)
        if (
            len(messages) < k + 2
            or messages[:k] != last.messages
            or not same_message(messages[k], last.reply)
        ):
            raise _Fallback("not_an_extension")
        if any(
            not isinstance(m.get("content"), (str, type(None))) or m.get("tool_calls") for m in messages[k:]
        ):
            raise _Fallback("unsupported_content")
        if self.upstreams.ranked(who.rollout_id)[0] in self._unsupported:
            raise _Fallback("tokenize_unsupported")

        reply = messages[k]
        empty_reply = {"role": reply.get("role", "assistant"), "content": ""}
        key = who.rollout_id
        e, p, f = await asyncio.gather(
            self._render(messages[:k] + [empty_reply], False, key, model),
            self._render(messages[: k + 1], False, key, model),
            self._render(messages, True, key, model),
        )
        a = list(last.rendered_prompt)
        e_ids, p_ids, (f_ids, max_model_len) = e[0], p[0], f
        glue = e_ids[len(a) :]
        if (
            e_ids[: len(a)] != a
            or not glue
            or p_ids[: len(a)] != a
            or p_ids[-len(glue) :] != glue
            or f_ids[: len(p_ids)] != p_ids
            or len(f_ids) == len(p_ids)
        ):
            raise _Fallback("template_mismatch")
        completion = list(last.completion_token_ids)
        if completion[-1] == glue[0]:
            glue = glue[1:]  # the model already produced the closing token (its stop token)
        prompt = list(last.prompt_token_ids) + completion + glue + f_ids[len(p_ids) :]
        return self._request(body, prompt, f_ids, max_model_len, model, sampling)

    def _request(
        self,
        body: dict[str, Any],
        prompt: list[int],
        rendered: list[int],
        max_model_len: int,
        model: str | None,
        sampling: dict[str, Any],
    ) -> Plan:
        request = {k: v for k, v in body.items() if k in CARRIED}
        request.update(sampling)
        if model is not None:
            request["model"] = model
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is None:  # chat's default is "up to the context limit"; completions' would be 16
            max_tokens = max_model_len - len(prompt)
            if max_tokens < 1:
                raise _Fallback("prompt_too_long")
        top = body.get("top_logprobs") if body.get("logprobs") is True else 0
        top = top if isinstance(top, int) and top > 0 else 0
        request.update(prompt=prompt, max_tokens=max_tokens, return_token_ids=True, logprobs=max(1, top))
        return Plan(request, rendered, top, body.get("stream") is True)

    async def _render(
        self, messages: list[Any], generation_prompt: bool, key: str, model: str | None
    ) -> tuple[list[int], int]:
        payload: dict[str, Any] = {"messages": messages, "add_generation_prompt": generation_prompt}
        if model is not None:
            payload["model"] = model
        try:
            answer = await self.upstreams.fetch("/tokenize", dumps(payload), key)
        except UpstreamUnavailable:
            raise _Fallback("tokenize_failed") from None
        if answer.status == 404:
            self._unsupported.add(answer.url)
            raise _Fallback("tokenize_unsupported")
        if answer.status != 200:
            raise _Fallback("tokenize_failed")
        try:
            data = loads(answer.body)
            tokens, limit = data["tokens"], int(data.get("max_model_len") or 0)
        except (ValueError, KeyError, TypeError):
            raise _Fallback("tokenize_failed") from None
        if not isinstance(tokens, list):
            raise _Fallback("tokenize_failed")
        return tokens, limit
