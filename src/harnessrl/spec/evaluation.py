"""``spec.evaluation``: held-out tasks the policy is scored on while it trains, never trained on.

Training reward alone can rise through overfitting or reward hacking; an evaluation answers "is the policy
getting better on tasks it does not train on?". Its rollouts run through the same harness, proxy and store
as training rollouts (a rollout kind of the one scheduler), are attributed to the policy version they
evaluate and are never claimed by a learner step.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from harnessrl.spec.base import SpecModel
from harnessrl.spec.harness import Tasks
from harnessrl.spec.rules import Rule


class Evaluation(SpecModel):
    """Score the policy on held-out tasks at version 0 and every ``everySteps`` versions."""

    tasks: Tasks
    """The held-out tasks, from the same sources as harness.tasks. They run through the same harness (configMap,
    file or inline); keep them apart from the training tasks, or the score measures memorisation."""
    every_steps: int = Field(default=10, ge=1)
    """Evaluate every policy version that is a multiple of this (10: versions 10, 20, ...); the newest
    version serving when the number is reached is the one evaluated."""
    at_start: bool = True
    """Also evaluate version 0 (the base model) before it trains: the baseline the other scores compare to."""
    samples_per_task: int = Field(default=1, ge=1)
    """Rollouts per evaluation task and version; above 1 the results include pass@k for k = this number."""
    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature of evaluation calls (the proxy forces it, as spec.rollout.temperature on training
    calls); 0 is greedy decoding."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling of evaluation calls."""
    pass_reward: float = 1.0
    """A rollout passes when its reward is at least this; the pass rate and pass@k count passes (a failed or
    timed-out rollout never passes)."""

    # Changing the tasks, the sampling or the pass threshold mid-run would make scores of one run incomparable;
    # how often to evaluate may change.
    changeable: ClassVar[frozenset[str] | None] = frozenset({"every_steps"})

    rules = (
        Rule(
            field="samplesPerTask",
            cel="self.samplesPerTask == 1 || self.temperature > 0.0",
            holds=lambda e: e.samples_per_task == 1 or e.temperature > 0,
            problem="several samples per task at temperature 0 are the same greedy sample",
            explain=lambda e: f"samplesPerTask is {e.samples_per_task} but temperature is 0 (greedy)",
            fix="set evaluation.temperature above 0 (e.g. 1.0) or samplesPerTask to 1",
        ),
    )


def evaluation_sampling(evaluation: Evaluation) -> dict[str, float]:
    """The sampling fields the proxy forces on evaluation calls (``--evaluation-sampling``)."""
    return {"temperature": evaluation.temperature, "top_p": evaluation.top_p}
