"""Versioned checkpoints on disk: what vLLM loads, what the learner resumes from, and nothing half-written.

Layout under the run's checkpoint directory (a shared volume when the learner spans nodes or vLLM runs in
other pods)::

    versions/v000012/   HF safetensors + config + tokenizer (or a LoRA adapter): what replicas load
    engine/v000012/     DeepSpeed optimizer/engine state, one shard per rank: what a restarted learner loads

Both are written under a temporary name and renamed into place, so a directory with a final name is always
complete. A final name is *not* proof the version counts: the store is. A version counts once its step is
committed there; anything newer on disk is a leftover of a learner killed between save and commit and is
discarded on start (:meth:`CheckpointDir.discard_after`), then written again when the step is redone.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harnessrl.trainer.engine import PolicyEngine

VERSION_RE = re.compile(r"^v(\d{6,})$")
TMP_PREFIX = ".tmp-"


def version_name(version: int) -> str:
    if version < 0:
        raise ValueError(f"version: {version} is negative; policy versions start at 0")
    return f"v{version:06d}"


class CheckpointDir:
    """The checkpoint tree of one run. Only rank 0 renames and deletes; every rank may write engine shards."""

    def __init__(self, root: str | Path, keep_last: int = 3, keep_engine_states: int = 1) -> None:
        if keep_last < 1 or keep_engine_states < 1:
            raise ValueError("keep_last and keep_engine_states must be >= 1: the newest version is always kept")
        self.root = Path(root)
        self.versions = self.root / "versions"
        self.engine = self.root / "engine"
        self.keep_last = keep_last
        self.keep_engine_states = keep_engine_states

    def version_path(self, version: int) -> Path:
        return self.versions / version_name(version)

    def engine_tag(self, version: int) -> str:
        return version_name(version)

    def has_engine_state(self, version: int) -> bool:
        return (self.engine / self.engine_tag(version)).is_dir()

    def make_dirs(self) -> None:
        self.versions.mkdir(parents=True, exist_ok=True)
        self.engine.mkdir(parents=True, exist_ok=True)

    # -- writing -----------------------------------------------------------------------------------------------

    def temp_path(self, parent: Path, version: int) -> Path:
        """A fresh temporary name beside the final one (same filesystem, so the rename is atomic)."""
        return parent / f"{TMP_PREFIX}{version_name(version)}-{uuid.uuid4().hex[:8]}"

    def publish(self, temp: Path, parent: Path, version: int) -> Path:
        """Move a completely written ``temp`` to its final name, replacing an uncommitted leftover."""
        final = parent / version_name(version)
        if final.exists():
            shutil.rmtree(final)
        _fsync_tree(temp)
        os.rename(temp, final)
        _fsync_dir(parent)
        return final

    def engine_temp_tag(self, version: int) -> str:
        """The engine state's temporary tag: the same name on every rank (ranks write into one directory)."""
        return f"{TMP_PREFIX}{version_name(version)}"

    def write_version(self, version: int, write: Callable[[Path], None]) -> Path:
        """Write the servable checkpoint of ``version`` with ``write(tmpdir)`` and publish it atomically."""
        self.make_dirs()
        temp = self.temp_path(self.versions, version)
        temp.mkdir()
        try:
            write(temp)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        return self.publish(temp, self.versions, version)

    # -- cleaning ----------------------------------------------------------------------------------------------

    def listed(self, parent: Path) -> list[int]:
        if not parent.is_dir():
            return []
        found = (VERSION_RE.match(p.name) for p in parent.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def discard_after(self, committed: int) -> list[Path]:
        """Remove every version newer than ``committed`` and every temporary left by a crash."""
        removed: list[Path] = []
        for parent in (self.versions, self.engine):
            if not parent.is_dir():
                continue
            for path in parent.iterdir():
                match = VERSION_RE.match(path.name)
                if path.name.startswith(TMP_PREFIX) or (match and int(match.group(1)) > committed):
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                    removed.append(path)
        return removed

    def prune(self, committed: int, spare: Iterable[int] = ()) -> list[Path]:
        """Keep the newest ``keep_last`` servable versions and ``keep_engine_states`` engine states, and the
        servable versions in ``spare`` whatever their age: the best-evaluated version (what ``harnessrl export
        --version best`` exports) and versions whose evaluation is still running."""
        removed: list[Path] = []
        spared = set(spare)
        for parent, keep in ((self.versions, self.keep_last), (self.engine, self.keep_engine_states)):
            old = [v for v in self.listed(parent) if v <= committed][:-keep]
            for version in old:
                if parent == self.versions and version in spared:
                    continue
                path = parent / version_name(version)
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed


def save_checkpoint(engine: PolicyEngine, ckpt: CheckpointDir, version: int) -> Path:
    """Write ``version``'s servable weights and engine state, each published atomically. Collective.

    The servable directory comes first: once the engine state exists too, the step can be committed.
    """
    import torch.distributed as dist

    main = engine.dist.is_main
    holder: list[Path | None] = [None]
    if main:
        ckpt.make_dirs()
        holder[0] = ckpt.temp_path(ckpt.versions, version)
        holder[0].mkdir()
    dist.broadcast_object_list(holder, src=0)
    temp = holder[0]
    assert temp is not None
    engine.save_pretrained(temp)
    if main:
        ckpt.publish(temp, ckpt.versions, version)
        stale = ckpt.engine / ckpt.engine_temp_tag(version)
        if stale.exists():
            shutil.rmtree(stale)
    dist.barrier()
    engine.save_engine_state(ckpt.engine, ckpt.engine_temp_tag(version))
    dist.barrier()
    if main:
        ckpt.publish(ckpt.engine / ckpt.engine_temp_tag(version), ckpt.engine, version)
    dist.barrier()
    return ckpt.version_path(version)


def restore_checkpoint(engine: PolicyEngine, ckpt: CheckpointDir, version: int) -> str:
    """Bring the engine to committed ``version``: weights and optimizer when the engine state is there.

    Returns how it was restored ("base", "engine-state" or "weights-only"). Version 0 is the base model the
    engine was built from. Without engine state (pruned, or a checkpoint copied in by hand) the published
    weights are loaded and the optimizer starts fresh, which is logged by the caller. Collective.
    """
    if version == 0:
        return "base"
    if ckpt.has_engine_state(version):
        engine.load_engine_state(ckpt.engine, ckpt.engine_tag(version))
        return "engine-state"
    path = ckpt.version_path(version)
    if not path.is_dir():
        raise FileNotFoundError(
            f"committed version {version} has neither {path} nor engine state under {ckpt.engine}; restore the "
            "checkpoint directory, or point --output at the run's checkpoint directory"
        )
    engine.load_published(path)
    return "weights-only"


def _fsync_tree(path: Path) -> None:
    """Flush the files before the rename, so a crash after it cannot leave a final name over empty files."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
