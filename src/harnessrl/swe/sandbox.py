"""Commands a model wrote, and the library tests that judge them, run here and never on the host as they are.

The sandbox is Debian's bubblewrap (``bwrap``): new PID, network, IPC, UTS and cgroup namespaces, so there is
no network at all (a loopback with nothing behind it, not the host's); none of the host's file system but
``/usr``, a few files of ``/etc`` and the Python environment (all read-only) and the folders the caller binds
(the repository copy, read-write); ``/tmp`` is a size-limited tmpfs. Limits: a wall-clock time limit, at which
the sandbox's PID 1 is killed and with it, by the kernel, every process in the namespace; and resource limits
set before bwrap starts, which every process inside inherits: address space per process (``RLIMIT_AS``), CPU
seconds, file size and the number of processes (``RLIMIT_NPROC``).

Run by root (CI, a harness pod), bwrap runs privileged, without a user namespace, and the command starts under
``setpriv`` as an unprivileged user of its own (a uid derived from the writable folder, with no passwd entry;
the folder is given to it), with every capability dropped and no-new-privs. Why not bwrap's user namespace:
it maps one uid, which as root makes the sandbox's user root outside (owner of root's files), and the kernel
never applies ``RLIMIT_NPROC`` to root; a uid of its own makes that limit count the sandbox's processes only.
Run by another user, bwrap makes an unprivileged user namespace and keeps that user's uid; the process limit
then counts all of that user's processes, so it is raised by their number at start.

Inside a harness pod on a cluster (``HARNESSRL_SANDBOX=pod``, which the example images set), the pod is the
sandbox: the operator runs it non-root with no capabilities, the RuntimeDefault seccomp profile, resource
limits, an activeDeadlineSeconds and a NetworkPolicy that lets it reach only its proxy, and bubblewrap cannot
make namespaces there without privileges. A command then runs as a plain child process of the pod's own
container, in its own session, with a cleared environment (no user site-packages) and the same time limit
(its whole process group is killed) and resource limits, except the process limit: ``RLIMIT_NPROC`` counts a
uid's processes node-wide, and every pod runs as the same uid, so the pod's own PID limit (the kubelet's
``podPidsLimit``) stands in. Nothing runs on a host in this mode, since the variable is only set in an image;
a command that leaves its session outlives its time limit but not the pod's container.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

MODE_ENV = "HARNESSRL_SANDBOX"
POD_MODE = "pod"
"""``HARNESSRL_SANDBOX=pod``: already inside a sandboxed pod, so commands run as plain child processes."""

SANDBOX_UID_BASE = 2_000_000
"""Root's sandboxes run as SANDBOX_UID_BASE + a hash of their writable directory (below 3,000,000)."""

_ETC_FILES = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group",
              "nsswitch.conf", "bash.bashrc", "inputrc")


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot create namespaces here; the message says how to fix it."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed command may use. ``memory_bytes`` is per process (``RLIMIT_AS``): with at most
    ``max_processes`` processes, the sandbox as a whole holds at most their product."""

    timeout_s: float = 120.0
    memory_bytes: int = 2 << 30
    max_processes: int = 256
    tmp_bytes: int = 256 << 20
    file_bytes: int = 256 << 20


@dataclass(frozen=True)
class SandboxResult:
    returncode: int
    output: str
    timed_out: bool
    seconds: float

    @property
    def reason(self) -> str | None:
        """Why the command did not succeed, in one line (None when it exited 0)."""
        if self.timed_out:
            return "killed: it passed the sandbox's time limit"
        if self.returncode < 0:
            return f"killed by {signal.Signals(-self.returncode).name}"
        return None if self.returncode == 0 else f"exited {self.returncode}"


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable("bwrap not found: install Debian's bubblewrap (apt-get install -y bubblewrap)")
    return path


def sandbox_uid(writable: Path) -> int:
    """Root's sandbox user for this directory: the same for every command on one repository copy (its files
    stay that user's), different across concurrent rollouts."""
    return SANDBOX_UID_BASE + zlib.crc32(str(writable.resolve()).encode()) % 1_000_000


def python_prefixes() -> list[Path]:
    """The Python environment the sandbox lends its interpreter from (the venv and its base), read-only."""
    prefixes = dict.fromkeys([Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()])  # venv first
    return [p for p in prefixes if not p.is_relative_to("/usr")]


def run_sandboxed(
    command: Sequence[str],
    *,
    writable: Sequence[Path] = (),
    readable: Mapping[Path, str] | None = None,
    chdir: Path | None = None,
    env: Mapping[str, str] | None = None,
    limits: SandboxLimits = SandboxLimits(),
) -> SandboxResult:
    """Run ``command`` in a fresh sandbox and return its exit, its output (stdout and stderr together) and
    whether the time limit killed it. ``writable`` directories are bound read-write at their own paths
    (root's sandbox user becomes their owner), ``readable`` maps host paths to read-only places inside."""
    if in_pod():
        return _run_in_pod(command, chdir or (Path(writable[0]) if writable else Path("/tmp")), env, limits)
    writable = [Path(p).resolve() for p in writable]
    binds = [("--ro-bind", prefix, str(prefix)) for prefix in python_prefixes()]
    binds += [("--ro-bind", Path(source).resolve(), target) for source, target in (readable or {}).items()]
    binds += [("--bind", directory, str(directory)) for directory in writable]
    argv = [bwrap_path()]
    uid = None
    if os.geteuid() == 0:
        # Privileged bwrap (no user namespace: its single-uid map would make the sandbox root's files its
        # own), which may still change user: setpriv then takes the sandbox user and drops every capability.
        uid = sandbox_uid(writable[0]) if writable else SANDBOX_UID_BASE
        for directory in writable:
            _give_to(directory, uid)
        argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                 "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        command = [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}",
                   "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", *command]
    else:
        argv += ["--unshare-all", "--unshare-user", "--disable-userns"]
    argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox", *_root_filesystem(),
             "--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp"]
    # bwrap makes a bind's missing parents with the mode of the host's (0700 for /root): open them up first.
    parents = sorted({parent for _, source, target in binds for parent in Path(target).parents} - {Path("/")},
                     key=lambda p: (len(p.parts), str(p)))
    for parent in parents:
        if parent.parts[1] not in ("usr", "proc", "dev", "etc"):
            argv += ["--perms", "0755", "--dir", str(parent)]
    for option, source, target in binds:
        argv += [option, str(source), target]
    argv += ["--chdir", str(chdir or (writable[0] if writable else "/tmp")), "--clearenv"]
    for name, value in {**sandbox_env(), **(env or {})}.items():
        argv += ["--setenv", name, value]
    return _run([*argv, "--", *command], limits, uid)


