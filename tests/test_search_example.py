"""examples/search without a model: its corpus and questions, the BM25 index, the reward, and the harness's
scripted modes through the runner's process backend (spec.harness.verifier: the harness, then ``harnessrl search
verify`` on its workspace) and the real capture proxy.

The tiny random model answers no question, so what shows the pipeline is right is this: the scripted oracle,
searching the same index the model's tool does, is scored 1 on every task of examples/search/tasks.jsonl and the
no-op 0, every reward coming from the verifier, which alone has the token."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import harness_modes
import pytest
from harness_modes import HARNESSRL, TOKEN
from proxy_servers import loops, make_proxy, upstream  # noqa: F401 - pytest fixtures

from harnessrl.search.corpus import generate
from harnessrl.search.index import SearchIndex
from harnessrl.search.reward import exact_match, token_f1
from harnessrl.search.verifier import verify
from harnessrl.store import RolloutState

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "search"
RUN = "search-modes"


def tasks() -> list[dict]:
    return [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]


def test_the_shipped_tasks_and_corpus_are_the_commands_output_for_seed_0(tmp_path):
    output = tmp_path / "tasks.jsonl"
    done = subprocess.run([HARNESSRL, "search", "tasks", "--output", str(output)], capture_output=True, text=True,
                          check=True)
    assert "32 tasks over 103 documents" in done.stdout
    assert output.read_text() == (EXAMPLE / "tasks.jsonl").read_text()
    assert (tmp_path / "corpus.jsonl").read_text() == (EXAMPLE / "corpus.jsonl").read_text()
    other = tmp_path / "seed1" / "tasks.jsonl"
    subprocess.run([HARNESSRL, "search", "tasks", "--output", str(other), "--seed", "1"], check=True,
                   capture_output=True)
    assert other.read_text() != output.read_text()
    refused = subprocess.run([HARNESSRL, "search", "tasks", "--output", str(tmp_path / "x.jsonl"), "--people", "3",
                              "--count", "7"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--count 7: 3 people give 6 questions; raise --people" in refused.stderr


def test_each_question_needs_two_documents_and_the_answer_is_only_in_the_second():
    documents, questions = generate(0)
    text = {d.id: d.text for d in documents}
    for question in questions:
        first, second = question.supporting
        assert question.answer in text[second] and question.answer not in text[first]
        assert question.answer not in question.question
        names = {d.title for d in documents}
        assert len(names) == len(documents)  # every entity has one document


def test_bm25_finds_the_first_hop_from_the_question_and_nothing_for_unknown_words():
    index = SearchIndex.from_file(EXAMPLE / "corpus.jsonl")
    for task in tasks():
        assert index.search(task["data"]["question"], 1)[0]["id"] == task["data"]["supporting"][0]
    assert index.search("zzzz qqqq") == [] and index.search("the of a") == [] and index.search("") == []
    # a one-word query (its one token id is 0) and unknown words beside a known one
    assert [d["text"].split(" is a ")[0] for d in index.search("zzzz born", 3)] == [
        d["title"] for d in index.search("born", 3)] and len(index.search("born", 3)) == 3


def test_reward_is_squad_token_f1_with_exact_match_beside_it(tmp_path):
    assert token_f1("The Kalo.", "kalo") == 1.0 and exact_match("The Kalo.", "kalo") == 1.0
    assert token_f1("Kalo Works", "Kalo") == pytest.approx(2 / 3) and exact_match("Kalo Works", "Kalo") == 0.0
    assert token_f1("", "Kalo") == 0.0 and token_f1("Mimizo", "Kalo") == 0.0
    task = {"answer": "Kalo"}
    assert verify(task, tmp_path).reward == 0.0 and verify(task, tmp_path).info["answered"] is False
    (tmp_path / "answer.txt").write_text("Kalo " + "x " * 5000)  # an essay is cut, so listing names does not pay
    assert verify(task, tmp_path).reward < 0.01
    os.symlink("/etc/hostname", tmp_path / "link")
    (tmp_path / "answer.txt").unlink()
    (tmp_path / "answer.txt").symlink_to(tmp_path / "link")  # the harness cannot point the verifier at a file
    assert verify(task, tmp_path).info["answered"] is False


def test_the_scripted_oracle_answers_every_task_through_two_searches(tmp_path):
    spec = importlib.util.spec_from_file_location("search_harness", EXAMPLE / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    index = SearchIndex.from_file(EXAMPLE / "corpus.jsonl")
    for task in tasks():
        (tmp_path / "answer.txt").write_text(harness.oracle_answer(task["data"], index))
        assert verify(task["data"], tmp_path).reward == 1.0, task


def run_mode(mode: str, chosen: list[dict], proxy, workdir: Path) -> None:
    harness_modes.run_mode(EXAMPLE, ["search", "verify"], RUN, mode, chosen, proxy, workdir, timeout_s=300.0)


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_the_oracle_scores_1_on_every_task_and_the_noop_0(upstream, make_proxy, store, tmp_path):  # noqa: F811
    proxy = make_proxy([upstream.url], reward_token=TOKEN, rollout_id=None, run=RUN)  # the runner's gateway
    # two tasks of each kind (every task's oracle answer is checked in process above); each rollout is two
    # processes that load numpy and scipy, about 1.3 s of CPU
    chosen = [task for kind in ("birth-country", "employer-seat")
              for task in [t for t in tasks() if t["data"]["kind"] == kind][:2]]
    run_mode("oracle", chosen, proxy, tmp_path / "oracle")
    run_mode("noop", chosen[1:3], proxy, tmp_path / "noop")
    proxy.flush()
    for mode, launched, expected in (("oracle", chosen, 1.0), ("noop", chosen[1:3], 0.0)):
        for task in launched:
            attempt = store.get_attempt(f"{mode}-{task['id']}", 0)
            assert attempt.state in (RolloutState.RUNNING, RolloutState.QUEUED)  # no scheduler settles it here
            assert attempt.reward == expected, (mode, task["id"], attempt.reward_info)
            assert attempt.reward_info["exact_match"] == expected
            assert attempt.reward_info["gold"] == task["data"]["answer"]
