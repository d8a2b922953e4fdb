"""The policy under DeepSpeed: per-token log-probs of generated tokens and one optimizer update per call.

:meth:`PolicyEngine.train_step` is one optimizer update over an *update batch* (the rows of a learner step, or
of one of its mini-batches), split over ranks and then into micro-batches by a token budget. The split must
not change the update, so:

* every token carries a loss **weight** that is already normalised over the whole update batch (the learner
  computes it once from the aggregation mode), and a micro-batch's loss is the weighted *sum* of its token
  losses. Summing micro-batches and ranks then gives the update's loss exactly, however rows were split;
* DeepSpeed averages gradients over data-parallel ranks, so each rank's loss is multiplied by the world size
  to turn that average back into the sum;
* gradient accumulation is unmanaged (``managed_gradient_accumulation: false``): ``step()`` is the boundary,
  so the number of micro-batches may differ from step to step. ZeRO-2 reduces gradients inside every
  backward, so every rank runs the same number of backwards: short ranks pad with empty micro-batches
  (a real forward/backward whose tokens all weigh zero, so every parameter still takes part).

Rows that share a long prefix (the rollouts of one task share their prompt) are packed into one sequence that
holds the prefix once (``prefix_sharing``): its forward and backward run once per group, with gradients equal
to training every row in full. ``shared_prefix_min_fraction`` decides which rows share; the rest go row by row.

Log-probs are taken from the decoder's hidden states at the positions that predict a generated token only,
projected through the output embedding in chunks (recomputed in the backward pass). Agentic rows are mostly
prompt (tool output, files), so this never builds the ``[tokens, vocab]`` logits of the prompt; with a large
vocabulary (150k) the chunking bounds the ``[chunk, vocab]`` block held at once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import numpy as np
import torch

from harnessrl.trainer.prefix_sharing import (
    Blocks,
    PrefixGroup,
    attention_blocks,
    group_shared_prefixes,
    pack,
    shared_prefix_attention,
    shared_prefix_mask,
    split_to_budget,
)

log = logging.getLogger(__name__)

# Positions projected through the output embedding at once; [chunk, vocab] fp32 is 600 MB at a 150k vocab.
LOGPROB_CHUNK_TOKENS = 1024


@dataclass(frozen=True)
class LoraSettings:
    """A LoRA adapter instead of full fine-tuning (peft); vLLM then loads the adapter, not the weights."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class EngineSettings:
    """What the engine needs from the TrainingRun's ``learner`` section (see ``LearnerSettings``)."""

    zero_stage: int = 2
    lr: float = 1.0e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1.0e-8
    gradient_clip: float = 1.0
    micro_batch_tokens: int = 32768
    gradient_checkpointing: bool = False
    lora: LoraSettings | None = None
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on an accelerator, fp32 on the CPU
    offload_optimizer: bool = False
    offload_parameters: bool = False
    seed: int = 0
    # spec.rollout.temperature: the policy trained is softmax(logits / temperature), the distribution the
    # replicas sample from (and, with vLLM's processed log-probs, report log-probs of)
    temperature: float = 1.0
    # spec.rollout.topP: below 1 the replicas sample from the smallest set of tokens holding that much probability,
    # renormalised (and processed log-probs are of that distribution), so the learner trains the same one
    top_p: float = 1.0
    # rows whose common prefix is at least this share of each row's tokens are packed with the prefix computed
    # once (prefix_sharing); None: every row alone
    shared_prefix_min_fraction: float | None = 0.5

    def __post_init__(self) -> None:
        if self.shared_prefix_min_fraction is not None and not 0 < self.shared_prefix_min_fraction <= 1:
            raise ValueError(f"shared_prefix_min_fraction: {self.shared_prefix_min_fraction} must be in (0, 1], "
                             "or None to train every row alone")
        if not self.temperature > 0:
            raise ValueError(f"temperature: {self.temperature} must be > 0; greedy decoding (spec.rollout.temperature "
                             "0) has no sampling distribution to train: set spec.rollout.temperature above 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: {self.top_p} must be in (0, 1] (spec.rollout.topP)")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage: {self.zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3")
        if self.micro_batch_tokens < 2:
            raise ValueError(f"micro_batch_tokens: {self.micro_batch_tokens} is below 2; pass a token budget >= 2")
        if self.gradient_clip <= 0:
            raise ValueError(f"gradient_clip: {self.gradient_clip} must be > 0")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed() -> DistInfo:
    """Join the process group described by the standard launcher environment, once per process.

    ``torchrun``, the DeepSpeed launcher and a Kubernetes indexed Job all set MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE and LOCAL_RANK. A process started without them is a world of one (local runs, tests).
    gloo on the CPU, nccl on GPUs.
    """
    import deepspeed

    alone = "WORLD_SIZE" not in os.environ
    if not alone:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK") if k not in os.environ]
        if missing:
            raise RuntimeError(f"WORLD_SIZE is set but {', '.join(missing)} is not; start the learner with a launcher "
                               "(torchrun, deepspeed) or set all of MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK")
    local_rank = 0 if alone else int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not torch.distributed.is_initialized():
        if alone:  # a private rendezvous; the process environment is left as it was
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                                       init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        else:
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    return DistInfo(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device)


# --------------------------------------------------------------------------------------------------------------
# Rows -> micro-batches


@dataclass(frozen=True)
class TrainRow:
    """One training row as the engine consumes it; arrays are per position of ``input_ids``.

    ``loss_mask[p] == 1`` means token ``p`` was generated and is trained on (its log-prob is predicted at
    ``p - 1``). ``weights`` is each token's share of the step loss, normalised over the whole step batch.
    ``key`` identifies the rollout attempt (for per-rollout metrics), ``index`` the row within the step.
    """

    index: int
    key: tuple[str, int]
    input_ids: np.ndarray  # int64 [n]
    loss_mask: np.ndarray  # int8 [n]
    rollout_logprobs: np.ndarray  # float32 [n]
    advantages: np.ndarray  # float32 [n]
    weights: np.ndarray  # float32 [n]
    # 1 where the token was generated by the weights the learner holds before this step: only there must the
    # serving engine's log-probs agree with the learner's (stale tokens differ by design). None: all of them.
    on_policy: np.ndarray | None = None  # int8 [n]
    # The learner's log-probs before the step's first update (decoupled PPO's proximal policy), for rows trained
    # in a later update of the step; None: the update's own forward pass is the step's first (ratio 1).
    old_logprobs: np.ndarray | None = None  # float32 [n]
    # position -> the token ids the sampler could draw there (a structured-output grammar's allowed set, as the
    # serving engine reported it): the token's log-prob is then taken over these ids only, the distribution it
    # was drawn from. Positions not in it (or None) are scored over the whole vocabulary.
    allowed: dict[int, np.ndarray] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class MicroBatch:
    """Right-padded tensors for one forward/backward plus the flattened generated tokens (``K`` of them).

    ``target_pos[k]`` is the flat index into ``[B * T]`` of the position whose output predicts token ``k``.
    A batch of packed prefix groups (:func:`collate_shared`) has a ``[B, 1, T, T]`` bool attention mask and
    ``position_ids``; several targets may then share a position (a prefix token of several rows).
    """

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T], or [B, 1, T, T] bool for packed prefix groups
    target_pos: torch.Tensor  # [K] long
    targets: torch.Tensor  # [K] long
    rollout_logprobs: torch.Tensor  # [K] float32
    advantages: torch.Tensor  # [K] float32
    weights: torch.Tensor  # [K] float32
    token_row: torch.Tensor  # [K] long: index of the TrainRow each token belongs to
    on_policy: torch.Tensor  # [K] float32: 1 where the serving weights were the learner's current ones
    row_tokens: int  # unpadded tokens in the batch (throughput counts these)
    padding: bool = False  # an empty micro-batch that only keeps ranks in step
    old_logprobs: torch.Tensor | None = None  # [K] float32, from TrainRow.old_logprobs
    # [K, M] long: each target's allowed token ids (TrainRow.allowed), padded with -1; a row of -1: the whole
    # vocabulary. None when no target of the batch has a set.
    allowed: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None  # [B, T] long, packed prefix groups only
    attention_blocks: Blocks | None = None  # packed prefix groups only: the mask's blocks, all sdpa computes
    shared_rows: int = 0  # rows computed in a packed prefix group
    saved_tokens: int = 0  # row tokens the packed groups did not compute again

    @property
    def num_targets(self) -> int:
        return int(self.targets.shape[0])

    def to(self, device: torch.device) -> MicroBatch:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return MicroBatch(**moved)


