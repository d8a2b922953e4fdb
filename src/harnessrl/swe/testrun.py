"""A library's own test suite, run in a fresh sandbox, read back as an outcome per pytest node id.

Outcomes come from a small plugin (``pytest_outcomes``) rather than from parsing pytest's terminal output:
node ids of parametrized tests hold spaces and dashes, which the summary lines do not delimit.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harnessrl.swe.repository import Layout
from harnessrl.swe.sandbox import SandboxLimits, SandboxResult, in_pod, run_sandboxed

PLUGIN_DIR = "/opt/harnessrl-pytest"
"""Where the outcomes plugin is mounted (read-only, alone) inside the sandbox."""

TEST_LIMITS = SandboxLimits(timeout_s=120.0)


@dataclass
class SuiteRun:
    outcomes: dict[str, str]  # node id -> passed | failed | error | skipped
    messages: dict[str, str] = field(default_factory=dict)  # node id -> its crash's one-line message
    result: SandboxResult | None = None

    @property
    def passed(self) -> set[str]:
        return {test for test, outcome in self.outcomes.items() if outcome == "passed"}

    @property
    def broken(self) -> set[str]:
        return {test for test, outcome in self.outcomes.items() if outcome in ("failed", "error")}

    def why_not_run(self) -> str | None:
        """Why this run says nothing about the tests (it timed out, or pytest never wrote outcomes)."""
        if self.result is not None and self.result.timed_out:
            return f"the test suite passed its {TEST_LIMITS.timeout_s:.0f} s limit"
        if not self.outcomes:
            tail = self.result.output.strip()[-800:] if self.result else ""
            return f"pytest reported no test ({self.result.reason if self.result else 'not run'}): {tail}"
        return None


def run_suite(root: Path, layout: Layout, *, limits: SandboxLimits = TEST_LIMITS) -> SuiteRun:
    """Run the library's tests (``layout.test_paths``) in ``root`` in a fresh sandbox."""
    plugin = Path(__file__).with_name("pytest_outcomes.py")
    with tempfile.TemporaryDirectory(prefix="harnessrl-outcomes-") as out:
        report = Path(out) / "outcomes.json"
        plugin_dir, readable = PLUGIN_DIR, {plugin: f"{PLUGIN_DIR}/{plugin.name}"}
        if in_pod():  # nothing to bind in a pod: the plugin, alone, is copied beside the report instead
            plugin_dir, readable = f"{out}/plugin", {}
            Path(plugin_dir).mkdir()
            shutil.copyfile(plugin, Path(plugin_dir) / plugin.name)
        env = {"PYTHONPATH": f"{(root / layout.python_path).resolve()}:{plugin_dir}",
               "HARNESSRL_OUTCOMES": str(report)}
        command = ["python", "-m", "pytest", "-p", "pytest_outcomes", "-p", "no:cacheprovider", "-q",
                   "--tb=no", "--no-header", "-rN", "--rootdir", str(root), *layout.test_paths]
        result = run_sandboxed(command, writable=[root, Path(out)], chdir=root, env=env, limits=limits,
                               readable=readable)
        data = json.loads(report.read_text()) if report.is_file() else {"outcomes": {}, "messages": {}}
    return SuiteRun(data["outcomes"], data["messages"], result)
