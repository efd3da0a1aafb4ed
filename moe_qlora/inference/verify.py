"""`moe-qlora verify ADAPTER`: does each export beside an adapter serve what was trained? One row per format.

Each export is read by its runtime's own reader where one is installed (PEFT's `from_pretrained` for the adapter
itself; gguf-py's GGUFReader, llama.cpp's own reader, for the GGUF; safetensors for the PEFT-layout folders and
the merged checkpoint; vLLM's loader through VLLM_PYTHON; libllama itself, where llama-cpp-python is installed,
running the GGUF: libllama_check.py) and compared with what the adapter, as the run trained
it, makes of that format: every tensor there under its name (none missing, none extra: a LoRA silently dropped
shows as missing), each equal to the one the adapter gives within a stated tolerance, the scale the same.

Tolerances: the PEFT-layout folders and the GGUF hold fp32 copies or slices of the adapter's fp32 factors, so
equal bit for bit (0). A merged checkpoint holds dequantized base + delta rounded to its dtype: within half a
unit in the last place of that dtype (fp32: 2^-24, bf16: 2^-9, fp16: 2^-11, relative to each element), plus
1e-6 of the tensor's largest value for the order of the fp32 sums.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_qlora.export.family_tables import ExportError
from moe_qlora.model.adapter_file import AdapterReadError, read_checked_adapter, read_safetensors
from moe_qlora.model.peft_roundtrip import ADAPTER_CONFIG, ADAPTER_WEIGHTS, first_few

# the suffix `export` gives each format beside the adapter folder (cli/adapter.py's DEFAULT_OUT_SUFFIX)
BESIDE = {"gguf": ".gguf", "vllm": "-vllm", "per-expert": "-per-expert"}
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-9, torch.float16: 2.0**-11}


@dataclass
class Row:
    """One format's verdict: ok, a mismatch (exit 1), or not checked and why."""

    format: str
    path: str
    status: str  # "ok" | "mismatch" | "not checked"
    detail: str
    tensors: int = 0


def compare_tensors(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> str | None:
    """None when `found` holds exactly `expected`'s keys with equal values; else what differs, by name."""
    if missing := sorted(expected.keys() - found.keys()):
        return f"{len(missing)} tensor(s) the adapter has are missing: {first_few(missing)}"
    if extra := sorted(found.keys() - expected.keys()):
        return f"{len(extra)} tensor(s) the adapter does not have: {first_few(extra)}"
    shapes = sorted(k for k in expected if tuple(expected[k].shape) != tuple(found[k].shape))
    if shapes:
        k = shapes[0]
        return f"{k} has shape {tuple(found[k].shape)}, the adapter gives {tuple(expected[k].shape)}"
    differ = sorted(k for k in expected if not torch.equal(expected[k].float(), found[k].float()))
    if differ:
        k = differ[0]
        err = float((expected[k].float() - found[k].float()).abs().max())
        return f"{len(differ)} tensor(s) differ from the adapter's: {first_few(differ)} ({k}: max error {err:.3g})"
    return None


def written_by(
    writer: Callable[..., Path], adapter: Path, target: str = "out", **options
) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, adapter_config or {}) that `writer` makes of the adapter now, written to a scratch `target`."""
    with tempfile.TemporaryDirectory(prefix="moe-qlora-verify-") as tmp:
        out = writer(adapter, Path(tmp) / target, **options)
        if out.suffix == ".gguf":
            return gguf_tensors_of(out), {}
        return read_safetensors(out / ADAPTER_WEIGHTS), json.loads((out / ADAPTER_CONFIG).read_text())


def gguf_tensors_of(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF as gguf-py's reader (llama.cpp's own) gives it, in torch's order of dimensions."""
    import gguf
    import numpy as np

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise AdapterReadError(f"{path}: not a readable GGUF file ({exc})") from None
    shape = lambda t: [int(d) for d in reversed(t.shape)]  # noqa: E731 (gguf lists ggml's order)
    return {t.name: torch.from_numpy(np.array(t.data).reshape(shape(t))) for t in reader.tensors}


