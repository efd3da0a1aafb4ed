"""The training methods as recipes (recipe.py: the loop they share; sft.py, grpo.py: their steps), and what runs
need around a step: the update, optimizers, checkpoints and resume, a run's lifecycle, and what it does on a fault.

May import every package below it: common, moe, config, data, model, export, inference.
"""
