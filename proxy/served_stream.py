"""A streamed Messages or Responses call continued through ``/v1/completions``, relayed while it is generated.

Why: Claude Code and Codex CLI always stream, and a stream answered once its completion is whole (the replay,
``CaptureProxy._replayed``) gives the harness its first token only after the last one was generated (issue
26: 30-62 s on CPU; minutes for long answers on a GPU), so clients with stream idle timeouts give up.

What streams: a continued call that no server-side parser must read, i.e. one ``TokenContinuity`` plans on
``/v1/completions`` (``continuity.Plan``: no tools, no reasoning parser at work, no structured output; such a
call never carries a grammar, since ``response_format`` or a Responses ``text.format`` keeps the call off the
continuation path). Its text is the completion's text as generated, so each upstream chunk goes out at once:
converted to chat chunks (``Plan.convert_chunk``), then to the route's text events (``anthropic_api.LiveMessage``:
``content_block_delta``; ``responses_api.LiveResponse``: ``response.output_text.delta``). The chat chunks are
assembled as a streamed chat call is (``protocol.StreamAssembler``), and once the upstream ends, the whole chat
completion is translated as the unary path translates it (``answer_as``): the closing events (the block's or
item's end, the stop reason, the usage) come from that answer, so the harness's final message and the stored
call (request, answer, token ids, log-probs) are what the same call unstreamed gives. Until the first token
(the upstream reading a long prompt) the route's keep-alive goes out every ``stream_keepalive_s``, as on the
replay path.

What is still answered whole, then replayed (with keep-alives while generating):

* calls with tools: the server's tool parser reads the whole answer (derender), and text streamed before it
  would be wrong once the parser takes that text for a tool call, which it may do at any later token (the
  hermes parser claims everything from ``<tool_call>`` on). ``tool_choice: none`` too: vLLM 0.32's
  engine-based parsers still rewrite the content then (``parser/abstract_parser.py`` runs
  ``extract_tool_calls`` and keeps its content), and whether the prompt holds the tools depends on the
  server's ``--exclude-tools-when-tool-choice-none``, which only its render endpoint knows; the answer a
  harness gets must be the one the chat route gives, so these stay on the render / generate / derender path;
* calls whose reasoning a reasoning parser splits off, for the same reason;
* first calls of a conversation (no earlier call to continue: the plain chat route, answered whole and
  translated; vLLM's own Messages and Responses streams carry no token ids or lose log-probs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .chat_served import carried, without_carried
from .protocol import StreamAssembler, Tokens


class LiveEvents(Protocol):
    """A route's events for an answer relayed while generated (``anthropic_api.LiveMessage``,
    ``responses_api.LiveResponse``)."""

    def beat(self) -> bytes:
        """A keep-alive before the first token (the replay path's ``heartbeat``)."""

    def start(self, head: Mapping[str, Any], prompt_tokens: int) -> list[dict[str, Any]]: ...

    def text(self, delta: str, logprobs: Any) -> list[dict[str, Any]]:
        """A chunk's text (empty for a token that ends inside a UTF-8 character) and chat log-probs."""

    def end(self, answer: Mapping[str, Any]) -> list[dict[str, Any]]: ...


def streamed_chat(chat: Mapping[str, Any]) -> dict[str, Any]:
    """The translated chat request a streamed call is planned on: streamed, ending with the usage chunk (the
    answer's ``usage``, as the unary answer has it). A plan through the server's parsers sends it unstreamed."""
    return {**chat, "stream": True, "stream_options": {"include_usage": True}}


class ServedStream:
    """One relayed stream: ``feed`` turns each upstream chunk into the route's events to send now, ``finish``
    gives the closing events once the upstream ended; ``response``, ``tokens`` and ``error`` are what the
    capture records (the ``StreamAssembler`` interface)."""

    def __init__(self, to_chat: Callable[[dict[str, Any]], list[dict[str, Any]]],
                 answer_as: Callable[[dict[str, Any]], dict[str, Any]], live: LiveEvents) -> None:
        self.to_chat = to_chat  # the plan's chunk conversion: completions chunk -> chat chunks
        self.answer_as = answer_as
        self.live = live
        self.chat = StreamAssembler("chat")
        self.error: dict[str, Any] | None = None
        self.started = False  # the first chunk came: its start events are sent
        self._answer: dict[str, Any] | None = None

    def feed(self, upstream_chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for chunk in self.to_chat(upstream_chunk):
            if "error" in chunk and not chunk.get("choices"):  # vLLM's in-stream error: the stream fails
                self.error = dict(chunk)
                continue
            self.chat.feed(chunk)
            choices = chunk.get("choices") or []
            if not self.started and choices:
                self.started = True
                events += self.live.start(chunk, len(chunk.get("prompt_token_ids") or ()))
            for choice in choices:
                delta = choice.get("delta") or {}
                content = delta.get("content")
                if choice.get("index", 0) == 0 and (content or choice.get("logprobs")):  # a token's empty text too
                    events += self.live.text(content if isinstance(content, str) else "", choice.get("logprobs"))
        return events

    def beat(self) -> bytes:
        return self.live.beat()

    def finish(self) -> list[dict[str, Any]]:
        """The closing events of a stream the upstream completed."""
        return self.live.end(without_carried(self.response()))

    def response(self) -> dict[str, Any]:
        """The answer as the harness gets it whole (its tokens carried for the capture), with the error when
        the stream failed."""
        if self._answer is None:
            chat = self.chat.response()
            chat.pop("error", None)
            self._answer = self.answer_as(chat)
        return self._answer if self.error is None else {**self._answer, "error": self.error.get("error", self.error)}

    def tokens(self) -> Tokens:
        return carried(self.response()) or Tokens()
