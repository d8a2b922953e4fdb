"""A TrainingRun's spec maps onto the learner's settings (the example cluster run, parsed by the spec model)."""

from __future__ import annotations

from pathlib import Path

import yaml

from harnessrl.spec.learner import Learner
from harnessrl.spec.models import TrainingRun
from harnessrl.spec.problems import validate_document
from harnessrl.trainer.learner import LearnerSettings

EXAMPLE = Path(__file__).parent.parent / "examples" / "trainingrun-cluster.yaml"


def test_the_cluster_example_becomes_learner_settings(tmp_path: Path):
    run = TrainingRun.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    spec = run.spec
    settings = LearnerSettings.from_spec(spec, run=run.metadata.name, model_dir=tmp_path / "model",
                                         output_dir=tmp_path / "ckpt", replicas=("http://vllm-0:8000",))
    learner = spec.learner
    assert settings.run == "swe-qwen" and settings.replicas == ("http://vllm-0:8000",)
    assert settings.group_size == spec.harness.group_size == 8
    assert settings.tasks_per_step == learner.tasks_per_step and settings.steps == learner.steps
    assert settings.engine.zero_stage == learner.deepspeed.zero_stage
    assert settings.engine.lr == learner.algorithm.lr
    assert settings.engine.micro_batch_tokens == learner.micro_batch_tokens
    assert (settings.engine.lora is not None) == (spec.weight_sync.method == "lora")
    if settings.engine.lora is not None:
        assert settings.engine.lora.rank == learner.lora.rank
    assert settings.loss.loss == learner.algorithm.loss
    assert (settings.loss.clip_low, settings.loss.clip_high) == tuple(learner.algorithm.clip)
    assert settings.advantage.max_staleness == learner.max_staleness
    assert settings.max_row_tokens == learner.rows.max_row_tokens
    assert settings.pause_mode == spec.proxy.pause.mode
    assert settings.sync_tries == spec.weight_sync.retries + 1
    assert settings.sync_timeout_s == spec.weight_sync.timeout_seconds
    assert settings.mini_batches == learner.mini_batches
    assert settings.loss.rollout_kl_coef == learner.algorithm.rollout_kl_coef


def test_mini_batches_and_the_rollout_kl_penalty_come_from_the_spec(tmp_path: Path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["learner"]["miniBatches"] = 4
    doc["spec"]["learner"]["algorithm"]["rolloutKlCoef"] = 0.05
    spec = TrainingRun.model_validate(doc).spec
    settings = LearnerSettings.from_spec(spec, run="r", model_dir=tmp_path, output_dir=tmp_path)
    assert settings.mini_batches == 4 and settings.loss.rollout_kl_coef == 0.05
    assert Learner().mini_batches == 1  # the default: one update per step, as before mini-batches existed


def test_the_old_kl_field_points_to_its_new_name():
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["learner"]["algorithm"]["klCoef"] = 0.05
    (problem,) = validate_document(doc)
    assert problem.path == "spec.learner.algorithm.klCoef"
    assert "rolloutKlCoef" in problem.message


def test_the_learner_trains_the_distribution_the_replicas_sample_from(tmp_path: Path):
    """spec.rollout.temperature reaches the engine (it scores softmax(logits / temperature)); 0 (greedy) has no
    distribution to train and is refused naming the field."""
    import pytest

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["rollout"]["temperature"] = 0.7
    spec = TrainingRun.model_validate(doc).spec
    assert LearnerSettings.from_spec(spec, run="r", model_dir=tmp_path, output_dir=tmp_path).engine.temperature == 0.7
    doc["spec"]["rollout"]["temperature"] = 0
    spec = TrainingRun.model_validate(doc).spec
    with pytest.raises(ValueError, match=r"set spec\.rollout\.temperature above 0"):
        LearnerSettings.from_spec(spec, run="r", model_dir=tmp_path, output_dir=tmp_path)
