"""Using a trained adapter: generation with it, and merging it into the base model's weights.

May import every package below it, up to train (which loads the policy and tokenizer).
"""
