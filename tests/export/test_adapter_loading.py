"""No LoRA tensor is dropped silently: targets PEFT would not load back are left out (auto) or refused
(explicit), every written adapter is verified by loading it as PEFT does, and `init_from` refuses an
adapter that does not land whole.

The oracle is PEFT itself: `PeftModel.from_pretrained` on the real base model, its missing-keys warning,
and the tensors it holds afterwards. Laguna is the family where transformers' key renaming
(`mlp.shared_expert.` -> `mlp.shared_experts.`, an unescaped dot) makes PEFT drop shared-expert LoRA.
"""

import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.config.sections import ConfigError, LoraSection
from moe_qlora.export.adapter import ADAPTER_WEIGHTS, AdapterVerificationError, save_adapter, verify_adapter
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.families import narrowest_loadable
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.peft_adapter import AdapterMismatchError, load_adapter
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config
from moe_qlora.moe.expert_stacks import UnsupportedExpertsError

from helpers.adapters import randomized
from helpers.tiny_configs import tiny_config_any

ROOT = Path(__file__).resolve().parents[2]
AUTO = LoraSection(rank=4, alpha=8.0, target_modules="auto")
SHARED = ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"]


@pytest.fixture(scope="module")
def laguna_dir(tmp_path_factory):
    tok = build_byte_tokenizer()
    return save_tiny_model(tmp_path_factory.mktemp("laguna"), tiny_config("laguna", len(tok)), tokenizer=tok)


