"""Fetch the UI's browser assets from the npm registry, pinned by version and integrity, into ``static/vendor``.

Run at build time (``setup.py``'s build step, ``scripts/test.sh``): ``python src/harnessrl/ui/vendor.py``. It
uses the ordinary npm client (``npm pack``) and checks each tarball against the ``integrity`` in ``assets.json``
(the registry's sha512, as a lock file records it) before extracting the files listed there, so a wheel carries
exactly the pinned bytes and the UI never loads anything from a CDN. Standard library only: it runs before the
package is installed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ASSETS = HERE / "assets.json"
VENDOR = HERE / "static" / "vendor"


def _integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def missing() -> list[str]:
    pins = json.loads(ASSETS.read_text())
    return [name for pin in pins.values() for name in pin["files"].values() if not (VENDOR / name).is_file()]


def fetch(force: bool = False) -> list[Path]:
    """Download and extract every pinned asset not present yet (all of them with ``force``)."""
    if not force and not missing():
        return []
    written = []
    VENDOR.mkdir(parents=True, exist_ok=True)
    for package, pin in json.loads(ASSETS.read_text()).items():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                out = subprocess.run(["npm", "pack", f"{package}@{pin['version']}", "--silent"], cwd=tmp,
                                     capture_output=True, text=True, check=True, timeout=300)
            except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                detail = getattr(exc, "stderr", "") or exc
                raise SystemExit(f"cannot fetch {package}@{pin['version']} with `npm pack` ({detail}); the UI needs "
                                 "npm at build time (apt-get install npm)") from None
            tarball = Path(tmp) / out.stdout.strip().splitlines()[-1]
            data = tarball.read_bytes()
            if _integrity(data) != pin["integrity"]:
                raise SystemExit(f"{package}@{pin['version']}: the registry's tarball does not match the pinned "
                                 f"integrity in {ASSETS}; refusing to use it")
            with tarfile.open(tarball) as archive:
                for member, name in pin["files"].items():
                    source = archive.extractfile(member)
                    if source is None:
                        raise SystemExit(f"{package}@{pin['version']} has no file {member}")
                    (VENDOR / name).write_bytes(source.read())
                    written.append(VENDOR / name)
    return written


def main() -> None:
    for path in fetch(force="--force" in sys.argv):
        print(f"vendored {path}")


if __name__ == "__main__":
    main()
