"""Which fields of a TrainingRun ``harnessrl run`` leaves to the cluster.

One spec runs in both places, so a file written for a cluster (images, GPUs, replicas, the sandbox, volumes)
validates and runs on one machine too; the fields only the operator reads are declared on their models
(``SpecModel.cluster_only``) and named to the user whenever a file sets them, instead of being dropped
silently.
"""

from __future__ import annotations

from pydantic import BaseModel

from harnessrl.spec.base import SpecModel


def cluster_only_paths(model: BaseModel, prefix: str = "spec") -> list[str]:
    """The YAML paths under ``model`` that the file sets and only the operator reads (in field order)."""
    paths: list[str] = []
    for name, field in type(model).model_fields.items():
        path = f"{prefix}.{field.alias or name}"
        value = getattr(model, name)
        if isinstance(model, SpecModel) and name in model.cluster_only:
            if name in model.model_fields_set:
                paths.append(path)
            continue
        if isinstance(value, BaseModel):
            paths += cluster_only_paths(value, path)
    return paths
