"""The `gguf (libllama)` row of `moe-qlora verify`: llama.cpp's own runtime runs the GGUF adapter on the base
and its log-probs are compared with PEFT's run of the adapter on the same base.

Needs llama-cpp-python (libllama; docs/export.md says how to build it) and the base as an f32 GGUF: the one
`--gguf-base` names, or the base converted here by `convert_hf_to_gguf.py` of the llama.cpp tree LLAMA_CPP_DIR
names (the tree libllama was built from: an adapter's tensor names are that version's). Token ids are fed
directly (`IDS_LEN` of them), so the vocabulary only has to load.

Each libllama run is its own process (`python -m moe_qlora.inference.libllama_check JOB`): libllama aborts the
process on a graph it cannot build, and verify must still print its table.

Tolerance: `TOL` = 1e-4 in log-prob, libllama's f32 matmuls and f32 KV cache against torch fp32 (measured 1.8e-7
to 1.6e-5 over 17 families' tiny bases by tests/export/test_llamacpp.py). The row first checks what makes the
comparison mean something, and says "not checked" otherwise: the base alone in libllama within `TOL` of the
base alone in PEFT (it is this adapter's base), and the adapter moving PEFT's log-probs by more than 10 x `TOL`
(a dropped adapter would be seen).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

TOL = 1e-4
IDS_LEN = 32
BASE_LIMIT = 4 * 2**30  # PEFT runs the base in fp32 on the CPU beside libllama's f32 copy
# The converter names a tokenizer by hashing its pre-tokenization, and refuses one it does not know (tiny and
# custom tokenizers): named "default" here, and given one BPE merge where it has none (libllama wants merges).
CONVERT = """
import sys
sys.path[:0] = [{root!r}, {root!r} + "/gguf-py"]
from conversion.base import TextModel
import gguf
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
add_to_gguf = gguf.SpecialVocab.add_to_gguf
def with_a_merge(self, writer, quiet=False):
    self.merges = self.merges or ["a b"]
    return add_to_gguf(self, writer, quiet)
gguf.SpecialVocab.add_to_gguf = with_a_merge
{patch}
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
convert_hf_to_gguf.main()
"""
# converter flags a family needs: Qwen3-Next's converter asserts multi-token-prediction layers unless told none
CONVERT_FLAGS = dict.fromkeys(("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"), ("--no-mtp",))


def converter_of(llama_cpp_dir: str | None) -> Path | None:
    """LLAMA_CPP_DIR's convert_hf_to_gguf.py, or None where it names no llama.cpp tree."""
    script = Path(llama_cpp_dir) / "convert_hf_to_gguf.py" if llama_cpp_dir else None
    return script if script is not None and script.is_file() else None


def convert_base(
    model_dir: Path, out: Path, llama_cpp_dir: str, *, extra: tuple[str, ...] = (), patch: str = ""
) -> subprocess.CompletedProcess:
    """Run llama.cpp's converter on the base folder, writing an f32 GGUF at `out` (`patch`: Python run first)."""
    args = [str(model_dir), "--outtype", "f32", "--outfile", str(out), *extra]
    code = CONVERT.format(root=llama_cpp_dir, args=args, patch=patch)
    env = {**os.environ, "NO_LOCAL_GGUF": ""}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600, env=env)


def llama_logprobs(base: Path, lora: Path | None, ids: list[int]) -> np.ndarray | str:
    """(len(ids), vocab) float64 log-probs of libllama run on `base` (with the `lora` GGUF), in a process of its
    own; or what stopped it, in words (a refused load, an abort)."""
    with tempfile.TemporaryDirectory(prefix="moe-qlora-libllama-") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "logits.npy"
        job.write_text(
            json.dumps({"base": str(base), "lora": str(lora) if lora else None, "ids": ids, "out": str(out)})
        )
        proc = subprocess.run(
            [sys.executable, "-m", "moe_qlora.inference.libllama_check", str(job)],
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if proc.returncode != 0 or not out.exists():
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-300:]
            return f"libllama stopped ({how}): {tail or 'no message'}"
        logits = torch.from_numpy(np.load(out)).double()
    return torch.log_softmax(logits, -1).numpy()


def run_job(job_file: str) -> None:
    """The child's side of llama_logprobs: every position's logits, with an f32 KV cache (type 0)."""
    from llama_cpp import Llama

    job = json.loads(Path(job_file).read_text())
    kwargs = {"lora_path": job["lora"]} if job["lora"] else {}
    llm = Llama(
        model_path=job["base"], n_ctx=2 * len(job["ids"]), logits_all=True, verbose=False, type_k=0, type_v=0, **kwargs
    )
    llm.eval(job["ids"])
    np.save(job["out"], np.array(llm.scores[: len(job["ids"])], dtype=np.float32))


