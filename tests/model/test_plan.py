"""`plan` counts from config.json alone exactly the bytes a loaded model holds; it runs on the shipped configs."""

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.config.load import validate_config
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.budget import meta_model
from moe_qlora.model.loaded_model import parameter_bytes_by_kind
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.plan import plan_run
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config

from helpers.published import publish_gpt_oss_mxfp4, publish_v4_flash
from helpers.tiny_configs import tiny_config_any

ROOT = Path(__file__).resolve().parents[2]


def run_config(path, **model):
    return validate_config(
        {
            "model": {"name_or_path": str(path), **model},
            "lora": {"rank": 4, "router": True},
            "data": {"train_files": ["unused.jsonl"], "max_seq_len": 32},
        }
    )


@pytest.mark.parametrize(
    "family", ["mixtral", "qwen3_moe", "deepseek_v2", "gpt_oss", "gpt_oss-mxfp4", "deepseek_v4-mxfp4"]
)
@pytest.mark.parametrize("double_quant", [False, True])
def test_plan_equals_the_bytes_of_the_loaded_model(tmp_path, family, double_quant):
    """gpt_oss-mxfp4: gpt-oss as published, its experts kept in MXFP4 (4.25 bits a weight, experts_mxfp4);
    deepseek_v4-mxfp4: DeepSeek-V4-Flash as published (FP8, its FP4 experts kept as MXFP4)."""
    tok = build_byte_tokenizer()
    model_type, _, published = family.partition("-")
    config = tiny_config_any(model_type, len(tok)) if model_type == "deepseek_v4" else tiny_config(model_type, len(tok))
    path = save_tiny_model(tmp_path / model_type, config, tokenizer=tok)
    if published:
        publish = publish_v4_flash if model_type == "deepseek_v4" else publish_gpt_oss_mxfp4
        path, _ = publish(path, tmp_path / family)
    cfg = run_config(path, expert_double_quant=double_quant, linear_double_quant=double_quant)
    opts = LoadOptions(str(path), expert_double_quant=double_quant, linear_double_quant=double_quant)
    model = attach_adapters(load_model(opts), cfg.lora, seed=0)
    measured = parameter_bytes_by_kind(model)
    planned = plan_run(cfg, name_or_path=str(path), device="cpu").bytes
    assert {k: planned[k] for k in measured} == measured
    assert ("experts_mxfp4" in measured) == bool(published) and (measured["experts_nf4"] == 0) == bool(published)
    assert planned["optimizer"] == 2 * planned["lora"] and planned["activations_estimate"] > 0  # fp32 AdamW


