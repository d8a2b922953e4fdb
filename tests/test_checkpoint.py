"""Checkpoint directories: atomic publication, crash leftovers, pruning, and resume giving the same training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from learner_helpers import flat, make_rows, reinforce

from harnessrl.trainer.checkpoint import CheckpointDir, restore_checkpoint, save_checkpoint
from harnessrl.trainer.engine import EngineSettings, PolicyEngine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harnessrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def write_files(content: str):
    def write(tmp: Path) -> None:
        (tmp / "model.safetensors").write_text(content)

    return write


def test_a_version_appears_complete_or_not_at_all(tmp_path: Path):
    ckpt = CheckpointDir(tmp_path)
    ckpt.write_version(1, write_files("one"))
    assert (ckpt.version_path(1) / "model.safetensors").read_text() == "one"

    def crash(tmp: Path) -> None:
        (tmp / "model.safetensors").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        ckpt.write_version(2, crash)
    assert not ckpt.version_path(2).exists()
    assert [p.name for p in ckpt.versions.iterdir()] == ["v000001"]  # the temporary is gone too


def test_leftovers_newer_than_the_committed_version_are_discarded(tmp_path: Path):
    ckpt = CheckpointDir(tmp_path)
    for v in (1, 2, 3):
        ckpt.write_version(v, write_files(str(v)))
        (ckpt.engine / f"v{v:06d}").mkdir(parents=True)
    (ckpt.versions / ".tmp-v000004-deadbeef").mkdir()  # a learner killed while writing
    removed = ckpt.discard_after(2)
    assert sorted(p.name for p in removed) == [".tmp-v000004-deadbeef", "v000003", "v000003"]
    assert ckpt.listed(ckpt.versions) == [1, 2] and ckpt.listed(ckpt.engine) == [1, 2]
    ckpt.write_version(2, write_files("redo"))  # an uncommitted leftover is replaced, not refused
    assert (ckpt.version_path(2) / "model.safetensors").read_text() == "redo"


def test_prune_keeps_the_newest(tmp_path: Path):
    ckpt = CheckpointDir(tmp_path, keep_last=2, keep_engine_states=1)
    for v in range(1, 6):
        ckpt.write_version(v, write_files(str(v)))
        (ckpt.engine / f"v{v:06d}").mkdir(parents=True)
    ckpt.prune(5)
    assert ckpt.listed(ckpt.versions) == [4, 5]
    assert ckpt.listed(ckpt.engine) == [5]


def test_resume_from_a_checkpoint_continues_exactly(tiny: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = EngineSettings(lr=1e-3)
    first, second = make_rows(10, 5), make_rows(11, 5)
    ckpt = CheckpointDir(tmp_path / "run")

    straight = PolicyEngine(tiny, settings)
    straight.train_step(first, reinforce)
    path = save_checkpoint(straight, ckpt, 1)
    straight.train_step(second, reinforce)

    # What vLLM and transformers load: the weights of version 1 and the tokenizer.
    published = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"
    engine_1 = dict(PolicyEngine(tiny, settings).module.named_parameters())  # base, to check v1 differs
    saved = dict(published.named_parameters())
    assert any(not torch.equal(saved[n], engine_1[n]) for n in saved)

    resumed = PolicyEngine(tiny, settings)
    assert restore_checkpoint(resumed, ckpt, 1) == "engine-state"
    for name, param in resumed.module.named_parameters():
        assert torch.equal(param, saved[name]), name
    resumed.train_step(second, reinforce)
    torch.testing.assert_close(flat(resumed), flat(straight), rtol=0, atol=0)  # optimizer state came back too

    # Without engine state the published weights are loaded and Adam starts over: same start, other step.
    import shutil

    shutil.rmtree(ckpt.engine / "v000001")
    fresh = PolicyEngine(tiny, settings)
    assert restore_checkpoint(fresh, ckpt, 1) == "weights-only"
    for name, param in fresh.module.named_parameters():
        assert torch.equal(param, saved[name]), name
    fresh.train_step(second, reinforce)
    assert not torch.allclose(flat(fresh), flat(straight))


def test_every_zero_stage_publishes_the_same_weights_and_restores_them(tiny: Path, tmp_path: Path):
    """ZeRO-3 shards the parameters: publishing must gather them; restoring must put them back."""
    from safetensors.torch import load_file

    rows = make_rows(12, 5)
    published = {}
    for stage in (1, 2, 3):
        engine = PolicyEngine(tiny, EngineSettings(zero_stage=stage, lr=1e-3))
        engine.train_step(rows, reinforce)
        ckpt = CheckpointDir(tmp_path / f"zero{stage}")
        published[stage] = load_file(save_checkpoint(engine, ckpt, 1) / "model.safetensors")

        again = PolicyEngine(tiny, EngineSettings(zero_stage=stage, lr=1e-3))
        assert restore_checkpoint(again, ckpt, 1) == "engine-state"
        republished = load_file(save_checkpoint(again, CheckpointDir(tmp_path / f"again{stage}"), 1)
                                / "model.safetensors")
        assert all(torch.equal(republished[k], published[stage][k]) for k in published[stage])
    for stage in (1, 3):
        assert published[stage].keys() == published[2].keys()
        for key in published[2]:
            torch.testing.assert_close(published[stage][key], published[2][key], rtol=1e-4, atol=1e-5)  # lr 1e-3


def test_prune_spares_the_best_evaluated_version(tmp_path: Path):
    """``spare`` (the learner passes the best-evaluated version) outlives keepCheckpoints; engine states do not."""
    ckpt = CheckpointDir(tmp_path, keep_last=2, keep_engine_states=1)
    for v in range(1, 7):
        ckpt.write_version(v, write_files(str(v)))
        (ckpt.engine / f"v{v:06d}").mkdir(parents=True)
    ckpt.prune(6, spare={2})
    assert ckpt.listed(ckpt.versions) == [2, 5, 6]
    assert ckpt.listed(ckpt.engine) == [6]
    ckpt.prune(6)  # no longer the best: pruned like any other
    assert ckpt.listed(ckpt.versions) == [5, 6]
