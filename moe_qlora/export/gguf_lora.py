"""`--format gguf`: a llama.cpp LoRA adapter: `blk.N.ffn_{gate,up,down}_exps.weight.lora_{a,b}` as 3D tensors
(E, r, in) and (E, out, r) (ggml reverses the order), `adapter.lora.alpha`, and the other LoRA (attention, router,
shared experts and their gate, dense MLPs) under the names gguf's own TensorNameMap gives the base's tensors,
where llama.cpp applies a LoRA to them (build_lora_mm; gguf_archs.py); DeepSeek's MLA projections are multiplied
without it, so their LoRA is refused rather than written to be ignored. llama.cpp permutes the q/k rows of
llama-architecture models (Mixtral) for its RoPE; the q/k lora_B rows are permuted the same way, as its own
converter does, and rows it regroups or splits are laid out alike (gguf_pieces).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from moe_qlora.common.fileio import disk_full_named, unwritable_named
from moe_qlora.export.family_tables import ExportError, FamilyNames, UnexportableModules, retrain_advice
from moe_qlora.export.gguf_archs import (
    GGUF_ALWAYS_FUSED_QKV,
    GGUF_FUSABLE_GATE_UP,
    GGUF_FUSABLE_QKV,
    gguf_linear_name,
    gguf_name_map,
)
from moe_qlora.export.peft_factors import expert_layers, linear_factors, read_run_adapter


def permute_rows_for_rope(b: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order for llama-architecture models (its converter's `permute`): within each head
    the rotary pairs (i, i + d/2) become adjacent rows."""
    return b.reshape(n_head, 2, b.shape[0] // n_head // 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)


def gguf_tensors(
    tensors: dict[str, torch.Tensor],
    rank: int,
    names: FamilyNames,
    base,
    *,
    fuse_gate_up_exps: bool = False,
    fuse_qkv: bool = False,
) -> dict[str, torch.Tensor]:
    """{llama.cpp tensor name: fp32 tensor in numpy order} for the adapter. `fuse_gate_up_exps` / `fuse_qkv`:
    the base was converted with llama.cpp's flags of those names, which write one ffn_gate_up_exps per layer
    (gate's rows, then up's) and one attn_qkv per attention layer (q's rows, k's, v's; conversion/base.py,
    modify_tensors)."""
    out, factors = {}, linear_factors(tensors)
    for layer, x in expert_layers(tensors, rank, names).items():
        inter = x.gate_up_b.shape[1] // 2
        blk = f"blk.{layer}"
        if names.gated and (names.fused_gate_up or fuse_gate_up_exps):  # the fused LoRA as it is: B's rows are
            # [gate; up] as the tensor's
            out[f"{blk}.ffn_gate_up_exps.weight.lora_a"] = x.gate_up_a
            out[f"{blk}.ffn_gate_up_exps.weight.lora_b"] = x.gate_up_b
        elif names.gated:
            out[f"{blk}.ffn_gate_exps.weight.lora_a"] = x.gate_up_a
            out[f"{blk}.ffn_gate_exps.weight.lora_b"] = x.gate_up_b[:, :inter]
            out[f"{blk}.ffn_up_exps.weight.lora_a"] = x.gate_up_a
            out[f"{blk}.ffn_up_exps.weight.lora_b"] = x.gate_up_b[:, inter:]
        else:  # the up projection alone
            out[f"{blk}.ffn_up_exps.weight.lora_a"] = x.gate_up_a
            out[f"{blk}.ffn_up_exps.weight.lora_b"] = x.gate_up_b
        out[f"{blk}.ffn_down_exps.weight.lora_a"] = x.down_a
        out[f"{blk}.ffn_down_exps.weight.lora_b"] = x.down_b
    n_head = base.num_attention_heads
    n_kv = getattr(base, "num_key_value_heads", None) or n_head
    tensor_names = gguf_name_map(names.gguf_arch, 1 + max((layer for layer, _, _ in factors), default=0))
    refused: dict[str, str] = {}  # every module llama.cpp would not apply, said at once with what exports
    for (layer, path, proj), ab in factors.items():
        for piece_path, piece_proj, a, b in gguf_pieces(names.gguf_arch, path, proj, ab["A"], ab["B"], base):
            try:
                name = gguf_linear_name(tensor_names, names.gguf_arch, layer, piece_path, piece_proj)
            except ExportError as exc:
                refused.setdefault(f"{path}.{proj}", str(exc))
                continue
            if names.permute_qk and name.endswith((".attn_q", ".attn_k")):
                b = permute_rows_for_rope(b, n_head if name.endswith(".attn_q") else n_kv)
            if f"{name}.weight.lora_a" in out:  # two modules on one tensor: never write one over the other
                raise ExportError(
                    f"layers.{layer}.{path}.{proj}: its LoRA lands on {name}, which another module's LoRA already fills"
                )
            out[f"{name}.weight.lora_a"] = a
            out[f"{name}.weight.lora_b"] = b
    if refused:
        raise UnexportableModules(refused)
    if fuse_qkv or names.gguf_arch in GGUF_ALWAYS_FUSED_QKV:
        out = fused_qkv(out, always=names.gguf_arch in GGUF_ALWAYS_FUSED_QKV)
    return {k: v.contiguous().clone() for k, v in out.items()}


def gguf_pieces(
    arch: str, path: str, proj: str, a: torch.Tensor, b: torch.Tensor, base
) -> list[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """The LoRA (A (r, in), B (out, r)) of the module `path.proj` as llama.cpp's converter lays out the base's
    weight: [(path, proj, A, B)], each piece under the transformers name of the tensor it lands on. Where the
    converter gathers a weight's rows (a split, a regrouping), B's rows are gathered alike, A shared; where it
    gathers the columns (inputs), A's columns are. Read from llama.cpp 0c1e57098's conversion/qwen.py,
    qwen4exp.py and minimax.py."""
    if arch == "qwen3next" and proj == "in_proj_qkvz":  # one [q | k | v | z] group per key head, apart in llama.cpp
        q, k, v, z = qwen3_next_qkvz_rows(base)
        return [(path, "in_proj_qkv", a, b[torch.cat([q, k, v])]), (path, "in_proj_z", a, b[z])]
    if arch in ("qwen35moe", "qwen4exp") and path.endswith("linear_attn"):
        return [(path, proj, *value_heads_tiled(proj, a, b, base))]
    split_shared = proj == "input_linear" and path.endswith("shared_mlp") and arch in ("granitemoe", "granitehybrid")
    if proj == "gate_up_proj" or split_shared:  # MiniMax-M3's dense and shared MLPs, Granite's shared MLP (kept
        # fused by Granite-MoE-SWA's converter): llama.cpp's ffn_gate and ffn_up, or their _shexp
        half = b.shape[0] // 2
        return [(path, "gate_proj", a, b[:half]), (path, "up_proj", a, b[half:])]
    if proj == "index_qk_proj":  # Qwen4-Exp's indexer: q's rows, then k's (conversion/qwen4exp.py)
        n_q = base.indexer_n_heads * base.indexer_head_dim
        return [(path, "q_proj", a, b[:n_q]), (path, "k_proj", a, b[n_q:])]
    return [(path, proj, a, b)]


def qwen3_next_qkvz_rows(base) -> tuple[torch.Tensor, ...]:
    """Row indices of q, k, v and z in Qwen3-Next's in_proj_qkvz, whose rows are one group per key head g:
    [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)], r = value heads per key head; llama.cpp's attn_qkv is
    [all q; all k; all v] and its attn_gate all z, each in head order (conversion/qwen.py)."""
    nk, dk, dv = base.linear_num_key_heads, base.linear_key_head_dim, base.linear_value_head_dim
    rdv = base.linear_num_value_heads // nk * dv
    group = torch.arange(nk)[:, None] * (2 * dk + 2 * rdv)
    q, k = group + torch.arange(dk), group + dk + torch.arange(dk)
    v, z = group + 2 * dk + torch.arange(rdv), group + 2 * dk + rdv + torch.arange(rdv)
    return q.flatten(), k.flatten(), v.flatten(), z.flatten()


def value_heads_tiled(proj: str, a: torch.Tensor, b: torch.Tensor, base) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of a Qwen3.5 / Qwen4-Exp linear-attention projection in llama.cpp's value-head order.

    transformers groups the value heads by key head (head g r + j serves key head g, repeat_interleave); ggml
    tiles the key heads instead (ggml_repeat), so the converter moves value head g r + j to j nk + g: in
    in_proj_qkv's value rows (q and k stay), in_proj_z's rows (dv per head), in_proj_a's and in_proj_b's (one
    per head), and out_proj's columns, its input. Nothing moves where nk == nv."""
    nk, nv = base.linear_num_key_heads, base.linear_num_value_heads
    if nk == nv:
        return a, b

    def order(head_dim: int) -> torch.Tensor:
        return torch.arange(nv * head_dim).reshape(nk, nv // nk, head_dim).transpose(0, 1).flatten()

    dv = base.linear_value_head_dim
    if proj == "in_proj_qkv":
        qk = 2 * nk * base.linear_key_head_dim
        return a, b[torch.cat([torch.arange(qk), qk + order(dv)])]
    if proj == "in_proj_z":
        return a, b[order(dv)]
    if proj in ("in_proj_a", "in_proj_b"):
        return a, b[order(1)]
    if proj == "out_proj":
        return a[:, order(dv)], b
    return a, b


def fused_qkv(out: dict[str, torch.Tensor], always: bool = False) -> dict[str, torch.Tensor]:
    """Each layer's q, k and v LoRA as the one attn_qkv LoRA of a base converted with --fuse-qkv: A stacked along
    the rank (3r, in), B block-diagonal (q_out + k_out + v_out, 3r), so that B A = [B_q A_q; B_k A_k; B_v A_v].
    llama.cpp scales each LoRA by alpha over its own rank (B's columns: 3r here), so B is multiplied by 3 to keep
    each block's alpha / r."""
    layers = sorted({int(k.split(".")[1]) for k in out if re.fullmatch(r"blk\.\d+\.attn_[qkv]\.weight\.lora_a", k)})
    for layer in layers:
        pieces = [f"blk.{layer}.attn_{p}.weight" for p in "qkv"]
        if missing := [p.split(".")[2] for p in pieces if f"{p}.lora_a" not in out]:
            how = "" if always else ", or convert the base without --fuse-qkv"
            holds = "this architecture's base always holds" if always else "a base converted with --fuse-qkv holds"
            raise ExportError(
                f"layer {layer}: no LoRA on {', '.join(missing)}; {holds} one attn_qkv, whose LoRA needs "
                f"q, k and v all trained (target q_proj, k_proj and v_proj{how})"
            )
        a = torch.cat([out.pop(f"{p}.lora_a") for p in pieces])
        b = torch.block_diag(*[out.pop(f"{p}.lora_b") for p in pieces]) * len(pieces)
        out[f"blk.{layer}.attn_qkv.weight.lora_a"], out[f"blk.{layer}.attn_qkv.weight.lora_b"] = a, b
    return out


def write_gguf(
    adapter_dir: str | Path, out_file: str | Path, *, fuse_gate_up_exps: bool = False, fuse_qkv: bool = False
) -> Path:
    """A llama.cpp LoRA GGUF (fp32 tensors) of `adapter_dir`, written atomically to `out_file`;
    `fuse_gate_up_exps` / `fuse_qkv` for a base converted with llama.cpp's flags of those names."""
    import gguf
    from transformers import AutoConfig

    from moe_qlora.model.model_path import resolve_model_path

    tensors, config, model_type, names = read_run_adapter(adapter_dir)
    if fuse_gate_up_exps and not names.fused_gate_up and names.gguf_arch not in GGUF_FUSABLE_GATE_UP:
        raise ExportError(
            f"{model_type}: llama.cpp's converter cannot fuse gate and up experts for its "
            f"{names.gguf_arch} architecture (--fuse-gate-up-exps is for "
            f"{', '.join(sorted(GGUF_FUSABLE_GATE_UP))}), so no base has ffn_gate_up_exps"
        )
    if fuse_qkv and names.gguf_arch not in GGUF_FUSABLE_QKV | GGUF_ALWAYS_FUSED_QKV:
        raise ExportError(
            f"{model_type}: llama.cpp's converter does not fuse q, k and v for its {names.gguf_arch} "
            "architecture, so no base has attn_qkv; export without --fuse-qkv"
        )
    base = AutoConfig.from_pretrained(resolve_model_path(config["base_model_name_or_path"])).get_text_config()
    try:
        converted = gguf_tensors(
            tensors, int(config["r"]), names, base, fuse_gate_up_exps=fuse_gate_up_exps, fuse_qkv=fuse_qkv
        )
    except UnexportableModules as exc:
        raise exc.with_advice(retrain_advice(config, set(exc.modules), "gguf")) from None
    out_file = Path(out_file)
    with unwritable_named(out_file):
        out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), names.gguf_arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for name, t in converted.items():
        writer.add_tensor(name, t.numpy())
    try:
        with disk_full_named(out_file, sum(t.numel() * 4 for t in converted.values())), unwritable_named(out_file):
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
            os.replace(tmp, out_file)
    finally:
        tmp.unlink(missing_ok=True)
    return out_file
