"""Expert offload (model.expert_offload, moe/offload.py): the schedule, bitwise equality with a run without
offload, and what `plan` says about it.

On the CPU the "device" copy of a layer's stacks is a separate buffer (CopyStream clones): the schedule (which
layers are resident at each MoE call, what is copied and dropped) runs as on a GPU, only the side stream does not.
Equality is bitwise: the offloaded stacks hold the same bytes, and the MoE layer does the same arithmetic.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_qlora.common.streams import CheckedStreams, StreamHazard
from moe_qlora.config.load import validate_config
from moe_qlora.config.sections import ConfigError, LoraSection, check_shardable
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.budget import meta_model, this_gpu_capability
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.model_path import ensure_tiny
from moe_qlora.model.offload_plan import OFFLOAD_HEADROOM_BYTES
from moe_qlora.model.plan import plan_run
from moe_qlora.moe.expert_stacks import experts_modules
from moe_qlora.moe.experts import set_moe_kernels
from moe_qlora.moe.offload import ExpertOffloader, offload_experts

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 4


def tiny_model(*, checkpointing: bool, kernels: str = "torch", layers: int = LAYERS):
    torch.manual_seed(0)  # PEFT draws lora_A from the global generator
    path = ensure_tiny("mixtral", num_hidden_layers=layers)
    model = attach_adapters(load_model(LoadOptions(str(path))), LoraSection(rank=4, alpha=8.0), seed=0)
    set_moe_kernels(model, kernels)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def offloaded(model, max_resident: int = 2) -> ExpertOffloader:
    """Every layer offloaded through CheckedStreams: each run of the schedule is also checked for the orderings
    a GPU needs (a copy after the compute that read its buffer, a wait before a read, `max_resident` buffers)."""
    streams = CheckedStreams(max_buffers=max_resident)
    offloader = offload_experts(
        [m for _, m in experts_modules(model)], "cpu", max_resident=max_resident, streams=streams
    )
    offloader.log = []
    return offloader


def step(model, shape: tuple[int, int] = (2, 16)) -> tuple[float, list[torch.Tensor]]:
    """One forward and backward on fixed tokens: (loss, every trainable gradient)."""
    ids = torch.randint(7, 200, shape, generator=torch.Generator().manual_seed(0))
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_schedule_keeps_the_bound_and_prefetches_every_layer(checkpointing):
    """Every MoE call finds its layer resident (prefetched by the call before it) except the very first, at most
    two layers are ever resident, and the backward walks the layers last to first (recomputing each first
    when checkpointing)."""
    model = tiny_model(checkpointing=checkpointing)
    offloader = offloaded(model)
    step(model)
    log = offloader.log
    assert all(len(resident) <= 2 for _, _, resident, _ in log)
    assert all(layer in resident for layer, _, resident, _ in log)
    misses = [(layer, phase) for layer, phase, _, hit in log if not hit]
    assert misses == [(0, "forward")]
    forward = [layer for layer, phase, _, _ in log if phase == "forward"]
    backward = [layer for layer, phase, _, _ in log if phase == "backward"]
    assert forward == list(range(LAYERS))
    # entering a layer inside the backward: every recompute (checkpointing), else each layer but the last,
    # which is still the current one when the backward starts
    assert backward == (list(range(LAYERS))[::-1] if checkpointing else list(range(LAYERS - 1))[::-1])


def test_schedule_check_fails_on_a_prefetch_in_the_wrong_direction(monkeypatch):
    """Broken control: prefetching layer + 1 in the backward too makes the backward miss layers."""
    model = tiny_model(checkpointing=True)
    offloader = offloaded(model)
    monkeypatch.setattr(ExpertOffloader, "next_layer", lambda self, layer: layer + 1 if layer + 1 < LAYERS else None)
    step(model)
    misses = [(layer, phase) for layer, phase, _, hit in offloader.log if not hit]
    assert any(phase == "backward" for _, phase in misses)


@pytest.mark.parametrize("max_resident", [1, 2, 3])
def test_device_buffers_are_allocated_once_and_reused(max_resident):
    """The window is `max_resident` buffers allocated when offload starts; a forward and backward (with
    recomputes) and a generation copy into them again and again and allocate nothing more."""
    model = tiny_model(checkpointing=True)
    offloader = offloaded(model, max_resident=max_resident)
    step(model)
    with torch.no_grad():
        model.generate(input_ids=torch.tensor([[7, 8, 9]]), max_new_tokens=2, do_sample=False)
    log = offloader.streams.log
    assert sum(op == "alloc" for op, *_ in log) == max_resident
    assert sum(op == "pin" for op, *_ in log) == LAYERS  # one page-locked block per layer, never twice
    copies = [entry for entry in log if entry[0] == "copy"]
    assert len(copies) > 2 * LAYERS and all(after is not None for _, _, after, _ in copies)


def test_checked_streams_catch_a_read_before_the_copy_is_waited_for(monkeypatch):
    """Broken control: a schedule that forgets to make the compute stream wait for a copy."""
    from moe_qlora.common.streams import CheckedStreams as Checked

    model = tiny_model(checkpointing=False)
    offloaded(model)
    monkeypatch.setattr(Checked, "wait", lambda self, event, buffer: None)
    with pytest.raises(StreamHazard, match="before the compute stream waited"):
        step(model)


def test_checked_streams_catch_a_copy_over_a_buffer_still_being_read(monkeypatch):
    """Broken control: a copy not ordered after the compute that read the layer it replaces (what dropping a
    buffer marked only by record_stream amounts to)."""
    model = tiny_model(checkpointing=False)
    offloader = offloaded(model)
    copy = offloader.streams.copy
    monkeypatch.setattr(offloader.streams, "copy", lambda dst, src, after=None: copy(dst, src, after=None))
    with pytest.raises(StreamHazard, match="overwrite data still being read"):
        step(model)


def test_checked_streams_catch_more_buffers_than_the_window():
    streams = CheckedStreams(max_buffers=2)
    streams.device_buffer(8), streams.device_buffer(8)
    with pytest.raises(StreamHazard, match="3 device buffers alive, at most 2"):
        streams.device_buffer(8)


@pytest.mark.parametrize("double_quant", [False, True])
def test_plan_counts_the_host_bytes_offload_takes(double_quant):
    """plan's host_bytes and window against the blocks and buffers a real offload allocates, on the tiny model."""
    path = ensure_tiny("mixtral", num_hidden_layers=LAYERS)
    model = load_model(LoadOptions(str(path), expert_double_quant=double_quant))
    cfg = validate_config(
        {
            "model": {"name_or_path": str(path), "expert_offload": "all", "expert_double_quant": double_quant},
            "data": {"train_files": ["(not read)"]},
        }
    )
    plan = plan_run(cfg, name_or_path=str(path), device="cuda")
    offloader = offload_experts([m for _, m in experts_modules(model)], "cpu")
    assert plan.offload.host_bytes == sum(h.block.numel() for h in offloader.host)
    assert plan.bytes["experts_resident"] == sum(s.buffer.numel() for s in offloader.slots)


