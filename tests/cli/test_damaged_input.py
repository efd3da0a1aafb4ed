"""Damaged adapters and other bad input, as a new user meets them (issue 69): every command that reads an adapter
answers a damaged one in one sentence with exit 2 and writes nothing; an adapter naming another base is refused
by export before a file with layers the base lacks is written; a model folder, a data file, an output path and a
full disk each say what is wrong and what to do.

Commands run in process (typer's CliRunner): an uncaught exception shows as `result.exception` other than
SystemExit, which is what a traceback would be."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.config.sections import LoraSection
from moe_qlora.model.adapter_file import AdapterReadError

from helpers.adapters import random_adapter

ROOT = Path(__file__).resolve().parents[2]


def invoke(*args) -> tuple[int, str]:
    """(exit code, output with whitespace joined); an exception the command did not turn into a sentence fails."""
    result = CliRunner().invoke(app, [*map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture(scope="module")
def adapter(tiny_mixtral_dir, tmp_path_factory):
    """An adapter of the tiny Mixtral (experts, q and v) with every factor non-zero, as a run writes it."""
    lora = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    return random_adapter(tiny_mixtral_dir, tmp_path_factory.mktemp("run") / "adapter", lora)[1]


NAN_KEY = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"  # (64, 4)


def damaged(adapter: Path, tmp_path: Path, damage: str) -> Path:
    """A copy of `adapter` with its weights file cut in half, its header overwritten, or one NaN in NAN_KEY."""
    copy = tmp_path / f"adapter-{damage}"
    shutil.copytree(adapter, copy)
    weights = copy / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "truncated":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "garbled":
        data[:8] = b"\xff" * 8
        weights.write_bytes(bytes(data))
    else:
        tensors = load_file(weights)
        tensors[NAN_KEY][2, 1] = float("nan")
        save_file(tensors, weights, metadata={"format": "pt"})
    return copy


COMMANDS = {
    "generate": lambda a, out: ["generate", "--adapter", a, "hi", "--max-new-tokens", "2", "--device", "cpu"],
    "merge": lambda a, out: ["merge", a, "--out", out],
    "gguf": lambda a, out: ["export", a, "--format", "gguf", "--out", out],
    "vllm": lambda a, out: ["export", a, "--format", "vllm", "--out", out],
    "per-expert": lambda a, out: ["export", a, "--format", "per-expert", "--out", out],
}


@pytest.mark.parametrize("damage", ["truncated", "garbled", "nan"])
def test_a_damaged_adapter_is_one_sentence_in_every_command_and_nothing_is_written(adapter, tmp_path, damage):
    """Before: generate and merge printed a traceback ending in SafetensorError (exit 1), and a NaN was blamed on
    PEFT renaming keys; export wrote a NaN GGUF with exit 0."""
    bad = damaged(adapter, tmp_path, damage)
    for command, args in COMMANDS.items():
        out = tmp_path / f"out-{command}"
        code, output = invoke(*args(bad, out))
        assert code == 2, (command, output)
        assert f"error: {bad / 'adapter_model.safetensors'}" in output, (command, output)
        if damage == "nan":
            assert f"{NAN_KEY} holds 1 NaN or inf value(s) of 256" in output, (command, output)
            assert "check-norms" in output and "PEFT renamed" not in output
        else:
            assert "not a readable safetensors file" in output, (command, output)
        assert not out.exists(), command
    # check-norms still reads such an adapter and names what is wrong with it (its job), exit 1 or 2
    code, output = invoke("check-norms", bad)
    assert (code, "NaN" in output or "not a readable" in output) == (1 if damage == "nan" else 2, True), output


def test_the_sound_adapter_is_the_control(adapter, tmp_path):
    """The same commands on the undamaged adapter write their outputs: the refusals above are the damage's."""
    for command in ("gguf", "vllm", "per-expert"):
        code, output = invoke(*COMMANDS[command](adapter, tmp_path / command))
        assert code == 0 and (tmp_path / command).exists(), (command, output)


def test_loading_a_nan_adapter_names_the_tensor_not_peft(adapter, tmp_path, tiny_mixtral_dir):
    """lora.init_from / generate's load: the equality check after PEFT's load used to fail on NaN != NaN and
    blame PEFT renaming the keys."""
    from moe_qlora.model.adapters import attach_adapters
    from moe_qlora.model.loading import LoadOptions, load_model
    from moe_qlora.model.peft_adapter import load_adapter

    lora = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    model = attach_adapters(load_model(LoadOptions(str(tiny_mixtral_dir))), lora, seed=0)
    assert load_adapter(model, adapter, lora) > 0  # control: the sound adapter loads
    with pytest.raises(AdapterReadError, match=rf"{NAN_KEY} holds 1 NaN or inf value\(s\) of 256; refusing to load"):
        load_adapter(model, damaged(adapter, tmp_path, "nan"), lora)


