"""podman's docker-archive turned into the OCI layout containerd imports, with the layers it holds left out
(harnessrl.devcluster.oci_layout). Synthetic archives shaped as podman writes them; the import itself into a
real containerd is tests/test_images_node.py's."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from harnessrl.devcluster.oci_layout import ArchiveError, digest_of, thin_layout


def _docker_archive(layers: list[bytes], config: bytes, *, manifest_layers: list[str] | None = None,
                    config_name: str | None = None) -> bytes:
    """As ``podman save --format docker-archive`` writes one image: layers named by digest first, the config,
    the legacy per-layer folders, manifest.json last."""
    buffer = io.BytesIO()
    names = [digest_of(layer)[7:] + ".tar" for layer in layers]
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for name, layer in zip(names, layers):
            add(name, layer)
        config_name = config_name or digest_of(config)[7:] + ".json"
        add(config_name, config)
        add("0123abcd/VERSION", b"1.0")
        link = tarfile.TarInfo("0123abcd/layer.tar")
        link.type, link.linkname = tarfile.SYMTYPE, "../" + names[0]
        archive.addfile(link)
        listed = manifest_layers if manifest_layers is not None else names
        add("manifest.json", json.dumps([{"Config": config_name, "RepoTags": ["x.io/a:1"], "Layers": listed}]).encode())
        add("repositories", b"{}")
    return buffer.getvalue()


def _layout(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return {member.name: archive.extractfile(member).read() for member in archive if member.isfile()}


def test_held_layers_are_left_out_and_the_manifest_still_names_them_all() -> None:
    layers = [b"base" * 3000, b"venv" * 5000, b"project" * 10]
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": [digest_of(layer) for layer in layers]}}).encode()
    out = io.BytesIO()
    thinned = thin_layout(io.BytesIO(_docker_archive(layers, config)), out, "x.io/a:1",
                          held={digest_of(layers[0]), digest_of(layers[1])})
    assert (thinned.layers, thinned.sent_bytes, thinned.held_bytes) == \
        (3, len(layers[2]), len(layers[0]) + len(layers[1]))
    files = _layout(out.getvalue())
    index = json.loads(files["index.json"])
    (entry,) = index["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "x.io/a:1"
    manifest = files["blobs/sha256/" + entry["digest"][7:]]
    assert digest_of(manifest) == entry["digest"] and len(manifest) == entry["size"]
    manifest = json.loads(manifest)
    assert [(layer["digest"], layer["size"]) for layer in manifest["layers"]] == \
        [(digest_of(layer), len(layer)) for layer in layers]
    assert files["blobs/sha256/" + manifest["config"]["digest"][7:]] == config
    blobs = {name for name in files if name.startswith("blobs/")}
    assert blobs == {"blobs/sha256/" + d[7:] for d in (digest_of(layers[2]), digest_of(config), entry["digest"])}
    assert files["blobs/sha256/" + digest_of(layers[2])[7:]] == layers[2]
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}


def test_with_nothing_held_every_layer_is_sent_and_the_same_image_gives_the_same_manifest() -> None:
    layers = [b"a" * 700, b"b" * 9000]
    config = b'{"rootfs":{}}'
    outs = [io.BytesIO(), io.BytesIO()]
    for out in outs:
        thinned = thin_layout(io.BytesIO(_docker_archive(layers, config)), out, "x.io/a:1", held=set())
        assert (thinned.sent_bytes, thinned.held_bytes) == (9700, 0)
    first, second = (_layout(out.getvalue()) for out in outs)
    assert first == second
    assert all(first["blobs/sha256/" + digest_of(layer)[7:]] == layer for layer in layers)


def test_an_archive_that_is_not_one_complete_image_is_refused_by_name() -> None:
    layers = [b"a" * 10]
    config = b"{}"
    with pytest.raises(ArchiveError, match="x.io/a:1: layer .* not in the archive"):
        thin_layout(io.BytesIO(_docker_archive(layers, config, manifest_layers=["f" * 64 + ".tar"])), io.BytesIO(),
                    "x.io/a:1", held=set())
    renamed = _docker_archive(layers, config, config_name="e" * 64 + ".json")
    with pytest.raises(ArchiveError, match="config is missing"):
        thin_layout(io.BytesIO(renamed), io.BytesIO(), "x.io/a:1", held=set())
