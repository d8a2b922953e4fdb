"""The sandbox's pod mode (``HARNESSRL_SANDBOX=pod``), what the coding example's image runs in a harness pod,
where the pod is the sandbox and bubblewrap cannot make namespaces: each command is still a child with a
cleared environment, killed with its whole process group at its time limit, and the verifier still takes only
the library's modules from the agent's tree and scores the known fix 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.swe.repository import apply_patch
from harnessrl.swe.sandbox import MODE_ENV, POD_MODE, SandboxLimits, SandboxUnavailable, run_sandboxed
from harnessrl.swe.verifier import verify
from harnessrl.swe.workspace import prepare_workspace

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "swe"


@pytest.fixture
def pod_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODE_ENV, POD_MODE)


def test_a_command_gets_a_cleared_environment_and_no_user_site(pod_mode, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HARNESSRL_REWARD_TOKEN", "never-seen-by-commands")
    result = run_sandboxed([sys.executable, "-c", "import json, os, site; print(json.dumps("
                            "[dict(os.environ), site.ENABLE_USER_SITE, os.getcwd()]))"],
                           writable=[tmp_path], env={"EXTRA": "1"})
    environment, user_site, cwd = json.loads(result.output)
    assert result.returncode == 0 and not result.timed_out
    assert "HARNESSRL_REWARD_TOKEN" not in environment and environment["EXTRA"] == "1"
    assert environment["PYTHONNOUSERSITE"] == "1" and user_site is False
    assert cwd == str(tmp_path)


def test_the_time_limit_kills_the_commands_process_group(pod_mode, tmp_path) -> None:
    """A command that forks a child and ignores SIGTERM is killed with its child at the limit."""
    result = run_sandboxed(["bash", "-c", "trap '' TERM; (sleep 300; echo late > late.txt) & sleep 300"],
                           writable=[tmp_path], limits=SandboxLimits(timeout_s=1))
    assert result.timed_out and result.reason == "killed: it passed the sandbox's time limit"
    listed = subprocess.run(["pgrep", "-f", "sleep 300; echo late"], capture_output=True, text=True)
    assert listed.stdout.strip() == ""
    assert not (tmp_path / "late.txt").exists()


def test_a_misspelt_mode_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(MODE_ENV, "pods")
    with pytest.raises(SandboxUnavailable, match="HARNESSRL_SANDBOX='pods'"):
        run_sandboxed(["true"], writable=[tmp_path])


def test_the_verifier_in_pod_mode_scores_the_fix_1_and_the_bug_0(pod_mode, tmp_path) -> None:
    task = json.loads((EXAMPLE / "tasks.jsonl").read_text().splitlines()[0])["data"]
    fixed = tmp_path / "fixed"
    apply_patch(prepare_workspace(task, EXAMPLE, fixed), task["patch"])
    assert verify(task, fixed).reward == 1.0
    buggy = tmp_path / "buggy"
    prepare_workspace(task, EXAMPLE, buggy)
    verdict = verify(task, buggy)
    assert verdict.reward == 0.0 and "tests_not_run" not in verdict.info, verdict.info


def test_unpacking_without_the_standard_librarys_filter(tmp_path, monkeypatch) -> None:
    """Before Python 3.11.4 (Debian bookworm's 3.11.2, the dev cluster's image base) tarfile has no "data"
    filter: a real sdist still unpacks, and an archive with a member outside its folder or a link is refused."""
    import io
    import tarfile

    from harnessrl.swe.repository import RepositoryError, unpack

    monkeypatch.delattr(tarfile, "data_filter")
    top = unpack(EXAMPLE / "repos" / "inflection-0.5.1.tar.gz", tmp_path / "ok")
    assert (top / "inflection" / "__init__.py").is_file()
    for name, kind in (("../escaped.py", tarfile.REGTYPE), ("pkg/link", tarfile.SYMTYPE)):
        archive = tmp_path / "bad.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            member = tarfile.TarInfo(name)
            member.type, member.linkname = kind, "/etc/passwd"
            tar.addfile(member, io.BytesIO(b""))
        with pytest.raises(RepositoryError, match="not a plain file or folder"):
            unpack(archive, tmp_path / "bad")
        assert not (tmp_path / "escaped.py").exists() and not (tmp_path / "bad" / "pkg" / "link").exists()
