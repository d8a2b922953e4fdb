"""The learner's step loop: claim -> rows -> advantages -> micro-batches -> train -> save -> commit -> sync.

Rank 0 talks to the store (claims, reads calls, commits) and to the rollout side (weight sync); it builds the
step batch and hands each rank its share of the rows. Every rank trains on its share and writes its part of
the checkpoint. What makes a crash at any point safe:

* a step counts only once :meth:`LearnerLedger.commit` wrote, in one transaction, the new policy version, the
  step record and the consumed marks of its rollouts;
* on start the learner takes the highest committed step and version from the store, discards newer
  checkpoint directories (written by a learner killed between save and commit), restores weights and
  optimizer state of that version and redoes the next step. Its rollouts are still unconsumed, so none is
  trained on twice and the version sequence has no gap;
* a committed version that was not yet synced (killed between commit and sync, or a sync that failed) is
  synced on start.

A sync that fails after its retries (``spec.weightSync.retries``, within ``timeoutSeconds``) stops the learner
with :class:`SyncFailed` on every rank: the version stays committed and unsynced, and a restarted learner
syncs it before anything else.

A step that trains produces the next policy version; version 0 is the base model (a LoRA run's fresh
adapter). A step whose rollouts give no trainable token (every group had equal rewards, or every row was
dropped) trains nothing and does not pretend it did: it saves nothing, makes no policy version and syncs
nothing (:meth:`LearnerLedger.consume`); it consumes its rollouts (the scheduler only starts new groups once
old ones are consumed) and its step record says ``empty_step: 1`` with ``skipped_reason``, at the version
the policy stays at (counted in ``harnessrl_learner_empty_steps_total``). It counts towards ``steps``, so a
run whose groups never differ still ends. Steps and versions are therefore numbered apart.

Tokens a structured-output grammar constrained: a token whose behaviour log-prob is 0 was forced and is no
decision (:func:`decision_mask`); a token whose call stored the grammar's allowed set there (the proxy records it
for constrained calls, ``TraceStore.allowed_token_ids``) is scored over that set only (:func:`row_allowed_sets`,
``TrainRow.allowed``), the masked distribution vLLM sampled it from.

A learner without replicas and proxies (offline training from a stored trace) has no rollout side: it
commits versions and syncs none, and the store leaves them unsynced, since nothing serves them.

A step makes ``mini_batches`` optimizer updates (decoupled PPO, see ``losses``): rank 0 splits the step's
rollouts into that many parts and weights each part's tokens as a whole batch of its own; every rank first
scores the rows of the parts after the first with the step's starting weights (one no-grad forward: the "old"
log-probs), then trains part after part. The first part needs no such pass: its update's own forward runs on
those weights. ACPO's clip widths are one statistic per update over all its micro-batches and ranks, from one
more no-grad pass before each update after the first (in the first, every ratio is 1).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from sqlalchemy.exc import OperationalError

from harnessrl.policy_serving import SERVED_MODEL_NAME
from harnessrl.scheduler import versions_to_keep
from harnessrl.served_marker import ServedVersion, write_marker
from harnessrl.store import TraceStore
from harnessrl.store.engine import first_line
from harnessrl.store.learner_ledger import CommitRefused, LearnerLedger, StepClaim, StepRows
from harnessrl.trainer.advantages import AdvantageConfig, RolloutOutcome, compute_advantages
from harnessrl.trainer.checkpoint import CheckpointDir, restore_checkpoint, save_checkpoint
from harnessrl.trainer.engine import (
    EngineSettings,
    MicroBatch,
    PolicyEngine,
    StepResult,
    TrainRow,
    shard_rows,
)
from harnessrl.trainer.losses import (
    LossConfig,
    acpo_bin_stats,
    acpo_clip_widths,
    aggregation_weights,
    policy_loss,
)
from harnessrl.trainer.metrics import LearnerMetrics, final_trajectory_tokens, merge_quality
from harnessrl.trainer.rows import Row, RowMode, RowStats, merge_calls_into_rows
from harnessrl.trainer.weight_sync import (
    ProxyAdminGate,
    ReplicaSet,
    SyncError,
    SyncFailed,
    SyncReport,
    WeightSync,
    check_inplace_reload,
)

log = logging.getLogger(__name__)

# losses.policy_loss reports these as sums over the micro-batch; every other metric is a mean over its tokens
_SUMMED_LOSS_METRICS = frozenset({"loss", "pg_loss", "rollout_kl_loss", "tokens"})


@dataclass(frozen=True)
class LearnerSettings:
    """Everything the learner loop needs; the TrainingRun's ``learner`` section maps onto it (``from_spec``)."""

    run: str
    model_dir: Path
    output_dir: Path
    steps: int = 100  # total steps of the run: a resumed learner stops at the same step
    tasks_per_step: int = 8
    group_size: int = 8
    max_attempts: int = 1  # the harness's attempts per rollout: a failure with attempts left is not final
    row_mode: RowMode = "merge"
    max_prompt_tokens: int | None = None
    max_row_tokens: int | None = None
    engine: EngineSettings = field(default_factory=EngineSettings)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    mini_batches: int = 1  # optimizer updates per step (spec.learner.miniBatches); 1: one on-policy update
    keep_checkpoints: int = 3
    replicas: tuple[str, ...] = ()  # vLLM base URLs
    proxies: tuple[str, ...] = ()  # proxy base URLs (admin API)
    lora_name: str = SERVED_MODEL_NAME  # the adapter's name under LoRA: what harnesses and the proxy ask for
    pause_mode: Literal["wait", "reject"] = "wait"
    drain_timeout_s: float = 30.0
    sync_tries: int = 3
    sync_backoff_s: float = 1.0
    sync_timeout_s: float = 600.0  # spec.weightSync.timeoutSeconds: no retry after it, no request longer
    replica_wait_s: float = 0.0  # a starting learner waits this long for a replica behind its dns:// targets
    poll_interval_s: float = 2.0
    wait_timeout_s: float | None = None  # stop when no step's worth of rollouts arrives for this long
    store_outage_s: float = 600.0  # how long the store may not answer while the learner waits for rollouts
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "tasks_per_step", "group_size", "keep_checkpoints", "sync_tries", "mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 1")
        if self.proxies and not self.replicas:
            raise ValueError("proxies need replicas: a sync that loads no replica would announce versions nothing "
                             "serves — pass the vLLM replicas (--replica) too, or neither for offline training")

    @classmethod
    def from_spec(cls, spec: Any, *, run: str, model_dir: Path, output_dir: Path, **overrides: Any) -> LearnerSettings:
        """Settings from a TrainingRun's spec (``harnessrl.spec.models.TrainingRunSpec``); ``overrides`` win."""
        from harnessrl.trainer.engine import LoraSettings

        learner = spec.learner
        algorithm = learner.algorithm
        lora = learner.lora
        use_lora = spec.weight_sync.method == "lora"
        engine = EngineSettings(
            zero_stage=learner.deepspeed.zero_stage,
            lr=algorithm.lr,
            gradient_clip=learner.gradient_clip,
            micro_batch_tokens=learner.micro_batch_tokens,
            gradient_checkpointing=learner.gradient_checkpointing,
            lora=LoraSettings(rank=lora.rank, alpha=lora.alpha, target_modules=tuple(lora.target_modules))
            if use_lora and lora is not None else None,
            offload_optimizer=learner.deepspeed.offload.optimizer == "cpu",
            offload_parameters=learner.deepspeed.offload.parameters == "cpu",
            temperature=spec.rollout.temperature,
            top_p=spec.rollout.top_p,
        )
        loss = LossConfig.from_spec(algorithm, max_row_tokens=learner.rows.max_row_tokens)
        if algorithm.tis_cap == 0:
            loss = replace(loss, tis_cap=None)
        values: dict[str, Any] = {
            "run": run, "model_dir": Path(model_dir), "output_dir": Path(output_dir), "steps": learner.steps,
            "tasks_per_step": learner.tasks_per_step, "group_size": spec.harness.group_size,
            "max_attempts": spec.harness.max_attempts,
            "row_mode": learner.rows.mode, "max_prompt_tokens": learner.rows.max_prompt_tokens,
            "max_row_tokens": learner.rows.max_row_tokens, "engine": engine,
            "advantage": AdvantageConfig.from_spec(learner), "loss": loss,
            "mini_batches": learner.mini_batches,
            "keep_checkpoints": learner.keep_checkpoints, "pause_mode": spec.proxy.pause.mode,
            "sync_tries": spec.weight_sync.retries + 1, "sync_timeout_s": float(spec.weight_sync.timeout_seconds),
        }
        return cls(**(values | overrides))