def collate(rows: Sequence[TrainRow], pad_id: int = 0) -> MicroBatch:
    """Stack rows into one right-padded micro-batch."""
    if not rows:
        raise ValueError("collate needs at least one row")
    length = max(r.num_tokens for r in rows)
    ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    attn = np.zeros((len(rows), length), dtype=np.int64)
    targets = _Targets()
    for b, row in enumerate(rows):
        n = row.num_tokens
        ids[b, :n] = row.input_ids
        attn[b, :n] = 1
        targets.add(row, lambda positions, b=b: b * length + positions)
    return targets.batch(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(attn),
                         row_tokens=int(sum(r.num_tokens for r in rows)))


def collate_shared(groups: Sequence[PrefixGroup], pad_id: int = 0) -> MicroBatch:
    """Stack packed prefix groups (``prefix_sharing``) into one right-padded micro-batch: each batch row is one
    group's prefix followed by its rows' suffixes, with the mask and positions that keep the rows apart."""
    if not groups:
        raise ValueError("collate_shared needs at least one group")
    layouts = [pack(group) for group in groups]
    length = max(len(layout.input_ids) for layout in layouts)
    ids = np.full((len(groups), length), pad_id, dtype=np.int64)
    segments = np.full((len(groups), length), -1, dtype=np.int64)
    positions = np.zeros((len(groups), length), dtype=np.int64)
    targets = _Targets()
    for b, (group, layout) in enumerate(zip(groups, layouts, strict=True)):
        n = len(layout.input_ids)
        ids[b, :n], segments[b, :n], positions[b, :n] = layout.input_ids, layout.segment, layout.position_ids
        for k, row in enumerate(group.rows):
            targets.add(row, lambda p, b=b, k=k, layout=layout: b * length + layout.packed_index(k, p))
    return targets.batch(
        input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(shared_prefix_mask(segments)),
        position_ids=torch.from_numpy(positions), attention_blocks=attention_blocks(layouts, length),
        row_tokens=sum(g.row_tokens for g in groups),
        shared_rows=sum(len(g.rows) for g in groups), saved_tokens=sum(g.saved_tokens for g in groups),
    )