def in_pod() -> bool:
    """Whether this process is already in a sandboxed pod (``HARNESSRL_SANDBOX=pod``); any other value is an
    error, so a misspelt mode never falls back to a weaker sandbox silently."""
    mode = os.environ.get(MODE_ENV, "")
    if mode not in ("", POD_MODE):
        raise SandboxUnavailable(f"{MODE_ENV}={mode!r}: set it to {POD_MODE!r} inside a sandboxed pod, or unset it")
    return mode == POD_MODE


def _run_in_pod(command: Sequence[str], chdir: Path, env: Mapping[str, str] | None,
                limits: SandboxLimits) -> SandboxResult:
    """The pod is the sandbox: the command as a child in a session of its own, cleared environment, rlimits and
    the time limit (its process group killed); ``readable`` needs no binding, the files are where they are."""
    environment = {**sandbox_env(), "PYTHONNOUSERSITE": "1", **(env or {})}
    started = time.monotonic()
    process = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, cwd=chdir, env=environment, start_new_session=True,
                               preexec_fn=_limiter(limits, None))  # noqa: PLW1509
    timed_out = False
    try:
        output, _ = process.communicate(timeout=limits.timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            output, _ = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process that left the group still holds the output pipe
            process.kill()
            process.wait()
            output = b""
    return SandboxResult(process.returncode, output.decode("utf-8", "replace"), timed_out,
                         time.monotonic() - started)


def sandbox_env() -> dict[str, str]:
    bins = [str(p / "bin") for p in python_prefixes()]
    return {"PATH": os.pathsep.join([*bins, "/usr/local/bin", "/usr/bin", "/bin"]), "HOME": "/tmp",
            "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}


def _root_filesystem() -> list[str]:
    """``/usr`` read-only with the merged-/usr links (or the directories where /usr is not merged) and the
    few files of ``/etc`` that programs read to start; nothing else of the host."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    args += ["--perms", "0755", "--dir", "/etc"]  # made like a bind's parent (0700 here) otherwise
    for name in _ETC_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return args


def _give_to(directory: Path, uid: int) -> None:
    """Make the sandbox user the owner of a writable directory (once: files it creates are its own)."""
    if directory.stat().st_uid == uid:
        return
    for root, dirs, files in os.walk(directory):
        os.lchown(root, uid, uid)
        for name in (*dirs, *files):
            os.lchown(os.path.join(root, name), uid, uid)


def _process_count(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def _kill_sandbox(process: subprocess.Popen[bytes], info: IO[bytes]) -> None:
    child = None
    if select.select([info], [], [], 1.0)[0]:
        try:
            child = json.loads(os.read(info.fileno(), 65536).decode() or "{}").get("child-pid")
        except ValueError:
            child = None
    try:
        if child:
            os.kill(child, signal.SIGKILL)
        else:  # bwrap never said: kill it (its child then gets --die-with-parent's SIGKILL)
            os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _limiter(limits: SandboxLimits, nproc: int | None) -> Callable[[], None]:
    """The child's resource limits, set between fork and exec (``nproc`` None: no process limit)."""
    cpu = max(1, int(limits.timeout_s) + 1)

    def preexec() -> None:
        if nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return preexec


def _run(argv: list[str], limits: SandboxLimits, uid: int | None) -> SandboxResult:
    # The process limit counts every process of the real uid: a sandbox user of its own starts from none.
    nproc = limits.max_processes + (0 if uid is not None else _process_count(os.getuid()))
    preexec = _limiter(limits, nproc)  # inherited by bwrap and everything in the sandbox

    # bwrap reports its child, the sandbox's PID 1, on --info-fd: killing that one ends the PID namespace (the
    # kernel kills every process in it) and lets bwrap reap it and exit, so nothing is left, not even a zombie.
    info_read, info_write = os.pipe()
    argv = [argv[0], "--info-fd", str(info_write), *argv[1:]]
    started = time.monotonic()
    try:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, pass_fds=[info_write], start_new_session=True,
                                   preexec_fn=preexec)  # noqa: PLW1509
    finally:
        os.close(info_write)
    timed_out = False
    with os.fdopen(info_read, "rb") as info:
        try:
            output, _ = process.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_sandbox(process, info)
            output, _ = process.communicate()
    text = output.decode("utf-8", "replace")
    if process.returncode == 1 and text.startswith("bwrap:") and not timed_out:  # bwrap could not build it
        raise SandboxUnavailable(f"the sandbox could not start: {text.strip()} (bubblewrap needs unprivileged "
                                 "user namespaces: sysctl user.max_user_namespaces above 0)")
    return SandboxResult(process.returncode, text, timed_out, time.monotonic() - started)
