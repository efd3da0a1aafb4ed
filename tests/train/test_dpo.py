"""`moe-qlora dpo` end to end: the demo raises held-out accuracy; the reference is the step-0 policy (lora.init_from
included), scored once, kept with a fingerprint, reused on resume and recomputed when what it depends on changes;
exact resume after SIGKILL; two DDP ranks reproduce one process; plot, check-norms and the config checks."""

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from safetensors.torch import load_file

from moe_qlora.config.load import load_config
from moe_qlora.model.build import build_policy, load_tokenizer
from moe_qlora.model.distributed import SINGLE
from moe_qlora.train import reference as reference_module
from moe_qlora.train.reference import LOGPS_FILE, REFERENCE_DIR, reference_fingerprint, reference_logps

from helpers.crash import assert_same_run, cli_command, kill_after_steps, run_cli, torchrun

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "dpo-demo.yaml"
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen")
STEPS, SAVE_EVERY = 10, 3


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def config_file(tmp_path: Path, name: str, **changes) -> Path:
    """The demo's config with `changes` merged into its sections (paths made absolute)."""
    cfg = yaml.safe_load(DEMO.read_text())
    cfg["data"]["train_files"] = [str(ROOT / "data" / "demo_dpo.jsonl")]
    cfg["output"]["dir"] = str(tmp_path / name)
    for section, values in changes.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def moe_qlora(*args, env, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_qlora", *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def demo(env, tmp_path_factory):
    """configs/dpo-demo.yaml as shipped, from the CLI."""
    out = tmp_path_factory.mktemp("dpo-demo")
    proc = moe_qlora("dpo", "--config", DEMO, "--set", f"output.dir={out}", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_the_demo_raises_held_out_accuracy_well_above_chance(demo):
    out, proc = demo
    rows = records(out)
    evals = [r for r in rows if "eval_rewards/accuracies" in r]
    assert [r["step"] for r in evals] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert evals[-1]["eval_rewards/accuracies"] >= 0.9, [r["eval_rewards/accuracies"] for r in evals]
    assert evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"] > 0
    assert all(key in r for r in rows for key in TRL_METRICS)
    assert "reference: scored 80 pairs with the step-0 policy" in proc.stdout
    assert "eval: 16 preference pairs held out" in proc.stdout


def test_plot_check_norms_and_export_take_the_dpo_run(demo, env):
    out, _ = demo
    proc = moe_qlora("plot", out, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"rewards.png", "accuracy.png", "logps.png", "loss.png"} <= {p.name for p in (out / "plots").iterdir()}
    assert moe_qlora("check-norms", out / "adapter", env=env).returncode == 0
    exported = moe_qlora("export", out / "adapter", "--format", "gguf", "--out", out / "adapter.gguf", env=env)
    assert exported.returncode == 0 and (out / "adapter.gguf").stat().st_size > 0, exported.stderr[-2000:]


def test_the_first_step_starts_at_the_reference_with_an_sft_adapter(demo_run, env, tmp_path):
    """SFT, then DPO from its adapter: the reference is the policy with that adapter, so the first step's
    rewards (beta x the policy's log-ratio to the reference) are zero up to fp32 noise, where a reference from
    the base alone would put them far from it."""
    init = {"init_from": str(demo_run.out / "adapter"), "dropout": 0.0}
    config = config_file(
        tmp_path, "sft-then-dpo", lora=init, train={"max_steps": 1, "eval_every": 0, "warmup_steps": 0}
    )
    proc = moe_qlora("dpo", "--config", config, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (first,) = records(tmp_path / "sft-then-dpo")
    assert abs(first["rewards/chosen"]) < 1e-5 and abs(first["rewards/rejected"]) < 1e-5, first
    cfg = load_config(config)
    model_path, tok = load_tokenizer(cfg.model)
    base_cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"init_from": None})})
    stored = load_file(str(tmp_path / "sft-then-dpo" / REFERENCE_DIR / LOGPS_FILE))
    base = scored(base_cfg, model_path, tok, tmp_path / "base")
    assert float((base.chosen - stored["chosen"]).abs().max()) > 1.0  # the control: the adapter matters


def scored(cfg, model_path, tok, out: Path):
    """The reference scores of every demo pair under `cfg`'s step-0 policy, computed afresh into `out`."""
    from moe_qlora.data.preference import build_pairs

    model = build_policy(cfg.model, cfg.lora, model_path, Console(quiet=True), seed=0)[0]
    pairs, _ = build_pairs(cfg.data, tok)
    cfg = cfg.model_copy(update={"output": cfg.output.model_copy(update={"dir": str(out)})})
    key = reference_fingerprint(cfg, model_path, pairs)
    return reference_logps(model, pairs, key, cfg, tok.pad_token_id, SINGLE, Console(quiet=True))


