"""``harnessrl export``: one policy version of a run as a model directory transformers and vLLM load.

A run's checkpoints are working files: ``versions/vNNNNNN`` holds what the replicas load, pruned as training
goes on (``keepCheckpoints``), and for a LoRA run only the adapter, whose base model path is whatever the
learner was given. Export turns one *committed* version (the store says which exist, not the directory
listing, which may hold an uncommitted leftover) into a self-contained directory elsewhere:

* full-weight version: the weights, config and tokenizer, copied;
* LoRA version: the adapter in PEFT format (what vLLM's ``--enable-lora``/``--lora-modules`` and
  ``load_lora_adapter`` accept, and what ``AutoModelForCausalLM.from_pretrained`` loads with peft installed),
  its ``base_model_name_or_path`` made absolute, plus the tokenizer;
* LoRA version with ``merge``: base + adapter merged into plain full weights (no peft needed to load it).

The directory is written under a temporary name beside ``--output`` and renamed into place, so an
interrupted export never leaves something that looks like a model. ``harnessrl-export.json`` in it records
the run, version and source.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import click

from harnessrl.store import TraceStore
from harnessrl.store.engine import parse_url, safe_url
from harnessrl.store.evaluations import evaluation_results
from harnessrl.store.learner_ledger import LearnerLedger, VersionInfo
from harnessrl.trainer.checkpoint import CheckpointDir

ADAPTER_CONFIG = "adapter_config.json"
PROVENANCE = "harnessrl-export.json"
Kind = Literal["full", "lora-adapter", "merged"]


class ExportError(ValueError):
    """Export cannot proceed; the message is one line naming the version, flag or path and the fix."""


@dataclass(frozen=True)
class ExportSource:
    """Where one run's versions are: its store (which versions are committed) and, when known, its
    checkpoint directory (where their files are now, even if the run directory was moved since)."""

    store_url: str
    run: str
    checkpoints: Path | None


@dataclass(frozen=True)
class ExportResult:
    version: int
    kind: Kind
    output: Path
    source: Path
    base_model: Path | None


# -- which version --------------------------------------------------------------------------------------------


def evaluation_scores(ledger: LearnerLedger) -> dict[int, tuple[float, float]]:
    """Each completely evaluated version's score, read from the store (``spec.evaluation``): what
    ``--version best`` ranks. The score is the pass rate, then the mean reward (``EvaluationResult.score``);
    a round still running has none yet."""
    return {r.version: r.score for r in evaluation_results(ledger.store, ledger.run) if r.complete}


def rank_versions(scores: Mapping[int, Any], exportable: Iterable[int]) -> list[int]:
    """Versions that have a score and are still on disk, best first (a tie goes to the newer version,
    which trained on more)."""
    present = set(exportable)
    return sorted((v for v in scores if v in present), key=lambda v: (scores[v], v), reverse=True)


def parse_version(value: str) -> int | Literal["latest", "best"]:
    """``--version``: a version number, ``latest`` or ``best``."""
    text = value.strip().lower()
    if text in ("latest", "best"):
        return text  # type: ignore[return-value]
    number = text.removeprefix("v")
    if not number.isdigit():
        raise ExportError(f"--version {value!r}: give a version number (e.g. 3), latest or best")
    return int(number)


def version_dir(info: VersionInfo, checkpoints: Path | None) -> Path | None:
    """The directory holding ``info``'s files now, or None when they are gone (pruned) or never written.

    The checkpoint directory wins over the stored path, which is where the learner wrote it and is stale once
    the run directory is moved. Version 0 of a full-weight run is the base model, found by its stored path.
    """
    candidates = [CheckpointDir(checkpoints).version_path(info.version)] if checkpoints is not None else []
    candidates.append(Path(info.checkpoint_path))
    for path in candidates:
        if (path / "config.json").is_file() or (path / ADAPTER_CONFIG).is_file():
            return path
    return None


def choose_version(ledger: LearnerLedger, source: ExportSource,
                   wanted: int | Literal["latest", "best"]) -> tuple[int, Path]:
    """The version to export and its directory, or an :class:`ExportError` naming what exists."""
    versions = ledger.versions()
    if not versions:
        raise ExportError(f"run {source.run!r} has no policy versions in the store {safe_url(source.store_url)}; "
                          "check the run name (--run) or the store")
    on_disk = {info.version: path for info in versions if (path := version_dir(info, source.checkpoints))}
    listing = _listing(on_disk)
    if wanted == "best":
        scores = evaluation_scores(ledger)
        ranked = rank_versions(scores, on_disk)
        if not ranked:
            why = (f"has evaluation results only for versions no longer on disk ({', '.join(map(str, sorted(scores)))})"
                   if scores
                   else "has no evaluation results yet (set spec.evaluation, and let a round finish)")
            raise ExportError(f"--version best: run {source.run!r} {why}; use --version latest or a number: {listing}")
        return ranked[0], on_disk[ranked[0]]
    version = ledger.committed_version() if wanted == "latest" else wanted
    if version in on_disk:
        return version, on_disk[version]
    where = f" under {CheckpointDir(source.checkpoints).versions}" if source.checkpoints is not None else ""
    if any(info.version == version for info in versions):
        why = f"was pruned{where} (keepCheckpoints keeps only the newest versions)"
    else:
        why = f"was never committed (the newest is {versions[-1].version})"
    raise ExportError(f"version {version} of run {source.run!r} {why}; versions that can be exported: {listing}")


def _listing(on_disk: Mapping[int, Path]) -> str:
    return ", ".join(str(v) for v in sorted(on_disk)) or "none (every checkpoint was deleted)"


# -- writing ---------------------------------------------------------------------------------------------------


def export_version(source: ExportSource, wanted: int | Literal["latest", "best"], output: Path, *,
                   merge: bool = False, force: bool = False, base_model: Path | None = None) -> ExportResult:
    """Export one committed version of ``source``'s run to ``output`` (see the module docstring)."""
    store = _open_store(source.store_url)
    try:
        version, path = choose_version(LearnerLedger(store, source.run), source, wanted)
    finally:
        store.close()
    lora = (path / ADAPTER_CONFIG).is_file()
    if merge and not lora:
        raise ExportError(f"--merge: version {version} of run {source.run!r} holds full weights, not a LoRA adapter; "
                          "there is nothing to merge: drop --merge")
    base = _adapter_base(path, base_model) if lora else None
    output = output.resolve()
    _check_output(output, force, [p for p in (path, base) if p is not None])
    kind: Kind = "merged" if merge else ("lora-adapter" if lora else "full")
    output.parent.mkdir(parents=True, exist_ok=True)
    temp = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        if kind == "full":
            shutil.copytree(path, temp)  # real copies, never links into the checkpoint tree
            if not _has_tokenizer(temp):
                raise ExportError(f"version {version}: {path} has no tokenizer files; copy the base model's "
                                  "tokenizer into it and export again")
        else:
            assert base is not None
            temp.mkdir()
            if kind == "merged":
                _write_merged(base, path, temp)
            else:
                _write_adapter(base, path, temp)
            _save_tokenizer(base, temp)
        provenance = {"run": source.run, "version": version, "kind": kind, "checkpoint": str(path),
                      "base_model": str(base) if base else None, "store": safe_url(source.store_url)}
        (temp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        if output.exists():  # only reached with --force (or an empty directory)
            shutil.rmtree(output)
        temp.rename(output)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return ExportResult(version, kind, output, path, base)


def _open_store(url: str) -> TraceStore:
    """The run's store, refusing one that is not a harnessrl store (opening a missing SQLite file would
    create it empty, and every query would then fail with a database traceback)."""
    from harnessrl.store.migrate import current_revision

    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and not Path(parsed.database).is_file():
        raise ExportError(f"store {safe_url(url)}: {parsed.database} does not exist; give the run directory or "
                          "the store URL `harnessrl run` printed")
    store = TraceStore.connect(url)
    if current_revision(store.engine) is None:
        store.close()
        raise ExportError(f"store {safe_url(url)} has no harnessrl tables; give the run's own store")
    return store


def _adapter_base(adapter: Path, override: Path | None) -> Path:
    """The base model a LoRA adapter applies to: ``--base-model``, else the adapter's own record of it."""
    if override is not None:
        if not (override / "config.json").is_file():
            raise ExportError(f"--base-model {override}: no config.json there; give the Hugging Face model directory "
                              "the run trained from")
        return override.resolve()
    recorded = json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not recorded or not (Path(recorded) / "config.json").is_file():
        raise ExportError(f"{adapter / ADAPTER_CONFIG}: base_model_name_or_path {recorded!r} is not a model "
                          "directory here; pass --base-model DIR (the model the run trained from)")
    return Path(recorded).resolve()


def _check_output(output: Path, force: bool, sources: list[Path]) -> None:
    for source in sources:
        source = source.resolve()
        if output == source or output.is_relative_to(source) or source.is_relative_to(output):
            raise ExportError(f"--output {output} overlaps {source}, which the export reads; choose a directory "
                              "outside the run's checkpoints and the base model")
    if output.exists() and not output.is_dir():
        raise ExportError(f"--output {output} is a file; choose a directory")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise ExportError(f"--output {output} exists and is not empty; choose a new directory, or pass --force to "
                          "replace its contents")


def _write_adapter(base: Path, adapter: Path, target: Path) -> None:
    """The adapter files as they are, with ``base_model_name_or_path`` pointing at the absolute base path
    (the learner records the path it was given, which may be relative to its working directory)."""
    shutil.copytree(adapter, target, dirs_exist_ok=True)
    config = json.loads((target / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = str(base)
    (target / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _write_merged(base: Path, adapter: Path, target: Path) -> None:
    """Base + adapter as plain weights: merged in fp32, saved in the base model's own dtype."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = AutoConfig.from_pretrained(base).dtype or torch.float32  # a torch.dtype, or its name in old configs
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.to(dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype)))
    merged.save_pretrained(target, safe_serialization=True)


def _save_tokenizer(base: Path, target: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(base).save_pretrained(target)


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


# -- the command ----------------------------------------------------------------------------------------------


def resolve_source(target: str, run: str | None, checkpoints: Path | None) -> ExportSource:
    """A run directory (``runs/NAME``: its ``run.json`` names the store and run, ``checkpoints/`` beside it) or a
    store URL with ``--run`` (and ``--checkpoints`` when the stored checkpoint paths moved)."""
    from harnessrl.local.report import run_and_store

    try:
        name, url, run_dir = run_and_store(target, run)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    return ExportSource(url, name, checkpoints or (run_dir / "checkpoints" if run_dir else None))


@click.command("export")
@click.argument("source", metavar="RUN_DIR_OR_STORE")
@click.option("--version", "version", default="latest", show_default=True,
              help="Policy version: a number, latest (the newest committed) or best (by evaluation score).")
@click.option("--output", "output", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory to write (must not exist or be empty, unless --force).")
@click.option("--merge", is_flag=True, help="LoRA runs: write base + adapter merged into full weights.")
@click.option("--force", is_flag=True, help="Replace the contents of a non-empty --output.")
@click.option("--run", "run", help="Run name, with a store URL (a run directory names its own).")
@click.option("--checkpoints", type=click.Path(file_okay=False, path_type=Path),
              help="The run's checkpoint directory [default: RUN_DIR/checkpoints; with a store URL, the stored paths].")
@click.option("--base-model", type=click.Path(file_okay=False, path_type=Path),
              help="LoRA runs: the base model directory, when the adapter's recorded path is gone.")
def export_command(source: str, version: str, output: Path, merge: bool, force: bool, run: str | None,
                   checkpoints: Path | None, base_model: Path | None) -> None:
    """Write one policy version of a run as a model directory transformers and vLLM load."""
    from harnessrl.store import StoreError

    try:
        wanted = parse_version(version)
        result = export_version(resolve_source(source, run, checkpoints), wanted, output, merge=merge, force=force,
                                base_model=base_model)
    except (ValueError, StoreError) as exc:  # ExportError, or read_run_file's "not a run directory"
        raise click.ClickException(str(exc)) from None
    what = {"full": "full weights", "lora-adapter": f"LoRA adapter (base model {result.base_model})",
            "merged": "base model + LoRA adapter merged"}[result.kind]
    click.echo(f"exported version {result.version} ({what}) to {result.output}")
