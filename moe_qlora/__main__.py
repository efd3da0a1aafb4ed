"""`python -m moe_qlora ...`: the same as the `moe-qlora` command."""

from moe_qlora.cli.app import entry_point

entry_point()
