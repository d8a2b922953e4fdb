"""The node's own small images (the pod sandbox, CoreDNS and the volume helper), written as OCI archives.

Each is one static binary (or busybox) in one layer, so it is written directly rather than built: no image
builder and no registry are needed to bring the node up, and the archive is byte-for-byte the same for the
same binary (fixed file times), so containerd imports it once and reuses it afterwards.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path


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
    layer_digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": list(image.entrypoint), "User": image.user, "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        },
        sort_keys=True,
    ).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": len(config),
            },
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": len(layer)}
            ],
        },
        sort_keys=True,
    ).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    index = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "annotations": {
                        "io.containerd.image.name": image.ref,
                        "org.opencontainers.image.ref.name": image.ref.rsplit(":", 1)[1],
                    },
                }
            ],
        },
        sort_keys=True,
    ).encode()
    entries = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": index,
        f"blobs/sha256/{layer_digest[7:]}": layer,
        f"blobs/sha256/{config_digest[7:]}": config,
        f"blobs/sha256/{manifest_digest[7:]}": manifest,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as archive:
        for name, data in entries.items():
            _add(archive, name, data)
    return path


def _layer(image: NodeImage) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as layer:
        for directory in sorted({str(Path(p).parent).lstrip("/") for p in [*image.files, *image.links]} - {""}):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            layer.addfile(info)
        for target, source in sorted(image.files.items()):
            _add(layer, target.lstrip("/"), source.read_bytes(), mode=0o755)
        for name, target in sorted(image.links.items()):
            info = tarfile.TarInfo(name.lstrip("/"))
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
            layer.addfile(info)
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode = tarfile.DIRTYPE, 0o1777
        layer.addfile(tmp)
    return buffer.getvalue()


def _add(archive: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    archive.addfile(info, io.BytesIO(data))
