"""Cross-field rules, each written once for the two places that enforce it.

Kubernetes evaluates a rule's CEL text when a TrainingRun is stored (the CRD carries it as an
``x-kubernetes-validations`` entry on the schema of the model that declares it); Python evaluates the same
rule in the model validator, so ``harnessrl validate``, the local runner and the operator refuse exactly what
the API server refuses. Keeping the CEL and the Python predicate in one object, beside the fields they read,
is what keeps them from drifting; tests/test_spec_rules.py evaluates both on the same documents with a real
CEL interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic_core import PydanticCustomError

# The error type a broken rule raises inside pydantic; problems.py expands it into one Problem per rule.
RULE_ERROR_TYPE = "spec_rule"


@dataclass(frozen=True)
class Rule:
    """A rule over one object of the spec (``self`` in CEL, the model instance in Python)."""

    cel: str
    """The rule as the API server evaluates it, after defaults are applied."""
    holds: Callable[[Any], bool]
    """The same rule over the model instance."""
    problem: str
    """What is wrong, in words; Kubernetes shows it, and Python does when ``explain`` is not given."""
    fix: str
    """What the user should do."""
    field: str = ""
    """camelCase path from the object to the field to blame ('' = the object itself), e.g. ``clip``."""
    explain: Callable[[Any], str] | None = None
    """The problem stated with the document's own values, e.g. ``low 0.3 is above high 0.2``."""
    cluster_only: bool = False
    """A rule only a cluster needs (``harnessrl run`` has one machine and one filesystem): the CRD always
    carries it, and Python enforces it when validating for a cluster (``CLUSTER_CONTEXT``: the operator,
    ``harnessrl validate``'s cluster check)."""

    @property
    def message(self) -> str:
        """The static message the CRD carries for this rule."""
        return f"{self.problem} — {self.fix}"

    def describe(self, obj: Any) -> str:
        """The message for a broken rule, with the document's values where the rule can state them."""
        problem = self.explain(obj) if self.explain is not None else self.problem
        return f"{problem} — {self.fix}"

    def to_crd(self) -> dict[str, str]:
        """The ``x-kubernetes-validations`` entry for this rule."""
        entry = {"rule": self.cel, "message": self.message}
        if self.field:
            entry["fieldPath"] = "." + self.field
        return entry


CLUSTER_CONTEXT = {"cluster": True}
"""The pydantic validation context under which cluster-only rules are enforced too."""


def enforce(obj: Any, rules: tuple[Rule, ...], cluster: bool = False) -> None:
    """Raise one pydantic error that carries every rule ``obj`` breaks (pydantic allows one per validator);
    cluster-only rules count only when ``cluster``."""
    broken = tuple(
        (rule.field, rule.describe(obj))
        for rule in rules
        if (cluster or not rule.cluster_only) and not rule.holds(obj)
    )
    if broken:
        summary = "; ".join(f"{field}: {message}" if field else message for field, message in broken)
        raise PydanticCustomError(RULE_ERROR_TYPE, "{summary}", {"summary": summary, "violations": broken})


def exactly_one(what: str, fields: dict[str, str], fix: str) -> Rule:
    """The rule 'exactly one of these optional fields is set'; ``fields``: YAML name -> Python attribute."""

    def present(obj: Any) -> list[str]:
        return [name for name, attribute in fields.items() if getattr(obj, attribute) is not None]

    names = list(fields)
    listed = ", ".join(names[:-1]) + " or " + names[-1]
    return Rule(
        cel=" + ".join(f"(has(self.{name}) ? 1 : 0)" for name in names) + " == 1",
        holds=lambda obj: len(present(obj)) == 1,
        problem=f"{what} needs exactly one of {listed}",
        explain=lambda obj: (
            f"{what} needs exactly one of {listed}, got {' and '.join(present(obj)) or 'none'}"
        ),
        fix=fix,
    )


def path_inside(path: str, mount_path: str) -> bool:
    """Whether ``path`` lies inside the directory ``mount_path`` (string logic, as the CEL twin does it)."""
    prefix = mount_path if mount_path.endswith("/") else mount_path + "/"
    return path == mount_path or path.startswith(prefix)


def path_inside_cel(path: str, mount_path: str) -> str:
    """CEL twin of :func:`path_inside` for two string expressions."""
    return (
        f"({path} == {mount_path} || {path}.startsWith("
        f"{mount_path}.endsWith('/') ? {mount_path} : {mount_path} + '/'))"
    )
