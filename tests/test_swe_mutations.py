"""Bugs put into code with the ``ast`` module (``harnessrl.swe.mutations``): each kind is found, each edit is
the one line it names, the fix patch undoes it with ``git apply``, and the order tried is fixed by the seed."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from harnessrl.swe.mutations import KINDS, find_mutations, fix_patch, interleave_by_kind
from harnessrl.swe.repository import RepositoryError, apply_patch

SOURCE = textwrap.dedent('''\
    """A module."""


    def clamp(value, low, high):
        """Docstrings are never removed."""
        if value < low and low <= high:
            return low
        total = value + 1
        return min(total - 1, high)  # a comment stays


    def label(name):
        return "item " + name
    ''')


def test_each_kind_is_found_and_edits_its_line_only() -> None:
    mutations = find_mutations("pkg/mod.py", SOURCE)
    assert {m.kind for m in mutations} == set(KINDS)
    seen = {(m.kind, m.describe(SOURCE)["before"], m.describe(SOURCE)["after"]) for m in mutations}
    assert ("operator", "if value < low and low <= high:", "if value <= low and low <= high:") in seen
    assert ("operator", "if value < low and low <= high:", "if value < low or low <= high:") in seen
    assert ("operator", "total = value + 1", "total = value - 1") in seen
    assert ("off-by-one", "total = value + 1", "total = value + 2") in seen
    assert ("removed-statement", "total = value + 1", "pass") in seen
    assert ("swapped-arguments", "return min(total - 1, high)  # a comment stays",
            "return min(high, total - 1)  # a comment stays") in seen
    for mutation in mutations:
        mutated = mutation.apply(SOURCE).splitlines()
        changed = [i + 1 for i, (a, b) in enumerate(zip(SOURCE.splitlines(), mutated)) if a != b]
        assert changed == [mutation.line]
        assert "Docstrings" in mutation.apply(SOURCE)
    # string building is left alone: "item " - name is a type error, not a bug a test names
    assert not [m for m in mutations if m.line == 14 and m.kind == "operator"]


def test_the_fix_patch_undoes_the_bug_with_git_apply(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    for mutation in find_mutations("pkg/mod.py", SOURCE)[:12]:
        buggy = mutation.apply(SOURCE)
        (tmp_path / "pkg/mod.py").write_text(buggy)
        apply_patch(tmp_path, fix_patch("pkg/mod.py", buggy, SOURCE))
        assert (tmp_path / "pkg/mod.py").read_text() == SOURCE
        apply_patch(tmp_path, fix_patch("pkg/mod.py", buggy, SOURCE), reverse=True)
        assert (tmp_path / "pkg/mod.py").read_text() == buggy


def test_a_patch_that_does_not_fit_is_refused_and_git_never_looks_above(tmp_path: Path) -> None:
    """Inside a git repository (this one), paths are still taken relative to the folder given."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg/mod.py").write_text(SOURCE)
    mutation = find_mutations("pkg/mod.py", SOURCE)[0]
    patch = fix_patch("pkg/mod.py", mutation.apply(SOURCE), SOURCE)
    apply_patch(tree, patch, reverse=True)
    assert (tree / "pkg/mod.py").read_text() == mutation.apply(SOURCE)
    with pytest.raises(RepositoryError, match="does not apply"):
        apply_patch(tree, patch, reverse=True)  # already applied: the context no longer matches


def test_the_order_tried_is_fixed_by_the_seed_and_mixes_kinds() -> None:
    mutations = find_mutations("pkg/mod.py", SOURCE)
    first = list(interleave_by_kind(mutations, "0:pkg"))
    assert first == list(interleave_by_kind(mutations, "0:pkg"))
    assert first != list(interleave_by_kind(mutations, "1:pkg"))
    assert sorted(first, key=id) == sorted(mutations, key=id)
    assert [m.kind for m in first[:4]] == list(KINDS)
