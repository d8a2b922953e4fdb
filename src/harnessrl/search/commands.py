"""``harnessrl search``: the search example's corpus and questions, and its verifier."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click


@click.group("search")
def search_group() -> None:
    """Search-agent tasks: generate a corpus with multi-hop questions, verify a rollout's answer."""


@search_group.command("tasks")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The tasks file (JSONL); the corpus goes to corpus.jsonl beside it.")
@click.option("--count", type=click.IntRange(min=1), default=32, show_default=True, help="Questions to write.")
@click.option("--people", type=click.IntRange(min=1), default=60, show_default=True,
              help="People in the corpus (two questions each).")
@click.option("--seed", type=int, default=0, show_default=True, help="Fixes the corpus and the questions chosen.")
def tasks_command(output: Path, count: int, people: int, seed: int) -> None:
    """Write two-hop questions over an invented corpus (deterministic under --seed)."""
    from harnessrl.search.tasks import write_example

    started = time.monotonic()
    try:
        documents, tasks = write_example(output, seed, count, people)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--count") from exc
    click.echo(f"{tasks} tasks over {documents} documents written to {output} "
               f"in {time.monotonic() - started:.2f} s")


@search_group.command("verify")
def verify_command() -> None:
    """Score a rollout's answer (spec.harness.verifier): token F1 against the gold answer, then POST the reward
    with the verifier's token. Reads HARNESSRL_TASK_FILE, HARNESSRL_WORKSPACE, HARNESSRL_REWARD_URL and
    HARNESSRL_REWARD_TOKEN."""
    from harnessrl.search.verifier import verify_from_environment

    try:
        sys.exit(verify_from_environment())
    except (KeyError, ValueError) as exc:
        raise click.ClickException(f"cannot verify: {exc}") from exc
