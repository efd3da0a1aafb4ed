"""What a GRPO rollout costs: one `moe-qlora grpo` step split into generation, scoring and the policy update, and
its generation against transformers `generate` + bitsandbytes 4-bit + PEFT on the same checkpoint.

    python scripts/bench_rollout.py                     # builtin:tiny-mixtral, 4 prompts x 8, 32 new tokens, CPU
    python scripts/bench_rollout.py --prompts 8 --group-size 16 --max-new-tokens 64 --json out.json
    python scripts/bench_rollout.py --preset qwen3 --prompts 8 --group-size 8 --max-new-tokens 128   # Qwen3-MoE-like
    python scripts/bench_rollout.py --device cuda --model /path/to/checkpoint --steps 3
    python scripts/bench_rollout.py --model /path/to/checkpoint --threads 16   # a real model on a quiet CPU

The run is configs/grpo-demo.yaml (its LoRA, optimizer, sampling) with the model, device, group size and
max_new_tokens given here; the prompts are the demo's parity rows, cycled to --prompts; the rewards are the demo's
plus a dense one (REWARDS), so that groups are not flat and the update has rows to train. Each contender runs in a
subprocess of its own, one warm-up step then --steps timed ones (the median reported), seeded alike:

  moe-qlora             the policy `moe-qlora grpo` trains (model.build.load_policy): experts NF4 in moe-qlora's stacks
                        (double-quantized scales as configured) with its expert LoRA, attention as bitsandbytes NF4
                        Linear4bit with PEFT LoRA, gradient checkpointing as configured, MoE kernels model.kernels
                        (auto: the torch reference on the CPU). A step is grpo.grpo_step itself, its time split as:
                          generation  rollout.sample_rollouts (transformers `generate` on this model, KV cache):
                                      grpo_step's generation_s less the time inside the reward functions
                          scoring     the time inside the reward functions (each wrapped in a timer)
                          update      the rest: advantages, grpo.policy_update (forward, backward, optimizer
                                      step) and the step's metrics
  transformers+bnb+peft `AutoModelForCausalLM.from_pretrained` with BitsAndBytesConfig nf4 (the attention linears
                        NF4; bitsandbytes quantizes nn.Linear only, so the fused 3D experts stay dense in the compute
                        dtype), PEFT LoRA of the same rank on the same linears and on the experts
                        (target_parameters). Generation only: `model.generate` on the same left-padded prompt ids
                        with rollout.generation_config (same sampling settings, num_return_sequences = group size).
  transformers+bnb      the same without PEFT: what the LoRA wrappers cost `generate` (--only to leave it out).

Both compute in model.compute_dtype (fp32 on the CPU, bf16 on CUDA). Tokens/s counts completion tokens (through
the first EOS, as rollout.completion_end cuts them); `generate` computes every row until the last one stops,
reported as decode steps. Prints a table per question and one JSON line; --json writes the same JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_presets import PRESETS, ensure_checkpoint  # noqa: E402
from worker_runs import emit, run_worker  # noqa: E402

CONTENDERS = ["moe-qlora", "transformers+bnb+peft", "transformers+bnb"]
PHASES = ("generation", "scoring", "update")
# The demo's rewards plus a dense one (the share of printable ASCII). exact_match alone scores a random model's
# multi-token completions 0 everywhere: every group flat, every advantage 0, and policy_update then runs no row.
REWARDS = (
    "[{function: exact_match, weight: 1.0}, {function: regex, args: {pattern: '[01]', mode: fullmatch}, "
    "weight: 0.0}, {function: regex, args: {pattern: '[ -~]', mode: share}, weight: 1.0}]"
)


# ------------------------------------------------------------------------------------------ the shared setup


def write_prompts(path: Path, count: int) -> Path:
    """The demo's parity prompt rows ({prompt, answer}), cycled to `count` rows."""
    rows = (ROOT / "data" / "demo_grpo_parity.jsonl").read_text().splitlines()
    path.write_text("".join(rows[i % len(rows)] + "\n" for i in range(count)))
    return path


