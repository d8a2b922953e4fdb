"""Copy the files an installed distribution put in place (its RECORD), each under FOLDER at its own path.

The Python images copy a virtual environment from a build stage; copied whole, its layer changed with every
source change (300 MB for the operator). The build stages install the dependencies in one step and the project
after them, and this gathers the project's own files (its package, its metadata, its console script) so the image
takes the dependencies' venv from a stage that stays cached and the project as a layer of a few MB.

Usage: project_files.py DIST FOLDER
"""

from __future__ import annotations

import shutil
import sys
from importlib import metadata
from pathlib import Path


def main(dist: str, folder: str) -> None:
    files = metadata.distribution(dist).files or []
    copied = 0
    for record in files:
        source = Path(str(record.locate())).resolve()  # ../../../bin/harnessrl: the venv's bin
        if source.is_file():
            target = Path(folder) / source.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
            copied += 1
    if not copied:
        sys.exit(f"project_files: {dist} has no installed files to copy")
    print(f"project_files: {copied} files of {dist} under {folder}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
