"""The learner Job's command as torchrun reads it: torchrun parses its own options with argparse, which takes
any prefix of them for an abbreviation, so a `harnessrl learn` option after the module name can be swallowed or
refused before the learner starts. On the real node `--run NAME` crash-looped every learner pod ("ambiguous
option: --run could match --run-path, --run_path"). This parses the rendered command with torchrun's own
parser and checks that every argument reaches `harnessrl learn` unchanged, and that `harnessrl learn` accepts
them."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from torch.distributed.run import get_args_parser

from harnessrl.operator.render_learner import learner_command, learner_env
from harnessrl.operator.config import OperatorConfig
from harnessrl.spec.problems import parse_training_run
from test_render import CLUSTER, MINIMAL


@pytest.mark.parametrize("doc", [MINIMAL, CLUSTER], ids=["minimal", "cluster"])
def test_torchrun_passes_every_argument_to_the_learner(doc: dict) -> None:
    run = parse_training_run(doc)
    # kubelet expands $(VAR) from the container's env; NODE_RANK is the pod's completion index.
    values = {e["name"]: e.get("value", "0") for e in learner_env(run, OperatorConfig(store_url="postgresql+psycopg://u:p@db:5432/h"))}
    command = [re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], part) for part in learner_command(run, OperatorConfig())]
    assert command[0] == "torchrun"
    module_at = command.index("-m")
    args = get_args_parser().parse_args(command[1:])  # exits (SystemExit) on an ambiguous or unknown option
    assert args.module and args.training_script == "harnessrl.cli"
    assert args.training_script_args == command[module_at + 2:]
    assert args.training_script_args[0] == "learn"


def test_the_learner_takes_its_run_name_from_the_spec_file(tmp_path) -> None:
    """With no --run, `harnessrl learn --spec FILE` reads the run name from the file's metadata.name."""
    from harnessrl.trainer.commands import learn_command

    result = CliRunner().invoke(learn_command, ["--help"])
    assert result.exit_code == 0
    assert "default with --spec: its metadata.name" in " ".join(result.output.split())
