"""The ids the scheduler gives rollouts, and what an id says about its rollout.

Ids are deterministic (re-creating a group after a crash is a no-op in the store) and carry their kind at
their end, after the run's name: ``<run>-g<group>-r<index>`` for training,
``<run>-eval-v<version>-t<task>-r<index>`` for an evaluation of a policy version. The id is what a harness's
``OPENAI_BASE_URL`` (gateway) or ``HARNESSRL_ROLLOUT_ID`` (sidecar) hands the proxy, so the proxy tells an
evaluation call from a training call by the attribution it already has, without asking the store.
"""

from __future__ import annotations

import re

EVALUATION_ID = re.compile(r"-eval-v(\d{6,})-t(\d{4,})-r(\d{3,})$")


def training_rollout_id(run: str, group: int, index: int) -> str:
    return f"{run}-g{group:06d}-r{index:03d}"


def evaluation_rollout_id(run: str, version: int, task: int, index: int) -> str:
    """Rollout ``index`` of evaluation task number ``task`` (its place in the evaluation's task list)."""
    return f"{run}-eval-v{version:06d}-t{task:04d}-r{index:03d}"


def is_evaluation(rollout_id: str | None) -> bool:
    """Whether a scheduler-made rollout id is an evaluation's (whatever the run is called: the suffix decides)."""
    return rollout_id is not None and EVALUATION_ID.search(rollout_id) is not None


def group_of(rollout_id: str) -> str:
    """The group part of a training rollout id (``<run>-g<group>``)."""
    return rollout_id.rsplit("-r", 1)[0]
