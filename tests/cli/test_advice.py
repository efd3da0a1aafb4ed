"""Advice that works when followed (issue 62): a message that tells the user what to set is followed here, and
what it suggests must then work. (The others are followed where their fault is tested: --force in
test_user_messages.py, another output.dir after a changed lora.rank in tests/train/test_resume.py, a lower
train.keep_checkpoints after a full disk in tests/train/test_faults.py.)"""

from __future__ import annotations

import re

import pytest
import torch

from moe_qlora.config.sections import ConfigError, ModelSection
from moe_qlora.data.sources import DataError, check_data_file

SUGGESTED = re.compile(r"set ([\w.]+): (\w+)")


def followed(message: str) -> tuple[str, str]:
    """The `key: value` a message suggests setting."""
    found = SUGGESTED.search(message)
    assert found, f"no `set key: value` in {message!r}"
    return found.group(1), found.group(2)


def test_cuda_asked_of_a_torch_without_cuda(monkeypatch):
    from moe_qlora.model import build

    monkeypatch.setattr(build.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as refused:
        build.policy_device(ModelSection(name_or_path="builtin:tiny-mixtral", device="cuda"))
    key, value = followed(str(refused.value))
    assert key == "model.device"
    assert build.policy_device(ModelSection(name_or_path="builtin:tiny-mixtral", device=value)) == "cpu"


def test_triton_asked_of_the_cpu(monkeypatch):
    from moe_qlora.model import kernel_choice

    monkeypatch.setattr(kernel_choice.tiles, "interpreted", lambda: False)  # as outside the tests
    with pytest.raises(ConfigError) as refused:
        kernel_choice.resolve_kernels("triton", "cpu", torch.float32)
    key, value = followed(str(refused.value))
    assert key == "model.kernels"
    assert kernel_choice.resolve_kernels(value, "cpu", torch.float32) == "torch"


def test_a_data_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes('{"text": "caf\\u00e9"}\n{"text": "na\u00efve"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"rows\.jsonl:2: not UTF-8 text .*save the file as UTF-8"):
        check_data_file(path)
    path.write_text(path.read_bytes().decode("latin-1"), encoding="utf-8")  # the advice: save it as UTF-8
    assert check_data_file(path) == "json"
