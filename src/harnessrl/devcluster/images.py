"""The product's images, built here from ``images/*/Dockerfile`` with podman, cached by their inputs, and
imported into the real node's containerd, so the chart and the operator run exactly what users deploy.

No registry but the package registries is reachable here, so the Dockerfiles' registry bases (the official
Python image, NVIDIA's CUDA images) cannot be pulled. A Debian bookworm base made with ``debootstrap`` (python3,
venv, pip, CA certificates) stands in through each Dockerfile's base-image build argument; the Dockerfiles keep
their registry bases as defaults. Builds reach PyPI through this machine's TLS-intercepting egress, so the
host's CA bundle and pip configuration are mounted into every build step, never copied into an image.

Each image is cached as a docker-archive under ``~/.cache/harnessrl/images/``, named by a digest of its inputs
(the Dockerfile, the build arguments, the base and the build context files the root ``.dockerignore`` lets
in): a warm run builds nothing, and a change to any input rebuilds only the images it feeds.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from harnessrl.devcluster.build import cache_root

APP_VERSION = "0.1.0"
BASE_REF = "localhost/harnessrl/debian-base:bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
_BASE_RECIPE = "1"  # bump when the base's packages or fix-ups change


class ImageError(RuntimeError):
    """An image could not be built or imported; one line naming the image, the failing step and the log."""


@dataclass(frozen=True)
class Image:
    name: str
    ref: str
    dockerfile: str
    target: str | None = None
    args: dict[str, str] = field(default_factory=dict)


def _python_base() -> dict[str, str]:
    return {"PYTHON_IMAGE": BASE_REF}


# The images the chart, the operator and the cluster examples run, tagged as they reference them.
IMAGES: tuple[Image, ...] = (
    Image("operator", f"ghcr.io/harnessrl/operator:{APP_VERSION}", "images/python/Dockerfile", "operator", _python_base()),
    Image("proxy", f"ghcr.io/harnessrl/proxy:{APP_VERSION}", "images/python/Dockerfile", "proxy", _python_base()),
    Image("harness-vowels", f"ghcr.io/harnessrl/harness-vowels:{APP_VERSION}", "images/harness/Dockerfile",
          None, _python_base()),
    Image("postgres", f"ghcr.io/harnessrl/postgres:{APP_VERSION}", "images/postgres/Dockerfile", None,
          {"BASE_IMAGE": BASE_REF}),
    # The learner and CPU vLLM share their torch layers: same base, same first steps, same torch index.
    Image("learner-cpu", f"ghcr.io/harnessrl/learner-cpu:{APP_VERSION}", "images/learner/Dockerfile", None,
          {"BASE_IMAGE": BASE_REF, "TORCH_INDEX": "https://pypi.org/simple"}),
    Image("vllm-cpu", f"ghcr.io/harnessrl/vllm-cpu:{APP_VERSION}", "images/vllm-cpu/Dockerfile", None,
          {"BASE_IMAGE": BASE_REF, "TORCH_INDEX": "https://pypi.org/simple"}),
)  # fmt: skip


def images_dir() -> Path:
    return cache_root() / "images"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def _run(command: list[str], log_path: Path | None = None, **kwargs) -> subprocess.CompletedProcess[str]:
    if log_path is None:
        return subprocess.run(command, capture_output=True, text=True, **kwargs)
    with open(log_path, "w") as out:
        return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, text=True, **kwargs)


def _podman() -> str:
    podman = shutil.which("podman")
    if podman is None:
        raise ImageError("images: podman is not installed (apt-get install podman)")
    return podman


def _image_id(podman: str, ref: str) -> str | None:
    result = _run([podman, "image", "inspect", "--format", "{{.Id}}", ref])
    return result.stdout.strip() or None if result.returncode == 0 else None


# --- the local base ---------------------------------------------------------------------------------------


def ensure_base(log: Callable[[str], None] = print) -> str:
    """The local Debian base in podman (built once: debootstrap, then ``podman import``); returns its ID."""
    podman = _podman()
    folder = images_dir()
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(f"{_BASE_RECIPE}:{','.join(BASE_PACKAGES)}".encode()).hexdigest()[:12]
    archive = folder / f"debian-base-{digest}.tar"
    ref = f"{BASE_REF}-{digest}"
    existing = _image_id(podman, ref)
    if existing:
        _run([podman, "tag", ref, BASE_REF])
        return existing
    if not archive.exists():
        started = time.monotonic()
        log("images: bootstrapping the Debian base (debootstrap bookworm) ...")
        rootfs = folder / f"debian-base-{digest}.rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        log_path = folder / "debian-base.log"
        result = _run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "bookworm", str(rootfs),
             "http://deb.debian.org/debian"],
            log_path,
        )  # fmt: skip
        if result.returncode != 0:
            raise ImageError(f"images: debootstrap of the base failed (exit {result.returncode}); log: {log_path}")
        # What the registry Python images give a Dockerfile: `python` and `pip`, and pip allowed to install.
        for marker in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
            marker.unlink()
        for link, target in (("usr/bin/python", "python3"), ("usr/bin/pip", "pip3")):
            (rootfs / link).unlink(missing_ok=True)
            (rootfs / link).symlink_to(target)
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        for lists in (rootfs / "var/lib/apt/lists").glob("*_*"):
            lists.unlink()
        partial = archive.with_suffix(".partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(rootfs, arcname=".")
        partial.rename(archive)
        shutil.rmtree(rootfs, ignore_errors=True)
        log(f"images: base bootstrapped in {time.monotonic() - started:.0f} s")
    result = _run([podman, "import", "--change", 'CMD ["/bin/bash"]', str(archive), ref])
    if result.returncode != 0:
        raise ImageError(f"images: podman import of the base failed: {result.stderr.strip()}")
    _run([podman, "tag", ref, BASE_REF])
    return _image_id(podman, ref) or ""


# --- inputs and builds ------------------------------------------------------------------------------------


def _dockerignore(root: Path) -> tuple[list[str], list[str]]:
    includes, excludes = [], []
    for line in (root / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line == "**":
            continue
        (includes if line.startswith("!") else excludes).append(line.lstrip("!").rstrip("/"))
    return includes, excludes


def context_files(root: Path) -> list[Path]:
    """The build context as the root .dockerignore leaves it (everything excluded, then re-included paths,
    minus the excluded patterns): the files whose change must rebuild an image."""
    includes, excludes = _dockerignore(root)
    found: list[Path] = []
    for include in includes:
        path = root / include
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for candidate in candidates:
            relative = candidate.relative_to(root).as_posix()
            if not any(fnmatch.fnmatch(relative, pattern) or fnmatch.fnmatch(relative, pattern + "/*")
                       or _in_excluded_dir(relative, pattern) for pattern in excludes):
                found.append(candidate)
    return found


def _in_excluded_dir(relative: str, pattern: str) -> bool:
    name = pattern.removeprefix("**/")
    return any(fnmatch.fnmatch(part, name) for part in relative.split("/")[:-1])


def input_digest(image: Image, base_id: str, root: Path | None = None) -> str:
    root = root or repo_root()
    digest = hashlib.sha256()
    digest.update(json.dumps([image.dockerfile, image.target, image.args, image.ref, base_id]).encode())
    digest.update((root / image.dockerfile).read_bytes())
    for path in context_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Built:
    image: Image
    archive: Path
    seconds: float  # this call's build time (0 when the cache had it)
    size_bytes: int


def ensure_images(names: Iterable[str] | None = None, log: Callable[[str], None] = print) -> list[Built]:
    """Build (or take from the cache) each image; returns them with their archives."""
    wanted = [image for image in IMAGES if names is None or image.name in set(names)]
    unknown = set(names or ()) - {image.name for image in IMAGES}
    if unknown:
        raise ImageError(f"images: no image named {', '.join(sorted(unknown))} (known: "
                         f"{', '.join(i.name for i in IMAGES)})")
    podman = _podman()
    base_id = ensure_base(log)
    root = repo_root()
    built = []
    for image in wanted:
        archive = images_dir() / f"{image.name}-{input_digest(image, base_id, root)}.tar"
        seconds = 0.0
        if not archive.exists():
            started = time.monotonic()
            _build(podman, image, root, log)
            partial = archive.with_suffix(".partial")
            result = _run([podman, "save", "--format", "docker-archive", "-o", str(partial), image.ref])
            if result.returncode != 0:
                raise ImageError(f"images: saving {image.ref} failed: {result.stderr.strip()}")
            partial.rename(archive)
            for stale in images_dir().glob(f"{image.name}-*.tar"):
                if stale != archive:
                    stale.unlink()
            seconds = time.monotonic() - started
            log(f"images: {image.name} built in {seconds:.0f} s ({archive.stat().st_size / 2**20:.0f} MiB)")
        built.append(Built(image, archive, seconds, archive.stat().st_size))
    return built


def _build(podman: str, image: Image, root: Path, log: Callable[[str], None]) -> None:
    log(f"images: building {image.ref} from {image.dockerfile} ...")
    log_path = images_dir() / f"build-{image.name}.log"
    command = [podman, "build", "--network", "host", "--layers", "-f", image.dockerfile, "-t", image.ref]
    for host_file in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf"):
        if Path(host_file).exists():  # the egress CA for pip and apt, mounted for the build only
            command += ["-v", f"{host_file}:{host_file}:ro"]
    if image.target:
        command += ["--target", image.target]
    for key, value in image.args.items():
        command += ["--build-arg", f"{key}={value}"]
    result = _run([*command, "."], log_path, cwd=root)
    if result.returncode != 0:
        raise ImageError(f"images: {image.name} failed at {_failing_step(log_path)}; log: {log_path}")


def _failing_step(log_path: Path) -> str:
    """The last ``STEP n/m: ...`` podman printed before the failure, and the error line after it."""
    lines = log_path.read_text(errors="replace").splitlines()
    steps = [line for line in lines if line.startswith("STEP ")]
    errors = [line for line in lines if line.lower().startswith(("error", "e: "))]
    step = steps[-1][:200] if steps else "the start"
    return f"{step} ({errors[-1][:200]})" if errors else step


def import_images(built: list[Built], ctr_address: Path, log: Callable[[str], None] = print) -> None:
    """Import the archives into a containerd (the real node's), skipping those it already took: a record
    beside its image store names the archive (and so the inputs) each reference was imported from."""
    record_path = cache_root() / "node" / "imported-images.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    present = set(
        _run(["ctr", "--address", str(ctr_address), "-n", "k8s.io", "images", "ls", "-q"]).stdout.split()
    )
    for item in built:
        if item.image.ref in present and record.get(item.image.ref) == item.archive.name:
            continue
        started = time.monotonic()
        result = _run(["ctr", "--address", str(ctr_address), "-n", "k8s.io", "images", "import", str(item.archive)],
                      timeout=1800)
        if result.returncode != 0:
            raise ImageError(f"images: importing {item.image.ref} failed: {result.stderr.strip()[:300]}")
        record[item.image.ref] = item.archive.name
        record_path.parent.mkdir(parents=True, exist_ok=True)
        record_path.write_text(json.dumps(record, indent=2))
        log(f"images: imported {item.image.ref} in {time.monotonic() - started:.0f} s")