class _Targets:
    """The flattened generated tokens of a micro-batch's rows, in row order and position order within a row."""

    def __init__(self) -> None:
        self.pos: list[np.ndarray] = []
        self.tgt: list[np.ndarray] = []
        self.old: list[np.ndarray] = []
        self.adv: list[np.ndarray] = []
        self.wts: list[np.ndarray] = []
        self.owner: list[np.ndarray] = []
        self.fresh: list[np.ndarray] = []
        self.before: list[np.ndarray] = []
        self.sets: list[np.ndarray | None] = []
        self.with_old: set[bool] = set()

    def add(self, row: TrainRow, flat_index: Callable[[np.ndarray], np.ndarray]) -> None:
        """The row's generated tokens; ``flat_index`` maps row positions to indices into the batch's [B * T]."""
        generated = np.flatnonzero(row.loss_mask[1:]) + 1  # token 0 has nothing before it to predict it
        self.pos.append(flat_index(generated - 1))
        self.tgt.append(row.input_ids[generated])
        self.old.append(row.rollout_logprobs[generated])
        self.adv.append(row.advantages[generated])
        self.wts.append(row.weights[generated])
        self.owner.append(np.full(generated.shape[0], row.index, dtype=np.int64))
        self.fresh.append(np.ones(generated.shape[0], np.float32) if row.on_policy is None
                          else row.on_policy[generated].astype(np.float32))
        self.with_old.add(row.old_logprobs is not None)
        if row.old_logprobs is not None:
            self.before.append(row.old_logprobs[generated])
        allowed = row.allowed or {}
        self.sets.extend(_allowed_set(allowed.get(int(p)), int(row.input_ids[p])) for p in generated)

    def batch(self, **tensors: Any) -> MicroBatch:
        if len(self.with_old) > 1:
            raise ValueError("rows: some have old_logprobs and some not; a micro-batch belongs to one update, "
                             "whose rows are either all scored before the step or all not")
        cat = np.concatenate
        return MicroBatch(
            target_pos=torch.from_numpy(cat(self.pos).astype(np.int64)),
            targets=torch.from_numpy(cat(self.tgt).astype(np.int64)),
            rollout_logprobs=torch.from_numpy(cat(self.old).astype(np.float32)),
            advantages=torch.from_numpy(cat(self.adv).astype(np.float32)),
            weights=torch.from_numpy(cat(self.wts).astype(np.float32)),
            token_row=torch.from_numpy(cat(self.owner)),
            on_policy=torch.from_numpy(cat(self.fresh)),
            old_logprobs=torch.from_numpy(cat(self.before).astype(np.float32)) if self.before else None,
            allowed=_pad_sets(self.sets),
            **tensors,
        )


