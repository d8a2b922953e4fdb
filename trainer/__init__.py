"""Learner: stored calls to rows, advantages, losses, DeepSpeed steps, checkpoints and weight sync."""
