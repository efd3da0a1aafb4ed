"""The run configuration's sections: pydantic models that forbid unknown keys, with their defaults and the checks
that tie keys together; and what a config means on a device (compute dtype, whether it can be sharded).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from moe_qlora.config.base import ConfigError, Section
from moe_qlora.config.grpo import GrpoSection
from moe_qlora.config.preference import DpoSection
from moe_qlora.moe.kernel_names import KERNEL_CHOICES


class ModelSection(Section):
    name_or_path: str = Field(description="hub id, local HF checkpoint folder, or builtin:tiny-mixtral")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="dtype of activations, dequantized experts, embeddings, head and norms; auto: bfloat16 on "
        "CUDA, float32 on the CPU",
    )
    expert_format: Literal["auto", "nf4", "mxfp4"] = Field(
        "auto",
        description="how the frozen experts are stored: nf4 (quantized while loading), or mxfp4, the published "
        "MXFP4 bytes kept as they are (4.25 bits a weight; only from a checkpoint whose experts are MXFP4: gpt-oss, "
        "DeepSeek-V4-Flash's FP4 experts with e8m0 scales); auto: mxfp4 for such a checkpoint, else nf4",
    )
    expert_double_quant: bool = Field(True, description="quantize the experts' block scales too (~8% smaller, QLoRA)")
    linear_double_quant: bool = Field(True, description="double quantization for the 4-bit linears (as in QLoRA)")
    trust_remote_code: bool = Field(False, description="run model code shipped with the checkpoint")
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template file that replaces the tokenizer's own (TRL's chat_template_path, "
        "axolotl's chat_template_jinja); the adapter folder keeps it as chat_template.jinja, and generate and "
        "merge use it",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: the GPU when there is one, else the CPU")
    strict_quantization: bool = Field(True, description="fail if any expert stack stays in high precision")
    kernels: Literal[KERNEL_CHOICES] = Field(
        "auto",
        description="MoE layer: triton (NF4 decoded inside the matmul, CUDA), grouped_mm (each NF4 stack decoded to "
        "a buffer, then torch._grouped_mm; any device) or the per-expert torch reference; auto: on CUDA triton "
        "below model.fused_below_rows rows per expert and grouped_mm above, the torch reference on the CPU",
    )
    fused_below_rows: int = Field(
        16,
        ge=0,
        description="kernels: auto picks the fused NF4 kernel below this many rows per expert (measured "
        "on an H100 at Qwen3-30B-A3B's layer: grouped_mm was faster at 32 and 256 rows per expert)",
    )
    kernel_self_check: bool = Field(
        True,
        description="check triton / grouped_mm against the torch reference at their first call per layer shape, "
        "dtype and rows class (one extra layer forward + backward each), falling back triton -> grouped_mm -> "
        "torch with a warning where they fail",
    )
    expert_offload: Literal["none", "auto", "all"] = Field(
        "none",
        description="keep the NF4 experts in (pinned) host memory and copy each MoE layer's to the GPU when it runs, "
        "the next one on a side stream meanwhile: all layers, or auto: as few as the plan needs to fit the GPU "
        "(none on the CPU). LoRA, its gradients and optimizer state stay on the GPU",
    )
    offload_resident_layers: int = Field(
        2,
        ge=1,
        description="expert_offload: most MoE layers whose experts are on the GPU at once (2: the one "
        "computing and the next arriving; 1: no prefetch)",
    )
    dequant_buffer_mb: float | None = Field(
        2048,
        gt=0,
        description="grouped_mm: decode at most this much of an expert stack at once (above it, windows of "
        "columns of every expert, each window's GEMM over all rows again; Qwen3-30B-A3B's gate_up stack is "
        "768 MiB in bf16, Mixtral-8x7B's 1,792 MiB: whole at the default); null: no limit",
    )


class LoraSection(Section):
    rank: int = Field(8, ge=1, le=1024, description="LoRA rank r for experts and linears")
    alpha: float = Field(16.0, gt=0, description="LoRA scale is alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the linears' LoRA input (not experts)")
    experts: bool = Field(True, description="per-expert LoRA on gate_up_proj and down_proj")
    router: bool = Field(False, description="LoRA on the router weight too (changes routing; usually frozen)")
    init_from: str | None = Field(None, description="start from this exported adapter (folder) instead of new LoRA")
    target_modules: list[str] | Literal["auto"] = Field(
        "auto", description="nn.Linear names that get PEFT LoRA; auto: the family's defaults (attention, shared MLPs)"
    )

    @model_validator(mode="before")
    @classmethod
    def _peft_variants(cls, data):
        """PEFT's LoRA variants, refused by name with what to do (else they would read as unknown keys)."""
        if not isinstance(data, dict):
            return data
        if data.get("use_rslora"):
            raise ValueError(
                "use_rslora: rsLoRA scales by alpha / sqrt(rank), and moe-qlora's expert and linear LoRA by "
                "alpha / rank, the scale every export writes; for rsLoRA's, set lora.alpha to alpha x sqrt(rank) "
                "(rank 16, alpha 16: lora.alpha 64), which is the same model"
            )
        if data.get("use_dora"):
            raise ValueError(
                "use_dora: DoRA is not supported: the experts' LoRA has no magnitude vector, and DoRA on the "
                "linears alone would leave most of the model's LoRA plain; drop the key"
            )
        return {k: v for k, v in data.items() if k not in ("use_rslora", "use_dora")}

    @model_validator(mode="after")
    def _something_to_train(self):
        if not self.experts and not self.target_modules:
            raise ValueError("nothing to train: set lora.experts: true or list lora.target_modules")
        return self