def _allowed_set(ids: np.ndarray | None, target: int) -> np.ndarray | None:
    """The set a target is scored over, or None (whole vocabulary). A set that lacks the sampled token cannot
    be the one it was drawn from (a store written by another proxy, say): the whole vocabulary then."""
    if ids is None or len(ids) == 0 or target not in ids:
        return None
    return ids


def _pad_sets(sets: Sequence[np.ndarray | None]) -> torch.Tensor | None:
    """``[K, M]`` long of the targets' allowed ids padded with -1, or None when no target has a set."""
    width = max((len(ids) for ids in sets if ids is not None), default=0)
    if width == 0:
        return None
    out = np.full((len(sets), width), -1, dtype=np.int64)
    for k, ids in enumerate(sets):
        if ids is not None:
            out[k, : len(ids)] = ids
    return torch.from_numpy(out)


def padding_micro_batch(pad_id: int = 0) -> MicroBatch:
    """Two pad tokens, one zero-weight target: a real pass that changes no gradient."""
    return MicroBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
        attention_mask=torch.ones((1, 2), dtype=torch.long),
        target_pos=torch.zeros(1, dtype=torch.long),
        targets=torch.full((1,), pad_id, dtype=torch.long),
        rollout_logprobs=torch.zeros(1),
        advantages=torch.zeros(1),
        weights=torch.zeros(1),
        token_row=torch.full((1,), -1, dtype=torch.long),
        on_policy=torch.zeros(1),
        row_tokens=0,
        padding=True,
    )


