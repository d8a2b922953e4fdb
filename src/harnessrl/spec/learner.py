"""``spec.learner``: how stored rollouts become training rows and gradient steps."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from harnessrl.spec.base import SpecModel
from harnessrl.spec.kube import PATH_MAX, Resources, Scheduling, Volume
from harnessrl.spec.rules import Rule, path_inside, path_inside_cel

NonNegativeFloat = Annotated[float, Field(ge=0)]


class Offload(SpecModel):
    """What DeepSpeed keeps in CPU memory instead of on the accelerator."""

    optimizer: Literal["none", "cpu"] = "none"
    """Optimizer states on the CPU (ZeRO stage 1 or higher)."""
    parameters: Literal["none", "cpu"] = "none"
    """Parameters on the CPU (ZeRO stage 3 only)."""


class DeepSpeed(SpecModel):
    """DeepSpeed engine settings."""

    zero_stage: int = Field(default=2, ge=0, le=3)
    """ZeRO stage: 0 off, 1 optimizer states, 2 plus gradients, 3 plus parameters sharded."""
    offload: Offload = Field(default_factory=Offload)
    """CPU offload of optimizer states and parameters."""

    rules = (
        Rule(
            field="offload.optimizer",
            cel="self.offload.optimizer == 'none' || self.zeroStage >= 1",
            holds=lambda d: d.offload.optimizer == "none" or d.zero_stage >= 1,
            problem="optimizer offload needs ZeRO stage 1 or higher",
            fix="set zeroStage to 1, 2 or 3, or offload.optimizer to none",
        ),
        Rule(
            field="offload.parameters",
            cel="self.offload.parameters == 'none' || self.zeroStage == 3",
            holds=lambda d: d.offload.parameters == "none" or d.zero_stage == 3,
            problem="parameter offload needs ZeRO stage 3",
            explain=lambda d: f"parameter offload needs ZeRO stage 3, not {d.zero_stage}",
            fix="set zeroStage to 3, or offload.parameters to none",
        ),
    )


class Algorithm(SpecModel):
    """The policy-gradient objective."""

    advantage: Literal["grpo", "rloo"] = "grpo"
    """Group-relative baseline: grpo (group mean) or rloo (leave-one-out mean). Both need groupSize >= 2."""
    std_normalize: bool = True
    """Divide advantages by the group's reward standard deviation."""
    loss: Literal["ppo-clip", "cispo", "acpo"] = "ppo-clip"
    """Surrogate loss over the ratio of the current policy to the one at the start of the step (decoupled PPO):
    ppo-clip, cispo (clipped ratio as a detached weight) or acpo (clip width from the ratios' spread). The
    ratio is 1 in a step's first update, so the clip acts only with miniBatches above 1."""
    loss_aggregation: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "per-rollout-mean"
    ] = "per-rollout-mean"
    """How token losses are averaged; per-rollout-mean weighs each rollout equally, whatever its rows."""
    clip: list[NonNegativeFloat] = Field(default_factory=lambda: [0.2, 0.28], min_length=2, max_length=2)
    """Ratio clip range [low, high]: the ratio to the step's starting policy is kept within [1 - low, 1 + high]
    (acpo sets its own width per probability bin)."""
    lr: float = Field(default=1.0e-6, gt=0)
    """Learning rate."""
    rollout_kl_coef: float = Field(default=0.0, ge=0)
    """Weight of a penalty on the KL divergence from the rollout policy (the weights that sampled the tokens;
    there is no frozen reference model): the k3 estimator of the reverse KL(policy || rollout policy) per
    generated token, exp(r) - r - 1 with r = rollout log-prob - policy log-prob, averaged like the loss. 0
    turns it off (it is still measured)."""
    tis_cap: float = Field(default=2.0, ge=0)
    """Truncated importance sampling cap on the weight exp(step-start log-prob - rollout log-prob), which
    corrects for stale rollouts and vLLM's numerics, separately from the clip; 0 turns it off."""
    failed_rollout_reward: float | None = None
    """Reward given to rollouts that failed or timed out; null leaves them out of training."""

    rules = (
        Rule(
            field="clip",
            cel="self.clip[0] <= self.clip[1]",
            holds=lambda a: a.clip[0] <= a.clip[1],
            problem="clip low is above clip high",
            explain=lambda a: f"low {a.clip[0]} is above high {a.clip[1]}",
            fix="write the range as [low, high] with low <= high, e.g. [0.2, 0.28]",
        ),
    )


class Rows(SpecModel):
    """How the calls of one rollout become training rows."""

    mode: Literal["merge", "transition"] = "merge"
    """merge: calls whose prompts extend the previous call become one row; transition: one row per call."""
    max_prompt_tokens: int = Field(default=16384, ge=1)
    """Rows whose prompt is longer are left out (and counted)."""
    max_row_tokens: int = Field(default=32768, ge=1)
    """A row may not grow past this: a call whose prompt leaves no room is dropped, a completion that runs past
    it is cut (both counted). Rows always start at the conversation's first token, so they are never split."""

    rules = (
        Rule(
            field="maxRowTokens",
            cel="self.maxRowTokens >= self.maxPromptTokens",
            holds=lambda r: r.max_row_tokens >= r.max_prompt_tokens,
            problem="maxRowTokens is below maxPromptTokens",
            explain=lambda r: (
                f"maxRowTokens {r.max_row_tokens} is below maxPromptTokens {r.max_prompt_tokens}"
            ),
            fix="raise maxRowTokens or lower maxPromptTokens",
        ),
    )


