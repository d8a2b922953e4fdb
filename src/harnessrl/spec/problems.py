"""Turning a TrainingRun document into a list of one-line problems: field path (as spelled in YAML), what is
wrong and what to do. `harnessrl validate` prints them; the operator puts the same text in status.message."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from harnessrl.spec.crd import openapi_schema
from harnessrl.spec.documents import Loc
from harnessrl.spec.kube import PATTERN_HINTS
from harnessrl.spec.models import TrainingRun
from harnessrl.spec.rules import CLUSTER_CONTEXT, RULE_ERROR_TYPE

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a document."""

    path: str
    """The field, as spelled in YAML: ``spec.learner.algorithm.clip``, ``spec.harness.env[0].value``."""
    message: str
    """What is wrong and what to do, on one line."""
    loc: Loc = field(default=(), compare=False)
    """The same path as a tuple of keys and list indices (for finding the line in a file)."""

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class InvalidSpec(ValueError):
    """A document that is not a valid TrainingRun; ``problems`` says why, each on its own line."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(problem) for problem in problems))


def parse_training_run(doc: Any, cluster: bool = False) -> TrainingRun:
    """The TrainingRun in ``doc`` (parsed YAML/JSON); raises :class:`InvalidSpec` listing every problem.

    Fields must be spelled in camelCase, as in the CRD: the Python names are not accepted from documents.
    ``cluster``: also the rules only a cluster needs (``Rule.cluster_only``), as the API server applies them.
    """
    if not isinstance(doc, dict):
        raise InvalidSpec(
            [
                Problem(
                    "",
                    "expected a TrainingRun (a mapping with apiVersion, kind, metadata, spec), "
                    f"got {_show(doc)}",
                )
            ]
        )
    try:
        return TrainingRun.model_validate(
            doc, by_alias=True, by_name=False, context=CLUSTER_CONTEXT if cluster else None
        )
    except ValidationError as error:
        raise InvalidSpec(problems_from_error(error)) from None


def validate_document(doc: Any, cluster: bool = False) -> list[Problem]:
    """Every problem with ``doc``; empty when it is a valid TrainingRun (on a cluster too, with ``cluster``)."""
    try:
        parse_training_run(doc, cluster)
    except InvalidSpec as invalid:
        return invalid.problems
    return []


def format_path(loc: Loc) -> str:
    """``('spec', 'harness', 'env', 0, 'value')`` -> ``spec.harness.env[0].value``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _IDENTIFIER.match(part):
            text += f".{part}" if text else part
        else:
            text += f"[{part!r}]"
    return text


def problems_from_error(error: ValidationError) -> list[Problem]:
    """One Problem per pydantic error; a broken-rules error becomes one Problem per rule."""
    problems: list[Problem] = []
    for detail in error.errors(include_url=False):
        loc: Loc = tuple(detail["loc"])
        if detail["type"] == RULE_ERROR_TYPE:
            for rule_field, message in detail["ctx"]["violations"]:
                rule_loc = loc + tuple(rule_field.split(".")) if rule_field else loc
                problems.append(Problem(format_path(rule_loc), message, rule_loc))
        else:
            problems.append(Problem(format_path(loc), _describe(detail, loc), loc))
    return problems


