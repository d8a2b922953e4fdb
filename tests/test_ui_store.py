"""The trace explorer's server side on both databases, without a browser: it never writes, its rollout list
filters, sorts and pages in SQL exactly as a filter over every attempt would, a store at an older schema gets
the upgrade command, unknown names are 404s, and a 100k-token call is rendered a page of tokens at a time.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy import insert, select, text, update
from sqlalchemy.exc import DBAPIError
from synthetic_calls import chat_trajectory

from harnessrl.store import CallRecord, CallStatus, RolloutState, TraceStore
from harnessrl.store.learner_ledger import LearnerLedger, StepRows
from harnessrl.store.migrate import downgrade
from harnessrl.store.schema import RolloutAttempt, Run
from harnessrl.ui.app import make_app
from harnessrl.ui.queries import RolloutFilter, rollout_page
from harnessrl.ui.store_access import open_read_only
from harnessrl.ui.token_text import TOKEN_PAGE

RUN = "ui"
ROWS = {"r0-0": 2, "r0-1": 1, "r0-2": 1, "r0-3": 3}  # training rows the learner built from what step 1 consumed


def _fill(store: TraceStore) -> None:
    """Three tasks x four rollouts with every state, rewards, versions and two learner steps."""
    store.add_tasks(RUN, [{"id": f"t{i}"} for i in range(3)])
    states = [RolloutState.SUCCEEDED, RolloutState.FAILED, RolloutState.SUCCEEDED, RolloutState.TIMED_OUT]
    ledger = LearnerLedger(store, RUN)
    ledger.ensure_base_version("/nowhere")
    for t in range(3):
        ids = store.create_rollouts(RUN, f"t{t}", [(f"r{t}-{i}", i) for i in range(4)])
        for i, (rollout_id, state) in enumerate(zip(ids, states, strict=True)):
            store.transition(rollout_id, 0, RolloutState.RUNNING, policy_version=t % 2)
            if state is RolloutState.SUCCEEDED:
                store.set_reward(rollout_id, 0, 0.25 * (i + t))
            store.transition(rollout_id, 0, state, reason=None if state is RolloutState.SUCCEEDED
                             else f"HarnessFailed: exit code {t}")
    ledger.commit(1, "/nowhere/v1", {"rows": 3}, [("r0-0", 0), ("r0-1", 0), ("r0-2", 0), ("r0-3", 0)], 1,
                  rows=StepRows(counts={(r, 0): n for r, n in ROWS.items()}))


def test_the_ui_engine_refuses_every_write(store: TraceStore) -> None:
    _fill(store)
    engine = open_read_only(store.engine.url.render_as_string(hide_password=False))
    try:
        for statement in (insert(Run).values(name="other"),
                          update(RolloutAttempt).values(reward=1.0).where(RolloutAttempt.run == RUN)):
            with engine.connect() as conn, pytest.raises(DBAPIError, match="read-?only"):
                conn.execute(statement)
                conn.commit()
        with engine.connect() as conn:  # and reads still work
            assert conn.execute(text("SELECT count(*) FROM rollout_attempts")).scalar() == 12
    finally:
        engine.dispose()


@pytest.mark.parametrize("query", [
    {}, {"state": "failed"}, {"step": "1"}, {"version": "1"}, {"task": "t2"}, {"reason": "code 2"},
    {"reward_min": "0.5"}, {"reward_min": "0.25", "reward_max": "0.75", "sort": "reward", "order": "asc"},
    {"sort": "reward"}, {"sort": "version", "order": "asc"}, {"sort": "step"}, {"kind": "evaluation"},
    {"rows_min": "2"}, {"rows_max": "1", "sort": "rows", "order": "asc"}, {"sort": "rows"},
    {"sort": "state", "order": "asc"}, {"sort": "reason"}, {"sort": "task", "order": "asc"},
])
def test_the_rollout_list_is_what_a_filter_over_every_attempt_gives(store: TraceStore, query: dict[str, str]):
    _fill(store)
    attempts = store.list_attempts(RUN)
    filt = RolloutFilter.parse(query)

    def keep(a: Any) -> bool:
        return ((filt.state is None or a.state.value == filt.state) and (filt.step is None or a.consumed_by_step ==
                filt.step) and (filt.version is None or a.policy_version_start == filt.version)
                and (filt.task is None or a.task_id == filt.task)
                and (filt.reason is None or filt.reason in (a.reason or ""))
                and (filt.reward_min is None or (a.reward is not None and a.reward >= filt.reward_min))
                and (filt.reward_max is None or (a.reward is not None and a.reward <= filt.reward_max))
                and (filt.rows_min is None or ROWS.get(a.rollout_id, -1) >= filt.rows_min)
                and (filt.rows_max is None or 0 <= ROWS.get(a.rollout_id, -1) <= filt.rows_max)
                and filt.kind != "evaluation")

    expected = [a for a in attempts if keep(a)]
    seen = []
    for page in (1, 2, 3, 4):  # pages of 4
        result = rollout_page(store.engine, RUN, RolloutFilter.parse({**query, "per_page": "4", "page": str(page)}))
        assert result.total == len(expected)
        seen += result.rows
    assert sorted(r.rollout_id for r in seen) == sorted(a.rollout_id for a in expected)
    assert {r.rollout_id: r.rows for r in seen if r.rows is not None} == {k: v for k, v in ROWS.items()
                                                                            if k in {r.rollout_id for r in seen}}
    key = {"created": "created_at", "reward": "reward", "version": "version", "step": "step",
           "rows": "rows", "state": "state", "reason": "reason", "task": "task_id"}[filt.sort]
    values = [getattr(r, key) for r in seen if getattr(r, key) is not None]
    assert values == sorted(values, reverse=filt.order == "desc")
    assert all(getattr(r, key) is not None for r in seen[: len(values)])  # no value sorts last


@pytest.mark.parametrize("query, says", [({"step": "x"}, "step='x' is not an integer"),
                                         ({"state": "lost"}, "state='lost' is not one of"),
                                         ({"sort": "size"}, "sort='size' is not one of"),
                                         ({"page": "0"}, "page='0' must be at least 1")])
def test_a_bad_filter_names_the_parameter(query: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        RolloutFilter.parse(query)


@pytest.fixture
async def client(store: TraceStore) -> AsyncIterator[TestClient]:
    engine = open_read_only(store.engine.url.render_as_string(hide_password=False))
    async with TestClient(TestServer(make_app(engine))) as test_client:
        yield test_client
    engine.dispose()


async def test_unknown_names_are_404_pages(store: TraceStore, client: TestClient) -> None:
    _fill(store)
    for path, says in (("/runs/nope", "no run &#39;nope&#39;"), (f"/runs/{RUN}/rollouts/nope", "no rollout"),
                       (f"/runs/{RUN}/rollouts?step=7", "no learner step 7 (steps 1-1 are committed)"),
                       (f"/runs/{RUN}/rollouts/r0-0?attempt=3", "attempt 3"),
                       (f"/runs/{RUN}/compare?task=t9", "no rollout of task"), ("/nothing/here", "no page")):
        response = await client.get(path)
        assert response.status == 404, path
        assert says in await response.text(), path


async def test_a_store_at_an_older_schema_gets_the_upgrade_command(store: TraceStore, client: TestClient) -> None:
    downgrade(store.engine, "0004")
    response = await client.get("/")
    assert response.status == 503
    body = await response.text()
    assert "is at schema revision 0004" in body and "harnessrl db upgrade --url" in body


async def test_a_100k_token_call_is_rendered_a_page_of_tokens_at_a_time(store: TraceStore, client: TestClient):
    [call] = chat_trajectory("huge", 1, system_tokens=100_000, observation_tokens=10, completion_tokens=50,
                             run=RUN)
    store.add_calls([call])
    total = len(call.prompt_token_ids) + len(call.completion_token_ids)
    assert total > 100_000
    response = await client.get(f"/runs/{RUN}/rollouts/huge")
    assert response.status == 200
    body = await response.text()
    assert body.count(' data-pos=') == TOKEN_PAGE
    assert f"tokens 0–{TOKEN_PAGE} of {total}" in body
    assert len(body) < 3_000_000  # the 400 kB system prompt is cut in the conversation too
    last = (total - 1) // TOKEN_PAGE * TOKEN_PAGE
    response = await client.get(f"/runs/{RUN}/rollouts/huge?from={last}")
    body = await response.text()
    assert body.count('data-trained="1"') == len(call.completion_token_ids)  # the completion ends the row
    assert f"tokens {last}–{total} of {total}" in body


async def test_the_token_view_shows_why_each_row_began_and_the_learners_stored_log_probs(store: TraceStore,
                                                                                        client: TestClient):
    """Two conversations in one attempt make two rows, the second split off as a new conversation where its
    prompt leaves the first (position 0); the learner's log-probs stored with step 1 sit on the trained tokens
    only (the second call's middle token, log-prob 0, was forced: no decision, none stored)."""
    ledger = LearnerLedger(store, RUN)
    ledger.ensure_base_version("/nowhere")
    store.add_tasks(RUN, [{"id": "s"}])
    [rollout] = store.create_rollouts(RUN, "s", [("split", 0)])
    store.transition(rollout, 0, RolloutState.RUNNING, policy_version=0)
    store.add_calls([CallRecord(f"split-c{seq}", RUN, rollout, 0, seq, "completions", {"prompt": "p"}, None,
                                prompt, completion, logprobs, 0)
                     for seq, (prompt, completion, logprobs) in enumerate([([1, 2, 3], [4, 5], [-0.5, -0.25]),
                                                                           ([9, 9], [6, 7, 8], [-1.0, 0.0, -2.0])])])
    store.set_reward(rollout, 0, 1.0)
    store.finish_attempt(rollout, 0, RolloutState.SUCCEEDED)
    ledger.commit(1, "/nowhere/v1", {}, [(rollout, 0)], rows=StepRows(
        counts={(rollout, 0): 2}, logprobs={(rollout, 0, 0): [-0.625, -0.375], (rollout, 0, 1): [-1.125, -2.5]}))

    first = await (await client.get(f"/runs/{RUN}/rollouts/split")).text()
    assert "the attempt's first row" in first and "split: new_conversation)" in first  # the row list
    assert re.findall(r'data-pos="(\d+)" [^>]*data-learner="([^"]+)"', first) == [("3", "-0.625"), ("4", "-0.375")]
    response = await client.get(f"/runs/{RUN}/rollouts/split?row=1")
    second = await response.text()
    assert response.status == 200
    assert re.search(r'id="split-reason">new_conversation</b>:\s*its prompt leaves the content of the row it split '
                     r'from at position 0', second)
    assert re.findall(r'data-pos="(\d+)" [^>]*data-learner="([^"]+)"', second) == [("2", "-1.125"), ("4", "-2.5")]
    assert 'data-pos="3" data-id="7" data-trained="0"' in second  # the forced token
    assert "learner log-prob -2.5000" in second and "behaviour log-prob -2.0000" in second
    page = rollout_page(store.engine, RUN, RolloutFilter.parse({"rows_min": "2"}))
    assert [(r.rollout_id, r.rows) for r in page.rows] == [("split", 2)]


def _chat_attempt(store: TraceStore, rollout: str, turns: list[tuple[list[dict], dict | None]],
                  failed_last: bool = False) -> None:
    """An attempt whose calls resend the conversation so far plus new messages (``turns``: the new messages and
    the answer of each call), stored as deltas the way a proxy stores them."""
    store.create_rollouts(RUN, "f", [(rollout, 0)])
    store.transition(rollout, 0, RolloutState.RUNNING, policy_version=0)
    messages: list[dict] = [{"role": "system", "content": "sys"}]
    calls = []
    for seq, (new, answer) in enumerate(turns):
        messages = messages + new
        last = failed_last and seq == len(turns) - 1
        response = {"error": "upstream boom 42"} if last else {"choices": [{"message": answer,
                                                                              "finish_reason": "stop"}]}
        calls.append(CallRecord(f"{rollout}-{seq}", RUN, rollout, 0, seq, "chat", {"messages": messages}, response,
                                list(range(1, 4 + 3 * seq)), [] if last else [7, 8], [] if last else [-0.5, -0.5],
                                0, status=CallStatus.ERROR if last else CallStatus.OK,
                                http_status=500 if last else 200, finish_reason=None if last else "stop"))
        if not last:
            messages = messages + [answer]
    store.add_calls(calls)
    store.finish_attempt(rollout, 0, RolloutState.FAILED, "HarnessFailed: exit code 1")


def test_failure_signatures_read_from_stored_calls_equal_the_full_calls(store: TraceStore) -> None:
    """The failures page reads each attempt's last call as stored; a tool error among the messages that call
    added, one only in earlier messages (the call is rebuilt then) and a failed call's error give the
    signatures the full calls give."""
    from harnessrl.store.schema import LlmCall
    from harnessrl.ui.failures import failure_groups

    store.add_tasks(RUN, [{"id": "f"}])
    ask = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                  "function": {"name": "ls", "arguments": "{}"}}]}
    _chat_attempt(store, "tail", [([{"role": "user", "content": "go"}], ask),
                                  ([{"role": "tool", "tool_call_id": "c1", "content": "Error: file 12 not found"}],
                                   {"role": "assistant", "content": "done"})])
    _chat_attempt(store, "earlier", [([{"role": "user", "content": "go"}], ask),
                                     ([{"role": "tool", "tool_call_id": "c1", "content": "Traceback: line 3"}],
                                      {"role": "assistant", "content": "hm"}),
                                     ([{"role": "user", "content": "continue"}], {"role": "assistant",
                                                                                  "content": None})])
    _chat_attempt(store, "broken", [([{"role": "user", "content": "go"}], ask),
                                    ([{"role": "tool", "tool_call_id": "c1", "content": "ok"}], None)],
                  failed_last=True)
    with store.engine.connect() as conn:  # the last calls are deltas: only their new messages are stored
        reused = dict(conn.execute(select(LlmCall.rollout_id, LlmCall.request_reused).where(LlmCall.seq > 0)
                                   .order_by(LlmCall.seq)).all())
    assert all(reused.get(r) for r in ("tail", "earlier", "broken")), reused
    groups = {g.representative[0]: (g.exit, g.error, g.tool_error, g.final)
              for g in failure_groups(store.engine, RUN)["groups"]}
    exit_ = "failed: HarnessFailed: exit code N"
    assert groups == {"tail": (exit_, "", "Error: file N not found", "stop, text"),
                      "earlier": (exit_, "", "Traceback: line N", "stop, empty"),
                      "broken": (exit_, "HTTP 500: upstream boom N", "", "error, no answer")}


def test_the_command_names_what_is_wrong_with_its_arguments(tmp_path) -> None:
    from click.testing import CliRunner

    from harnessrl.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["ui"], env={"HARNESSRL_STORE_URL": ""})
    assert result.exit_code == 2 and "give a run directory (RUN_DIR) or --store URL" in result.output
    result = runner.invoke(main, ["ui", str(tmp_path)], env={"HARNESSRL_STORE_URL": "sqlite:///elsewhere.db"})
    assert result.exit_code == 1 and "is not a run directory (no run.json)" in result.output  # RUN_DIR wins
    result = runner.invoke(main, ["ui", str(tmp_path), "--store", "sqlite:///x.db"])
    assert result.exit_code == 2 and "not both" in result.output
    result = runner.invoke(main, ["ui", "--store", "mysql://h/db"])
    assert result.exit_code == 1 and "which the store does not support" in result.output
