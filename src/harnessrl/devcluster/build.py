"""Build the control-plane binaries from Go modules once, and cache them outside the repository.

Release downloads are unreachable here, and ``go install k8s.io/kubernetes/cmd/...@v1.36.3`` refuses the
kubernetes module (its go.mod replaces every staging module with a local folder). So each binary is built from
a small wrapper module under ``scripts/kube/`` that pins it: ``kubernetes/`` (kube-apiserver,
kube-controller-manager, kube-scheduler, kubectl; every staging module replaced by its published v0.36.3),
``etcd/`` (a five-line main around ``etcdmain``; kept apart so etcd's dependency versions do not mix with
Kubernetes') and ``kwok/``. Their go.mod and go.sum are the only build inputs in the repository.

The cache folder's name carries a digest of those files and of the build recipe, so changing a version
rebuilds and an unchanged checkout reuses the binaries at once. The build is as fast as it can be on a small
machine: only the six binaries, ``-pgo=off`` (PGO recompiles the standard library and all dependencies),
``CGO_ENABLED=0`` (static, no C toolchain), stripped, and Go's own package-level parallelism; the Go build
cache (``go env GOCACHE``) is shared by the six builds, so everything after kube-apiserver mostly links.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

KUBERNETES_VERSION = "v1.36.3"
KWOK_VERSION = "v0.8.0"
_RECIPE = "4"  # bump when the flags below change, so cached binaries built the old way are not reused


class BuildError(RuntimeError):
    """A binary could not be built; the message is one line naming the component and its log."""


@dataclass(frozen=True)
class Target:
    name: str
    module: str  # folder under scripts/kube/
    package: str
    ldflags: tuple[str, ...] = ()


def _stamp(package: str, version: str) -> tuple[str, ...]:
    major, minor = version.lstrip("v").split(".")[:2]
    return (
        f"-X {package}.gitVersion={version}",
        f"-X {package}.gitMajor={major}",
        f"-X {package}.gitMinor={minor}",
        f"-X {package}.gitTreeState=clean",
    )


# Without the version stamp `/version` and `kubectl version` say v0.0.0-master, and clients that gate on
# the server version (helm, kubectl's skew warning) misbehave.
_KUBE_STAMP = _stamp("k8s.io/component-base/version", KUBERNETES_VERSION) + _stamp(
    "k8s.io/client-go/pkg/version", KUBERNETES_VERSION
)
TARGETS: tuple[Target, ...] = (
    Target("kube-apiserver", "kubernetes", "k8s.io/kubernetes/cmd/kube-apiserver", _KUBE_STAMP),
    Target(
        "kube-controller-manager", "kubernetes", "k8s.io/kubernetes/cmd/kube-controller-manager", _KUBE_STAMP
    ),
    Target("kube-scheduler", "kubernetes", "k8s.io/kubernetes/cmd/kube-scheduler", _KUBE_STAMP),
    Target("kubectl", "kubernetes", "k8s.io/kubernetes/cmd/kubectl", _KUBE_STAMP),
    Target("etcd", "etcd", "harnessrl.dev/kube/etcd"),
    Target("kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok"),
)
# The real node's binaries (harnessrl.devcluster.node): a set of their own, cached apart, so adding the node
# never rebuilds the control plane and a cluster of kwok nodes alone never builds them.
NODE_TARGETS: tuple[Target, ...] = (
    Target("kubelet", "node", "k8s.io/kubernetes/cmd/kubelet", _KUBE_STAMP),
    Target("kube-proxy", "node", "k8s.io/kubernetes/cmd/kube-proxy", _KUBE_STAMP),
    Target("coredns", "coredns", "harnessrl.dev/kube/coredns"),
    Target("pause", "pause", "harnessrl.dev/kube/pause"),
    Target("local-path-provisioner", "local-path", "github.com/rancher/local-path-provisioner"),
    Target("kube-router", "netpol", "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"),
)


def modules_dir() -> Path:
    """The wrapper modules: ``HARNESSRL_KUBE_MODULES`` or ``scripts/kube`` of this checkout."""
    configured = os.environ.get("HARNESSRL_KUBE_MODULES")
    return Path(configured) if configured else Path(__file__).resolve().parents[3] / "scripts" / "kube"


def cache_root() -> Path:
    configured = os.environ.get("HARNESSRL_KUBE_CACHE")
    if configured:
        return Path(configured)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "harnessrl"


def _digest(modules: Path, targets: tuple[Target, ...]) -> str:
    """A digest of the recipe and of the wrapper modules ``targets`` are built from (their go.mod, go.sum and
    Go files), so another set's modules never invalidate this set's cache."""
    names = {target.module for target in targets}
    digest = hashlib.sha256(_RECIPE.encode())
    files = sorted(p for p in modules.glob("*/go.*") if p.parent.name in names)
    for path in files + sorted(p for p in modules.glob("*/*.go") if p.parent.name in names):
        digest.update(str(path.relative_to(modules)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class Binaries:
    """A complete set of built binaries and what their build measured."""

    dir: Path

    def __getitem__(self, name: str) -> Path:
        return self.dir / "bin" / name

    @property
    def node_stages(self) -> Path:
        """kwok's own node stage (copied from its module at build time): nodes become Ready."""
        return self.dir / "node-initialize.yaml"

    def measurements(self) -> dict[str, dict[str, float]]:
        return json.loads((self.dir / "build.json").read_text())["binaries"]


