"""The node's own small images (the pod sandbox, CoreDNS and the volume helper), written as OCI archives.

Each is one static binary (or busybox) in one layer, so it is written directly rather than built: no image
builder and no registry are needed to bring the node up, and the archive is byte-for-byte the same for the
same binary (fixed file times), so containerd imports it once and reuses it afterwards.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from harnessrl.devcluster.oci_layout import add_file, blob_name, digest_of, image_entries


@dataclass(frozen=True)
class NodeImage:
    ref: str
    files: dict[str, Path]  # path in the image -> file on this machine (mode taken from it)
    entrypoint: tuple[str, ...]
    links: dict[str, str]  # path in the image -> link target
    user: str = "65532:65532"


def write_oci_archive(image: NodeImage, path: Path) -> Path:
    """Write ``image`` as an OCI image-layout tar that ``ctr images import`` takes under its reference."""
    layer = _layer(image)
    layer_digest = digest_of(layer)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": list(image.entrypoint), "User": image.user, "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        },
        sort_keys=True,
    ).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as archive:
        add_file(archive, blob_name(layer_digest), layer)
        for name, data in image_entries(image.ref, config, [(layer_digest, len(layer))]).items():
            add_file(archive, name, data)
    return path


def _layer(image: NodeImage) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as layer:
        for directory in sorted({str(Path(p).parent).lstrip("/") for p in [*image.files, *image.links]} - {""}):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            layer.addfile(info)
        for target, source in sorted(image.files.items()):
            add_file(layer, target.lstrip("/"), source.read_bytes(), mode=0o755)
        for name, target in sorted(image.links.items()):
            info = tarfile.TarInfo(name.lstrip("/"))
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
            layer.addfile(info)
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode = tarfile.DIRTYPE, 0o1777
        layer.addfile(tmp)
    return buffer.getvalue()