def another_base(adapter: Path, tmp_path: Path, tiny_mixtral_dir: Path, **changes) -> Path:
    """A copy of `adapter` whose adapter_config.json names a base with `changes` to the tiny Mixtral's config."""
    base = tmp_path / "other-base"
    base.mkdir()
    config = json.loads((tiny_mixtral_dir / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, **changes}))
    moved = tmp_path / "moved-adapter"
    shutil.copytree(adapter, moved)
    adapter_config = json.loads((moved / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = str(base)
    (moved / "adapter_config.json").write_text(json.dumps(adapter_config))
    return moved


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"num_hidden_layers": 1}, "has LoRA for layer 1, and its base has 1 layer"),
        (
            {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8},
            "self_attn.q_proj.lora_A.weight is LoRA for 64 inputs, and the base's layers.0.self_attn.q_proj has 32",
        ),
    ],
    ids=["shallower", "narrower"],
)
def test_export_refuses_an_adapter_that_names_another_base(adapter, tmp_path, tiny_mixtral_dir, changes, said):
    """Before: export wrote a GGUF with layers the base does not have (exit 0). Each format is refused, naming
    the first tensor that does not fit and the base, and writes nothing."""
    moved = another_base(adapter, tmp_path, tiny_mixtral_dir, **changes)
    for command in ("gguf", "vllm", "per-expert"):
        out = tmp_path / f"out-{command}"
        code, output = invoke(*COMMANDS[command](moved, out))
        assert code == 2 and said in output and "set base_model_name_or_path" in output, (command, output)
        assert not out.exists()


def test_a_model_folder_without_or_with_a_broken_config_is_one_sentence_in_plan_and_train(tiny_mixtral_dir, tmp_path):
    """Before: plan printed a traceback for both; train one for the field of the wrong type."""
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    shutil.copytree(tiny_mixtral_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    demo = ROOT / "configs" / "demo.yaml"
    code, output = invoke("plan", "--config", demo, "--model", empty)
    assert code == 2 and f"model path '{empty}' has no config.json" in output, output
    code, output = invoke("plan", "--config", demo, "--model", broken)
    assert code == 2 and f"{broken / 'config.json'}: transformers cannot read it" in output, output
    assert "'hidden_size' expected int, got str (value: 'big')" in output
    out = tmp_path / "run"
    code, output = invoke(
        "train", "--config", demo, "--set", f"model.name_or_path={broken}", "--set", f"output.dir={out}"
    )
    assert code == 2 and "transformers cannot read it" in output and not out.exists(), output


def test_an_output_on_a_file_system_that_makes_no_files_is_named(adapter):
    """/proc takes no new files: mkstemp there fails with ENOENT, which used to print as a raw '[Errno 2]'."""
    for args in (["merge", adapter, "--out", "/proc/merged"], COMMANDS["gguf"](adapter, "/proc/a.gguf")):
        code, output = invoke(*args)
        assert code == 2 and "/proc takes no new files (a virtual file system" in output, output


def test_the_full_disk_advice_frees_what_it_says(tmp_path):
    """With older checkpoints kept, a resume with train.keep_checkpoints=1 frees them (tests/train/test_faults.py
    runs that resume on a real full disk); with one, lowering it frees nothing, so the advice is the bytes to
    free by hand."""
    from moe_qlora.cli.run import room_advice
    from moe_qlora.common.fileio import DiskFullError

    cfg = SimpleNamespace(output=SimpleNamespace(dir=str(tmp_path)))  # what room_advice reads of a RunConfig
    for step in (5, 10, 15):
        folder = tmp_path / "checkpoints" / f"step-{step:08d}"
        folder.mkdir(parents=True)
        (folder / "trainable.safetensors").write_bytes(b"\0" * 300_000)
    advice = room_advice(cfg, DiskFullError(tmp_path, needed=300_000, free=100_000))
    assert (
        "add --set train.keep_checkpoints=1 to the resume, which removes the 2 older checkpoint(s) (585.9 KiB)"
        in advice
    )
    advice = room_advice(cfg, DiskFullError(tmp_path, needed=900_000, free=100_000))  # more than they give back
    assert "free at least 781.2 KiB on that disk" in advice
    for step in (5, 10):
        shutil.rmtree(tmp_path / "checkpoints" / f"step-{step:08d}")
    advice = room_advice(cfg, DiskFullError(tmp_path, needed=300_000, free=100_000))
    assert "free at least 195.3 KiB on that disk" in advice and "keep_checkpoints frees nothing" in advice
