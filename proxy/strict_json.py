"""What the store keeps of an answer that is no strict JSON: every value kept, as text where JSON cannot say it.

The store takes strict JSON only (PostgreSQL's ``json`` refuses NaN and Infinity), but a harness can get a 200
for an answer holding a number no float holds: an Anthropic ``tool_use`` input keeps the literal the model
wrote (``anthropic_api.tool_input``: ``1e999``, or vLLM's tool parser's ``Infinity``). Refusing the record
would lose a call the harness went on from, its tokens included (issue 26 saw such calls in ``.rejected``).
So such a value is stored as a string holding its JSON literal (``"1e999"``, ``"NaN"``), and the object gains
``_harnessrl_nonstrict``: the JSON pointers (RFC 6901) of the values so written, which a lenient JSON reader
turns back into the numbers (``restore``). Only a record the store refused is copied this way.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

NONSTRICT_KEY = "_harnessrl_nonstrict"


def _literal(value: Any) -> str | None:
    """The JSON literal of a value strict JSON cannot hold, or None for any other value."""
    if isinstance(value, msgspec.Raw):
        return bytes(value).decode()
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    return None


def _pointer_part(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def strict_copy(value: Any) -> tuple[Any, list[str]]:
    """``value`` with every non-strict value replaced by its literal as a string, and their pointers."""
    pointers: list[str] = []

    def walk(v: Any, at: str) -> Any:
        literal = _literal(v)
        if literal is not None:
            pointers.append(at)
            return literal
        if isinstance(v, dict):
            return {k: walk(x, f"{at}/{_pointer_part(k)}") for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{at}/{i}") for i, x in enumerate(v)]
        return v

    return walk(value, ""), pointers


def storable(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    """A JSON object as the store can keep it: unchanged when strict, else its strict copy naming what it
    wrote as text under ``_harnessrl_nonstrict``."""
    if obj is None:
        return None
    copy, pointers = strict_copy(obj)
    return {**copy, NONSTRICT_KEY: pointers} if pointers else obj


def restore(obj: dict[str, Any]) -> dict[str, Any]:
    """The object ``storable`` wrote, its non-strict values read back (Python floats: ``inf``, ``nan``)."""
    pointers = obj.get(NONSTRICT_KEY)
    if not isinstance(pointers, list):
        return obj
    out = json.loads(json.dumps({k: v for k, v in obj.items() if k != NONSTRICT_KEY}))
    for pointer in pointers:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
        holder = out
        for part in parts[:-1]:
            holder = holder[int(part) if isinstance(holder, list) else part]
        last = int(parts[-1]) if isinstance(holder, list) else parts[-1]
        holder[last] = json.loads(holder[last])
    return out


def lenient_loads(raw: bytes) -> Any:
    """JSON as Python's reader takes it (``1e999`` and ``Infinity`` as inf), or None when not even that: the
    spool writes a kept literal as it is (``msgspec.Raw``), which the strict reader refuses."""
    try:
        return json.loads(raw)
    except ValueError:
        return None
