"""Using a trained adapter: generation with it, and merging it into the base model's weights.

May import every package below it, up to model (which builds the model and tokenizer); nothing from train.
"""