class DataSource(Section):
    """A dataset by name or folder, with the split and column mapping to read it with."""

    path: str = Field(description="a data file, a folder (save_to_disk, or of data files), or a hub dataset id")
    name: str | None = Field(None, description="the dataset's configuration (subset), if it has several")
    split: str = Field("train", description="which split to read")
    revision: str | None = Field(None, description="hub datasets: a branch, tag or commit")
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="our field -> the dataset's column, e.g. {prompt: question, completion: answer}",
    )


class DataSection(Section):
    train_files: list[str | DataSource] = Field(
        min_length=1,
        description="JSONL, JSON or parquet files, save_to_disk folders, or hub dataset ids (or "
        "mappings {path, name, split, revision, columns})",
    )
    format: Literal["auto", "prompt_completion", "messages", "text"] = Field(
        "auto", description="row format; auto decides per row from its keys"
    )
    train_on_prompt: bool = Field(False, description="also train on prompt tokens")
    all_assistant_turns: bool = Field(False, description="messages: train on every assistant turn, not just the last")
    max_seq_len: int = Field(512, ge=8, description="longer rows follow `overlength`")
    overlength: Literal["truncate", "drop", "error"] = Field(
        "truncate", description="rows over max_seq_len: cut them, skip them, or stop naming the row"
    )
    max_dropped_share: float = Field(
        0.5, ge=0.0, le=1.0, description="stop if more than this share of rows is dropped (overlength, no target)"
    )
    packing: bool = Field(
        False, description="pack rows into max_seq_len sequences (no padding; attention never crosses rows)"
    )
    eval_files: list[str | DataSource] = Field(default_factory=list, description="held-out rows for the eval loss")
    eval_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="or hold out this share of the training rows (a seeded split, no overlap)"
    )

    @model_validator(mode="after")
    def _one_eval_source(self):
        if self.eval_files and self.eval_fraction:
            raise ValueError("set data.eval_files or data.eval_fraction, not both")
        return self


class RewardSection(Section):
    """rwsft: how a row's `reward` (or `score`) becomes its loss weight."""

    mapping: Literal["raw", "minmax", "zscore"] = Field(
        "raw", description="raw: w = r; minmax: (r - min) / (max - min) over the dataset; zscore: (r - mean) / std"
    )
    clip_min: float | None = Field(None, description="weights below are raised to this")
    clip_max: float | None = Field(None, description="weights above are lowered to this")
    allow_negative: bool = Field(False, description="negative weights push probability away (unlikelihood)")


