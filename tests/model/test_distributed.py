"""Data parallel on the CPU: two gloo ranks launched by torchrun against one process with the same global batch."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config

from helpers.crash import free_port, torchrun, torchrun_command
from helpers.once import once_per_session
from helpers.published import publish_gpt_oss_mxfp4

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
STEPS = ["--set", "train.max_steps=6", "--set", "train.warmup_steps=2"]
# The FSDP runs train with the long-context memory helpers on: the MoE rows in chunks of 16 of the micro-batch's
# tokens (nested checkpoints inside FSDP2's layers) and the layer inputs offloaded to the host (all of them: the
# tiny model's are under the 1 MiB floor). Their checks then hold with both on: one process reproduced, a
# checkpoint resumed bit for bit.
LONG_CONTEXT = ["--set", "train.mlp_chunk_tokens=16", "--set", "train.offload_activations=true"]
OFFLOAD_ALL = {"MOE_QLORA_OFFLOAD_MIN_BYTES": "0"}


def env_for(tmp_path, **extra) -> dict:
    """The ranks' environment: one thread each, and the session's model cache (conftest's, beside `tmp_path`), so
    the builtin model is generated once a session, not once a test."""
    cache = str(tmp_path.parent / "moe-qlora-cache")
    return {**os.environ, "MOE_QLORA_CACHE": cache, "OMP_NUM_THREADS": "1", **extra}


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def shared_run(tmp_path_factory, name: str, launch) -> tuple[Path, subprocess.CompletedProcess]:
    """(the run's output.dir, its finished process): `launch(folder)` made once a session (helpers.once), whichever
    xdist worker asks first; the tests read it and copy what they resume."""
    folder, proc = once_per_session(tmp_path_factory, name, launch)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return folder / "run", proc


def train_command(folder: Path, *args: str) -> list[str]:
    return ["train", "--config", str(DEMO), *STEPS, *args, "--set", f"output.dir={folder / 'run'}"]


@pytest.fixture
def runs(tmp_path_factory):
    """The demo for 6 steps: one process with micro-batch 4, and 2 ranks with micro-batch 2 each."""

    def single(folder: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "moe_qlora", *train_command(folder, "--set", "train.micro_batch_size=4")]
        return subprocess.run(cmd, env=env_for(folder), capture_output=True, text=True, timeout=600)

    def two(folder: Path) -> subprocess.CompletedProcess:
        return torchrun(train_command(folder, "--set", "train.micro_batch_size=2"), env_for(folder))

    one_run, _ = shared_run(tmp_path_factory, "ddp-single", single)
    two_run, proc = shared_run(tmp_path_factory, "ddp-two", two)
    return one_run, two_run, proc


FSDP_ARGS = ["--set", "train.micro_batch_size=2", "--set", "train.parallel=fsdp", "--set", "train.save_every=3"]


@pytest.fixture
def fsdp_run(tmp_path_factory):
    """The demo for 6 steps on 2 ranks under fsdp with the long-context helpers on, a checkpoint every 3 steps."""

    def launch(folder: Path) -> subprocess.CompletedProcess:
        return torchrun(train_command(folder, *FSDP_ARGS, *LONG_CONTEXT), env_for(folder, **OFFLOAD_ALL))

    return shared_run(tmp_path_factory, "fsdp", launch)


def test_fsdp_over_two_ranks_reproduces_one_process(runs, fsdp_run):
    """FSDP2: experts sharded by expert, LoRA and AdamW moments sharded, gradients reduce-scattered. The same
    global batch as one process: losses within 1e-5 (the issue's bound; fp32 summation order differs), and the
    adapter, gathered whole and verified in PEFT by rank 0, within the same AdamW noise as DDP (see above)."""
    single, _, _ = runs
    run, proc = fsdp_run
    a, b = records(single), records(run)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True)) <= 1e-5
    assert max(abs(x["grad_norm"] - y["grad_norm"]) / x["grad_norm"] for x, y in zip(a, b, strict=True)) <= 1e-5
    assert "data parallel (fsdp): 2 ranks x micro_batch_size 2, global batch 8" in proc.stdout
    assert "each verified to load in PEFT as trained" in proc.stdout
    fa, fb = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (single, run))
    diff = torch.cat([(fa[k] - fb[k]).abs().flatten() for k in fa])
    assert fa.keys() == fb.keys() and float(diff.max()) <= 5e-5
    assert int((diff > 1e-6).sum()) <= diff.numel() // 1000
    # The checkpoint holds whole tensors (gathered), the same names and shapes as a one-process run's.
    saved = load_file(str(run / "checkpoints" / "step-00000006" / "trainable.safetensors"))
    mine = load_file(str(single / "checkpoints" / "step-00000006" / "trainable.safetensors"))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in mine.items()}


def test_a_checkpoint_of_two_fsdp_ranks_resumes_in_one_process_from_the_same_global_position(fsdp_run, tmp_path):
    """Written by 2 ranks x micro-batch 2 (global batch 8), resumed by one process x micro-batch 2 (global 4):
    checkpoint step 3 ended at example 24, which is step 6 of the new layout. The steps after it must see the
    data, and the LR, of an uninterrupted one-process run from step 7 on, and the run says what changed."""
    run, _ = fsdp_run
    args = [
        "train",
        "--config",
        str(DEMO),
        "--set",
        "train.max_steps=6",
        "--set",
        "train.warmup_steps=2",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "train.parallel=fsdp",
    ]
    env = env_for(tmp_path)
    reference = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_qlora",
            *args,
            "--set",
            "train.max_steps=12",
            "--set",
            f"output.dir={tmp_path / 'reference'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert reference.returncode == 0, reference.stderr[-2000:]
    run = Path(shutil.copytree(run, tmp_path / "resumed"))
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_qlora",
            *args,
            "--set",
            f"output.dir={run}",
            "--resume-from",
            str(run / "checkpoints" / "step-00000003"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = " ".join(resumed.stdout.split())
    assert "the checkpoint was written by 2 rank(s), this run has 1: the global batch changes from 8 to 4" in said
    assert (
        "continues from the same global position (example 24 of the run): step 3 of the checkpoint's run is "
        "step 6 here, of 12;" in said
    )
    after = [r for r in records(run) if r["step"] > 6]
    ref = {r["step"]: r for r in records(tmp_path / "reference")}
    assert [r["step"] for r in after] == list(range(7, 13))
    assert [r["tokens"] for r in after] == [ref[r["step"]]["tokens"] for r in after]  # the same examples
    assert all(abs(r["lr"] - ref[r["step"]]["lr"]) <= 1e-12 for r in after)  # the same point of the schedule
    assert [r["step"] for r in records(run)][:3] == [1, 2, 3]  # the 2-rank steps before the checkpoint are kept


EP_ARGS = ["--set", "train.micro_batch_size=2", "--set", "train.parallel=ep", "--set", "train.save_every=3"]
EP_DENSE_FSDP = ["--set", "train.ep_dense=fsdp"]  # the ep run's: the rest sharded (replicated in the other ep tests)


@pytest.fixture
def ep_run(tmp_path_factory):
    """The demo for 6 steps on 2 ranks under train.parallel: ep, the rest sharded with FSDP2 (train.ep_dense:
    fsdp), with the MoE rows in chunks and the layer inputs offloaded (LONG_CONTEXT), a checkpoint at step 3."""

    def launch(folder: Path) -> subprocess.CompletedProcess:
        args = [*EP_ARGS, *EP_DENSE_FSDP, *LONG_CONTEXT]
        return torchrun(train_command(folder, *args), env_for(folder, **OFFLOAD_ALL))

    return shared_run(tmp_path_factory, "ep", launch)


def test_ep_over_two_ranks_reproduces_one_process(runs, ep_run):
    """The same global batch as one process: losses and gradient norms within 1e-5 (the fsdp bounds: fp32 sums in
    another order), the adapter (gathered whole, verified in PEFT by rank 0) within AdamW's noise, and the
    checkpoint holding whole tensors under a one-process run's names and shapes."""
    single, _, _ = runs
    run, proc = ep_run
    a, b = records(single), records(run)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6] and [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True)) <= 1e-5
    assert max(abs(x["grad_norm"] - y["grad_norm"]) / x["grad_norm"] for x, y in zip(a, b, strict=True)) <= 1e-5
    said = " ".join(proc.stdout.split())
    assert "ep: every MoE layer's experts and their LoRA split over 2 ranks, the rest sharded with FSDP2" in said
    assert "data parallel (ep): 2 ranks x micro_batch_size 2, global batch 8" in said
    fa, fb = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (single, run))
    diff = torch.cat([(fa[k] - fb[k]).abs().flatten() for k in fa])
    assert fa.keys() == fb.keys() and float(diff.max()) <= 5e-5
    saved = load_file(str(run / "checkpoints" / "step-00000006" / "trainable.safetensors"))
    mine = load_file(str(single / "checkpoints" / "step-00000006" / "trainable.safetensors"))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in mine.items()}