def peft_logprobs(base_dir: Path, adapter: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(with the adapter, without it) float64 log-probs of PEFT's model on the base in fp32."""
    from peft import PeftModel
    from transformers import AutoConfig

    from moe_qlora.model.classes import text_generation_class

    base = text_generation_class(AutoConfig.from_pretrained(base_dir)).from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        with_lora = model(input_ids=x).logits[0].double()
        with model.disable_adapter():
            without = model(input_ids=x).logits[0].double()
    return torch.log_softmax(with_lora, -1).numpy(), torch.log_softmax(without, -1).numpy()


def non_f32_types(gguf_file: Path) -> list[str]:
    """The tensor types of a GGUF other than F32 (an f32 conversion has none)."""
    import gguf

    return sorted({t.tensor_type.name for t in gguf.GGUFReader(str(gguf_file)).tensors} - {"F32"})


def probe_ids(vocab_size: int) -> list[int]:
    """A fixed sequence of ordinary token ids (clear of the first 10, where special tokens usually are)."""
    return [10 + i % max(vocab_size - 10, 1) for i in range(IDS_LEN)]


def unavailable(gguf_base: Path | None, base_dir: Path) -> str | None:
    """Why libllama's run cannot be had here (no llama-cpp-python, no f32 base to be had, a base PEFT cannot run
    on the CPU), or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python (libllama) is not installed (docs/export.md: building it)"
    if gguf_base is None and converter_of(os.environ.get("LLAMA_CPP_DIR")) is None:
        return "no f32 base GGUF: give --gguf-base, or set LLAMA_CPP_DIR to the llama.cpp tree libllama was built from"
    size = sum(f.stat().st_size for f in base_dir.glob("*.safetensors"))
    if size > BASE_LIMIT:
        return f"the base is {size / 2**30:.1f} GiB; PEFT runs it in fp32 on the CPU here (checked up to 4 GiB)"
    return None


def f32_base(gguf_base: Path | None, base_dir: Path, flags: tuple[str, ...], tmp: Path) -> Path | str:
    """The base as an f32 GGUF: `gguf_base` once checked to hold only F32 tensors, or `base_dir` converted into
    `tmp` by LLAMA_CPP_DIR's converter with the adapter's converter `flags`; else why not, in words."""
    if gguf_base is not None:
        if other := non_f32_types(gguf_base):
            return (
                f"{gguf_base} holds {', '.join(other)} tensors: the comparison needs the base in f32 "
                "(convert_hf_to_gguf.py --outtype f32)"
            )
        return gguf_base
    from transformers import AutoConfig

    converter = converter_of(os.environ.get("LLAMA_CPP_DIR"))
    extra = CONVERT_FLAGS.get(AutoConfig.from_pretrained(base_dir).model_type, ()) + flags
    proc = convert_base(base_dir, tmp / "base.gguf", str(converter.parent), extra=extra)
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.strip().splitlines()[-2:])[-300:]
        return f"llama.cpp's converter ({converter}) did not convert {base_dir}: {tail}"
    return tmp / "base.gguf"


def compare_runs(adapter: Path, gguf_lora: Path, gguf_base: Path, base_dir: Path) -> tuple[str, str]:
    """(status, detail): libllama's base alone and with the adapter against PEFT's, in that order of what each
    failure means."""
    import llama_cpp
    from transformers import AutoConfig

    ids = probe_ids(AutoConfig.from_pretrained(base_dir).get_text_config().vocab_size)
    with_lora, without = peft_logprobs(base_dir, adapter, ids)
    alone = llama_logprobs(gguf_base, None, ids)
    if isinstance(alone, str):
        return ("not checked", f"the base alone did not run: {alone}")
    if (off := float(np.abs(alone - without).max())) > TOL:
        why = f"{gguf_base} alone is {off:.2g} in log-prob from {base_dir} alone in PEFT: not this adapter's base"
        return ("not checked", why)
    if (moved := float(np.abs(with_lora - without).max())) <= 10 * TOL:
        why = f"the adapter moves PEFT's log-probs by {moved:.2g}, too little to tell it applied (tolerance {TOL:g})"
        return ("not checked", why)
    ours = llama_logprobs(gguf_base, gguf_lora, ids)
    if isinstance(ours, str):
        return ("mismatch", f"the base runs, but with this adapter {ours}")
    if (err := float(np.abs(ours - with_lora).max())) > TOL:
        detail = f"libllama's log-probs are {err:.3g} from PEFT's with the adapter (tolerance {TOL:g}; "
        detail += f"the adapter moves them {moved:.3g})"
        return ("mismatch", detail)
    detail = (
        f"run by libllama (llama-cpp-python {llama_cpp.__version__}) on an f32 base: {len(ids)} tokens' log-probs "
        f"within {err:.2g} of PEFT's (tolerance {TOL:g}); the adapter moves them {moved:.2g}"
    )
    return ("ok", detail)


if __name__ == "__main__":
    run_job(sys.argv[1])
