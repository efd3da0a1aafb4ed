"""`python -m moe_qlora ...`: the same as the `moe-qlora` command."""

from .cli import main

main()
