#!/usr/bin/env bash
# Wheels for an offline GPU machine that has torch, triton, numpy, pyarrow, tokenizers and huggingface-hub but
# not this package's other needs (the lent H100/H200 image: Python 3.12, torch 2.11, transformers 5.17, no
# bitsandbytes, pydantic, datasets or gguf). Run here, where pip reaches a registry:
#     bash scripts/gpu_wheels.sh            # -> .whl/ (about 37 MB), ignored by git
# then on the GPU machine, with .whl carried beside the checkout (64 MB may be carried), stage by stage:
#     bash scripts/gpu_check.sh wheels "$OUT" && bash scripts/gpu_check.sh preflight "$OUT"   # then the others
# bitsandbytes' wheel (43 MB) is repacked without the libraries no CUDA 12.6+ torch loads (CUDA 11.8-12.4, ROCm,
# XPU): 20 MB; bitsandbytes picks its library by torch.version.cuda, and torch 2.9+ is built for 12.6 and later.
# Versions are the ones CI tests with (pyproject's test pins, and what the CPU install resolves today), and
# experts4bit-qlora with its grouped-nf4-gemm kernel, a contender of scripts/perf.py (1.1 MB, no other needs).
# Unsloth is not carried: its wheel alone is 28.6 MB (26.0 of them its studio's web assets), it pins
# transformers <= 5.17, trl <= 1.15 and datasets < 5 against the 5.24, 1.16 and 5.2 tested here, and it requires
# xformers, torchao, diffusers and cut_cross_entropy, which the image lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$dest/" "$exclude" 2>/dev/null || echo "/$dest/" >> "$exclude"
rm -rf "$dest" && mkdir -p "$dest"
wheels=(
  transformers==5.24.0 peft==0.21.2 bitsandbytes==0.50.2 gguf==0.19.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  pytest-xdist==3.8.0 execnet==2.1.2
  experts4bit-qlora==0.58.1 grouped-nf4-gemm==0.51.0
)
platforms=()
for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
           manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dest" "${wheels[@]}"
python3 - "$dest"/bitsandbytes-*.whl <<'PY'
import re, sys, zipfile
path = sys.argv[1]
unused = re.compile(r"libbitsandbytes_(cuda1(18|21|24)|rocm\d+|xpu\d+)\.so$")
with zipfile.ZipFile(path) as src:
    members = [(i, src.read(i)) for i in src.infolist() if not unused.search(i.filename)]
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
    for info, data in members:
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True) if not unused.search(line.split(b",")[0].decode()))
        dst.writestr(info, data)
PY
count=$(ls "$dest"/*.whl | wc -l)
[ "$count" -eq "${#wheels[@]}" ] || { echo "expected ${#wheels[@]} wheels, got $count" >&2; exit 1; }
du -sh "$dest"
