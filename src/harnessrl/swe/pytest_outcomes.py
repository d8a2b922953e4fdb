"""A pytest plugin, loaded inside the sandbox (``-p pytest_outcomes``), that writes each test's outcome and, for
a failure, the one-line message of its crash to the JSON file named by ``HARNESSRL_OUTCOMES``.

A test passed when its call passed and neither its setup nor its teardown failed; a skip or an expected failure
is "skipped"; a failed call is "failed" and a failed setup or teardown "error", as pytest reports them. A module
that does not even collect is recorded under its own node id as "error".
"""

from __future__ import annotations

import json
import os

_outcomes: dict[str, str] = {}
_messages: dict[str, str] = {}


def _record(nodeid: str, outcome: str, report) -> None:
    if _outcomes.get(nodeid) in (None, "passed"):
        _outcomes[nodeid] = outcome
    if report.failed and nodeid not in _messages:
        crash = getattr(report.longrepr, "reprcrash", None)
        _messages[nodeid] = crash.message if crash is not None else str(report.longrepr)[-2000:]


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        _record(report.nodeid, "failed" if report.when == "call" else "error", report)
    elif report.skipped:
        _record(report.nodeid, "skipped", report)
    elif report.when == "call":
        _record(report.nodeid, "passed", report)


def pytest_collectreport(report) -> None:
    if report.failed:
        _record(report.nodeid, "error", report)


def pytest_sessionfinish(session) -> None:
    path = os.environ.get("HARNESSRL_OUTCOMES")
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"outcomes": _outcomes, "messages": _messages}, fh)
