"""One training step of moe-qlora against transformers + bitsandbytes 4-bit + PEFT, side by side.

    python scripts/bench_train.py                       # issue preset: Mixtral arch, seq 512
    python scripts/bench_train.py --preset qwen3 --seq 1024 --json out.json
    python scripts/bench_train.py --preset qwen3 --seq 1024 --packing   # tokens/s padded vs packed rows
    python scripts/bench_train.py --device cuda --preset qwen3-30b-a3b --seq 4096   # GPU: tokens/s, peak vs plan
    python scripts/bench_train.py --preset qwen3 --seq 1024 --roofline   # CPU: GFLOP/s against torch.mm's, a profile

Each contender runs in its own subprocess (so its peak RSS is its own) on the same generated checkpoint,
the same tokens and the same loss code: a step is forward + backward + AdamW, batch 1, expert LoRA r8,
gradient checkpointing on every layer. On the CPU the contenders take turns, a step each per round (the speed
of a shared machine drifts by 2x over minutes; --sequential runs each one's steps in one block). Reports the
median and least step time, the median over rounds of each contender's time over transformers + PEFT's in the
same round and dtype (x PEFT, paired), peak RSS (VmHWM, loading included) and parameter bytes by kind, as a table and
as JSON. With --device cuda every contender computes in bf16, and
tokens/s and peak torch.cuda.max_memory_reserved are shown against `moe-qlora plan`'s total for the same step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # bench_presets, step_roofline

from bench_presets import PRESETS, ensure_checkpoint  # noqa: E402
from worker_runs import emit, run_worker  # noqa: E402

CONTENDERS = [
    "moe-qlora",
    "moe-qlora-bf16",
    "transformers+bnb+peft",
    "transformers+bnb+peft-fp32",
    "experts4bit-qlora",
    "unsloth",
]
# run by default where installed: experts4bit-qlora (pip install experts4bit-qlora grouped-nf4-gemm), another
# fused-experts QLoRA trainer, bf16 only; Unsloth (CUDA only)
OPTIONAL = {"experts4bit-qlora": "experts4bit_qlora", "unsloth": "unsloth"}
GPU_ONLY = ("unsloth",)
CPU_ONLY = ("moe-qlora-bf16", "transformers+bnb+peft-fp32")  # on a GPU every contender computes in bf16
LORA_RANK = 8  # expert LoRA of every contender (alpha 2r)
PEFT = {"bfloat16": "transformers+bnb+peft", "float32": "transformers+bnb+peft-fp32"}  # by compute dtype


def setup_moe_qlora(path, dtype, double_quant, device="cpu"):
    from moe_qlora.config.sections import LoraSection
    from moe_qlora.model.adapters import attach_adapters, configure_checkpointing
    from moe_qlora.model.kernel_choice import resolve_kernels
    from moe_qlora.model.loading import LoadOptions, load_model
    from moe_qlora.moe.experts import set_moe_kernels

    opts = LoadOptions(
        str(path),
        compute_dtype=dtype,
        expert_double_quant=double_quant,
        linear_double_quant=double_quant,
        device=device,
    )
    model = load_model(opts)
    model = attach_adapters(
        model, LoraSection(rank=LORA_RANK, alpha=2 * LORA_RANK, experts=True, target_modules=[]), seed=0
    )
    # the kernels a run with model.kernels: auto gets (the torch reference on the CPU, Triton / grouped_mm on CUDA)
    set_moe_kernels(model, resolve_kernels("auto", device, dtype))
    configure_checkpointing(model, enabled=True, interval=1)
    return model


def setup_experts4bit(path, dtype, double_quant, device="cpu"):
    """experts4bit-qlora: on a GPU its documented fast path (recipe.prepare_qlora_training: experts streamed into
    NF4, grouped-nf4-gemm's fused grouped kernel with its dgrad kernel, attention projections in NF4, expert LoRA
    only as the others here); on the CPU the same without the CUDA-only kernel, below."""
    if device != "cpu":
        from experts4bit_qlora.recipe import QLoRASetup, prepare_qlora_training

        setup = QLoRASetup(r=LORA_RANK, alpha=2 * LORA_RANK, train_attention=False, attn_4bit=True)
        return prepare_qlora_training(str(path), setup, device=device).model
    return setup_experts4bit_cpu(path, dtype, double_quant)


def setup_unsloth(path, dtype, double_quant, device="cuda"):
    """Unsloth's documented QLoRA path (FastLanguageModel in 4-bit, LoRA on the experts' fused gate_up and down
    projections, its own gradient checkpointing). `unsloth` is imported first, as its documentation asks: it
    patches transformers at import."""
    if device == "cpu":
        raise ValueError("Unsloth trains on CUDA only")
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        str(path), max_seq_length=MAX_SEQ, dtype=dtype, load_in_4bit=True, local_files_only=True
    )
    return FastLanguageModel.get_peft_model(
        model,
        r=LORA_RANK,
        lora_alpha=2 * LORA_RANK,
        target_modules=["gate_up_proj", "down_proj"],
        use_gradient_checkpointing="unsloth",
        random_state=0,
    )


MAX_SEQ = 16384  # the longest sequence a contender is set up for (Unsloth's max_seq_length)


def setup_experts4bit_cpu(path, dtype, double_quant, device="cpu"):
    """experts4bit-qlora's documented path without its CUDA-only grouped kernel: experts streamed into NF4 under
    its ExpertsLoRA (bf16 factors), attention projections in bitsandbytes 4-bit, non-reentrant checkpointing.
    It trains in bf16 only; its experts' double quantization is its own default."""
    from experts4bit_qlora.loader import load_moe_4bit_streaming
    from experts4bit_qlora.lora import quantize_attention_projections_4bit

    from moe_qlora.model.loading import keep_linears_differentiable

    if dtype != torch.bfloat16:
        raise ValueError("experts4bit-qlora trains in bf16 only")
    model, _ = load_moe_4bit_streaming(str(path), device, dtype, LORA_RANK, 2 * LORA_RANK)
    quantize_attention_projections_4bit(model)
    # bitsandbytes' packed CPU kernel drops the gradient through 4-bit linears: off, as moe-qlora's loader does
    keep_linears_differentiable(model)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return model