def bench_config(args):
    """configs/grpo-demo.yaml with this benchmark's model, device, prompts and group shape."""
    from moe_qlora.config.load import load_config

    sets = {
        "model.name_or_path": args.model,
        "model.device": args.device,
        "data.train_files": f"[{args.prompts_file}]",
        "data.max_seq_len": args.max_new_tokens + 64,
        "grpo.prompts_per_step": args.prompts,
        "grpo.group_size": args.group_size,
        "grpo.max_new_tokens": args.max_new_tokens,
        "train.micro_batch_size": args.prompts * args.group_size,
        "grpo.rewards": REWARDS,
        "output.dir": str(Path(args.prompts_file).parent / "out"),
    }
    return load_config(ROOT / "configs" / "grpo-demo.yaml", [f"{k}={v}" for k, v in sets.items()])


def clock(device: str) -> float:
    """perf_counter after the device's queued work is done."""
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter()


def compute_dtype(cfg) -> torch.dtype:
    from moe_qlora.config.sections import resolve_compute_dtype

    return getattr(torch, resolve_compute_dtype(cfg.model.compute_dtype, cfg.model.device))


def bytes_by_kind(model) -> dict[str, float]:
    """MiB of parameters by kind; the dense 3D expert stacks transformers + bitsandbytes leave counted apart."""
    from moe_qlora.model.loaded_model import parameter_bytes_by_kind

    kinds = parameter_bytes_by_kind(model)
    if not kinds["experts_nf4"]:
        dense = sum(
            p.numel() * p.element_size() for n, p in model.named_parameters() if p.dim() == 3 and "lora" not in n
        )
        kinds["experts_dense"], kinds["other"] = dense, kinds["other"] - dense
    return {k: round(v / 2**20, 2) for k, v in kinds.items()}


