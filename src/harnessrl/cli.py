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
        command = getattr(importlib.import_module(module_name), attr)
        if not isinstance(command, click.Command):  # a wiring mistake, not user input
            raise TypeError(f"{target} is not a click command")
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="harnessrl")
def main() -> None:
    """Harnessed agentic RL: train a model through the agent harness it is deployed in."""

if __name__ == "__main__":
    main()
