"""``harnessrl swe tasks``: coding tasks from a library's source distribution, kept only when its own tests, run
in the sandbox, show the bug. A small library is built here as an sdist (the generator takes a local
``NAME-VERSION.tar.gz`` as it takes one from PyPI), so the test needs no network and each suite run is short;
the example's real libraries are exercised by test_swe_verifier.py on examples/swe/tasks.jsonl."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from harnessrl.swe.repository import apply_patch, unpack
from harnessrl.swe.tasks import generate_tasks, write_tasks

HARNESSRL = str(Path(sys.executable).with_name("harnessrl"))

LIBRARY = textwrap.dedent('''\
    """Small arithmetic helpers."""


    def clamp(value, low, high):
        if value < low:
            return low
        if value > high:
            return high
        return value


    def mean(values):
        total = 0
        for value in values:
            total += value
        return total / len(values)


    def window(items, size):
        return [items[i:i + size] for i in range(0, len(items) - size + 1)]
    ''')

TESTS = textwrap.dedent('''\
    import pytest

    from tinylib import clamp, mean, window


    @pytest.mark.parametrize("value,expected", [(-5, 0), (5, 5), (15, 10)])
    def test_clamp(value, expected):
        assert clamp(value, 0, 10) == expected


    def test_mean():
        assert mean([1, 2, 3, 6]) == 3


    def test_window():
        assert window([1, 2, 3], 2) == [[1, 2], [2, 3]]


    def test_window_whole():
        assert window([1, 2], 2) == [[1, 2]]
    ''')


def make_sdist(directory: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A source distribution as setuptools writes one: ``NAME-VERSION/`` with the files inside."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for relative, text in {"PKG-INFO": f"Name: {name}\nVersion: {version}\n", **files}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-{version}/{relative}")
            info.size, info.mtime = len(data), 0
            archive.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def tinylib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sdist(tmp_path_factory.mktemp("sdists"), "tinylib", "1.0.0",
                      {"tinylib/__init__.py": LIBRARY, "tests/test_tinylib.py": TESTS})


def test_tasks_are_bugs_the_librarys_own_tests_show(tinylib: Path, tmp_path: Path) -> None:
    """Each task: its FAIL_TO_PASS tests fail with the bug and pass as released, its PASS_TO_PASS tests pass
    in both, its problem statement names the failing tests without naming the change, and the same seed makes
    the same file."""
    logged: list[str] = []
    reports = generate_tasks([str(tinylib)], tmp_path / "a", seed=7, per_library=3, max_tries=12,
                             log=logged.append)
    (report,) = reports
    assert report.error is None and report.baseline_tests == 6
    assert len(report.tasks) == 3, (report.rejected, logged)
    assert report.tried >= 3 and sum(report.rejected.values()) == report.tried - 3
    all_tests = {f"tests/test_tinylib.py::test_clamp[{v}-{e}]" for v, e in [(-5, 0), (5, 5), (15, 10)]} | {
        "tests/test_tinylib.py::test_mean", "tests/test_tinylib.py::test_window",
        "tests/test_tinylib.py::test_window_whole"}
    lines = set()
    for task in report.tasks:
        assert {"instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "FAIL_TO_PASS",
                "PASS_TO_PASS", "version", "environment_setup_commit", "hints_text", "created_at"} <= set(task)
        assert task["repo"] == "pypi/tinylib" and task["version"] == "1.0.0" and task["test_patch"] == ""
        fail, keep = set(task["FAIL_TO_PASS"]), set(task["PASS_TO_PASS"])
        assert fail and keep and not fail & keep and fail | keep == all_tests
        mutation = task["mutation"]
        lines.add(mutation["line"])
        statement = task["problem_statement"]
        assert all(f"`{test}`" in statement for test in sorted(fail)[:5])
        for source_line in (mutation["before"], mutation["after"]):  # the code is not quoted ("pass" is a word)
            assert source_line == "pass" or source_line not in statement
        assert "mutat" not in statement.lower() and mutation["kind"] not in statement
        # the repository an agent gets is the snapshot with the fix patch reversed: the bug, on its line
        snapshot = tmp_path / "a" / task["snapshot"]
        root = unpack(snapshot, tmp_path / f"check-{task['instance_id']}")
        apply_patch(root, task["patch"], reverse=True)
        buggy_line = (root / mutation["path"]).read_text().splitlines()[mutation["line"] - 1]
        assert buggy_line.strip() == mutation["after"]
    assert len(lines) == 3  # one task per line of code

    write_tasks(reports, tmp_path / "a" / "tasks.jsonl")
    again = generate_tasks([str(tinylib)], tmp_path / "b", seed=7, per_library=3, max_tries=12, log=logged.append)
    write_tasks(again, tmp_path / "b" / "tasks.jsonl")
    assert (tmp_path / "a/tasks.jsonl").read_bytes() == (tmp_path / "b/tasks.jsonl").read_bytes()
    rows = [json.loads(line) for line in (tmp_path / "a/tasks.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rows] == [task["instance_id"] for task in report.tasks]
    assert rows[0]["data"] == report.tasks[0]


def test_a_library_whose_tests_fail_as_released_or_that_has_none_is_rejected_with_the_reason(
        tmp_path: Path) -> None:
    failing = make_sdist(tmp_path / "in", "brokenlib", "0.1", {
        "brokenlib/__init__.py": "def one():\n    return 2\n",
        "tests/test_one.py": "from brokenlib import one\n\n\ndef test_one():\n    assert one() == 1\n"})
    untested = make_sdist(tmp_path / "in", "untested", "0.1", {"untested/__init__.py": "X = 1\n"})
    reports = generate_tasks([str(failing), str(untested)], tmp_path / "out", seed=0, per_library=2,
                             max_tries=5, log=lambda line: None)
    assert reports[0].error == "its tests fail before any mutation (1: tests/test_one.py::test_one)"
    assert "has no tests" in reports[1].error
    assert all(not r.tasks for r in reports)
    assert not (tmp_path / "out" / "repos").exists()  # nothing kept of a rejected library


def test_the_command_writes_the_file_and_reports_per_library(tinylib: Path, tmp_path: Path) -> None:
    output = tmp_path / "swe" / "tasks.jsonl"
    done = subprocess.run([HARNESSRL, "swe", "tasks", "--library", str(tinylib), "--library", "no-version-given",
                           "--output", str(output), "--per-library", "1", "--max-tries", "6", "--seed", "3"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{tinylib}: 1 tasks in" in done.stdout
    assert "no-version-given: 0 tasks" in done.stdout and "exact version (NAME==VERSION)" in done.stdout
    assert f"1 tasks written to {output}" in done.stdout
    (row,) = [json.loads(line) for line in output.read_text().splitlines()]
    assert (output.parent / row["data"]["snapshot"]).read_bytes() == tinylib.read_bytes()