def peft_load(base_dir, adapter_dir):
    """PEFT's own load on the real base model: (peft model, its missing-keys warnings)."""
    base = load_model_plain(base_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    return model, [str(w.message) for w in caught if "missing adapter keys" in str(w.message)]


def load_model_plain(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def test_auto_targets_on_laguna_load_in_peft_with_every_tensor(laguna_dir, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        model = randomized(attach_adapters(load_model(LoadOptions(str(laguna_dir))), AUTO, seed=0))
    assert "not targeting model.layers.1.mlp.shared_experts" in caplog.text and "laguna" in caplog.text
    targets = model.peft_config["default"].target_modules
    assert {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "q_proj"} <= targets  # the dense layer keeps its LoRA
    adapter = save_adapter(model, tmp_path / "adapter", cfg=AUTO, base_model_name_or_path=str(laguna_dir))
    assert verify_adapter(model, adapter) == len(load_file(str(adapter / ADAPTER_WEIGHTS)))

    peft_model, missing_warnings = peft_load(laguna_dir, adapter)
    assert missing_warnings == []
    saved, loaded = load_file(str(adapter / ADAPTER_WEIGHTS)), get_peft_model_state_dict(peft_model)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert any("layers.0.mlp.gate_proj.lora_B" in k for k in saved)


@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2"])
def test_auto_targets_attention_projections_wrapped_in_modules(tmp_path, model_type):
    """Inkling-2 (transformers 5.24) holds each attention Linear as `self_attn.q_proj.linear`: the family default
    `q_proj` names no Linear there, and `auto` once trained only the output gate, leaving attention frozen.
    In the multimodal inkling2, `q_proj` is also a plain Linear of the vision tower: PEFT refuses a name that
    matches the text model's wrapper too, so that target must be narrowed, not passed on."""
    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path / model_type, tiny_config_any(model_type, len(tok)), tokenizer=tok)
    model = attach_adapters(load_model(LoadOptions(str(path))), AUTO, seed=0)
    with_lora = [n.split(".lora_A.")[0] for n, _ in model.named_parameters() if ".lora_A." in n]
    text = model.config.get_text_config()
    for layer in range(text.num_hidden_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = f"layers.{layer}.self_attn.{proj}.linear"
            assert any(n.endswith(name) for n in with_lora), name


@pytest.fixture(scope="module")
def mistral_large4_dir(tmp_path_factory):
    tok = build_byte_tokenizer()
    config = tiny_config_any("mistral_large4", len(tok))
    return save_tiny_model(tmp_path_factory.mktemp("mistral_large4"), config, tokenizer=tok)


def test_expert_lora_peft_would_rename_away_is_refused_before_training(mistral_large4_dir):
    """Mistral-Large-4's conversion renames `.experts.` to `.mlp.experts.` unanchored, and PEFT applies it to
    adapter keys: expert LoRA would load as `mlp.mlp.experts` and be lost. Refused at attach, with the cause."""
    with pytest.raises(UnsupportedExpertsError, match=r"mlp\.mlp\.experts"):
        attach_adapters(load_model(LoadOptions(str(mistral_large4_dir))), AUTO, seed=0)


def test_the_control_peft_really_drops_mistral_large4_expert_lora(mistral_large4_dir, tmp_path, monkeypatch):
    """Without the refusal, the adapter is written and PEFT's own load leaves its expert LoRA untouched."""
    monkeypatch.setattr("moe_qlora.model.adapters.refuse_parameter_lora_peft_would_drop", lambda *a: None)
    model = randomized(attach_adapters(load_model(LoadOptions(str(mistral_large4_dir))), AUTO, seed=0))
    adapter = save_adapter(model, tmp_path / "adapter", cfg=AUTO, base_model_name_or_path=str(mistral_large4_dir))
    with pytest.raises(AdapterVerificationError, match=r"experts.*stay at their initial value|stay at.*experts"):
        verify_adapter(model, adapter)


def test_explicit_shared_expert_target_on_laguna_is_refused_with_the_reason(laguna_dir):
    lora = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "shared_experts.gate_proj"])
    with pytest.raises(ConfigError, match=r"would not load as trained.*shared_experts\.gate_proj.*renames"):
        attach_adapters(load_model(LoadOptions(str(laguna_dir))), lora, seed=0)


def test_the_control_peft_really_drops_laguna_shared_expert_lora(laguna_dir, tmp_path):
    """Without the check, an adapter with shared-expert LoRA is written; PEFT then leaves it at init."""
    model = get_peft_model(load_model_plain(laguna_dir), LoraConfig(r=4, target_modules=SHARED))
    randomized(model)
    model.save_pretrained(str(tmp_path / "peft"))
    peft_model, missing_warnings = peft_load(laguna_dir, tmp_path / "peft")
    assert len(missing_warnings) == 1 and "shared_experts.gate_proj.lora_A" in missing_warnings[0]
    b = dict(peft_model.named_parameters())[
        "base_model.model.model.layers.1.mlp.shared_experts.up_proj.lora_B.default.weight"
    ]
    assert float(b.norm()) == 0.0


def test_init_from_refuses_an_adapter_peft_would_load_partly(laguna_dir, tmp_path):
    """moe-qlora's own init_from used to drop these tensors with no word (B norm 0 in the model, 0.8 in the file)."""
    shared_lora = LoraConfig(r=4, lora_alpha=8, target_modules=SHARED)
    source = randomized(get_peft_model(load_model(LoadOptions(str(laguna_dir))), shared_lora))
    lora = LoraSection(rank=4, alpha=8.0, experts=False, target_modules=SHARED)
    adapter = save_adapter(source, tmp_path / "adapter", cfg=lora, base_model_name_or_path=str(laguna_dir))
    target = get_peft_model(
        load_model(LoadOptions(str(laguna_dir))), LoraConfig(r=4, lora_alpha=8, target_modules=SHARED)
    )
    with pytest.raises(AdapterMismatchError, match=r"6 tensor\(s\) did not load.*shared_experts.*renamed"):
        load_adapter(target, adapter, lora)


@pytest.fixture(scope="module")
def mixtral_adapter(tiny_mixtral_dir, tmp_path_factory):
    lora = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    model = randomized(attach_adapters(load_model(LoadOptions(str(tiny_mixtral_dir))), lora, seed=0))
    adapter = save_adapter(
        model, tmp_path_factory.mktemp("a") / "adapter", cfg=lora, base_model_name_or_path=str(tiny_mixtral_dir)
    )
    return model, adapter, lora


def rewrite_file(adapter, edit):
    state = load_file(str(adapter / ADAPTER_WEIGHTS))
    edit(state)
    save_file(state, str(adapter / ADAPTER_WEIGHTS))


def test_a_verified_adapter_passes(mixtral_adapter):
    model, adapter, _ = mixtral_adapter
    assert verify_adapter(model, adapter) == 16


@pytest.mark.parametrize(
    "edit, message",
    [
        # a key renamed the way a faulty regex would: the tensor matches no module in PEFT
        (
            lambda s: s.__setitem__(KEY.replace(".q_proj.", ".q_proj.."), s.pop(KEY)),
            r"stay at their initial value.*q_proj",
        ),
        (lambda s: s.pop(EXPERT_KEY), r"missing from the file.*experts\.base_layer\.lora_B"),  # one expert delta lost
        (lambda s: s[KEY].mul_(0.5), r"values differ from the run's.*q_proj"),
    ],
    ids=["renamed_key", "expert_key_dropped", "values_changed"],
)
def test_broken_adapters_fail_the_verification_naming_the_key(mixtral_adapter, tmp_path, edit, message):
    import shutil

    model, adapter, _ = mixtral_adapter
    broken = Path(shutil.copytree(adapter, tmp_path / "broken"))
    rewrite_file(broken, edit)
    with pytest.raises(AdapterVerificationError, match=message):
        verify_adapter(model, broken)


KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
EXPERT_KEY = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"


def test_a_failed_verification_at_the_end_of_training_keeps_the_adapter(tmp_path, monkeypatch):
    """The run's adapter is written, then checked; a check that fails exits 1 and the file stays."""
    import moe_qlora.train.runs as runs

    real_save = runs.save_adapter

    def save_and_lose_a_tensor(model, out, **kw):
        path = real_save(model, out, **kw)
        rewrite_file(path, lambda s: s.pop(next(k for k in sorted(s) if "experts" in k)))
        return path

    monkeypatch.setattr(runs, "save_adapter", save_and_lose_a_tensor)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "model: {name_or_path: 'builtin:tiny-mixtral'}\n"
        f"data: {{train_files: [{ROOT / 'data' / 'demo_sft.jsonl'}], max_seq_len: 32}}\n"
        "train: {max_steps: 2, micro_batch_size: 2}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n"
    )
    result = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert result.exit_code == 1, result.output
    assert "would not load as trained" in result.output and "missing from the file" in result.output
    assert (tmp_path / "run" / "adapter" / ADAPTER_WEIGHTS).exists()


