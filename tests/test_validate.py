"""`harnessrl validate`: OK or one line per problem (file:line: field: what to do), never a traceback;
exit 0 / 1 (problems) / 2 (unreadable)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.cli import main
from harnessrl.spec.documents import load_documents
from harnessrl.spec.problems import validate_document

ROOT = Path(__file__).resolve().parents[1]
MINIMAL_EXAMPLE = ROOT / "examples" / "trainingrun-minimal.yaml"

HEADER = """\
apiVersion: harnessrl.io/v1alpha1
kind: TrainingRun
metadata:
  name: bad
"""


def run_validate(*args: str, stdin: str | None = None) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, ["validate", *args], input=stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output.splitlines()


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_valid_examples_print_ok() -> None:
    examples = sorted(str(path) for path in (ROOT / "examples").glob("trainingrun-*.yaml"))
    code, lines = run_validate(*examples)
    assert code == 0
    assert [line for line in lines if ": only on a cluster" not in line] == [f"{path}: OK" for path in examples]


def test_a_cluster_run_without_a_shared_checkpoint_volume_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """A file written for a cluster (it sets harness.image) runs with `harnessrl run`, but the operator's vLLM
    could never load what its learner writes: validate says the cluster refuses it, naming the field and the
    fix, and still exits 0. A file with no cluster field (the minimal example) gets no such line."""
    path = write(tmp_path, "novolume.yaml", """
apiVersion: harnessrl.io/v1alpha1
kind: TrainingRun
metadata: {name: novolume}
spec:
  model: {path: /models/m}
  harness: {image: h:1, command: [h], tasks: {inline: [{id: t1}]}}
""")
    code, lines = run_validate(path)
    assert code == 0 and lines[0] == f"{path}: OK"
    [refusal] = [line for line in lines if "a cluster refuses it" in line]
    assert "spec.learner.checkpointVolume" in refusal and "ReadWriteMany" in refusal and "upstreams" in refusal
    assert run_validate(str(ROOT / "examples" / "trainingrun-minimal.yaml"))[1] == [
        f"{ROOT / 'examples' / 'trainingrun-minimal.yaml'}: OK"
    ]


def test_fields_only_a_cluster_reads_are_named_after_ok(tmp_path: Path) -> None:
    """A file written for a cluster validates for `harnessrl run` too, which says what it leaves alone."""
    path = write(
        tmp_path,
        "both.yaml",
        """
apiVersion: harnessrl.io/v1alpha1
kind: TrainingRun
metadata: {name: both}
spec:
  model: {path: /models/m}
  rollout: {image: vllm/vllm-openai:v0.32.0, temperature: 1.0}
  harness:
    command: [python, -m, h]
    tasks: {inline: [{id: t1}]}
    sandbox: {runtimeClassName: gvisor}
  learner:
    nodes: 2
    steps: 5
    checkpointDir: /ckpt/both
    checkpointVolume: {pvc: ckpt, mountPath: /ckpt, readOnly: false}
""",
    )
    assert run_validate(path) == (0, [
        f"{path}: OK",
        f"{path}: only on a cluster (harnessrl run leaves them alone): spec.rollout.image, spec.harness.sandbox, "
        "spec.learner.nodes, spec.learner.checkpointVolume",
    ])


def test_clip_problem_names_field_values_and_fix(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "clip.yaml",
        HEADER
        + """\
spec:
  model: {path: /m}
  harness:
    command: [h]
    tasks: {file: {path: t.jsonl}}
  learner:
    algorithm:
      clip: [0.3, 0.2]
""",
    )
    code, lines = run_validate(path)
    assert code == 1
    assert lines == [
        f"{path}:12: spec.learner.algorithm.clip: low 0.3 is above high 0.2 — "
        "write the range as [low, high] "
        "with low <= high, e.g. [0.2, 0.28]"
    ]


def test_every_problem_is_reported_once_on_its_own_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "many.yaml",
        HEADER
        + """\
spec:
  model: {path: /m}
  rollout:
    topp: 0.9
    replicas: "2"
    env:
      - {name: PORT, value: 8080}
  harness:
    command: [h]
    tasks: {file: {path: t.jsonl}}
    concurrency: 0
    sandbox: {networkPolicy: Custom}
  learner:
    deepspeed: {zeroStage: 4}
    group_size: 3
