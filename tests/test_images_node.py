"""The images `scripts/kube.sh images` builds, as the real node's containerd takes and runs them.

A private containerd (its own root, state and socket under /tmp; never the system's or the node's) imports the
images from podman and runs the images with runc: `podman run` cannot set its rlimits on these machines, containerd's
defaults can. The builds are cached (scripts/test.sh builds them before pytest), so this test only builds what
changed. The node itself runs them through the chart and the operator in test_real_node.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from harnessrl.devcluster.containerd import private_containerd
from harnessrl.devcluster.images import (
    INPUTS_LABEL,
    BASE_REF,
    Built,
    Image,
    ImageError,
    build,
    ensure_base,
    ensure_images,
    images_dir,
    import_images,
)

pytestmark = pytest.mark.real_node

CTR = "ctr"
NAMESPACE = "k8s.io"


@pytest.fixture(scope="module")
def built() -> dict[str, Built]:
    return {item.image.name: item for item in ensure_images()}


@pytest.fixture(scope="module")
def containerd() -> Iterator[str]:
    """A containerd of this test's own, on a root of its own; its address."""
    assert os.geteuid() == 0 and shutil.which("containerd"), "needs root and containerd (kube.sh build --node)"
    root = Path(tempfile.mkdtemp(prefix="hr-ctrd-root-", dir="/tmp"))
    try:
        with private_containerd(root) as address:
            yield address
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _ctr(address: str, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([CTR, "--address", address, "-n", NAMESPACE, *args], capture_output=True, text=True,
                            timeout=timeout)
    assert not check or result.returncode == 0, f"ctr {' '.join(args)}: {result.stderr}"
    return result


def _config(ref: str) -> dict:
    result = subprocess.run(["podman", "image", "inspect", "--format", "{{json .Config}}", ref],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def test_each_image_starts_as_the_chart_and_the_operator_start_it(built: dict[str, Built]) -> None:
    """Users and commands as built (not just as written): the components run as the non-root uid their pods
    ask for, the PostgreSQL image starts its entrypoint as the official image does (root, then uid 999)."""
    expected = {
        "operator": ("65532:65532", ["harnessrl"]),
        "proxy": ("65532:65532", ["harnessrl"]),
        "learner-cpu": ("65532:65532", ["harnessrl"]),
        "harness-vowels": ("65532:65532", ["python", "/app/harness.py"]),
        "harness-search": ("65532:65532", ["python", "/app/harness.py"]),
        "harness-swe": ("65532:65532", ["python", "/app/harness.py"]),
        "vllm-cpu": ("65532:65532", None),
        "postgres": ("", ["docker-entrypoint.sh"]),
    }
    assert set(built) == set(expected)
    for name, (user, entrypoint) in expected.items():
        config = _config(built[name].image.ref)
        assert (config.get("User", ""), config.get("Entrypoint")) == (user, entrypoint), name
    assert _config(built["vllm-cpu"].image.ref)["Cmd"][:2] == ["vllm", "serve"]


@contextmanager
def _mounted(ref: str) -> Iterator[Path]:
    path = subprocess.run(["podman", "image", "mount", ref], capture_output=True, text=True, check=True).stdout
    try:
        yield Path(path.strip())
    finally:
        subprocess.run(["podman", "image", "unmount", ref], capture_output=True)


def _run_rootfs(address: str, ref: str, argv: list[str]) -> str:
    """Run ``argv`` in the image's filesystem (read-only, its environment and working directory, /tmp an empty
    folder) as a containerd task; returns its output. As root: ctr has no user flag for a bare root
    filesystem (the users are checked from the image configuration above)."""
    config = _config(ref)
    scratch = Path(tempfile.mkdtemp(prefix="hr-tmp-", dir="/tmp"))
    scratch.chmod(0o1777)
    env = [f"--env={item}" for item in config.get("Env", [])]
    try:
        with _mounted(ref) as rootfs:
            result = _ctr(address, "run", "--rm", "--rootfs", "--read-only", *env, "--env=HOME=/tmp",
                          "--cwd", config.get("WorkingDir") or "/",
                          "--mount", f"type=bind,src={scratch},dst=/tmp,options=rbind:rw",
                          str(rootfs), f"smoke-{os.getpid()}", *argv, check=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert result.returncode == 0, f"{ref} {argv}: {result.stdout}{result.stderr}"
    return result.stdout


def test_the_python_images_run_their_commands(built: dict[str, Built], containerd: str) -> None:
    operator = _run_rootfs(containerd, built["operator"].image.ref, [
        "python", "-c", "import harnessrl, harnessrl.operator.handlers; print(harnessrl.__version__)"])
    assert operator.strip() == "0.1.0"
    # The operator image has the operator's extra only: --help lists what it cannot import instead of failing.
    assert "operator " in _run_rootfs(containerd, built["operator"].image.ref, ["harnessrl", "--help"])
    assert "Usage" in _run_rootfs(containerd, built["proxy"].image.ref, ["harnessrl", "proxy", "--help"])
    assert "Usage" in _run_rootfs(containerd, built["learner-cpu"].image.ref, ["harnessrl", "learn", "--help"])
    # vLLM's sampler gathers log-probs through torch.compile even in eager mode: inductor must build C++ here.
    compiled = _run_rootfs(containerd, built["vllm-cpu"].image.ref, [
        "python", "-c", "import torch; f = torch.compile(lambda x: x.log_softmax(-1).gather(-1, x.argmax(-1, True)));"
        " print(round(float(f(torch.eye(4)).sum()), 3))"])
    assert compiled.strip().splitlines()[-1] == str(round(4 * (1 - math.log(math.e + 3)), 3))  # each row of eye(4)
    harness = _run_rootfs(containerd, built["harness-vowels"].image.ref, [
        "python", "-c", "import ast, openai, httpx; ast.parse(open('/app/harness.py').read()); print('ok')"])
    assert harness.strip() == "ok"


def test_import_takes_each_image_once_under_its_references(built: dict[str, Built], containerd: str) -> None:
    """The chart's default PostgreSQL reference comes with the image; a second import skips what containerd
    holds from the same inputs, an image whose inputs changed (another label) is imported again, and no archive
    of it is left on disk (podman's store is the cache)."""
    postgres = built["postgres"]
    refs = [postgres.image.ref, *postgres.image.aliases]
    assert postgres.image.aliases, "the chart's default PostgreSQL reference"
    assert import_images(CTR, containerd, NAMESPACE, built=[postgres], log=lambda _: None) == refs
    assert set(refs) <= set(_ctr(containerd, "images", "ls", "-q").stdout.split())
    assert import_images(CTR, containerd, NAMESPACE, built=[postgres], log=lambda _: None) == []
    _ctr(containerd, "images", "label", refs[-1], f"{INPUTS_LABEL}=postgres-0000000000000000")
    assert import_images(CTR, containerd, NAMESPACE, built=[postgres], log=lambda _: None) == refs
    labels = _ctr(containerd, "images", "ls").stdout
    assert labels.count(f"{INPUTS_LABEL}={postgres.key}") == len(refs)
    assert not list(images_dir().glob("postgres-*.tar"))


def test_an_image_replacing_another_is_sent_without_the_layers_containerd_holds(
        built: dict[str, Built], containerd: str) -> None:
    """A rebuilt image goes in under the reference its old build had, as after a source change: containerd gets
    only the layers it lacks (both images stand on the same Debian base), the reference then names the new
    image, and that image, unpacked from the held layers and the sent ones, runs from containerd's snapshot."""
    old, new = built["postgres"], built["harness-vowels"]
    ref = f"localhost/harnessrl-test/replaced-{os.getpid()}:1"
    logged: list[str] = []

    def replaced_by(source: Built, key: str) -> Built:
        subprocess.run(["podman", "tag", source.image.ref, ref], check=True, capture_output=True)
        return Built(Image(name="replaced", ref=ref, dockerfile=source.image.dockerfile), key, 0.0, source.size_bytes)

    try:
        assert import_images(CTR, containerd, NAMESPACE, built=[replaced_by(old, "replaced-1")], log=logged.append) == [ref]
        assert import_images(CTR, containerd, NAMESPACE, built=[replaced_by(new, "replaced-2")], log=logged.append) == [ref]
        sent, held = (int(n) for n in re.search(r"\((\d+) MiB of layers sent, (\d+) MiB held\)", logged[-1]).groups())
        assert held >= 200 and sent < new.size_bytes / 2**20 - 200, logged  # the 210 MB Debian base stayed
        target = next(line.split()[2] for line in _ctr(containerd, "images", "ls").stdout.splitlines()
                      if line.split()[0] == ref)
        manifest = json.loads(_ctr(containerd, "content", "get", target).stdout)
        podman_id = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", new.image.ref],
                                   capture_output=True, text=True, check=True).stdout.strip()
        assert manifest["config"]["digest"] == f"sha256:{podman_id}"
        ran = _ctr(containerd, "run", "--rm", ref, f"replaced-{os.getpid()}", "python", "-c",
                   "import httpx, openai; print('ran', open('/app/harness.py').read()[:2] != '')")
        assert ran.stdout.strip() == "ran True"
    finally:
        subprocess.run(["podman", "untag", ref, ref], capture_output=True)  # that name alone, not all the image has
        _ctr(containerd, "images", "rm", ref, check=False)


def test_images_imported_before_the_node_starts_are_the_nodes(built: dict[str, Built]) -> None:
    """What `scripts/kube.sh images --node-store` relies on (CI imports while the control plane compiles): what a
    containerd started for the import put in a root is there, labelled with its inputs, for the next containerd
    on that root (the node's), which so imports nothing again."""
    vowels = built["harness-vowels"]
    refs = [vowels.image.ref, *vowels.image.aliases]
    root = Path(tempfile.mkdtemp(prefix="hr-ctrd-root-", dir="/tmp"))
    try:
        with private_containerd(root) as address:
            assert import_images(CTR, address, NAMESPACE, built=[vowels], log=lambda _: None) == refs
        with private_containerd(root) as address:
            assert import_images(CTR, address, NAMESPACE, built=[vowels], log=lambda _: None) == []
            assert _ctr(address, "images", "ls").stdout.count(f"{INPUTS_LABEL}={vowels.key}") == len(refs)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_postgres_image_serves_the_database_the_chart_asks_for(built: dict[str, Built], containerd: str) -> None:
    """The imported image under the chart's default reference, as a plain container (root, which the entrypoint
    leaves for uid 999), a read-only root filesystem, the chart's PGDATA under its data volume, /var/run/postgresql
    and /tmp empty folders: the database answers over TCP with the password."""
    ref = built["postgres"].image.aliases[0]
    import_images(CTR, containerd, NAMESPACE, built=[built["postgres"]], log=lambda _: None)
    folder = Path(tempfile.mkdtemp(prefix="hr-pg-", dir="/tmp"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mounts = []
    for name, target in (("data", "/var/lib/postgresql/data"), ("run", "/var/run/postgresql"), ("tmp", "/tmp")):
        (folder / name).mkdir()
        (folder / name).chmod(0o1777)
        mounts += ["--mount", f"type=bind,src={folder / name},dst={target},options=rbind:rw"]
    env = {"POSTGRES_DB": "harnessrl", "POSTGRES_USER": "harnessrl", "POSTGRES_PASSWORD": "pw-1",
           "PGDATA": "/var/lib/postgresql/data/pgdata"}
    container = f"pg-{os.getpid()}"
    # ctr's arguments replace the image's entrypoint too; flags first, as the chart's args would be.
    try:
        _ctr(containerd, "run", "-d", "--net-host", "--read-only", *mounts,
             *(f"--env={k}={v}" for k, v in env.items()),
             ref, container, "docker-entrypoint.sh", "-c", f"port={port}", "-c", "listen_addresses=127.0.0.1")
        deadline = time.monotonic() + 90
        while True:
            try:
                connection = psycopg.connect(host="127.0.0.1", port=port, dbname="harnessrl", user="harnessrl",
                                             password="pw-1")
                break
            except psycopg.OperationalError:
                assert time.monotonic() < deadline, "the image's database never accepted the chart's password"
                time.sleep(0.5)
        with connection:
            row = connection.execute("SELECT current_database(), pg_encoding_to_char(encoding), version() "
                                     "FROM pg_database WHERE datname = current_database()").fetchone()
        assert row[:2] == ("harnessrl", "UTF8") and row[2].startswith("PostgreSQL")
        assert (folder / "data/pgdata").stat().st_uid == 999
    finally:
        _ctr(containerd, "tasks", "kill", "-s", "SIGKILL", container, check=False)
        for _ in range(50):
            if _ctr(containerd, "tasks", "delete", container, check=False).returncode == 0:
                break
            time.sleep(0.2)
        _ctr(containerd, "containers", "delete", container, check=False)
        shutil.rmtree(folder, ignore_errors=True)



def test_a_failed_build_names_the_image_its_failing_step_and_its_log(tmp_path: Path) -> None:
    ensure_base(lambda _: None)
    (tmp_path / "Dockerfile").write_text(
        "ARG BASE_IMAGE=docker.io/library/debian:12.12\nFROM ${BASE_IMAGE}\nRUN echo fine\n"
        "RUN echo 'error: the tool broke' >&2 && exit 3\nRUN echo never\n"
    )
    image = Image("broken-test", "localhost/harnessrl/broken-test:1", "Dockerfile", None, {"BASE_IMAGE": BASE_REF})
    log = images_dir() / "build-broken-test.log"
    try:
        with pytest.raises(ImageError) as failure:
            build(image, tmp_path, log=lambda _: None)
        message = str(failure.value)
        assert message.startswith("images: broken-test failed at STEP RUN echo 'error: the tool broke'"), message
        assert "(error: the tool broke)" in message and message.endswith(f"log: {log}") and "\n" not in message
        assert "exit status 3" in log.read_text()
    finally:
        log.unlink(missing_ok=True)
