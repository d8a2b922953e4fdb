"""The ``harnessrl`` command.

Each subcommand lives beside the code it drives and is imported only when invoked, so ``harnessrl validate``
does not pay for torch and the proxy image does not need the trainer's dependencies.
"""

from __future__ import annotations

import importlib

import click

# name -> "module:attribute" of a click command. One line per subcommand; keep it sorted.
COMMANDS: dict[str, str] = {
    "crd": "harnessrl.spec.commands:crd_command",
    "db": "harnessrl.store.commands:db_group",
    "export": "harnessrl.trainer.export:export_command",
    "learn": "harnessrl.trainer.commands:learn_command",
    "operator": "harnessrl.operator.commands:operator_command",
    "proxy": "harnessrl.proxy.commands:proxy_command",
    "run": "harnessrl.local.commands:run_command",
    "search": "harnessrl.search.commands:search_group",
    "status": "harnessrl.local.commands:status_command",
    "swe": "harnessrl.swe.commands:swe_group",
    "tiny-model": "harnessrl.tiny_model:tiny_model_command",
    "ui": "harnessrl.ui.commands:ui_command",
    "validate": "harnessrl.spec.commands:validate_command",
    "vllm-gate": "harnessrl.proxy.vllm_gate:gate_command",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name and error.name.split(".")[0] == "harnessrl":
                raise  # our own module missing is a packaging bug, not the environment's choice
            raise MissingDependency(cmd_name, error.name or str(error)) from error
        command = getattr(module, attr)
        if not isinstance(command, click.Command):  # a wiring mistake, not user input
            raise TypeError(f"{target} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each image installs only the extras its own commands need (the operator's has no proxy settings
        library), so ``--help`` lists a command it cannot import as unavailable instead of failing."""
        rows = []
        for name in self.list_commands(ctx):
            try:
                command = self.get_command(ctx, name)
            except MissingDependency as missing:
                rows.append((name, f"(unavailable here: needs {missing.module})"))
                continue
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(formatter.width - 6 - max(map(len, COMMANDS)))))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class MissingDependency(click.ClickException):
    """A subcommand whose dependencies this environment (an image, a venv) was installed without."""

    def __init__(self, command: str, module: str) -> None:
        super().__init__(f"`harnessrl {command}` needs the Python module {module}, which this environment lacks: "
                         "install harnessrl with the extra that provides it (pyproject.toml's "
                         "optional-dependencies), or run the command from the image made for it")
        self.module = module


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="harnessrl")
def main() -> None:
    """Harnessed agentic RL: train a model through the agent harness it is deployed in."""

if __name__ == "__main__":
    main()