class _Sequence(Protocol):
    """What micro-batch planning needs of a row or of a packed prefix group."""

    @property
    def index(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


_S = TypeVar("_S", bound=_Sequence)


def plan_micro_batches(rows: Sequence[_S], token_budget: int) -> list[list[_S]]:
    """Group rows so that each padded micro-batch (rows x longest row) stays within ``token_budget``.

    Rows are taken longest first so similar lengths share a batch (little padding); a row longer than the
    budget goes alone (the spec keeps ``microBatchTokens >= maxRowTokens`` so that does not happen in a run).
    Deterministic: the same rows always give the same plan.
    """
    ordered = sorted(rows, key=lambda r: (-r.num_tokens, r.index))
    plan: list[list[_S]] = []
    current: list[_S] = []
    for row in ordered:
        longest = current[0].num_tokens if current else row.num_tokens
        if current and (len(current) + 1) * longest > token_budget:
            plan.append(current)
            current = []
        current.append(row)
    if current:
        plan.append(current)
    return plan


def shard_rows(rows: Sequence[TrainRow], world_size: int, shared_prefix_min_fraction: float | None = None,
               token_budget: int | None = None) -> list[list[TrainRow]]:
    """Split rows over ranks so each gets about the same number of computed tokens (longest first, to the
    lightest). With ``shared_prefix_min_fraction``, rows the engine will pack with a shared prefix (in pieces
    of at most ``token_budget`` tokens) go to one rank together, their prefix counted once, so sharding does
    not undo the sharing."""
    units: list[tuple[int, int, list[TrainRow]]] = [(r.num_tokens, r.index, [r]) for r in rows]
    if shared_prefix_min_fraction is not None:
        groups, alone = group_shared_prefixes(rows, shared_prefix_min_fraction)
        pieces = [p for g in groups for p in split_to_budget(g, token_budget or sum(r.num_tokens for r in rows))]
        units = [(r.num_tokens, r.index, [r]) for r in alone] + [
            (p.num_tokens, p.index, list(p.rows)) if isinstance(p, PrefixGroup) else (p.num_tokens, p.index, [p])
            for p in pieces]
    shards: list[list[TrainRow]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for tokens, _, members in sorted(units, key=lambda u: (-u[0], u[1])):
        target = min(range(world_size), key=lambda i: (load[i], i))
        shards[target].extend(members)
        load[target] += tokens
    return shards


def plan_shared_micro_batches(rows: Sequence[TrainRow], token_budget: int, min_fraction: float,
                              pad_id: int = 0) -> list[MicroBatch]:
    """Micro-batches with the rows that share a prefix packed (``prefix_sharing``), the others as before.

    A group's packed sequence longer than the budget is cut into pieces that each carry the prefix (a piece of
    one row goes alone); packed sequences are then batched by the same rule as rows (batch x longest within the
    budget). Rows sharing too little get exactly today's micro-batches.
    """
    groups, alone = group_shared_prefixes(rows, min_fraction)
    pieces = [piece for group in groups for piece in split_to_budget(group, token_budget)]
    alone = alone + [p for p in pieces if not isinstance(p, PrefixGroup)]
    packed = [p for p in pieces if isinstance(p, PrefixGroup)]
    return ([collate(batch, pad_id) for batch in plan_micro_batches(alone, token_budget)]
            + [collate_shared(batch, pad_id) for batch in plan_micro_batches(packed, token_budget)])


_blocked_sdpa_installed = False


def _install_blocked_sdpa() -> None:
    """transformers' ``sdpa`` attention, process-wide, made to compute a packed batch block by block when
    the decoder is given ``shared_prefix_blocks`` (:func:`shared_prefix_attention`); other calls unchanged."""
    global _blocked_sdpa_installed
    if _blocked_sdpa_installed:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = shared_prefix_attention(ALL_ATTENTION_FUNCTIONS["sdpa"])
    _blocked_sdpa_installed = True


def supports_prefix_sharing(config: Any) -> bool:
    """Whether the model takes a ready shared-prefix mask: attention ``sdpa`` or ``eager`` (FlashAttention-2
    takes no arbitrary mask) and no sliding-window layer (the window would have to be part of the mask)."""
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    layer_types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        return False
    return not (getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None))


# --------------------------------------------------------------------------------------------------------------
# The engine

# loss_fn(micro_batch, new_logprobs [K], entropy [K]) -> (weighted loss sum, {stat name: summed value tensor})
LossFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class StepResult:
    """What one optimizer step did, summed over micro-batches and ranks (identical on every rank)."""

    loss: float
    grad_norm: float
    stats: dict[str, float]
    row_tokens: int  # unpadded tokens processed, all ranks
    target_tokens: int
    micro_batches: int  # per rank, padding included
    padding_micro_batches: int  # empty passes that kept short ranks in step, all ranks
    seconds: float
    shared_prefix_rows: int = 0  # rows trained in a packed prefix group, all ranks
    prefix_fallback_rows: int = 0  # rows trained alone (sharing too little, or sharing off), all ranks
    shared_prefix_tokens: int = 0  # row tokens not computed again thanks to a shared prefix, all ranks
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.row_tokens / self.seconds if self.seconds > 0 else 0.0


def deepspeed_config(settings: EngineSettings, world_size: int, bf16: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": settings.zero_stage}
    if settings.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if settings.offload_parameters:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        # step() is the accumulation boundary, so a step may have any number of micro-batches.
        "managed_gradient_accumulation": False,
        "gradient_clipping": settings.gradient_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": settings.lr,
                "betas": list(settings.betas),
                "eps": settings.eps,
                "weight_decay": settings.weight_decay,
                "torch_adam": True,  # no JIT-compiled fused kernel; works on CPU and GPU alike
            },
        },
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class PolicyEngine:
    """A causal LM wrapped by DeepSpeed. Every rank builds one, collectively, with the same arguments."""

    def __init__(self, model_dir: str | Path, settings: EngineSettings, dist: DistInfo | None = None) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.settings = settings
        self.dist = dist or init_distributed()
        self.model_dir = Path(model_dir)
        on_accel = self.dist.device.type != "cpu"
        self.bf16 = settings.dtype == "bfloat16" or (settings.dtype == "auto" and on_accel)
        torch.manual_seed(settings.seed)  # same LoRA init everywhere (DeepSpeed also broadcasts rank 0's)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.bfloat16 if self.bf16 else torch.float32
        )
        model.config.use_cache = False
        if settings.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if settings.lora is not None:
            from peft import LoraConfig, get_peft_model

            lora = settings.lora
            model = get_peft_model(model, LoraConfig(
                r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                target_modules=list(lora.target_modules), task_type="CAUSAL_LM",
            ))
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.attn_implementation = model.config._attn_implementation
        self.shared_prefix_min_fraction = settings.shared_prefix_min_fraction
        if self.shared_prefix_min_fraction is not None and not supports_prefix_sharing(model.config):
            log.warning("model %s (attention %s) cannot take a shared-prefix mask: every row trains alone",
                        self.model_dir, self.attn_implementation)
            self.shared_prefix_min_fraction = None
        if self.shared_prefix_min_fraction is not None and self.attn_implementation == "sdpa":
            _install_blocked_sdpa()
        params = [p for p in model.parameters() if p.requires_grad]
        self.ds_config = deepspeed_config(settings, self.dist.world_size, self.bf16)
        with _launcher_env(self.dist):
            self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=self.ds_config)
        self.engine.train()

    # -- model access ------------------------------------------------------------------------------------------

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def is_lora(self) -> bool:
        return self.settings.lora is not None

    def _causal_lm(self) -> torch.nn.Module:
        module = self.module
        return module.get_base_model() if hasattr(module, "get_base_model") else module

    # -- log-probs ---------------------------------------------------------------------------------------------

    def token_logprobs(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs (with grad) and entropies (without) of the micro-batch's generated tokens, in fp32."""
        lm = self._causal_lm()
        mask = mb.attention_mask
        if mask.dim() == 4 and self.attn_implementation == "eager":  # eager adds the mask to the scores
            dtype = lm.get_input_embeddings().weight.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        blocks = {"shared_prefix_blocks": mb.attention_blocks} \
            if mb.attention_blocks is not None and self.attn_implementation == "sdpa" else {}
        hidden = lm.get_decoder()(input_ids=mb.input_ids, attention_mask=mask,
                                  position_ids=mb.position_ids, **blocks).last_hidden_state
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.target_pos)
        head = lm.get_output_embeddings()
        logps, entropies = [], []
        for start in range(0, selected.shape[0], LOGPROB_CHUNK_TOKENS):
            chunk = selected[start:start + LOGPROB_CHUNK_TOKENS]
            targets = mb.targets[start:start + LOGPROB_CHUNK_TOKENS]
            allowed = None if mb.allowed is None else mb.allowed[start:start + LOGPROB_CHUNK_TOKENS]
            temperature, top_p = self.settings.temperature, self.settings.top_p
            if torch.is_grad_enabled() and chunk.requires_grad:
                logp, ent = torch.utils.checkpoint.checkpoint(_chunk_logprobs, head, chunk, targets, temperature,
                                                              top_p, allowed, use_reentrant=False)
            else:
                logp, ent = _chunk_logprobs(head, chunk, targets, temperature, top_p, allowed)
            logps.append(logp)
            entropies.append(ent)
        return torch.cat(logps), torch.cat(entropies).detach()

    @torch.no_grad()
    def score(self, rows: Sequence[TrainRow]) -> list[np.ndarray]:
        """Per-row log-probs of each row's generated tokens under the current weights (no gradient).

        Collective: every rank calls it, with its own rows (possibly none), and runs as many forward passes as
        the busiest rank, since ZeRO-3 gathers parameters inside every forward.
        """
        out: dict[int, np.ndarray] = {}
        plan = self._padded_plan(rows)
        was_training = self.module.training
        self.module.eval()
        try:
            for mb in plan:
                logp, _ = self.token_logprobs(mb.to(self.dist.device))
                if mb.padding:
                    continue
                owner = mb.token_row.numpy()
                values = logp.float().cpu().numpy()
                for index in np.unique(owner):
                    out[int(index)] = values[owner == index]
        finally:
            self.module.train(was_training)
        return [out.get(r.index, np.zeros(0, np.float32)) for r in rows]

    def _padded_plan(self, rows: Sequence[TrainRow]) -> list[MicroBatch]:
        """This rank's micro-batches, padded with empty ones to the most any rank has (collective)."""
        budget = self.settings.micro_batch_tokens
        plan = [collate(batch, self.pad_id) for batch in plan_micro_batches(rows, budget)] \
            if self.shared_prefix_min_fraction is None else plan_shared_micro_batches(
                rows, budget, self.shared_prefix_min_fraction, self.pad_id)
        count = torch.tensor([len(plan)], dtype=torch.long)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        return plan + [padding_micro_batch(self.pad_id) for _ in range(int(count.item()) - len(plan))]

    # -- one step ----------------------------------------------------------------------------------------------

    def train_step(self, rows: Sequence[TrainRow], loss_fn: LossFn) -> StepResult:
        """One optimizer update over this rank's rows; collective: every rank calls it once per update."""
        started = time.perf_counter()
        plan = self._padded_plan(rows)
        padding = sum(mb.padding for mb in plan)
        scale = float(self.dist.world_size)  # undo DeepSpeed's average over ranks: we want the sum
        loss_sum = torch.zeros((), dtype=torch.float64)
        stat_sums: dict[str, torch.Tensor] = {}
        row_tokens = target_tokens = shared_rows = saved_tokens = fallback_rows = 0
        for mb in plan:
            mb = mb.to(self.dist.device)
            logp, entropy = self.token_logprobs(mb)
            loss, stats = loss_fn(mb, logp, entropy)
            self.engine.backward(loss * scale, scale_wrt_gas=False)
            loss_sum += loss.detach().double().cpu()
            for name, value in stats.items():
                stat_sums[name] = stat_sums.get(name, torch.zeros((), dtype=torch.float64)) + value.detach().double().cpu()
            if not mb.padding:
                row_tokens += mb.row_tokens
                target_tokens += mb.num_targets
                shared_rows += mb.shared_rows
                saved_tokens += mb.saved_tokens
                fallback_rows += 0 if mb.shared_rows else int(mb.input_ids.shape[0])
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        names = sorted(stat_sums)
        counts = [float(row_tokens), float(target_tokens), float(padding), float(shared_rows), float(fallback_rows),
                  float(saved_tokens)]
        packed = torch.stack([loss_sum, *[torch.tensor(c, dtype=torch.float64) for c in counts],
                              *[stat_sums[n] for n in names]])
        torch.distributed.all_reduce(packed)  # sums over ranks; every rank must return the same stat names
        values = packed.tolist()
        return StepResult(
            loss=values[0],
            grad_norm=float(grad_norm) if grad_norm is not None else math.nan,
            stats=dict(zip(names, values[1 + len(counts):])),
            row_tokens=int(values[1]),
            target_tokens=int(values[2]),
            micro_batches=len(plan),
            padding_micro_batches=int(values[3]),
            seconds=time.perf_counter() - started,
            shared_prefix_rows=int(values[4]),
            prefix_fallback_rows=int(values[5]),
            shared_prefix_tokens=int(values[6]),
        )

    # -- state -------------------------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The weights to publish, on rank 0 (None elsewhere); collective under ZeRO-3, which must gather."""
        if self.settings.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
            return state if self.dist.is_main else None
        if not self.dist.is_main:
            return None
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}

    def save_pretrained(self, path: Path) -> None:
        """Write what vLLM loads: full HF weights + config + tokenizer, or the LoRA adapter. Collective."""
        state = self.full_state_dict()
        if self.dist.is_main:
            self.module.save_pretrained(path, state_dict=state, safe_serialization=True)  # peft: the adapter only
            if not self.is_lora:
                self.tokenizer.save_pretrained(path)
        torch.distributed.barrier()

    def save_engine_state(self, root: Path, tag: str) -> None:
        """Optimizer and engine state for resume (every rank writes its shard). Collective."""
        self.engine.save_checkpoint(str(root), tag=tag, save_latest=False,
                                    exclude_frozen_parameters=self.is_lora)

    def load_engine_state(self, root: Path, tag: str) -> None:
        """Restore weights + optimizer saved by :meth:`save_engine_state`. Collective."""
        path, _ = self.engine.load_checkpoint(str(root), tag=tag, load_module_strict=not self.is_lora,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {root}")

    def load_published(self, path: Path) -> None:
        """Load weights written by :meth:`save_pretrained` (no optimizer state). Every rank reads them."""
        from safetensors.torch import load_file

        if self.settings.zero_stage == 3:
            raise ValueError(f"cannot resume ZeRO-3 from published weights alone ({path}); keep the engine state "
                             "(keep_engine_states >= 1) or resume with zero_stage 1 or 2")
        state: dict[str, torch.Tensor] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(file))
        if not state:
            raise FileNotFoundError(f"{path} has no .safetensors files")
        if self.is_lora:
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.module, state)
            unexpected = list(result.unexpected_keys)
            missing: list[str] = []
        else:
            result = self.module.load_state_dict(state, strict=False)
            unexpected = list(result.unexpected_keys)
            missing = [n for n, p in self.module.named_parameters() if p.requires_grad and n in result.missing_keys]
        if unexpected or missing:
            raise ValueError(f"{path} does not match the model: unexpected {sorted(unexpected)[:5]}, "
                             f"missing {sorted(missing)[:5]}")
        refresh = getattr(self.engine.optimizer, "refresh_fp32_params", None)
        if refresh is not None:  # ZeRO keeps fp32 master copies; they must follow the loaded weights
            refresh()
        torch.distributed.barrier()


