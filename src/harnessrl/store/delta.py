"""Prefix-delta encoding: store a call as "its predecessor's context + what is new".

In an agent loop every call resends the whole history, so storing each prompt in full costs the sum of all
prompts (quadratic in turns). Instead a call that extends its predecessor keeps only a reference plus the new
suffix, and storage grows with the final length. The predecessor is the call just before it in the same rollout
attempt; when that one's tokens do not begin the prompt, it is the one of the attempt's ``PARENT_SEARCH``
calls before it whose prompt + completion is the longest token prefix of the prompt (``call_writer``), so two
conversations interleaved in one attempt (an agent and its sub-agent) are each stored as a chain of deltas.

Invariant (rows): training rows built from the stored deltas (``TraceStore.rollout_calls``) are identical to
rows built from the full records, whichever earlier call the store chose as a base: which calls were stored when
a call arrived (a late call, a batch boundary) changes the base, never the rows. A delta parent only tells the
row builder (``harnessrl.trainer.rows``) the tokens its prompt begins with; the builder picks the row, the split
reason and the duplicates from the prompt's tokens alone. ``tests/test_rows_store.py`` checks this on random
trajectories through the real store.

Two independent parts use the same predecessor:

* tokens: the prompt extends iff it starts with predecessor prompt + completion (then ``prompt_offset`` is
  that length and ``parent_call_id`` in ``StoredCall`` is the predecessor);
* request input (chat ``messages`` or a completions text ``prompt``): the longest of "predecessor input +
  its output" (its request messages + its reply message, or its prompt text + completion text) or
  "predecessor input" alone that the new input starts with, compared as exact JSON text so key order and
  number types survive; the second form covers harnesses that resend the reply rewritten (e.g. without the
  ``reasoning_content: null`` vLLM adds), which would otherwise cost a full copy of the history every turn.

The predecessor is described by an ``Anchor``: lengths and digests of its full values. Anchors come from an
in-memory record or from the predecessor's row (the digests are stored), so deciding "does it extend?" never
needs to rebuild the predecessor's chain; and a delta only ever references a row that is stored.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harnessrl.store.codec import copy_json

DIGEST_SIZE = 16
PARENT_SEARCH = 8  # earlier calls of the attempt a call may extend when the one just before it does not

RequestInput = list[Any] | str


@dataclass(frozen=True)
class Anchor:
    """What a successor needs to know about its predecessor to encode itself against it."""

    call_id: str
    context_len: int  # len(prompt) + len(completion)
    context_digest: bytes
    input_len: int | None  # messages count or prompt characters; None when the request has neither
    input_digest: bytes | None
    io_len: int | None  # input + output (reply message / completion text); None without an output
    io_digest: bytes | None


@dataclass(frozen=True)
class Encoded:
    """How one call is stored relative to its anchor (``base_call_id`` None = stored in full)."""

    base_call_id: str | None
    prompt_offset: int
    prompt_suffix_bytes: bytes
    request: dict[str, Any]
    request_reused: int


def tokens_digest(token_bytes: bytes) -> bytes:
    return hashlib.blake2b(b"T" + token_bytes, digest_size=DIGEST_SIZE).digest()


try:  # the proxy's extra; without it the JSON text comes from json alone (the same bytes)
    from msgspec.json import Encoder as _Encoder
except ImportError:  # pragma: no cover - the proxy and the operator install msgspec
    _fast_text = None
else:
    _fast_text = _Encoder().encode


def _plain(value: Any) -> bool:
    """Whether ``value`` is made only of exact str, int, bool, None, lists and str-keyed dicts: for those
    msgspec writes the very bytes ``json.dumps`` does (compact, ensure_ascii off; tests/test_store_delta.py
    holds it to that). Floats are left to json: msgspec spells some differently (``1e16``, json ``1e+16``)."""
    t = type(value)
    if t is str or t is int or t is bool or value is None:
        return True
    if t is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if t is list:
        return all(_plain(v) for v in value)
    return False


def _item_text(item: Any) -> bytes:
    """An item's JSON text, what its prefix digest hashes (stored digests depend on these exact bytes).
    A plain message goes through msgspec: json.dumps cost 3-25 us a message, msgspec and the check under 4."""
    if _fast_text is not None:
        try:
            if _plain(item):
                return _fast_text(item)
        except (UnicodeEncodeError, RecursionError):  # a lone surrogate (json writes it), deep nesting
            pass
    return json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def prefix_digests(items: list[Any]) -> list[bytes]:
    """Digests of ``items[:n]`` for every n (index n), in one pass (items are separated by a byte JSON never
    contains unescaped, so different splits cannot collide). Computed once per call and kept, because the
    JSON text of each message is what costs; ``digest_cache.PrefixDigestCache`` gives the same digests
    hashing only what a conversation's previous call did not have."""
    h = hashlib.blake2b(b"L", digest_size=DIGEST_SIZE)
    found = [h.copy().digest()]
    for item in items:
        h.update(_item_text(item))
        h.update(b"\x1e")
        found.append(h.copy().digest())
    return found


def _text_digest(text: str) -> bytes:
    return hashlib.blake2b(b"S" + text.encode("utf-8", "surrogatepass"), digest_size=DIGEST_SIZE).digest()


def request_input(request: dict[str, Any]) -> RequestInput | None:
    """The part of a request that grows turn by turn: chat messages or a completions text prompt."""
    messages = request.get("messages")
    if isinstance(messages, list):
        return messages
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return prompt
    return None