def test_expert_lora_lives_where_the_model_computes_not_where_experts_are_stored():
    """Offloaded experts are stored on the host while the model computes on the GPU; the LoRA, its routed-row
    counts and gradients must be on the compute device. On a CPU machine the stacks are put on the meta device
    to stand for "stored elsewhere": the old placement (the stacks' device) puts the LoRA there."""
    torch.manual_seed(0)
    model = load_model(LoadOptions(str(ensure_tiny("mixtral", num_hidden_layers=LAYERS))))
    for _, module in experts_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            stored = torch.empty(getattr(module, name).quant_state.shape, device="meta")
            module._parameters[name] = torch.nn.Parameter(stored, requires_grad=False)
    model = attach_adapters(model, LoraSection(rank=4, alpha=8.0), seed=0)
    devices = {p.device.type for _, m in experts_modules(model) for p in m.moe_lora.parameters()}
    devices |= {m.moe_lora.routed_rows.device.type for _, m in experts_modules(model)}
    assert devices == {"cpu"}


def test_one_resident_layer_means_no_prefetch():
    model = tiny_model(checkpointing=True)
    offloader = offloaded(model, max_resident=1)
    step(model)
    assert all(len(resident) == 1 for _, _, resident, _ in offloader.log)
    assert sum(not hit for *_, hit in offloader.log) == 2 * LAYERS - 1  # each layer copied once per pass


