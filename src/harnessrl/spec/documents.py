"""Reading TrainingRun YAML the way kubectl does, keeping the line of every field for error messages."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from harnessrl.spec.models import GROUP, KIND

Loc = tuple[str | int, ...]


class _KubeYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, plus the exponent-only floats kubectl's YAML parser accepts.

    PyYAML follows YAML 1.1, where ``1e-6`` (no dot) is a *string*; kubectl reads it as a number. Without
    this, ``lr: 1e-6`` would pass ``kubectl apply`` and fail ``harnessrl validate``.
    """


_KubeYamlLoader.yaml_implicit_resolvers = {
    first: list(resolvers) for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_KubeYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class YamlSyntaxError(ValueError):
    """Malformed YAML, with the 1-based line and column where the parser gave up."""

    def __init__(self, problem: str, line: int | None, column: int | None):
        self.problem, self.line, self.column = problem, line, column
        where = f"line {line}, column {column}: " if line is not None else ""
        super().__init__(f"{where}{problem}")


@dataclass
class Document:
    """One YAML document of a file: its data, where each field sits, and keys given twice."""

    data: Any
    start_line: int
    lines: dict[Loc, int] = field(default_factory=dict)
    duplicate_keys: list[tuple[Loc, int, int]] = field(default_factory=list)
    """(path of the key, line of its first use, line of the repeat); YAML silently keeps only the last."""

    def line_of(self, loc: Loc) -> int:
        """The line of the field at ``loc``, or of its nearest parent that is in the file (missing fields)."""
        for end in range(len(loc), 0, -1):
            line = self.lines.get(tuple(loc[:end]))
            if line is not None:
                return line
        return self.start_line


def _index(node: yaml.Node, loc: Loc, document: Document) -> None:
    if isinstance(node, yaml.MappingNode):
        first_line: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None:
                continue
            line = key_node.start_mark.line + 1
            if key in first_line:
                document.duplicate_keys.append(((*loc, key), first_line[key], line))
            first_line.setdefault(key, line)
            document.lines[(*loc, key)] = line
            _index(value_node, (*loc, key), document)
    elif isinstance(node, yaml.SequenceNode):
        for position, item in enumerate(node.value):
            document.lines[(*loc, position)] = item.start_mark.line + 1
            _index(item, (*loc, position), document)


def is_other_object(data: object) -> bool:
    """A Kubernetes object that is not a TrainingRun (a ConfigMap of tasks in the same file): skipped by
    validation. Anything with our group, our kind, or no apiVersion/kind at all is checked as a TrainingRun,
    so a typo in either is reported rather than skipped."""
    if not isinstance(data, dict):
        return False
    api_version, kind = data.get("apiVersion"), data.get("kind")
    return (
        isinstance(api_version, str)
        and isinstance(kind, str)
        and not api_version.startswith(f"{GROUP}/")
        and kind != KIND
    )


def load_documents(text: str) -> list[Document]:
    """Every non-empty document in ``text``; raises :class:`YamlSyntaxError` for malformed YAML."""
    loader = _KubeYamlLoader(text)
    documents: list[Document] = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            document = Document(data=None, start_line=node.start_mark.line + 1)
            _index(node, (), document)
            document.data = loader.construct_document(node)
            if document.data is not None:
                documents.append(document)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        problem = " ".join(part for part in (error.context, error.problem) if part) or "malformed YAML"
        raise YamlSyntaxError(
            problem, mark.line + 1 if mark else None, mark.column + 1 if mark else None
        ) from None
    except yaml.YAMLError as error:
        raise YamlSyntaxError(str(error).replace("\n", " "), None, None) from None
    finally:
        loader.dispose()
    return documents
