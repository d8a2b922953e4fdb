"""Turning one finished exchange into a ``CallRecord``, with its place in the rollout.

Sequence numbers: the proxy numbers the calls of each rollout attempt 0, 1, 2... in the order they
*finish* (when the record is handed to the writer). For an agent loop that is also the order they started;
for calls a harness runs concurrently, finish order is the order in which their results could have fed any
later prompt. Numbering at finish also means the call with ``seq - 1`` always reaches the writer first, so
the store finds each call's predecessor earlier in the same batch or already stored (its delta encoding).

The ledger keeps, per live rollout attempt, the next sequence number and slim summaries of its recent calls
(token ids as compact int32 arrays, messages and reply) for token continuity (``continuity.py``): the call a
new one extends is chosen among them, so two conversations interleaved in one attempt (an agent and its
sub-agent) each continue their own. A call that another one extended is superseded and dropped, so a linear
agent loop holds one call per attempt, and at most ``RECENT_PER_ATTEMPT`` are kept (oldest out). A call sent
with token continuity still remembers the call it continued (``ContinuedFrom``: a few numbers, since that
call's tokens and messages begin its own), so that a harness re-sending a call it already got an answer for
(its SDK timed out after the answer came, or the harness sends it again) continues that same call as the
answered one did, instead of being rendered afresh and splitting its conversation. Both maps are
bounded (least recently used first out): the counters by count, the recent calls by the tokens they hold. A
counter that fell out would restart numbering, so its bound is large (``HARNESSRL_LIVE_ROLLOUTS``).

Why not the whole last ``CallRecord``: the store computes deltas from digests kept on the stored rows, so
it needs no predecessor in memory, and a full record with its decoded
response costs ~220 kB of Python objects for a 1k+200-token call -- the proxy's RSS grew by ~400 MB over
20k calls across 500 rollouts (bench/proxy_overhead.py) before the ledger was made slim.
"""

from __future__ import annotations

import itertools
import struct
import sys
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from harnessrl.store.records import CallRecord, CallStatus

from .protocol import Route, Tokens, reply_message, same_message

AttemptKey = tuple[str, int]  # (rollout_id, attempt)


@dataclass(frozen=True)
class Attribution:
    """Who a call belongs to: from the pod's env (sidecar) or the URL path (gateway)."""

    run: str
    rollout_id: str
    attempt: int

    @property
    def key(self) -> AttemptKey:
        return (self.rollout_id, self.attempt)


_ID_PREFIX = uuid.uuid4().hex[:20]  # 80 random bits per process
_ID_COUNTER = itertools.count()


