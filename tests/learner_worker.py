"""A learner process for the multi-process and crash tests: ``python tests/learner_worker.py ARGS``.

It runs the real learner loop (what ``harnessrl learn`` runs) and adds what a test needs from the inside: kill
itself with SIGKILL right after a given step's checkpoint is saved (before the commit), and dump this rank's
weights. Rank and world come from the standard launcher environment.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch

from harnessrl.store import TraceStore
from harnessrl.trainer.engine import EngineSettings, PolicyEngine, init_distributed
from harnessrl.trainer.learner import Learner, LearnerHooks, LearnerSettings
from harnessrl.trainer.losses import LossConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--tasks-per-step", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--micro-batch-tokens", type=int, default=32768)
    parser.add_argument("--mini-batches", type=int, default=1)
    parser.add_argument("--loss", default="ppo-clip")
    parser.add_argument("--acpo-alpha", type=float, default=3.0)
    parser.add_argument("--no-shared-prefix", action="store_true", help="train every row alone")
    parser.add_argument("--kill-after-save", type=int, default=None)
    parser.add_argument("--dump", type=Path, default=None, help="write this rank's weights to DUMP.rank<N>.pt")
    args = parser.parse_args()

    dist = init_distributed()
    settings = LearnerSettings(
        run=args.run, model_dir=args.model, output_dir=args.output, steps=args.steps,
        tasks_per_step=args.tasks_per_step, group_size=args.group_size, wait_timeout_s=0,
        engine=EngineSettings(lr=args.lr, eps=args.eps, micro_batch_tokens=args.micro_batch_tokens,
                              shared_prefix_min_fraction=None if args.no_shared_prefix else 0.5),
        mini_batches=args.mini_batches, loss=LossConfig(loss=args.loss, acpo_alpha=args.acpo_alpha),
    )

    def after_save(step: int) -> None:
        if step == args.kill_after_save:
            os.kill(os.getpid(), signal.SIGKILL)

    store = TraceStore.connect(args.store) if dist.is_main else None
    engine = PolicyEngine(args.model, settings.engine, dist)
    outcomes = Learner(settings, engine, store, hooks=LearnerHooks(after_save=after_save)).run()
    if args.dump is not None:
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        torch.save(weights, f"{args.dump}.rank{dist.rank}.pt")
    if dist.is_main:
        print(json.dumps({"steps": [o.step for o in outcomes],
                          "grad_norms": [o.metrics.get("grad_norm") for o in outcomes],
                          "padding": [o.metrics.get("padding_micro_batches") for o in outcomes],
                          "shared": [o.metrics.get("shared_prefix_rows") for o in outcomes],
                          "clip_frac": [o.metrics.get("clip_frac") for o in outcomes],
                          "acpo_clip_mean": [o.metrics.get("acpo_clip_mean") for o in outcomes]}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
