"""Byte-level encodings of a call: compact token arrays, JSON text, the response without duplicate arrays.

Token ids are little-endian int32 (4 bytes per token) and log-probs little-endian float32 (4 bytes per
token). vLLM computes log-probs in float32 and hands them out as Python floats converted from float32, so
float32 storage is lossless for them; a list holding any value that is not float32-representable is stored
as float64 instead (flagged per call), so a read is bit-exact whatever the caller passed.

The response JSON from vLLM repeats the token arrays (``prompt_token_ids``, ``choices[0].token_ids``) and the
log-probs (``choices[0].logprobs.content[i].logprob`` for chat, ``.token_logprobs`` for completions). Those
are cut out before storage when they are exactly equal to the arrays, and put back on read at the same key
position; anything that differs in the slightest stays in the JSON, so the round trip is always exact.
"""

from __future__ import annotations

import json
import struct
from array import array
from typing import Any

import numpy as np

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def dumps(value: Any) -> str:
    """JSON text as stored: compact, UTF-8 rather than \\u escapes, and no NaN/Infinity (PostgreSQL refuses
    them in ``json``). Falls back to ASCII escapes when a string holds a lone surrogate UTF-8 cannot carry."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text


def loads(text: str | bytes) -> Any:
    return json.loads(text)


def copy_json(value: Any) -> Any:
    """A deep copy of a JSON value (dicts, lists, immutable scalars); much cheaper than ``copy.deepcopy``."""
    if isinstance(value, dict):
        return {k: copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_json(v) for v in value]
    return value


def pack_ids(ids: list[int], what: str = "token ids") -> bytes:
    """int32 little-endian bytes; ValueError naming ``what`` for non-integers or values out of range."""
    if len(ids) == 0:
        return b""
    try:  # the common case at C speed (~3x ``array``): refuses floats, strings and nesting, checks the range
        packed = struct.pack(f"<{len(ids)}i", *ids)
    except (struct.error, TypeError):
        pass  # numpy below finds what is wrong and names it
    else:
        if type(ids[0]) is not bool or not _only(ids, bool):  # numpy refuses an all-bool list: so do we
            return packed
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise ValueError(f"{what} must be a flat list of integers")
    low, high = int(arr.min()), int(arr.max())
    if low < INT32_MIN or high > INT32_MAX:
        bad = low if low < INT32_MIN else high
        raise ValueError(f"{what} hold {bad}, which does not fit a 32-bit token id")
    return arr.astype("<i4").tobytes()


def unpack_ids(blob: bytes) -> list[int]:
    return np.frombuffer(blob, dtype="<i4").tolist()


def pack_logprobs(values: list[float], what: str = "logprobs") -> tuple[bytes, bool]:
    """float32 bytes when lossless, else float64; returns (bytes, is_float64)."""
    if len(values) == 0:
        return b"", False
    try:
        f64 = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be a flat list of numbers ({exc})") from None
    if f64.ndim != 1:
        raise ValueError(f"{what} must be a flat list of numbers")
    f32 = f64.astype("<f4")
    if f32.astype(np.float64).tobytes() == f64.tobytes():
        return f32.tobytes(), False
    return f64.astype("<f8").tobytes(), True


def unpack_logprobs(blob: bytes, is_float64: bool) -> list[float]:
    return np.frombuffer(blob, dtype="<f8" if is_float64 else "<f4").tolist()


# --- response stripping ------------------------------------------------------------------------------------

CHAT_LOGPROB_KEYS = ["token", "logprob", "bytes", "top_logprobs"]  # vLLM / OpenAI field order


def _only(values: list[Any], kind: type) -> bool:
    """Every element is exactly of type ``kind`` (not a subclass: ``True`` is no token id); C-speed loop."""
    return set(map(type, values)) <= {kind}


def _same_ints(value: Any, expected: list[int]) -> bool:
    return isinstance(value, list) and len(value) == len(expected) and value == expected and _only(value, int)


def _same_floats(value: Any, expected: list[float]) -> bool:
    """Equal down to the bit pattern (so -0.0 never stands in for 0.0)."""
    if not isinstance(value, list) or len(value) != len(expected) or not _only(value, float):
        return False
    try:
        return array("d", value).tobytes() == array("d", expected).tobytes()
    except TypeError:  # ``expected`` holds something numpy converts and array does not (e.g. numeric text)
        return np.asarray(value, np.float64).tobytes() == np.asarray(expected, np.float64).tobytes()


def token_bytes(token: str) -> list[int]:
    """The ``bytes`` field vLLM puts beside each chat log-prob token."""
    return list(token.encode("utf-8", errors="replace"))


def _chat_logprob_tokens(content: Any, logprobs: list[float]) -> list[str] | None:
    """Token strings, if every entry is exactly {token, logprob (ours), bytes (utf-8), top_logprobs: []}.

    ``bytes`` is compared as ``bytes(...)`` (C speed, no list built per token), which also refuses a float
    such as ``104.0`` that equals the byte but would come back as an int.
    """
    if not isinstance(content, list) or len(content) != len(logprobs) or not content:
        return None
    tokens: list[str] = []
    append = tokens.append
    try:
        for entry in content:
            if not isinstance(entry, dict) or list(entry) != CHAT_LOGPROB_KEYS:
                return None
            token, byte_list = entry["token"], entry["bytes"]
            if (
                type(token) is not str
                or entry["top_logprobs"] != []
                or type(byte_list) is not list
                or bytes(byte_list) != token.encode("utf-8", errors="replace")
            ):
                return None
            append(token)
    except (TypeError, ValueError):  # a byte that is no int in 0..255: not what the token encodes
        return None
    if not _same_floats([entry["logprob"] for entry in content], logprobs):
        return None
    return tokens


# Fields vLLM's chat answers carry with the same value in every call; stripped only when all of a level's are
# there with exactly these values (their positions are kept), so any other answer is stored as it came.
DEFAULTS: dict[str, dict[str, Any]] = {
    "defaults": {"service_tier": None, "system_fingerprint": None, "prompt_logprobs": None,
                 "kv_transfer_params": None},
    "choice.message.defaults": {"refusal": None, "annotations": None, "audio": None, "function_call": None,
                                "tool_calls": [], "reasoning_content": None},
}
USAGE_KEYS = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"]


def _usage(prompt_ids: list[int], completion_ids: list[int]) -> dict[str, Any]:
    """vLLM's ``usage`` of a call whose token arrays are these (the counts are the arrays' lengths)."""
    p, c = len(prompt_ids), len(completion_ids)
    return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c, "prompt_tokens_details": None}


def _strip_defaults(container: dict[str, Any], name: str, stripped: list[list[Any]]) -> None:
    """Cut ``DEFAULTS[name]`` out of ``container`` (a copy the caller owns) when all are there, in order, with
    exactly those values; the marker keeps their positions. Type-exact: ``0`` or ``False`` is no ``None``."""
    defaults = DEFAULTS[name]
    keys = list(container)
    positions = [keys.index(k) if k in container else -1 for k in defaults]
    if -1 in positions or positions != sorted(positions):
        return
    for key, value in defaults.items():
        if type(container[key]) is not type(value) or container[key] != value:
            return
    for key in defaults:
        del container[key]
    stripped.append([name, positions])


# A token's length in characters as one character of this alphabet (lengths 0-61).
_LENGTHS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_LENGTH_OF = {c: i for i, c in enumerate(_LENGTHS)}
_LENGTH_BYTES = _LENGTHS.encode("ascii").ljust(256, b"?")  # bytes.translate table: length -> its character


def _split_lengths(tokens: list[str], message: Any) -> str | None:
    """The tokens' lengths, one character each, when the tokens spell the message's content exactly: the
    tokens are then the content cut at those lengths. A plain chat reply's log-prob tokens are its text again,
    as long as the text (a quarter of a 50-turn trajectory's stored bytes); one character per token instead.
    None where they do not (tool calls, reasoning, a token longer than 61 characters): tokens stay as strings."""
    if not isinstance(message, dict) or type(message.get("content")) is not str:
        return None
    lengths = list(map(len, tokens))
    if max(lengths) >= len(_LENGTHS) or "".join(tokens) != message["content"]:
        return None
    return bytes(lengths).translate(_LENGTH_BYTES).decode("ascii")  # C speed: 200 tokens a call


def _split(content: str, lengths: str) -> list[str]:
    tokens, at = [], 0
    for c in lengths:
        n = _LENGTH_OF[c]
        tokens.append(content[at:at + n])
        at += n
    if at != len(content):
        raise ValueError("stored log-prob token lengths do not add up to the message content")
    return tokens


def _pop_at(container: dict[str, Any], key: str) -> int:
    index = list(container).index(key)
    del container[key]
    return index


def _insert_at(container: dict[str, Any], key: str, value: Any, index: int) -> None:
    items = list(container.items())
    items.insert(index, (key, value))
    container.clear()
    container.update(items)


def strip_response(
    response: dict[str, Any] | None,
    prompt_ids: list[int],
    completion_ids: list[int],
    logprobs: list[float],
) -> tuple[dict[str, Any] | None, list[list[Any]] | None]:
    """Return (response without the duplicated arrays, what was stripped). Never mutates ``response``."""
    if not isinstance(response, dict):
        return response, None
    out = dict(response)
    stripped: list[list[Any]] = []
    if _same_ints(out.get("prompt_token_ids"), prompt_ids):
        stripped.append(["prompt_token_ids", _pop_at(out, "prompt_token_ids")])
    if out.get("usage") == _usage(prompt_ids, completion_ids) and list(out["usage"]) == USAGE_KEYS:
        stripped.append(["usage", _pop_at(out, "usage")])
    _strip_defaults(out, "defaults", stripped)
    choices = out.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = dict(choices[0])
        if isinstance(choice.get("message"), dict):
            message = choice["message"] = dict(choice["message"])
            _strip_defaults(message, "choice.message.defaults", stripped)
        if _same_ints(choice.get("prompt_token_ids"), prompt_ids):
            stripped.append(["choice.prompt_token_ids", _pop_at(choice, "prompt_token_ids")])
        if _same_ints(choice.get("token_ids"), completion_ids):
            stripped.append(["choice.token_ids", _pop_at(choice, "token_ids")])
        if isinstance(choice.get("logprobs"), dict):
            lp = dict(choice["logprobs"])
            tokens = _chat_logprob_tokens(lp.get("content"), logprobs)
            lengths = None if tokens is None else _split_lengths(tokens, choice.get("message"))
            if lengths is not None:
                lp["content"] = lengths
                stripped.append(["choice.logprobs.content_split", 0])
            elif tokens is not None:
                lp["content"] = tokens
                stripped.append(["choice.logprobs.content", 0])
            if _same_floats(lp.get("token_logprobs"), logprobs):
                stripped.append(["choice.logprobs.token_logprobs", _pop_at(lp, "token_logprobs")])
            choice["logprobs"] = lp
        out["choices"] = [choice, *choices[1:]]
    if not stripped:
        return response, None
    return out, stripped


def restore_response(
    stored: dict[str, Any] | None,
    stripped: list[list[Any]] | None,
    prompt_ids: list[int],
    completion_ids: list[int],
    logprobs: list[float],
) -> dict[str, Any] | None:
    """Inverse of ``strip_response``; mutates ``stored`` (a freshly decoded value) and returns it."""
    if stored is None or not stripped:
        return stored
    for name, index in reversed(stripped):  # undo pops last-first so every index is valid again
        if name == "prompt_token_ids":
            _insert_at(stored, name, list(prompt_ids), index)
            continue
        if name == "usage":
            _insert_at(stored, name, _usage(prompt_ids, completion_ids), index)
            continue
        if name in DEFAULTS:
            container = stored if name == "defaults" else stored["choices"][0]["message"]
            for (key, value), at in zip(DEFAULTS[name].items(), index, strict=True):
                _insert_at(container, key, copy_json(value), at)
            continue
        choice = stored["choices"][0]
        if name == "choice.prompt_token_ids":
            _insert_at(choice, "prompt_token_ids", list(prompt_ids), index)
        elif name == "choice.token_ids":
            _insert_at(choice, "token_ids", list(completion_ids), index)
        elif name == "choice.logprobs.content":
            choice["logprobs"]["content"] = [
                {"token": token, "logprob": lp, "bytes": token_bytes(token), "top_logprobs": []}
                for token, lp in zip(choice["logprobs"]["content"], logprobs, strict=True)
            ]
        elif name == "choice.logprobs.content_split":
            tokens = _split(choice["message"]["content"], choice["logprobs"]["content"])
            choice["logprobs"]["content"] = [
                {"token": token, "logprob": lp, "bytes": token_bytes(token), "top_logprobs": []}
                for token, lp in zip(tokens, logprobs, strict=True)
            ]
        elif name == "choice.logprobs.token_logprobs":
            _insert_at(choice["logprobs"], "token_logprobs", list(logprobs), index)
        else:
            raise ValueError(f"unknown stripped response field {name!r} (written by a newer harnessrl?)")
    return stored