class TrainSection(Section):
    objective: Literal["sft", "rwsft"] = Field("sft", description="rwsft: each sample's loss times its reward weight")
    epochs: int = Field(1, ge=1)
    max_steps: int = Field(0, ge=0, description="stop after this many optimizer steps (0: run all epochs)")
    micro_batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = Field(
        "adamw",
        description="adamw: torch's, fp32 moments (8 bytes a LoRA parameter); adamw_8bit: bitsandbytes' "
        "block-wise 8-bit moments (2 bytes); paged_adamw_8bit: the same in CUDA unified memory, paged out "
        "under pressure (plain adamw_8bit on the CPU)",
    )
    optimizer_in_backward: bool = Field(
        False,
        description="update each LoRA tensor as soon as its gradient is complete, so the whole model's "
        "gradients never exist at once (needs grad_accum 1 and max_grad_norm 0)",
    )
    gclip: float = Field(0.0, ge=0, description="clamp each gradient element to [-gclip, gclip]; 0 disables")
    max_grad_norm: float = Field(0.0, ge=0, description="global-norm clipping before gclip; 0 disables")
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    gradient_checkpointing: bool = Field(True, description="recompute activations in backward: less memory")
    loss_chunk_tokens: int = Field(
        256,
        ge=0,
        description="tokens per chunk through the output head for the loss (never the whole "
        "(tokens, vocab) logits); 0: full logits",
    )
    mlp_chunk_tokens: int | Literal["auto"] = Field(
        "auto",
        description="tokens the MoE experts, shared experts and dense MLPs of a layer work on at once while "
        "training, each chunk recomputed in its own backward, so their rows take a chunk's memory, not the "
        "micro-batch's (one more MLP forward a step); auto: the largest chunk `moe-qlora plan` needs for the run "
        "to fit the GPU (none when it fits without, and none on the CPU); 0: the whole micro-batch",
    )
    offload_activations: bool | Literal["auto"] = Field(
        "auto",
        description="keep the checkpointed decoder layers' inputs in page-locked host memory from the forward to "
        "the backward, copied on a side stream while the GPU computes (about two layers' stay on the GPU); needs "
        "gradient_checkpointing; auto: when `moe-qlora plan` says the run does not fit the GPU without it (never "
        "on the CPU)",
    )
    router_aux_loss_coef: float | Literal["model"] = Field(
        0.0,
        description="train on the family's MoE load-balancing (auxiliary) loss times this, in train, dpo and grpo "
        "(logged as aux_loss either way); model: the coefficient in the model's config (TRL's default for MoE "
        "models is 0.001); 0: off",
    )
    checkpoint_interval: int = Field(1, ge=1, description="checkpoint every Nth decoder layer")
    seed: int = 0
    log_every: int = Field(1, ge=1)
    parallel: Literal["auto", "ddp", "fsdp", "ep"] = Field(
        "auto",
        description="under a launcher: ddp (the whole 4-bit model on every rank, LoRA gradients summed); fsdp "
        "(FSDP2: 4-bit weights, LoRA and AdamW state sharded across ranks, for a model that does not fit one "
        "GPU; train only); ep (expert parallelism: each rank holds its share of every MoE layer's experts and "
        "their LoRA, the routed rows sent to them and back; the rest whole on every rank; train only); auto: ddp "
        "when `moe-qlora plan` says the run fits one GPU (always on CPUs), else fsdp or ep, the one that fits and "
        "sends fewer bytes",
    )
    ep_size: int = Field(
        0,
        ge=0,
        description="train.parallel: ep: how many consecutive ranks split each MoE layer's experts (one node's GPUs, "
        "say); the world size must be a multiple of it, and the groups are replicas of each other (their experts' "
        "LoRA gradients summed, as ddp does); 0: all the ranks",
    )
    ep_dense: Literal["replicate", "fsdp"] = Field(
        "replicate",
        description="train.parallel: ep: what the ranks do with the rest of the model (attention, routers, shared "
        "experts, dense layers, embeddings, head): replicate it whole on each (its LoRA gradients all-reduced), or "
        "fsdp: shard it with FSDP2 over all the ranks, one FSDP group a decoder layer (gathered for its forward "
        "and again for its backward), for a model whose non-expert part does not fit beside the experts",
    )
    dist_timeout_s: int = Field(
        600, ge=10, description="data parallel: a rank waiting longer than this for the others stops the run"
    )
    nan_policy: Literal["abort", "skip"] = Field(
        "abort", description="a non-finite loss or gradient: stop, or skip the step (no weight or moment changes)"
    )
    max_consecutive_skips: int = Field(3, ge=1, description="skipped steps in a row before the run stops anyway")
    spike_factor: float = Field(3.0, ge=0, description="log a loss_spike event above this times the loss EMA; 0: off")
    eval_every: int = Field(0, ge=0, description="eval loss every N optimizer steps (0: only at the end)")
    keep_best: bool = Field(False, description="also keep the adapter with the lowest eval loss, in adapter-best/")
    save_every: int = Field(0, ge=0, description="checkpoint every N optimizer steps (0: by time and at the end)")
    save_every_minutes: float = Field(
        30.0, ge=0, description="also checkpoint when this many minutes passed since the last one (0: off)"
    )
    keep_checkpoints: int = Field(2, ge=1, description="how many checkpoints to keep (newest first)")
    resume: str = Field(
        "never",
        description="never; auto: continue from the newest valid checkpoint in output.dir; or the path of a "
        "checkpoint folder (checkpoints/step-NNNNNNNN) to continue from",
        min_length=1,
    )

    @field_validator("router_aux_loss_coef", "mlp_chunk_tokens")
    @classmethod
    def _non_negative(cls, value, info):
        word = {"router_aux_loss_coef": "model", "mlp_chunk_tokens": "auto"}[info.field_name]
        if value != word and value < 0:
            raise ValueError(f"must be >= 0 or `{word}`, got {value}")
        return value


