"""Base classes every spec and status model derives from, so the YAML conventions are set in one place."""

from __future__ import annotations

from typing import ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator
from pydantic.alias_generators import to_camel

from harnessrl.spec.rules import Rule, enforce


class SpecModel(BaseModel):
    """A part of ``TrainingRun.spec``.

    camelCase in YAML, snake_case in Python. Unknown fields are errors (a typo must not silently fall
    back to a default). Types are strict because the API server is: it refuses ``groupSize: "8"``, or
    ``value: 8080`` for an env var, so ``harnessrl validate`` must refuse them too.
    """

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        use_attribute_docstrings=True,
    )

    rules: ClassVar[tuple[Rule, ...]] = ()
    """Cross-field rules over this object; also emitted as CEL into the CRD at this object's schema."""

    cluster_only: ClassVar[frozenset[str]] = frozenset()
    """Fields (Python names) only the operator reads: ``harnessrl run`` has one machine and no pods, so it
    leaves them alone, and ``harnessrl validate`` and ``harnessrl run`` say so when a file sets them
    (``harnessrl.spec.scope``)."""

    changeable: ClassVar[frozenset[str] | None] = None
    """For the objects of a TrainingRun whose fields are fixed once it exists: the fields (Python names) that
    may still change; every other field gets a CEL transition rule (``self.f == oldSelf.f``) in the CRD, see
    ``harnessrl.spec.changes``. None: the object is compared as a whole by the object holding it."""

    @model_validator(mode="after")
    def _enforce_rules(self, info: ValidationInfo) -> Self:
        enforce(self, self.rules, cluster=bool((info.context or {}).get("cluster")))
        return self


class StatusModel(BaseModel):
    """A part of ``TrainingRun.status``: written by harnessrl itself and read back as JSON, so not strict."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        use_attribute_docstrings=True,
    )