@pytest.mark.parametrize("kernels", ["torch", "torch-grouped", "triton"])  # triton: in its interpreter here
def test_offload_gives_bitwise_the_same_loss_and_gradients(kernels, request):
    """With and without gradient checkpointing, against one reference step without offload (recomputing the
    forward gives the same bits, so one reference serves both: the interpreter's step is the test's cost).
    torch-grouped with offload runs the grouped autograd Function instead of the registered op (whose inputs
    would pin the device copies until the backward): the same functions inside, so the same bits. The
    interpreted triton kernels run the checkpointed case only (offload's schedule is the kernels' own in both
    cases; the recompute is where a kernel could read a dropped buffer) on 2 layers with 1 resident (the first
    is dropped in the forward and copied again for its recompute), one row of 8 tokens and wide_triton_blocks
    (3.2 s a step instead of 10.0 at the 16-row swapped tiles 8 tokens take): offload's schedule is the same at
    any tiling."""
    if kernels == "triton":
        request.getfixturevalue("wide_triton_blocks")
    layers, shape, resident = (2, (1, 8), 1) if kernels == "triton" else (LAYERS, (2, 16), 2)
    reference = step(tiny_model(checkpointing=False, kernels=kernels, layers=layers), shape)
    for checkpointing in (True,) if kernels == "triton" else (False, True):
        model = tiny_model(checkpointing=checkpointing, kernels=kernels, layers=layers)
        offloader = offloaded(model, max_resident=resident)
        loss, grads = step(model, shape)
        assert loss == reference[0], checkpointing
        assert all(torch.equal(a, b) for a, b in zip(grads, reference[1], strict=True)), checkpointing
        assert offloader.bytes_copied > 0
        if kernels == "triton":  # layer 0 is copied again for its recompute
            assert [layer for layer, *_, hit in offloader.log if not hit] == [0, 1, 0], offloader.log


def test_generation_with_offload_wraps_to_the_first_layer_and_matches():
    """GRPO's sampling: no-grad forwards, one per token; after the last layer the first is prefetched."""
    ids = torch.randint(7, 200, (1, 5), generator=torch.Generator().manual_seed(1))
    reference = tiny_model(checkpointing=False).generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    model = tiny_model(checkpointing=False)
    offloader = offloaded(model)
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, reference)
    log = offloader.log
    assert [layer for layer, *_ in log] == list(range(LAYERS)) * 4
    assert all(hit for *_, hit in log[1:]) and all(len(r) <= 2 for _, _, r, _ in log)


def run_demo(out: Path, offload: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_qlora",
            "train",
            "--config",
            "configs/demo.yaml",
            "--set",
            f"output.dir={out}",
            "--set",
            "train.max_steps=6",
            "--set",
            "train.warmup_steps=2",
            "--set",
            f"model.expert_offload={offload}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_lora_init_does_not_depend_on_what_loading_drew_from_the_global_rng():
    """Found on an H200: a run with offload and one without began from different attention LoRA (the same first
    loss, since B is zero; different from the second step on), because on CUDA `plan` builds a probe adapter
    to choose the layers, drawing from the global RNG before PEFT drew lora_A from it. Here loading draws a
    few numbers first, as that probe did: the adapter must not change."""
    path = ensure_tiny("mixtral", num_hidden_layers=LAYERS)

    def lora_a_after(draws: int):
        torch.manual_seed(0)
        model = load_model(LoadOptions(str(path)))
        torch.rand(draws)  # what a probe adapter, or a cold cache, draws while loading
        model = attach_adapters(model, LoraSection(rank=4, alpha=8.0), seed=0)
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}

    quiet, drawn = lora_a_after(0), lora_a_after(11)
    assert len(quiet) == 4 * LAYERS and quiet.keys() == drawn.keys()  # q, k, v, o of every layer
    assert all(torch.equal(quiet[n], drawn[n]) for n in quiet)


