"""The model a run trains or generates with, built in one place: the tokenizer, the 4-bit model with its adapters
(new, or from lora.init_from), expert offload, the MoE kernels, activation checkpointing, and FSDP sharding.

`build_policy` needs only the model and lora sections (generate and merge call it); `load_policy` is the training
run's entry, which first decides from the whole run config where the model goes (placement.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from transformers import AutoTokenizer

from moe_qlora.common.memory import large_allocations_mapped, release_freed_memory
from moe_qlora.config.sections import ConfigError, LoraSection, ModelSection, RunConfig, resolve_compute_dtype
from moe_qlora.model.adapters import (
    attach_adapters,
    configure_checkpointing,
    offload_layer_inputs,
    trainable_parameters,
)
from moe_qlora.model.checkpoint_files import check_model_path, read_model_config
from moe_qlora.model.device_choice import policy_device
from moe_qlora.model.distributed import SINGLE, Ranks, device_of, shard_model
from moe_qlora.model.expert_parallel import describe_groups, expert_group, shard_dense, split_experts
from moe_qlora.model.kernel_choice import describe_kernels, resolve_kernels
from moe_qlora.model.loaded_model import parameter_bytes_by_kind
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.model_path import resolve_model_path
from moe_qlora.model.peft_adapter import load_adapter
from moe_qlora.model.placement import memory_helpers_chosen, offloaded_layers, parallel_chosen, size
from moe_qlora.moe.expert_stacks import experts_modules, stack_names
from moe_qlora.moe.experts import set_moe_kernels, set_token_chunks
from moe_qlora.moe.nf4 import NF4Stack
from moe_qlora.moe.offload import host_layer_bytes, offload_experts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXPERT_FORMAT_WORDS = {  # model.expert_format as the run states it at load
    "nf4": "NF4 (quantized while loading)",
    "mxfp4": "MXFP4 as published (the checkpoint's own bytes)",
}


@dataclass(frozen=True)
class Placement:
    """Where the model goes: `sharded` over the ranks with FSDP2 (loaded on the host, each rank's shards then moved
    to its device), or its experts split over them (`experts_split`, train.parallel: ep, loaded alike); and the
    experts modules (by name) whose NF4 stacks stay in host memory."""

    sharded: bool = False
    experts_on_host: frozenset[str] = frozenset()
    experts_split: bool = False
    ep_size: int = 0  # experts_split: the consecutive ranks each layer's experts are split over (0: all of them)
    dense_sharded: bool = False  # experts_split: the rest FSDP2-sharded over all the ranks (train.ep_dense: fsdp)

    @property
    def by_rank(self) -> bool:
        """Whether each rank loads only its experts (fsdp's shards, ep's experts)."""
        return self.sharded or self.experts_split


@dataclass(frozen=True)
class Recompute:
    """Activation checkpointing: off, or every `interval`th decoder layer recomputed in the backward; and the
    tokens the MoE layer and MLPs work on at once (moe/token_chunks.py; 0: all of them); whether the checkpointed
    layers' inputs wait for the backward in host memory (common/saved_offload.py)."""

    enabled: bool = False
    interval: int = 1
    mlp_chunk_tokens: int = 0
    offload_inputs: bool = False


def load_tokenizer(model: ModelSection):
    """(resolved model path, tokenizer with a pad token)."""
    model_path = resolve_model_path(model.name_or_path)
    check_model_path(model_path)
    read_model_config(model_path, trust_remote_code=model.trust_remote_code)  # a damaged config.json: one sentence
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=model.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.chat_template:
        tokenizer.chat_template = read_chat_template(model.chat_template)
    return model_path, tokenizer


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # the name transformers saves and reads a tokenizer's template under