@dataclass
class StepOutcome:
    step: int
    version: int
    metrics: dict[str, Any]
    synced: bool


@dataclass
class LearnerHooks:
    """Callbacks at the points a crash matters (tests kill the process there; a runner may log)."""

    after_save: Callable[[int], None] | None = None
    after_commit: Callable[[int], None] | None = None


@dataclass
class _Plan:
    """What rank 0 sends every rank for one step: this rank's rows of each mini-batch (one update each)."""

    step: int
    mini_batches: list[list[TrainRow]]
    empty: bool


def split_mini_batches(keys: Sequence[Hashable], count: int) -> list[list[int]]:
    """Row indices of each mini-batch, for rows owned by the rollouts ``keys`` (one key per row).

    Rollouts, in the order they first appear, go to ``min(count, rollouts)`` contiguous parts whose rollout
    counts differ by at most one, the later parts taking the remainder (so with rollouts in claim order a task
    group stays together where the counts allow). A rollout's rows always share a part, so per-rollout
    aggregation sees the whole rollout in one update.
    """
    order: dict[Hashable, int] = {}
    for key in keys:
        order.setdefault(key, len(order))
    parts = min(count, len(order))
    out: list[list[int]] = [[] for _ in range(parts)]
    for i, key in enumerate(keys):
        out[(order[key] * parts + parts - 1) // len(order)].append(i)
    return out


class Learner:
    """Runs steps until ``settings.steps`` are committed. Every rank constructs one; only rank 0 gets a store."""

    def __init__(self, settings: LearnerSettings, engine: PolicyEngine, store: TraceStore | None = None,
                 sync: WeightSync | None = None, metrics: LearnerMetrics | None = None,
                 hooks: LearnerHooks | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.dist = engine.dist
        self.main = self.dist.is_main
        if self.main and store is None:
            raise ValueError("rank 0 needs the store (pass store=TraceStore.connect(url))")
        self.ledger = LearnerLedger(store, settings.run) if self.main and store is not None else None
        self.ckpt = CheckpointDir(settings.output_dir, keep_last=settings.keep_checkpoints)
        self.metrics = metrics or LearnerMetrics()
        self.hooks = hooks or LearnerHooks()
        # None on rank 0: no rollout side (no replica, no proxy); versions are committed and never synced
        self.sync = sync if sync is not None else (default_weight_sync(settings) if self.main else None)
        self.version = 0  # the policy version the learner holds
        # this step's rows: rank 0's (rollout, attempt, row index) of each TrainRow.index and rows built per
        # attempt (``_build_batch``); every rank's own log-probs of its rows' trained tokens (``_loss_fn``)
        self._origins: dict[int, tuple[str, int, int]] = {}
        self._row_counts: dict[tuple[str, int], int] = {}
        self._learner_logprobs: dict[int, np.ndarray] = {}
        self.steps_done = 0  # committed steps, trained or empty
        self.restored = "base"

    # -- start -------------------------------------------------------------------------------------------------

    def resume(self) -> int:
        """Find the committed version, clean up after a crash, restore it; collective. Returns the version."""
        committed = [0, 0]
        if self.main:
            assert self.ledger is not None
            if self.ledger.version(0) is None:
                base_path = self._write_initial_adapter() if self.engine.is_lora else self.settings.model_dir
                self.ledger.ensure_base_version(str(base_path), synced=not self.engine.is_lora)
            committed = [self.ledger.committed_version(), self.ledger.committed_step()]
            removed = self.ckpt.discard_after(committed[0])
            if removed:
                log.warning("discarded uncommitted checkpoint files: %s", [str(p) for p in removed])
            if self.sync is None:
                log.warning("no rollout side (no replica, no proxy): versions are committed, none is synced")
        torch.distributed.broadcast_object_list(committed, src=0)
        self.version, self.steps_done = int(committed[0]), int(committed[1])
        self.restored = restore_checkpoint(self.engine, self.ckpt, self.version)
        if self.restored == "weights-only":
            log.warning("version %d has no engine state: weights restored, optimizer state starts fresh", self.version)
        failure: Exception | None = None
        if self.main:
            assert self.ledger is not None
            info = self.ledger.version(self.version)
            if info is not None and not info.synced:
                _, failure = self._sync(self.version, Path(info.checkpoint_path))
        self._stop_on_failed_sync(failure)
        return self.version

    def _write_initial_adapter(self) -> Path:
        """LoRA: version 0 is the freshly initialised adapter (B = 0, so it equals the base model)."""
        return self.ckpt.write_version(0, lambda tmp: self.engine.module.save_pretrained(tmp, safe_serialization=True))

    # -- the loop ----------------------------------------------------------------------------------------------

    def run(self) -> list[StepOutcome]:
        """Resume, then step until the run's last step is committed or rollouts stop coming (wait_timeout_s)."""
        if self.main and self.settings.metrics_port is not None:
            self.metrics.serve(self.settings.metrics_port)
        self.resume()
        outcomes: list[StepOutcome] = []
        while self.steps_done < self.settings.steps:
            outcome = self.step()
            if outcome is None:
                break
            outcomes.append(outcome)
        return outcomes

    def step(self) -> StepOutcome | None:
        """One step (collective). None when no claim arrived within ``wait_timeout_s``."""
        step = self.steps_done + 1
        started = time.perf_counter()
        claim = self._wait_for_claim()
        if claim is None:
            return None
        payload: list[Any] = [None] * self.dist.world_size
        info: dict[str, Any] = {}
        if self.main:
            assert claim is not None
            parts, info = self._build_batch(claim)
            shards = [shard_rows(part, self.dist.world_size, self.engine.shared_prefix_min_fraction,
                                 self.settings.engine.micro_batch_tokens) for part in parts]
            payload = [_Plan(step, [s[rank] for s in shards], not parts) for rank in range(self.dist.world_size)]
        mine: list[Any] = [None]
        torch.distributed.scatter_object_list(mine, payload if self.main else None, src=0)
        plan: _Plan = mine[0]
        version = self.version if plan.empty else self.version + 1

        train_started = time.perf_counter()
        result = None if plan.empty else self._train(plan.mini_batches)
        train_seconds = time.perf_counter() - train_started
        rows = self._step_rows(gather=not plan.empty)

        save_started = time.perf_counter()
        path = None if plan.empty else save_checkpoint(self.engine, self.ckpt, version)
        save_seconds = time.perf_counter() - save_started
        if self.hooks.after_save:
            self.hooks.after_save(step)

        status: list[Any] = [None]
        metrics: dict[str, Any] = {}
        if self.main:
            assert self.ledger is not None and claim is not None
            metrics = _step_metrics(step, version, info, result, train_seconds, save_seconds)
            if plan.empty:
                metrics["skipped_reason"] = _skipped_reason(info)
                log.warning("step %d trains nothing (%s): no new version, the policy stays at version %d", step,
                            metrics["skipped_reason"], version)
            metrics["step_seconds"] = time.perf_counter() - started
            try:
                if path is None:
                    self.ledger.consume(step, _json_safe(metrics), claim.keys, rows=rows)
                else:
                    self.ledger.commit(step, str(path), _json_safe(metrics), claim.keys, version=version, rows=rows)
            except CommitRefused as exc:
                self.metrics.commit_refusals.inc()
                status[0] = str(exc)
            else:
                self.metrics.observe_step(metrics)
        torch.distributed.broadcast_object_list(status, src=0)
        if status[0] is not None:
            raise CommitRefused(status[0])
        self.version, self.steps_done = version, step
        if self.hooks.after_commit:
            self.hooks.after_commit(step)

        failure: Exception | None = None
        synced = False
        if self.main and path is not None:
            self.ckpt.prune(version, spare=self._evaluated_versions_to_keep())
            synced, failure = self._sync(version, path)
            metrics["synced"] = synced
        self._stop_on_failed_sync(failure)
        return StepOutcome(step, version, metrics, synced)

    # -- rank 0 ------------------------------------------------------------------------------------------------

    def _evaluated_versions_to_keep(self) -> set[int]:
        """What pruning spares for spec.evaluation (``scheduler.versions_to_keep``)."""
        if self.ledger is None:
            return set()
        return versions_to_keep(self.ledger.store, self.ledger.run)

    def _wait_for_claim(self) -> StepClaim | None:
        """Poll the store on rank 0; every poll is one broadcast, so other ranks never hit a collective timeout."""
        deadline = None if self.settings.wait_timeout_s is None else time.monotonic() + self.settings.wait_timeout_s
        outage_since: float | None = None
        while True:
            claim: StepClaim | None = None
            box: list[str] = ["wait"]
            if self.main:
                assert self.ledger is not None
                try:
                    claim = self.ledger.claim(self.settings.tasks_per_step, self.settings.group_size,
                                              self.settings.max_attempts)
                    if outage_since is not None:
                        log.info("the store answers again after %.0f s", time.monotonic() - outage_since)
                    outage_since = None
                except OperationalError as exc:
                    # A database restart (the chart's PostgreSQL pod moved or upgraded): waiting costs nothing,
                    # while exiting would restart the learner, and restarts use up its Job's backoffLimit.
                    now = time.monotonic()
                    if outage_since is None:
                        outage_since = now
                        log.warning("the store does not answer (%s): waiting for it, up to %.0f s",
                                    first_line(exc), self.settings.store_outage_s)
                    if now - outage_since > self.settings.store_outage_s:
                        raise
                if claim is not None:
                    box[0] = "go"
                elif deadline is not None and time.monotonic() >= deadline:
                    box[0] = "stop"
            torch.distributed.broadcast_object_list(box, src=0)
            if box[0] == "stop":
                return None
            if box[0] == "go":  # other ranks get their rows from rank 0, not the claim
                return claim if self.main else StepClaim((), ())
            time.sleep(self.settings.poll_interval_s)

    def _step_rows(self, gather: bool) -> StepRows | None:
        """What the step made of its attempts, for its commit (rank 0; None elsewhere): rows per attempt, and
        every rank's log-probs of its rows' trained tokens gathered (collective when ``gather``)."""
        scored: list[Any] = [None] * self.dist.world_size
        if gather:
            torch.distributed.gather_object(self._learner_logprobs, scored if self.main else None, dst=0)
        self._learner_logprobs = {}
        if not self.main:
            return None
        logprobs = {self._origins[index]: values for part in scored if part for index, values in part.items()}
        return StepRows(counts=dict(self._row_counts), logprobs=logprobs)

    def _build_batch(self, claim: StepClaim) -> tuple[list[list[TrainRow]], dict[str, Any]]:
        """Rows of the claimed attempts with advantages, split into mini-batches, each with loss weights
        normalised over the whole mini-batch (rank 0). Where each row comes from and how many rows each attempt
        gave are kept for the commit (``_step_rows``)."""
        store = self.ledger.store if self.ledger else None
        assert store is not None
        s = self.settings
        row_stats = RowStats()
        final_tokens = 0
        rows_by_key: dict[tuple[str, int], list[Row]] = {}
        outcomes: list[RolloutOutcome] = []
        allowed_by_row: dict[int, dict[int, np.ndarray]] = {}
        for attempt in claim.attempts:
            calls = store.rollout_calls(attempt.rollout_id, attempt.attempt)
            built = merge_calls_into_rows(calls, mode=s.row_mode, max_prompt_tokens=s.max_prompt_tokens,
                                          max_row_tokens=s.max_row_tokens)
            row_stats.add(built.stats)
            final_tokens += final_trajectory_tokens([row.input_ids for row in built.rows])
            rows_by_key[attempt.key] = built.rows
            sets = store.allowed_token_ids(attempt.rollout_id, attempt.attempt)
            if sets:
                for row in built.rows:
                    allowed_by_row[id(row)] = row_allowed_sets(row, sets)
            versions = [r.min_policy_version for r in built.rows]
            oldest = min(versions) if versions else (attempt.policy_version_start
                                                    if attempt.policy_version_start is not None else self.version)
            outcomes.append(RolloutOutcome(attempt.rollout_id, attempt.attempt, attempt.task_id, attempt.state,
                                           attempt.reward, oldest))
        adv = compute_advantages(outcomes, s.advantage, current_version=self.version)
        kept: list[Row] = []
        masks: list[np.ndarray] = []
        values: list[float] = []
        origins: list[tuple[str, int, int]] = []
        forced = 0
        for key, rows in rows_by_key.items():
            if key in adv.advantages:
                for number, row in enumerate(rows):
                    mask = decision_mask(row.loss_mask, row.rollout_logprobs)
                    forced += row.num_generated - int(mask.sum())
                    if mask.any():
                        kept.append(row)
                        masks.append(mask)
                        values.append(adv.advantages[key])
                        origins.append((*key, number))
        self._origins = dict(enumerate(origins))
        self._row_counts = {key: len(rows) for key, rows in rows_by_key.items()}
        parts: list[list[TrainRow]] = []
        for members in split_mini_batches([(row.rollout_id, row.attempt) for row in kept], s.mini_batches):
            weights = self._weights([masks[i] for i in members], [kept[i] for i in members])
            parts.append([
                TrainRow(
                    index=i, key=(kept[i].rollout_id, kept[i].attempt), input_ids=kept[i].input_ids,
                    loss_mask=masks[i], rollout_logprobs=kept[i].rollout_logprobs,
                    advantages=masks[i].astype(np.float32) * np.float32(values[i]), weights=w,
                    on_policy=self._on_policy(kept[i]), allowed=allowed_by_row.get(id(kept[i])) or None,
                )
                for i, w in zip(members, weights)
            ])
        train_rows = [row for part in parts for row in part]
        trained_rollouts = len({r.key for r in train_rows})
        info: dict[str, Any] = {
            "tasks": len(claim.tasks),
            "rollouts": len(claim.attempts),
            "trained_rollouts": trained_rollouts,
            "trained_rows": len(train_rows),
            "updates": len(parts),
            "rows_per_rollout": len(train_rows) / trained_rollouts if trained_rollouts else math.nan,
            "forced_tokens": forced,
            "constrained_tokens": sum(
                sum(1 for pos in (row.allowed or {}) if row.loss_mask[pos]) for row in train_rows
            ),
            **row_stats.as_metrics(),
            **merge_quality(row_stats.row_tokens, final_tokens),
            **adv.stats.as_metrics(),
        }
        return parts, info

    def _on_policy(self, row: Row) -> np.ndarray:
        """1 on the completion tokens the weights the learner holds now produced (see ``TrainRow.on_policy``)."""
        fresh = np.zeros(row.num_tokens, dtype=np.int8)
        for (start, end), version in zip(row.completion_spans, row.policy_versions, strict=True):
            if version == self.version:
                fresh[start:end] = 1
        return fresh

    def _weights(self, masks: Sequence[np.ndarray], rows: Sequence[Row]) -> list[np.ndarray]:
        """Each token's share of its update's loss, from ``losses.aggregation_weights`` over the mini-batch.

        ``masks`` are the rows' trained tokens (:func:`decision_mask`: forced tokens do not count in any mean).
        Adapter: the losses module computes weights for one padded ``[rows, tokens]`` batch; computing them
        once for the mini-batch and carrying them with the rows makes micro-batch and rank sums exact.
        """
        if not rows:
            return []
        length = max(r.num_tokens for r in rows)
        mask = torch.zeros((len(rows), length), dtype=torch.int8)
        for i, row in enumerate(rows):
            mask[i, : row.num_tokens] = torch.from_numpy(masks[i])
        index: dict[tuple[str, int], int] = {}
        rollout = torch.tensor([index.setdefault((r.rollout_id, r.attempt), len(index)) for r in rows])
        weights = aggregation_weights(mask, rollout, self.settings.loss.aggregation,
                                      sum_norm_tokens=self.settings.loss.sum_norm_tokens)
        return [weights[i, : row.num_tokens].numpy().astype(np.float32) for i, row in enumerate(rows)]

    def _sync(self, version: int, path: Path) -> tuple[bool, SyncFailed | None]:
        """Rank 0: sync ``version``. Whether every replica has it, and the failure to stop the run with;
        (False, None) without a rollout side, where nothing is synced and nothing fails."""
        assert self.ledger is not None
        if self.sync is None:
            return False, None
        # Replicas that start after this sync load the version from the marker (harnessrl.served_marker).
        write_marker(self.ckpt.root, ServedVersion(version, str(path), self.engine.is_lora))
        report: SyncReport = self.sync.sync(version, path)
        self.metrics.observe_sync(version, report.ok, report.seconds)
        if report.ok:
            self.ledger.mark_synced(version)
            return True, None
        return False, SyncFailed(report, self.sync.tries, self.sync.timeout_s)

    def _stop_on_failed_sync(self, failure: Exception | None) -> None:
        """Collective: every rank raises rank 0's sync failure, so no rank waits for a step that never comes."""
        box: list[Any] = [None if failure is None else str(failure)]
        torch.distributed.broadcast_object_list(box, src=0)
        if self.main and failure is not None:
            raise failure
        if box[0] is not None:
            raise SyncError(box[0])

    # -- every rank --------------------------------------------------------------------------------------------

    def _train(self, mini_batches: list[list[TrainRow]]) -> StepResult:
        """The step's updates, one per mini-batch, all against the step's starting weights (collective)."""
        started = time.perf_counter()
        if len(mini_batches) > 1:  # the proximal ("old") log-probs, before any update
            later = [row for part in mini_batches[1:] for row in part]
            scored = {row.index: values for row, values in zip(later, self.engine.score(later))}
            mini_batches = [mini_batches[0]] + [[_with_old(row, scored[row.index]) for row in part]
                                                for part in mini_batches[1:]]
        results = []
        for k, rows in enumerate(mini_batches):
            widths = self._acpo_widths(rows, first=k == 0) if self.settings.loss.loss == "acpo" else None
            results.append(self.engine.train_step(rows, partial(self._loss_fn, acpo_widths=widths)))
        return _merge_updates(results, time.perf_counter() - started)

    def _acpo_widths(self, rows: Sequence[TrainRow], *, first: bool) -> torch.Tensor:
        """ACPO's per-bin clip widths for one update, from all its tokens on every rank (collective).

        In the step's first update the weights are the old ones, every ratio is 1 and every bin's spread 0;
        later, one no-grad pass gives the current log-probs of the update's tokens.
        """
        config = self.settings.loss
        stats = torch.zeros((config.acpo_bins, 3), dtype=torch.float64)
        if not first:
            for row, current in zip(rows, self.engine.score(rows)):
                old = torch.from_numpy(row.old_logprobs[np.flatnonzero(row.loss_mask[1:]) + 1])
                stats += acpo_bin_stats(torch.from_numpy(current), old, torch.ones_like(old), config).cpu()
            torch.distributed.all_reduce(stats)
        return acpo_clip_widths(stats, config)

    def _loss_fn(self, mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor,
                 acpo_widths: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """policy_loss on the micro-batch's flattened generated tokens, plus sums for step-level metrics."""
        mask = torch.ones_like(mb.weights) if not mb.padding else torch.zeros_like(mb.weights)
        # the step's starting log-probs: scored before the first update, or this very forward in the first one
        old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
        if not mb.padding:  # kept per row for the step's commit: the trace explorer shows them per token
            owner = mb.token_row.cpu().numpy()
            scored = old.detach().float().cpu().numpy()
            for index in np.unique(owner):
                self._learner_logprobs[int(index)] = scored[owner == index]
        out = policy_loss(logp, mb.rollout_logprobs, mb.advantages, mask, mb.token_row, self.settings.loss,
                          old_logprobs=old, entropy=entropy, weights=mb.weights,
                          acpo_widths=None if acpo_widths is None else acpo_widths.to(logp.device))
        tokens = float(mask.sum())
        sums: dict[str, torch.Tensor] = {}
        for name, value in out.metrics.items():
            total = value if name in _SUMMED_LOSS_METRICS else value * tokens
            sums[f"m_{name}"] = torch.tensor(total, dtype=torch.float64)
        # Agreement between the serving engine's log-probs and ours on the same tokens, over the tokens the
        # learner's weights at the start of the step served (stale tokens differ by design, which says nothing
        # about the engines), with our log-probs from those weights.
        on = mask * mb.on_policy
        x = mb.rollout_logprobs.double() * on
        y = old.double() * on
        sums.update(_agreement_sums("lp", x, y, on))
        # the same over the tokens scored over a grammar's allowed set only (the constrained decisions); always
        # present, since every rank must sum the same stat names
        constrained = on * (mb.allowed[:, 0] >= 0).to(on.dtype) if mb.allowed is not None else on * 0
        sums.update(_agreement_sums("lpc", x * constrained, y * constrained, constrained))
        return out.loss, sums


def _agreement_sums(prefix: str, x: torch.Tensor, y: torch.Tensor, on: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums for the Pearson correlation and mean absolute difference of ``x`` and ``y`` (already zero where
    ``on`` is 0), summed over micro-batches and ranks before :func:`_agreement` reads them."""
    return {f"{prefix}_n": on.double().sum(), f"{prefix}_x": x.sum(), f"{prefix}_y": y.sum(),
            f"{prefix}_xx": (x * x).sum(), f"{prefix}_yy": (y * y).sum(), f"{prefix}_xy": (x * y).sum(),
            f"{prefix}_abs": (x - y).abs().sum()}


def _agreement(stats: dict[str, float], prefix: str) -> tuple[float, float, float] | None:
    """(tokens, mean |x - y|, Pearson r) from :func:`_agreement_sums`' totals; None without tokens."""
    n = stats.get(f"{prefix}_n", 0.0)
    if not n:
        return None
    mx, my = stats[f"{prefix}_x"] / n, stats[f"{prefix}_y"] / n
    vx = stats[f"{prefix}_xx"] / n - mx * mx
    vy = stats[f"{prefix}_yy"] / n - my * my
    cov = stats[f"{prefix}_xy"] / n - mx * my
    return n, stats[f"{prefix}_abs"] / n, cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else math.nan


def row_allowed_sets(row: Row, sets: dict[str, list[list[int]]]) -> dict[int, np.ndarray]:
    """The row's positions whose token a grammar constrained, with the token ids it allowed there: each kept
    call's stored sets (``TraceStore.allowed_token_ids``, one per completion token, [] where not known) placed
    on its completion span (a span cut at ``max_row_tokens`` keeps its first tokens' sets)."""
    out: dict[int, np.ndarray] = {}
    for call_id, (start, end) in zip(row.call_ids, row.completion_spans, strict=True):
        for offset, ids in enumerate(sets.get(call_id, ())[: end - start]):
            if ids:
                out[start + offset] = np.asarray(ids, dtype=np.int64)
    return out


def decision_mask(loss_mask: np.ndarray, rollout_logprobs: np.ndarray) -> np.ndarray:
    """The generated tokens that were a decision of the policy that sampled them: ``loss_mask`` without the
    tokens whose behaviour log-prob is exactly 0 (int8, like ``loss_mask``).

    A log-prob of 0 means the sampling distribution put all its mass on that token: the structured-output
    grammar allowed only it (vLLM's processed log-probs are taken after the grammar mask), or p rounded to 1.
    Under that distribution the token has no policy gradient (d log 1 = 0), whereas the learner's full-vocabulary
    log-prob of it does, and pushing that up or down trains a choice nobody made: on the flights example (forced
    tool calls) 45% of the tool-call tokens were such, and training them drifted the policy. So they stay in the
    row as context (the model reads them) but carry no loss, no importance weight, do not count in the loss
    normalisation (a call with a long forced JSON skeleton does not dilute the rollout's real decisions) and are
    left out of the log-prob agreement metrics; the step record counts them as ``forced_tokens``.
    """
    return (loss_mask.astype(bool) & (rollout_logprobs != 0)).astype(np.int8)


def _with_old(row: TrainRow, generated: np.ndarray) -> TrainRow:
    """The row carrying its step-start log-probs, per position like its other arrays."""
    old = np.zeros(row.num_tokens, dtype=np.float32)
    old[np.flatnonzero(row.loss_mask[1:]) + 1] = generated
    return replace(row, old_logprobs=old)


def _merge_updates(results: list[StepResult], seconds: float) -> StepResult:
    """The step's updates as one result: losses and grad norms averaged over updates, everything else summed
    (token-mean metrics then average over all the step's tokens), seconds including the scoring passes."""
    n = len(results)
    stats: dict[str, float] = {}
    for result in results:
        for name, value in result.stats.items():
            stats[name] = stats.get(name, 0.0) + value
    for name in _SUMMED_LOSS_METRICS - {"tokens"}:
        if f"m_{name}" in stats:
            stats[f"m_{name}"] /= n
    return StepResult(
        loss=sum(r.loss for r in results) / n,
        grad_norm=sum(r.grad_norm for r in results) / n,
        stats=stats,
        row_tokens=sum(r.row_tokens for r in results),
        target_tokens=sum(r.target_tokens for r in results),
        micro_batches=sum(r.micro_batches for r in results),
        padding_micro_batches=sum(r.padding_micro_batches for r in results),
        seconds=seconds,
        shared_prefix_rows=sum(r.shared_prefix_rows for r in results),
        prefix_fallback_rows=sum(r.prefix_fallback_rows for r in results),
        shared_prefix_tokens=sum(r.shared_prefix_tokens for r in results),
    )


def _step_metrics(step: int, version: int, info: dict[str, Any], result: Any, train_seconds: float,
                  save_seconds: float) -> dict[str, Any]:
    metrics: dict[str, Any] = {"step": step, "policy_version": version, **info,
                               "train_seconds": train_seconds, "checkpoint_seconds": save_seconds}
    if result is None:
        metrics.update(empty_step=1, trained_tokens=0)
        return metrics
    stats = result.stats
    tokens = stats.get("m_tokens", 0.0)
    for name, value in stats.items():
        if name.startswith("m_"):
            key = name[2:]
            metrics[key] = value if key in _SUMMED_LOSS_METRICS else (value / tokens if tokens else math.nan)
    for prefix, suffix in (("lp", ""), ("lpc", "_constrained")):
        agreement = _agreement(stats, prefix)
        if agreement is not None:
            (metrics[f"logprob_tokens{suffix}"], metrics[f"logprob_abs_diff{suffix}"],
             metrics[f"logprob_pearson{suffix}"]) = agreement
    metrics.update(
        empty_step=0,
        grad_norm=result.grad_norm,
        trained_tokens=result.row_tokens,
        trained_target_tokens=result.target_tokens,
        micro_batches=result.micro_batches,
        padding_micro_batches=result.padding_micro_batches,
        tokens_per_second=result.tokens_per_second,
        shared_prefix_rows=result.shared_prefix_rows,
        prefix_fallback_rows=result.prefix_fallback_rows,
        shared_prefix_tokens=result.shared_prefix_tokens,
    )
    return metrics


def _skipped_reason(info: dict[str, Any]) -> str:
    """Why a step had no trainable token, from its batch statistics (the step record keeps it)."""
    if not info.get("rollouts"):
        return "no rollout"
    parts = [f"{int(info.get('zero_variance_groups', 0))} of {int(info.get('tasks', 0))} groups had equal rewards"]
    excluded = {k.removeprefix("excluded_"): v for k, v in info.items() if k.startswith("excluded_") and v}
    if excluded:
        parts.append("rollouts excluded: " + ", ".join(f"{int(v)} {k}" for k, v in sorted(excluded.items())))
    if info.get("rows", 0) and not info.get("trained_rows"):
        parts.append("no row had a generated token that was a decision"
                     + (f" ({int(info['forced_tokens'])} forced)" if info.get("forced_tokens") else ""))
    return "; ".join(parts)


def _json_safe(metrics: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf are not JSON: store them as null."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
        elif isinstance(value, np.generic):
            out[key] = value.item()
        else:
            out[key] = value
    return out


def default_weight_sync(settings: LearnerSettings) -> WeightSync | None:
    """The sync to the settings' replicas and proxies; None without either (no rollout side)."""
    if not settings.replicas:
        return None  # LearnerSettings refuses proxies without replicas
    lora = settings.lora_name if settings.engine.lora is not None else None
    if lora is None:
        check_inplace_reload(settings.model_dir)
    # URLs, or dns://NAME:PORT resolved at each sync
    replicas = ReplicaSet(settings.replicas, lora_name=lora, timeout_s=settings.sync_timeout_s)
    gate = ProxyAdminGate(settings.proxies, mode=settings.pause_mode, drain_timeout_s=settings.drain_timeout_s) \
        if settings.proxies else None
    return WeightSync(replicas.current, gate, tries=settings.sync_tries, backoff_s=settings.sync_backoff_s,
                      timeout_s=settings.sync_timeout_s)