@pytest.mark.slow
def test_a_run_with_offload_writes_the_same_losses_and_adapter(tmp_path):
    runs = {o: run_demo(tmp_path / o, o) for o in ("none", "all")}
    for proc in runs.values():
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert "expert offload (all): 2 of 2 MoE layers" in runs["all"].stdout

    def losses(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines if '"loss"' in line]

    assert losses("all") == losses("none") and len(losses("none")) == 6
    adapters = [(tmp_path / o / "adapter" / "adapter_model.safetensors").read_bytes() for o in ("none", "all")]
    assert adapters[0] == adapters[1]


def cfg_with(model_path: str, **model_keys):
    return validate_config(
        {
            "model": {"name_or_path": model_path, **model_keys},
            "lora": {"rank": 16, "alpha": 32},
            "data": {"train_files": ["(not read by plan)"], "max_seq_len": 2048},
            "train": {"micro_batch_size": 1, "optimizer": "adamw_8bit", "optimizer_in_backward": True},
        }
    )


@pytest.mark.parametrize(("name", "target_gib"), [("qwen3-30b-a3b", 9), ("mixtral-8x7b", 8), ("deepseek-v2-lite", 6)])
def test_plan_meets_the_offload_targets(name, target_gib):
    """Planned for the cards offload is for: below 80 GB (auto: Triton, no decoded stack held)."""
    path = str(ROOT / "configs" / "models" / name)
    model = meta_model(path)
    small = dict(device="cuda", model=model, gpu_gib=24)
    without = plan_run(cfg_with(path), name_or_path=path, **small)
    plan = plan_run(cfg_with(path, expert_offload="all"), name_or_path=path, **small)
    assert plan.total <= target_gib * 2**30 < without.total
    off = plan.offload
    assert off.layers == off.of and plan.bytes["experts_nf4"] == 0
    # the whole expert stacks move to the host (their blocks: each tensor aligned, the nested code tables, under
    # 0.01% more); two layers' worth comes back as the resident window
    assert 0 <= off.host_bytes - without.bytes["experts_nf4"] < 1e-4 * off.host_bytes
    assert plan.bytes["experts_resident"] == 2 * off.host_bytes // off.layers
    assert without.total - plan.total == without.bytes["experts_nf4"] - plan.bytes["experts_resident"]
    # copies per step: every layer but the two at each turn, twice (forward, backward)
    assert off.bytes_per_step == pytest.approx(2 * off.host_bytes * (off.layers - 2) / off.layers, rel=1e-9)
    assert any("per optimizer step" in note and "PCIe 4 x16" in note for note in plan.notes)


def test_auto_offloads_the_fewest_layers_that_fit():
    path = str(ROOT / "configs" / "models" / "qwen3-30b-a3b")
    model = meta_model(path)
    plan = plan_run(cfg_with(path, expert_offload="auto"), name_or_path=path, device="cuda", model=model, gpu_gib=16)
    k = plan.offload.layers
    headroom = OFFLOAD_HEADROOM_BYTES / 2**30
    assert 0 < k < plan.offload.of and plan.total <= (16 - headroom) * 2**30
    fewer = plan_run(
        cfg_with(path, expert_offload="auto"),
        name_or_path=path,
        device="cuda",
        model=model,
        gpu_gib=plan.total / 2**30 + headroom + 0.01,
    )
    assert fewer.offload.layers == k
    roomy = plan_run(cfg_with(path, expert_offload="auto"), name_or_path=path, device="cuda", model=model, gpu_gib=80)
    assert roomy.offload is None and any("fits without offloading" in n for n in roomy.notes)


