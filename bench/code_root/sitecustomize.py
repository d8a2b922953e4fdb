"""Run a benchmark against another checkout's code: ``PYTHONPATH=bench/code_root BENCH_CODE_ROOT=DIR``.

With ``BENCH_CODE_ROOT`` set, ``harnessrl`` and the packages the editable install maps into it (proxy,
operator, trainer) are imported from the checkout at ``DIR`` (e.g. ``git worktree add /tmp/before bf5639d``),
in this process and in every Python process it starts with its environment (the proxy, the fake upstream).
``PYTHONPATH=DIR/src`` alone is not enough: ``harnessrl.proxy`` would still come from this checkout, and the
checkout's root cannot go on the path (its ``operator`` package hides the standard library's). Python imports
``sitecustomize`` by itself at start-up. Used for issue 25's report (README, "Performance report").
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec
from typing import Any

_ROOT = os.environ.get("BENCH_CODE_ROOT")


class _CheckoutFinder:
    """Finds ``harnessrl`` and its mapped packages in ``BENCH_CODE_ROOT``; everything below them follows."""

    packages = {
        "harnessrl": "src/harnessrl",
        "harnessrl.operator": "operator",
        "harnessrl.proxy": "proxy",
        "harnessrl.trainer": "trainer",
    }

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        where = cls.packages.get(fullname)
        if where is None or _ROOT is None:
            return None
        folder = os.path.join(_ROOT, where)
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )


if _ROOT:
    sys.meta_path.insert(0, _CheckoutFinder)
