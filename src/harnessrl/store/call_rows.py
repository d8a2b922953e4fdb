"""Turning ``CallRecord``s into ``llm_calls`` rows and back.

Writing: ``prepare_call`` validates a record and packs what does not depend on its predecessor (arrays,
digests, stripped response); ``PreparedCall.row`` finishes the row once the predecessor's anchor is known.
Reading: ``CallRebuilder`` rebuilds full records from rows given in chain order, keeping each call's full
context only as long as a successor may reference it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Protocol

from harnessrl.store import codec, delta
from harnessrl.store.digest_cache import PrefixDigestCache
from harnessrl.store.records import CallRecord, CallStatus, StoredCall

ID_MAX = 128
# Most token ids kept for one position of a constrained call: a larger set is no mask worth keeping (the
# whole vocabulary is then as good a guess, and storage stays bounded), and the proxy never sees one anyway.
ALLOWED_MAX = 256


class InvalidCall(ValueError):
    """Calls the store refuses; nothing of the batch was written. ``call_ids`` names every refused call."""

    def __init__(self, problems: dict[str, str]) -> None:
        self.call_ids = list(problems)
        self.problems = problems
        first, reason = next(iter(problems.items()))
        more = f" (and {len(problems) - 1} more calls)" if len(problems) > 1 else ""
        super().__init__(f"call {first!r}: {reason}{more}; fix or drop these calls and write the batch again")


def check_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > ID_MAX:
        raise ValueError(f"{what} must be a non-empty string of at most {ID_MAX} characters, got {value!r}")
    return value


def _check_int(value: Any, what: str, minimum: int | None = None) -> int:
    if type(value) is not int or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{what} must be an integer{bound}, got {value!r}")
    return value


def _json_text(value: Any, what: str) -> str:
    """The stored JSON text (checked once here, then written as is where the driver allows)."""
    try:
        return codec.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not storable JSON ({exc})") from None


@dataclass
class PreparedCall:
    """A validated record with everything computed that does not depend on its predecessor.

    ``record.response`` is None here: the response lives on as ``response`` (without the arrays it repeats)
    and ``full_record()`` puts it back together. A call waiting in a writer's queue then holds packed arrays
    and a few small objects, not the ~600 decoded containers of a chat response's log-probs that Python's
    cyclic collector would scan again at every collection while it waits.
    """

    record: CallRecord
    prompt_bytes: bytes
    completion_bytes: bytes
    logprob_bytes: bytes
    logprobs_f64: bool
    allowed_bytes: bytes | None
    response: dict[str, Any] | None
    response_stripped: list[list[Any]] | None
    anchor: delta.Anchor
    input_digests: list[bytes] | None  # message prefix digests, reused by every encode
    encoded: delta.Encoded | None = field(default=None)
    request_text: str | None = field(default=None)  # JSON of encoded.request
    response_text: str | None = field(default=None)  # JSON of response ("null" when None: stored as NULL)
    _extended: tuple[delta.Anchor, int] | None = field(default=None, repr=False, compare=False)

    def full_record(self) -> CallRecord:
        """The record as it was given to ``prepare_call`` (its response restored, bit-exact)."""
        r = self.record
        response = codec.restore_response(
            codec.copy_json(self.response),
            self.response_stripped,
            r.prompt_token_ids,
            r.completion_token_ids,
            r.logprobs,
        )
        return replace(r, response=response)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.record.rollout_id, self.record.attempt, self.record.seq)

    @property
    def predecessor_key(self) -> tuple[str, int, int] | None:
        r = self.record
        return (r.rollout_id, r.attempt, r.seq - 1) if r.seq > 0 else None

    def extends(self, anchor: delta.Anchor) -> int:
        """``delta.extends`` of this call's prompt, remembered for the last anchor asked: the writer asks it
        when it chooses the anchor, and ``encode`` again (a blake2b of the whole shared prefix, ~10 us for a
        2k-token prompt, was computed twice per call)."""
        known = self._extended
        if known is not None and known[0] is anchor:
            return known[1]
        n = delta.extends(self.prompt_bytes, anchor)
        self._extended = (anchor, n)
        return n

    def encode(self, anchor: delta.Anchor | None) -> dict[str, Any]:
        """Encode against ``anchor`` (None: in full), check the stored JSON, and return the row."""
        extended = None if anchor is None else self.extends(anchor)
        self.encoded = delta.encode(
            self.prompt_bytes, self.record.request, anchor, self.input_digests, extended
        )
        self.request_text = _json_text(self.encoded.request, "request")
        if self.response_text is None:
            self.response_text = _json_text(self.response, "response")
        return self.row()

    def json_texts(self) -> dict[str, str | None]:
        """The JSON columns as the text ``encode`` already produced (None = SQL NULL), to write as is."""
        assert self.request_text is not None, "encode() first"
        return {
            "request": self.request_text,
            "response": None if self.response is None else self.response_text,
            "response_stripped": None
            if self.response_stripped is None
            else codec.dumps(self.response_stripped),
            "sampling": None if self.record.sampling is None else _json_text(self.record.sampling, "sampling"),
        }

    def row(self) -> dict[str, Any]:
        r, e, a = self.record, self.encoded, self.anchor
        assert e is not None, "encode() first"
        return {
            "call_id": r.call_id,
            "run": r.run,
            "rollout_id": r.rollout_id,
            "attempt": r.attempt,
            "seq": r.seq,
            "route": r.route,
            "base_call_id": e.base_call_id,
            "prompt_offset": e.prompt_offset,
            "prompt_suffix": e.prompt_suffix_bytes,
            "completion_ids": self.completion_bytes,
            "logprobs": self.logprob_bytes,
            "logprobs_f64": self.logprobs_f64,
            "request": e.request,
            "request_reused": e.request_reused,
            "response": self.response,
            "response_stripped": self.response_stripped,
            "sampling": r.sampling,
            "allowed_ids": self.allowed_bytes,
            "context_len": a.context_len,
            "context_digest": a.context_digest,
            "input_len": a.input_len,
            "input_digest": a.input_digest,
            "io_len": a.io_len,
            "io_digest": a.io_digest,
            "policy_version": r.policy_version,
            "upstream": r.upstream,
            "latency_s": r.latency_s,
            "status": CallStatus(r.status).value,
            "http_status": r.http_status,
            "finish_reason": r.finish_reason,
            "prompt_tokens": len(r.prompt_token_ids),
            "completion_tokens": len(r.completion_token_ids),
            "created_at": r.created_at,
        }


def prepare_call(
    record: CallRecord,
    packed: tuple[bytes, bytes] | None = None,
    digests: PrefixDigestCache | None = None,
) -> PreparedCall:
    """Validate one record (ValueError naming the field) and pack its predecessor-independent parts.

    ``packed``: the record's prompt and completion ids as ``codec.pack_ids`` packs them, when the caller has
    them already (the proxy packs them once for its own ledger too). ``digests``: where the message prefix
    digests of the attempt's earlier calls are kept, so only this call's new messages are hashed (the
    proxy's; keyed by ``attempt_key``)."""
    check_id(record.call_id, "call_id")
    check_id(record.run, "run")
    check_id(record.rollout_id, "rollout_id")
    _check_int(record.attempt, "attempt", 0)
    _check_int(record.seq, "seq", 0)
    _check_int(record.policy_version, "policy_version")
    _check_int(record.http_status, "http_status")
    if not isinstance(record.route, str) or not 0 < len(record.route) <= 32:
        raise ValueError(f"route must be a short string such as 'chat', got {record.route!r}")
    try:
        CallStatus(record.status)
    except ValueError:
        raise ValueError(
            f"status must be one of {[s.value for s in CallStatus]}, got {record.status!r}"
        ) from None
    if not isinstance(record.request, dict):
        raise ValueError("request must be a JSON object")
    if record.sampling is not None and not isinstance(record.sampling, dict):
        raise ValueError(f"sampling must be a JSON object or None, got {record.sampling!r}")
    if record.response is not None and not isinstance(record.response, dict):
        raise ValueError("response must be a JSON object or None")
    if not isinstance(record.latency_s, int | float) or not math.isfinite(record.latency_s):
        raise ValueError(f"latency_s must be a finite number, got {record.latency_s!r}")
    if record.finish_reason is not None and (
        not isinstance(record.finish_reason, str) or len(record.finish_reason) > 64
    ):
        raise ValueError(
            f"finish_reason must be None or a string of at most 64 characters, got {record.finish_reason!r}"
        )
    if not isinstance(record.upstream, str):
        raise ValueError(f"upstream must be a string, got {record.upstream!r}")
    if not isinstance(record.created_at, datetime):
        raise ValueError(f"created_at must be a datetime, got {record.created_at!r}")
    if packed is None:
        prompt_bytes = codec.pack_ids(record.prompt_token_ids, "prompt_token_ids")
        completion_bytes = codec.pack_ids(record.completion_token_ids, "completion_token_ids")
    else:
        prompt_bytes, completion_bytes = packed
    logprob_bytes, f64 = codec.pack_logprobs(record.logprobs)
    allowed_bytes = pack_allowed(record.allowed_token_ids, len(record.completion_token_ids))
    response, stripped = codec.strip_response(
        record.response, record.prompt_token_ids, record.completion_token_ids, record.logprobs
    )
    digests_of = delta.prefix_digests
    if digests is not None:
        key = attempt_key(record)
        digests_of = lambda items: digests.digests(key, items)  # noqa: E731
    anchor, input_digests = delta.describe(
        record.call_id, prompt_bytes, completion_bytes, record.request, record.response, digests_of
    )
    kept = copy.copy(record)  # the caller's record is left as it was (cheaper than dataclasses.replace)
    kept.response = None
    return PreparedCall(
        kept,
        prompt_bytes,
        completion_bytes,
        logprob_bytes,
        f64,
        allowed_bytes,
        response,
        stripped,
        anchor,
        input_digests,
    )


class _OfAttempt(Protocol):
    @property
    def run(self) -> str: ...
    @property
    def rollout_id(self) -> str: ...
    @property
    def attempt(self) -> int: ...


def attempt_key(of: _OfAttempt) -> tuple[str, str, int]:
    """What ``prepare_call``'s digest cache keys a call's conversation by (of a record or an attribution)."""
    return (of.run, of.rollout_id, of.attempt)


def pack_allowed(allowed: list[list[int]] | None, completion_tokens: int) -> bytes | None:
    """``CallRecord.allowed_token_ids`` as stored: int32 little-endian ``[n_0, ids_0..., n_1, ids_1..., ...]``,
    one ``n_i`` (0: not known) per completion token; None for None or a call with no known set (stored NULL).
    ValueError naming the field for a list that does not line up with the completion or holds no token ids."""
    if allowed is None:
        return None
    if not isinstance(allowed, list) or len(allowed) != completion_tokens:
        raise ValueError(
            f"allowed_token_ids must be None or one list per completion token ({completion_tokens}), got "
            f"{len(allowed) if isinstance(allowed, list) else type(allowed).__name__}"
        )
    flat: list[int] = []
    for i, ids in enumerate(allowed):
        if not isinstance(ids, list) or len(ids) > ALLOWED_MAX:
            raise ValueError(f"allowed_token_ids[{i}] must be a list of at most {ALLOWED_MAX} token ids")
        flat.append(len(ids))
        flat.extend(ids)
    if len(flat) == completion_tokens:  # every set unknown: nothing worth a row
        return None
    return codec.pack_ids(flat, "allowed_token_ids")


def unpack_allowed(blob: bytes | None) -> list[list[int]] | None:
    """The inverse of :func:`pack_allowed`."""
    if blob is None:
        return None
    flat = codec.unpack_ids(blob)
    out: list[list[int]] = []
    i = 0
    while i < len(flat):
        n = flat[i]
        out.append(flat[i + 1 : i + 1 + n])
        i += 1 + n
    return out


def stored_call_from_row(row: Any) -> StoredCall:
    """The delta form, straight from the row: no predecessor is touched."""
    return StoredCall(
        call_id=row.call_id,
        rollout_id=row.rollout_id,
        attempt=row.attempt,
        seq=row.seq,
        parent_call_id=row.base_call_id if row.prompt_offset else None,
        prompt_suffix=codec.unpack_ids(row.prompt_suffix),
        completion_token_ids=codec.unpack_ids(row.completion_ids),
        logprobs=codec.unpack_logprobs(row.logprobs, row.logprobs_f64),
        policy_version=row.policy_version,
        status=CallStatus(row.status),
        finish_reason=row.finish_reason,
    )


class CallRebuilder:
    """Rebuilds full records from rows fed in chain order (every base before the calls that reference it)."""

    def __init__(self) -> None:
        # call_id -> (full prompt + completion token ids, full request input + output); what successors need
        self._context: dict[str, tuple[list[int], delta.RequestInput | None]] = {}

    def rebuild(self, row: Any) -> CallRecord:
        suffix = codec.unpack_ids(row.prompt_suffix)
        completion = codec.unpack_ids(row.completion_ids)
        logprobs = codec.unpack_logprobs(row.logprobs, row.logprobs_f64)
        base_tokens: list[int] = []
        base_io: delta.RequestInput | None = None
        if row.base_call_id is not None:
            if row.base_call_id not in self._context:
                raise delta.StoreCorruption(
                    f"call {row.call_id}: its base call {row.base_call_id} is not stored"
                )
            base_tokens, base_io = self._context[row.base_call_id]
            if len(base_tokens) < row.prompt_offset:
                raise delta.StoreCorruption(
                    f"call {row.call_id}: base {row.base_call_id} is shorter than its offset"
                )
        prompt = base_tokens[: row.prompt_offset] + suffix
        request = delta.decode_request(row.request, row.request_reused, base_io, row.call_id)
        response = codec.restore_response(row.response, row.response_stripped, prompt, completion, logprobs)
        request_in = delta.request_input(request)
        io = None
        if request_in is not None:
            output = delta.request_output(request_in, response)
            io = request_in if output is None else delta.join_io(request_in, output)
        self._context[row.call_id] = (prompt + completion, io)
        return CallRecord(
            call_id=row.call_id,
            run=row.run,
            rollout_id=row.rollout_id,
            attempt=row.attempt,
            seq=row.seq,
            route=row.route,
            request=request,
            response=response,
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            logprobs=logprobs,
            policy_version=row.policy_version,
            upstream=row.upstream,
            latency_s=row.latency_s,
            status=CallStatus(row.status),
            http_status=row.http_status,
            finish_reason=row.finish_reason,
            created_at=row.created_at,
            sampling=row._mapping.get("sampling"),  # absent in tables before revision 0003 (migration 0002)
            allowed_token_ids=unpack_allowed(row._mapping.get("allowed_ids")),  # absent before revision 0005
        )
