"""`moe-qlora plan --parallel ep`: one GPU's bytes with the experts and their LoRA split and the rest whole, the
routed rows' traffic, and auto choosing ep where it fits and sends fewer bytes than fsdp."""

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.config.load import validate_config
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.plan import plan_run
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config

ROOT = Path(__file__).resolve().parents[2]
MIXTRAL_8X7B = ROOT / "configs" / "models" / "mixtral-8x7b"
SPLIT_OR_ADDED = ("experts_nf4", "lora", "gradients", "optimizer", "exchange_buffers")


def config(path, **train):
    return validate_config(
        {
            "model": {"name_or_path": str(path)},
            "lora": {"rank": 4, "router": True},
            "data": {"train_files": ["unused.jsonl"], "max_seq_len": 32},
            "train": {"mlp_chunk_tokens": 0, "micro_batch_size": 1, **train},
        }
    )


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    """A tiny Mixtral (2 MoE layers of 8 experts, top-2, hidden 64) and the shape of every LoRA tensor of the model
    loaded and adapted as training does: what the plan must split, counted without the planner."""
    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path_factory.mktemp("ep") / "mixtral", tiny_config("mixtral", len(tok)), tokenizer=tok)
    model = attach_adapters(load_model(LoadOptions(str(path))), config(path).lora, seed=0)
    lora = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    return path, lora


