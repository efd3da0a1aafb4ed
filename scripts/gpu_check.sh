#!/usr/bin/env bash
# Everything that needs a GPU, in stages that each fit one command of a lent GPU machine (at most 10 minutes):
#     bash scripts/gpu_check.sh --stages          # the stages, each with its command and estimated time
#     bash scripts/gpu_check.sh STAGE [OUT_DIR]   # run one stage; its log and JSON go to OUT_DIR (gpu-check-out)
#     bash scripts/gpu_check.sh all [OUT_DIR]     # every stage in order (a machine without a command limit)
# Each stage is bounded by `timeout` (STAGE_TIMEOUT, 540 s) and prints "PASS|FAIL|TIMEOUT  stage". Run from the
# repository root with the package importable (pip install -e ".[test,gpu]", or on an offline machine the wheels
# of scripts/gpu_wheels.sh: the `wheels` stage installs them). Layers are built and NF4-quantized on the GPU, once
# per shape, and reused across backends, candidates and token counts.
# Nothing a CPU can do runs here: the ahead-of-time compiles and SASS readings (scripts/kernel_report.py,
# tests/moe/test_kernel_report.py), torch.compile (tests/moe/test_compile.py) and the interpreter tests run in CI.
#
# Estimated GPU-machine time per stage (H100, 16 cores; measured on 2026-11-26 where said): `wheels` and
# `preflight` 1 min each (measured together: 15 s); `gpu-tests` 3 min (measured: 63 s; 73 s on an H200; since then the Gluon kernels' 18 cases, each variant compiled once); `kernels` 6 min (each
# distinct constexpr variant compiled once by the JIT, ~2-10 s each); `kernels-parity` 2 min (measured with the
# self-check tests: 75 s); `checks` 4 min (one Qwen3-30B-A3B layer, 3 backends, 8 candidates x 3 token counts,
# ~40 compiles); `offload` 3 min (scripts/bench_offload.py: 6 short training runs, a real-width model built once;
# the demo's and the real-width model's six runs: measured 220 s on an H200); `train-bench` 2 min
# (scripts/bench_train.py: two Qwen3-30B-A3B-wide layers against transformers + bitsandbytes + PEFT, 4096 tokens:
# measured 80 s with the checkpoint built); `bench-qwen3` and `bench-mixtral` 3 min each (6 contenders x 4 token
# counts; Mixtral at 3 token counts measured: about 150 s); `profile` 1 min (scripts/profile_moe.py: measured
# 30 s); `rollout` 4 min (scripts/bench_rollout.py: a GRPO step on four Qwen3-30B-A3B-wide layers, 8 prompts x 16
# completions of 256 tokens, against transformers generate + bitsandbytes + PEFT; not measured yet); `perf` 7 min
# (scripts/perf.py: issue 58's layer, training-step and plan figures in one JSON, within its 420 s budget;
# measured on an H200 on 2026-11-30 with --budget-s 380: 296 s, nothing left out); `sweep` 3 min
# (scripts/sweep_kernels.py: every kernel config and grid order of a layer step at both shapes, 512-16k tokens,
# within its 420 s budget, rows kept as measured; measured at 4096 and 16384 tokens alone: 192 rows in about
# 45 s); `long` 5 min
# (scripts/bench_memory.py --device cuda: two Qwen3-30B-A3B-wide layers at 32,768 and 131,072 tokens held to 80
# GiB, the MoE rows in 8,192-token chunks, the layer inputs kept or on the host: peak reserved against `plan`;
# measured: about 4.5 min for its four rows, 2026-11-30); `gluon` 1 min (scripts/bench_gluon.py: the Gluon NF4
# kernel beside the fused Triton kernel and dequantize + grouped_mm, 4 weights x 2 token counts, each result checked
# first; not measured yet). About 48 minutes in all: more than one session's device
# time (15 minutes), so a session runs the stages it needs most: `wheels`, `preflight` and `perf` first, then
# `sweep`, then `long` (2026-11-30: the first three with the sweep at two token counts in one 372 s call, then
# `gpu-tests` and `long`).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
limit=${STAGE_TIMEOUT:-540}
declare -A command estimate
stages=(wheels preflight perf sweep long gluon gpu-tests kernels kernels-parity checks offload train-bench rollout bench-qwen3 bench-mixtral profile)
# CPU-only tests inside the kernel test files (AOT compiles in a subprocess, the launcher run with a stubbed JIT)
# carry the marker cpu_only (tests/conftest.py marks every user of the AOT fixture).
command[wheels]='if [ -d .whl ]; then '"$python"' -m pip install -q --no-index --no-deps --no-compile --upgrade --target .gpu-site .whl/*.whl; else echo "no .whl/: using the installed packages"; fi'
estimate[wheels]=1
command[preflight]="$python"' -c "import torch, triton, bitsandbytes, transformers, peft, pydantic, gguf, datasets, pytest, xdist, moe_qlora
assert torch.cuda.is_available(), \"no CUDA device\"
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__, \"bitsandbytes\", bitsandbytes.__version__, \"on\", torch.cuda.get_device_name())"'
estimate[preflight]=1
command[gpu-tests]="$python -m pytest -q -n 0 -m gpu tests/moe/test_gpu.py tests/model/test_expert_parallel.py"
estimate[gpu-tests]=3
command[kernels]="$python -m pytest -q -n 0 -m 'not cpu_only' tests/moe/test_kernels.py"
estimate[kernels]=6
command[kernels-parity]="$python -m pytest -q -n 0 tests/moe/test_kernels_parity.py tests/moe/test_self_check.py"
estimate[kernels-parity]=2
command[checks]="$python scripts/gpu_checks.py --json \$OUT/gpu_checks.json"
estimate[checks]=4
command[offload]="$python scripts/bench_offload.py --json \$OUT/offload.json"
estimate[offload]=3
command[train-bench]="$python scripts/bench_train.py --device cuda --preset qwen3-30b-a3b --seq 4096 --json \$OUT/bench_train.json"
estimate[train-bench]=2
command[rollout]="$python scripts/bench_rollout.py --device cuda --preset qwen3-30b-a3b-4l --prompts 8 --group-size 16 --max-new-tokens 256 --steps 1 --budget-s 480 --json \$OUT/bench_rollout.json"
estimate[rollout]=4
command[perf]="$python scripts/perf.py --json \$OUT/perf.json"
estimate[perf]=7
command[sweep]="$python scripts/sweep_kernels.py --budget-s 420 --out \$OUT/sweep.jsonl"
estimate[sweep]=3
command[long]="$python scripts/bench_memory.py --device cuda --gpu-gib 80 --seqs 32768 131072 --configs 'long: MLP chunks of 8192' 'long: MLP chunks of 8192, inputs on the host' --json \$OUT/long.json"
estimate[long]=5
command[gluon]="$python scripts/bench_gluon.py --out \$OUT/gluon.json"
estimate[gluon]=1
command[profile]="$python scripts/profile_moe.py --json \$OUT/profile.json"
estimate[profile]=1
command[bench-qwen3]="$python scripts/bench_moe.py --full --shape qwen3-30b-a3b --json \$OUT/bench_qwen3.json"
estimate[bench-qwen3]=3
command[bench-mixtral]="$python scripts/bench_moe.py --full --shape mixtral-8x7b --json \$OUT/bench_mixtral.json"
estimate[bench-mixtral]=3