def test_the_stored_reference_is_reused_and_recomputed_when_what_it_depends_on_changes(tmp_path, monkeypatch):
    cfg = load_config(config_file(tmp_path, "cache"))
    model_path, tok = load_tokenizer(cfg.model)
    first = scored(cfg, model_path, tok, tmp_path / "out")
    calls = []
    real = reference_module.score_pairs
    monkeypatch.setattr(reference_module, "score_pairs", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = scored(cfg, model_path, tok, tmp_path / "out")
    assert calls == [] and torch.equal(again.chosen, first.chosen) and torch.equal(again.rejected, first.rejected)
    longer = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_seq_len": 20})})  # cuts completions
    scored(longer, model_path, tok, tmp_path / "out")
    assert calls == [1]
    other_lora = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"rank": 4})})
    scored(other_lora, model_path, tok, tmp_path / "out")
    assert calls == [1, 1]
    (tmp_path / "out" / REFERENCE_DIR / LOGPS_FILE).write_bytes(b"torn")  # a damaged file is recomputed too
    scored(other_lora, model_path, tok, tmp_path / "out")
    assert calls == [1, 1, 1]
    ld = other_lora.model_copy(update={"dpo": other_lora.dpo.model_copy(update={"ld_alpha": 0.0})})
    scored(ld, model_path, tok, tmp_path / "out")  # LD-DPO's sums are other scores (tests/train/test_dpo_loss.py)
    assert calls == [1, 1, 1, 1]


# ------------------------------------------------------------------------------- resume and ranks

RESUMED = {
    "train": {"max_steps": STEPS, "save_every": SAVE_EVERY, "eval_every": 5, "seed": 3},
    "lora": {"dropout": 0.1},
}


def history(out: Path):
    return [(r["step"], r["loss"], r["rewards/margins"], r["grad_norm"], r.get("eval_loss")) for r in records(out)]


@pytest.fixture(scope="module")
def uninterrupted(env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo-whole")
    config = config_file(tmp, "whole", **RESUMED)
    proc = run_cli("dpo", config, tmp / "whole", env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return config, tmp / "whole"


def test_sigkill_at_a_random_step_then_resume_is_exact_and_reuses_the_reference(uninterrupted, env, tmp_path):
    config, reference_run = uninterrupted
    kill_after = random.Random(2).randint(SAVE_EVERY + 1, STEPS - 2)
    assert kill_after_steps(cli_command("dpo", config, tmp_path), env, tmp_path, kill_after) < STEPS
    proc = run_cli("dpo", config, tmp_path, env, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "log-probabilities reused" in proc.stdout
    assert_same_run(tmp_path, reference_run, history)


COMMON = {"data": {"eval_fraction": 0.3}, "lora": {"dropout": 0.0}}


@pytest.fixture(scope="module")
def single_dpo(env, tmp_path_factory):
    """One process accumulating 2 micro-batches of 8 pairs a step."""
    tmp = tmp_path_factory.mktemp("dpo-single")
    single = config_file(tmp, "single", train={**RESUMED["train"], "grad_accum": 2}, **COMMON)
    proc = moe_qlora("dpo", "--config", single, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "single"


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "ep"])
def test_two_ranks_reproduce_one_process(single_dpo, env, tmp_path, layout):
    """Two ranks of 8 pairs a micro-batch against one process accumulating 2 micro-batches of 8: the same global
    batch, so the same steps (no dropout: the ranks draw from their own generators), under ddp, fsdp (the model
    sharded) and ep (the experts split, the rest FSDP2-sharded: train.ep_dense: fsdp). 56 pairs train: each
    epoch's fourth step has 8, all on rank 0, so rank 1 joins its collectives with none (under fsdp and ep with a
    pair whose loss counts 0: every rank runs each forward, the reference's scoring and the eval's too)."""
    train = {**RESUMED["train"], "parallel": layout, **({"ep_dense": "fsdp"} if layout == "ep" else {})}
    config = config_file(tmp_path, "two", train=train, **COMMON)
    two = torchrun(["dpo", "--config", str(config)], {**env, "OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    assert f"data parallel ({layout}): 2 ranks x micro_batch_size 8, global batch 16" in two.stdout
    a, b = records(single_dpo), records(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["pairs"] for r in a][:4] == [16, 16, 16, 8]
    for x, y in zip(a, b, strict=True):
        assert x["pairs"] == y["pairs"]
        for key in ("loss", *TRL_METRICS):
            assert abs(x[key] - y[key]) <= 1e-5 * max(1.0, abs(x[key])), (key, x[key], y[key])
    ra, rb = (load_file(str(r / REFERENCE_DIR / LOGPS_FILE)) for r in (single_dpo, tmp_path / "two"))
    assert max(float((ra[k] - rb[k]).abs().max()) for k in ra) <= 1e-4  # each rank scored its share


# ------------------------------------------------------------------------------- the config


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"dpo": None}, "no `dpo:` section"),
        ({"data": {"packing": True}}, "data.packing is not for `moe-qlora dpo`"),
        ({"dpo": {"loss_type": "hinge", "label_smoothing": 0.1}}, "label_smoothing enters"),
        ({"dpo": {"loss_type": "ipo", "simpo_gamma": 1.0}}, "simpo_gamma is SimPO's margin"),
        ({"train": {"optimizer_in_backward": True, "max_grad_norm": 0.0}}, "train.optimizer_in_backward is not for"),
        ({"train": {"objective": "rwsft"}}, "train.objective: rwsft is not for `moe-qlora dpo`"),
        ({"data": {"format": "messages"}}, "data.format: messages is not for `moe-qlora dpo`"),
        ({"data": {"train_on_prompt": True}}, "data.train_on_prompt is not for `moe-qlora dpo`"),
        ({"train": {"parallel": "ep", "optimizer": "adamw_8bit"}, "WORLD_SIZE": "2"}, "adamw_8bit keeps bitsandbytes"),
    ],
)
def test_config_refusals_are_one_sentence_before_loading(tmp_path, env, changes, expected):
    cfg = yaml.safe_load(config_file(tmp_path, "bad").read_text())
    world = changes.pop("WORLD_SIZE", "1")  # launched as one of two ranks
    for section, values in changes.items():
        if values is None:
            cfg.pop(section)
        else:
            cfg[section] = {**cfg.get(section, {}), **values}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = moe_qlora("dpo", "--config", path, "--dry-run", env={**env, "WORLD_SIZE": world}, timeout=120)
    assert proc.returncode == 2 and expected in " ".join(proc.stderr.split()), proc.stderr
    assert "Traceback" not in proc.stderr