def test_an_ep_checkpoint_resumes_under_ddp_as_the_same_run(ep_run, tmp_path):
    """Checkpoint step 3 of the ep run (whole tensors) resumed by 2 ranks under ddp (the whole model on each rank:
    another layout): the same run within AdamW's noise (the bound above), and not bit for bit (another order of
    the sums). Resumed under ep it is bit for bit: the SIGKILL test below."""
    run, _ = ep_run
    resumed = Path(shutil.copytree(run, tmp_path / "resumed"))
    proc = torchrun(
        ["train", "--config", str(DEMO), *STEPS, *EP_ARGS, "--set", "train.parallel=ddp", *LONG_CONTEXT]
        + ["--set", f"output.dir={resumed}", "--resume-from", str(resumed / "checkpoints" / "step-00000003")],
        env_for(tmp_path, **OFFLOAD_ALL),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "resumed from" in proc.stdout and "warning" not in proc.stdout
    assert [r["step"] for r in records(resumed)] == [1, 2, 3, 4, 5, 6]
    a, b = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (run, resumed))
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 5e-5
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_reproduce_one_process_with_the_same_global_batch(runs):
    single, two, proc = runs
    a, b = records(single), records(two)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]  # rank 0 alone writes: each step once
    # The same tokens (the global batch), and losses equal up to fp32 summation order.
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True)) <= 1e-6
    assert "data parallel (ddp): 2 ranks x micro_batch_size 2, global batch 8" in proc.stdout
    # Adapters: AdamW divides each step by sqrt(v), so a gradient element that is ~0 (rounding noise, which
    # differs between a 4-row and two 2-row matmuls) moves by up to lr in a sign set by that noise: measured,
    # 5 of 72,704 elements differ by more than 1e-6, none by more than 1e-5 (lr 5e-3).
    fa, fb = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (single, two))
    diff = torch.cat([(fa[k] - fb[k]).abs().flatten() for k in fa])
    assert fa.keys() == fb.keys() and float(diff.max()) <= 5e-5
    assert int((diff > 1e-6).sum()) <= diff.numel() // 1000


