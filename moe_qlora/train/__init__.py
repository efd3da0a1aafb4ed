"""The training loops: what `train` (sft) and `grpo` share (session), their steps, optimizers, checkpoints, and
what a run does when a step fails.

May import every package below it: common, moe, config, data, model, export.
"""