def read_chat_template(path: str) -> str:
    """model.chat_template's text: a Jinja file, refused in one sentence when it is missing, empty or not text."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"model.chat_template: {path} is not a readable Jinja template file ({exc})") from None
    if not text.strip():
        raise ConfigError(f"model.chat_template: {path} is empty")
    return text


def load_policy(
    cfg: RunConfig,
    model_path: str,
    console: Console,
    ranks: Ranks = SINGLE,
):
    """A training run's model: its placement decided (parallel_chosen, offloaded_layers), then built
    (build_policy); (model, trainable params, ranks)."""
    device = policy_device(cfg.model)
    parallel = parallel_chosen(cfg, ranks, model_path, console)
    sharded, split = parallel == "fsdp", parallel == "ep"
    placement = Placement(
        sharded,
        offloaded_layers(cfg, model_path, device, sharded or split),
        split,
        cfg.train.ep_size,
        dense_sharded=split and cfg.train.ep_dense == "fsdp",
    )
    chunk, offload = memory_helpers_chosen(cfg, ranks, model_path, console, parallel=parallel)
    recompute = Recompute(cfg.train.gradient_checkpointing, cfg.train.checkpoint_interval, chunk, offload)
    return build_policy(
        cfg.model,
        cfg.lora,
        model_path,
        console,
        seed=cfg.train.seed,
        recompute=recompute,
        placement=placement,
        ranks=ranks,
    )


def experts_loaded_by(placement: Placement, ranks: Ranks) -> Ranks | None:
    """Whose share of the experts this rank reads and quantizes: its ep group's place (expert_group), its fsdp
    place, or None: all of them."""
    if placement.experts_split:
        return expert_group(ranks, placement.ep_size)
    return ranks if placement.sharded else None


def build_policy(
    model_cfg: ModelSection,
    lora_cfg: LoraSection,
    model_path: str,
    console: Console,
    *,
    seed: int = 0,
    recompute: Recompute = Recompute(),
    placement: Placement = Placement(),
    ranks: Ranks = SINGLE,
):
    """The quantized model with its adapters (new, drawn from `seed`, or read from lora.init_from),
    offload, MoE kernels and checkpointing, sharded with FSDP2 when `placement` says so; (model, trainable params,
    ranks). A sharded run quantizes each expert stack for the experts its rank keeps alone, on the host, and on
    CUDA moves each rank's shards to its GPU, so neither host nor GPU ever holds the whole 4-bit experts."""
    device = policy_device(model_cfg)
    opts = LoadOptions(
        device="cpu" if placement.by_rank else device,
        name_or_path=model_path,
        compute_dtype=DTYPES[resolve_compute_dtype(model_cfg.compute_dtype, device)],
        expert_format=model_cfg.expert_format,
        expert_double_quant=model_cfg.expert_double_quant,
        linear_double_quant=model_cfg.linear_double_quant,
        trust_remote_code=model_cfg.trust_remote_code,
        strict=model_cfg.strict_quantization,
        experts_on_host=placement.experts_on_host,
        expert_shard=experts_loaded_by(placement, ranks),
    )
    model = attach_adapters(load_model(opts), lora_cfg, seed=seed, device=opts.device)
    start_expert_offload(model, model_cfg, opts.experts_on_host, device, console)
    choose_kernels(model, model_cfg, device, opts.compute_dtype, console)
    console.print(f"attention: {model.attention_choice.describe()}")
    if lora_cfg.init_from:
        n = load_adapter(model, lora_cfg.init_from, lora_cfg)
        console.print(f"LoRA initialised from {lora_cfg.init_from} ({n} tensors)")
    n_ckpt = configure_checkpointing(model, enabled=recompute.enabled, interval=recompute.interval)
    if recompute.mlp_chunk_tokens:
        experts, mlps = set_token_chunks(model, recompute.mlp_chunk_tokens)
        console.print(
            f"MLP chunks: {experts} MoE layers and {mlps} other MLPs work on {recompute.mlp_chunk_tokens} tokens "
            "at a time while training (train.mlp_chunk_tokens)"
        )
    if recompute.offload_inputs and n_ckpt:
        model.activation_offload = offload_layer_inputs(model, torch.device(device))
        console.print(
            f"train.offload_activations: the {n_ckpt} checkpointed layers' inputs wait for the backward in host memory"
        )
    if placement.sharded:
        with large_allocations_mapped():
            ranks = shard_model(model, ranks)
        move_unsharded_to(model, device_of(ranks))
        console.print(
            f"fsdp: 4-bit experts and linears, frozen weights, LoRA and optimizer state sharded over "
            f"{ranks.world} ranks"
        )
    if placement.experts_split:
        with large_allocations_mapped():
            ranks = split_experts(model, ranks, placement.ep_size)
            if placement.dense_sharded:
                ranks = shard_dense(model, ranks)
        split = describe_groups(ranks, placement.ep_size)
        if placement.dense_sharded:
            move_unsharded_to(model, device_of(ranks))
            rest = f"the rest sharded with FSDP2 over {ranks.world} ranks (train.ep_dense: fsdp)"
        else:
            model.to(device_of(ranks))  # the rest, whole on every rank (the experts' rows and LoRA are there already)
            rest = "the rest whole"
        console.print(f"ep: every MoE layer's experts and their LoRA split over {split}, {rest}")
    params = trainable_parameters(model)
    if not params:
        raise ValueError("no trainable parameters: lora.target_modules matched nothing and the model has no experts")
    sizes = parameter_bytes_by_kind(model)
    console.print(
        f"model on {device}, experts in {EXPERT_FORMAT_WORDS[getattr(model, 'expert_format', 'nf4')]}: "
        + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sizes.items())
        + f"; {sum(p.numel() for p in params):,} trainable parameters; {n_ckpt} layers checkpointed"
    )
    return model, params, ranks


