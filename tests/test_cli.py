"""The ``harnessrl`` command group: subcommands imported on use, and an environment installed without a
command's extra (each image has only its own) still answering ``--help``."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from harnessrl import cli


@pytest.fixture
def commands(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    table = dict(cli.COMMANDS)
    table["needs-missing"] = "harnessrl_test_absent_dependency.module:command"
    monkeypatch.setattr(cli, "COMMANDS", table)
    return table


def test_help_lists_a_command_this_environment_cannot_import_as_unavailable(commands: dict[str, str]) -> None:
    result = CliRunner().invoke(cli.main, ["--help"])
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.startswith("  ") and line.split()}
    assert "(unavailable here: needs harnessrl_test_absent_dependency)" in lines["needs-missing"]
    assert "Check TrainingRun YAML files" in lines["validate"]  # an importable command keeps its own short help
    assert set(commands) <= set(lines)


def test_running_it_names_the_missing_module_and_the_way_out(commands: dict[str, str]) -> None:
    result = CliRunner().invoke(cli.main, ["needs-missing", "--flag"])
    assert result.exit_code == 1
    assert "`harnessrl needs-missing` needs the Python module harnessrl_test_absent_dependency" in result.output
    assert "optional-dependencies" in result.output


def test_a_missing_module_of_harnessrl_itself_is_a_packaging_bug_and_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "COMMANDS", {**cli.COMMANDS, "broken": "harnessrl.no_such_module:command"})
    result = CliRunner().invoke(cli.main, ["broken"])
    assert isinstance(result.exception, ModuleNotFoundError)
