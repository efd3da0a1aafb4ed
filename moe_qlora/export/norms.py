"""`check-norms`: the health of a LoRA adapter, read from its tensors alone (no model code runs).

For every module (and every expert of an expert stack): ||A||, ||B|| and ||scale * B A|| (Frobenius).
The last is computed without forming B A: ||B A||_F^2 = trace((A A^T)(B^T B)), r x r matrices only.
Flags: NaN/Inf, B all zero (never trained), A all zero (B A = 0 whatever B is), and updates over
OUTLIER_FACTOR times the median of the same module across layers and experts.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moe_qlora.model.adapter_file import (
    AdapterReadError,
    adapter_weights_path,
    read_adapter_config,
    read_safetensors,
)

OUTLIER_FACTOR = 10.0
MIN_GROUP_FOR_OUTLIERS = 4
# PEFT nests wrappers in parameter order, the first projection innermost: gate_up_proj; up_proj when not gated;
# gate_proj then up_proj for split stacks (Inkling's shared experts)
PARAM_ORDER = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class NormRow:
    module: str
    expert: int | None
    norm_a: float
    norm_b: float
    norm_delta: float
    issues: list[str] = field(default_factory=list)


@dataclass
class NormReport:
    adapter: str
    scale: float
    scale_known: bool
    rows: list[NormRow]
    router_rows_checked: int | None = None  # expert rows matched to the run's router load (cross_check_router)

    @property
    def problems(self) -> list[str]:
        return [
            f"{r.module}{'' if r.expert is None else f' expert {r.expert}'}: {issue}"
            for r in self.rows
            for issue in r.issues
        ]

    @property
    def healthy(self) -> bool:
        return not self.problems


def read_adapter_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict | None, Path]:
    """Tensors of an adapter file (or folder) and its adapter_config.json when present beside it; a llama.cpp
    LoRA .gguf is read too (read_gguf_adapter). Non-finite values are read as they are: check-norms names them."""
    path = Path(path)
    if path.suffix == ".gguf":
        return read_gguf_adapter(path)
    weights = adapter_weights_path(path)
    config_path = weights.parent / "adapter_config.json"
    config = read_adapter_config(config_path) if config_path.is_file() else None
    return read_safetensors(weights), config, weights


def read_gguf_adapter(path: Path) -> tuple[dict[str, torch.Tensor], dict, Path]:
    """A llama.cpp LoRA GGUF as PEFT-style tensors: `<tensor>.lora_a/.lora_b` become `<tensor>.lora_A/B.weight`;
    3D expert tensors (E, r, in) / (E, out, r) are flattened as PEFT stacks experts (rows e*r + j of A,
    columns j*E + e of B), so every expert gets its own row. llama.cpp scales each tensor by adapter.lora.alpha
    over its own rank (B's columns: a base converted with --fuse-qkv has attn_qkv at 3r), so the config carries
    each tensor's rank; "r" is the experts' (the rank their stacks are split by)."""
    import gguf
    import numpy as np

    if not path.is_file():
        raise AdapterReadError(f"{path}: no such adapter file")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise AdapterReadError(f"{path}: not a readable GGUF file ({exc})") from None
    fields = reader.fields
    kind = fields.get("general.type")
    if kind is None or bytes(kind.parts[kind.data[0]]).decode() != "adapter":
        raise AdapterReadError(f"{path}: a GGUF, but not an adapter (general.type is not 'adapter')")
    alpha_field = fields.get("adapter.lora.alpha")
    tensors, ranks, expert_ranks = {}, {}, set()
    for t in reader.tensors:
        x = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)]))
        base, _, ab = t.name.rpartition(".lora_")
        if ab == "a":
            ranks[base] = x.shape[-2]
            if x.dim() == 3:
                expert_ranks.add(x.shape[-2])
            x = x.reshape(-1, x.shape[-1])  # (E, r, in) -> (E*r, in)
        elif x.dim() == 3:
            x = x.permute(1, 2, 0).reshape(x.shape[1], -1)  # (E, out, r) -> (out, r*E)
        tensors[f"{base}.lora_{ab.upper()}.weight"] = x
    rank = min(expert_ranks or ranks.values(), default=None)
    config = None
    if alpha_field:
        config = {"r": rank, "lora_alpha": float(alpha_field.parts[alpha_field.data[0]][0]), "tensor_ranks": ranks}
    return tensors, config, path


def pair_factors(tensors: dict[str, torch.Tensor], source: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (A (r*, in), B (out, r*))} from '<module>.lora_A.weight' / '<module>.lora_B.weight' keys."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m:
            pairs.setdefault(m.group(1), {})[m.group(2)] = t
    if not pairs:
        raise AdapterReadError(f"{source}: no lora_A / lora_B tensors: not a LoRA adapter")
    out = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterReadError(f"{source}: {module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterReadError(
                f"{source}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not multiply"
            )
        out[module] = (a.double(), b.double())
    return out


def _scale(config: dict | None) -> tuple[float, bool]:
    if not config or "r" not in config or "lora_alpha" not in config:
        return 1.0, False
    r, alpha = config["r"], config["lora_alpha"]
    return (alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r), True


def _module_label(module: str, config: dict | None) -> str:
    """Readable name: prefix dropped; an expert wrapper named by the parameter it adapts."""
    name = module.removeprefix("base_model.model.")
    depth = 0
    while name.endswith(".base_layer"):
        name, depth = name.removesuffix(".base_layer"), depth + 1
    targets = [t for t in (config or {}).get("target_parameters") or [] if name.endswith(t.rsplit(".", 1)[0])]
    params = [p for p in PARAM_ORDER if any(t.endswith("." + p) for t in targets)]
    if params and depth < len(params):
        return f"{name}.{params[len(params) - 1 - depth]}"
    return module.removeprefix("base_model.model.")


def _frobenius_delta(a: torch.Tensor, b: torch.Tensor) -> float:
    return math.sqrt(max(0.0, float(torch.trace((a @ a.T) @ (b.T @ b)))))


def _factor_issues(a: torch.Tensor, b: torch.Tensor) -> list[str]:
    issues = []
    for name, t in (("A", a), ("B", b)):
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            issues.append(f"{bad} NaN/Inf values in lora_{name}")
    if torch.isfinite(b).all() and not bool(b.any()):
        issues.append("lora_B is all zero (never trained)")
    if torch.isfinite(a).all() and not bool(a.any()):
        issues.append("lora_A is all zero (the update B A is zero: this adapter does nothing here)")
    return issues


def module_rows(label: str, a, b, *, rank: int | None, scale: float) -> list[NormRow]:
    """One row, or one per expert when the factors stack E experts (A: (r*E, in), B: (out, r*E))."""
    experts = a.shape[0] // rank if rank and a.shape[0] > rank and a.shape[0] % rank == 0 else 1
    rows = []
    for e in range(experts):
        ae = a[e * rank : (e + 1) * rank] if experts > 1 else a
        be = b.view(b.shape[0], rank, experts)[:, :, e] if experts > 1 else b  # columns j*E + e
        rows.append(
            NormRow(
                module=label,
                expert=e if experts > 1 else None,
                norm_a=float(ae.norm()),
                norm_b=float(be.norm()),
                norm_delta=scale * _frobenius_delta(ae, be),
                issues=_factor_issues(ae, be),
            )
        )
    return rows


def flag_outliers(rows: list[NormRow]) -> None:
    """Mark updates far above the rest of the same module kind (across layers and experts)."""
    groups: dict[str, list[NormRow]] = {}
    for r in rows:
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", r.module), []).append(r)
    for group in groups.values():
        finite = [r.norm_delta for r in group if math.isfinite(r.norm_delta)]
        if len(finite) < MIN_GROUP_FOR_OUTLIERS:
            continue
        median = statistics.median(finite)
        for r in group:
            if median > 0 and math.isfinite(r.norm_delta) and r.norm_delta > OUTLIER_FACTOR * median:
                r.issues.append(f"||scale*BA|| {r.norm_delta:.3g} is over {OUTLIER_FACTOR:g}x the median {median:.3g}")


def check_norms(path: str | Path) -> NormReport:
    tensors, config, weights = read_adapter_tensors(path)
    scale, known = _scale(config)
    rank = (config or {}).get("r")
    rows = []
    for module, (a, b) in pair_factors(tensors, weights).items():
        own = (config or {}).get("tensor_ranks", {}).get(module, rank)  # a GGUF's: alpha over each tensor's rank
        own_scale = scale if own == rank else config["lora_alpha"] / own
        rows.extend(module_rows(_module_label(module, config), a, b, rank=own, scale=own_scale))
    flag_outliers(rows)
    return NormReport(adapter=str(weights), scale=scale, scale_known=known, rows=rows)


def report_json(report: NormReport) -> str:
    def finite(x):
        return x if isinstance(x, float) and math.isfinite(x) else None if isinstance(x, float) else x

    rows = [{k: finite(v) for k, v in asdict(r).items()} for r in report.rows]
    return json.dumps(
        {
            "adapter": report.adapter,
            "scale": report.scale,
            "scale_known": report.scale_known,
            "healthy": report.healthy,
            "problems": report.problems,
            "rows": rows,
        },
        indent=2,
    )


@dataclass
class ModuleSummary:
    """One module (an expert stack: all its experts) of one layer: min / median / max of each norm."""

    module: str
    experts: int
    norm_a: tuple[float, float, float]
    norm_b: tuple[float, float, float]
    norm_delta: tuple[float, float, float]
    problems: list[str]


def _spread(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return ordered[0], ordered[len(ordered) // 2], ordered[-1]


def summarize(report: NormReport) -> list[ModuleSummary]:
    """One entry per module (per layer), in the report's order; the experts with problems named by number."""
    groups: dict[str, list[NormRow]] = {}
    for r in report.rows:
        groups.setdefault(r.module, []).append(r)
    out = []
    for module, rows in groups.items():
        problems = [f"{'' if r.expert is None else f'expert {r.expert}: '}{issue}" for r in rows for issue in r.issues]
        out.append(
            ModuleSummary(
                module,
                len(rows) if rows[0].expert is not None else 0,
                _spread([r.norm_a for r in rows]),
                _spread([r.norm_b for r in rows]),
                _spread([r.norm_delta for r in rows]),
                problems,
            )
        )
    return out


LAYER_IN_NAME = re.compile(r"^(?:(?P<prefix>.*?)\.)?(?P<layer>\d+)\.(?P<rest>.+)$")


def split_layers(modules: list[str]) -> tuple[str, dict[str, tuple[str, str]]]:
    """(prefix, {module: (layer, name under the layer)}) for the prefix most modules share before their layer
    number ('model.layers'); a module under another prefix, or under none, keeps its whole name and no layer.
    The tables show the layer in a column of its own, so that a name fits one line of an 80-column terminal."""
    found = {m: match for m in modules if (match := LAYER_IN_NAME.match(m))}
    prefixes = Counter(match["prefix"] or "" for match in found.values())
    prefix = prefixes.most_common(1)[0][0] if prefixes else ""
    return prefix, {
        m: (found[m]["layer"], found[m]["rest"]) if m in found and (found[m]["prefix"] or "") == prefix else ("", m)
        for m in modules
    }


def norms_table(title: str, columns: tuple[str, ...]):
    """A table without vertical rules or padding, one space between columns, so that at 80 columns the layer and
    module name keep their line (never wrapped) and only the problems text wraps."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    for col in columns:
        left = col in ("module", "problems", "issues")
        table.add_column(
            col, justify="left" if left else "right", no_wrap=col in ("layer", "module", "expert"), overflow="fold"
        )
    return table


def under_prefix(report: NormReport, prefix: str) -> str:
    return f"{report.adapter}, modules under {prefix}.N" if prefix else report.adapter


def render_summary(report: NormReport, console) -> None:
    """The default view at MoE scale: one row per module and layer (not 12,288 rows for Qwen3-30B-A3B)."""

    def fmt(spread):  # the median, and below it the range over the experts
        lo, mid, hi = spread
        return f"{mid:.4g}" if lo == hi else f"{mid:.3g}\n[dim]{lo:.2g}-{hi:.2g}"

    summary = summarize(report)
    prefix, names = split_layers([m.module for m in summary])
    table = norms_table(
        f"LoRA norms: {under_prefix(report, prefix)} (expert stacks: the median over experts, min-max below)",
        ("layer", "module", "||A||", "||B||", "||scale*BA||", "problems"),
    )
    for m in summary:
        shown = "; ".join(m.problems[:3]) + (f"; and {len(m.problems) - 3} more" if len(m.problems) > 3 else "")
        layer, name = names[m.module]
        name += f"\n[dim]{m.experts} experts" if m.experts else ""  # under the name: a column of its own is too wide
        table.add_row(
            layer, name, fmt(m.norm_a), fmt(m.norm_b), fmt(m.norm_delta), f"[red]{shown}" if m.problems else "[green]ok"
        )
    console.print(table)
    _render_verdict(report, console)


def _render_verdict(report: NormReport, console) -> None:
    if not report.scale_known:
        console.print("[yellow]no adapter_config.json beside the file: scale taken as 1 and experts not split")
    verdict = "[green]healthy" if report.healthy else f"[red]{len(report.problems)} problem(s)"
    console.print(f"{len(report.rows)} rows, scale {report.scale:g}: {verdict}")


def render_table(report: NormReport, console) -> None:
    """Every row: one per expert of every expert stack (--per-expert)."""
    prefix, names = split_layers(list(dict.fromkeys(r.module for r in report.rows)))
    table = norms_table(
        f"LoRA norms: {under_prefix(report, prefix)}",
        ("layer", "module", "expert", "||A||", "||B||", "||scale*BA||", "issues"),
    )
    for r in report.rows:
        table.add_row(
            *names[r.module],
            "" if r.expert is None else str(r.expert),
            f"{r.norm_a:.4g}",
            f"{r.norm_b:.4g}",
            f"{r.norm_delta:.4g}",
            "[red]" + "; ".join(r.issues) if r.issues else "[green]ok",
        )
    console.print(table)
    _render_verdict(report, console)
