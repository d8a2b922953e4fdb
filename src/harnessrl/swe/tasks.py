"""Coding tasks made from real libraries: a bug put into a library's code, kept only when its own tests show it.

For each library (``name==version`` on PyPI): its source distribution is fetched and pinned by sha256, its test
suite is run unchanged in a sandbox (a library whose suite does not pass as released is rejected, with the
failing tests named), then mutations of its modules are tried in an order fixed by the seed. A mutation makes a
task when some tests that passed now fail (FAIL_TO_PASS) and some still pass (PASS_TO_PASS): the tests of the
suite that passed before and still pass are all PASS_TO_PASS. At most one task is made per line of code.

Tasks use SWE-bench's field names: ``instance_id``, ``repo``, ``base_commit`` (here ``sha256:<sdist digest>``),
``patch`` (the diff that fixes the bug: buggy file -> released file), ``test_patch`` (empty: the library's own
tests are unchanged), ``problem_statement`` (written from the failing tests' output, never naming the
mutation), ``FAIL_TO_PASS``, ``PASS_TO_PASS`` (lists of pytest node ids), ``version``, ``hints_text``,
``created_at``, ``environment_setup_commit``. Beside them: ``snapshot`` (the sdist, relative to the tasks
file), ``snapshot_sha256``, ``root`` (the sdist's top folder), ``python_path`` and ``test_paths`` (how the suite
is run) and ``mutation`` (what was changed, for analysis; the agent is given the problem statement alone).
The repository an agent gets is the snapshot with ``patch`` applied in reverse.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harnessrl.swe.mutations import Mutation, find_mutations, fix_patch, interleave_by_kind
from harnessrl.swe.repository import (
    Layout,
    RepositoryError,
    detect_layout,
    download_sdist,
    sdist_name_version,
    sha256,
    unpack,
)
from harnessrl.swe.testrun import SuiteRun, run_suite

SNAPSHOT_DIR = "repos"  # beside the tasks file
STATEMENT_TESTS = 5  # failing tests quoted in a problem statement
STATEMENT_MESSAGE_CHARS = 400


@dataclass
class LibraryReport:
    """What generation did with one library: its tasks, or why it has none."""

    requirement: str
    tasks: list[dict] = field(default_factory=list)
    tried: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> mutations
    error: str | None = None
    seconds: float = 0.0
    baseline_tests: int = 0


def generate_tasks(requirements: Sequence[str], output_dir: Path, *, seed: int, per_library: int,
                   max_tries: int, log: Callable[[str], None] = print) -> list[LibraryReport]:
    """Tasks for each library, its sdist copied into ``output_dir/repos`` (the same bytes for the same
    version), where the tasks file beside it names it."""
    snapshots = output_dir / SNAPSHOT_DIR
    reports = []
    for requirement in requirements:
        started = time.monotonic()
        report = LibraryReport(requirement)
        try:
            _library_tasks(requirement, snapshots, seed, per_library, max_tries, report, log)
        except RepositoryError as exc:
            report.error = str(exc)
            log(f"{requirement}: rejected: {exc}")
        report.seconds = time.monotonic() - started
        reports.append(report)
    return reports


def _library_tasks(requirement: str, snapshots: Path, seed: int, per_library: int, max_tries: int,
                   report: LibraryReport, log: Callable[[str], None]) -> None:
    with tempfile.TemporaryDirectory(prefix="harnessrl-swe-") as scratch:
        work = Path(scratch)
        sdist = _fetch(requirement, work / "download")
        snapshot = snapshots / sdist.name
        if snapshot.exists() and sha256(snapshot) != sha256(sdist):
            raise RepositoryError(f"{snapshot} exists with other bytes than {sdist}; remove it")
        name, version = sdist_name_version(sdist)
        pristine = unpack(sdist, work / "pristine")
        layout = detect_layout(pristine)
        baseline = run_suite(_fresh_copy(pristine, work / "baseline"), layout)
        problem = baseline.why_not_run()
        if problem is None and baseline.broken:
            failing = sorted(baseline.broken)
            problem = (f"its tests fail before any mutation ({len(failing)}: {', '.join(failing[:5])}"
                       f"{', ...' if len(failing) > 5 else ''})")
        if problem:
            raise RepositoryError(problem)
        report.baseline_tests = len(baseline.passed)
        snapshots.mkdir(parents=True, exist_ok=True)
        if not snapshot.exists():
            shutil.copyfile(sdist, snapshot)
        log(f"{requirement}: {len(baseline.passed)} tests pass as released ({baseline.result.seconds:.1f} s)")
        sources = {path: (pristine / path).read_text(encoding="utf-8") for path in layout.sources}
        candidates = [m for path, text in sources.items() for m in find_mutations(path, text)]
        used_lines: set[tuple[str, int]] = set()
        for mutation in interleave_by_kind(candidates, f"{seed}:{name}"):
            if len(report.tasks) >= per_library or report.tried >= max_tries:
                break
            if (mutation.path, mutation.line) in used_lines:
                continue
            report.tried += 1
            trial = _fresh_copy(pristine, work / f"trial-{report.tried}")
            buggy = mutation.apply(sources[mutation.path])
            (trial / mutation.path).write_text(buggy, encoding="utf-8")
            run = run_suite(trial, layout)
            shutil.rmtree(trial, ignore_errors=True)
            verdict = _verdict(baseline, run)
            if verdict is not None:
                report.rejected[verdict] = report.rejected.get(verdict, 0) + 1
                continue
            used_lines.add((mutation.path, mutation.line))
            task = make_task(name, version, snapshot, pristine, layout, mutation, sources[mutation.path], buggy,
                             baseline, run)
            report.tasks.append(task)
            log(f"{requirement}: task {task['instance_id']}: {len(task['FAIL_TO_PASS'])} failing, "
                f"{len(task['PASS_TO_PASS'])} passing ({mutation.kind})")


def _fetch(requirement: str, directory: Path) -> Path:
    """A local ``.tar.gz`` as it is, or ``NAME==VERSION`` from PyPI."""
    if requirement.endswith(".tar.gz"):
        path = Path(requirement)
        if not path.is_file():
            raise RepositoryError(f"{requirement}: no such source distribution")
        return path
    if "==" not in requirement:
        raise RepositoryError(f"{requirement}: give an exact version (NAME==VERSION) so tasks can be rebuilt")
    return download_sdist(requirement, directory)


def _fresh_copy(pristine: Path, target: Path) -> Path:
    shutil.copytree(pristine, target, symlinks=True)
    return target


def _verdict(baseline: SuiteRun, run: SuiteRun) -> str | None:
    """Why a mutation makes no task (None: it does)."""
    if run.result is not None and run.result.timed_out:
        return "the suite timed out"
    if not run.outcomes:
        return "the suite did not run"
    if not baseline.passed & run.broken:
        return "no test fails"
    if not baseline.passed & run.passed:
        return "every test fails"
    return None


def make_task(name: str, version: str, snapshot: Path, pristine: Path, layout: Layout, mutation: Mutation,
              original: str, buggy: str, baseline: SuiteRun, run: SuiteRun) -> dict:
    fail_to_pass = sorted(baseline.passed & run.broken)
    pass_to_pass = sorted(baseline.passed & run.passed)
    patch = fix_patch(mutation.path, buggy, original)
    digest = sha256(snapshot)
    return {
        "instance_id": f"{name}-{version}-{hashlib.sha256(patch.encode()).hexdigest()[:10]}",
        "repo": f"pypi/{name}",
        "base_commit": f"sha256:{digest}",
        "environment_setup_commit": f"sha256:{digest}",
        "version": version,
        "patch": patch,
        "test_patch": "",
        "problem_statement": problem_statement(name, version, layout, fail_to_pass, run.messages),
        "hints_text": "",
        "created_at": "",
        "FAIL_TO_PASS": fail_to_pass,
        "PASS_TO_PASS": pass_to_pass,
        "snapshot": f"{SNAPSHOT_DIR}/{snapshot.name}",
        "snapshot_sha256": digest,
        "root": pristine.name,
        "python_path": layout.python_path,
        "test_paths": layout.test_paths,
        "mutation": mutation.describe(original),
    }


def problem_statement(name: str, version: str, layout: Layout, failing: list[str],
                      messages: dict[str, str]) -> str:
    """A bug report as a user who ran the tests would file it: which tests fail and how. It quotes pytest's
    one-line crash messages only (no traceback, which would point at the changed line)."""
    lines = [f"Some of {name} {version}'s own tests fail.", "",
             f"Running its test suite (`python -m pytest {' '.join(layout.test_paths)}`, with "
             f"`{layout.python_path}` on PYTHONPATH) reports these failures:", ""]
    for test in failing[:STATEMENT_TESTS]:
        message = messages.get(test, "").strip() or "(no message)"
        if len(message) > STATEMENT_MESSAGE_CHARS:
            message = message[:STATEMENT_MESSAGE_CHARS] + " ..."
        lines += [f"- `{test}`", *(f"    {part}" for part in message.splitlines()[:8])]
    if len(failing) > STATEMENT_TESTS:
        lines.append(f"- and {len(failing) - STATEMENT_TESTS} more")
    lines += ["", "The tests are right and must not be changed. Fix the library's code so that these tests pass "
              "again without breaking any other test."]
    return "\n".join(lines)


def write_tasks(reports: list[LibraryReport], output: Path) -> int:
    """The tasks as ``harness.tasks.file`` reads them: one ``{"id", "data"}`` object a line."""
    output.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with output.open("w", encoding="utf-8") as fh:
        for report in reports:
            for task in report.tasks:
                fh.write(json.dumps({"id": task["instance_id"], "data": task}, sort_keys=True) + "\n")
                count += 1
    return count
