"""Build hook only (the project is described in pyproject.toml): before the packages are copied into a wheel,
fetch the trace explorer's pinned browser assets from npm (``src/harnessrl/ui/vendor.py``), so every wheel ships
them and the UI never loads anything from a CDN."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

VENDOR = Path(__file__).resolve().parent / "src" / "harnessrl" / "ui" / "vendor.py"


class BuildWithAssets(build_py):
    def run(self) -> None:
        spec = importlib.util.spec_from_file_location("harnessrl_ui_vendor", VENDOR)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.fetch()
        super().run()


setup(cmdclass={"build_py": BuildWithAssets})