def request_output(request_in: RequestInput, response: dict[str, Any] | None) -> Any:
    """What the model added to the input: the reply message (chat) or the completion text; None if absent."""
    if not isinstance(response, dict):
        return None
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    if isinstance(request_in, list):
        message = choices[0].get("message")
        return message if isinstance(message, dict) else None
    text = choices[0].get("text")
    return text if isinstance(text, str) else None


def join_io(request_in: RequestInput, output: Any) -> RequestInput:
    return request_in + [output] if isinstance(request_in, list) else request_in + output


def _input_key(request: dict[str, Any]) -> str:
    return "messages" if isinstance(request.get("messages"), list) else "prompt"


def make_anchor(
    call_id: str,
    prompt_bytes: bytes,
    completion_bytes: bytes,
    request: dict[str, Any],
    response: dict[str, Any] | None,
) -> Anchor:
    """The anchor of a full call (its stored digest columns are exactly these values)."""
    return describe(call_id, prompt_bytes, completion_bytes, request, response)[0]


def describe(
    call_id: str,
    prompt_bytes: bytes,
    completion_bytes: bytes,
    request: dict[str, Any],
    response: dict[str, Any] | None,
    digests_of: Callable[[list[Any]], list[bytes]] = prefix_digests,
) -> tuple[Anchor, list[bytes] | None]:
    """The call's anchor, and the prefix digests of its chat messages (None for a text prompt or neither):
    ``encode`` takes them back so the messages are serialised and hashed once per call, not twice.
    ``digests_of``: ``prefix_digests`` or what returns the same (a ``PrefixDigestCache`` for the call's
    conversation)."""
    context_len = (len(prompt_bytes) + len(completion_bytes)) // 4
    context_digest = tokens_digest(prompt_bytes + completion_bytes)
    request_in = request_input(request)
    if request_in is None:
        return Anchor(call_id, context_len, context_digest, None, None, None, None), None
    output = request_output(request_in, response)
    if isinstance(request_in, str):
        io = None if output is None else join_io(request_in, output)
        anchor = Anchor(
            call_id, context_len, context_digest,
            len(request_in), _text_digest(request_in),
            None if io is None else len(io), None if io is None else _text_digest(io),
        )  # fmt: skip
        return anchor, None
    io_list = request_in if output is None else join_io(request_in, output)
    digests = digests_of(io_list)
    has_io = output is not None
    anchor = Anchor(
        call_id, context_len, context_digest,
        len(request_in), digests[len(request_in)],
        len(io_list) if has_io else None, digests[len(io_list)] if has_io else None,
    )  # fmt: skip
    return anchor, digests[: len(request_in) + 1]


def _reused_input(request_in: RequestInput, anchor: Anchor, input_digests: list[bytes] | None) -> int:
    """How many leading items/characters of ``request_in`` equal the anchor's io or input (longest wins)."""
    candidates = [
        (length, digest)
        for length, digest in ((anchor.io_len, anchor.io_digest), (anchor.input_len, anchor.input_digest))
        if length and digest is not None and length <= len(request_in)
    ]
    if not candidates:
        return 0
    if isinstance(request_in, str):
        for length, digest in candidates:
            if _text_digest(request_in[:length]) == digest:
                return length
        return 0
    digests = input_digests if input_digests is not None else prefix_digests(request_in)
    for length, digest in candidates:
        if digests[length] == digest:
            return length
    return 0


def extends(prompt_bytes: bytes, anchor: Anchor) -> int:
    """How many tokens of the prompt are the anchor's prompt + completion (0: it does not start with them)."""
    n = anchor.context_len
    if 0 < n and 4 * n <= len(prompt_bytes) and tokens_digest(prompt_bytes[: 4 * n]) == anchor.context_digest:
        return n
    return 0


def encode(
    prompt_bytes: bytes,
    request: dict[str, Any],
    anchor: Anchor | None,
    input_digests: list[bytes] | None = None,
    extended: int | None = None,
) -> Encoded:
    """Encode one call against its predecessor's anchor (or in full when there is none or nothing matches).

    ``input_digests``: this call's message prefix digests from ``describe``, if already computed.
    ``extended``: ``extends(prompt_bytes, anchor)``, if already computed."""
    offset = 0
    reused = 0
    stored_request = request
    if anchor is not None:
        offset = extends(prompt_bytes, anchor) if extended is None else extended
        request_in = request_input(request)
        if request_in is not None:
            reused = _reused_input(request_in, anchor, input_digests)
            if reused:
                stored_request = dict(request)
                stored_request[_input_key(request)] = request_in[reused:]
    base = anchor.call_id if anchor is not None and (offset or reused) else None
    return Encoded(base, offset, prompt_bytes[4 * offset :], stored_request, reused)


def decode_request(
    stored_request: dict[str, Any], reused: int, base_io: RequestInput | None, call_id: str
) -> dict[str, Any]:
    """Rebuild the full request from its stored tail and the base call's full input + output."""
    if not reused:
        return stored_request
    if base_io is None or len(base_io) < reused:
        raise StoreCorruption(
            f"call {call_id}: its request references {reused} items of a base that has fewer"
        )
    key = _input_key(stored_request)
    request = dict(stored_request)
    prefix = base_io[:reused]
    if isinstance(prefix, list):  # fresh objects: records handed out must not share messages with each other
        prefix = [copy_json(item) for item in prefix]
    request[key] = prefix + stored_request[key]
    return request


class StoreCorruption(RuntimeError):
    """A stored delta whose base is missing or too short; never expected, reported instead of guessed."""