""",
    )
    code, lines = run_validate(path)
    assert code == 1
    assert lines == [
        f"{path}:8: spec.rollout.topp: unknown field 'topp' — did you mean 'topP'?",
        f"{path}:9: spec.rollout.replicas: expected an integer, got '2' (a string) — write a whole number "
        "without quotes",
        f'{path}:11: spec.rollout.env[0].value: expected a string, got 8080 (an integer) — quote it: "8080"',
        f"{path}:15: spec.harness.concurrency: must be at least 1, got 0 — use 1 or more",
        f"{path}:16: spec.harness.sandbox.networkPolicy: 'Custom' is not allowed — did you mean 'custom'?",
        f"{path}:18: spec.learner.deepspeed.zeroStage: must be at most 3, got 4 — use 3 or less",
        f"{path}:19: spec.learner.group_size: unknown field 'group_size' here — it belongs at "
        "spec.harness.groupSize",
    ]


def test_missing_required_fields_and_wrong_kind(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "missing.yaml",
        """\
apiVersion: harnessrl.io/v1
kind: TrainingRun
metadata: {name: x}
spec:
  model: {path: /m}
""",
    )
    code, lines = run_validate(path)
    assert code == 1
    assert lines == [
        f"{path}:1: apiVersion: 'harnessrl.io/v1' is not allowed — did you mean 'harnessrl.io/v1alpha1'?",
        f"{path}:4: spec.harness: required field is missing — add it (the agent harness and its tasks)",
    ]


def test_malformed_yaml_is_one_line_with_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "broken.yaml", HEADER + "spec:\n  model: {path: /m\n  harness: [\n")
    code, lines = run_validate(path)
    assert code == 1
    assert len(lines) == 1
    assert lines[0].startswith(f"{path}:7:")
    assert "malformed YAML" in lines[0] and lines[0].endswith("fix the YAML syntax there")


def test_tabs_and_bad_indentation_are_malformed_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "tabs.yaml", HEADER + "spec:\n\tmodel: {}\n")
    code, lines = run_validate(path)
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"{path}:6:")


def test_unreadable_file_exits_2_and_others_are_still_checked(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    code, lines = run_validate(missing, str(binary), str(MINIMAL_EXAMPLE))
    assert code == 2
    assert lines == [
        f"{missing}: cannot read: No such file or directory",
        f"{binary}: cannot read: not UTF-8 text",
        f"{MINIMAL_EXAMPLE}: OK",
    ]


def test_directory_is_unreadable(tmp_path: Path) -> None:
    code, lines = run_validate(str(tmp_path))
    assert code == 2 and lines == [f"{tmp_path}: cannot read: Is a directory"]


def test_duplicate_keys_are_reported(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys; kubectl's strict decoding refuses them, so do we."""
    text = MINIMAL_EXAMPLE.read_text().replace(
        "kind: TrainingRun\n", "kind: TrainingRun\nkind: TrainingRun\n"
    )
    path = write(tmp_path, "dup.yaml", text)
    code, lines = run_validate(path)
    assert code == 1
    assert lines == [f"{path}:6: kind: duplicate key (first on line 5); YAML keeps only the last — keep one"]


def test_multi_document_files(tmp_path: Path) -> None:
    good = MINIMAL_EXAMPLE.read_text()
    config_map = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: tasks}\ndata: {tasks.jsonl: '{}'}\n"
    bad = good.replace("name: minimal", "name: second").replace(
        "command: [python, -m, my_harness]", "command: []"
    )
    path = write(tmp_path, "multi.yaml", f"{good}---\n{config_map}---\n{bad}")
    code, lines = run_validate(path)
    assert code == 1
    bad_line = (
        len((good + "---\n" + config_map + "---\n").splitlines())
        + bad.splitlines().index("    command: []")
        + 1
    )
    assert lines == [
        f"{path}:{bad_line}: spec.harness.command: needs at least 1 item(s), got 0 — add items or remove "
        "the key"
    ]
    ok = write(tmp_path, "ok.yaml", f"{config_map}---\n{good}")
    assert run_validate(ok) == (0, [f"{ok}: OK (1 other Kubernetes object(s) skipped)"])
    only_other = write(tmp_path, "other.yaml", config_map)
    code, lines = run_validate(only_other)
    assert code == 1 and "no TrainingRun in this file" in lines[0]


def test_empty_file_and_non_mapping(tmp_path: Path) -> None:
    assert run_validate(write(tmp_path, "empty.yaml", "# nothing\n"))[0] == 1
    path = write(tmp_path, "list.yaml", "- a\n- b\n")
    code, lines = run_validate(path)
    assert code == 1
    assert lines == [
        f"{path}:1: expected a TrainingRun (a mapping with apiVersion, kind, metadata, spec), got a list"
    ]


