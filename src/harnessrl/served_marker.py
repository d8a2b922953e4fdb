"""The version every vLLM replica of a run must serve, on the checkpoint volume the learner and vLLM share.

The learner's weight sync reaches the replicas that are Ready when it runs. A replica that starts later (its
pod deleted or evicted, its container restarted after a crash or an OOM kill, a replica added by scaling)
starts from the base model and no sync comes until the next step: with full weights it would serve the base
model while its calls were recorded under a trained version, and under LoRA it would answer 404 for the
missing adapter. So before each sync the learner writes this marker (``<checkpointDir>/served.json``), and the
gate in front of each vLLM (``harnessrl vllm-gate``) loads the version it names into a freshly started
server, labels it, and only then lets calls and the learner's control requests through.

Written before the sync, not after: a replica that starts during a sync then loads the version being synced,
and its weight label stays true whichever it loads; the marker never names a version whose checkpoint is not
complete (versions are published by an atomic rename before they are committed).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

MARKER_NAME = "served.json"


@dataclass(frozen=True)
class ServedVersion:
    version: int
    checkpoint: str  # the servable checkpoint's path, as both the learner and vLLM mount it
    lora: bool  # an adapter on the base model (load_lora_adapter), else full weights (reload_weights)


class MarkerError(ValueError):
    """The marker exists but cannot be read as a served version."""


def marker_path(checkpoint_root: str | Path) -> Path:
    return Path(checkpoint_root) / MARKER_NAME


def write_marker(checkpoint_root: str | Path, served: ServedVersion) -> Path:
    """Replace the marker atomically (a reader sees the old or the new one, never a part)."""
    path = marker_path(checkpoint_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=".served-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(served), out)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temp, 0o644)  # vLLM's pods read it under their own uid
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


def read_marker(path: str | Path) -> ServedVersion | None:
    """The version the marker names; None when there is none yet (no version synced so far)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        served = ServedVersion(int(data["version"]), str(data["checkpoint"]), bool(data["lora"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise MarkerError(f"{path} is not a served-version marker ({exc}); the learner rewrites it at its next "
                          "sync") from None
    if served.version < 0:
        raise MarkerError(f"{path} names version {served.version}; versions start at 0")
    return served