def new_call_id() -> str:
    """Idempotency key of a call (spool replays and retried writes rely on it): 32 hex digits, a random
    per-process prefix and a counter, so no system call per request."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"


@dataclass(frozen=True)
class ContinuedFrom:
    """The call a continued call was sent on (its parent), kept by that call once it superseded it: the
    parent's tokens are the first ones of the continued call's prompt (its prompt, then its completion) and
    of its rendering (the parent's rendering ``A`` begins ``F``, checked when the call was planned), and its
    messages are the continued call's first ones, so lengths and the parent's reply are all it takes."""

    call_id: str
    seq: int
    route: Route
    messages: int  # how many of the continued call's messages were the parent's
    reply: dict[str, Any]
    prompt: int  # the parent's prompt length
    completion: int  # ... completion length
    rendered: int  # ... rendering's length
    up: ContinuedFrom | None = None  # the call the parent continued, and so on (at most ``ANCESTORS`` in all)

    @classmethod
    def of(cls, parent: LastCall) -> ContinuedFrom | None:
        """``parent``'s lengths, with the calls it continued (``up``, bounded), so that a call re-sent after
        a later turn superseded its answer (call k again after k+1) still finds the call it continued."""
        if parent.messages is None or parent.reply is None:
            return None
        return cls(parent.call_id, parent.seq, parent.route, len(parent.messages), parent.reply,
                   len(parent.prompt_token_ids), len(parent.completion_token_ids), len(parent.rendered_prompt),
                   _trimmed(parent.continued, ANCESTORS - 1))

    def chain(self) -> Iterator[ContinuedFrom]:
        """This parent, then the calls above it, nearest first."""
        up: ContinuedFrom | None = self
        while up is not None:
            yield up
            up = up.up


def _trimmed(continued: ContinuedFrom | None, depth: int) -> ContinuedFrom | None:
    """``continued`` with at most ``depth`` calls in its chain (the farthest dropped)."""
    if continued is None or depth <= 0:
        return None
    up = _trimmed(continued.up, depth - 1)
    return continued if up is continued.up else replace(continued, up=up)


@dataclass(frozen=True)
class LastCall:
    """What a later call needs to know about the attempt's previous one."""

    call_id: str
    seq: int
    route: Route
    status: CallStatus
    prompt_token_ids: array  # int32, what the model saw
    completion_token_ids: array  # int32
    rendered_prompt: array  # int32, the chat template's rendering of ``messages`` (continuity.py's "A")
    messages: list[Any] | None  # the chat request's messages, as the harness sent them
    reply: dict[str, Any] | None  # the assistant message of choice 0
    continued: ContinuedFrom | None = None  # the call it was sent on with token continuity, if any

    @classmethod
    def of(
        cls,
        record: CallRecord,
        rendered_prompt: list[int] | None = None,
        chat: tuple[list[Any], dict[str, Any]] | None = None,
        packed: tuple[bytes, bytes] | None = None,
        continued: ContinuedFrom | None = None,
    ) -> LastCall:
        """``chat``: for a call on another route that was served as a chat completion (Messages, Responses),
        the chat messages and reply it amounts to, so a later call can continue it like a chat call.
        ``packed``: the record's prompt and completion ids as the store packs them (``CallItem.packed``),
        taken as they are instead of packed a second time. ``continued``: the call it was sent on with token
        continuity (kept only where this call's tokens, rendering and messages are long enough to hold it)."""
        if chat is not None:
            messages, reply = chat
        else:
            messages = record.request.get("messages") if record.route == "chat" else None
            reply = reply_message(record.response) if record.route == "chat" else None
        if packed is None:
            prompt, completion = _int32(record.prompt_token_ids), _int32(record.completion_token_ids)
        else:
            prompt, completion = _unpacked(packed[0]), _unpacked(packed[1])
        rendered = prompt if rendered_prompt is None else _int32(rendered_prompt)
        messages = messages if isinstance(messages, list) else None
        if continued is not None and (
            rendered is prompt or messages is None or len(messages) < continued.messages + 2
            or len(prompt) < continued.prompt + continued.completion or len(rendered) < continued.rendered
        ):
            continued = None
        return cls(
            record.call_id,
            record.seq,
            record.route,
            record.status,  # type: ignore[arg-type]
            prompt,
            completion,
            rendered,
            messages,
            reply,
            continued,
        )

    def extended_by(self, messages: list[Any]) -> bool:
        """Whether ``messages`` are this call's messages + its reply + at least one more message."""
        own, reply = self.messages, self.reply
        if own is None or reply is None:
            return False
        return _extends(messages, own, len(own), reply)

    def parent_extended_by(self, messages: list[Any], parent: ContinuedFrom | None = None) -> bool:
        """Whether ``messages`` extend the call this one continued (``continued``, or ``parent``, one of the
        calls above it): this call's own messages again (a retry of it) or another turn from its parent."""
        parent = parent or self.continued
        if parent is None or self.messages is None:
            return False
        return _extends(messages, self.messages, parent.messages, parent.reply)

    def parent(self, parent: ContinuedFrom | None = None) -> LastCall | None:
        """The call this one continued (or ``parent``, one of the calls above it), rebuilt from this call's
        tokens and messages (copies: only done for the call a new one continues)."""
        p = parent or self.continued
        if p is None or self.messages is None:
            return None
        prompt = self.prompt_token_ids
        return LastCall(p.call_id, p.seq, p.route, CallStatus.OK, prompt[: p.prompt],
                        prompt[p.prompt : p.prompt + p.completion], self.rendered_prompt[: p.rendered],
                        self.messages[: p.messages], p.reply)

    def supersedes(self, older: LastCall) -> bool:
        """Whether this call continues ``older``'s conversation, so ``older`` can never be extended again
        by a later call that this one could not serve as well. A chat call that got no answer (errored,
        aborted: it keeps its request's messages, but has no reply to be extended) supersedes nothing: its
        retry, the same messages (the SDK's after a timeout, or the harness's), must still continue the call
        it extended, or the retry's prompt is rendered afresh and its conversation splits into two rows."""
        if self.messages is None or older.messages is None:
            return self.messages is None and older.messages is None
        return self.status is CallStatus.OK and older.extended_by(self.messages)

    @property
    def tokens(self) -> int:
        rendered = len(self.rendered_prompt) if self.rendered_prompt is not self.prompt_token_ids else 0
        return len(self.prompt_token_ids) + len(self.completion_token_ids) + rendered + 1


def _extends(messages: list[Any], own: list[Any], k: int, reply: dict[str, Any]) -> bool:
    """Whether ``messages`` are ``own[:k]`` + ``reply`` + at least one more message."""
    head = own if len(own) == k else own[:k]
    return len(messages) >= k + 2 and messages[:k] == head and same_message(messages[k], reply)


def _int32(ids: list[int]) -> array:
    """``array("i", ids)``, built from ``struct.pack``'s bytes: half the CPU for a 1k-token prompt (measured)."""
    out = array("i")
    try:
        out.frombytes(struct.pack(f"={len(ids)}i", *ids))
    except (struct.error, TypeError):  # not int32 token ids (never from vLLM): keep them out of continuity
        pass
    return out


def _unpacked(packed: bytes) -> array:
    """int32 little-endian bytes (``codec.pack_ids``) as ``array("i")``: a copy, no per-token work."""
    out = array("i")
    out.frombytes(packed)
    if sys.byteorder != "little":
        out.byteswap()
    return out


ANCESTORS = 4  # calls a continued call remembers above it (``ContinuedFrom.up``): a few numbers each
RECENT_PER_ATTEMPT = 8  # conversations continued side by side in one attempt (agent + sub-agents)


class RolloutLedger:
    """Sequence counters and recent calls of live rollout attempts (event-loop thread only; no awaits)."""

    def __init__(self, max_rollouts: int, max_tokens: int, per_attempt: int = RECENT_PER_ATTEMPT) -> None:
        self.max_rollouts = max_rollouts
        self.max_tokens = max_tokens
        self.per_attempt = per_attempt
        self._next_seq: OrderedDict[AttemptKey, int] = OrderedDict()
        self._recent: OrderedDict[AttemptKey, list[LastCall]] = OrderedDict()  # oldest call first
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._next_seq)

    @property
    def held_tokens(self) -> int:
        return self._tokens

    def last_call(self, key: AttemptKey) -> LastCall | None:
        """The attempt's most recent remembered call."""
        recent = self._recent.get(key)
        return recent[-1] if recent else None

    def recent_calls(self, key: AttemptKey) -> list[LastCall]:
        """The attempt's remembered calls, newest first (the candidates a new call may extend)."""
        return list(reversed(self._recent.get(key, ())))

    def next_seq(self, key: AttemptKey) -> int:
        seq = self._next_seq.pop(key, 0)
        self._next_seq[key] = seq + 1
        while len(self._next_seq) > self.max_rollouts:
            self._next_seq.popitem(last=False)
        return seq

    def remember(
        self,
        key: AttemptKey,
        record: CallRecord,
        rendered_prompt: list[int] | None = None,
        chat: tuple[list[Any], dict[str, Any]] | None = None,
        packed: tuple[bytes, bytes] | None = None,
        parent: str = "",
    ) -> None:
        """Add ``record`` to the attempt's recent calls (``rendered_prompt``: when its prompt is not the chat
        template's rendering, i.e. it was sent with token continuity). The calls it extends (their messages
        + reply begin its messages; for calls without messages, any such call) are superseded and dropped. A
        chat call with no reply (no answer) is not added: it could never be extended, and it must neither
        supersede the call its retry continues (``LastCall.supersedes``) nor take a conversation's place.
        ``chat``: the chat messages and reply of a call served as a chat completion on another route;
        ``packed``: as for ``LastCall.of``; ``parent``: the id of the call it was sent on with token continuity
        (a recent call, or the one a recent call continued), which it keeps (``LastCall.continued``) so that
        a retry of it continues that call too."""
        continued = None
        if parent and rendered_prompt is not None:
            for call in self._recent.get(key, ()):
                if call.call_id == parent:
                    continued = ContinuedFrom.of(call)
                elif call.continued is not None:
                    continued = next((up for up in call.continued.chain() if up.call_id == parent), None)
                if continued is not None:
                    break
        last = LastCall.of(record, rendered_prompt, chat, packed, continued)
        if last.messages is not None and last.reply is None:
            return  # a chat call with no answer (errored, aborted) is never extended: nothing to remember
        kept = []
        for call in self._recent.pop(key, ()):
            if last.supersedes(call):
                self._tokens -= call.tokens
            else:
                kept.append(call)
        if last.tokens <= self.max_tokens:
            kept.append(last)
            self._tokens += last.tokens
        while len(kept) > self.per_attempt:
            self._tokens -= kept.pop(0).tokens
        if kept:
            self._recent[key] = kept
        while self._tokens > self.max_tokens and self._recent:
            oldest_key = next(iter(self._recent))
            calls = self._recent[oldest_key]
            self._tokens -= calls.pop(0).tokens
            if not calls:
                del self._recent[oldest_key]

    def forget(self, key: AttemptKey) -> None:
        """Drop the attempt's recent calls (the counter stays, so late calls never reuse a number)."""
        for call in self._recent.pop(key, ()):
            self._tokens -= call.tokens


def build_call_record(
    *,
    who: Attribution,
    seq: int,
    route: Route,
    request: dict[str, Any],
    response: dict[str, Any] | None,
    tokens: Tokens,
    policy_version: int,
    upstream: str,
    latency_s: float,
    status: CallStatus,
    http_status: int,
    call_id: str | None = None,
) -> CallRecord:
    return CallRecord(
        call_id=call_id or new_call_id(),
        run=who.run,
        rollout_id=who.rollout_id,
        attempt=who.attempt,
        seq=seq,
        route=route,
        request=request,
        response=response,
        prompt_token_ids=tokens.prompt_token_ids,
        completion_token_ids=tokens.completion_token_ids,
        logprobs=tokens.logprobs,
        policy_version=policy_version,
        upstream=upstream,
        latency_s=latency_s,
        status=status,
        http_status=http_status,
        finish_reason=tokens.finish_reason,
        allowed_token_ids=tokens.allowed,
    )