@contextlib.contextmanager
def _launcher_env(dist: DistInfo) -> Iterator[None]:
    """DeepSpeed's initialize insists on LOCAL_RANK in the environment; a world of one sets it only meanwhile."""
    if "LOCAL_RANK" in os.environ:
        yield
        return
    os.environ["LOCAL_RANK"] = str(dist.local_rank)
    try:
        yield
    finally:
        os.environ.pop("LOCAL_RANK", None)


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float = 1.0, top_p: float = 1.0,
                    allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and the entropy under the sampling policy: softmax(logits / temperature),
    restricted to the top-p nucleus and renormalised when ``top_p`` < 1.

    Where ``allowed`` (``[K, M]``, -1 padded) gives a target's set, the policy there is softmax over that set
    only: ``log pi(a) - logsumexp`` over the allowed ids, what vLLM samples from under a structured-output grammar
    (its mask comes before temperature and top-p, and the set the proxy records is what was left after both, so
    no nucleus is cut again there)."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    restricted = None
    if allowed is not None:
        restricted = allowed[:, 0] >= 0
        with torch.no_grad():
            keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, allowed.clamp_min(0), allowed >= 0)
            outside = ~keep & restricted[:, None]
        logits = logits.masked_fill(outside, float("-inf"))
    if top_p < 1.0:
        drop = _outside_nucleus(logits, targets, top_p)
        if restricted is not None:
            drop &= ~restricted[:, None]
        logits = logits.masked_fill(drop, float("-inf"))
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = logz - (probs * logits.masked_fill(torch.isinf(logits), 0.0)).sum(-1)
    return logp, entropy


def _outside_nucleus(logits: torch.Tensor, targets: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens top-p sampling never draws, by vLLM's rule: ascending by probability, those whose cumulative
    probability stays within 1 - top_p (the most likely token always stays). The sampled token itself always
    stays: two engines' rounding may put it on the other side of the cut, and -inf there would poison the loss."""
    with torch.no_grad():
        ordered, order = logits.sort(dim=-1)
        drop_ordered = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop_ordered[..., -1] = False
        drop = torch.zeros_like(drop_ordered).scatter(-1, order, drop_ordered)
        drop.scatter_(-1, targets.unsqueeze(-1), False)
    return drop
