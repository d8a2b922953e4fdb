"""The top-level component folders are importable as ``harnessrl.*`` and never shadow the standard library.

``operator/`` sits at the repository root next to code that runs with the root as working directory, so a
mapping mistake would silently replace the stdlib's ``operator`` (which ``collections`` imports) or make
``harnessrl.operator`` unimportable from a wheel. Each way the package is used gets checked in a real
subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"src/harnessrl": "harnessrl", "operator": "harnessrl/operator", "proxy": "harnessrl/proxy",
          "trainer": "harnessrl/trainer"}
CHECK = (
    "import operator, collections, harnessrl, harnessrl.operator, harnessrl.proxy, harnessrl.trainer; "
    "assert operator.itemgetter(0)([7]) == 7, operator.__file__; "
    "import os; print(os.path.dirname(harnessrl.operator.__file__))"
)


def _run(python: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([python, "-c", CHECK], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_stdlib_operator_wins_from_repository_root() -> None:
    assert Path(_run(sys.executable, ROOT)) == ROOT / "operator"


def test_editable_install_maps_folders_from_elsewhere(tmp_path: Path) -> None:
    assert Path(_run(sys.executable, tmp_path)) == ROOT / "operator"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    (out / "build.log").write_text(proc.stdout + proc.stderr)
    (built,) = out.glob("harnessrl-*.whl")
    return built


def test_the_build_prints_no_warning(wheel: Path) -> None:
    """pip shows the build backend's warnings even with -q: setuptools' "Package would be ignored" box for each
    data folder (ui/static, ui/templates) printed at every install, which a newcomer reads as a failure."""
    output = (wheel.parent / "build.log").read_text()
    assert "Warning" not in output and "!!" not in output, output[-3000:]
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"harnessrl/ui/templates/base.html", "harnessrl/ui/static/app.js", "harnessrl/ui/assets.json",
            "harnessrl/store/migrations/script.py.mako", "harnessrl/devcluster/kwok-pod-stages.yaml"} <= names
    assert any(name.startswith("harnessrl/ui/static/vendor/") for name in names)  # fetched at build time


def test_wheel_contains_every_module(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for folder, target in MAPPED.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).as_posix()
            expected.add(f"{target}/{rel}")
    missing = sorted(expected - names)
    assert not missing, f"not in the wheel (add the package to pyproject's [tool.setuptools] packages): {missing}"
    assert "operator/__init__.py" not in names  # never a top-level `operator` package


@pytest.mark.parametrize("cwd", ["root", "elsewhere"])
def test_wheel_import_with_base_interpreter(wheel: Path, tmp_path: Path, cwd: str) -> None:
    """The base interpreter has no editable install: only the unpacked wheel provides harnessrl."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    where = ROOT if cwd == "root" else tmp_path
    base = getattr(sys, "_base_executable", sys.executable)
    found = Path(_run(base, where, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}))
    assert found == site / "harnessrl" / "operator"
