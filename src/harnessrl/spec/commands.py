"""``harnessrl crd`` and ``harnessrl validate``."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import click

from harnessrl.spec.crd import CRD_PATH, render_crd_yaml
from harnessrl.spec.documents import Document, YamlSyntaxError, is_other_object, load_documents
from harnessrl.spec.problems import format_path, parse_training_run, validate_document
from harnessrl.spec.scope import cluster_only_paths

EXIT_PROBLEMS = 1
EXIT_UNREADABLE = 2


@click.command("crd")
@click.option(
    "--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help=f"Write here (e.g. {CRD_PATH})."
)
@click.option(
    "--check", is_flag=True, help="Do not write; exit 1 when the file at --output is not up to date."
)
def crd_command(output: Path | None, check: bool) -> None:
    """Generate the TrainingRun CustomResourceDefinition from the spec models (stdout without --output)."""
    text = render_crd_yaml()
    if check:
        if output is None:
            raise click.UsageError("--check needs --output PATH: the committed CRD file to compare")
        try:
            current = output.read_text(encoding="utf-8")
        except OSError as error:
            click.echo(
                f"{output}: cannot read: {error.strerror or error} — "
                f"generate it with: harnessrl crd --output {output}"
            )
            sys.exit(EXIT_PROBLEMS)
        if current != text:
            click.echo(f"{output}: stale — regenerate it with: harnessrl crd --output {output}")
            sys.exit(EXIT_PROBLEMS)
        click.echo(f"{output}: up to date")
        return
    if output is None:
        click.echo(text, nl=False)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so a failed write never leaves a half-written CRD behind.
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=output.parent, delete=False, suffix=".tmp"
    ) as tmp:
        tmp.write(text)
    os.replace(tmp.name, output)
    click.echo(f"wrote {output}")


def _read(name: str) -> str:
    if name == "-":
        return click.get_text_stream("stdin").read()
    return Path(name).read_text(encoding="utf-8")


def _document_lines(name: str, document: Document) -> list[str]:
    lines = [
        f"{name}:{again}: {format_path(loc)}: duplicate key (first on line {first}); "
        "YAML keeps only the last — keep one"
        for loc, first, again in document.duplicate_keys
    ]
    located = [(document.line_of(problem.loc), str(problem)) for problem in validate_document(document.data)]
    # In file order, so the output reads top to bottom like the file (sorted() keeps ties in rule order).
    lines += [f"{name}:{line}: {text}" for line, text in sorted(located, key=lambda item: item[0])]
    return lines


def validate_file(name: str) -> tuple[int, list[str]]:
    """The exit code and the output lines for one file (``-`` is standard input)."""
    try:
        text = _read(name)
    except UnicodeDecodeError:
        return EXIT_UNREADABLE, [f"{name}: cannot read: not UTF-8 text"]
    except OSError as error:
        return EXIT_UNREADABLE, [f"{name}: cannot read: {error.strerror or error}"]
    try:
        documents = load_documents(text)
    except YamlSyntaxError as error:
        where = f"{name}:{error.line}:{error.column}" if error.line is not None else name
        return EXIT_PROBLEMS, [f"{where}: malformed YAML: {error.problem} — fix the YAML syntax there"]
    ours = [document for document in documents if not is_other_object(document.data)]
    if not ours:
        skipped = len(documents) - len(ours)
        detail = f" ({skipped} other Kubernetes object(s) skipped)" if skipped else ""
        return EXIT_PROBLEMS, [f"{name}: no TrainingRun in this file{detail} — add one"]
    lines = [line for document in ours for line in _document_lines(name, document)]
    if lines:
        return EXIT_PROBLEMS, lines
    skipped = len(documents) - len(ours)
    ok = [f"{name}: OK" + (f" ({skipped} other Kubernetes object(s) skipped)" if skipped else "")]
    cluster_only = [path for document in ours for path in cluster_only_paths(parse_training_run(document.data).spec)]
    if cluster_only:
        ok.append(f"{name}: only on a cluster (harnessrl run leaves them alone): {', '.join(cluster_only)}")
    # Rules only a cluster needs, for a file written for one (it sets fields only a cluster reads): harnessrl
    # run accepts it, the API server would not.
    for document in ours if cluster_only else ():
        for problem in validate_document(document.data, cluster=True):
            ok.append(f"{name}:{document.line_of(problem.loc)}: a cluster refuses it: {problem}")
    return 0, ok


@click.command("validate")
@click.argument("files", nargs=-1, required=True)
def validate_command(files: tuple[str, ...]) -> None:
    """Check TrainingRun YAML files; print OK or every problem as FILE:LINE: FIELD: what to do.

    Exit status: 0 all valid, 1 a problem in some file, 2 a file could not be read.
    """
    worst = 0
    for name in files:
        code, lines = validate_file(name)
        for line in lines:
            click.echo(line)
        worst = max(worst, code)
    sys.exit(worst)
