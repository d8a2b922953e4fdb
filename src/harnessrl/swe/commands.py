"""``harnessrl swe``: coding tasks from real libraries, their verifier, and the sandbox agents run commands in."""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import click

DEFAULT_LIBRARIES = ("inflection==0.5.1", "cachetools==8.0.2", "semantic_version==2.10.0")


@click.group("swe")
def swe_group() -> None:
    """Coding-agent tasks: generate them, verify a rollout, run a command in the sandbox."""


@swe_group.command("tasks")
@click.option("--library", "libraries", multiple=True, metavar="NAME==VERSION|SDIST",
              help=f"A pure-Python library on PyPI whose sdist ships its tests, or a local NAME-VERSION.tar.gz "
                   f"(repeat). [default: {', '.join(DEFAULT_LIBRARIES)}]")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The tasks file (JSONL); the libraries' sdists go to repos/ beside it.")
@click.option("--per-library", type=click.IntRange(min=1), default=5, show_default=True,
              help="Tasks to keep per library.")
@click.option("--max-tries", type=click.IntRange(min=1), default=40, show_default=True,
              help="Mutations to test per library at most.")
@click.option("--seed", type=int, default=0, show_default=True, help="Fixes which mutations are tried, in order.")
def tasks_command(libraries: tuple[str, ...], output: Path, per_library: int, max_tries: int, seed: int) -> None:
    """Write coding tasks: bugs put into libraries' code that their own tests catch (SWE-bench fields)."""
    from harnessrl.swe.sandbox import SandboxUnavailable
    from harnessrl.swe.tasks import generate_tasks, write_tasks

    started = time.monotonic()
    try:
        reports = generate_tasks(libraries or DEFAULT_LIBRARIES, output.parent, seed=seed,
                                 per_library=per_library, max_tries=max_tries,
                                 log=lambda line: click.echo(line, err=True))
    except SandboxUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    count = write_tasks(reports, output)
    for report in reports:
        kinds = Counter(task["mutation"]["kind"] for task in report.tasks)
        rejected = ", ".join(f"{n} {why}" for why, n in sorted(report.rejected.items())) or "none"
        detail = report.error or (f"{report.tried} mutations tried, rejected: {rejected}; "
                                  f"kinds: {dict(sorted(kinds.items()))}")
        click.echo(f"{report.requirement}: {len(report.tasks)} tasks in {report.seconds:.0f} s ({detail})")
    click.echo(f"{count} tasks written to {output} in {time.monotonic() - started:.0f} s")
    if count == 0:
        sys.exit(1)


@swe_group.command("verify")
def verify_command() -> None:
    """Score a rollout's repository (spec.harness.verifier): the task's tests in a fresh sandbox, then POST the
    reward with the verifier's token. Reads HARNESSRL_TASK_FILE, HARNESSRL_WORKSPACE, HARNESSRL_REWARD_URL and
    HARNESSRL_REWARD_TOKEN."""
    from harnessrl.swe.repository import RepositoryError
    from harnessrl.swe.verifier import verify_from_environment

    try:
        sys.exit(verify_from_environment())
    except (RepositoryError, KeyError) as exc:
        raise click.ClickException(f"cannot verify: {exc}") from exc


@swe_group.command("sandbox", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--timeout", type=float, default=60.0, show_default=True,
              help="Seconds before everything in the sandbox is killed.")
@click.option("--memory-mb", type=int, default=2048, show_default=True, help="Address space per process.")
@click.option("--max-processes", type=int, default=256, show_default=True)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def sandbox_command(timeout: float, memory_mb: int, max_processes: int, args: tuple[str, ...]) -> None:
    """Run a command in the sandbox, taking bubblewrap's calling convention so an agent's bubblewrap
    environment can use it as its executable: leading ``--bind SRC DEST`` (read-write), ``--chdir DIR`` and
    ``--setenv NAME VALUE`` options, then the command."""
    from harnessrl.swe.sandbox import SandboxLimits, run_sandboxed

    writable, chdir, env, rest = _bwrap_options(list(args))
    if not rest:
        raise click.UsageError("no command given")
    result = run_sandboxed(rest, writable=writable, chdir=chdir, env=env,
                           limits=SandboxLimits(timeout_s=timeout, memory_bytes=memory_mb << 20,
                                                max_processes=max_processes))
    sys.stdout.write(result.output)
    if result.timed_out:
        sys.stdout.write(f"\n[harnessrl sandbox: killed after {timeout:.0f} s, the command's time limit]\n")
        sys.exit(124)
    sys.exit(result.returncode if result.returncode >= 0 else 128 - result.returncode)


def _bwrap_options(args: list[str]) -> tuple[list[Path], Path | None, dict[str, str], list[str]]:
    writable: list[Path] = []
    chdir: Path | None = None
    env: dict[str, str] = {}
    while args and args[0] in ("--bind", "--chdir", "--setenv", "--"):
        option = args.pop(0)
        if option == "--":
            break
        if option == "--bind":
            source, target = args.pop(0), args.pop(0)
            if Path(source).resolve() != Path(target).resolve():
                raise click.UsageError(f"--bind {source} {target}: a folder is bound at its own path only")
            writable.append(Path(source))
        elif option == "--chdir":
            chdir = Path(args.pop(0))
        else:
            name = args.pop(0)
            env[name] = args.pop(0)
    return writable, chdir, env, args
