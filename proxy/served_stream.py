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

Calls with tools and ``tool_choice`` auto (Claude Code's and Codex's usual call) are relayed too, through
``ParsedStream``: the generate endpoint streams tokens, the server's streaming derender lets out as text only
what its tool parser does not hold back as a possible tool call, and the tool calls come from the whole
answer parsed as unstreamed. Measured with ``bench/stream_tools.py`` (tiny model, vLLM on the 2-core CPU,
hermes, a ~1,200-token answer of text then a tool call): first text after 2.0 s against 4.0 s replayed (the
replay's first byte is its last), the whole stream 4.6 s against 4.0 s. Each streaming derender call costs the
server a request with the whole chat request in it (messages and tools: 217 KB at a 32,000-token prompt) and
its parser's work, 20-180 ms on that CPU, and what costs is the number of calls, not their size
(``bench/derender.py``: one call per read of the token stream made 78-143 calls at a 32,000-token prompt, 3.1-3.7 s
of a 3.5-5.0 s call). So the first read's tokens are derendered at once (the harness's first text as soon as
it exists), then each call waits for at least ``stream_derender_tokens`` new tokens (``HARNESSRL_STREAM_DERENDER_TOKENS``,
default 16; tokens that come while a call is out go in the next), and the tokens left when the answer ends go in
one last call: an answer of N tokens makes at most 2 + (N - 2) // 16 streaming calls, besides the whole
answer's derender at the end (``ParsedStream.settle``).

What is still answered whole, then replayed (with keep-alives while generating):

