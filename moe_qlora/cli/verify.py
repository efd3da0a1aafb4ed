"""`moe-qlora verify ADAPTER`: each export beside an adapter read as its runtime reads it and compared with what
the adapter makes of that format; a table, one row per format, exit 1 on any mismatch."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import typer

from moe_qlora.cli.common import console, err_console, fail, quiet_libraries, user_errors

VERIFY_EPILOG = """Examples:

  moe-qlora verify runs/demo/adapter                          # every export found beside it

  moe-qlora verify runs/demo/adapter --format gguf --merged runs/demo/merged --json
"""


def verify_cmd(
    adapter: str = typer.Argument(..., help="the adapter folder a run wrote (PEFT format)"),
    formats: list[str] = typer.Option(
        None, "--format", "-f", help="gguf | vllm | per-expert (repeatable): only these, each required to be there"
    ),
    merged: str = typer.Option(None, "--merged", help="a merged checkpoint of this adapter (moe-qlora merge --out)"),
    gguf_base: str = typer.Option(
        None,
        "--gguf-base",
        help="the base as an f32 GGUF, for libllama's run of the GGUF export (else converted with LLAMA_CPP_DIR's "
        "convert_hf_to_gguf.py)",
    ),
    as_json: bool = typer.Option(False, "--json", help="print JSON (one object per row) instead of a table"),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """Whether each export of ADAPTER serves what was trained: PEFT's own load of the adapter, and the GGUF,
    vLLM and per-expert exports beside it (export's default names) and --merged, each read as its runtime
    reads it and compared tensor by tensor with what the adapter gives. Exit 0 all checked agree, 1 a
    mismatch, 2 unreadable."""
    quiet_libraries()
    from rich.table import Table

    from moe_qlora.inference.verify import verify_all

    try:
        rows = verify_all(
            Path(adapter),
            merged=Path(merged) if merged else None,
            formats=formats,
            console=err_console,
            gguf_base=Path(gguf_base) if gguf_base else None,
        )
    except user_errors() as exc:
        fail(exc, debug)
    if as_json:
        sys.stdout.write(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    else:
        table = Table("format", "result", "tensors", "what was checked", box=None, pad_edge=False)
        for r in rows:
            style = {"ok": "green", "mismatch": "red"}.get(r.status, "yellow")
            table.add_row(r.format, f"[{style}]{r.status}[/{style}]", str(r.tensors or "-"), r.detail)
        console.print(table)
    raise typer.Exit(1 if any(r.status == "mismatch" for r in rows) else 0)