def gguf_alpha(path: Path) -> float | None:
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("adapter.lora.alpha")
    return None if field is None else float(field.parts[field.data[0]][0])


def verify_gguf(adapter: Path, path: Path, config: dict) -> Row:
    """The GGUF against what the GGUF export makes of the adapter now; llama.cpp's converter flags (fused q/k/v,
    fused gate/up experts) are read off its tensor names, since the file does not record them."""
    from moe_qlora.export.gguf_lora import write_gguf

    found = gguf_tensors_of(path)
    options = converter_options(found)
    expected, _ = written_by(write_gguf, adapter, "out.gguf", **options)
    problem = compare_tensors(expected, found)
    if problem is None and gguf_alpha(path) != float(config["lora_alpha"]):
        problem = f"adapter.lora.alpha is {gguf_alpha(path)}, the adapter's lora_alpha {config['lora_alpha']}"
    flags = ", ".join(converter_flags(options))
    how = "read by gguf-py's GGUFReader" + (f" (as exported with {flags})" if flags else "")
    return row("gguf", path, problem, len(found), how)


def converter_options(gguf_tensors: dict) -> dict[str, bool]:
    """llama.cpp's converter flags a GGUF adapter was exported for, read off its tensor names (as keywords)."""
    return {
        "fuse_qkv": any(".attn_qkv." in k for k in gguf_tensors),
        "fuse_gate_up_exps": any(".ffn_gate_up_exps." in k for k in gguf_tensors),
    }


def converter_flags(options: dict[str, bool]) -> tuple[str, ...]:
    """The options that are on, as the converter's command-line flags (--fuse-qkv, --fuse-gate-up-exps)."""
    return tuple(f"--{k.replace('_', '-')}" for k, on in options.items() if on)


def libllama_row(adapter: Path, path: Path, config: dict, gguf_base: Path | None) -> Row:
    """libllama's run of the GGUF on the f32 base against PEFT's run of the adapter (libllama_check.py); "not
    checked" with the reason where libllama, an f32 base or a telling comparison cannot be had."""
    from moe_qlora.inference import libllama_check
    from moe_qlora.model.model_path import resolve_model_path

    name, base_dir = "gguf (libllama)", Path(resolve_model_path(config["base_model_name_or_path"]))
    if (why := libllama_check.unavailable(gguf_base, base_dir)) is not None:
        return Row(name, str(path), "not checked", why)
    found = gguf_tensors_of(path)
    flags = converter_flags(converter_options(found))
    with tempfile.TemporaryDirectory(prefix="moe-qlora-verify-") as tmp:
        base = libllama_check.f32_base(gguf_base, base_dir, flags, Path(tmp))
        if isinstance(base, str):
            return Row(name, str(path), "not checked", base)
        status, detail = libllama_check.compare_runs(adapter, path, base, base_dir)
    return Row(name, str(path), status, detail, len(found) if status != "not checked" else 0)


def verify_peft_layout(fmt: str, adapter: Path, path: Path, config: dict) -> Row:
    """A PEFT-layout export (vllm, per-expert) against what its writer makes of the adapter now; one of another
    base or scale is refused in one sentence."""
    from moe_qlora.export.writers import WRITERS

    found, theirs = read_checked_adapter(path, "verify")
    for key in ("base_model_name_or_path", "r", "lora_alpha"):
        if theirs.get(key) != config.get(key):
            raise AdapterReadError(
                f"{path}: its {ADAPTER_CONFIG} has {key} {theirs.get(key)!r}, the adapter {adapter} has "
                f"{config.get(key)!r}: the {fmt} export of another adapter; export this one again with --force"
            )
    expected, _ = written_by(WRITERS[fmt], adapter)
    return row(fmt, path, compare_tensors(expected, found), len(found), "read with safetensors")