def choose_kernels(model, model_cfg: ModelSection, device: str, dtype: torch.dtype, console: Console) -> None:
    """model.kernels resolved once for this device and dtype, and set on every MoE layer (said when it has one)."""
    kernels = resolve_kernels(model_cfg.kernels, device, dtype)
    if set_moe_kernels(
        model,
        kernels,
        fused_below_rows=model_cfg.fused_below_rows,
        dequant_buffer_mb=model_cfg.dequant_buffer_mb,
        self_check=model_cfg.kernel_self_check,
    ):
        console.print(f"MoE kernels: {describe_kernels(kernels, model_cfg.fused_below_rows, model_cfg.kernels)}")


def start_expert_offload(
    model, model_cfg: ModelSection, on_host: frozenset[str], device: str, console: Console, streams=None
):
    """Route the reads of the experts modules stored on the host (`on_host`, by name) through an
    ExpertOffloader: each layer's stacks packed into one page-locked block, copied into one of
    model.offload_resident_layers device buffers when the layer runs (moe/offload.py). Returns it, or None."""
    modules = [(n, m) for n, m in experts_modules(model) if n in on_host or plain_name(n) in on_host]
    if not modules:
        return None
    need = sum(host_layer_bytes({s: NF4Stack.from_param(getattr(m, s)) for s in stack_names(m)}) for _, m in modules)
    offloader = offload_experts(
        [m for _, m in modules], device, max_resident=model_cfg.offload_resident_layers, streams=streams
    )
    release_freed_memory()  # the pageable copies the loader left, now in the page-locked blocks
    total = len(experts_modules(model))
    console.print(
        f"expert offload ({model_cfg.expert_offload}): {len(modules)} of {total} MoE layers' experts "
        f"({size(need)}) in page-locked host memory, at most {model_cfg.offload_resident_layers} layers "
        f"on {device} at once"
    )
    return offloader


def plain_name(name: str) -> str:
    """A module's name without PEFT's wrapper prefix: the name it had when it was loaded."""
    return name.removeprefix("base_model.model.")


def move_unsharded_to(model, device: torch.device) -> None:
    """After fully_shard (which moves the shards it manages to the mesh's device): the bitsandbytes 4-bit linears
    it leaves whole, and the buffers, to `device` too. Nothing to do on the CPU."""
    if device.type == "cpu":
        return
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.to(device)
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