class Lora(SpecModel):
    """Train a LoRA adapter instead of all weights."""

    rank: int = Field(default=16, ge=1)
    """Adapter rank; vLLM is started with a matching --max-lora-rank."""
    alpha: float = Field(default=32.0, gt=0)
    """Scaling numerator (the adapter's output is scaled by alpha / rank)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Module names to adapt, as PEFT matches them."""


class Learner(SpecModel):
    """The learner Job: one pod per node, DeepSpeed across them."""

    nodes: int = Field(default=1, ge=1)
    """Pods (nodes) in the learner Job."""
    gpus_per_node: int = Field(default=1, ge=0)
    """Accelerators per learner pod; 0 trains on the CPU (small models, tests)."""
    image: str | None = Field(default=None, min_length=1)
    """Trainer image; default: the trainer image of the installed harnessrl version."""
    resources: Resources = Field(default_factory=Resources)
    """Extra requests and limits for each learner pod (accelerators come from gpusPerNode)."""
    deepspeed: DeepSpeed = Field(default_factory=DeepSpeed)
    """DeepSpeed settings."""
    algorithm: Algorithm = Field(default_factory=Algorithm)
    """Advantage, loss and optimizer settings."""
    rows: Rows = Field(default_factory=Rows)
    """How rollouts become rows."""
    micro_batch_tokens: int = Field(default=32768, ge=1)
    """Tokens per forward/backward pass; rows are packed up to this."""
    tasks_per_step: int = Field(default=8, ge=1)
    """Task groups whose rollouts make up one learner step."""
    mini_batches: int = Field(default=1, ge=1)
    """Optimizer updates per learner step, each on one part of the step's rollouts (nearly equal rollout counts,
    a rollout's rows together, at most one part per rollout), all clipped against the policy at the start of
    the step. 1 (default): one on-policy update per step, where the ratio is 1 and the clip never acts. Above 1
    costs one no-grad forward over the rows of every part but the first (acpo: one more per later update)."""
    max_staleness: int = Field(default=1, ge=0)
    """How many policy versions a rollout may lag behind the learner and still be trained on."""
    steps: int = Field(default=100, ge=1)
    """Learner steps; the run succeeds after the last one. A step that trains makes a new policy version; one
    whose groups give nothing to train (equal rewards) consumes them, counts, and makes none."""
    gradient_clip: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass to save memory."""
    lora: Lora | None = None
    """Train a LoRA adapter; required when weightSync.method is lora."""
    checkpoint_dir: str = Field(default="checkpoints", min_length=1, max_length=PATH_MAX)
    """Where versioned checkpoints are written; relative paths are inside the run's directory."""
    checkpoint_volume: Volume | None = None
    """A shared (ReadWriteMany) claim holding checkpointDir, so vLLM pods can load what the learner writes."""
    keep_checkpoints: int = Field(default=3, ge=1)
    """How many of the newest checkpoints to keep."""
    scheduling: Scheduling = Field(default_factory=Scheduling)
    """Node selector, tolerations, affinity, priority class, pull secrets and ServiceAccount of the learner
    pods."""

    cluster_only: ClassVar[frozenset[str]] = frozenset(
        {"nodes", "gpus_per_node", "image", "resources", "checkpoint_volume", "scheduling"}
    )

    rules = (
        Rule(
            field="microBatchTokens",
            cel="self.microBatchTokens >= self.rows.maxRowTokens",
            holds=lambda lr: lr.micro_batch_tokens >= lr.rows.max_row_tokens,
            problem="microBatchTokens is below rows.maxRowTokens, so the longest row fits in no micro-batch",
            explain=lambda lr: (
                f"microBatchTokens {lr.micro_batch_tokens} is below "
                f"rows.maxRowTokens {lr.rows.max_row_tokens}"
            ),
            fix="raise microBatchTokens or lower rows.maxRowTokens",
        ),
        Rule(
            field="checkpointDir",
            cel="!has(self.checkpointVolume) || "
            + path_inside_cel("self.checkpointDir", "self.checkpointVolume.mountPath"),
            holds=lambda lr: (
                lr.checkpoint_volume is None
                or path_inside(lr.checkpoint_dir, lr.checkpoint_volume.mount_path)
            ),
            problem="checkpointDir is not inside checkpointVolume.mountPath",
            explain=lambda lr: (
                f"checkpointDir {lr.checkpoint_dir!r} is not inside checkpointVolume.mountPath "
                f"{lr.checkpoint_volume.mount_path!r}"
            ),
            fix="put checkpointDir under the volume's mountPath",
        ),
        Rule(
            field="checkpointVolume.readOnly",
            cel="!has(self.checkpointVolume) || !self.checkpointVolume.readOnly",
            holds=lambda lr: lr.checkpoint_volume is None or not lr.checkpoint_volume.read_only,
            problem="the checkpoint volume is mounted read-only, so the learner cannot write checkpoints",
            fix="set checkpointVolume.readOnly to false",
        ),
    )