def test_two_ranks_with_expert_offload_give_bitwise_the_two_rank_run(runs, tmp_path):
    """model.expert_offload: all under ddp: each rank offloads its own copy; the losses and adapter are bitwise
    those of the same two ranks without offload."""
    _, two, _ = runs
    out = tmp_path / "offload"
    proc = torchrun(
        [
            "train",
            "--config",
            str(DEMO),
            *STEPS,
            "--set",
            "train.micro_batch_size=2",
            "--set",
            "model.expert_offload=all",
            "--set",
            f"output.dir={out}",
        ],
        env_for(tmp_path),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "expert offload (all): 2 of 2 MoE layers" in proc.stdout
    assert [r["loss"] for r in records(out)] == [r["loss"] for r in records(two)]
    adapters = [(r / "adapter" / "adapter_model.safetensors").read_bytes() for r in (two, out)]
    assert adapters[0] == adapters[1]


GRADIENT_SCRIPT = """
import sys, torch
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.config.sections import LoraSection
from moe_qlora.data.examples import Example, collate
from moe_qlora.common.process_exit import exit_without_finalizing
from moe_qlora.model.distributed import full_tensor, join, leave, local_shard, shard_model
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.model_path import ensure_tiny
from moe_qlora.train.sft import accumulate_gradients
from moe_qlora.train.steps import idle_row

joined = join(60)
lora = LoraSection(rank=4, target_modules=["o_proj"])


def gradient_of(path, layout):
    from moe_qlora.model.expert_parallel import expert_group

    ranks = joined
    layout, _, ep_size = layout.partition(":")  # ep:2: experts split over each group of 2 ranks
    ep_size = int(ep_size or 0)
    layout, _, dense = layout.partition("+")  # ep+fsdp: the rest FSDP2-sharded over all ranks (train.ep_dense)
    expert_shard = ranks if layout in ("fsdp", "ep") and ranks.enabled else None
    if layout == "ep" and ranks.enabled:
        expert_shard = expert_group(ranks, ep_size)
    model = attach_adapters(load_model(LoadOptions(path, expert_shard=expert_shard)), lora, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.05, generator=g)
    rows = [Example(ids, ids, f"r{i}") for i, ids in enumerate(torch.randint(3, 250, (6, 17), generator=g).tolist())]
    rows[1] = Example(rows[1].input_ids[:9], rows[1].labels[:9], "short")
    share = -(-len(rows) // ranks.world)
    mine = rows[ranks.rank * share : (ranks.rank + 1) * share] if ranks.enabled else rows
    if not mine:  # 6 rows over 4 ranks: the last has none, and runs a row with no target, as a run's step does
        mine = [idle_row(rows[0])]
    shards = {}
    if layout == "fsdp" and ranks.enabled:
        ranks = shard_model(model, ranks)
        shards = {k: (tuple(local_shard(p).shape), tuple(p.shape)) for k, p in model.named_parameters()
                  if k.endswith(("_nf4", "_blocks"))}
    if layout == "ep" and ranks.enabled:
        from moe_qlora.model.expert_parallel import split_experts

        ranks = split_experts(model, ranks, ep_size)
        if dense == "fsdp":
            from moe_qlora.model.expert_parallel import shard_dense

            ranks = shard_dense(model, ranks)
        shards = {k: (tuple(local_shard(p).shape), tuple(p.shape)) for k, p in model.named_parameters()}
    loss, n, _ = accumulate_gradients(model, [collate(mine, 0)], ranks=ranks)
    grads = {k: full_tensor(p.grad) for k, p in model.named_parameters() if p.requires_grad}  # every rank gathers
    return {"loss": loss, "n": n, "grads": grads, "shards": shards}


paths = sys.argv[3:] or [str(ensure_tiny("mixtral"))]
results = [gradient_of(path, layout) for layout in sys.argv[2].split(",") for path in paths]
if joined.main:
    torch.save(results, sys.argv[1])
leave(joined)
exit_without_finalizing(0)  # gloo's worker threads outlive the group (common/process_exit.py)
"""


def gradients_over_models(tmp_path, parallel: str, paths: list[str], *, world: int = 2, one=None):
    """GRADIENT_SCRIPT's results for each of `paths` (the tiny Mixtral when empty) in one process (`one`: already
    computed) and on `world` ranks under `parallel`: (one-process results, ranks' results), one launch each."""
    script = tmp_path / "grad.py"
    script.write_text(GRADIENT_SCRIPT)
    env = env_for(tmp_path)
    if one is None:
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "one.pt"), "none", *paths],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        one = torch.load(tmp_path / "one.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd += [str(script), str(tmp_path / f"{world}.pt"), parallel, *paths]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return one, torch.load(tmp_path / f"{world}.pt")


def gradients_of_one_and_two_ranks(tmp_path, parallel: str, *model_path: str) -> tuple[dict, dict]:
    """GRADIENT_SCRIPT's results in one process and on two ranks under `parallel` (on `model_path`'s checkpoint,
    the tiny Mixtral by default)."""
    one, two = gradients_over_models(tmp_path, parallel, list(model_path))
    return one[0], two[0]


def assert_same_gradients(a: dict, b: dict) -> None:
    assert a["n"] == b["n"] and abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"])
    for name, grad in a["grads"].items():
        err = float((grad - b["grads"][name]).abs().max())
        assert err <= 1e-6 * float(grad.abs().max()) + 1e-12, (name, err)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_summed_gradient_of_two_ranks_is_the_one_process_gradient(tmp_path, parallel):
    """The oracle at the level data parallelism controls: the gradient of the step, before AdamW. Under FSDP the
    expert stacks are sharded by expert (each rank holds half the experts' codes) and the gradients are
    reduce-scattered; gathered whole, they must be the one-process gradient."""
    a, b = gradients_of_one_and_two_ranks(tmp_path, parallel)
    if parallel == "fsdp":  # every 4-bit weight's codes split in two: experts (8) by expert, linears by row
        experts = {k: v for k, v in b["shards"].items() if "experts" in k}
        assert len(experts) == 4 and all(local == (8 // 2, whole[1]) for local, whole in experts.values())
        linears = {k: v for k, v in b["shards"].items() if "self_attn" in k}
        assert len(linears) == 8 and all(local == (whole[0] // 2, whole[1]) for local, whole in linears.values())
    assert_same_gradients(a, b)
    # Broken control: a rank that forgot to sum (its own slice only) is far off.
    assert any(
        float((g - 0.5 * b["grads"][k]).abs().max()) > 1e-3 * float(g.abs().max()) for k, g in a["grads"].items()
    )


def test_fsdp_shards_mxfp4_experts_by_expert_and_keeps_the_one_process_gradient(tmp_path):
    """gpt-oss as published, its experts kept in MXFP4: FSDP shards the blocks and scales by expert as loaded (each
    rank holds 4 of the 8 experts' codes), and the gathered gradient is the one-process gradient."""
    tok = build_byte_tokenizer()
    source = save_tiny_model(tmp_path / "bf16", tiny_config("gpt_oss", len(tok)), seed=0, tokenizer=tok)
    folder, _ = publish_gpt_oss_mxfp4(source, tmp_path / "mxfp4")
    a, b = gradients_of_one_and_two_ranks(tmp_path, "fsdp", str(folder))
    blocks = {k: v for k, v in b["shards"].items() if k.endswith("_blocks")}
    assert len(blocks) == 4 and all(local == (4, *whole[1:]) and whole[0] == 8 for local, whole in blocks.values())
    assert_same_gradients(a, b)


def test_expert_parallel_gradients_of_two_and_four_ranks_are_the_one_process_gradient(tmp_path):
    """train.parallel: ep: each rank loads and keeps its experts alone (8 experts: 4 a rank over 2, 2 over 4), the
    routed rows exchanged with all_to_all. The summed LoRA gradients, gathered whole, are the one-process gradient
    within 1e-6 of its scale (assert_same_gradients: fp32 sums in another order) for Mixtral, Qwen3-MoE (a shared
    expert), DeepSeek-V3 (grouped routing, its first layer dense), gpt-oss (biases, its own gate) in NF4 and as
    published in MXFP4; over 4 ranks the last rank has no row of its own and runs a row with no target. Over 4
    ranks also as 2 groups of 2 (train.ep_size: 2; 4 experts a rank, the groups replicas whose experts' gradients
    are summed over them), and so again with the rest FSDP2-sharded over the 4 (train.ep_dense: fsdp; its LoRA
    gradients reduce-scattered). Control by hand: without the sum over the groups (distributed.sum_over_replicas a
    no-op) it fails."""
    tok = build_byte_tokenizer()
    paths = [
        str(save_tiny_model(tmp_path / family, tiny_config(family, len(tok)), seed=0, tokenizer=tok))
        for family in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
    ]
    paths.append(str(publish_gpt_oss_mxfp4(Path(paths[-1]), tmp_path / "gpt_oss_mxfp4")[0]))
    one, two = gradients_over_models(tmp_path, "ep", paths, world=2)
    _, four = gradients_over_models(tmp_path, "ep,ep:2,ep+fsdp:2", paths, world=4, one=one)
    by_layout = [four[i * len(paths) : (i + 1) * len(paths)] for i in range(3)]
    # (ranks, ranks an expert group holds, the rest sharded, results): over 2, over 4, over 4 as 2 groups of 2
    # (train.ep_size 2), and so with the rest sharded over the 4
    layouts = ((2, 2, False, two), (4, 4, False, by_layout[0]), (4, 2, False, by_layout[1]), (4, 2, True, by_layout[2]))
    for world, group, dense_sharded, results in layouts:
        for path, a, b in zip(paths, one, results, strict=True):
            split = {k: v for k, v in b["shards"].items() if "moe_lora" in k or k.endswith(("_nf4", "_blocks"))}
            split = {k: v for k, v in split.items() if ".experts." in k}  # not shared_experts
            dense = {k: v for k, v in b["shards"].items() if "self_attn" in k and "weight" in k}
            assert dense and all((local[0] < whole[0]) == dense_sharded for local, whole in dense.values()), path
            # LoRA: DTensors of 8 experts, this rank's rows local; codes and blocks: this rank's rows alone.
            assert split and all(
                local[0] == 8 // group and whole[0] == (8 if "moe_lora" in k else 8 // group)
                for k, (local, whole) in split.items()
            ), path
            assert_same_gradients(a, b)
            experts = [k for k in a["grads"] if "moe_lora" in k]
            assert experts and all(float(a["grads"][k].abs().max()) > 0 for k in experts)
            # Control: a rank's experts that missed the rows of the other ranks (its own only) are far off.
            assert any(
                float((a["grads"][k] - b["grads"][k] / world).abs().max()) > 1e-3 * float(a["grads"][k].abs().max())
                for k in experts
            ), path


FAIL_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":
    import moe_qlora.train.sft as trainer
    from moe_qlora.data.sources import DataError

    def broken(*args, **kwargs):
        raise DataError("rows.jsonl:3: unreadable on this node")

    trainer.build_examples = broken
if os.environ.get("RANK") == "0":  # slow to reach its sentence: torchrun stops it unless rank 1 waits at exit
    import time
    import moe_qlora.model.distributed as distributed

    leave = distributed.leave

    def slow_leave(ranks, *, together=True):
        if not together:
            time.sleep(5)
        leave(ranks, together=together)

    distributed.leave = slow_leave
"""


def test_a_rank_that_fails_to_load_stops_every_rank_with_its_message(tmp_path):
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(FAIL_ON_RANK_1)
    env = env_for(tmp_path, PYTHONPATH=os.pathsep.join([str(tmp_path / "inject"), os.environ.get("PYTHONPATH", "")]))
    proc = torchrun(
        [
            "train",
            "--config",
            str(DEMO),
            *STEPS,
            "--set",
            "train.dist_timeout_s=120",
            "--set",
            f"output.dir={tmp_path / 'out'}",
        ],
        env,
        timeout=240,
    )
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0
    assert "error: rank 1 failed (DataError): rows.jsonl:3: unreadable on this node" in out  # rank 0's sentence
    assert "error: rows.jsonl:3: unreadable on this node" in out  # rank 1's own
    assert "moe_qlora/" not in out  # no traceback from the ranks (torchrun prints its own launcher's)
    assert not (tmp_path / "out" / "adapter").exists()


@pytest.mark.parametrize("layout", ["fsdp", "ep"])
def test_a_sharded_layout_with_expert_offload_or_an_8bit_optimizer_is_refused_before_loading(tmp_path, layout):
    env = env_for(tmp_path, WORLD_SIZE="2")
    sharded = ["--set", f"train.parallel={layout}"]
    for args, message in (
        (
            [
                "grpo",
                "--config",
                str(ROOT / "configs" / "grpo-demo.yaml"),
                *sharded,
                "--set",
                "model.expert_offload=all",
            ],
            f"model.expert_offload: all with train.parallel: {layout}",
        ),
        (
            [
                "dpo",
                "--config",
                str(ROOT / "configs" / "dpo-demo.yaml"),
                *sharded,
                "--set",
                "train.optimizer=adamw_8bit",
            ],
            "train.optimizer: adamw_8bit keeps bitsandbytes state a sharded tensor cannot have",
        ),
        (
            ["train", "--config", str(DEMO), *sharded, "--set", "train.optimizer=adamw_8bit"],
            f"train.optimizer: adamw_8bit keeps bitsandbytes state a sharded tensor cannot have; use adamw with "
            f"train.parallel: {layout}",
        ),
        (
            ["train", "--config", str(DEMO), *sharded, "--set", "model.expert_offload=all"],
            f"model.expert_offload: all with train.parallel: {layout}: {layout} already splits the experts",
        ),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "moe_qlora", *args], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2 and message in " ".join(proc.stderr.split()), (args, proc.stderr[-800:])


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{LOCAL_RANK: pid} of the workers torchrun started (read from /proc: Linux)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == launcher_pid:  # field 4 of /proc/PID/stat: the parent
            ranks = [v.split(b"=", 1)[1] for v in environ if v.startswith(b"LOCAL_RANK=")]
            if ranks:
                found[int(ranks[0])] = int(entry.name)
    return found


def kill_rank_1_after_steps(args: list[str], env: dict, out: Path, steps: int) -> None:
    """Launch `args` on 2 ranks and SIGKILL rank 1 once rank 0 has logged `steps` steps to `out`/metrics.jsonl;
    torchrun then stops rank 0, and the launch fails."""
    import signal
    import time

    launcher = subprocess.Popen(torchrun_command(args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, killed = out / "metrics.jsonl", False
    while launcher.poll() is None and not killed:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            os.kill(rank_pids(launcher.pid)[1], signal.SIGKILL)
            killed = True
        time.sleep(0.002)
    assert killed and launcher.wait(timeout=120) != 0


def test_sigkill_of_one_rank_then_resume_gives_the_uninterrupted_result(runs, tmp_path):
    """The 2-rank demo run (`runs`) relaunched with a checkpoint every 2 steps; rank 1 is SIGKILLed after rank 0
    logged 5 steps. torchrun stops the other rank; relaunched with --resume, the run ends with the uninterrupted
    run's adapter, tensor for tensor (the checkpoint cadence and the collectives' timeout change no number), and
    metrics.jsonl holds each step once."""
    _, two, _ = runs
    args = ["train", "--config", str(DEMO), *STEPS, "--set", "train.micro_batch_size=2", "--set", "train.save_every=2"]
    args += ["--set", "train.dist_timeout_s=60"]
    env = env_for(tmp_path)
    out = tmp_path / "crashed"
    kill_rank_1_after_steps([*args, "--set", f"output.dir={out}"], env, out, steps=5)
    assert sorted(d.name for d in (out / "checkpoints").iterdir())[-1] == "step-00000004"
    resumed = torchrun([*args, "--set", f"output.dir={out}", "--set", "train.resume=auto"], env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    assert [r["step"] for r in records(out)] == list(range(1, 7))
    a = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def grpo_config(tmp_path, name: str, **grpo) -> Path:
    """Offline GRPO (scored completions in a file, so no sampling noise): 3 prompts a step over 2 ranks is 2 and
    1 whole groups; 2 passes (the clipped ratio) and a KL term, so every statistic and normaliser is summed."""
    import yaml

    cfg = {
        "model": {"name_or_path": "builtin:tiny-mixtral"},
        "lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]},
        "data": {"train_files": [str(ROOT / "data" / "demo_grpo.jsonl")], "max_seq_len": 32},
        "train": {"epochs": 1, "max_steps": 4, "micro_batch_size": 2, "lr": 5e-3, "seed": 0},
        "grpo": {"prompts_per_step": 3, "passes": 2, "kl_coef": 0.02, **grpo},
        "output": {"dir": str(tmp_path / name)},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


OFFLINE = {"offline_file": str(ROOT / "data" / "demo_grpo_offline.jsonl")}


@pytest.fixture
def grpo_one(tmp_path_factory) -> Path:
    """Offline GRPO in one process (grpo_config), made once a session."""

    def run(folder: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "moe_qlora", "grpo", "--config", str(grpo_config(folder, "one", **OFFLINE))]
        return subprocess.run(cmd, env=env_for(folder), capture_output=True, text=True, timeout=600)

    folder, proc = once_per_session(tmp_path_factory, "grpo-one", run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return folder / "one"


def grpo_two(tmp_path_factory, tmp_path, layout: str) -> Path:
    """Offline GRPO over 2 ranks under `layout` (under ep the rest FSDP2-sharded), a checkpoint every 2 steps; the
    ddp run made once a session (the checkpoint test resumes a copy of it), the others in `tmp_path`."""

    def run(folder: Path) -> subprocess.CompletedProcess:
        config = grpo_config(folder, "two", **OFFLINE)
        dense = EP_DENSE_FSDP if layout == "ep" else []
        args = ["grpo", "--config", str(config), "--set", f"train.parallel={layout}", *dense]
        return torchrun([*args, "--set", "train.save_every=2"], env_for(folder))

    if layout == "ddp":
        folder, proc = once_per_session(tmp_path_factory, "grpo-two-ddp", run)
    else:
        folder, proc = tmp_path, run(tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert f"data parallel ({layout}): 2 ranks share each step's 3 prompts by whole groups" in proc.stdout
    return folder / "two"


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "ep"])
def test_grpo_over_two_ranks_splits_prompts_by_whole_groups_and_reproduces_one_process(
    grpo_one, tmp_path_factory, tmp_path, layout
):
    """Under fsdp and ep the rank with 1 group has fewer micro-batches than the rank with 2: it runs idle ones
    (no target, weight 0), so every rank joins each forward of the scoring and of the update. Under ep the rest
    of the model is FSDP2-sharded (train.ep_dense: fsdp; replicated in the reward fault's ep run)."""
    two = grpo_two(tmp_path_factory, tmp_path, layout)
    a, b = records(grpo_one), records(two)
    assert [r["step"] for r in b] == [1, 2, 3, 4] and [r["passes"] for r in b] == [2] * 4
    for x, y in zip(a, b, strict=True):
        # Rewards 1, 0, 0, 0 in every group: advantages 1.5, -0.5 x 3; a group split 2 + 2 would give 0.7 and 0.
        assert x["advantage"] == y["advantage"] and x["reward_mean"] == y["reward_mean"]
        assert x["sequences_trained"] == y["sequences_trained"] == 12
        for key in ("loss", "kl", "clip_fraction"):
            assert abs(x[key] - y[key]) <= 1e-6 * max(1.0, abs(x[key])), (key, x[key], y[key])
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5 * x["grad_norm"]
    roll_a, roll_b = (
        [json.loads(line) for line in (r / "rollouts.jsonl").read_text().splitlines()] for r in (grpo_one, two)
    )
    strip = ("step", "group", "source", "completion", "advantage", "reward")
    assert [{k: r[k] for k in strip} for r in roll_a] == [{k: r[k] for k in strip} for r in roll_b]
    fa, fb = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (grpo_one, two))
    assert fa.keys() == fb.keys() and max(float((fa[k] - fb[k]).abs().max()) for k in fa) <= 5e-5


FLAKY_REWARD = """import os
calls = []
def flaky(prompts, completions, **columns):
    calls.append(len(completions))
    if len(calls) >= 3 and os.environ.get("FAIL_REWARD"):  # rank 1's third step on: every call fails
        raise ConnectionError("reward server unreachable from this node")
    return [float(len(c) % 3) for c in completions]
"""


def online_grpo_args(folder: Path, layout: str) -> list[str]:
    """Online grpo over 2 ranks (2 + 1 prompts a step, 4 completions of at most 4 tokens each, 4 steps) under
    `layout` (ep-fsdp: ep with the rest FSDP2-sharded), scored by FLAKY_REWARD (written to `folder`), which fails
    where FAIL_REWARD is set."""
    (folder / "flaky.py").write_text(FLAKY_REWARD)
    reward = {"rewards": [{"function": f"{folder / 'flaky.py'}:flaky"}], "group_size": 4, "max_new_tokens": 4}
    cfg = grpo_config(folder, "run", **reward)
    parallel = ["--set", f"train.parallel={layout.removesuffix('-fsdp')}"]
    parallel += EP_DENSE_FSDP if layout == "ep-fsdp" else []
    return ["grpo", "--config", str(cfg), "--set", "train.dist_timeout_s=60", *parallel]


def online_grpo(tmp_path_factory, layout: str) -> Path:
    """The uninterrupted online grpo run of `layout` (online_grpo_args), made once a session: the online test
    reads its rollouts, the reward fault's test its adapter."""

    def run(folder: Path) -> subprocess.CompletedProcess:
        return torchrun(online_grpo_args(folder, layout), env_for(folder), timeout=180)

    folder, proc = once_per_session(tmp_path_factory, f"online-grpo-{layout}", run)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return folder / "run"


def rollouts(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]


def test_online_grpo_over_two_ranks_samples_every_prompt_of_a_step_once_per_completion(tmp_path_factory):
    """Sampling: each rank samples G completions of its own prompts (seeded by step and rank); rank 0's
    rollouts.jsonl holds the whole batch, every prompt of the step with exactly G completions; and under ep (the
    rest replicated, or sharded too) and fsdp the same rollouts (where FSDP2 shards the model, generate gathers the
    root's shards: the embedding and the head)."""
    rows = rollouts(online_grpo(tmp_path_factory, "ddp"))
    for step in (1, 2, 3, 4):
        mine = [r for r in rows if r["step"] == step]
        by_group = {}
        for r in mine:
            by_group.setdefault(r["group"], set()).add(r["source"])
        assert len(mine) == 3 * 4 and sorted(by_group) == [0, 1, 2]
        assert all(len(sources) == 1 for sources in by_group.values())  # a group is one prompt
        assert len({next(iter(s)) for s in by_group.values()}) == 3  # three different prompts
    # ep: the experts split, every rank generating until all are done (its forwards joined by the other rank,
    # which samples 1 prompt's group against 2). Each rank draws from the same seeded generator as under ddp and
    # the model computes the same function (to fp32 rounding): step 1's completions and rewards are ddp's. Its
    # logged loss is the second pass's, after an update (AdamW's noise, see above), and later steps sample from
    # adapters that differ by it: a token may differ there.
    keep = ("step", "group", "source", "completion", "reward")
    first = [{k: r[k] for k in keep} for r in rows if r["step"] == 1]
    for layout in ("ep", "ep-fsdp", "fsdp"):  # ep with the rest replicated, and sharded too
        run = online_grpo(tmp_path_factory, layout)
        sharded = rollouts(run)
        assert len(first) == 12 and first == [{k: r[k] for k in keep} for r in sharded if r["step"] == 1], layout
        assert len(sharded) == len(rows) and [r["step"] for r in records(run)] == [1, 2, 3, 4]


def launch_two_nodes(
    args: list[str], env: dict, timeout: int = 600, per_node: int = 1
) -> list[subprocess.CompletedProcess]:
    """Two 'nodes' of `per_node` processes each on this machine, met through torchrun's c10d rendezvous, as on a
    cluster (each node runs the same command with its own --node-rank)."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                str(per_node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "moe-qlora-test",
                "-m",
                "moe_qlora",
                *args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


@pytest.mark.parametrize("launcher", ["accelerate", "two nodes"])
def test_accelerate_launch_and_two_nodes_run_the_same_data_parallel_steps(runs, tmp_path, launcher):
    """The CLI reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) whoever sets
    it: accelerate launch, and torchrun across two nodes (LOCAL_RANK 0 on both), give the 2-rank run's steps."""
    _, two, _ = runs
    args = [
        "train",
        "--config",
        str(DEMO),
        *STEPS,
        "--set",
        "train.micro_batch_size=2",
        "--set",
        f"output.dir={tmp_path / 'run'}",
    ]
    env = env_for(tmp_path)
    if launcher == "accelerate":
        accelerate = Path(sys.executable).with_name("accelerate")
        procs = [
            subprocess.run(
                [
                    str(accelerate),
                    "launch",
                    "--multi_gpu",
                    "--num_processes",
                    "2",
                    "--num_machines",
                    "1",
                    "--main_process_port",
                    str(free_port()),
                    "-m",
                    "moe_qlora",
                    *args,
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
        ]
    else:
        procs = launch_two_nodes(args, env)
    for proc in procs:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    said = [p.stdout.count("data parallel (ddp): 2 ranks x micro_batch_size 2, global batch 8") for p in procs]
    assert sum(said) == 1  # rank 0 alone speaks (on either node: the c10d rendezvous assigns the ranks)
    a, b = records(two), records(tmp_path / "run")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6] and [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True)) <= 1e-6


def test_ep_over_two_nodes_of_two_ranks_trains_checkpoints_and_resumes_as_one_node(runs, tmp_path):
    """train.parallel: ep on two 'nodes' of 2 ranks (c10d rendezvous, LOCAL_RANK 0 and 1 on each), the experts
    split within each node (train.ep_size: 2; each rank holds 4 of the 8 experts, the nodes replicas of each
    other, the experts' LoRA gradients summed across them): 4 ranks x micro-batch 1 x grad_accum 2 are one
    process's global batch of 8, losses and gradient norms within 1e-5 (as on one node; the norm counts each
    replicated shard once); the checkpoint of step 3 resumed on two nodes ends on the uninterrupted adapter, bit
    for bit."""
    single, _, _ = runs
    args = ["train", "--config", str(DEMO), *STEPS, "--set", "train.micro_batch_size=1"]
    args += ["--set", "train.parallel=ep", "--set", "train.ep_size=2", "--set", "train.save_every=3"]
    env = env_for(tmp_path)
    run = tmp_path / "run"
    procs = launch_two_nodes([*args, "--set", f"output.dir={run}"], env, per_node=2)
    for proc in procs:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    said = " ".join(" ".join(p.stdout for p in procs).split())
    assert said.count("data parallel (ep): 4 ranks x micro_batch_size 1, global batch 8") == 1
    assert "experts and their LoRA split over each group of 2 ranks (2 groups, replicas of each other)" in said
    a, b = records(single), records(run)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6] and [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True)) <= 1e-5
    assert max(abs(x["grad_norm"] - y["grad_norm"]) / x["grad_norm"] for x, y in zip(a, b, strict=True)) <= 1e-5
    resumed = Path(shutil.copytree(run, tmp_path / "resumed"))
    checkpoint = ["--resume-from", str(resumed / "checkpoints" / "step-00000003")]
    procs = launch_two_nodes([*args, "--set", f"output.dir={resumed}", *checkpoint], env, per_node=2)
    for proc in procs:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert sum(p.stdout.count("resumed from") for p in procs) == 1
    x, y = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (run, resumed))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_fsdp_with_a_rank_left_without_rows_and_an_eval_that_keeps_the_best(tmp_path):
    """Packed, the demo's 94 training rows are 34 sequences: the last global micro-batch of 4 holds 2, both rank
    0's, and rank 1 has nothing (without idle_row the ranks wait on each other until the timeout).
    Under FSDP every rank must run each forward, so that rank trains on a row with no target (idle_row): the
    run must neither hang nor change: losses and eval losses within 1e-5 of one process x micro-batch 4. The
    evals with keep_best write adapter-best from rank 0 alone between steps (the root left gathered by the eval
    must not desynchronise the ranks)."""
    args = [
        "train",
        "--config",
        str(DEMO),
        "--set",
        "train.max_steps=0",
        "--set",
        "train.epochs=1",
        "--set",
        "train.warmup_steps=2",
        "--set",
        "data.packing=true",
        "--set",
        "data.eval_fraction=0.1",
        "--set",
        "train.eval_every=2",
        "--set",
        "train.keep_best=true",
        "--set",
        "train.dist_timeout_s=60",
    ]
    env = env_for(tmp_path)
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_qlora",
            *args,
            "--set",
            "train.micro_batch_size=4",
            "--set",
            f"output.dir={tmp_path / 'one'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    two = torchrun(
        [
            *args,
            "--set",
            "train.micro_batch_size=2",
            "--set",
            "train.parallel=fsdp",
            "--set",
            f"output.dir={tmp_path / 'two'}",
        ],
        env,
        timeout=600,
    )
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    a, b = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b] and [r["tokens"] for r in a] == [r["tokens"] for r in b]
    for key in ("loss", "eval_loss"):
        pairs = [(x[key], y[key]) for x, y in zip(a, b, strict=True) if key in x]
        assert pairs and max(abs(x - y) for x, y in pairs) <= 1e-5, key
    assert (tmp_path / "two" / "adapter-best" / "adapter_model.safetensors").is_file()


