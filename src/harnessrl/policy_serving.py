"""How a TrainingRun's policy is served by vLLM: the model names and the flags the spec decides.

One mapping for ``harnessrl run`` (``local/runner.py``) and the operator (``operator/render_rollout.py``), so
a run serves the same way on one machine and on a cluster.

Names. Harnesses, the proxy and the learner's probes always ask for :data:`SERVED_MODEL_NAME`. With full-weight
sync that is the served model itself, reloaded in place. With ``weightSync.method: lora`` it is the LoRA
adapter, which the learner loads (``/v1/load_lora_adapter``, in place, under that one name) before the first
rollout — version 0 is the fresh adapter — and after every step; the base model stays addressable under
:data:`BASE_MODEL_NAME`. The two names must differ: vLLM routes a request to an adapter only by its name, and
a base served as "policy" would answer every call with the base weights while the store attributed it to an
adapter version.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harnessrl.spec.models import TrainingRunSpec

SERVED_MODEL_NAME = "policy"
"""What harnesses ask for (``HARNESSRL_MODEL_NAME``) and the proxy sends upstream: the policy being trained."""
BASE_MODEL_NAME = "policy-base"
"""The base model's served name when the policy is a LoRA adapter on it."""
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``--max-lora-rank`` (``vllm.config.lora.MaxLoRARanks``)."""


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds an adapter of ``rank`` (vLLM refuses any other value)."""
    for allowed in MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"spec.learner.lora.rank: {rank} is above {MAX_LORA_RANKS[-1]}, the largest LoRA rank vLLM serves — "
        "lower it"
    )


def is_lora(spec: TrainingRunSpec) -> bool:
    return spec.weight_sync.method == "lora"


def served_model_name(spec: TrainingRunSpec) -> str:
    """vLLM's ``--served-model-name``: the policy itself, or the base model under a LoRA policy."""
    return BASE_MODEL_NAME if is_lora(spec) else SERVED_MODEL_NAME


def lora_flags(spec: TrainingRunSpec) -> list[str]:
    """Runtime adapters, sized for the spec's rank (``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` must be set too)."""
    if not is_lora(spec):
        return []
    assert spec.learner.lora is not None  # the spec's rule: weightSync.method lora needs learner.lora
    return ["--enable-lora", "--max-lora-rank", str(max_lora_rank(spec.learner.lora.rank))]


SERVER_PARSER_FLAGS = ("--tool-call-parser", "--reasoning-parser")
"""vLLM flags whose parsers read the answers of calls the proxy continues through render / generate /
derender, which ``--enable-scale-out`` serves."""
SCALE_OUT_FLAG = "--enable-scale-out"


def continuity_flags(args: Sequence[str]) -> list[str]:
    """``--enable-scale-out`` when ``args`` name a tool-call or reasoning parser and do not enable it.

    Why added, not left to the spec: without it the proxy cannot continue a call that needs the server's
    parsers, so every such call takes the plain chat path and a rollout splits into rows (measured with a
    function-calling coding agent: 6 rows per rollout and 4.9x the tokens, against 1 row and 1.00x with it);
    a user who names a parser wants those calls parsed, and nothing tells them to add the flag. It opens no new
    way in: the render / generate endpoints sit on the rollout port harness pods already reach.
    """
    if SCALE_OUT_FLAG in args:
        return []
    named = any(arg == flag or arg.startswith(flag + "=") for arg in args for flag in SERVER_PARSER_FLAGS)
    return [SCALE_OUT_FLAG] if named else []


def load_request(checkpoint: str, lora_name: str | None) -> tuple[str, dict[str, Any]]:
    """vLLM's request (path, JSON body) that loads a servable checkpoint in place: full weights
    (``reload_weights`` through ``collective_rpc``), or the adapter under ``lora_name`` (loaded in place, so
    requests that name it switch at once). Shared by the learner's sync and the vLLM gate's restore."""
    if lora_name is None:
        return "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": checkpoint}}
    return "/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": checkpoint, "load_inplace": True}


def label_request(version: int) -> tuple[str, dict[str, Any]]:
    """vLLM's request that sets the weight label ``GET /weight_info`` answers: what proxies record calls under."""
    return "/update_weight_version", {"new_version": str(version)}