def ensure_binaries(log=print) -> Binaries:
    """The cached control-plane binaries for this checkout's modules, building them first if missing.

    Concurrent callers wait on a lock instead of building twice. Raises :class:`BuildError`.
    """
    return _ensure("kube", TARGETS, log)


def ensure_node_binaries(log=print) -> Binaries:
    """The cached binaries of the real node (kubelet, kube-proxy, CoreDNS, pause, the volume provisioner and
    the NetworkPolicy enforcer), building them first if missing. Raises :class:`BuildError`."""
    return _ensure("node", NODE_TARGETS, log)


def _ensure(prefix: str, targets: tuple[Target, ...], log) -> Binaries:
    modules = modules_dir()
    missing = sorted({t.module for t in targets if not (modules / t.module / "go.mod").is_file()})
    if missing:
        raise BuildError(
            f"kube build: no wrapper module {', '.join(missing)} at {modules} (set HARNESSRL_KUBE_MODULES to "
            "the checkout's scripts/kube)"
        )
    root = cache_root()
    target = root / f"{prefix}-{KUBERNETES_VERSION}-{_digest(modules, targets)}"
    if (target / "build.json").is_file():
        return Binaries(target)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "build.json").is_file():
            _build_all(modules, targets, target, log)
    return Binaries(target)


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    # The committed go.sum files are the source of truth: never upgrade the toolchain or rewrite go.mod.
    env.update(GOTOOLCHAIN="local", CGO_ENABLED="0", GOFLAGS="-mod=readonly -buildvcs=false")
    return env


def _build_all(modules: Path, targets: tuple[Target, ...], target: Path, log) -> None:
    go = shutil.which("go")
    if go is None:
        raise BuildError("kube build: `go` is not on PATH; install Go 1.26 or later and run it again")
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "bin").mkdir(parents=True)
    measured: dict[str, dict[str, float]] = {}
    env = _go_env()
    for item in targets:
        log(f"kube build: {item.name} ...")
        measured[item.name] = _build_one(go, item, modules / item.module, staging, env)
        log(
            f"kube build: {item.name} {measured[item.name]['seconds']:.0f} s, "
            f"peak {measured[item.name]['peak_rss_mib']:.0f} MiB"
        )
    if any(item.module == "kwok" for item in targets):
        kwok_dir = _module_dir(go, modules / "kwok", "sigs.k8s.io/kwok", env)
        shutil.copy(
            kwok_dir / "kustomize" / "stage" / "node" / "fast" / "node-initialize.yaml",
            staging / "node-initialize.yaml",
        )
    (staging / "build.json").write_text(
        json.dumps(
            {
                "kubernetes": KUBERNETES_VERSION,
                "kwok": KWOK_VERSION,
                "go": _go_version(go),
                "binaries": measured,
            },
            indent=2,
        )
    )
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def _build_one(go: str, item: Target, module: Path, staging: Path, env: dict[str, str]) -> dict[str, float]:
    log_path = staging / f"build-{item.name}.log"
    ldflags = " ".join(("-s", "-w") + item.ldflags)
    command = [
        go,
        "build",
        "-pgo=off",
        "-trimpath",
        "-ldflags",
        ldflags,
        "-o",
        str(staging / "bin" / item.name),
        item.package,
    ]
    start = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            command, cwd=module, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            # wait4's usage covers the go command and the compilers and linker it waited for.
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise BuildError(
            f"kube build: {item.name} failed (go build exit {proc.returncode}): "
            f"{_last_line(log_path)}; log: {log_path}"
        )
    return {"seconds": round(seconds, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


def _module_dir(go: str, module: Path, path: str, env: dict[str, str]) -> Path:
    out = subprocess.run(
        [go, "list", "-m", "-f", "{{.Dir}}", path], cwd=module, env=env, capture_output=True, text=True
    )
    if out.returncode != 0 or not out.stdout.strip():
        raise BuildError(f"kube build: cannot locate module {path}: {out.stderr.strip().splitlines()[-1:]}")
    return Path(out.stdout.strip())


def _go_version(go: str) -> str:
    return subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True).stdout.strip()


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


if __name__ == "__main__":
    # `python3 src/harnessrl/devcluster/build.py` needs only the standard library, so scripts/test.sh can
    # build the binaries with the system Python while pip is still filling the venv.
    import sys

    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        ensure_binaries(say)
        if "--node" in sys.argv[1:]:
            ensure_node_binaries(say)
    except BuildError as error:
        print(error, file=sys.stderr)
        sys.exit(1)
