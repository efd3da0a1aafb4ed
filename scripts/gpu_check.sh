#!/usr/bin/env bash
# Everything that needs a GPU, in order, with a verdict per check. Run from the repository root on a CUDA
# machine with the package installed (pip install -e ".[test,gpu]"):   bash scripts/gpu_check.sh [OUT_DIR]
#  1. the gpu-marked tests and the kernel tests, compiled on the GPU (the `dev` fixture picks cuda);
#  2. bench_moe.py --full: Mixtral-8x7B and Qwen3-30B-A3B layers against the H100 roofline;
#  3. gpu_checks.py: host syncs per MoE layer call, two identical steps bit for bit, every autotune candidate
#     bit for bit against the default config, and the live JIT's
#     registers / spills / shared memory per kernel variant.
set -uo pipefail
out="${1:-gpu-check-out}"
mkdir -p "$out"
declare -A verdict
export TRITON_INTERPRET=0
python=${PYTHON:-python3}
# Pre-flight: what the checks import, and a CUDA device. On a machine without internet install the wheels first:
# scripts/gpu_wheels.sh downloads them (elsewhere) and says how to install them there.
if ! "$python" -c "import torch, triton, bitsandbytes, transformers, peft, pydantic, gguf, pytest, moe_qlora
assert torch.cuda.is_available(), 'no CUDA device'
print('torch', torch.__version__, 'triton', triton.__version__, 'on', torch.cuda.get_device_name())"; then
  echo "FAIL  pre-flight: the package and its dependencies must import and torch must see a GPU"; exit 1
fi

"$python" -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log"
verdict[gpu_tests]=$([ "${PIPESTATUS[0]}" -eq 0 ] && echo PASS || echo FAIL)

"$python" -m pytest -q tests/test_kernels.py tests/test_kernels_parity.py tests/test_compile.py 2>&1 | tee "$out/kernel_tests.log"
verdict[kernel_tests_compiled]=$([ "${PIPESTATUS[0]}" -eq 0 ] && echo PASS || echo FAIL)

"$python" scripts/bench_moe.py --full --json "$out/bench_moe.json" 2>&1 | tee "$out/bench_moe.log"
verdict[bench_moe_full]=$([ "${PIPESTATUS[0]}" -eq 0 ] && echo PASS || echo FAIL)

"$python" scripts/kernel_report.py --json > "$out/kernel_report_aot.json"  # the AOT reading, beside the live figures below
"$python" scripts/gpu_checks.py --json "$out/gpu_checks.json" 2>&1 | tee "$out/gpu_checks.log"
verdict[syncs_determinism_live_jit]=$([ "${PIPESTATUS[0]}" -eq 0 ] && echo PASS || echo FAIL)

echo
for check in gpu_tests kernel_tests_compiled bench_moe_full syncs_determinism_live_jit; do
  echo "${verdict[$check]}  $check"
done
[[ " ${verdict[*]} " != *" FAIL "* ]]