def test_held_out_accuracy_measures_the_trained_preference_and_its_reverse_control(env, tmp_path):
    """eval_files: 16 pairs never trained on. Trained on the other 64 as given, the held-out accuracy is high;
    trained on them with chosen and rejected swapped (the broken control), it falls towards 0."""
    rows = [json.loads(line) for line in (ROOT / "data" / "demo_dpo.jsonl").read_text().splitlines()]
    held, train = rows[64:], rows[:64]
    swapped = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in train]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    accuracy = {}
    for name, data in (("as-given", train), ("swapped", swapped)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        files = {"train_files": [str(tmp_path / f"{name}.jsonl")], "eval_files": [str(tmp_path / "held.jsonl")]}
        config = config_file(tmp_path, name, data={**files, "eval_fraction": 0.0}, train={"max_steps": 16})
        proc = moe_qlora("dpo", "--config", config, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        accuracy[name] = records(tmp_path / name)[-1]["eval_rewards/accuracies"]
    assert accuracy["as-given"] >= 0.9 and accuracy["swapped"] <= 0.1, accuracy


def test_the_dry_run_prints_a_config_that_loads_back(tmp_path, env):
    """The resolved config (the per-type defaults filled in) is a valid config itself, for every loss type."""
    for loss_type in ("sigmoid", "simpo", "orpo"):
        proc = moe_qlora("dpo", "--config", DEMO, "--dry-run", "--set", f"dpo.loss_type={loss_type}", env=env)
        assert proc.returncode == 0, proc.stderr
        printed = tmp_path / f"{loss_type}.yaml"
        printed.write_text(proc.stdout)
        cfg = load_config(printed)
        assert cfg.dpo.loss_type == loss_type and cfg.dpo.beta == (2.0 if loss_type == "simpo" else 0.1)
        assert cfg.dpo.nll_weight == (1.0 if loss_type == "orpo" else 0.0)


def test_a_resume_without_the_stored_reference_scores_it_again_from_the_step_0_policy(uninterrupted, env, tmp_path):
    """The reference is scored before the checkpoint is restored: deleting it mid-run and resuming gives the
    uninterrupted run's every loss and its adapter, tensor for tensor."""
    config, reference_run = uninterrupted
    assert kill_after_steps(cli_command("dpo", config, tmp_path), env, tmp_path, SAVE_EVERY + 1) < STEPS
    shutil.rmtree(tmp_path / REFERENCE_DIR)
    proc = run_cli("dpo", config, tmp_path, env, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "scored 80 pairs with the step-0 policy" in proc.stdout
    assert_same_run(tmp_path, reference_run, history)
