"""``harnessrl run`` and ``harnessrl status``."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command("run")
@click.argument("spec_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the run keeps its store, logs, checkpoints and reward curve. [default: runs/NAME]")
@click.option("--store", "store_url", metavar="URL",
              help="Trace store URL (postgresql+psycopg://...); default: spec.store, i.e. SQLite in the run dir.")
@click.option("--openai-base-url", metavar="URL", help="Use this running vLLM server instead of starting one.")
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Model directory to start from, instead of spec.model.path.")
@click.option("--steps", type=click.IntRange(min=1), help="Learner steps, instead of spec.learner.steps.")
@click.option("--no-live", is_flag=True, help="Print a progress line per change instead of a live line.")
def run_command(spec_file: Path, run_dir: Path | None, store_url: str | None, openai_base_url: str | None,
                model_dir: Path | None, steps: int | None, no_live: bool) -> None:
    """Run a TrainingRun on this machine: vLLM, capture proxy, harness processes and the learner."""
    from harnessrl.local.runner import LocalRun, LocalRunOptions, RunError
    from harnessrl.spec.commands import validate_file
    from harnessrl.spec.documents import is_other_object, load_documents
    from harnessrl.spec.problems import parse_training_run
    from harnessrl.store import StoreError

    code, lines = validate_file(str(spec_file))
    if code:
        for line in lines:
            click.echo(line, err=True)
        sys.exit(code)
    documents = [d for d in load_documents(spec_file.read_text()) if not is_other_object(d.data)]
    if len(documents) != 1:
        raise click.UsageError(f"{spec_file} holds {len(documents)} TrainingRuns; `harnessrl run` takes one")
    run = parse_training_run(documents[0].data)
    options = LocalRunOptions(spec_path=spec_file, run_dir=run_dir, store_url=store_url,
                              openai_base_url=openai_base_url, model_dir=model_dir, steps=steps, live=not no_live)
    try:
        sys.exit(LocalRun(run, options).execute())
    except (RunError, StoreError) as exc:
        raise click.ClickException(str(exc)) from None


@click.command("status")
@click.argument("source", metavar="RUN_DIR_OR_STORE")
@click.option("--run", "run_name", help="Run name, with a store URL (a run directory names its own).")
def status_command(source: str, run_name: str | None) -> None:
    """Print a run's progress, per-step rewards and rollout totals from its store: a `harnessrl run`
    directory, or the store URL of a cluster's runs with --run NAME."""
    from rich.console import Console

    from harnessrl.local.report import progress_line, run_and_store, summarize, summary_table
    from harnessrl.store import StoreError, TraceStore

    try:
        run, url, _ = run_and_store(source, run_name)
        store = TraceStore.connect(url)
        summary = summarize(store, run)
        store.close()
    except (ValueError, StoreError) as exc:
        raise click.ClickException(str(exc)) from None
    Console().print(summary_table(summary))
    click.echo(progress_line(summary))
