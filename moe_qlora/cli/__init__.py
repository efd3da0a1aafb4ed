"""The `moe-qlora` command: one typer app; each command parses its options and calls the packages below.

May import every other package; nothing imports it.
"""
