"""Bugs put into a library's code on purpose, found with the ``ast`` module and written back as a small edit of
the original text (never a re-rendering of the module, so its diff is the changed line alone).

Each kind is one a person makes: an operator flipped (``+``/``-``, ``<``/``<=``, ``==``/``!=``, ``and``/``or``,
``in``/``not in``, ...), an off-by-one integer, a statement removed, two arguments of a call swapped. Only edits
within one line are made, and only where the text between the operands is the operator alone (no comment or
line break), so the edit is exact. Whether a mutation makes a task is for the library's tests to say
(``swe.tasks``): most change nothing a test sees.
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Iterator
from dataclasses import dataclass

BINARY = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "//"), ast.FloorDiv: ("//", "*"),
          ast.Div: ("/", "*"), ast.Mod: ("%", "//"), ast.LShift: ("<<", ">>"), ast.RShift: (">>", "<<"),
          ast.BitAnd: ("&", "|"), ast.BitOr: ("|", "&")}
COMPARE = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
           ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in"),
           ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is")}
BOOLEAN = {ast.And: ("and", "or"), ast.Or: ("or", "and")}
REMOVABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return, ast.Raise, ast.Delete)
KINDS = ("operator", "off-by-one", "removed-statement", "swapped-arguments")


@dataclass(frozen=True)
class Mutation:
    path: str  # relative to the repository's top folder
    line: int  # 1-based
    start: int  # byte offsets within the line
    end: int
    replacement: str
    kind: str  # one of KINDS

    def apply(self, source: str) -> str:
        lines = split_lines(source)
        raw = lines[self.line - 1].encode()
        lines[self.line - 1] = (raw[:self.start] + self.replacement.encode() + raw[self.end:]).decode()
        return "".join(lines)

    def describe(self, source: str) -> dict[str, object]:
        """What changed, for the task's record (never shown to the agent)."""
        before = source.splitlines()[self.line - 1]
        after = self.apply(source).splitlines()[self.line - 1]
        return {"kind": self.kind, "path": self.path, "line": self.line, "before": before.strip(),
                "after": after.strip()}


def split_lines(source: str) -> list[str]:
    """Lines as the ``ast`` module numbers them (at ``\n`` only; ``str.splitlines`` also breaks at form feeds)."""
    parts = source.split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def fix_patch(path: str, buggy: str, fixed: str) -> str:
    """The unified diff that turns the buggy file back into the original (SWE-bench's ``patch``)."""
    body = "".join(difflib.unified_diff(buggy.splitlines(keepends=True), fixed.splitlines(keepends=True),
                                        f"a/{path}", f"b/{path}"))
    return f"diff --git a/{path} b/{path}\n{body}"


def find_mutations(path: str, source: str) -> list[Mutation]:
    """Every mutation of one module, in source order, that still compiles and changes the text."""
    tree = ast.parse(source)
    lines = [line.encode() for line in split_lines(source)]
    docstrings = _docstring_nodes(tree)
    found: list[Mutation] = []
    seen: set[tuple[int, int, int, str]] = set()
    for node in ast.walk(tree):
        for line, start, end, replacement, kind in _edits(node, lines, docstrings):
            key = (line, start, end, replacement)
            if key in seen:
                continue
            seen.add(key)
            mutation = Mutation(path, line, start, end, replacement, kind)
            mutated = mutation.apply(source)
            if mutated != source and _compiles(mutated):
                found.append(mutation)
    return sorted(found, key=lambda m: (m.line, m.start, m.end, m.replacement))


def _compiles(source: str) -> bool:
    try:
        compile(source, "<mutant>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                ids.add(id(first))
    return ids


def _one_line(node: ast.AST) -> bool:
    return getattr(node, "lineno", None) is not None and node.lineno == node.end_lineno


def _between(lines: list[bytes], left: ast.AST, right: ast.AST) -> tuple[int, int, int, str] | None:
    """The text between two operands on one line: (line, start, end, text)."""
    if not (_one_line(left) and _one_line(right) and left.end_lineno == right.lineno):
        return None
    line = left.end_lineno
    start, end = left.end_col_offset, right.col_offset
    return line, start, end, lines[line - 1][start:end].decode()


def _swap_operator(span: tuple[int, int, int, str] | None, old: str, new: str):
    """Replace the operator in the text between operands, when that text is only the operator (and brackets)."""
    if span is None:
        return
    line, start, end, text = span
    if re.sub(r"[\s()]", "", text) != old.replace(" ", ""):
        return
    replaced = re.sub(rf"(?<![\w<>=!/*&|]){re.escape(old)}(?![\w<>=/*&|])", new, text, count=1)
    if replaced != text:
        yield line, start, end, replaced, "operator"


def _edits(node: ast.AST, lines: list[bytes], docstrings: set[int]):
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY and not _is_text(node.left):
        old, new = BINARY[type(node.op)]
        yield from _swap_operator(_between(lines, node.left, node.right), old, new)
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in COMPARE:
        old, new = COMPARE[type(node.ops[0])]
        yield from _swap_operator(_between(lines, node.left, node.comparators[0]), old, new)
    elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
        old, new = BOOLEAN[type(node.op)]
        yield from _swap_operator(_between(lines, node.values[0], node.values[1]), old, new)
    elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 16 and _one_line(node):
        text = lines[node.lineno - 1][node.col_offset:node.end_col_offset].decode()
        if text.isdigit():  # a plain decimal literal, not 0x10 or 1_000
            for value in (node.value + 1, node.value - 1):
                if value >= 0:
                    yield node.lineno, node.col_offset, node.end_col_offset, str(value), "off-by-one"
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = [s for s in node.body if id(s) not in docstrings]
        if len(body) >= 2:
            for statement in body:
                if isinstance(statement, REMOVABLE) and _one_line(statement):
                    yield (statement.lineno, statement.col_offset, statement.end_col_offset, "pass",
                           "removed-statement")
    elif isinstance(node, ast.Call) and len(node.args) >= 2 and not node.keywords:
        first, second = node.args[0], node.args[1]
        if isinstance(first, ast.Starred) or isinstance(second, ast.Starred):
            return
        span = _between(lines, first, second)
        if span is None or span[3].strip() != "," or not _one_line(first):
            return
        line = lines[first.lineno - 1]
        a = line[first.col_offset:first.end_col_offset].decode()
        b = line[second.col_offset:second.end_col_offset].decode()
        if a != b:
            yield first.lineno, first.col_offset, second.end_col_offset, f"{b}{span[3]}{a}", "swapped-arguments"


def _is_text(node: ast.AST) -> bool:
    """String building (``"a" + b``, ``"%s" % x``) is left alone: flipping it is a type error, not a bug."""
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def interleave_by_kind(mutations: list[Mutation], seed: int | str) -> Iterator[Mutation]:
    """The order in which a library's mutations are tried: each kind shuffled under the seed, then one of each
    kind in turn, so the tasks of a library mix kinds instead of being the first lines' flips."""
    import random

    rng = random.Random(f"{seed}")
    groups = {kind: [m for m in mutations if m.kind == kind] for kind in KINDS}
    for group in groups.values():
        rng.shuffle(group)
    while any(groups.values()):
        for kind in KINDS:
            if groups[kind]:
                yield groups[kind].pop(0)
