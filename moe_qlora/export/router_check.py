"""`check-norms --run`: an adapter's experts against the router load its run logged. An expert the router never
chose cannot have learned; one it chose whose lora_B is still zero never got its gradient (a bug). The run's
metrics.jsonl holds each step's router load; router_layers.json, which experts module each entry is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from moe_qlora.common.reporting import read_jsonl
from moe_qlora.export.norms import AdapterReadError, NormReport

ROUTER_LAYERS = "router_layers.json"  # written by train / grpo: the experts modules in router_load's order


def routed_shares(run_dir: Path) -> tuple[dict[str, list[float]], int]:
    """({experts module: each expert's share of routed rows summed over the logged steps}, steps) from a run's
    metrics.jsonl and router_layers.json."""
    layers_file, metrics = run_dir / ROUTER_LAYERS, run_dir / "metrics.jsonl"
    for f in (layers_file, metrics):
        if not f.is_file():
            raise AdapterReadError(f"{f}: not there; --run takes the output.dir of a train or grpo run")
    names = [n.removeprefix("base_model.model.") for n in json.loads(layers_file.read_text())]
    totals: dict[str, list[float]] = {}
    steps = 0
    for record in read_jsonl(metrics):
        load = record.get("router_load")
        if not load:
            continue
        steps += 1
        for name, shares in zip(names, load, strict=True):
            totals[name] = [a + b for a, b in zip(totals.get(name, [0.0] * len(shares)), shares, strict=True)]
    return totals, steps


GGUF_EXPERTS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?:gate|up|down|gate_up)_exps\b")


def router_load_of(module: str, totals: dict[str, list[float]]) -> list[float] | None:
    """The router load of the experts module a report row belongs to. A PEFT row names the module itself; a
    GGUF's `blk.N.ffn_*_exps` row is matched by its layer N, since every family the GGUF export writes has one
    routed experts module per layer (shared experts are dense `ffn_*_shexp`). None when it is not in the run."""
    if (m := GGUF_EXPERTS.match(module)) is not None:
        found = [shares for name, shares in totals.items() if f".layers.{m['layer']}." in f"{name}."]
        return found[0] if len(found) == 1 else None
    return totals.get(module.rsplit(".", 1)[0])


def run_of(adapter: str | Path) -> Path | None:
    """The run folder an adapter was written in, where train, grpo, `export` and output.export_formats put it:
    RUN/adapter (the folder, or its file) or RUN/adapter.gguf and RUN/adapter-per-expert. None if not in one."""
    path = Path(adapter).resolve()
    for folder in (path, *path.parents[:2]) if path.is_dir() else path.parents[:2]:
        if (folder / ROUTER_LAYERS).is_file():
            return folder
    return None


def cross_check_router(report: NormReport, run_dir: str | Path) -> int:
    """Flag experts whose LoRA and router load disagree; returns the logged steps read.

    Never routed a token: its LoRA cannot have learned (B stays 0), which is a dead expert of the router,
    not a bug of the adapter; non-zero factors then mean another run's adapter. Routed but B still zero:
    its gradient never arrived, which is a bug."""
    totals, steps = routed_shares(Path(run_dir))
    report.router_rows_checked = 0
    for row in report.rows:
        shares = router_load_of(row.module, totals) if row.expert is not None else None
        if shares is None or row.expert >= len(shares):
            continue
        report.router_rows_checked += 1
        untrained = any("lora_B is all zero" in issue for issue in row.issues)
        if shares[row.expert] == 0 and untrained:
            row.issues.append(f"never routed a token in the {steps} logged steps: the router never chose it")
        elif shares[row.expert] == 0:
            row.issues.append(
                f"never routed a token in the {steps} logged steps, yet its LoRA is not zero "
                "(an adapter from another run?)"
            )
        elif untrained:
            row.issues.append(
                f"routed {shares[row.expert] / steps:.2%} of rows on average, yet lora_B is all "
                "zero: its gradient never reached it"
            )
    return steps
