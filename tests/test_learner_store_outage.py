"""The learner waits through a database restart instead of exiting (issue 22, fault 4 on the real node: the
learner pod crash-looped while the chart's PostgreSQL pod was rescheduled, and its Job's backoffLimit failed
the run). Real PostgreSQL, taken away from every client and given back, while a real learner polls for a group.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
from learner_helpers import Sample, record_group, sample_completions
from pg_helpers import BlockableDatabase

from harnessrl.store import TraceStore
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.trainer.engine import EngineSettings, PolicyEngine
from harnessrl.trainer.learner import Learner, LearnerSettings

PROMPT = list(range(40, 56))


@pytest.mark.postgres
def test_the_learner_waits_for_a_database_that_restarts(pg_url: str, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    from harnessrl.tiny_model import build_tiny_model

    tiny = build_tiny_model(tmp_path / "tiny")
    samples = [Sample(((PROMPT, completion, logprobs),), float(i % 2))
               for i, (completion, logprobs) in enumerate(sample_completions(tiny, PROMPT, 4, 4, seed=1))]
    store = TraceStore.connect(pg_url)
    store.upgrade()
    db = BlockableDatabase(pg_url)
    settings = LearnerSettings(run="outage", model_dir=tiny, output_dir=tmp_path / "out", steps=1, tasks_per_step=1,
                               group_size=4, poll_interval_s=0.2, engine=EngineSettings(lr=1e-3))
    learner_store = TraceStore.connect(pg_url)
    outcome: list = []
    failure: list[BaseException] = []

    def learn() -> None:
        try:
            outcome.extend(Learner(settings, PolicyEngine(tiny, settings.engine), learner_store).run())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failure.append(exc)

    caplog.set_level(logging.INFO, logger="harnessrl.trainer.learner")
    thread = threading.Thread(target=learn)
    try:
        thread.start()
        deadline = time.monotonic() + 120
        while LearnerLedger(store, "outage").version(0) is None:  # resumed: now it polls for a group
            assert time.monotonic() < deadline and not failure, failure
            time.sleep(0.2)
        db.block()
        while "the store does not answer" not in caplog.text:
            assert time.monotonic() < deadline and not failure, failure
            time.sleep(0.2)
        time.sleep(1.0)  # several polls into the outage
        db.unblock()
        store.engine.dispose()  # this test's own connections were ended by the block too
        record_group(store, "outage", "t0", samples)
        thread.join(180)
    finally:
        db.close()
    assert not failure, failure
    assert [o.version for o in outcome] == [1]
    assert "the store answers again" in caplog.text
    assert LearnerLedger(store, "outage").committed_version() == 1
    learner_store.close()
    store.close()