def test_a_grpo_checkpoint_of_two_ranks_resumes_in_one_process_on_the_same_prompts(
    grpo_one, tmp_path_factory, tmp_path
):
    """A GRPO step is prompts_per_step prompts of the global order whatever the world size, so a checkpoint of 2
    ranks resumed by one process goes on with the next step's prompts, without remapping. Offline rollouts (no
    sampling): steps 3 and 4 after the resume (of a copy of the 2-rank ddp run) are those of an uninterrupted
    one-process run (rollouts, rewards and advantages equal, losses within 1e-5: the adapter at the checkpoint was
    trained over two ranks)."""
    shared = grpo_two(tmp_path_factory, tmp_path, "ddp")
    two = Path(shutil.copytree(shared, tmp_path / "two"))
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_qlora",
            "grpo",
            "--config",
            str(shared.parent / "two.yaml"),
            "--set",
            "train.save_every=2",
            "--set",
            f"output.dir={two}",
            "--resume-from",
            str(two / "checkpoints" / "step-00000002"),
        ],
        env=env_for(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "warning" not in resumed.stdout
    a, b = records(grpo_one), records(two)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:], strict=True):
        assert x["advantage"] == y["advantage"] and x["reward_mean"] == y["reward_mean"]
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * max(1.0, abs(x["loss"]))
    roll_a, roll_b = (rollouts(r) for r in (grpo_one, two))
    keep = ("step", "group", "source", "completion", "reward")
    assert [{k: r[k] for k in keep} for r in roll_a] == [{k: r[k] for k in keep} for r in roll_b]