@pytest.mark.parametrize("gpus", [2, 3, 4])
def test_ep_splits_the_experts_and_their_lora_and_keeps_the_rest_whole(tiny_mixtral, gpus):
    path, lora = tiny_mixtral
    cfg = config(path, grad_accum=2)
    one = plan_run(cfg, name_or_path=str(path)).bytes
    no_nested = cfg.model_copy(update={"model": cfg.model.model_copy(update={"expert_double_quant": False})})
    codes_and_scales = plan_run(no_nested, name_or_path=str(path)).bytes["experts_nf4"]
    ep = plan_run(cfg, name_or_path=str(path), gpus=gpus, parallel="ep")
    share = -(-8 // gpus)  # ceil(E / N) experts a GPU, as torch.chunk splits them
    assert ep.bytes["experts_nf4"] == codes_and_scales * share // 8  # fp32 scales: never double-quantized
    experts = {n: s for n, s in lora.items() if "moe_lora" in n}
    whole = {n: s for n, s in lora.items() if "moe_lora" not in n}
    assert experts and whole and all(len(s) == 3 and s[0] == 8 for s in experts.values())
    numel = sum(share * math.prod(s[1:]) for s in experts.values()) + sum(math.prod(s) for s in whole.values())
    assert ep.bytes["lora"] == 4 * numel and ep.bytes["optimizer"] == 2 * 4 * numel  # fp32, AdamW's two moments
    assert {k: v for k, v in ep.bytes.items() if k not in SPLIT_OR_ADDED} == {
        k: v for k, v in one.items() if k not in SPLIT_OR_ADDED
    }
    # Traffic: 32 tokens (micro_batch_size 1) x top-2 x hidden 64 x bf16 per MoE layer call, out and back, in the
    # forward, the backward and the checkpointed recompute, (N-1)/N of it leaving, 2 layers, 2 micro-batches; then
    # the whole LoRA's gradients all-reduced (2 (N-1)/N of them).
    rows = 32 * 2 * 64 * 2
    exchange = 2 * 3 * 2 * rows * (gpus - 1) // gpus
    all_reduce = 2 * (gpus - 1) * 4 * sum(math.prod(s) for s in whole.values()) // gpus
    assert ep.communication_bytes_per_step == 2 * exchange + all_reduce
    assert ep.bytes["exchange_buffers"] == 4 * rows
    # Control: the tokens double, so does the exchange (the all-reduce does not move).
    longer = plan_run(config(path, grad_accum=2, micro_batch_size=2), name_or_path=str(path), gpus=gpus, parallel="ep")
    assert longer.communication_bytes_per_step == 4 * exchange + all_reduce


def test_ep_with_the_rest_sharded_holds_eps_experts_and_fsdps_share_of_the_rest(tiny_mixtral):
    """train.ep_dense: fsdp over 2 GPUs: the experts, their LoRA and the exchange as under ep; the attention's
    4-bit linears, the compute-dtype weights and the root as under fsdp; the rest's LoRA halved (its rows split).
    Traffic: ep's exchange (no LoRA all-reduce) plus fsdp's traffic less what fsdp moves for the experts (their
    stacks and LoRA gathered twice a layer, their LoRA gradients reduce-scattered, (N-1)/N of each). Control: the
    replicated rest holds the 4-bit linears whole."""
    path, lora = tiny_mixtral
    dense = plan_run(config(path, grad_accum=2, ep_dense="fsdp"), name_or_path=str(path), gpus=2, parallel="ep")
    ep, fsdp = (
        plan_run(config(path, grad_accum=2), name_or_path=str(path), gpus=2, parallel=p) for p in ("ep", "fsdp")
    )
    assert dense.bytes["experts_nf4"] == ep.bytes["experts_nf4"] and dense.bytes["exchange_buffers"] > 0
    for kind in ("linear_4bit", "other", "root_unsharded"):
        assert dense.bytes[kind] == fsdp.bytes[kind], kind
    assert 0 < dense.bytes["all_gather_buffers"] < fsdp.bytes["all_gather_buffers"]  # a layer without its experts
    numel = sum(4 * math.prod(s[1:]) if "moe_lora" in n else -(-s[0] // 2) * math.prod(s[1:]) for n, s in lora.items())
    assert dense.bytes["lora"] == 4 * numel and dense.bytes["optimizer"] == 2 * 4 * numel
    assert dense.bytes["linear_4bit"] < ep.bytes["linear_4bit"]
    exchange = 2 * (2 * 3 * 2 * (32 * 2 * 64 * 2) // 2)
    no_nested = config(path, grad_accum=2).model_copy(deep=True)
    no_nested.model.expert_double_quant = False
    stacks = plan_run(no_nested, name_or_path=str(path)).bytes["experts_nf4"]  # codes and fp32 scales, whole
    expert_lora = 4 * sum(math.prod(s) for n, s in lora.items() if "moe_lora" in n)
    experts_in_fsdp = 2 * (2 * (stacks + expert_lora) // 2 + expert_lora // 2)  # 2 micro-batches
    assert dense.communication_bytes_per_step == exchange + fsdp.communication_bytes_per_step - experts_in_fsdp
    assert any(note.startswith("train.ep_dense: fsdp: the rest sharded over the 2 GPUs") for note in dense.notes)


def plan_json(*args, code=0):
    result = CliRunner().invoke(app, ["plan", "--model", str(MIXTRAL_8X7B), "--json", "--gpus", "2", *args])
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


UNCHUNKED = ["--set", "train.mlp_chunk_tokens=0", "--set", "train.offload_activations=false"]


def test_auto_takes_ep_where_it_fits_and_sends_less_than_fsdp_and_fsdp_where_it_sends_less():
    """Mixtral-8x7B over 2 GPUs. 256 tokens a micro-batch, 24 GiB GPUs: the whole run does not fit one, ep (its
    routed rows) sends far fewer bytes than fsdp (every layer's parameters twice): ep. 8,192 tokens, 40 GiB: the
    routed rows outweigh the parameters: fsdp."""
    short = ["--set", "data.max_seq_len=256", "--gpu-gb", "24", *UNCHUNKED]
    by_layout = {p: plan_json(*short, "--parallel", p, code=int(p == "ddp")) for p in ("ddp", "fsdp", "ep")}
    auto = plan_json(*short, "--parallel", "auto")
    assert not by_layout["ddp"]["fits"] and by_layout["ep"]["fits"]
    assert by_layout["ep"]["communication_bytes_per_step"] < by_layout["fsdp"]["communication_bytes_per_step"]
    assert auto["parallel"] == "ep" and auto["bytes"] == by_layout["ep"]["bytes"]
    assert any(n.startswith("parallel auto -> ep: the whole run") for n in auto["notes"])
    long = ["--set", "data.max_seq_len=8192", "--gpu-gb", "40", *UNCHUNKED]
    ep, fsdp = (plan_json(*long, "--parallel", p) for p in ("ep", "fsdp"))
    assert ep["fits"] and fsdp["fits"]
    assert ep["communication_bytes_per_step"] > fsdp["communication_bytes_per_step"]
    assert plan_json(*long, "--parallel", "auto")["parallel"] == "fsdp"


def test_ep_in_groups_splits_the_experts_within_a_group_and_sums_their_gradients_over_the_groups(tiny_mixtral):
    """train.ep_size 2 over 4 GPUs: each GPU's bytes are those of ep over 2 (4 of the 8 experts and their LoRA);
    the exchange is the 2-GPU group's; the whole LoRA is all-reduced over the 4 GPUs, and each GPU's experts' LoRA
    gradients over the 2 replica groups (2 (R-1)/R of them, R = 2). Control: ep over all 4 holds fewer experts a
    GPU and sends more rows."""
    path, lora = tiny_mixtral
    cfg = config(path, grad_accum=2, ep_size=2)
    grouped = plan_run(cfg, name_or_path=str(path), gpus=4, parallel="ep")
    pair = plan_run(config(path, grad_accum=2), name_or_path=str(path), gpus=2, parallel="ep")
    assert grouped.bytes == pair.bytes
    whole = sum(math.prod(s) for n, s in lora.items() if "moe_lora" not in n)
    experts_per_gpu = sum(4 * math.prod(s[1:]) for n, s in lora.items() if "moe_lora" in n)
    rows = 32 * 2 * 64 * 2
    exchange = 2 * 3 * 2 * rows * (2 - 1) // 2
    reduce = 2 * 3 * 4 * whole // 4 + 2 * 1 * 4 * experts_per_gpu // 2
    assert grouped.communication_bytes_per_step == 2 * exchange + reduce
    four = plan_run(config(path, grad_accum=2), name_or_path=str(path), gpus=4, parallel="ep")
    assert four.bytes["experts_nf4"] < grouped.bytes["experts_nf4"]
    assert four.communication_bytes_per_step != grouped.communication_bytes_per_step


@pytest.mark.parametrize(
    ("train", "world", "message"),
    [
        ({"parallel": "fsdp", "ep_size": 2}, 4, "train.ep_size: 2 splits the experts under train.parallel: ep, and"),
        ({"parallel": "ep", "ep_size": 1}, 4, "train.ep_size: 1 keeps every expert on every rank"),
        ({"parallel": "ep", "ep_size": 3}, 4, "train.ep_size: 3 does not divide the 4 ranks launched"),
        ({"parallel": "ddp", "ep_dense": "fsdp"}, 2, "train.ep_dense: fsdp places the non-expert part under"),
    ],
)
def test_an_ep_setting_that_cannot_apply_is_refused_naming_the_key(tmp_path, train, world, message):
    from moe_qlora.config.methods import check_method
    from moe_qlora.config.sections import ConfigError

    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        check_method("train", config(tmp_path, **train), world=world, source="cfg.yaml")