@pytest.mark.parametrize(
    "name,params_b",
    [("mixtral-8x7b", 46.70), ("qwen3-30b-a3b", 30.53), ("deepseek-v2-lite", 15.71)],  # published sizes
)
def test_plan_on_shipped_configs_from_the_cli(name, params_b):
    result = CliRunner().invoke(app, ["plan", "--model", str(ROOT / "configs/models" / name), "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert round(plan["params"] / 1e9, 2) == params_b
    b = plan["bytes"]
    # The experts are most of the weights (DeepSeek-V2-Lite: 78%, its vocabulary is large); NF4 with double
    # quantization (the default) stores them in 0.5 + 1/64 + 4/(64*256) = 0.516 bytes per weight.
    assert b["experts_nf4"] > 0.7 * (b["experts_nf4"] + b["linear_4bit"] + b["other"])
    assert 0.5 * plan["params"] < b["experts_nf4"] + b["linear_4bit"] + b["other"] < 0.75 * plan["params"]


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_planned_optimizer_state_equals_the_state_after_a_step(tmp_path, optimizer):
    """The optimizer row is exact: bitsandbytes' uint8 codes and per-256 scales for tensors of 4,096
    elements or more, fp32 moments below (the tiny Mixtral has both), torch's fp32 moments for adamw. Step
    counters and bitsandbytes' two shared code maps are left out of both sides."""
    from moe_qlora.train.optim import build_optimizer

    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path / "mixtral", tiny_config("mixtral", len(tok)), tokenizer=tok)
    cfg = validate_config(
        {
            "model": {"name_or_path": str(path)},
            "lora": {"rank": 4, "target_modules": ["q_proj"]},
            "data": {"train_files": ["unused.jsonl"]},
            "train": {"optimizer": optimizer},
        }
    )
    model = attach_adapters(load_model(LoadOptions(str(path))), cfg.lora, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg.train)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    held = sum(
        v.nbytes
        for s in opt.state.values()
        for k, v in s.items()
        if torch.is_tensor(v) and k not in ("step", "qmap1", "qmap2")
    )
    sizes = [p.numel() for p in params]
    assert min(sizes) < 4096 <= max(sizes)
    assert plan_run(cfg, name_or_path=str(path), device="cpu").bytes["optimizer"] == held


def test_optimizer_in_backward_plans_one_layers_gradients():
    common = ["plan", "--model", str(ROOT / "configs/models/qwen3-30b-a3b"), "--json", "--set", "lora.rank=16"]
    ordinary = json.loads(CliRunner().invoke(app, common).stdout)["bytes"]
    inside = json.loads(CliRunner().invoke(app, [*common, "--set", "train.optimizer_in_backward=true"]).stdout)["bytes"]
    assert ordinary["gradients"] == ordinary["lora"]
    assert inside["gradients"] == -(-ordinary["lora"] // 48)  # 48 layers: one layer's LoRA gradients at a time


@pytest.mark.parametrize(
    "settings,expected_mib",
    [
        # Qwen3-30B-A3B gate_up: 128 experts x 1536 x 2048 bf16 = 768 MiB, down 384 MiB, each whole under the default
        # 2048 MiB: a checkpointed layer's recompute hands both to its backward
        ([], 768.0 + 384.0),
        (["model.dequant_buffer_mb=null"], 768.0 + 384.0),  # no budget: the same
        (["train.gradient_checkpointing=false"], 768.0),  # no recompute: the largest stack, one projection at a time
        # 256 MiB: windows; the largest is down's forward, 1360 of its 2048 output columns (a 192 KiB column of
        # 128 x 768 bf16 weights, 1365 fit, rounded down to 16 bytes): the window, its codes (half a byte each)
        # and fp32 scales (one per 64), down's fp32 scales (24 MiB / 2), and the window's output for 2048 x 8 rows
        (
            ["model.dequant_buffer_mb=256"],
            (128 * 768 * 1360 * (2 + 0.5 + 4 / 64) + 128 * 2048 * 768 * 4 / 64 + 16384 * 1360 * 2) / 2**20,
        ),
        (["model.kernels=triton"], None),  # the fused kernel decodes in registers: no buffer
        (["data.max_seq_len=128"], None),  # auto: 128 x 8 / 128 = 8 rows per expert < 16 -> triton
        (["model.compute_dtype=float32"], None),  # auto in fp32: torch has no fused grouped_mm -> triton
    ],
)
def test_grouped_mm_decode_buffer_is_planned(settings, expected_mib):
    args = [
        "plan",
        "--model",
        str(ROOT / "configs/models/qwen3-30b-a3b"),
        "--json",
        "--set",
        "data.max_seq_len=2048",
        "--set",
        "train.micro_batch_size=1",
    ]
    for s in settings:
        args += ["--set", s]
    planned = json.loads(CliRunner().invoke(app, args).stdout)["bytes"]
    assert planned.get("dequant_buffer", 0) / 2**20 == (expected_mib or 0)


@pytest.mark.parametrize(
    "settings,per_row",
    [
        # Qwen3-30B-A3B, 2048 tokens x 8 = 16384 rows; grouped_mm: the gathered output gradient, the projected rows
        # and their LoRA term apart (3 x H = 2048), the gate's gradient (2I = 1536) and activation (I = 768), bf16
        ([], 3 * 2048 + 1536 + 768),
        (["lora.experts=false"], 2 * 2048 + 1536 + 768),  # no LoRA term kept apart
        (["model.kernels=triton"], 2048 + 1536 + 768),  # gathers inside the GEMM, adds LoRA in its epilogue
        (["model.kernels=torch"], 0),  # the per-expert reference: an expert's rows at a time
    ],
)
def test_the_moe_backwards_rows_are_planned(settings, per_row):
    """The grouped backward's row tensors at its peak (besides the saved activations and the decoded stack): the
    measured GPU peaks ran above the plan by about this much at 8192 tokens (1.27x allocated), none of it counted."""
    args = ["plan", "--model", str(ROOT / "configs/models/qwen3-30b-a3b"), "--json", "--set", "data.max_seq_len=2048"]
    for s in ["train.micro_batch_size=1", *settings]:
        args += ["--set", s]
    planned = json.loads(CliRunner().invoke(app, args).stdout)["bytes"]
    assert planned.get("moe_backward", 0) == 16384 * per_row * 2


@pytest.mark.parametrize(
    "settings, autotune, planned",
    [
        (["--gpu-gb", "24"], "1", True),
        (["--set", "data.max_seq_len=128", "--set", "train.micro_batch_size=1"], "1", True),
        (["--set", "model.kernels=triton"], "1", True),
        ([], "1", False),
        (["--set", "model.kernels=grouped_mm"], "1", False),
        (["--gpu-gb", "24"], "0", False),
    ],
    ids=["auto-on-a-24GB-card", "auto-few-rows", "triton", "auto-many-rows", "grouped_mm", "autotune-off"],
)
def test_the_autotuners_flush_buffer_is_planned_where_it_runs(settings, autotune, planned, override_kernel_settings):
    """Triton's autotuner clears the L2 with a 256 MiB buffer (its driver's get_empty_cache_for_benchmark) while
    it times configs, in the first step of each shape class. Planned where the training micro-batch's MoE calls take
    Triton and autotuning is on: auto on a 24 GB card (sm_89: Triton at every size), auto on an H100 with few rows
    per expert (128 tokens x 8 / 128 experts: 8, below fused_below_rows), or triton set. Not where they take
    grouped_mm (auto on an H100 at the default micro-batch: the H200 run of 2026-11-30 reserved 0.80x a plan
    that counted it)."""
    from triton.backends.nvidia.driver import CudaDriver

    override_kernel_settings(autotune=autotune != "0")  # MOE_QLORA_AUTOTUNE=autotune, as read at the first launch
    args = ["plan", "--model", str(ROOT / "configs/models/qwen3-30b-a3b"), "--json", *settings]
    out = json.loads(CliRunner().invoke(app, args).stdout)
    got = out["bytes"].get("autotune_flush", 0)
    source = inspect.getsource(CudaDriver.get_empty_cache_for_benchmark)
    assert "256 * 1024 * 1024" in source  # the size the plan counts is still Triton's
    assert got == (256 * 2**20 if planned else 0), out["kernels"] if "kernels" in out else out["notes"]


def test_the_loss_and_the_layers_backward_are_planned_as_phases_apart():
    """The total takes the larger of the loss's logits and what the layers' backward alone holds (the recomputed
    layer, the decoded stacks, the MoE rows), not their sum (the premise: tests/model/test_plan_phases.py): the
    not_at_once row is the smaller of the two, the total the rows' sum less it. Qwen3-30B-A3B at 8,192 tokens on
    a GPU of an H100's kind (grouped_mm: a decoded stack) of 200 GB, so that every case fits. Chunked (1,024 x
    151,936 fp32 twice) the logits are the smaller; whole (8,192 x 151,936 x 3) the backward's rows; without
    checkpointing no layer is recomputed (its activations are held from the forward on), so the backward's own
    rows are the decoded stacks and the MoE rows alone."""

    def planned(*settings: str) -> dict:
        args = ["--gpu-gb", "200", "--set", "data.max_seq_len=8192", "--set", "train.micro_batch_size=1"]
        for setting in settings:
            args += ["--set", setting]
        out = plan_json(ROOT / "configs/models/qwen3-30b-a3b", *args)
        assert out["total"] == out["per_gpu_total"] == sum(out["bytes"].values()) - out["not_at_once"]
        assert any("never meet" in n for n in out["notes"])
        return out

    chunked = planned("train.loss_chunk_tokens=1024")
    assert chunked["not_at_once"] == chunked["bytes"]["loss_logits"] == 2 * 4 * 1024 * 151936
    whole = planned("train.loss_chunk_tokens=0")
    own = whole["bytes"]["dequant_buffer"] + whole["bytes"]["moe_backward"]
    recomputed = whole["not_at_once"] - own
    assert (
        0 < recomputed < whole["bytes"]["activations_estimate"] and whole["not_at_once"] < whole["bytes"]["loss_logits"]
    )
    flat = planned("train.loss_chunk_tokens=0", "train.gradient_checkpointing=false")
    assert flat["not_at_once"] == flat["bytes"]["dequant_buffer"] + flat["bytes"]["moe_backward"]


# --- several GPUs -----------------------------------------------------------------------------------------------
# FSDP2 (distributed.shard_model) splits every tensor it manages on dim 0, padded to a multiple of the ranks, one
# group per decoder layer plus the root; 4-bit linears whose rows hold whole NF4 blocks are split by row.

FSDP_SHARDED = ("experts_nf4", "linear_4bit", "other", "lora", "gradients", "optimizer")
REPLICATED = ("activations_estimate", "loss_logits", "runtime", "dequant_buffer", "moe_backward", "autotune_flush")


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    """A tiny Mixtral (2 layers of 8 experts, vocab 263) and the shape of every LoRA tensor, by name, of the model
    loaded and adapted as training does: the LoRA the plan must shard, counted without the planner."""
    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path_factory.mktemp("plan") / "mixtral", tiny_config("mixtral", len(tok)), tokenizer=tok)
    model = attach_adapters(load_model(LoadOptions(str(path))), run_config(path).lora, seed=0)
    lora = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    return path, lora


def several_gpus_config(path, **train):
    return validate_config(
        {
            "model": {"name_or_path": str(path)},
            "lora": {"rank": 4, "router": True},
            "data": {"train_files": ["unused.jsonl"], "max_seq_len": 32},
            "train": train,
        }
    )


def layer_of(name: str) -> int | None:
    """The decoder layer index in a parameter name (None: the root's embeddings, final norm, head)."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def row_bytes(shape: tuple[int, ...], elem_bytes: int) -> int:
    """Bytes of one dim-0 row: at most one such row of padding per tensor and rank."""
    return math.prod(shape[1:]) * elem_bytes


@pytest.mark.parametrize("gpus", [2, 3, 4])
def test_fsdp_shards_each_tensor_on_dim_0_with_the_4bit_linears_by_row(tiny_mixtral, gpus):
    path, lora = tiny_mixtral
    cfg = several_gpus_config(path)
    one = plan_run(
        cfg.model_copy(update={"model": cfg.model.model_copy(update={"expert_double_quant": False})}),
        name_or_path=str(path),
    ).bytes
    sharded = plan_run(cfg, name_or_path=str(path), gpus=gpus, parallel="fsdp").bytes
    # Experts: codes and fp32 scales per 64 weights (never double-quantized under fsdp), ceil(8 / N) experts a rank.
    assert sharded["experts_nf4"] == one["experts_nf4"] * -(-8 // gpus) // 8
    meta = meta_model(str(path))
    other_rows = sum(row_bytes(p.shape, 2) for n, p in meta.named_parameters() if "experts" not in n)  # bf16
    lora_rows = sum(row_bytes(s, 4) for s in lora.values())
    for kind, padding in [("other", other_rows), ("lora", lora_rows), ("gradients", lora_rows)]:
        assert -(-one[kind] // gpus) <= sharded[kind] <= -(-one[kind] // gpus) + padding, kind
        if gpus != 3:  # every dim 0 of the tiny model's LoRA divides by 2 and 4: no padding
            assert kind == "other" or sharded[kind] == one[kind] // gpus
    assert sharded["lora"] == 4 * sum(-(-s[0] // gpus) * math.prod(s[1:]) for s in lora.values())
    assert sharded["optimizer"] == 2 * sharded["lora"]  # AdamW: two fp32 moments of each shard
    # 4-bit linears (the tiny model's q/k/v/o, in_features 64): codes and fp32 scales, ceil(out / N) rows a rank.
    linears = [p.shape for n, p in meta.named_parameters() if ".self_attn." in n]
    assert linears and sharded["linear_4bit"] == sum(-(-o // gpus) * (i // 2 + i // 64 * 4) for o, i in linears)
    assert {k: sharded.get(k) for k in REPLICATED} == {k: one.get(k) for k in REPLICATED}
    assert set(sharded) == set(one) | {"all_gather_buffers", "root_unsharded"}


def test_fsdp_communication_and_gather_buffers_from_the_layers_parameters(tiny_mixtral):
    """Per optimizer step each rank sends, every micro-batch, (N-1)/N of each layer's unsharded parameters twice
    (forward; backward after reshard_after_forward), of the root's once, and of the fp32 LoRA gradients once
    (reduce-scatter). Counted here from the meta model's parameters and the adapted model's LoRA."""
    path, lora = tiny_mixtral
    gpus, grad_accum = 4, 3
    meta = meta_model(str(path))
    layers = [0] * len(meta.model.layers)
    root = 0
    for name, p in meta.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            nbytes = p.numel() // 2 + p.numel() // 64 * 4  # codes + fp32 scale per 64 weights
        elif ".self_attn." in name:  # q/k/v/o 4-bit: codes + fp32 scales by output row, padded to the ranks
            nbytes = -(-p.shape[0] // gpus) * gpus * (p.shape[1] // 2 + p.shape[1] // 64 * 4)
        else:
            nbytes = -(-p.shape[0] // gpus) * gpus * row_bytes(p.shape, 2)  # bf16, dim 0 padded to the ranks
        if layer_of(name) is None:
            root += nbytes
        else:
            layers[layer_of(name)] += nbytes
    for name, shape in lora.items():
        layers[layer_of(name)] += math.prod(shape) * 4
    lora_bytes = sum(math.prod(s) for s in lora.values()) * 4
    assert root == 2 * 264 * 64 * 2 + 64 * 2  # vocab 263 padded to 264 rows, embeddings and head; the final norm
    per_micro_batch = (gpus - 1) * (2 * sum(layers) + root + lora_bytes) // gpus

    planned = plan_run(
        several_gpus_config(path, grad_accum=grad_accum), name_or_path=str(path), gpus=gpus, parallel="fsdp"
    )
    assert planned.communication_bytes_per_step == grad_accum * per_micro_batch
    assert planned.bytes["all_gather_buffers"] == 2 * max(layers)  # the layer computing and the one prefetched
    assert planned.bytes["root_unsharded"] == root


def test_ddp_holds_the_one_gpu_plan_and_all_reduces_the_lora_gradients(tiny_mixtral):
    path, _ = tiny_mixtral
    cfg = several_gpus_config(path, grad_accum=2)
    one = plan_run(cfg, name_or_path=str(path))
    ddp = plan_run(cfg, name_or_path=str(path), gpus=4, parallel="ddp")
    assert ddp.bytes == one.bytes and (ddp.gpus, ddp.parallel) == (4, "ddp")
    assert one.communication_bytes_per_step == 0
    assert ddp.communication_bytes_per_step == 2 * 3 * one.bytes["lora"] // 4  # ring all-reduce, once a step


def plan_json(path, *args, code=0):
    """plan's JSON; `code`: its exit code, 1 when the run does not fit one GPU of --gpu-gb."""
    result = CliRunner().invoke(app, ["plan", "--model", str(path), "--json", *args])
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def test_auto_is_ddp_when_the_run_fits_one_gpu_and_fsdp_when_not(tiny_mixtral):
    path, _ = tiny_mixtral
    fits = plan_json(path, "--gpus", "2")  # train.parallel: auto (the default)
    assert (fits["gpus"], fits["parallel"], fits["fits"]) == (2, "ddp", True)
    assert fits["per_gpu_total"] == fits["total"] == sum(fits["bytes"].values()) - fits["not_at_once"]
    assert 0 < fits["communication_bytes_per_step"] == fits["bytes"]["lora"]  # all-reduce: 2 (N-1)/N = 1
    assert any("fits one 80 GiB GPU" in n for n in fits["notes"])
    tiny_gpu = plan_json(path, "--gpus", "2", "--gpu-gb", "0.01", code=1)
    small = plan_json(path, "--gpus", "2", "--gpu-gb", "24")  # a GPU of the same class (below 80 GB) that fits
    assert (tiny_gpu["parallel"], tiny_gpu["fits"], small["parallel"]) == ("fsdp", False, "ddp")
    assert tiny_gpu["per_gpu_total"] < small["per_gpu_total"] and tiny_gpu["communication_bytes_per_step"] > 0
    assert any("does not fit one 0.01 GiB GPU" in n for n in tiny_gpu["notes"])
    unchunked = ["--set", "train.mlp_chunk_tokens=0"]  # auto would chunk the MoE rows where nothing fits
    asked = plan_json(path, "--gpus", "2", "--gpu-gb", "0.01", "--set", "train.parallel=ddp", *unchunked, code=1)
    assert (asked["parallel"], asked["bytes"]) == ("ddp", small["bytes"])  # the config's choice, when not auto
    assert plan_json(path, "--gpus", "2", "--set", "train.parallel=ddp", "--parallel", "fsdp")["parallel"] == "fsdp"


def test_the_gpus_memory_says_which_kernels_are_planned(tiny_mixtral):
    """From 80 GB an H100 (auto: grouped_mm, with its decoded stack and its backward's extra rows), below it a 24-48
    GB card (auto: Triton); the control: both at 80 GB and up plan the same bytes."""
    path, _ = tiny_mixtral
    h100, card = plan_json(path, "--gpu-gb", "80")["bytes"], plan_json(path, "--gpu-gb", "24")["bytes"]
    assert h100["dequant_buffer"] > 0 and "dequant_buffer" not in card
    assert h100["moe_backward"] > card["moe_backward"] > 0
    assert plan_json(path, "--gpu-gb", "141")["bytes"] == h100


def test_one_gpu_prints_what_it_always_did(tiny_mixtral):
    path, _ = tiny_mixtral
    plain = CliRunner().invoke(app, ["plan", "--model", str(path)])
    assert plain.exit_code == 0, plain.output
    same_gpu = CliRunner().invoke(app, ["plan", "--model", str(path), "--gpus", "1", "--gpu-gb", "96"])
    *table, verdict = plain.stdout.splitlines()
    assert same_gpu.stdout.splitlines() == [*table, verdict.replace("80 GiB GPU (79", "96 GiB GPU (95")]
    assert verdict.startswith("fits: ") and verdict.endswith(" GiB to spare)")
    assert "per GPU" not in plain.stdout and "communication" not in plain.stdout
    one = plan_json(path)
    assert (one["gpus"], one["parallel"], one["communication_bytes_per_step"], one["fits"]) == (1, "ddp", 0, True)
    bad = CliRunner().invoke(app, ["plan", "--model", str(path), "--parallel", "zero"])
    assert bad.exit_code == 2 and "auto, ddp, fsdp" in bad.output


@pytest.mark.parametrize(
    "name,model_type,params_b,fewest_gpus",
    [("mixtral-8x22b", "mixtral", 141, 2), ("deepseek-v2", "deepseek_v2", 236, 3)],  # published sizes
)
def test_large_shipped_configs_fit_80_gib_gpus_under_fsdp(name, model_type, params_b, fewest_gpus):
    """config.json alone, built by transformers' own classes (no remote code); at seq 4096, r16, fsdp needs
    `fewest_gpus` GPUs of 80 GiB."""
    path = str(ROOT / "configs/models" / name)
    model = meta_model(path)
    cfg = validate_config(
        {
            "model": {"name_or_path": path},
            "lora": {"rank": 16, "alpha": 32},
            "data": {"train_files": ["(not read by plan)"], "max_seq_len": 4096},
            "train": {"micro_batch_size": 1},
        }
    )
    one = plan_run(cfg, name_or_path=path, model=model)
    assert (one.model_type, round(one.params / 1e9)) == (model_type, params_b)
    for gpus in (fewest_gpus - 1, fewest_gpus):
        fsdp = plan_run(cfg, name_or_path=path, model=model, gpus=gpus, parallel="fsdp")
        assert fsdp.fits == (gpus == fewest_gpus), (gpus, fsdp.total / 2**30)


def test_expert_offload_is_not_planned_for_mxfp4_experts():
    """gpt-oss as published keeps its experts in MXFP4, which loading refuses to offload: plan says so and plans
    the run without offload (the experts stay whole on the GPU), rather than subtracting NF4 bytes it never
    counted; with expert_format nf4 the same run is planned offloaded."""
    path = ROOT / "configs/models/gpt-oss-20b"
    plans = {}
    for expert_format in ("auto", "nf4"):
        cfg = run_config(path, expert_offload="all", expert_format=expert_format)
        plans[expert_format] = plan_run(cfg, name_or_path=str(path), device="cuda")
    mxfp4, nf4 = plans["auto"], plans["nf4"]
    assert mxfp4.offload is None and any("not built for MXFP4" in n for n in mxfp4.notes)
    assert mxfp4.bytes["experts_nf4"] == 0 and mxfp4.bytes["experts_mxfp4"] > 9 * 2**30
    assert nf4.offload is not None and "experts_mxfp4" not in nf4.bytes