def verify_peft(adapter: Path, config: dict) -> Row:
    """The adapter itself through PEFT's own from_pretrained on a weightless skeleton of its base."""
    from transformers import AutoConfig

    from moe_qlora.model.model_path import resolve_model_path
    from moe_qlora.model.peft_roundtrip import load_like_peft

    base = AutoConfig.from_pretrained(resolve_model_path(config["base_model_name_or_path"]))
    report = load_like_peft(adapter, base)
    problem = None if report.ok else report.describe(base.model_type)
    count = len(read_safetensors(adapter / ADAPTER_WEIGHTS))
    return row("peft", adapter, problem, count, "loaded by PEFT's from_pretrained")


def row(fmt: str, path: Path, problem: str | None, count: int, how: str, agree: str = "equal to the adapter's") -> Row:
    if problem:
        return Row(fmt, str(path), "mismatch", problem, count)
    return Row(fmt, str(path), "ok", f"{how}: every tensor there, {agree}", count)


def verify_merged(adapter: Path, merged: Path, console) -> Row:
    """Every tensor of a merged checkpoint against the merge of the adapter now (dequantized base + delta)."""
    from safetensors import safe_open

    from moe_qlora.inference.merge import DTYPES, merged_tensors_of

    files = sorted(merged.glob("*.safetensors"))
    if not files:
        raise AdapterReadError(f"{merged}: no *.safetensors: not a merged checkpoint (moe-qlora merge --out)")
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {k: h for h in handles for k in h.keys()}
    dtype = next(iter(where.values())).get_tensor(next(iter(where))).dtype
    if dtype not in DTYPES.values():
        raise AdapterReadError(f"{merged}: tensors in {dtype}, not a dtype moe-qlora merge writes")
    seen, problems = set(), []
    for key, want in merged_tensors_of(adapter, dtype, console):
        seen.add(key)
        if key not in where:
            problems.append(f"{key} is missing")
            continue
        got = where[key].get_tensor(key).float()
        want = want.float()
        tol = HALF_ULP[dtype] * want.abs() + 1e-6 * float(want.abs().max()) if want.numel() else 0
        if got.shape != want.shape or bool(((got - want).abs() > tol).any()):
            err = float((got - want).abs().max()) if got.shape == want.shape else float("nan")
            problems.append(f"{key} differs from the merge of this adapter (max error {err:.3g})")
    if extra := sorted(where.keys() - seen):
        problems.append(f"{len(extra)} tensor(s) the merge does not write: {first_few(extra)}")
    problem = f"{len(problems)} problem(s): " + "; ".join(problems[:3]) if problems else None
    how = f"read with safetensors ({str(dtype).removeprefix('torch.')})"
    return row("merged", merged, problem, len(where), how, "the base plus this adapter's deltas within half an ulp")


VLLM_BASE_LIMIT = 4 * 2**30  # vLLM on the CPU holds the base twice in fp32 (with and without the LoRA), and PEFT once