def median_index(values: list[float]) -> int:
    """Index of the median (the lower one of an even count): the call reported, robust to a busy machine."""
    return sorted(range(len(values)), key=values.__getitem__)[(len(values) - 1) // 2]


def generation_record(
    name: str, seconds: list[float], tokens: list[int], i: int, sequences: int, decode_steps: int
) -> dict:
    """Generation figures of one contender: call `i` of its timed calls (seconds, completion tokens), all listed."""
    return {
        "contender": name,
        "sequences": sequences,
        "tokens": tokens[i],
        "decode_steps": decode_steps,
        "generation_s": round(seconds[i], 4),
        "tokens_per_s": round(tokens[i] / seconds[i], 1),
        "tokens_all": tokens,
        "generation_s_all": [round(s, 4) for s in seconds],
    }


# ------------------------------------------------------------------------------------------ moe-qlora


class RewardClock:
    """Seconds spent inside a RolloutSource's reward functions: each one wrapped, the source's list replaced."""

    def __init__(self, source):
        self.seconds = 0.0
        source.functions = [dataclasses.replace(f, fn=self.timed(f.fn)) for f in source.functions]

    def timed(self, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        return call


class PolicyBench:
    """The GRPO run's pieces as `_grpo` builds them (prompts, policy, optimizer, schedule); `step()` runs
    grpo.grpo_step on the same prompt batch and splits its time into the three phases."""

    def __init__(self, cfg, steps: int):
        from rich.console import Console

        from moe_qlora.model.build import load_policy, load_tokenizer
        from moe_qlora.train.optim import build_optimizer
        from moe_qlora.train.position import StepContext
        from moe_qlora.train.rollout import RolloutSource
        from moe_qlora.train.runs import seed_everything
        from moe_qlora.train.schedule import lr_schedule

        console = Console(stderr=True)
        seed_everything(cfg.train.seed)
        t = time.perf_counter()
        model_path, tokenizer = load_tokenizer(cfg.model)
        self.source = RolloutSource(cfg, tokenizer, console)
        model, params, _ = load_policy(cfg, model_path, console)
        self.load_s = time.perf_counter() - t
        seed_everything(cfg.train.seed)
        optimizer = build_optimizer(params, cfg.train)
        self.training = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": lr_schedule(optimizer, cfg.train, total_updates=(steps + 1) * cfg.grpo.passes),
        }
        self.rewards = RewardClock(self.source)
        self.batch, self.device, self.steps_done = self.source.items[: cfg.grpo.prompts_per_step], cfg.model.device, 0
        self.context = StepContext(cfg.train)
        model.train()

    def step(self) -> tuple[dict[str, float], dict]:
        """(seconds per phase and of the whole step, grpo_step's metrics). grpo_step's own generation_s covers
        sampling and scoring; the reward functions' time is taken out of it as scoring, and the rest of the step
        (advantages, policy_update, the step's metrics) is the update."""
        from moe_qlora.train.grpo import grpo_step

        self.steps_done += 1
        self.context.position.start(self.steps_done)
        self.rewards.seconds = 0.0
        t0 = clock(self.device)
        record = grpo_step(self.source, self.batch, self.training, None, self.context)
        step_s = clock(self.device) - t0
        scoring = self.rewards.seconds
        phases = {
            "generation": record["generation_s"] - scoring,
            "scoring": scoring,
            "update": step_s - record["generation_s"],
        }
        return {**phases, "step": step_s}, record


def policy_worker(cfg, steps: int) -> dict:
    """Load the policy, run one warm-up step and `steps` timed ones; generation figures and the phase split."""
    from moe_qlora.common.memory import peak_rss_mib
    from moe_qlora.model.kernel_choice import resolve_kernels

    bench = PolicyBench(cfg, steps)
    bench.step()
    timed = [bench.step() for _ in range(steps)]
    times = {k: [t[k] for t, _ in timed] for k in (*PHASES, "step")}
    m = median_index(times["step"])
    split, record = timed[m]
    tokens = [r["completion_tokens_total"] for _, r in timed]
    sequences = len(bench.batch) * cfg.grpo.group_size
    # sample_rollouts keeps no padded length: the longest completion, a lower bound of generate's decode steps
    decode = int(record["completion_tokens"]["max"])
    step_s = split["step"]
    phases = {k: {"s": round(split[k], 6), "share": round(split[k] / step_s, 4)} for k in PHASES}
    return {
        **generation_record("moe-qlora", times["generation"], tokens, m, sequences, decode),
        "compute_dtype": str(compute_dtype(cfg)).removeprefix("torch."),
        "load_s": round(bench.load_s, 2),
        "kernels": resolve_kernels(cfg.model.kernels, cfg.model.device, compute_dtype(cfg)),
        "step_s": round(step_s, 6),
        "step_s_all": [round(s, 6) for s in times["step"]],
        "phases": phases,
        "sequences_trained": record["sequences_trained"],
        "reward_mean": record["reward_mean"],
        "param_mib": bytes_by_kind(bench.training["model"]),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


# ------------------------------------------------------------------------------------------ transformers


def load_transformers(cfg, model_path: str, dtype: torch.dtype, *, lora: bool, experts: str | None):
    """The checkpoint through transformers + bitsandbytes NF4 (nn.Linear only), with PEFT LoRA on what
    moe-qlora adapts (the family's linears and the experts' 3D stacks) when `lora`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from moe_qlora.model.families import resolve_targets

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_use_double_quant=cfg.model.linear_double_quant,
    )
    placement = {"device_map": {"": cfg.model.device}} if cfg.model.device != "cpu" else {}
    chosen = {"experts_implementation": experts} if experts else {}
    model = AutoModelForCausalLM.from_pretrained(
        model_path, quantization_config=quant, dtype=dtype, **placement, **chosen
    )
    implementation = getattr(model.config, "_experts_implementation", None) or "eager"
    model.requires_grad_(False)  # frozen, as under PEFT (and parameter_bytes_by_kind counts trainables as LoRA)
    if not lora:
        return model, implementation
    stacks = sorted({re.sub(r"^.*\.layers\.\d+\.", "", n) for n, p in model.named_parameters() if p.dim() == 3})
    config = LoraConfig(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=resolve_targets(model, cfg.lora.target_modules) or [],
        target_parameters=stacks if cfg.lora.experts else None,
    )
    torch.manual_seed(cfg.train.seed)
    return get_peft_model(model, config), implementation


def transformers_worker(cfg, name: str, steps: int, experts: str | None) -> dict:
    """Load, then time `model.generate` on the GRPO prompts: one warm-up call and `steps` timed ones."""
    from moe_qlora.common.memory import peak_rss_mib
    from moe_qlora.model.build import load_tokenizer
    from moe_qlora.train.rollout import completion_end, generation_config, left_pad, load_prompts
    from moe_qlora.train.runs import seed_everything

    g, dtype = cfg.grpo, compute_dtype(cfg)
    seed_everything(cfg.train.seed)
    t = time.perf_counter()
    model_path, tokenizer = load_tokenizer(cfg.model)
    prompts = load_prompts(cfg.data, tokenizer, g.max_new_tokens)[0][: g.prompts_per_step]
    model, implementation = load_transformers(cfg, model_path, dtype, lora=name.endswith("peft"), experts=experts)
    load_s = time.perf_counter() - t
    model.eval()
    ids, mask = left_pad([p.ids for p in prompts], tokenizer.pad_token_id)
    ids, mask = ids.to(cfg.model.device), mask.to(cfg.model.device)
    gen_cfg = generation_config(g, tokenizer)
    torch.manual_seed(cfg.train.seed)
    seconds, tokens, widths = [], [], []
    for i in range(steps + 1):
        t0 = clock(cfg.model.device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg, tokenizer=tokenizer)
        t1 = clock(cfg.model.device)
        generated = out[:, ids.shape[1] :].tolist()
        if i:
            seconds.append(t1 - t0)
            tokens.append(sum(completion_end(row, tokenizer, tokenizer.eos_token_id, g.stop) for row in generated))
            widths.append(len(generated[0]))
    m = median_index(seconds)
    return {
        **generation_record(name, seconds, tokens, m, len(generated), widths[m]),
        "compute_dtype": str(dtype).removeprefix("torch."),
        "load_s": round(load_s, 2),
        "experts_implementation": implementation,
        "param_mib": bytes_by_kind(model),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


# ------------------------------------------------------------------------------------------ the driver


def run_contender(name: str, args, timeout: float | None = None) -> dict:
    """Contender `name` in a subprocess of its own, for at most `timeout` seconds: its figures, or why not."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        name,
        "--prompts-file",
        str(args.prompts_file),
        "--model",
        args.model,
        "--device",
        args.device,
        "--prompts",
        str(args.prompts),
        "--group-size",
        str(args.group_size),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
    ]
    cmd += ["--hf-experts", args.hf_experts] if args.hf_experts else []
    run = run_worker(cmd, timeout=timeout, env=env, cwd=ROOT)
    if run.error is not None or not run.records:
        return {"contender": name, "error": run.error or "handed over no figures"}
    return run.records[-1]


def contender_timeout(budget_s: float | None, start: float, contenders_left: int) -> float | None:
    """An equal share of what is left of `budget_s` (None: no limit); what one contender leaves goes to the next."""
    if budget_s is None:
        return None
    return max(0.0, budget_s - (time.monotonic() - start)) / contenders_left


def holds(r: dict) -> str:
    """What a contender's experts are stored as, from its parameter bytes."""
    pm = r["param_mib"]
    if pm.get("experts_nf4"):
        return f"NF4 experts {pm['experts_nf4']:.2f} MiB (kernels {r['kernels']})"
    return f"dense experts {pm.get('experts_dense', 0):.2f} MiB ({r['experts_implementation']})"


def print_tables(results: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    title = (
        f"{args.model} on {args.device}, {args.threads} threads: generation of {args.prompts} prompts x "
        f"{args.group_size} completions, max_new_tokens {args.max_new_tokens}; the median of {args.steps} calls "
        "after a warm-up"
    )
    table = Table(title=title)
    for col in (
        "contender",
        "dtype",
        "holds",
        "sequences",
        "tokens",
        "decode steps",
        "gen s / call",
        "tokens/s",
        "vs ours",
        "peak RSS MiB",
        "load s",
    ):
        table.add_column(col, justify="right")
    ours = next((r for r in results if r["contender"] == "moe-qlora" and "error" not in r), None)
    for r in results:
        if "error" in r:
            table.add_row(r["contender"], "", "error: " + r["error"][:100], *[""] * 8)
            continue
        ratio = f"{r['tokens_per_s'] / ours['tokens_per_s']:.2f}x" if ours else "-"
        table.add_row(
            r["contender"],
            r["compute_dtype"],
            holds(r),
            str(r["sequences"]),
            str(r["tokens"]),
            str(r["decode_steps"]),
            f"{r['generation_s']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            ratio,
            f"{r['peak_rss_mib']:.0f}",
            f"{r['load_s']:.1f}",
        )
    console.print(table)
    if ours is None:
        return
    trained = f"the update trained {ours['sequences_trained']} of {ours['sequences']} sequences"
    split = Table(title=f"moe-qlora GRPO step: where {ours['step_s']:.3f} s go (the median of {args.steps}; {trained})")
    for col in ("phase", "s", "share"):
        split.add_column(col, justify="right")
    for k, v in ours["phases"].items():
        split.add_row(k, f"{v['s']:.3f}", f"{v['share']:.1%}")
    split.add_row("step", f"{ours['step_s']:.3f}", f"{sum(v['share'] for v in ours['phases'].values()):.1%}")
    console.print(split)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model", default="builtin:tiny-mixtral", help="a builtin:tiny-* model or a local checkpoint")
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="bench_train.py's model of this preset (random weights, generated once into the cache) as --model",
    )
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (the demo's rows, cycled)")
    ap.add_argument("--group-size", type=int, default=8, help="completions sampled per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (generate calls) after one warm-up")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of each contender. 1: the tiny model's ops gain nothing from more, and on a "
        "busy machine a second thread makes every op wait for a core (10-100x slower); raise it for a "
        "real checkpoint on a quiet machine",
    )
    ap.add_argument("--only", nargs="*", choices=CONTENDERS, default=CONTENDERS)
    ap.add_argument(
        "--hf-experts",
        choices=["eager", "grouped_mm", "batched_mm"],
        help="transformers' experts_implementation (default: its own choice)",
    )
    ap.add_argument("--json", type=Path, help="also write the results here (rewritten after each contender)")
    ap.add_argument(
        "--budget-s",
        type=float,
        help="seconds for the whole run, the checkpoint included: each contender is given an equal share of what "
        "is left, and one still running at its share's end is stopped and said not measured (default: no limit)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        import logging

        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
        torch.set_num_threads(args.threads)
        cfg = bench_config(args)
        run = (
            policy_worker(cfg, args.steps)
            if args.worker == "moe-qlora"
            else transformers_worker(cfg, args.worker, args.steps, args.hf_experts)
        )
        emit(run)
        return
    start = time.monotonic()
    if args.preset:
        args.model = str(ensure_checkpoint(args.preset, args.device))  # drawn on the GPU: seconds, not minutes
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        args.prompts_file = write_prompts(Path(tmp) / "prompts.jsonl", args.prompts)
        for i, name in enumerate(args.only):
            results.append(run_contender(name, args, contender_timeout(args.budget_s, start, len(args.only) - i)))
            save(args, results)
    print_tables(results, args)
    payload = save(args, results)
    print(json.dumps(payload))
    if any("error" in r for r in results):
        sys.exit(1)


def save(args, results: list[dict]) -> dict:
    """The run's JSON (to --json, atomically, after every contender: a stage stopped by its timeout keeps what
    was measured)."""
    payload = {
        "model": args.model,
        "device": args.device,
        "prompts": args.prompts,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "steps": args.steps,
        "threads": args.threads,
        "budget_s": args.budget_s,
        "torch": torch.__version__,
        "results": results,
    }
    if args.json:
        from moe_qlora.common.fileio import atomic_write_text

        atomic_write_text(args.json, json.dumps(payload, indent=2))
    return payload


if __name__ == "__main__":
    main()
