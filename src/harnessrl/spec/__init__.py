"""The TrainingRun spec: the single source of truth for the API, the CRD and validation messages.

Modules: ``models`` (the resource and its spec sections, with ``harness``, ``learner``, ``kube`` and
``status``), ``rules`` (cross-field rules, written once for pydantic and CEL), ``crd`` (the generated
CustomResourceDefinition), ``documents`` (YAML as kubectl reads it), ``problems`` (one-line messages for
users and for status), ``commands`` (``harnessrl crd`` and ``harnessrl validate``).
"""

from harnessrl.spec.models import TrainingRun, TrainingRunSpec
from harnessrl.spec.problems import InvalidSpec, Problem, parse_training_run, validate_document
from harnessrl.spec.status import Condition, ConditionType, Phase, Reason, TrainingRunStatus

__all__ = [
    "Condition",
    "ConditionType",
    "InvalidSpec",
    "Phase",
    "Problem",
    "Reason",
    "TrainingRun",
    "TrainingRunSpec",
    "TrainingRunStatus",
    "parse_training_run",
    "validate_document",
]