def setup_peft(path, dtype, double_quant, device="cpu"):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from moe_qlora.model.loading import keep_linears_differentiable

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_use_double_quant=double_quant,
    )
    placement = {"device_map": {"": device}} if device != "cpu" else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(path), quantization_config=quant, dtype=dtype, experts_implementation="grouped_mm", **placement
    )
    lora = LoraConfig(
        r=LORA_RANK,
        lora_alpha=2 * LORA_RANK,
        target_modules=[],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = get_peft_model(model, lora)
    # bitsandbytes' packed CPU kernel drops the gradient through 4-bit linears: off, as moe-qlora's loader does
    keep_linears_differentiable(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def bytes_by_kind(model):
    """parameter_bytes_by_kind, with the other contenders' experts found: experts4bit-qlora's packed uint8 codes
    (parameters) and block scales (buffers) as 4-bit experts, transformers' 3D stacks as dense experts."""
    from moe_qlora.model.loaded_model import parameter_bytes_by_kind

    kinds = parameter_bytes_by_kind(model)
    if kinds["experts_nf4"]:
        return kinds

    def nbytes(named, keep):
        return sum(
            t.numel() * t.element_size() for n, t in named if ".experts." in n and "lora" not in n and keep(n, t)
        )

    codes = nbytes(model.named_parameters(), lambda n, t: t.dtype == torch.uint8)
    scales = nbytes(model.named_buffers(), lambda n, t: "absmax" in n)
    dense = nbytes(model.named_parameters(), lambda n, t: t.dim() == 3 and t.is_floating_point())
    kinds["experts_nf4"], kinds["experts_dense"] = codes + scales, dense
    kinds["other"] -= codes + dense
    return kinds


def device_peaks(device: str) -> dict:
    """Peak device memory of this process since the last reset (CUDA allocator statistics); nothing on the CPU,
    where RSS says it."""
    if device == "cpu":
        return {}
    return {
        "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1),
        "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
    }


def synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def profiled_step(model, batch, loss_chunk: int, optimizer_s: float, vocab: int) -> dict:
    """One more forward and backward under torch.profiler: seconds of self CPU time by category
    (step_roofline.CATEGORIES, matmuls by part: experts, LoRA, attention and router, head), and `optimizer_s`,
    the timed steps' median optimizer step."""
    from step_roofline import categorized

    from moe_qlora.train.sft import token_loss_sum

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        loss, n, _ = token_loss_sum(model, batch, loss_chunk=loss_chunk)
        (loss / n).backward()
    model.zero_grad(set_to_none=True)
    split = {**categorized(prof.events(), rank=LORA_RANK, vocab=vocab), "optimizer": optimizer_s}
    return {k: round(v, 3) for k, v in sorted(split.items(), key=lambda kv: -kv[1])}


SETUPS = {
    "moe-qlora": setup_moe_qlora,
    "moe-qlora-bf16": setup_moe_qlora,
    "transformers+bnb+peft": setup_peft,
    "transformers+bnb+peft-fp32": setup_peft,
    "experts4bit-qlora": setup_experts4bit,
    "unsloth": setup_unsloth,
}


class Contender:
    """One contender loaded in this process: its model, AdamW and batch (seed 0) of `seq` tokens. step() runs and
    times one training step (forward + backward + AdamW, then what the trainer does after every step);
    use_seq() moves to another sequence length with the model loaded once."""

    def __init__(self, name: str, preset: str, seq: int, double_quant: bool, loss_chunk: int, device: str):
        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1)))
        path = ensure_checkpoint(preset, device)
        t0 = time.perf_counter()
        bf16 = device != "cpu" or name in ("moe-qlora-bf16", "transformers+bnb+peft", "experts4bit-qlora")
        self.name, self.preset, self.loss_chunk, self.device = name, preset, loss_chunk, device
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        self.model = SETUPS[name](path, self.dtype, double_quant, device)
        self.load_s = time.perf_counter() - t0
        self.load_peaks = device_peaks(device)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.use_seq(seq)

    def use_seq(self, seq: int) -> None:
        """A fresh batch of `seq` tokens (seed 0), the step records cleared, the device's peak restarted (the
        steps' own peak from here: loading's is reported apart)."""
        ids = torch.randint(10, PRESETS[self.preset]["vocab"], (1, seq), generator=torch.Generator().manual_seed(0))
        ids = ids.to(self.device)
        self.seq, self.batch = seq, {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
        self.losses, self.opt_times = [], []
        if self.device != "cpu":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def step(self) -> float:
        from moe_qlora.common.memory import release_freed_memory
        from moe_qlora.train.sft import token_loss_sum

        synchronize(self.device)
        t = time.perf_counter()
        # the same loss code for every contender
        loss, n, _ = token_loss_sum(self.model, self.batch, loss_chunk=self.loss_chunk)
        (loss / n).backward()
        t_opt = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.opt_times.append(time.perf_counter() - t_opt)
        release_freed_memory()  # what the trainer does after every step, for every contender
        synchronize(self.device)
        self.losses.append(float(loss) / n)
        return time.perf_counter() - t

    def result(self, times: list[float], profile: bool) -> dict:
        """The figures of the timed steps `times` (the warm-up left out), and with `profile` where one more
        step's time goes."""
        from moe_qlora.common.memory import peak_rss_mib

        median_opt = statistics.median(self.opt_times[1:] or self.opt_times)
        peak_rss = peak_rss_mib()  # before the profiled step, whose event records would count in it
        vocab = self.model.config.get_text_config().vocab_size
        where = (
            {"profile_s": profiled_step(self.model, self.batch, self.loss_chunk, median_opt, vocab)} if profile else {}
        )
        step_s = statistics.median(times)
        return {
            **where,
            "contender": self.name,
            "seq": self.seq,
            "compute_dtype": str(self.dtype).removeprefix("torch."),
            "load_s": round(self.load_s, 2),
            "step_s": round(step_s, 3),
            "step_s_min": round(min(times), 3),
            "step_s_all": [round(t, 3) for t in times],
            "tokens_per_s": round(self.seq / step_s, 1),
            "peak_rss_mib": round(peak_rss, 1),
            **device_peaks(self.device),
            **{f"load_{k}": v for k, v in self.load_peaks.items()},
            "param_mib": {k: round(v / 2**20, 1) for k, v in bytes_by_kind(self.model).items()},
            "trainable_params": sum(p.numel() for p in self.params),
            "first_loss": round(self.losses[0], 4),
        }


def worker(name: str, args) -> None:
    """Runs in the subprocess, alone (GPU, or --sequential): load once, then at each of args.seqs time `steps`
    training steps after one warm-up step, each length's figures handed to the driver as soon as they are
    measured (a time limit keeps the lengths done). A length that runs out of device memory says so, and the
    next one still runs."""
    c = Contender(name, args.preset, args.seqs[0], not args.single_quant, args.loss_chunk, args.device)
    for seq in args.seqs:
        _hang_if_asked(name, seq)
        try:
            c.use_seq(seq)
            times = [c.step() for _ in range(args.steps + 1)][1:]
            emit(c.result(times, profile=args.roofline))
        except torch.OutOfMemoryError as exc:
            c.opt.zero_grad(set_to_none=True)
            emit({"contender": name, "seq": seq, "error": f"out of memory: {str(exc).splitlines()[0]}"})


# The tests' stand-in for a contender that never finishes a length: BENCH_TRAIN_HANG_AT=NAME:SEQ makes contender
# NAME wait forever before SEQ (scripts/perf.py's time limits are tested with it).
HANG_AT = "BENCH_TRAIN_HANG_AT"


def _hang_if_asked(name: str, seq: int) -> None:
    if os.environ.get(HANG_AT) == f"{name}:{seq}":
        while True:
            time.sleep(60)


REPLY = "@bench_train "  # starts every line of the turn protocol on a --serve worker's stdout (other lines: not)


def serve(name: str, args) -> None:
    """Runs in the subprocess, in turns with the other contenders: loads, says `ready`, then runs one step for
    each `step` line on stdin (printing its seconds), and for `finish` prints its figures as JSON."""
    c = Contender(name, args.preset, args.seq, not args.single_quant, args.loss_chunk, args.device)
    times = []
    print(REPLY + "ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "step":
            times.append(c.step())
            print(f"{REPLY}{times[-1]:.6f}", flush=True)
        elif line.strip() == "finish":
            print(REPLY + json.dumps(c.result(times[1:], profile=args.roofline)), flush=True)
            return


def spread_rows(seq: int, count: int, vocab: int):
    """`count` rows with an instruction-tuning length spread: log-normal, median seq/5, from 16 to seq tokens;
    the first quarter of each row is prompt (no loss)."""
    from moe_qlora.data.examples import IGNORE, Example

    g = torch.Generator().manual_seed(0)
    lengths = (torch.randn(count, generator=g) * 0.8 + math.log(seq / 5)).exp().clamp(16, seq).long().tolist()
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(10, vocab, (n,), generator=g).tolist()
        rows.append(Example(ids, [IGNORE] * (n // 4) + ids[n // 4 :], f"row:{i}"))
    return rows


def packing_worker(mode: str, preset: str, seq: int, rows_count: int, batch_rows: int, loss_chunk: int) -> dict:
    """One epoch over the same rows: padded micro-batches of `batch_rows` rows, or rows packed into `seq`-token
    sequences (one per micro-batch); an optimizer step per micro-batch. Tokens/s counts real tokens only."""
    from moe_qlora.common.memory import peak_rss_mib, release_freed_memory
    from moe_qlora.data.examples import collate, pack_examples
    from moe_qlora.train.sft import token_loss_sum

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1)))
    model = setup_moe_qlora(ensure_checkpoint(preset), torch.float32, True)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = spread_rows(seq, rows_count, PRESETS[preset]["vocab"])
    if mode == "packed":
        batches = [collate([p], pad_id=0) for p in pack_examples(rows, seq)]
    else:
        batches = [collate(rows[i : i + batch_rows], pad_id=0) for i in range(0, len(rows), batch_rows)]
    real = sum(len(r.input_ids) for r in rows)
    t = time.perf_counter()
    for batch in batches:
        loss, n, _ = token_loss_sum(model, batch, loss_chunk=loss_chunk)
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        release_freed_memory()
    seconds = time.perf_counter() - t
    computed = sum(b["input_ids"].numel() for b in batches)
    return {
        "mode": mode,
        "rows": len(rows),
        "micro_batches": len(batches),
        "real_tokens": real,
        "computed_tokens": computed,
        "padding_share": round(1 - real / computed, 3),
        "seconds": round(seconds, 1),
        "tokens_per_s": round(real / seconds, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def run_packing(args) -> list[dict]:
    results = []
    for mode in ("padded", "packed"):
        cmd = [
            sys.executable,
            __file__,
            "--packing-worker",
            mode,
            "--preset",
            args.preset,
            "--seq",
            str(args.seq),
            "--rows",
            str(args.rows),
            "--batch-rows",
            str(args.batch_rows),
            "--loss-chunk",
            str(args.loss_chunk),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        results.append(
            json.loads(proc.stdout.strip().splitlines()[-1])
            if proc.returncode == 0
            else {"mode": mode, "error": proc.stderr.strip().splitlines()[-1]}
        )
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{args.preset}: {args.rows} rows, log-normal lengths 16..{args.seq} (median "
        f"{args.seq // 5}); padded: {args.batch_rows} rows a micro-batch; packed: {args.seq}-token "
        "sequences"
    )
    for col in ("mode", "micro-batches", "padding", "s / epoch", "tokens/s", "peak RSS MiB"):
        table.add_column(col, justify="right")
    for r in results:
        if "error" in r:
            table.add_row(r["mode"], "error: " + r["error"][:80], "", "", "", "")
            continue
        table.add_row(
            r["mode"],
            str(r["micro_batches"]),
            f"{r['padding_share']:.0%}",
            f"{r['seconds']:.1f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['peak_rss_mib']:.0f}",
        )
    Console(width=150).print(table)
    return results


def worker_command(name: str, args, mode: str) -> list[str]:
    """The subprocess that runs contender `name`: mode `--worker` (alone) or `--serve` (in turns)."""
    cmd = [sys.executable, __file__, mode, name, "--preset", args.preset, "--seq", *map(str, args.seqs)]
    cmd += ["--steps", str(args.steps), "--loss-chunk", str(args.loss_chunk), "--device", args.device]
    return cmd + (["--single-quant"] if args.single_quant else []) + (["--roofline"] if args.roofline else [])


# the environment a user's run has: oneDNN keeps its primitive cache (turned off here until 2026-11-26, which
# cost bf16 steps ~1.8x their time, as every bf16 GEMM rebuilt its kernel, and saved ~400 MiB of peak RSS)
WORKER_ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}


def run_contender(name, args, timeout: float | None = None) -> list[dict]:
    """Contender `name` alone in a subprocess: a result per sequence length it finished, then, if it stopped
    early (an error, or `timeout` seconds passed), one error row per length it did not finish, naming why."""
    run = run_worker(worker_command(name, args, "--worker"), timeout=timeout, env=WORKER_ENV)
    done = {r["seq"] for r in run.records}
    if run.error is None:
        return run.records
    return run.records + [{"contender": name, "seq": seq, "error": run.error} for seq in args.seqs if seq not in done]


class TurnTaker:
    """A contender's `--serve` subprocess, driven a line at a time; its stderr goes to a file (a full pipe would
    block it), whose last line is the error if it dies."""

    def __init__(self, name: str, args, log_dir: Path):
        self.name, self.error = name, None
        self.log = open(log_dir / f"{name}.stderr", "w+")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            worker_command(name, args, "--serve"),
            env=WORKER_ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def ask(self, command: str | None) -> str | None:
        """Send `command` (None: only read) and return the next reply (a stdout line starting with REPLY, without
        it; whatever else a library prints is skipped); None once the process has failed."""
        if self.error is not None:
            return None
        line = ""
        try:
            if command is not None:
                self.proc.stdin.write(command + "\n")
                self.proc.stdin.flush()
            while (line := self.proc.stdout.readline()) and not line.startswith(REPLY):
                pass
        except BrokenPipeError:
            line = ""
        if not line:
            self.proc.wait()
            self.log.seek(0)
            lines = self.log.read().strip().splitlines()
            self.error = lines[-1] if lines else f"exited with {self.proc.returncode}"
            return None
        return line.removeprefix(REPLY).strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def run_in_turns(names: list[str], args) -> list[dict]:
    """The contenders' steps in turns, one process each, all loaded at once (loaded one after the other, so
    load times are their own): round i runs one step of each, starting from contender i mod n. On a shared
    machine whose speed drifts over minutes, every contender then sees the same drift, and each round gives a
    paired ratio (paired_x) that drift cancels from."""
    import tempfile

    with tempfile.TemporaryDirectory() as log_dir:
        takers = []
        try:
            for name in names:
                takers.append(TurnTaker(name, args, Path(log_dir)))
                if takers[-1].ask(None) != "ready" and takers[-1].error is None:
                    takers[-1].error = "did not say it was ready"
            rounds = []
            for i in range(args.steps + 1):
                times = {}
                for t in takers[i % len(takers) :] + takers[: i % len(takers)]:
                    answer = t.ask("step")
                    if answer is not None:
                        times[t.name] = float(answer)
                rounds.append(times)
            results = []
            for t in takers:
                answer = t.ask("finish")
                results.append(json.loads(answer) if answer is not None else {"contender": t.name, "error": t.error})
        finally:
            for t in takers:
                t.close()
    add_paired_ratios(results, rounds[1:])
    return results


def add_paired_ratios(results: list[dict], rounds: list[dict[str, float]]) -> None:
    """paired_x: the median over timed rounds of a contender's step time over its reference's in the same round.
    The reference is transformers + bnb + PEFT, what a user would run instead, in the contender's dtype when that
    runs, else in bf16 (no ratio when neither runs)."""
    names = {r["contender"] for r in results if "error" not in r}
    for r in results:
        if "error" in r:
            continue
        reference = next((PEFT[d] for d in (r.get("compute_dtype"), "bfloat16") if PEFT.get(d) in names), None)
        ratios = [
            times[r["contender"]] / times[reference] for times in rounds if {r["contender"], reference} <= times.keys()
        ]
        if reference is not None and ratios:
            r["paired_x"] = round(statistics.median(ratios), 3)
            r["paired_with"] = reference


def planned_bytes(path: Path, args, seq: int) -> int:
    """`moe-qlora plan`'s total for the step this script times: bf16, batch 1, expert LoRA r8 only, AdamW,
    checkpointing every layer."""
    from moe_qlora.config.load import load_config
    from moe_qlora.model.plan import plan_run

    sets = {
        "model.name_or_path": str(path),
        "model.compute_dtype": "bfloat16",
        "model.device": args.device,
        "model.expert_double_quant": not args.single_quant,
        "model.linear_double_quant": not args.single_quant,
        "lora.target_modules": "[]",
        "data.max_seq_len": seq,
        "train.micro_batch_size": 1,
        "train.grad_accum": 1,
        "train.loss_chunk_tokens": args.loss_chunk,
    }
    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"{k}={v}" for k, v in sets.items()])
    from moe_qlora.model.budget import this_gpu_capability  # the kernels this GPU's `auto` takes

    return plan_run(cfg, name_or_path=str(path), device=args.device, capability=this_gpu_capability()).total


def device_columns(r: dict, plans: dict[int, int], device: str) -> tuple[str, ...]:
    if device == "cpu":
        return ()
    reserved, plan = r["peak_reserved_mib"], plans.get(r["seq"])
    ratio = f"{reserved * 2**20 / plan:.2f}" if plan else "-"
    return f"{r['tokens_per_s']:,.0f}", f"{reserved:,.0f}", ratio, f"{r['load_peak_reserved_mib']:,.0f}"


def paired_column(r: dict) -> str:
    """x PEFT, paired: the ratio, and the reference's dtype where it is not the contender's own."""
    if "paired_x" not in r:
        return "-"
    dtype = next(d for d, name in PEFT.items() if name == r["paired_with"])
    other = "" if dtype == r["compute_dtype"] else f" (vs {dtype.replace('bfloat16', 'bf16')})"
    return f"{r['paired_x']:.3f}{other}"


def print_table(results, args, plans=None):
    from rich.console import Console
    from rich.table import Table

    p = PRESETS[args.preset]
    title = (
        f"{p['arch']}: {p['layers']} layers, {p['experts']} experts top-{p['top_k']}, hidden {p['hidden']}, "
        f"expert intermediate {p['inter']}, vocab {p['vocab']}; batch 1, expert LoRA r8, checkpointing"
    )
    table = Table(title=title)
    device_cols = ("tokens/s", "step peak reserved MiB", "reserved / plan", "load peak reserved MiB")
    device_cols = device_cols if args.device != "cpu" else ()
    for col in (
        "contender",
        "seq",
        "dtype",
        "step s",
        "min s",
        "x PEFT same dtype, paired",
        *device_cols,
        "peak RSS MiB",
        "experts MiB",
        "other 4-bit MiB",
        "LoRA MiB",
        "load s",
    ):
        table.add_column(col, justify="right")
    for r in results:
        if "error" in r:
            seq = str(r.get("seq", ""))
            table.add_row(r["contender"], seq, "", "error: " + r["error"][:60], *[""] * (7 + len(device_cols)))
            continue
        pm = r["param_mib"]
        experts = pm.get("experts_nf4") or pm.get("experts_dense", 0)
        kind = "NF4" if pm.get("experts_nf4") else "dense"
        table.add_row(
            r["contender"],
            str(r["seq"]),
            r["compute_dtype"],
            f"{r['step_s']:.3f}",
            f"{r['step_s_min']:.3f}",
            paired_column(r),
            *device_columns(r, plans or {}, args.device),
            f"{r['peak_rss_mib']:.0f}",
            f"{experts:.1f} {kind}",
            f"{pm['linear_4bit']:.1f}",
            f"{pm['lora']:.1f}",
            f"{r['load_s']:.1f}",
        )
    Console(width=150).print(table)


def roofline(results: list[dict], args) -> dict:
    """The step's limit per dtype (step_roofline.step_limit, in a process of its own), each contender's GFLOP/s
    and time against it, and where its profiled step went; printed, and returned for the JSON."""
    limits = {}
    for dtype in sorted({r["compute_dtype"] for r in results if "error" not in r}):
        cmd = [
            sys.executable,
            __file__,
            "--limit-worker",
            dtype,
            "--preset",
            args.preset,
            "--seq",
            str(args.seq),
            "--loss-chunk",
            str(args.loss_chunk),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        limits[dtype] = json.loads(proc.stdout.strip().splitlines()[-1])
    first = next(iter(limits.values()))
    print(f"step: {first['flops'] / 1e9:.1f} GFLOP (forward, recompute, backward; step_roofline.py counts them)")
    for dtype, lim in limits.items():
        rates = ", ".join(f"{r['kind']} {r['gflops_per_s']:.0f}" for r in lim["products"])
        print(f"{dtype} limit {lim['limit_s']:.3f} s at torch.mm's GFLOP/s per product: {rates}")
    for r in results:
        if "error" in r:
            continue
        lim = limits[r["compute_dtype"]]
        r["gflops_per_s"] = round(lim["flops"] / r["step_s"] / 1e9, 1)
        r["x_limit"] = round(r["step_s"] / lim["limit_s"], 2)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["profile_s"].items())
        print(
            f"{r['contender']:22} {r['compute_dtype']:9} {r['gflops_per_s']:7.1f} GFLOP/s, {r['x_limit']:.2f}x the "
            f"limit; profiled step (s): {parts}"
        )
    return limits


def contenders_for(device: str, names: list[str]) -> list[str]:
    """The contenders of `names` that run on `device`: on a GPU every contender computes in bf16 (the CPU's
    second dtype is left out), Unsloth on a GPU only."""
    leave_out = CPU_ONLY if device != "cpu" else GPU_ONLY
    return [name for name in names if name not in leave_out]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="mixtral")
    ap.add_argument(
        "--seq", type=int, nargs="+", default=[512], help="tokens a step; several on a GPU (each contender loads once)"
    )
    ap.add_argument("--steps", type=int, default=3)
    installed = [c for c in CONTENDERS if c not in OPTIONAL or importlib.util.find_spec(OPTIONAL[c]) is not None]
    ap.add_argument("--only", nargs="*", choices=CONTENDERS, default=installed)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument(
        "--single-quant", action="store_true", help="no double quantization (the default is on, as in QLoRA)"
    )
    ap.add_argument("--loss-chunk", type=int, default=1024, help="train.loss_chunk_tokens (0: full logits)")
    ap.add_argument("--packing", action="store_true", help="tokens/s of padded against packed rows (moe-qlora)")
    ap.add_argument("--rows", type=int, default=48, help="--packing: rows in the dataset")
    ap.add_argument("--batch-rows", type=int, default=4, help="--packing: rows per padded micro-batch")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: bf16, peak device memory")
    ap.add_argument(
        "--roofline", action="store_true", help="CPU: GFLOP/s against torch.mm's at the step's shapes, and a profile"
    )
    ap.add_argument("--limit-worker", help=argparse.SUPPRESS)
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="CPU: each contender's steps in one block, one contender after the other (the default takes turns)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--packing-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.seqs, args.seq = args.seq, args.seq[0]
    if len(args.seqs) > 1 and args.device == "cpu" and not (args.worker or args.sequential):
        ap.error("several --seq lengths run each contender alone: on a GPU, or with --sequential")
    if "unsloth" in (args.worker, args.serve):
        import unsloth  # noqa: F401  (first: it patches transformers at import)
    if (args.worker or args.serve or "").startswith("moe-qlora"):
        from moe_qlora.common.cuda_allocator import choose_cuda_allocator

        choose_cuda_allocator()  # what `moe-qlora train` runs with; the others keep torch's default allocator
    if args.packing_worker:
        import logging

        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
        print(
            json.dumps(
                packing_worker(args.packing_worker, args.preset, args.seq, args.rows, args.batch_rows, args.loss_chunk)
            )
        )
        return
    if args.packing:
        ensure_checkpoint(args.preset)
        results = run_packing(args)
        payload = {
            "preset": args.preset,
            "seq": args.seq,
            "rows": args.rows,
            "batch_rows": args.batch_rows,
            "packing": results,
        }
        print(json.dumps(payload))
        if args.json:
            Path(args.json).write_text(json.dumps(payload, indent=2))
        return
    if args.limit_worker:
        from step_roofline import step_limit

        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1)))
        limit = step_limit(PRESETS[args.preset], args.seq, getattr(torch, args.limit_worker), chunk=args.loss_chunk)
        print(json.dumps(limit))
        return
    if args.worker or args.serve:
        import logging

        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
        if args.serve:
            serve(args.serve, args)
        else:
            worker(args.worker, args)
        return
    path = ensure_checkpoint(args.preset, args.device)
    args.only = contenders_for(args.device, args.only)
    in_turns = args.device == "cpu" and not args.sequential and len(args.only) > 1
    if in_turns:
        results = run_in_turns(args.only, args)
    else:
        results = [r for name in args.only for r in run_contender(name, args)]
    plans = {seq: planned_bytes(path, args, seq) for seq in args.seqs} if args.device != "cpu" else {}
    print_table(results, args, plans)
    limits = roofline(results, args) if args.roofline else {}
    payload = {
        "preset": args.preset,
        "config": PRESETS[args.preset],
        "seq": args.seqs,
        "threads": os.cpu_count(),
        "double_quant": not args.single_quant,
        "loss_chunk": args.loss_chunk,
        "device": args.device,
        "plan_mib": {seq: round(plan / 2**20, 1) for seq, plan in plans.items()},
        "torch": torch.__version__,
        "results": results,
        "roofline": limits,
    }
    print(json.dumps(payload))
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
