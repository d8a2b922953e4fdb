"""The workspace of one coding rollout, as the harness leaves it and the verifier reads it.

``$HARNESSRL_WORKSPACE/snapshot.tar.gz`` is the task's source distribution (the verifier checks it against the
task's ``snapshot_sha256``, which comes from the runner, so a harness cannot swap it) and
``$HARNESSRL_WORKSPACE/repo/<root>/`` is the repository the agent worked in: the snapshot with the task's
``patch`` applied in reverse (the bug), then whatever the agent did.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from harnessrl.swe.repository import RepositoryError, apply_patch, sha256, unpack

SNAPSHOT = "snapshot.tar.gz"
REPO = "repo"


def snapshot_in(workspace: Path, task: dict) -> Path:
    """The workspace's snapshot, checked against the task's digest."""
    snapshot = workspace / SNAPSHOT
    if not snapshot.is_file():
        raise RepositoryError(f"{snapshot} is missing: the harness copies the task's snapshot there")
    if sha256(snapshot) != task["snapshot_sha256"]:
        raise RepositoryError(f"{snapshot} is not the task's snapshot (sha256 differs from snapshot_sha256)")
    return snapshot


def prepare_workspace(task: dict, tasks_dir: Path, workspace: Path) -> Path:
    """Copy the task's snapshot into the workspace and unpack the buggy repository; returns its top folder.
    ``tasks_dir`` is where the tasks file is (``task["snapshot"]`` is relative to it)."""
    workspace.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tasks_dir / task["snapshot"], workspace / SNAPSHOT)
    root = unpack(snapshot_in(workspace, task), workspace / REPO)
    if root.name != task["root"]:
        raise RepositoryError(f"the snapshot's top folder is {root.name}, the task says {task['root']}")
    apply_patch(root, task["patch"], reverse=True)
    return root


def repository_in(workspace: Path, task: dict) -> Path:
    return workspace / REPO / task["root"]
