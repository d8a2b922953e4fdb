"""A library's source distribution as the repository of a coding task: fetched from PyPI, pinned by its sha256,
unpacked, and described by where its code, its tests and its import root are.

Source distributions rather than wheels because only they carry a library's own tests; ``pip download
--no-binary :all:`` fetches one through the user's pip configuration (index, proxy, certificates).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

TEST_DIRS = ("tests", "testing", "test")
PYTEST_CONFIG_FILES = ("pyproject.toml", "setup.cfg", "tox.ini", "pytest.ini")


class RepositoryError(ValueError):
    """A library that cannot be a task's repository; the message names it and why."""


@dataclass(frozen=True)
class Layout:
    """Where things are in an unpacked source distribution, relative to its top folder."""

    python_path: str  # what goes on PYTHONPATH: "src" for a src layout, else "."
    test_paths: list[str]  # what pytest is given
    sources: list[str]  # the library's own modules: the files a bug may be put in

    def is_test_file(self, relative: str) -> bool:
        name = Path(relative).name
        return (name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"
                or any(relative == t or relative.startswith(t.rstrip("/") + "/") for t in self.test_paths))


def download_sdist(requirement: str, directory: Path) -> Path:
    """Fetch ``name==version``'s source distribution into ``directory`` and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    before = set(directory.iterdir())
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           "--no-build-isolation", "-q", "-d", str(directory), requirement],
                          capture_output=True, text=True, check=False)
    fetched = sorted(set(directory.iterdir()) - before) or sorted(
        p for p in directory.iterdir() if _sdist_matches(p, requirement))
    if proc.returncode != 0 or not fetched:
        raise RepositoryError(f"{requirement}: pip download --no-binary :all: failed: "
                              f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return fetched[0]


def _sdist_matches(path: Path, requirement: str) -> bool:
    name, _, version = requirement.partition("==")
    stem = path.name.lower().replace("-", "_")
    return stem.startswith(f"{name.lower().replace('-', '_')}_{version}") and path.name.endswith(".tar.gz")


def sdist_name_version(path: Path) -> tuple[str, str]:
    """``name-1.2.3.tar.gz`` -> ("name", "1.2.3"), as sdists are named (PEP 625: the name normalised with
    underscores, so the last dash separates the version)."""
    stem = path.name.removesuffix(".tar.gz")
    name, dash, version = stem.rpartition("-")
    if not (name and dash and version[:1].isdigit()):
        raise RepositoryError(f"{path.name}: not named NAME-VERSION.tar.gz as a source distribution is")
    return name, version


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unpack(sdist: Path, into: Path) -> Path:
    """Unpack a source distribution into ``into``; returns its single top folder."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later: the standard library's refusals
            archive.extractall(into, filter="data")
        else:
            archive.extractall(into, members=_plain_members(archive, sdist))
    tops = [p for p in into.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise RepositoryError(f"{sdist.name}: expected one top folder in the archive, found {len(tops)}")
    return tops[0]


def _plain_members(archive: tarfile.TarFile, sdist: Path) -> list[tarfile.TarInfo]:
    """The "data" filter by hand for Pythons before 3.11.4 (Debian bookworm's 3.11.2, the base the dev cluster's
    images are built on): plain files and folders inside the target only, no links or devices, no set-id
    bits; anything else refuses the archive."""
    members = archive.getmembers()
    for member in members:
        path = PurePosixPath(member.name)
        if path.is_absolute() or ".." in path.parts or not (member.isfile() or member.isdir()):
            raise RepositoryError(f"{sdist.name}: {member.name!r} is not a plain file or folder inside the "
                                  "archive's top folder; a source distribution holds nothing else")
        member.mode &= 0o777
    return members


def detect_layout(root: Path) -> Layout:
    """The import root, the tests and the library's modules of an unpacked source distribution."""
    python_path = "src" if (root / "src").is_dir() else "."
    test_paths = [d for d in TEST_DIRS if (root / d).is_dir()]
    test_paths += sorted(p.name for p in root.glob("test_*.py"))
    if not test_paths:
        raise RepositoryError(f"{root.name}: the source distribution has no tests ({', '.join(TEST_DIRS)} or "
                              "test_*.py at its top): pick a library whose sdist ships them")
    layout = Layout(python_path, test_paths, [])
    code_root = root / python_path
    # The library is its packages (folders with an __init__.py at the import root); a one-module library
    # (six.py) has none, and then its top-level modules are it.
    packages = sorted(p.parent for p in code_root.glob("*/__init__.py"))
    candidates = ([f for package in packages for f in sorted(package.rglob("*.py"))] if packages
                  else [p for p in sorted(code_root.glob("*.py"))
                        if p.name not in ("setup.py", "noxfile.py", "conftest.py")])
    sources = []
    for path in candidates:
        relative = path.relative_to(root).as_posix()
        if not (layout.is_test_file(relative) or path.name.startswith("_version") or "/tests/" in relative):
            sources.append(relative)
    if not sources:
        raise RepositoryError(f"{root.name}: no library modules found under {python_path}/")
    return Layout(python_path, test_paths, sources)


def copy_tree(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, symlinks=True)
    return target


def apply_patch(root: Path, patch: str, *, reverse: bool = False) -> None:
    """Apply a unified diff (``a/``, ``b/`` prefixes, paths relative to ``root``) with ``git apply``, which
    refuses a diff whose context does not match rather than guessing. Git must not find a repository above
    ``root`` (it would take paths as relative to that repository's top), hence the ceiling."""
    with tempfile.NamedTemporaryFile("w", suffix=".diff", delete=False) as fh:
        fh.write(patch)
    try:
        proc = subprocess.run(["git", "apply", *(["-R"] if reverse else []), fh.name], cwd=root,
                              env={**os.environ, "GIT_CEILING_DIRECTORIES": str(root.resolve().parent)},
                              capture_output=True, text=True, check=False)
    finally:
        Path(fh.name).unlink()
    if proc.returncode != 0:
        raise RepositoryError(f"the patch does not apply to {root}: {proc.stderr.strip()}")