def _schema_at(loc: Loc) -> dict[str, Any] | None:
    """The CRD schema node describing the field at ``loc``, if the schema describes it."""
    node: dict[str, Any] | None = openapi_schema()
    for part in loc:
        if node is None:
            return None
        if isinstance(part, int):
            node = node.get("items")
        elif part in node.get("properties", {}):
            node = node["properties"][part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return None
    return node


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML, with its kind where that is the point."""
    if value is None:
        return "an empty value (null)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (true/false)"
    if isinstance(value, int):
        return f"{value} (an integer)"
    if isinstance(value, float):
        return f"{value} (a number)"
    if isinstance(value, str):
        return f"{value!r} (a string)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


def _normalized(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _closest(word: str, choices: list[str]) -> str | None:
    """The choice the user probably meant: same letters ignoring case and separators, else difflib's best."""
    for choice in choices:
        if _normalized(choice) == _normalized(word):
            return choice
    by_normalized = {_normalized(choice): choice for choice in choices}
    match = difflib.get_close_matches(_normalized(word), list(by_normalized), n=1, cutoff=0.6)
    return by_normalized[match[0]] if match else None


def _paths_named(name: str) -> list[str]:
    """Where in the spec a field of this name (ignoring case and separators) exists."""
    found: list[str] = []
    pending: list[tuple[Loc, dict[str, Any]]] = [((), openapi_schema())]
    while pending:
        loc, node = pending.pop()
        for key, child in node.get("properties", {}).items():
            if _normalized(key) == _normalized(name):
                found.append(format_path((*loc, key)))
            pending.append(((*loc, key), child))
        if isinstance(node.get("items"), dict):
            pending.append(((*loc, 0), node["items"]))
    return sorted(path.replace("[0]", "[]") for path in found)


def _unknown_field(loc: Loc) -> str:
    name = str(loc[-1])
    parent = _schema_at(loc[:-1]) or {}
    allowed = list(parent.get("properties", {}))
    suggestion = _closest(name, allowed) if allowed else None
    if suggestion:
        return f"unknown field {name!r} — did you mean {suggestion!r}?"
    elsewhere = _paths_named(name)
    if elsewhere:
        return f"unknown field {name!r} here — it belongs at {' or '.join(elsewhere)}"
    if allowed:
        return f"unknown field {name!r} — remove it; fields here: {', '.join(allowed)}"
    return f"unknown field {name!r} — remove it"


def _not_allowed_value(value: Any, loc: Loc, expected: str) -> str:
    node = _schema_at(loc) or {}
    choices = [str(choice) for choice in node.get("enum", [])]
    allowed = ", ".join(choices) if choices else expected
    suggestion = _closest(str(value), choices) if isinstance(value, str) and choices else None
    hint = f"did you mean {suggestion!r}?" if suggestion else f"use one of: {allowed}"
    shown = repr(value) if isinstance(value, str) else _show(value)
    return f"{shown} is not allowed — {hint}"


def _missing(loc: Loc) -> str:
    node = _schema_at(loc) or {}
    description = node.get("description", "").split(". ")[0].rstrip(".")
    if description[:2].istitle():  # "The desired run" -> "the desired run", but keep "TCP ports"
        description = description[0].lower() + description[1:]
    return "required field is missing — add it" + (f" ({description})" if description else "")


_BOUNDS = {
    "greater_than_equal": ("ge", "at least", "use {bound} or more"),
    "greater_than": ("gt", "greater than", "use a value above {bound}"),
    "less_than_equal": ("le", "at most", "use {bound} or less"),
    "less_than": ("lt", "less than", "use a value below {bound}"),
}

_WANTED = {
    "int_type": ("an integer", "write a whole number without quotes"),
    "float_type": ("a number", "write a number without quotes"),
    "string_type": ("a string", "quote it"),
    "bool_type": ("true or false", "write true or false without quotes"),
    "list_type": ("a list", "write it as [a, b] or as '- item' lines"),
    "dict_type": ("a mapping", "write it as 'key: value' lines"),
    "model_type": ("a mapping", "write it as 'key: value' lines"),
    "model_attributes_type": ("a mapping", "write it as 'key: value' lines"),
    "datetime_type": ("a date-time", "write it like 2025-01-31T12:00:00Z"),
    "datetime_parsing": ("a date-time", "write it like 2025-01-31T12:00:00Z"),
    "datetime_from_date_parsing": ("a date-time", "write it like 2025-01-31T12:00:00Z"),
    "finite_number": ("a finite number", "use a number other than inf or nan"),
    # Lax parsing errors come from status models, which accept JSON strings for numbers and times.
    "int_parsing": ("an integer", "write a whole number"),
    "int_from_float": ("an integer", "write a whole number"),
    "float_parsing": ("a number", "write a number"),
    "bool_parsing": ("true or false", "write true or false"),
}


def _describe(detail: ErrorDetails, loc: Loc) -> str:
    """What is wrong and what to do, for one pydantic error."""
    kind, value, ctx = detail["type"], detail.get("input"), detail.get("ctx") or {}
    if kind == "missing":
        return _missing(loc)
    if kind == "extra_forbidden":
        return _unknown_field(loc)
    if kind in _WANTED:
        wanted, fix = _WANTED[kind]
        if kind == "string_type" and isinstance(value, (int, float)) and not isinstance(value, bool):
            fix = f'quote it: "{value}"'
        if value is None and kind in ("model_type", "dict_type", "list_type"):
            fix = "fill it in, or remove the key to use the default"
        return f"expected {wanted}, got {_show(value)} — {fix}"
    if kind in ("literal_error", "enum"):
        return _not_allowed_value(value, loc, str(ctx.get("expected", "")))
    if kind in _BOUNDS:
        bound_key, words, fix = _BOUNDS[kind]
        bound = ctx[bound_key]
        return f"must be {words} {bound}, got {value} — {fix.format(bound=bound)}"
    if kind in ("too_short", "too_long"):
        actual = ctx.get("actual_length", len(value) if hasattr(value, "__len__") else "?")
        if kind == "too_short":
            return f"needs at least {ctx['min_length']} item(s), got {actual} — add items or remove the key"
        return f"takes at most {ctx['max_length']} item(s), got {actual} — remove the extra items"
    if kind == "string_too_short":
        return "must not be empty — fill it in or remove the key"
    if kind == "string_too_long":
        return f"is {len(value)} characters long, the limit is {ctx['max_length']} — shorten it"
    if kind == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern", ""))
        hint = PATTERN_HINTS.get(pattern, f"it must match {pattern}")
        return f"{value!r} is not valid here — {hint}"
    # Custom errors (quantities, CIDRs, URLs, duplicate task ids) are already written for users; anything
    # else keeps pydantic's wording, still on one line and still saying what to do.
    message = detail["msg"].replace("\n", " ")
    return message if " — " in message else f"{message} — correct the value"
