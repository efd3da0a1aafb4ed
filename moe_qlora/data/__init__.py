"""Training rows: where they come from (files, folders, hub datasets) and how they become masked token sequences.

May import moe_qlora.common and moe_qlora.config.
"""
