#!/usr/bin/env bash
# Wheels for an offline GPU machine that has torch, triton, numpy, pyarrow, tokenizers and huggingface-hub but
# not this package's other needs (the lent H100/H200 image: Python 3.12, torch 2.11, transformers 5.17, no
# bitsandbytes, pydantic, datasets or gguf). Run here, where pip reaches a registry:
#     bash scripts/gpu_wheels.sh            # -> .whl/ (about 60 MB), ignored by git
# then on the GPU machine, with .whl carried beside the checkout:
#     python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
#       && PYTHONPATH=/tmp/site:$PWD bash scripts/gpu_check.sh "$OUT/gpu-check"
# Versions are the ones CI tests with (pyproject's test pins, and what the CPU install resolves today).
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
)
platforms=()
for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
           manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dest" "${wheels[@]}"
count=$(ls "$dest"/*.whl | wc -l)
[ "$count" -eq "${#wheels[@]}" ] || { echo "expected ${#wheels[@]} wheels, got $count" >&2; exit 1; }
du -sh "$dest"
