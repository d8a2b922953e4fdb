"""The trace explorer (`harnessrl ui`) in a real browser (Debian's Chromium through Playwright) against the store
of a real short run: `harnessrl run` of the vowels example on the tiny model (vLLM on the CPU, DeepSpeed), two
steps, with an evaluation each step and harnesses that crash or report no reward, so every page has something
to show.

Checked: every page renders with no console error (and a screenshot of each is kept: the directory is printed,
``$HARNESSRL_TEST_ARTIFACTS`` when set); the rollout list's filters (rows per rollout among them), sort and pages
give what the store holds; the token view's trained/context split and advantage equal the rows
``Learner._build_batch`` builds for the same step, and the learner's own log-probs, stored by the step, sit on
exactly its trained tokens; unknown runs, rollouts and steps are 404 pages; a store written after the page
loaded shows up live.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from sqlalchemy import select

from harnessrl.store import RolloutState, TraceStore
from harnessrl.store.schema import Rollout
from harnessrl.store.evaluations import evaluated_versions
from harnessrl.store.learner_ledger import ClaimedAttempt, LearnerLedger, StepClaim

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
RUN = "ui-e2e"
STEPS = 2
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-step run of the vowels example, with failing harnesses and evaluations
    (``$HARNESSRL_TEST_UI_RUN_DIR``: a run directory this fixture made before, to use instead)."""
    from harnessrl.tiny_model import build_tiny_model

    if os.environ.get("HARNESSRL_TEST_UI_RUN_DIR"):
        return Path(os.environ["HARNESSRL_TEST_UI_RUN_DIR"])

    base = tmp_path_factory.mktemp("ui-run")
    model = build_tiny_model(base / "model")
    spec = yaml.safe_load((ROOT / "examples/vowels/trainingrun.yaml").read_text())
    spec["metadata"]["name"] = RUN
    spec["spec"]["model"]["path"] = str(model)
    harness = spec["spec"]["harness"]
    harness["command"] = ["python", str(ROOT / "tests/harnesses/chaos_harness.py")]
    tasks = [json.loads(line) for line in (ROOT / "examples/vowels/tasks.jsonl").read_text().splitlines()[:6]]
    tasks += [{"id": f"chaos-{b}", "data": {"behaviour": b}} for b in ("crash", "noreward")]
    harness["tasks"] = {"inline": tasks}
    spec["spec"]["learner"]["tasksPerStep"] = 2
    spec["spec"]["learner"]["steps"] = STEPS
    evaluation_tasks = (ROOT / "examples/vowels/eval-tasks.jsonl").read_text().splitlines()[:2]
    spec["spec"]["evaluation"] = {"tasks": {"inline": [json.loads(line) for line in evaluation_tasks]},
                                  "everySteps": 1}
    (base / "run.yaml").write_text(yaml.safe_dump(spec))
    out = base / "run"
    proc = subprocess.run([sys.executable, "-m", "harnessrl.cli", "run", str(base / "run.yaml"), "--run-dir",
                           str(out), "--no-live"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def store(run_dir: Path) -> Iterator[TraceStore]:
    from harnessrl.ui.store_access import open_read_only

    read_only = TraceStore(open_read_only(f"sqlite:///{run_dir / 'trace.sqlite'}"))
    yield read_only
    read_only.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ui(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`harnessrl ui RUN_DIR` as a user starts it; its base URL."""
    port = _free_port()
    log = tmp_path_factory.mktemp("ui-log") / "ui.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "harnessrl.cli", "ui", str(run_dir), "--port", str(port)],
                                stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("HARNESSRL_TEST_ARTIFACTS")
    path = Path(where) / "ui" if where else tmp_path_factory.mktemp("ui-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    print(f"\nUI screenshots: {path}")
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        context = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900})
        yield context
        context.close()


class Page:
    """A browser tab that records console errors and uncaught exceptions."""

    def __init__(self, context: Any) -> None:
        self.tab = context.new_page()
        self.errors: list[str] = []
        self.tab.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.tab.on("pageerror", lambda e: self.errors.append(str(e)))

    def open(self, url: str) -> Any:
        return self.tab.goto(url, wait_until="load")  # scripts are synchronous: charts are drawn by then

    def click(self, selector: str) -> None:
        """Click a link or button that loads a page, and wait for it."""
        with self.tab.expect_navigation(wait_until="load"):
            self.tab.click(selector)


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    tab = Page(browser)
    yield tab
    tab.tab.close()


def _a_trained_rollout(store: TraceStore) -> str:
    """A rollout that succeeded and that a learner step consumed (a crashed one may have no call to show)."""
    return next(a.rollout_id for a in store.list_attempts(RUN, [RolloutState.SUCCEEDED])
                if a.consumed_by_step is not None)


def test_every_page_renders_with_no_console_error(ui: str, store: TraceStore, page: Page, artifacts: Path):
    rollout = _a_trained_rollout(store)
    with store.engine.connect() as conn:  # a held-out task: evaluated at every version, so Compare has columns
        task = conn.scalar(select(Rollout.task_id).where(Rollout.run == RUN, Rollout.kind == "evaluation")
                           .order_by(Rollout.task_id).limit(1))
    pages = {
        "runs": "/", "overview": f"/runs/{RUN}", "rollouts": f"/runs/{RUN}/rollouts",
        "rollout": f"/runs/{RUN}/rollouts/{rollout}", "failures": f"/runs/{RUN}/failures",
        "compare": f"/runs/{RUN}/compare?task={task}",
    }
    for name, path in pages.items():
        response = page.open(ui + path)
        assert response.status == 200, (name, response.status)
        page.tab.screenshot(path=str(artifacts / f"{name}.png"))
        if name == "rollout":  # and the token view itself, scrolled into sight
            page.tab.locator("#tokens").screenshot(path=str(artifacts / "rollout-tokens.png"))
        assert page.errors == [], (name, page.errors)
    # what the pages say is what the store holds
    page.open(ui + "/")
    row = page.tab.locator("#runs tbody tr", has_text=RUN)
    assert f"{STEPS} / {STEPS}" in row.inner_text() and "done" in row.inner_text()
    page.open(ui + f"/runs/{RUN}")
    assert page.tab.locator("figure.chart .uplot canvas").count() == 5  # every curve drawn by uPlot
    counts = store.count_attempts(RUN)
    for state, n in counts.items():
        assert page.tab.locator(f"#states .state.{state.value} b").inner_text() == str(n)
    assert page.tab.locator("#steps tbody tr").count() == STEPS
    assert page.tab.locator("#evaluation tbody tr").count() >= 2  # v0 and the versions after each step
    page.open(ui + f"/runs/{RUN}/failures")
    failed = counts[RolloutState.FAILED]
    assert failed >= 1
    groups = page.tab.locator("#failure-groups tbody tr")
    exits = [groups.nth(i).inner_text() for i in range(groups.count())]
    crash = [text for text in exits if "HarnessFailed: exit code N" in text]  # the crash harness's exit 3
    assert len(crash) == 1, exits
    page.open(ui + f"/runs/{RUN}/compare?task={task}")
    columns = page.tab.locator("#compare .col")
    evaluated = sorted(evaluated_versions(store, RUN))  # v0 (atStart), then each version a step made
    assert len(evaluated) >= 2
    assert [int(columns.nth(i).get_attribute("data-version")) for i in range(columns.count())] == evaluated


def test_rollout_list_filters_sort_and_pages(ui: str, store: TraceStore, page: Page):
    attempts = store.list_attempts(RUN)
    page.open(ui + f"/runs/{RUN}/rollouts")
    assert page.tab.locator("#rollouts tbody tr").count() == min(len(attempts), 50)

    # a state picked in the form, applied by the server
    page.tab.select_option("#filters select[name=state]", "failed")
    page.click("#apply")
    rows = page.tab.locator("#rollouts tbody tr")
    failed = {a.rollout_id for a in attempts if a.state is RolloutState.FAILED}
    assert {rows.nth(i).get_attribute("data-rollout") for i in range(rows.count())} == failed

    # a step: exactly the attempts that step consumed
    page.open(ui + f"/runs/{RUN}/rollouts")
    page.tab.fill("#filters input[name=step]", "1")
    page.click("#apply")
    rows = page.tab.locator("#rollouts tbody tr")
    shown = {rows.nth(i).get_attribute("data-rollout") for i in range(rows.count())}
    assert shown == {rollout_id for rollout_id, _ in LearnerLedger(store, RUN).consumed_by(1)}

    # sorted by reward, ascending, by clicking the column twice (descending first); no reward sorts last
    page.open(ui + f"/runs/{RUN}/rollouts?reward_min=0")
    page.click("a.sort[data-sort=reward]")
    page.click("a.sort[data-sort=reward]")
    rows = page.tab.locator("#rollouts tbody tr")
    rewards = [float(rows.nth(i).get_attribute("data-reward")) for i in range(rows.count())]
    expected = sorted(a.reward for a in attempts if a.reward is not None and a.reward >= 0)
    assert rewards == expected[:50]

    # pages of 5 cover every attempt once
    seen: list[str] = []
    page.open(ui + f"/runs/{RUN}/rollouts?per_page=5")
    while True:
        rows = page.tab.locator("#rollouts tbody tr")
        seen += [f"{rows.nth(i).get_attribute('data-rollout')}" for i in range(rows.count())]
        if page.tab.locator("#next-page").count() == 0:
            break
        page.click("#next-page")
    assert sorted(seen) == sorted(a.rollout_id for a in attempts)  # one attempt per rollout in this run

    # rows per rollout: what the learner's row code builds from each consumed attempt, as each step recorded it
    from harnessrl.ui.training_view import training_view

    page.open(ui + f"/runs/{RUN}/rollouts?rows_min=1&per_page=500")
    rows = page.tab.locator("#rollouts tbody tr")
    shown_rows = {rows.nth(i).get_attribute("data-rollout"): int(rows.nth(i).get_attribute("data-rows"))
                  for i in range(rows.count())}
    consumed = [a for a in attempts if a.consumed_by_step is not None]
    built = {a.rollout_id: len(training_view(store.engine, RUN, a.rollout_id, a.attempt).rows) for a in consumed}
    assert shown_rows == {rollout_id: n for rollout_id, n in built.items() if n >= 1} and shown_rows
    assert page.errors == []


def _learner_batch(store: TraceStore, step: int) -> dict[tuple[str, int], list[Any]]:
    """The rows ``Learner._build_batch`` builds for the attempts ``step`` consumed, as the learner held them."""
    import torch

    from harnessrl.trainer.engine import DistInfo
    from harnessrl.trainer.learner import Learner
    from harnessrl.ui.training_view import learner_settings

    settings, _ = learner_settings(store.engine, RUN)
    engine = SimpleNamespace(dist=DistInfo(0, 1, 0, torch.device("cpu")))
    with tempfile.TemporaryDirectory() as out:
        learner = Learner(replace(settings, output_dir=Path(out)), engine, store)  # type: ignore[arg-type]
        metrics = LearnerLedger(store, RUN).step_metrics(step) or {}
        learner.version = metrics["policy_version"] - (0 if metrics.get("empty_step") else 1)
        keys = LearnerLedger(store, RUN).consumed_by(step)
        records = store.get_attempts(keys)
        claim = StepClaim(tuple(sorted({r.task_id for r in records.values()})), tuple(
            ClaimedAttempt(r.rollout_id, r.attempt, r.task_id, r.group_index, r.state, r.reward,
                           r.policy_version_start) for r in records.values()))
        parts, info = learner._build_batch(claim)
    assert info["rows"] == metrics["rows"]  # the same rows the learner built when it trained this step
    batch: dict[tuple[str, int], list[Any]] = {key: [] for key in keys}
    for part in parts:
        for row in part:
            batch[row.key].append(row)
    return batch


def test_token_view_equals_the_learners_rows(ui: str, store: TraceStore, page: Page):
    trained = 0
    for step in range(1, STEPS + 1):
        for (rollout_id, attempt), rows in _learner_batch(store, step).items():
            page.open(ui + f"/runs/{RUN}/rollouts/{rollout_id}?attempt={attempt}")
            tokens = page.tab.locator("#tokens .tok")
            ids = np.array([int(x) for x in tokens.evaluate_all("els => els.map(e => e.dataset.id)")])
            split = np.array([int(x) for x in tokens.evaluate_all("els => els.map(e => e.dataset.trained)")])
            advantage = page.tab.locator("#advantage").inner_text()
            if not rows:  # the learner trained nothing of it (e.g. its group's rewards were equal)
                assert advantage == "–", (rollout_id, advantage)
                continue
            (row,) = rows  # the vowels harness's two calls merge into one row
            assert ids.tolist() == row.input_ids.tolist()
            assert split.tolist() == row.loss_mask.tolist(), rollout_id  # trained vs context, token by token
            value = float(row.advantages[np.flatnonzero(row.loss_mask)[0]])
            assert float(advantage) == pytest.approx(value, abs=5e-5)
            # the learner's log-probs, stored by the step, on exactly the tokens it trained (its targets)
            learner = tokens.evaluate_all("els => els.map(e => e.dataset.learner ?? null)")
            on = [i for i, value in enumerate(learner) if value is not None]
            assert on == (np.flatnonzero(row.loss_mask[1:]) + 1).tolist(), rollout_id
            assert all(np.isfinite(float(learner[i])) and float(learner[i]) <= 0 for i in on)
            trained += 1
    assert trained >= 2
    assert page.errors == []


def test_unknown_run_rollout_and_step_are_404_pages(ui: str, page: Page):
    for path, says in (("/runs/nope", "no run 'nope'"), (f"/runs/{RUN}/rollouts/nope", "no rollout 'nope'"),
                       (f"/runs/{RUN}/rollouts?step=99", "no learner step 99")):
        response = page.open(ui + path)
        assert response.status == 404
        assert says in page.tab.locator("#error-message").inner_text()
    response = page.open(ui + f"/runs/{RUN}/rollouts?step=one")
    assert response.status == 400 and "step='one' is not an integer" in page.tab.locator("#error-message").inner_text()


def test_pages_update_live_while_the_store_changes(ui: str, run_dir: Path, page: Page):
    """The runs page picks up a run created after it loaded, without a reload (the live toggle is on)."""
    probe = f"live-probe-{uuid.uuid4().hex[:8]}"
    page.open(ui + "/")
    assert page.tab.locator("#runs", has_text=probe).count() == 0
    with TraceStore.connect(f"sqlite:///{run_dir / 'trace.sqlite'}") as writer:
        writer.ensure_run(probe)
    page.tab.wait_for_selector(f"#runs >> text={probe}", timeout=30_000)
    assert page.errors == []