list_stages() {
  local total=0
  for s in "${stages[@]}"; do
    printf '%-15s ~%s min   %s\n' "$s" "${estimate[$s]}" "${command[$s]}"
    total=$((total + estimate[$s]))
  done
  echo "total ~$total min, each stage bounded by timeout $limit s"
}

run_stage() {
  local stage=$1
  [ -n "${command[$stage]:-}" ] || { echo "unknown stage: $stage (bash scripts/gpu_check.sh --stages)" >&2; return 2; }
  mkdir -p "$OUT"
  export PYTHONPATH="$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 OUT
  # the commit the figures are of: a lent machine gets the tree without .git, so the caller may pass it
  MOE_QLORA_COMMIT=${MOE_QLORA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
  export MOE_QLORA_COMMIT
  timeout "$limit" bash -c "${command[$stage]}" 2>&1 | tee "$OUT/$stage.log"
  local rc=${PIPESTATUS[0]} verdict=PASS
  [ "$rc" -eq 124 ] && verdict=TIMEOUT
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && verdict=FAIL
  echo "$verdict  $stage" | tee -a "$OUT/verdicts.txt"
  [ "$verdict" = PASS ]
}

case "${1:-}" in
  --stages|"") list_stages ;;
  all)
    OUT=${2:-gpu-check-out}
    failed=0
    for s in "${stages[@]}"; do run_stage "$s" || failed=1; done
    cat "$OUT/verdicts.txt"
    exit $failed ;;
  *) OUT=${2:-gpu-check-out}; run_stage "$1" ;;
esac