def test_offload_is_refused_under_fsdp():
    raw = cfg_with(str(ROOT / "configs" / "models" / "qwen3-30b-a3b"), expert_offload="all").model_dump(mode="json")
    raw["train"].update(optimizer="adamw", optimizer_in_backward=False, parallel="fsdp")
    with pytest.raises(ConfigError, match="model.expert_offload: all with train.parallel: fsdp"):
        check_shardable(validate_config(raw))


def offload_cfg(mode: str = "all"):
    path = str(ROOT / "configs" / "models" / "qwen3-30b-a3b")  # a config.json alone: no weight can be loaded
    return path, cfg_with(path, expert_offload=mode)


def test_offload_is_refused_before_loading_when_the_host_lacks_the_memory(monkeypatch):
    """Decided from config.json alone, before any weight is read (the folder has none): the check cannot be
    fooled by blocks already pinned, which MemAvailable no longer counts."""
    from moe_qlora.model import placement

    path, cfg = offload_cfg()
    monkeypatch.setattr(placement, "available_host_bytes", lambda: 2**30)
    expected = r"needs 13\.93 GiB of host memory for 48 MoE layers' experts; this machine has 1\.00 GiB available"
    with pytest.raises(ConfigError, match=expected):
        placement.offloaded_layers(cfg, path, "cuda", sharded=False, gpu_gib=80)


def test_offloaded_layers_are_the_plans_and_none_off_the_gpu(monkeypatch):
    from moe_qlora.model import placement

    path, cfg = offload_cfg("auto")
    monkeypatch.setattr(placement, "available_host_bytes", lambda: 2**40)
    names = placement.offloaded_layers(cfg, path, "cuda", sharded=False, gpu_gib=16)
    # the run plans for its own GPU (this machine's capability, an H100's without one), as placement does
    plan = plan_run(cfg, name_or_path=path, device="cuda", gpu_gib=16, capability=this_gpu_capability())
    assert names == set(plan.offload.modules) and 0 < len(names) < 48
    assert names == {f"model.layers.{i}.mlp.experts" for i in range(len(names))}
    assert placement.offloaded_layers(cfg, path, "cpu", sharded=False) == frozenset()
    every = {f"model.layers.{i}.mlp.experts" for i in range(48)}
    assert placement.offloaded_layers(offload_cfg("all")[1], path, "cpu", sharded=False) == every
    assert placement.offloaded_layers(cfg, path, "cuda", sharded=True, gpu_gib=16) == frozenset()


@pytest.mark.slow
def test_grpo_with_offload_samples_scores_and_trains_the_same(tmp_path):
    """GRPO's generation (no-grad forwards, the schedule wrapping to layer 0), its reward and policy update with
    every layer offloaded: the rollouts, rewards and adapter are bitwise those of the run without."""
    outs = {}
    for offload in ("none", "all"):
        out = outs[offload] = tmp_path / offload
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "moe_qlora",
                "grpo",
                "--config",
                "configs/grpo-demo.yaml",
                "--set",
                f"output.dir={out}",
                "--set",
                "train.max_steps=3",
                "--set",
                f"model.expert_offload={offload}",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
    rollouts = [(outs[o] / "rollouts.jsonl").read_text().splitlines() for o in ("none", "all")]
    strip = [[{k: v for k, v in json.loads(line).items() if not k.endswith("_s")} for line in r] for r in rollouts]
    assert strip[0] == strip[1] and len(strip[0]) == 3 * 10 * 16
    adapters = [(outs[o] / "adapter" / "adapter_model.safetensors").read_bytes() for o in ("none", "all")]
    assert adapters[0] == adapters[1]


def test_a_run_may_resume_with_offload_switched():
    """Offload changes no bit, so it is not part of the config identity a resume checks (checkpoint.PLACEMENT);
    the control: a key that does change the math (the LoRA rank) changes it."""
    from moe_qlora.config.load import load_config
    from moe_qlora.train.run_identity import config_hash

    def identity(*overrides):
        return config_hash(load_config(ROOT / "configs" / "demo.yaml", list(overrides)).model_dump(mode="json"))

    assert identity() == identity("model.expert_offload=all", "model.offload_resident_layers=1")
    assert identity() != identity("lora.rank=4")
