"""Migrations: they build the schema the models describe, on an empty SQLite and PostgreSQL database, re-run
as no-ops, survive concurrent starts, and `harnessrl db` applies them with one-line errors for bad URLs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from click.testing import CliRunner
from sqlalchemy import inspect, text

from harnessrl.cli import main
from harnessrl.store import StoreError, TraceStore
from harnessrl.store.migrate import current_revision, head_revision
from harnessrl.store.schema import Base


def schema_diffs(store: TraceStore) -> list:
    with store.engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)


def test_upgrade_on_empty_database_matches_models_and_reruns_cleanly(store_url: str) -> None:
    store = TraceStore.connect(store_url)
    try:
        assert current_revision(store.engine) is None
        assert schema_diffs(store), "an empty database must differ from the models (else the check is blind)"
        assert store.upgrade() == head_revision()
        assert schema_diffs(store) == []
        tables = set(inspect(store.engine).get_table_names())
        assert set(Base.metadata.tables) <= tables
        assert store.upgrade() == head_revision()  # second run: nothing to do, nothing breaks
        assert schema_diffs(store) == []
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
    finally:
        store.close()


def test_concurrent_upgrades_of_one_empty_database_all_succeed(store_url: str) -> None:
    """Many pods may start at once against a new database; the first migrates, the rest find head."""
    results: list[object] = []

    def upgrade() -> None:
        try:
            with TraceStore.connect(store_url) as s:
                results.append(s.upgrade())
        except Exception as exc:  # collected and asserted below
            results.append(exc)

    threads = [threading.Thread(target=upgrade) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [head_revision()] * 4
    with TraceStore.connect(store_url) as s:
        assert schema_diffs(s) == []


def test_cli_db_upgrade_and_current(store_url: str) -> None:
    runner = CliRunner()
    before = runner.invoke(main, ["db", "current", "--url", store_url])
    assert before.exit_code == 0, before.output
    assert "not migrated" in before.output
    result = runner.invoke(main, ["db", "upgrade", "--url", store_url])
    assert result.exit_code == 0, result.output
    assert f"at revision {head_revision()} (head)" in result.output
    again = runner.invoke(main, ["db", "upgrade"], env={"HARNESSRL_STORE_URL": store_url})
    assert again.exit_code == 0, again.output
    current = runner.invoke(main, ["db", "current", "--url", store_url])
    assert f"at revision {head_revision()} (head)" in current.output
    with TraceStore.connect(store_url) as s:
        assert schema_diffs(s) == []


def harnessrl_executable() -> str:
    found = Path(sys.executable).with_name("harnessrl")
    return str(found) if found.exists() else shutil.which("harnessrl") or "harnessrl"


def test_cli_db_upgrade_as_a_process(store_url: str) -> None:
    proc = subprocess.run(
        [harnessrl_executable(), "db", "upgrade", "--url", store_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"at revision {head_revision()}" in proc.stdout
    with TraceStore.connect(store_url) as s:
        assert current_revision(s.engine) == head_revision()


BAD_URLS = {
    "not a url": "is not a database URL",
    "mysql://user@localhost/db": "does not support",
    "sqlite:////nonexistent-dir/sub/store.db": "cannot connect",
    "postgresql+psycopg://postgres@/nodb?host=/nonexistent-socket-dir": "cannot connect",
}


@pytest.mark.parametrize("url", list(BAD_URLS))
def test_cli_bad_url_is_one_line_error(url: str) -> None:
    result = CliRunner().invoke(main, ["db", "upgrade", "--url", url])
    assert result.exit_code == 1
    assert result.output.startswith("Error: ")
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert BAD_URLS[url] in result.output
    assert "Traceback" not in result.output
    with pytest.raises(StoreError, match=BAD_URLS[url]):
        TraceStore.connect(url)


def test_cli_bad_url_in_a_process_prints_no_traceback() -> None:
    proc = subprocess.run(
        [harnessrl_executable(), "db", "upgrade", "--url", "sqlite:////nonexistent-dir/x.db"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "cannot connect to store sqlite:////nonexistent-dir/x.db" in proc.stderr


def test_password_is_hidden_in_errors() -> None:
    with pytest.raises(StoreError) as info:
        TraceStore.connect("postgresql+psycopg://u:s3cret@/nodb?host=/nonexistent-socket-dir")
    assert "s3cret" not in str(info.value)


def test_cli_upgrade_of_a_database_at_an_unknown_revision_is_one_line(store_url: str) -> None:
    """A database migrated by a newer harnessrl: refuse in one line instead of guessing."""
    with TraceStore.connect(store_url) as s:
        s.upgrade()
        with s.engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = 'from_the_future'"))
    result = CliRunner().invoke(main, ["db", "upgrade", "--url", store_url])
    assert result.exit_code == 1
    assert result.output.startswith("Error: cannot upgrade")
    assert "from_the_future" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_postgres_stores_arrays_as_bytea_and_json_as_exact_text(pg_url: str) -> None:
    """``json`` (not ``jsonb``) keeps the request text as sent; token arrays are ``bytea``, not JSON."""
    with TraceStore.connect(pg_url) as s:
        s.upgrade()
        with s.engine.connect() as conn:
            types = dict(
                conn.execute(
                    text(
                        "SELECT column_name, data_type FROM information_schema.columns "
                        "WHERE table_name = 'llm_calls'"
                    )
                ).all()
            )
    assert {types[c] for c in ("prompt_suffix", "completion_ids", "logprobs", "context_digest")} == {"bytea"}
    assert {types[c] for c in ("request", "response", "response_stripped")} == {"json"}
    assert types["created_at"] == "timestamp with time zone"


def test_upgrade_keeps_the_first_of_duplicate_calls_and_every_kept_call_rebuilds_exactly(store_url: str) -> None:
    """A store written before the unique (rollout, attempt, seq) constraint may hold two calls at one place;
    the upgrade keeps the one made first, deletes the other, and re-encodes in full a kept call that was a
    delta against the deleted one."""
    import dataclasses
    from datetime import timedelta

    from sqlalchemy.exc import IntegrityError
    from synthetic_calls import chat_trajectory

    from harnessrl.store.migrate import downgrade

    calls = chat_trajectory("dup", turns=3, seed=5)
    twin = dataclasses.replace(calls[1], call_id="twin", created_at=calls[1].created_at + timedelta(seconds=1))
    with TraceStore.connect(store_url) as store:
        store.upgrade()  # today's writer writes today's columns; the store then goes back to revision 0001
        store.add_calls(calls[:2])
        store.add_calls([twin])  # its place is taken: stored at seq 2, a delta against calls[1]
        store.add_calls([dataclasses.replace(calls[2], seq=3)])  # a delta against the twin
        assert downgrade(store.engine, "0001") == "0001"
        with store.engine.begin() as conn:  # the duplicate as an older store could hold it
            conn.execute(text("UPDATE llm_calls SET seq = 1 WHERE call_id = 'twin'"))
            conn.execute(text("UPDATE llm_calls SET seq = 2 WHERE call_id = :id"), {"id": calls[2].call_id})
        assert [c.parent_call_id for c in store.rollout_calls("dup", 0)][-1] == "twin"
        assert store.upgrade() == head_revision()
        assert schema_diffs(store) == []
        assert store.read_calls("dup", 0) == calls  # the first made at seq 1 kept; the others bit-exact
        assert [c.parent_call_id for c in store.rollout_calls("dup", 0)] == [None, calls[0].call_id, None]
        with pytest.raises(IntegrityError), store.engine.begin() as conn:
            conn.execute(text("UPDATE llm_calls SET seq = 0 WHERE call_id = :id"), {"id": calls[1].call_id})


def test_upgrade_to_0003_keeps_calls_and_records_the_sampling_of_new_ones(store_url: str) -> None:
    """Revision 0003 adds ``llm_calls.sampling``: a call stored before it reads back unchanged with sampling
    None (not recorded); a call written after it keeps the sampling parameters exactly (COPY and insert)."""
    import dataclasses

    from synthetic_calls import chat_trajectory

    from harnessrl.store.migrate import downgrade

    old = chat_trajectory("before", turns=2, seed=3)
    sampling = {"temperature": 0.7, "top_p": 0.8, "top_k": -1, "min_p": 0.0, "logit_bias": {}}
    new = [dataclasses.replace(c, sampling=sampling) for c in chat_trajectory("after", turns=2, seed=4)]
    with TraceStore.connect(store_url) as store:
        store.upgrade()
        store.add_calls(old)  # written by today's writer, without sampling; then the store goes back to 0002
        assert downgrade(store.engine, "0002") == "0002"
        assert "sampling" not in {c["name"] for c in inspect(store.engine).get_columns("llm_calls")}
        assert store.upgrade() == head_revision()
        assert schema_diffs(store) == []
        assert store.read_calls("before", 0) == old
        assert all(c.sampling is None for c in store.read_calls("before", 0))
        store.add_calls(new)
        assert [c.sampling for c in store.read_calls("after", 0)] == [sampling] * len(new)
        assert store.read_calls("after", 0) == new


def test_upgrade_waits_for_a_store_that_comes_up(tmp_path: Path) -> None:
    """`db upgrade --wait` (the chart's init container) retries while the database cannot be reached, as a
    chart's PostgreSQL that is still starting, and migrates once it can; without --wait it fails at once."""
    folder = tmp_path / "not-yet"
    url = f"sqlite:///{folder}/store.db"
    assert CliRunner().invoke(main, ["db", "upgrade", "--url", url]).exit_code == 1
    appears = threading.Timer(3.0, folder.mkdir)
    appears.start()
    try:
        result = CliRunner().invoke(main, ["db", "upgrade", "--url", url, "--wait", "60"])
    finally:
        appears.cancel()
    assert result.exit_code == 0, result.output
    assert "retrying for up to 60 s" in result.output and "(head)" in result.output
    assert (folder / "store.db").is_file()


def test_upgrade_that_waited_in_vain_names_the_last_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/never/store.db"
    result = CliRunner().invoke(main, ["db", "upgrade", "--url", url, "--wait", "3"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1].startswith(f"Error: cannot connect to store {url}")