class OutputSection(Section):
    dir: str = Field("runs/latest", description="metrics.jsonl and adapter/ go here")
    export_formats: list[Literal["vllm", "per-expert", "gguf"]] = Field(
        default_factory=list,
        description="also write the adapter in these layouts at the end: vllm (adapter-vllm/, the layout vLLM "
        "loads for the family), per-expert (adapter-per-expert/, SGLang), gguf (adapter.gguf, llama.cpp); the "
        "same as `moe-qlora export`",
    )
    report_to: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="where metrics go besides metrics.jsonl (always written): tensorboard (event files in "
        "tensorboard/), wandb (Weights & Biases; WANDB_MODE=offline keeps it on disk)",
    )
    wandb_project: str = Field("moe-qlora", description="the W&B project of the run (named after output.dir)")


class RunConfig(Section):
    model: ModelSection
    lora: LoraSection = Field(default_factory=LoraSection)
    data: DataSection
    train: TrainSection = Field(default_factory=TrainSection)
    output: OutputSection = Field(default_factory=OutputSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    grpo: GrpoSection | None = Field(None, description="settings of `moe-qlora grpo` (ignored by `train`)")
    dpo: DpoSection | None = Field(None, description="settings of `moe-qlora dpo` (ignored by the other commands)")

    @model_validator(mode="after")
    def _consistent(self):
        t = self.train
        if t.max_steps and t.save_every > t.max_steps:
            raise ValueError(f"train.save_every ({t.save_every}) is beyond train.max_steps ({t.max_steps})")
        if t.optimizer_in_backward and t.grad_accum > 1:
            raise ValueError(
                f"train.optimizer_in_backward updates each tensor as its gradient completes, so it cannot "
                f"accumulate train.grad_accum ({t.grad_accum}) micro-batches first: set one of them off"
            )
        if t.offload_activations is True and not t.gradient_checkpointing:
            raise ValueError(
                "train.offload_activations keeps the checkpointed layers' inputs on the host: it needs "
                "train.gradient_checkpointing (without it every activation stays where the forward made it)"
            )
        if t.optimizer_in_backward and t.max_grad_norm > 0:
            raise ValueError(
                "train.optimizer_in_backward cannot clip by the global norm (train.max_grad_norm "
                f"{t.max_grad_norm}): the norm is known only after every tensor was updated; use train.gclip "
                "(element-wise) instead"
            )
        return self


def resolve_compute_dtype(choice: str, device: str) -> str:
    """model.compute_dtype for a device: auto is bfloat16 on CUDA (tensor cores, half the activations) and
    float32 on the CPU (where bf16 matmuls are slow without AMX)."""
    if choice != "auto":
        return choice
    return "bfloat16" if device.startswith("cuda") else "float32"


def check_shardable(cfg: RunConfig, *, layout: str = "fsdp") -> None:
    """Refuse what a sharded run (train.parallel: fsdp, or ep: every rank joins each forward) cannot do: expert
    offload, 8-bit optimizers."""
    if cfg.model.expert_offload != "none":
        raise ConfigError(
            f"model.expert_offload: {cfg.model.expert_offload} with train.parallel: {layout}: {layout} already "
            "splits the experts over the GPUs; offload is for one GPU or ddp (set model.expert_offload: none, or "
            "train.parallel: ddp)"
        )
    if cfg.train.optimizer != "adamw":
        raise ConfigError(
            f"train.optimizer: {cfg.train.optimizer} keeps bitsandbytes state a sharded tensor cannot have; "
            f"use adamw with train.parallel: {layout} (its moments are sharded too)"
        )