def test_init_from_with_a_missing_key_exits_2_naming_it(mixtral_adapter, tmp_path):
    import shutil

    _, adapter, _ = mixtral_adapter
    broken = Path(shutil.copytree(adapter, tmp_path / "broken"))
    rewrite_file(broken, lambda s: s.pop(KEY))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "model: {name_or_path: 'builtin:tiny-mixtral'}\n"
        f"lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj], init_from: {broken}}}\n"
        f"data: {{train_files: [{ROOT / 'data' / 'demo_sft.jsonl'}]}}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n"
    )
    result = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert result.exit_code == 2
    assert f"has no {KEY}" in result.output


def test_narrowing_keeps_the_modules_that_load_and_only_those():
    ok = ["model.layers.0.mlp.gate_proj"]
    bad = ["model.layers.1.mlp.shared_experts.gate_proj", "model.layers.2.mlp.shared_experts.gate_proj"]
    assert narrowest_loadable("gate_proj", ok, bad) == ["mlp.gate_proj"]
    # same parent name: a longer suffix separates them
    ok, bad = ["model.layers.0.mlp.gate_proj"], ["model.layers.1.mlp.gate_proj"]
    assert narrowest_loadable("gate_proj", ok, bad) == ["0.mlp.gate_proj"]


def test_an_adapter_trained_with_lora_dropout_loads_in_peft(tiny_mixtral_dir, tmp_path):
    """PEFT refuses LoRA on parameters (our experts) with lora_dropout != 0; dropout only acts in training,
    so the export writes 0 there, and the verification (which caught this) passes."""
    lora = LoraSection(rank=4, alpha=8.0, dropout=0.1, target_modules=["q_proj"])
    model = randomized(attach_adapters(load_model(LoadOptions(str(tiny_mixtral_dir))), lora, seed=0))
    adapter = save_adapter(model, tmp_path / "adapter", cfg=lora, base_model_name_or_path=str(tiny_mixtral_dir))
    assert verify_adapter(model, adapter) == 12
    peft_model, missing_warnings = peft_load(tiny_mixtral_dir, adapter)
    assert missing_warnings == [] and peft_model.peft_config["default"].lora_dropout == 0.0


def test_an_adapter_peft_refuses_fails_the_verification(mixtral_adapter, tmp_path):
    import json
    import shutil

    model, adapter, _ = mixtral_adapter
    broken = Path(shutil.copytree(adapter, tmp_path / "broken"))
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "lora_dropout": 0.1}))
    with pytest.raises(AdapterVerificationError, match="PEFT refuses to load it.*dropout"):
        verify_adapter(model, broken)


def test_the_round_trip_probe_is_exact_on_a_bf16_checkpoint():
    """On a bf16 base, PEFT's low_cpu_mem_usage load rounds adapter tensors through bf16 (the probe's 257th
    tensor, 257.0, came back as 256.0, and Qwen3-30B-A3B lost its attention targets from layer 32 on): the
    skeleton is built in float32, so every tensor lands exactly."""
    from moe_qlora.model.peft_roundtrip import target_modules_failing_round_trip

    config = tiny_config("mixtral", 263, num_hidden_layers=40)
    config.dtype = torch.bfloat16
    report, failing = target_modules_failing_round_trip(config, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert report.ok and not failing, report.describe()


def test_experts_only_needs_no_peft_targets(tiny_mixtral_dir, tmp_path):
    """target_modules: [] (LoRA on the experts alone) resolves, trains and verifies; PEFT is asked nothing."""
    lora = LoraSection(rank=4, alpha=8.0, target_modules=[])
    model = randomized(attach_adapters(load_model(LoadOptions(str(tiny_mixtral_dir))), lora, seed=0))
    adapter = save_adapter(model, tmp_path / "adapter", cfg=lora, base_model_name_or_path=str(tiny_mixtral_dir))
    assert verify_adapter(model, adapter) == 8  # 2 layers x 4 expert factors
