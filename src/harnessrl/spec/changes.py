"""Which fields of a TrainingRun may change while it exists, and the CEL transition rules that fix the others.

A running run has a vLLM Deployment loaded with one model, a learner Job whose pod template Kubernetes never
lets change, rows already trained with one algorithm and a store holding calls sampled one way: changing any
of those mid-run would silently mix two experiments. So a field is fixed once the run is created unless its
model lists it in ``changeable`` (``SpecModel.changeable``); the API server refuses the change with a
message naming the field, the way a Job refuses a new pod template. What may change acts on work started
after the change: the suspend switch and the deadlines, how many vLLM replicas serve, and how many harness
pods run at once, for how long, how often they are retried and where they are scheduled.

A transition rule (one that reads ``oldSelf``) is only evaluated on an update and only where the old object
had the field, so a fixed optional field compares presence too: setting a field that was unset is a change.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

from pydantic import BaseModel
from pydantic.alias_generators import to_camel

from harnessrl.spec.base import SpecModel


def _yaml_name(model: type[BaseModel], name: str) -> str:
    field = model.model_fields[name]
    return field.alias or to_camel(name)


def _may_be_absent(model: type[BaseModel], name: str) -> bool:
    """Optional without a default: the API server stores nothing when it is not set."""
    field = model.model_fields[name]
    return not field.is_required() and field.default is None and field.default_factory is None


def _checked_submodel(model: type[BaseModel], name: str) -> type[SpecModel] | None:
    """The field's model when that model fixes its own fields (so this level leaves it alone)."""
    annotation = model.model_fields[name].annotation
    # An optional section (``evaluation: Evaluation | None``) fixes its own fields wherever it is set.
    members = [arg for arg in get_args(annotation) if arg is not type(None)]
    if len(members) == 1:
        annotation = members[0]
    if (
        isinstance(annotation, type)
        and issubclass(annotation, SpecModel)
        and annotation.changeable is not None
    ):
        return annotation
    return None


def changeable_paths(model: type[SpecModel], prefix: str = "spec") -> Iterator[str]:
    """The YAML paths under ``model`` that may change while a run exists (e.g. ``spec.rollout.replicas``)."""
    for name in sorted(model.changeable or (), key=list(model.model_fields).index):
        submodel = _checked_submodel(model, name)
        path = f"{prefix}.{_yaml_name(model, name)}"
        if submodel is None:
            yield path
        else:
            yield from changeable_paths(submodel, path)


def transition_rules(model: type[SpecModel], changeable_text: str) -> list[dict[str, Any]]:
    """The ``x-kubernetes-validations`` entries that fix every field of ``model`` not in its ``changeable``."""
    if model.changeable is None:
        return []
    unknown = model.changeable - set(model.model_fields)
    if unknown:
        raise ValueError(f"{model.__name__}.changeable names fields it does not have: {sorted(unknown)}")
    rules = []
    for name in model.model_fields:
        if name in model.changeable:
            continue
        yaml_name = _yaml_name(model, name)
        same = f"self.{yaml_name} == oldSelf.{yaml_name}"
        if _may_be_absent(model, name):
            same = f"has(self.{yaml_name}) == has(oldSelf.{yaml_name}) && (!has(self.{yaml_name}) || {same})"
        rules.append(
            {
                "rule": same,
                "message": "is fixed once the run exists — create a new TrainingRun to change it (the stored "
                f"traces of this one are kept); what may change: {changeable_text}",
                "fieldPath": f".{yaml_name}",
            }
        )
    return rules
