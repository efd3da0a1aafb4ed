"""A checkpoint's files: a local folder or hub id checked before anything is read (config, weights, tokenizer), its
safetensors shards, and their tensors read lazily, one whole tensor at a time into its own buffer.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

from moe_qlora.common.hub import check_hub_model
from moe_qlora.model.published_tensors import ModelLoadError

# Files a tokenizer is read from (fast, sentencepiece, BPE, WordPiece, tiktoken; a remote-code tokenizer's config)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "tokenizer_config.json",
    "*.tiktoken",
)
NO_TOKENIZER = "no tokenizer files (tokenizer.json, tokenizer.model or vocab.json: save the tokenizer beside the model)"
NO_WEIGHTS = "no weight files (*.safetensors; .bin weights are not read)"


def check_model_path(name_or_path: str, *, tokenizer: bool = True) -> None:
    """A local-looking path must exist and hold a config, weight files and (`tokenizer`) tokenizer files, all
    named in one sentence before any data or weight is read; else it is a hub id."""
    looks_local = os.path.isabs(name_or_path) or name_or_path.startswith((".", "~")) or os.path.exists(name_or_path)
    if not looks_local:
        check_hub_model(name_or_path, ModelLoadError)
        return
    path = Path(os.path.expanduser(name_or_path))
    if not path.is_dir():
        raise ModelLoadError(f"model path {name_or_path!r} does not exist")
    if not (path / "config.json").exists():
        raise ModelLoadError(f"model path {name_or_path!r} has no config.json")
    missing = [NO_TOKENIZER] if tokenizer and not has_any(path, TOKENIZER_FILES) else []
    if not has_weights(path):
        missing.append(NO_WEIGHTS)
    if missing:
        raise ModelLoadError(f"model path {name_or_path!r} has {' and '.join(missing)}")


def read_model_config(name_or_path: str, *, trust_remote_code: bool = False):
    """transformers' config of a model folder or hub id; a folder without config.json, or a config.json
    transformers refuses (a field of the wrong type, no model_type, not JSON), in one sentence naming the file."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    path = Path(os.path.expanduser(name_or_path))
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"model path {name_or_path!r} has no config.json (the model's architecture and sizes)")
    where = path / "config.json" if path.is_dir() else f"the config.json of {name_or_path}"
    try:
        return AutoConfig.from_pretrained(
            str(path) if path.is_dir() else name_or_path, trust_remote_code=trust_remote_code
        )
    except (ValueError, TypeError, KeyError, StrictDataclassError) as exc:
        raise ModelLoadError(f"{where}: transformers cannot read it: {' '.join(str(exc).split())}") from None


def has_any(folder: Path, patterns: tuple[str, ...]) -> bool:
    """Whether a file of `folder` matches one of the glob `patterns`."""
    return any(next(folder.glob(p), None) is not None for p in patterns)


def has_weights(folder: Path) -> bool:
    """Whether `folder` holds a checkpoint's safetensors (an index, or a weights file that is not an adapter)."""
    if (folder / "model.safetensors.index.json").exists():
        return True
    return any(not f.name.startswith("adapter_") for f in folder.glob("*.safetensors"))


def local_checkpoint(name_or_path: str) -> Path:
    """A local folder holding the checkpoint: the path itself, or the hub snapshot (config and safetensors)."""
    path = Path(os.path.expanduser(name_or_path))
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    # top-level files only: openai/gpt-oss-20b also ships original/ (13 GB more) and metal/ weights
    return Path(snapshot_download(name_or_path, allow_patterns=patterns, ignore_patterns=["*/*"]))


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, or every weights file."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are not there: {', '.join(missing[:3])}")
        return [folder / s for s in shards]
    files = sorted(f for f in folder.glob("*.safetensors") if not f.name.startswith("adapter_"))
    if not files:
        raise ModelLoadError(f"{folder} has {NO_WEIGHTS}")
    return files


TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # block scales stored as e8m0 (scale_fmt ue8m0)
}


class LazyTensor:
    """One tensor of a safetensors file, read on `[...]` straight into its own buffer (one copy).

    The two readers safetensors offers cost more here: mmap leaves every touched page resident until the
    file is closed (the whole checkpoint, by the end of loading), and its pread backend holds the bytes
    twice while it builds the tensor (measured: 577 MiB high-water for a 288 MiB tensor).
    """

    def __init__(self, path: Path, dtype: str, shape: list[int], start: int, end: int):
        self.path, self.dtype_name, self.shape, self.start, self.end = path, dtype, shape, start, end

    def get_dtype(self) -> str:
        return self.dtype_name

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise ValueError(f"LazyTensor reads whole tensors only ([...]), not [{index!r}]")
        buffer = torch.empty(self.end - self.start, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.start)
            if f.readinto(buffer.numpy()) != buffer.numel():
                raise ModelLoadError(f"{self.path}: truncated safetensors file")
        return buffer.view(TORCH_DTYPES[self.dtype_name]).reshape(self.shape)


def read_safetensors_index(path: Path) -> dict[str, LazyTensor]:
    """The tensors of one safetensors file: an 8-byte header length, a JSON header, then the data."""
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > path.stat().st_size - 8:
                raise ValueError(f"header length {header_len} exceeds the file")
            header = json.loads(f.read(header_len))
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ModelLoadError(f"{path}: not a readable safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    base = 8 + header_len
    unknown = {v["dtype"] for v in header.values()} - TORCH_DTYPES.keys()
    if unknown:
        raise ModelLoadError(f"{path}: tensors of dtype {sorted(unknown)} are not supported")
    return {
        k: LazyTensor(path, v["dtype"], v["shape"], base + v["data_offsets"][0], base + v["data_offsets"][1])
        for k, v in header.items()
    }


@contextmanager
def lazy_state_dict(files: list[Path]):
    """{name: LazyTensor} over all files of a checkpoint; nothing is read until transformers asks."""
    state = {}
    for f in files:
        state.update(read_safetensors_index(f))
    yield state


def stored_dtype(state: dict) -> torch.dtype:
    """The floating dtype most tensors of the checkpoint are stored in."""
    counts = Counter(t.get_dtype() for t in state.values() if TORCH_DTYPES[t.get_dtype()].is_floating_point)
    return TORCH_DTYPES[counts.most_common(1)[0][0]] if counts else torch.float32
