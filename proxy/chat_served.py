"""What the routes the proxy serves as chat completions (Anthropic Messages, and Responses in train mode) share.

Why serve them as chat: vLLM's own ``/v1/messages`` answers without token ids or log-probs, its
``/v1/responses`` gives no log-probs for a ``function_call`` output, and neither can continue an earlier call's
exact tokens. A chat completion has all three (token continuity, ``continuity.py``, works on chat requests), so
such a call is translated into the chat request it amounts to (same messages, tools and sampling, rendered by
the same chat template), served on the chat path -- continued from its parent's tokens when it extends an
earlier call -- and its answer translated back into the route's shape. The chat answer's tokens travel with the
translated answer under ``CAPTURE_KEY`` to the capture, which takes them out before anything is stored or sent.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from .protocol import Tokens, ask_allowed
from .protocol import tokens_from_response as chat_tokens

PATH = "/v1/chat/completions"
CAPTURE_KEY = "_harnessrl_tokens"  # carries the chat completion's tokens from the translation to the capture


def for_upstream(
    chat: Mapping[str, Any], *, train: bool, model: str | None, sampling: Mapping[str, Any]
) -> dict[str, Any]:
    """The translated chat request as sent upstream on the plain chat path (never streamed: the answer is
    translated whole): the run's model and sampling, and in train mode token ids and log-probs."""
    out = dict(chat)
    if model is not None:
        out["model"] = model
    if train:
        out.update(sampling)
        out["return_token_ids"] = True
        out["logprobs"] = True
        ask_allowed(out, chat)
    return out


def carry(chat: Mapping[str, Any]) -> list[Any]:
    """The chat answer's tokens, in the form ``carried`` reads back (JSON-safe: the answer may be replayed)."""
    tokens = chat_tokens("chat", chat)
    return [tokens.prompt_token_ids, tokens.completion_token_ids, tokens.logprobs, tokens.finish_reason,
            tokens.allowed]


def carried(body: Mapping[str, Any]) -> Tokens | None:
    """The tokens a translated answer carries, or None for an answer that carries none."""
    value = body.get(CAPTURE_KEY)
    return Tokens(*value) if isinstance(value, list) and len(value) in (4, 5) else None


def without_carried(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without the carried tokens (what the harness gets and the store keeps)."""
    if CAPTURE_KEY not in obj:
        return obj
    return {k: v for k, v in obj.items() if k != CAPTURE_KEY}


def then(first: Callable[[Any], Any], second: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``second(first(data))``, awaiting ``first``'s result when it is awaitable (a continued call with tools
    is turned into a chat completion by the server's derender endpoint)."""

    def convert(data: Any) -> Any:
        out = first(data)
        if inspect.isawaitable(out):

            async def later() -> Any:
                return second(await out)

            return later()
        return second(out)

    return convert