def vllm_runtime_row(adapter: Path, export: Path, config: dict) -> Row:
    """vLLM's own loading of the export (export.vllm_runtime_check under VLLM_PYTHON, on the CPU): every tensor
    lands in a wrapped module that the model calls, and base + vLLM's delta equals PEFT's fp32 merge within 1e-5
    of the delta's scale. Run for bases up to VLLM_BASE_LIMIT; else, or without VLLM_PYTHON, said why not."""
    import os
    import subprocess

    from moe_qlora.export import vllm_runtime_check
    from moe_qlora.model.model_path import resolve_model_path

    name = "vllm (runtime)"
    if not (python := os.environ.get("VLLM_PYTHON")):
        return Row(name, str(export), "not checked", "VLLM_PYTHON is not set (docs/export.md: vLLM in its own venv)")
    base = Path(resolve_model_path(config["base_model_name_or_path"]))
    size = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    if size > VLLM_BASE_LIMIT:
        why = f"the base is {size / 2**30:.1f} GiB; vLLM on the CPU holds it twice in fp32 (checked up to 4 GiB)"
        return Row(name, str(export), "not checked", why)
    with tempfile.TemporaryDirectory(prefix="moe-qlora-vllm-") as tmp:
        merged = peft_fp32_merge(adapter, base, Path(tmp) / "merged")
        case = {"name": "export", "base": str(base), "lora": str(export), "merged": str(merged), "rank": config["r"]}
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"cases": [case], "out": str(Path(tmp) / "out.json")}))
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
        proc = subprocess.run([python, vllm_runtime_check.__file__, str(job)], env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not (Path(tmp) / "out.json").exists():
            return Row(name, str(export), "not checked", f"{python} could not run vLLM: {proc.stderr.strip()[-300:]}")
        r = json.loads((Path(tmp) / "out.json").read_text())[0]
    return vllm_verdict(r, export)


def vllm_verdict(r: dict, export: Path) -> Row:
    """The checker's result as a row: a load vLLM refuses or cannot do on the CPU is 'not checked' with its words."""
    name = "vllm (runtime)"
    if r["error"]:
        return Row(name, str(export), "not checked", f"vLLM {r.get('vllm')} did not load it on the CPU: {r['error']}")
    problems = [f"{k}: {first_few(r[k])}" for k in ("leftover", "bypassed", "uncovered") if r[k]]
    if r["max_err"] > 1e-5:
        problems.append(f"vLLM's delta is {r['max_err']:.3g} of the merge's scale off at {r['worst']}")
    if problems:
        return Row(name, str(export), "mismatch", f"vLLM {r['vllm']}: " + "; ".join(problems), r["loaded_tensors"])
    detail = (
        f"loaded by vLLM {r['vllm']}: every tensor applied by a wrapped module, {r['modules_checked']} of them "
        "equal to PEFT's merge"
    )
    return Row(name, str(export), "ok", detail, r["loaded_tensors"])


def peft_fp32_merge(adapter: Path, base: Path, out: Path) -> Path:
    """PEFT's merge_and_unload of the adapter into the base in fp32, saved with the base's tokenizer: vLLM loads
    it as the oracle of what its LoRA adds."""
    import shutil

    from peft import PeftModel
    from transformers import AutoConfig

    from moe_qlora.model.classes import text_generation_class

    model = text_generation_class(AutoConfig.from_pretrained(base)).from_pretrained(base, dtype=torch.float32)
    PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().save_pretrained(out)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def verify_all(
    adapter: Path, *, merged: Path | None, formats: list[str] | None, console, gguf_base: Path | None = None
) -> list[Row]:
    """A row per format: those asked (`formats`; refused in one sentence when their export is not there), else
    every export found beside the adapter under export's default names, and the merged checkpoint if given.
    A GGUF's row is followed by libllama's run of it (`gguf_base`: the base as an f32 GGUF)."""
    _, config = read_checked_adapter(adapter, "verify")
    if gguf_base is not None and not gguf_base.is_file():
        raise AdapterReadError(f"--gguf-base {gguf_base}: no such file (the base as an f32 GGUF)")
    exports = {fmt: adapter.with_name(adapter.name + suffix) for fmt, suffix in BESIDE.items()}
    if formats:
        for fmt in formats:
            if fmt not in exports:
                raise ExportError(f"--format {fmt!r}: expected one of {', '.join(exports)}")
            if not exports[fmt].exists():
                raise AdapterReadError(
                    f"{exports[fmt]}: no {fmt} export beside {adapter} (moe-qlora export {adapter} --format {fmt} "
                    "writes it there)"
                )
    rows = [verify_peft(adapter, config)]
    for fmt, path in exports.items():
        if formats and fmt not in formats:
            continue
        if not path.exists():
            rows.append(Row(fmt, str(path), "not checked", "no export there"))
        elif fmt == "gguf":
            rows.append(verify_gguf(adapter, path, config))
            rows.append(libllama_row(adapter, path, config, gguf_base))
        else:
            rows.append(verify_peft_layout(fmt, adapter, path, config))
            if fmt == "vllm":
                rows.append(vllm_runtime_row(adapter, path, config))
    if merged is not None:
        rows.append(verify_merged(adapter, merged, console))
    return rows
