"""Two real learner processes (DeepSpeed ZeRO-2 over gloo on the CPU) end a run with the same weights.

The run is the whole loop: rank 0 claims from the store and hands rank 1 its share of the rows; both train;
both write checkpoint shards. The same run in a single process, on a copy of the store, reaches the same
weights up to float summation order, which shows the loss is normalised over the whole step batch and not
per rank. Adam uses a large epsilon so the update follows the gradient's size (see test_engine.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from learner_helpers import Sample, record_group, sample_completions, two_turn
from safetensors.torch import load_file

from harnessrl.store import TraceStore
from harnessrl.store.learner_ledger import LearnerLedger

HERE = Path(__file__).parent
RUN = "dist"
pytestmark = pytest.mark.slow  # real learner processes: ~20 s


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harnessrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker(tiny: Path, store: Path, out: Path, dump: Path, extra: list[str]) -> list[str]:
    return [sys.executable, str(HERE / "learner_worker.py"), "--store", f"sqlite:///{store}", "--run", RUN,
            "--model", str(tiny), "--output", str(out), "--steps", "3", "--tasks-per-step", "1",
            "--group-size", "3", "--lr", "0.05", "--eps", "1.0", "--micro-batch-tokens", "40", "--dump", str(dump),
            *extra]


def env_for(rank: int, world: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    if world > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank))
    return env


# Rows alone (no prefix sharing, which would pack two rows of a step on one rank): the rank with one
# micro-batch pads. Two updates per step with ACPO: the old log-probs and ACPO's per-update spread statistic are
# collective (the first update has one rollout, so rank 1 only pads; the second has a row on each rank), and
# must match one rank's.
@pytest.mark.parametrize("extra", [["--no-shared-prefix"],
                                   ["--mini-batches", "2", "--loss", "acpo", "--acpo-alpha", "0.5"]],
                         ids=["one-update", "acpo-two-updates"])
def test_two_ranks_end_with_identical_weights_equal_to_one_rank(tiny: Path, tmp_path: Path, extra: list[str]):
    db = tmp_path / "two.db"
    store = TraceStore.connect(f"sqlite:///{db}")
    store.upgrade()
    prompt = list(range(30, 50))
    samples = sample_completions(tiny, prompt, 6, 7, seed=5)
    # 3 steps of one task with 3 rollouts. Rows are 27 to 58 tokens and the budget is 40 tokens, so every row is
    # a micro-batch of its own: 3 rows over 2 ranks, and the rank with one row must pad to stay in step.
    for task in range(3):
        group = []
        for i in range(3):
            completion, logprobs = samples[(task + i) % 6]
            turns = ((prompt, completion, logprobs),) if i != 1 else two_turn(
                prompt, (completion, logprobs), [5, 6, 7] * (task + 1), samples[i])
            group.append(Sample(turns, float((task * 3 + i) % 3 == 0)))
        record_group(store, RUN, f"t{task}", group)
    store.close()
    single_db = tmp_path / "one.db"
    shutil.copy(db, single_db)

    port = free_port()
    procs = [subprocess.Popen(worker(tiny, db, tmp_path / "out2", tmp_path / "two", extra), env=env_for(r, 2, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    two_report = json.loads(results[0][0].strip().splitlines()[-1])

    one = subprocess.run(worker(tiny, single_db, tmp_path / "out1", tmp_path / "one", extra), env=env_for(0, 1, 0),
                         capture_output=True, text=True, check=False, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    one_report = json.loads(one.stdout.strip().splitlines()[-1])

    rank0 = torch.load(tmp_path / "two.rank0.pt")
    rank1 = torch.load(tmp_path / "two.rank1.pt")
    single = torch.load(tmp_path / "one.rank0.pt")
    assert rank0.keys() == rank1.keys() == single.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    assert two_report["steps"] == one_report["steps"] == [1, 2, 3]
    assert two_report["grad_norms"] == pytest.approx(one_report["grad_norms"], rel=1e-5)
    assert all(p >= 1 for p in two_report["padding"]) and one_report["padding"] == [0, 0, 0]
    assert two_report["clip_frac"] == pytest.approx(one_report["clip_frac"], rel=1e-5)
    assert two_report["shared"] == one_report["shared"]
    if len(extra) > 1:  # the second update's ratios spread, so ACPO widened its bound, by the same on both ranks
        assert min(one_report["acpo_clip_mean"]) > 0.2
        assert two_report["acpo_clip_mean"] == pytest.approx(one_report["acpo_clip_mean"], rel=1e-5)
    for name in rank0:
        torch.testing.assert_close(rank0[name], single[name], rtol=1e-4, atol=1e-6)
    base = load_file(tiny / "model.safetensors")
    moved = max(float((rank0[n] - base[n]).abs().max()) for n in base)
    assert moved > 1e-3  # the run changed the weights, so equal results are not trivially equal

    with TraceStore.connect(f"sqlite:///{db}") as two_store:
        ledger = LearnerLedger(two_store, RUN)
        assert [v.version for v in ledger.versions()] == [0, 1, 2, 3]
        assert [len(ledger.consumed_by(step)) for step in (1, 2, 3)] == [3, 3, 3]
        metrics = ledger.step_metrics(1)
    assert metrics["trained_rows"] == 3 and metrics["micro_batches"] == 2
