"""``harnessrl learn``: run the learner loop against a trace store.

Every rank runs the same command line; the launcher (torchrun, the DeepSpeed launcher, a Kubernetes indexed
Job) supplies MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK. Only rank 0 opens the store and
talks to replicas and proxies. Settings are flags here; a TrainingRun spec maps onto the same
``LearnerSettings`` through ``LearnerSettings.from_spec``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import click


def _positive(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and value <= 0:
        raise click.BadParameter(f"{value} must be > 0", ctx=ctx, param=param)
    return value


def _spec_default(model: str, field: str) -> object:
    """The TrainingRun spec's default for a flag that mirrors a spec field: one default everywhere."""
    from harnessrl.spec import harness, learner, models

    owner = {"Learner": learner.Learner, "Algorithm": learner.Algorithm, "DeepSpeed": learner.DeepSpeed,
             "Rows": learner.Rows, "Lora": learner.Lora, "Harness": harness.Harness, "Rollout": models.Rollout}
    return owner[model].model_fields[field].default


# The spec field behind each flag that --spec replaces (a test holds their defaults equal).
SPEC_FIELDS = {
    "tasks_per_step": ("Learner", "tasks_per_step"), "group_size": ("Harness", "group_size"),
    "lr": ("Algorithm", "lr"), "zero_stage": ("DeepSpeed", "zero_stage"),
    "micro_batch_tokens": ("Learner", "micro_batch_tokens"), "gradient_clip": ("Learner", "gradient_clip"),
    "gradient_checkpointing": ("Learner", "gradient_checkpointing"), "lora_alpha": ("Lora", "alpha"),
    "loss": ("Algorithm", "loss"), "loss_aggregation": ("Algorithm", "loss_aggregation"),
    "advantage": ("Algorithm", "advantage"), "max_staleness": ("Learner", "max_staleness"),
    "row_mode": ("Rows", "mode"), "keep_checkpoints": ("Learner", "keep_checkpoints"),
    "mini_batches": ("Learner", "mini_batches"), "temperature": ("Rollout", "temperature"),
    "top_p": ("Rollout", "top_p"),
}

# Flags that --spec replaces: the algorithm and engine settings come from the TrainingRun instead.
SPEC_OWNED = ("tasks_per_step", "group_size", "lr", "zero_stage", "micro_batch_tokens", "gradient_clip",
              "gradient_checkpointing", "lora_rank", "lora_alpha", "loss", "loss_aggregation", "advantage",
              "max_staleness", "row_mode", "max_row_tokens", "keep_checkpoints", "mini_batches", "temperature",
              "top_p")