* forced tool calls (``required``, a named tool: the parser reads a grammar-constrained answer whole, and a
  named call's text is its arguments), and calls with a stop string. ``tool_choice: none`` too: vLLM 0.32's
  engine-based parsers still rewrite the content then (``parser/abstract_parser.py`` runs
  ``extract_tool_calls`` and keeps its content), and whether the prompt holds the tools depends on the
  server's ``--exclude-tools-when-tool-choice-none``, which only its render endpoint knows; the answer a
  harness gets must be the one the chat route gives, so these stay on the render / generate / derender path;
* calls whose reasoning a reasoning parser splits off (seen in the parent's reply), for the same reason;
  ``reasoning_effort`` alone (Claude Code sends ``output_config.effort`` on every call) keeps no call here: the
  chat route only gives it to the chat template, and so do the continued call's renderings (``continuity.py``);
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

    def error(self, error: Mapping[str, Any]) -> bytes:
        """The route's error event, ending a stream whose answer failed after events went out."""

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


class ParsedStream:
    """A streamed call with tools (``tool_choice`` auto) relayed while generated: the ``ServedStream`` interface
    (``take`` then ``derender_taken`` per read, ``settle`` awaited) over ``/inference/v1/generate``'s token stream.

    Text: each generate chunk goes through the server's streaming derender (``ServedPlan.derender_chunk``), and
    the content its tool parser lets out goes to the harness at once. The parser holds back, by its own
    markers, whatever may still become a tool call (hermes: a suffix that may begin ``<tool_call>``, and all
    from it on), so no marker is spelled here and a call's raw text never goes out as text. The stop token
    that ends the answer is left out, as the unary derender leaves it out (``continuity.decoded_tokens``).

    End: the whole generate answer, assembled from the chunks, is derendered exactly as the unary path does
    (``ServedPlan.derender``), so the tool calls, the closing events and the stored call are the unstreamed
    call's. The parsed content must begin with the text already sent; it does for hermes, whose streaming and
    whole-answer parsers split the text alike. Where a parser's two paths disagree, the text sent cannot be
    taken back (neither protocol lets a text block or part be rewritten), so the stream ends with the route's
    error event and the call is stored as an error, never as an answer the harness did not get; the harness
    retries it. Forced calls, ``tool_choice: none``, stop strings and reasoning stay on the replay
    (``continuity.TokenContinuity._plan`` sets ``ServedPlan.live``).
    """

    def __init__(self, plan: Any, answer_as: Callable[[dict[str, Any]], dict[str, Any]], live: LiveEvents, *,
                 derender_tokens: int) -> None:
        self.plan = plan  # continuity.ServedPlan, with ``live`` set
        self.answer_as = answer_as
        self.live = live
        self.derender_tokens = derender_tokens  # fewest new tokens per streaming derender call but the first
        self.derender_calls = 0
        self.error: dict[str, Any] | None = None
        self.started = False
        self.sent = ""  # the text the harness got
        self.head: dict[str, Any] = {}
        self.choice: dict[str, Any] = {"index": 0, "token_ids": [], "logprobs": None, "finish_reason": None,
                                       "stop_reason": None}
        self.state: Any = None  # the streaming derender's state, carried between its calls
        self._answer: dict[str, Any] | None = None
        self._taken: tuple[list[int], list[Any], dict[str, Any]] = ([], [], {})  # since the last derender call

    def take(self, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chunks one read brought, kept for one streaming-derender call (``derender_taken``); the start
        events when the first token came, to send before that call is awaited: a derender call costs more than
        a token on a loaded CPU (50-180 ms measured on the 2-core machine, the parser replaying the answer so
        far), so the harness sees its stream begin with the first token, and tokens that come while one call is
        out go together in the next, so the text keeps up with generation."""
        events: list[dict[str, Any]] = []
        ids, entries, last = self._taken
        for chunk in chunks:
            if "error" in chunk and not chunk.get("choices"):
                self.error = dict(chunk)
                continue
            choices = [c for c in chunk.get("choices") or [] if isinstance(c, dict) and c.get("index", 0) == 0]
            if not self.started and choices:
                self.started = True
                self.head = {k: chunk[k] for k in ("request_id", "prompt_token_ids") if chunk.get(k) is not None}
                events += self.live.start({"id": f"chatcmpl-{chunk.get('request_id', '')}"},
                                          len(self.plan.request.get("token_ids") or ()))
            for choice in choices:
                new = list(choice.get("token_ids") or [])
                logprobs = list((choice.get("logprobs") or {}).get("content") or [])
                self.choice["token_ids"] += new
                if choice.get("logprobs") is not None:
                    self.choice["logprobs"] = {"content": [*(self.choice["logprobs"] or {}).get("content", []),
                                                           *logprobs]}
                for name in ("finish_reason", "stop_reason"):
                    if choice.get(name) is not None:
                        self.choice[name] = choice[name]
                ids += new
                entries += logprobs
                last = {**chunk, "choices": [choice]}
        self._taken = (ids, entries, last)
        return events

    async def derender_taken(self) -> list[dict[str, Any]]:
        """The text events of the tokens taken since the last call, derendered in one streaming-derender call:
        the first read's at once, later ones once ``derender_tokens`` are taken (else they wait for a later
        read), and whatever is left when the answer ends (the final flush, before ``settle``)."""
        ids, entries, last = self._taken
        if not ids:
            return []
        choice = last["choices"][0]
        ended = choice.get("finish_reason") is not None
        if self.derender_calls and len(ids) < self.derender_tokens and not ended:
            return []
        self._taken = ([], [], {})
        if self.choice["finish_reason"] == "stop" and not isinstance(self.choice["stop_reason"], str) and ended:
            ids, entries = ids[:-1], entries[: len(ids) - 1]  # the stop token: no text (decoded_tokens)
            if not ids:
                return []
        self.derender_calls += 1
        part = {**choice, "token_ids": ids, "finish_reason": None, "stop_reason": None,
                "logprobs": {"content": entries} if choice.get("logprobs") is not None else None}
        text, logprobs, self.state = await self.plan.derender_chunk({**last, "choices": [part]}, self.state)
        if not text:
            return []
        self.sent += text
        return self.live.text(text, logprobs)

    def beat(self) -> bytes:
        return self.live.beat()

    def whole(self) -> dict[str, Any]:
        """The generate answer the chunks make up, as the unary call's."""
        return {**self.head, "choices": [dict(self.choice)]}

    async def settle(self) -> list[dict[str, Any]]:
        """Once the upstream completed: the whole answer derendered as unstreamed; the events of the text the
        parser still held back (no tool call came of it), or the error when the parsed text does not begin
        with the text sent."""
        from .continuity import DerenderFailed  # continuity imports this module's users

        try:
            chat = await self.plan.derender(self.whole())
        except DerenderFailed as exc:
            self.error = {"error": {"message": str(exc), "type": "upstream_error", "code": "derender_failed"}}
            return []
        message = ((chat.get("choices") or [{}])[0].get("message") or {})
        content = message.get("content") if isinstance(message.get("content"), str) else ""
        self._answer = self.answer_as(chat)
        if not content.startswith(self.sent):
            self.error = {"error": {
                "message": "the server's tool parser split the whole answer otherwise than its stream: the text "
                           "sent is not the answer's, so this answer is withdrawn; retry the call",
                "type": "upstream_error", "code": "streamed_text_not_parsed"}}
            return []
        rest = content[len(self.sent):]
        self.sent = content
        return self.live.text(rest, None) if rest else []

    def finish(self) -> list[dict[str, Any]]:
        return self.live.end(without_carried(self.response()))

    def response(self) -> dict[str, Any]:
        """The derendered answer once settled; before (the harness left, the upstream failed) the text sent and
        the tokens so far, unparsed."""
        answer = self._answer
        if answer is None:
            from .continuity import _token_id_logprobs

            prompt = list(self.plan.request.get("token_ids") or [])
            ids = list(self.choice["token_ids"])
            chat = {"id": f"chatcmpl-{self.head.get('request_id', '')}", "object": "chat.completion",
                    "model": self.plan.chat_request.get("model"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": self.sent},
                                 "logprobs": _token_id_logprobs(self.choice["logprobs"] or {}),
                                 "finish_reason": self.choice["finish_reason"], "token_ids": ids}],
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                              "total_tokens": len(prompt) + len(ids)},
                    "prompt_token_ids": prompt}
            answer = self.answer_as(chat)
        return answer if self.error is None else {**answer, "error": self.error.get("error", self.error)}

    def tokens(self) -> Tokens:
        return carried(self.response()) or Tokens()
