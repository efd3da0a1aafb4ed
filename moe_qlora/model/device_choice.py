"""Where a run computes: model.device with `auto` resolved. Imports torch alone, so the CLI can refuse a `cuda` that
torch cannot give before the heavy imports and the model's loading.
"""

from __future__ import annotations

import torch

from moe_qlora.config.sections import ConfigError, ModelSection


def policy_device(model: ModelSection) -> str:
    """model.device with auto resolved: the GPU when there is one. cuda asked of a torch without CUDA (its CPU
    build, or no GPU visible) is refused in one sentence, before anything is loaded."""
    if model.device == "cuda" and not torch.cuda.is_available():
        build = "a CPU build of torch" if torch.version.cuda is None else "no CUDA device visible to torch"
        raise ConfigError(
            f"model.device is cuda, but this machine has {build} ({torch.__version__}): install the CUDA build "
            "of torch your driver supports, or set model.device: auto"
        )
    return model.device if model.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