def _settings_from_spec(ctx: click.Context, spec_file: Path, run: str | None, **overrides: object):
    """LearnerSettings from a TrainingRun file (the operator mounts the same file into the learner Job)."""
    from harnessrl.spec.commands import validate_file
    from harnessrl.spec.documents import is_other_object, load_documents
    from harnessrl.spec.problems import parse_training_run
    from harnessrl.trainer.learner import LearnerSettings

    given = [name for name in SPEC_OWNED
             if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise click.UsageError(f"{flags}: set in the TrainingRun's spec.learner when --spec is given, not as flags")
    code, lines = validate_file(str(spec_file))
    if code:
        raise click.BadParameter("\n".join(lines), param_hint="--spec")
    documents = [d for d in load_documents(spec_file.read_text()) if not is_other_object(d.data)]
    training_run = parse_training_run(documents[0].data)
    return LearnerSettings.from_spec(training_run.spec, run=run or training_run.metadata.name, **overrides)


@click.command("learn")
@click.option("--spec", "spec_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="TrainingRun YAML: the learner, algorithm and group settings come from it.")
@click.option("--store", "store_url", required=True, envvar="HARNESSRL_STORE_URL",
              help="Trace store URL (sqlite:///PATH or postgresql+psycopg://...).")
@click.option("--run", "run", envvar="HARNESSRL_RUN",
              help="TrainingRun name in the store (default with --spec: its metadata.name).")
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Base model directory (HF format: config, safetensors, tokenizer).")
@click.option("--output", "output_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Checkpoint directory (shared with the vLLM replicas; versions/ and engine/ inside).")
@click.option("--steps", default=None, type=click.IntRange(min=1),
              help="Total steps of the run; a restarted learner stops at the same step. "
                   "[default: spec.learner.steps with --spec, else 100]")
@click.option("--tasks-per-step", default=_spec_default(*SPEC_FIELDS["tasks_per_step"]), show_default=True, type=click.IntRange(min=1))
@click.option("--group-size", default=_spec_default(*SPEC_FIELDS["group_size"]), show_default=True, type=click.IntRange(min=1),
              help="Rollouts per task; a task's group is trained once all of them finished.")
@click.option("--mini-batches", default=_spec_default(*SPEC_FIELDS["mini_batches"]), show_default=True, type=click.IntRange(min=1),
              help="Optimizer updates per step, each on a part of its rollouts, all clipped against the weights "
                   "at the start of the step (1: one update, where the ratio is 1 and nothing clips).")
@click.option("--temperature", default=_spec_default(*SPEC_FIELDS["temperature"]), show_default=True, type=float, callback=_positive,
              help="The replicas' sampling temperature: the learner trains softmax(logits / temperature). "
                   "[with --spec: spec.rollout.temperature]")
@click.option("--top-p", default=_spec_default(*SPEC_FIELDS["top_p"]), show_default=True,
              type=click.FloatRange(0, 1, min_open=True),
              help="The replicas' nucleus: below 1 the learner trains the renormalised top-p distribution. "
                   "[with --spec: spec.rollout.topP]")
@click.option("--lr", default=_spec_default(*SPEC_FIELDS["lr"]), show_default=True, type=float, callback=_positive)
@click.option("--zero-stage", default=_spec_default(*SPEC_FIELDS["zero_stage"]), show_default=True, type=click.IntRange(0, 3))
@click.option("--micro-batch-tokens", default=_spec_default(*SPEC_FIELDS["micro_batch_tokens"]), show_default=True, type=click.IntRange(min=2))
@click.option("--gradient-clip", default=_spec_default(*SPEC_FIELDS["gradient_clip"]), show_default=True, type=float, callback=_positive)
@click.option("--gradient-checkpointing/--no-gradient-checkpointing",
              default=_spec_default(*SPEC_FIELDS["gradient_checkpointing"]), show_default=True)
@click.option("--lora-rank", default=0, show_default=True, type=click.IntRange(min=0),
              help="Train a LoRA adapter of this rank (0: full fine-tuning).")
@click.option("--lora-alpha", default=_spec_default(*SPEC_FIELDS["lora_alpha"]), show_default=True, type=float, callback=_positive)
@click.option("--loss", default=_spec_default(*SPEC_FIELDS["loss"]), show_default=True, type=click.Choice(["ppo-clip", "cispo", "acpo"]))
@click.option("--loss-aggregation", default=_spec_default(*SPEC_FIELDS["loss_aggregation"]), show_default=True,
              type=click.Choice(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "per-rollout-mean"]))
@click.option("--advantage", default=_spec_default(*SPEC_FIELDS["advantage"]), show_default=True, type=click.Choice(["grpo", "rloo"]))
@click.option("--max-staleness", default=_spec_default(*SPEC_FIELDS["max_staleness"]), show_default=True,
              type=click.IntRange(min=0), help="Leave out rollouts more than this many versions old.")
@click.option("--row-mode", default=_spec_default(*SPEC_FIELDS["row_mode"]), show_default=True, type=click.Choice(["merge", "transition"]))
@click.option("--max-row-tokens", default=None, type=click.IntRange(min=1))
@click.option("--replica", "replicas", multiple=True,
              help="vLLM base URL to sync weights to, or dns://NAME:PORT for every address NAME resolves to at "
                   "each sync (a headless Service); repeatable.")
@click.option("--proxy", "proxies", multiple=True, help="Proxy base URL to pause during syncs (repeatable).")
@click.option("--replica-wait", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="At start, wait up to this many seconds for a replica behind a dns:// --replica before the "
                   "first sync (the operator passes its provisioning timeout); 0: do not wait.")
@click.option("--keep-checkpoints", default=_spec_default(*SPEC_FIELDS["keep_checkpoints"]), show_default=True, type=click.IntRange(min=1))
@click.option("--wait-timeout", default=None, type=float, callback=_positive,
              help="Stop when no step's worth of rollouts arrives for this many seconds (default: wait).")
@click.option("--poll-interval", default=2.0, show_default=True, type=float, callback=_positive)
@click.option("--metrics-port", default=None, type=click.IntRange(1, 65535), help="Serve /metrics (rank 0).")
@click.pass_context
def learn_command(ctx: click.Context, spec_file: Path | None, store_url: str, run: str | None, model_dir: Path,
                  output_dir: Path, steps: int | None, tasks_per_step: int,
                  group_size: int, mini_batches: int, temperature: float, top_p: float, lr: float, zero_stage: int, micro_batch_tokens: int, gradient_clip: float,
                  gradient_checkpointing: bool, lora_rank: int, lora_alpha: float, loss: str,
                  loss_aggregation: str, advantage: str, max_staleness: int | None, row_mode: str,
                  max_row_tokens: int | None, replicas: tuple[str, ...], proxies: tuple[str, ...],
                  replica_wait: float, keep_checkpoints: int, wait_timeout: float | None, poll_interval: float,
                  metrics_port: int | None) -> None:
    """Train on finished rollouts from the store, write versioned checkpoints, sync them to vLLM."""
    if not (model_dir / "config.json").is_file():
        raise click.BadParameter(f"{model_dir} has no config.json; pass a Hugging Face model directory",
                                 param_hint="--model")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    common = dict(model_dir=model_dir, output_dir=output_dir, replicas=replicas, proxies=proxies,
                  replica_wait_s=replica_wait, wait_timeout_s=wait_timeout, poll_interval_s=poll_interval, metrics_port=metrics_port)
    if spec_file is not None:
        try:
            settings = _settings_from_spec(ctx, spec_file, run, **common, **({"steps": steps} if steps else {}))
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    elif run is None:
        raise click.UsageError("give --run NAME (or --spec FILE, whose metadata.name is the run)")
    else:
        settings = _settings_from_flags(
            run=run, steps=steps or 100, tasks_per_step=tasks_per_step, group_size=group_size,
            mini_batches=mini_batches, temperature=temperature, top_p=top_p, lr=lr,
            zero_stage=zero_stage, micro_batch_tokens=micro_batch_tokens, gradient_clip=gradient_clip,
            gradient_checkpointing=gradient_checkpointing, lora_rank=lora_rank, lora_alpha=lora_alpha, loss=loss,
            loss_aggregation=loss_aggregation, advantage=advantage, max_staleness=max_staleness,
            row_mode=row_mode, max_row_tokens=max_row_tokens, keep_checkpoints=keep_checkpoints, common=common)
    _run_learner(settings, store_url)


def _settings_from_flags(*, run: str, steps: int, tasks_per_step: int, group_size: int, mini_batches: int,
                         temperature: float, top_p: float, lr: float,
                         zero_stage: int, micro_batch_tokens: int, gradient_clip: float,
                         gradient_checkpointing: bool, lora_rank: int, lora_alpha: float, loss: str,
                         loss_aggregation: str, advantage: str, max_staleness: int | None, row_mode: str,
                         max_row_tokens: int | None, keep_checkpoints: int, common: dict):
    from harnessrl.trainer.advantages import AdvantageConfig
    from harnessrl.trainer.engine import EngineSettings, LoraSettings
    from harnessrl.trainer.learner import LearnerSettings
    from harnessrl.trainer.losses import LossConfig

    if loss_aggregation == "seq-mean-token-sum-norm" and max_row_tokens is None:
        raise click.BadParameter("seq-mean-token-sum-norm divides by the row limit; also pass --max-row-tokens",
                                 param_hint="--loss-aggregation")
    try:
        return LearnerSettings(
            run=run, steps=steps, tasks_per_step=tasks_per_step, mini_batches=mini_batches,
            group_size=group_size, row_mode=row_mode, max_row_tokens=max_row_tokens,
            engine=EngineSettings(
                zero_stage=zero_stage, lr=lr, gradient_clip=gradient_clip, micro_batch_tokens=micro_batch_tokens,
                gradient_checkpointing=gradient_checkpointing, temperature=temperature, top_p=top_p,
                lora=LoraSettings(rank=lora_rank, alpha=lora_alpha) if lora_rank else None,
            ),
            advantage=AdvantageConfig(estimator=advantage, max_staleness=max_staleness),
            loss=LossConfig(loss=loss, aggregation=loss_aggregation, sum_norm_tokens=max_row_tokens),
            keep_checkpoints=keep_checkpoints, **common,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _run_learner(settings, store_url: str) -> None:
    from harnessrl.store import StoreError, TraceStore
    from harnessrl.store.engine import open_engine_waiting
    from harnessrl.store.learner_ledger import CommitRefused
    from harnessrl.trainer.engine import PolicyEngine, init_distributed
    from harnessrl.trainer.learner import Learner
    from harnessrl.trainer.weight_sync import SyncError, wait_for_replicas

    store = None
    if int(os.environ.get("RANK", "0")) == 0:  # before the slow engine start, so a wrong URL fails at once
        try:
            # A database that is (re)starting is waited for, not a reason to exit: every exit of the learner
            # pod counts against its Job's backoffLimit.
            say = logging.getLogger(__name__).warning
            store = TraceStore(open_engine_waiting(store_url, settings.store_outage_s, say))
            store.upgrade()
        except StoreError as exc:
            raise click.ClickException(str(exc)) from None
    wait_for_replicas(settings.replicas, settings.replica_wait_s, logging.getLogger(__name__).warning)
    dist = init_distributed()
    engine = PolicyEngine(settings.model_dir, settings.engine, dist)
    try:
        outcomes = Learner(settings, engine, store).run()
    except (CommitRefused, SyncError) as exc:  # SyncError: a sync failed after its retries (spec.weightSync)
        raise click.ClickException(str(exc)) from None
    finally:
        if store is not None:
            store.close()
    if dist.is_main:
        last = outcomes[-1].version if outcomes else None
        click.echo(f"learner stopped after {len(outcomes)} step(s); last version {last}; "
                   f"rank {dist.rank} of {dist.world_size}, pid {os.getpid()}")