def test_stdin_and_exponent_floats() -> None:
    """`lr: 1e-6` is a number to kubectl; PyYAML alone would read it as a string."""
    text = MINIMAL_EXAMPLE.read_text().replace(
        "  harness:\n", "  learner: {algorithm: {lr: 1e-6}}\n  harness:\n"
    )
    assert run_validate("-", stdin=text) == (0, ["-: OK"])
    [document] = load_documents(text)
    assert document.data["spec"]["learner"]["algorithm"]["lr"] == 1e-6
    assert yaml.safe_load(text)["spec"]["learner"]["algorithm"]["lr"] == "1e-6"


@pytest.mark.parametrize(
    "patch, expected",
    [
        (
            "  rollout: {resources: {limits: {cpu: 0.5}}}\n",
            "spec.rollout.resources.limits.cpu: 0.5 is not a Kubernetes quantity — quote it as a string, "
            'e.g. "0.5" or "500m"',
        ),
        ("  harness2: {}\n", "spec.harness2: unknown field 'harness2' — did you mean 'harness'?"),
        (
            "  rollout: {upstreams: [vllm:8000]}\n",
            "spec.rollout.upstreams[0]: 'vllm:8000' is not an http(s) URL — write it like "
            "http://vllm.example:8000/v1",
        ),
        (
            "  rollout:\n",
            "spec.rollout: expected a mapping, got an empty value (null) — fill it in, or remove the key "
            "to use the default",
        ),
        (
            "  store: {postgres: {secretRef: {name: DB, key: url}}}\n",
            "spec.store.postgres.secretRef.name: 'DB' is not valid here — use a Kubernetes object name: "
            "lowercase letters, "
            "digits, '-' and '.', starting and ending with a letter or digit",
        ),
    ],
    ids=["float-quantity", "typo-near-name", "bad-url", "empty-section", "bad-object-name"],
)
def test_bad_values_give_one_line_each(tmp_path: Path, patch: str, expected: str) -> None:
    text = MINIMAL_EXAMPLE.read_text().replace("spec:\n", "spec:\n" + patch, 1)
    path = write(tmp_path, "bad.yaml", text)
    code, lines = run_validate(path)
    assert code == 1
    assert [line.split(": ", 1)[1] for line in lines] == [expected]


def test_real_subprocess(tmp_path: Path) -> None:
    """The installed `harnessrl` entry point, as a user runs it."""
    executable = shutil.which("harnessrl") or str(Path(sys.executable).with_name("harnessrl"))
    bad = write(
        tmp_path,
        "bad.yaml",
        MINIMAL_EXAMPLE.read_text().replace(
            "command: [python, -m, my_harness]", "command: [python]\n    groupSize: 1"
        ),
    )
    result = subprocess.run(
        [executable, "validate", str(MINIMAL_EXAMPLE), bad],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines() == [
        f"{MINIMAL_EXAMPLE}: OK",
        f"{bad}:13: spec.harness.groupSize: advantage grpo compares rollouts within a group, but groupSize "
        "is 1 "
        "— set harness.groupSize to 2 or more (8 is typical)",
    ]


def _leaf_paths() -> list[tuple]:
    """Every field path the CRD describes (list items as index 0)."""
    from harnessrl.spec.crd import openapi_schema

    paths: list[tuple] = []
    pending: list[tuple[tuple, dict]] = [((), openapi_schema())]
    while pending:
        loc, node = pending.pop()
        if loc:
            paths.append(loc)
        for name, child in node.get("properties", {}).items():
            pending.append(((*loc, name), child))
        if isinstance(node.get("items"), dict):
            pending.append(((*loc, 0), node["items"]))
    return sorted(paths, key=str)


SCALARS = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=12)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def _with(node: object, loc: tuple, value: object) -> object:
    """A copy of ``node`` with ``value`` at ``loc`` (mappings and one-item lists made on the way)."""
    if not loc:
        return value
    head, rest = loc[0], loc[1:]
    if isinstance(head, int):
        items = list(node) if isinstance(node, list) and node else [{}]
        items[0] = _with(items[0], rest, value)
        return items
    mapping = dict(node) if isinstance(node, dict) else {}
    mapping[head] = _with(mapping.get(head), rest, value)
    return mapping


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_leaf_paths()), JSON_VALUES), min_size=1, max_size=3))
def test_any_value_anywhere_gives_one_line_problems_never_an_exception(changes: list) -> None:
    """Random values at random fields: validate_document always answers with one-line problems that name a
    field and say what to do (no exception escapes, no pydantic wording leaks through)."""
    doc = yaml.safe_load(MINIMAL_EXAMPLE.read_text())
    for loc, value in changes:
        doc = _with(doc, loc, value)
    for problem in validate_document(doc):
        assert problem.path and "\n" not in problem.message
        assert " — " in problem.message, problem