# ------------------------------------------------------------------------------------------ a fault on one rank

ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":
    os.environ.update({k.removeprefix("RANK_1_"): v for k, v in os.environ.items() if k.startswith("RANK_1_")})
"""


def env_on_rank_1(tmp_path, **only_rank_1) -> dict:
    """The environment of a launch whose rank 1 alone also sees `only_rank_1` (a fault to inject), through a
    sitecustomize.py that copies RANK_1_X to X on that rank."""
    (tmp_path / "inject").mkdir(exist_ok=True)
    (tmp_path / "inject" / "sitecustomize.py").write_text(ON_RANK_1)
    path = os.pathsep.join([str(tmp_path / "inject"), os.environ.get("PYTHONPATH", "")])
    return env_for(tmp_path, PYTHONPATH=path, **{f"RANK_1_{k}": v for k, v in only_rank_1.items()})


def stopped_together(proc: subprocess.CompletedProcess) -> str:
    """The one sentence every rank printed: the launch failed, each rank said the same error line and where to resume,
    with no traceback. (Whichever rank exits first, torchrun may SIGTERM the other while it tears down.)"""
    said = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(said) == 2, (proc.stdout + proc.stderr)[-3000:]
    assert said[0] == said[1] and proc.stderr.count("resume with: moe-qlora") == 2
    assert "moe_qlora/" not in proc.stdout + proc.stderr  # no traceback from the ranks (torchrun prints its own)
    return said[0]


def test_out_of_memory_on_one_rank_stops_every_rank_with_one_sentence_and_resumes_exactly(runs, tmp_path):
    """Issue 43: out of memory on rank 1 alone, in each phase of a step in turn, the run resumed after each: the
    forward of step 4, the backward of step 5, the optimizer of step 6. Rank 0 meets it after the stretch that
    failed (before the gradients are summed, or after the optimizer), so neither waits in a collective the other
    never reaches: both print rank 0's sentence and exit 1, with the last completed step checkpointed (step 3),
    or found checkpointed already (step 4, by save_every), or, in the optimizer, not (the weights are past step
    5; step 4's checkpoint is the last). The last resume ends on the uninterrupted 2-rank run's adapter, tensor for
    tensor. A launch that hangs fails on the timeout (dist_timeout_s bounds a collective's wait). Before the fix
    rank 1 stopped alone, saying it had checkpointed what only rank 0 writes, and torchrun killed rank 0."""
    _, two, _ = runs
    out = tmp_path / "run"
    args = [
        "train",
        "--config",
        str(DEMO),
        *STEPS,
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "train.save_every=2",
        "--set",
        "train.dist_timeout_s=60",
        "--set",
        f"output.dir={out}",
    ]
    checkpoints = out / "checkpoints"
    faults = (
        ("forward", 4, f"Step 3, the last completed, is checkpointed in {checkpoints / 'step-00000003'}.", 2),
        ("backward", 5, f"Step 4, the last completed, was already checkpointed in {checkpoints / 'step-00000004'}", 3),
        ("optimizer", 6, "Not checkpointed: the optimizer had already updated part of the weights", 3),
    )
    resume = []
    for phase, step, where, oldest_kept in faults:
        env = env_on_rank_1(tmp_path, MOE_QLORA_INJECT_OOM=f"{step}:{phase}")
        said = stopped_together(torchrun([*args, *resume], env, timeout=180))
        assert said.startswith(f"error: rank 1: out of memory at step {step} ({phase}): peak"), said
        assert where in said, said
        kept = sorted(d.name for d in checkpoints.iterdir())
        assert kept == [f"step-{oldest_kept:08d}", f"step-{oldest_kept + 1:08d}"], (phase, kept)
        resume = ["--resume"]
    resumed = torchrun([*args, "--resume"], env_for(tmp_path), timeout=180)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4, 5, 6]
    a, b = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (two, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layout", ["fsdp", "ep"])
def test_out_of_memory_in_a_sharded_forward_then_sigkill_of_a_rank_each_resume_on_the_uninterrupted_adapter(
    request, tmp_path, layout
):
    """The 2-rank fsdp and ep runs (their fixtures: 6 steps, the long-context helpers on) relaunched with a
    checkpoint every 2 steps, and two faults in turn. Out of memory on rank 1 in the forward of step 4: under fsdp
    and ep it cannot be met (rank 0 is inside FSDP's gathers, or the experts' exchange), so rank 1 prints its
    sentence naming the last checkpoint (step 2; nothing is written for step 3) and the launch ends within its
    time limit. Resumed, rank 1 is SIGKILLed once rank 0 has logged 5 steps. The last `--resume` (each rank taking
    its shards, or its experts' rows, of the whole tensors checkpointed) ends on the uninterrupted run's adapter,
    tensor for tensor, with each step logged once."""
    run, _ = request.getfixturevalue(f"{layout}_run")
    out = tmp_path / "run"
    layout_args = {"fsdp": FSDP_ARGS, "ep": EP_ARGS + EP_DENSE_FSDP}[layout]
    args = ["train", "--config", str(DEMO), *STEPS, *layout_args, *LONG_CONTEXT, "--set", "train.save_every=2"]
    args += ["--set", "train.dist_timeout_s=60", "--set", f"output.dir={out}"]
    env = {**env_on_rank_1(tmp_path, MOE_QLORA_INJECT_OOM="4:forward"), **OFFLOAD_ALL}
    proc = torchrun(args, env, timeout=180)
    said = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and said, (proc.stdout + proc.stderr)[-3000:]
    assert said[0].startswith("error: rank 1: out of memory at step 4 (forward): peak")
    assert f"the last checkpoint is {out / 'checkpoints' / 'step-00000002'}." in said[0]
    assert sorted(d.name for d in (out / "checkpoints").iterdir()) == ["step-00000002"]
    env = env_for(tmp_path, **OFFLOAD_ALL)
    kill_rank_1_after_steps([*args, "--resume"], env, out, steps=5)
    assert sorted(d.name for d in (out / "checkpoints").iterdir())[-1] == "step-00000004"
    resumed = torchrun([*args, "--resume"], env, timeout=180)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert "resumed from" in resumed.stdout and "warning" not in resumed.stdout
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4, 5, 6]
    a, b = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (run, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "ep"])
def test_a_reward_function_failing_on_one_rank_stops_every_rank_after_a_checkpoint_and_resumes_exactly(
    tmp_path_factory, tmp_path, layout
):
    """Online grpo over 2 ranks (2 + 1 prompts a step); the reward function raises on rank 1 alone from step 3.
    Rank 0 meets it after sampling and scoring, before the step's first collective (under fsdp and ep the
    sampling's forwards are joined by both, and the scoring has its own meeting point): both print rank 0's sentence,
    naming the function, the step and the prompt, with step 2 checkpointed; resumed, the run ends on the
    uninterrupted run's adapter (the online test's run of the layout)."""
    reference = online_grpo(tmp_path_factory, layout)
    args = online_grpo_args(tmp_path, layout)
    said = stopped_together(torchrun(args, env_on_rank_1(tmp_path, FAIL_REWARD="1"), timeout=180))
    assert said.startswith(f"error: rank 1: reward '{tmp_path / 'flaky.py'}:flaky' failed on prompt 2 of step 3 (")
    assert "ConnectionError: reward server unreachable from this node" in said
    assert f"Step 2, the last completed, is checkpointed in {tmp_path / 'run' / 'checkpoints'}" in said
    resumed = torchrun([*args, "--resume"], env_for(tmp_path), timeout=180)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2, 3, 4]
    a, b = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (reference, tmp_path / "run"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
