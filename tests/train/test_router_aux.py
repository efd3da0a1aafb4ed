"""train.router_aux_loss_coef: the family's MoE load-balancing loss trained on in SFT, DPO and GRPO. Off, the
gradients are bitwise those of the loss alone; on, they move by exactly coef x the auxiliary loss's own gradient
(fp32 summation order: within 1e-6 of the largest element), which reaches the router's LoRA. "Off" is compared
with the forward that does not ask for router logits at all."""

import pytest
import torch

from moe_qlora.config.grpo import GrpoSection
from moe_qlora.config.preference import DpoSection
from moe_qlora.config.sections import ConfigError, LoraSection, TrainSection
from moe_qlora.data.examples import Example, collate
from moe_qlora.data.preference import PreferencePair
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.tiny import save_tiny_model, tiny_config
from moe_qlora.train import dpo as dpo_module
from moe_qlora.train import grpo as grpo_module
from moe_qlora.train.dpo import StepTotals
from moe_qlora.train.dpo import micro_batch_loss as dpo_loss
from moe_qlora.train.grpo import BatchTotals, backward_pass
from moe_qlora.train.losses import router_aux_coefficient, token_logprobs
from moe_qlora.train.position import StepContext
from moe_qlora.train.sft import accumulate_gradients

from helpers.oracle import randomize_lora_b

COEF = 0.5
LORA = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj"], router=True)


@pytest.fixture(scope="module")
def model(tiny_mixtral_dir):
    model = attach_adapters(load_model(LoadOptions(str(tiny_mixtral_dir))), LORA, seed=0)
    model.eval()
    randomize_lora_b(model)
    return model


def rows(n: int, seed: int) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, 250, (10 + 3 * i,), generator=g).tolist()
        out.append(Example(ids, [-100] * 4 + ids[4:], f"rows:{i + 1}"))
    return out


def router_gradients(model) -> dict[str, torch.Tensor]:
    named = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    router = {n: g for n, g in named.items() if "gate" in n and "experts" not in n}
    assert router, "the router carries LoRA (lora.router)"
    return router


def gradients(model, backward) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    backward()
    return router_gradients(model)


def aux_gradient(model, batch) -> dict[str, torch.Tensor]:
    """The gradient of the auxiliary loss alone (transformers' own load_balancing_loss_func on the router logits)."""

    def backward():
        _, _, out = token_logprobs(model, batch, output_router_logits=True)
        out.aux_loss.backward()

    return gradients(model, backward)


def assert_moved_by_the_aux_gradient(on, off, aux):
    for name in off:
        scale = float(on[name].abs().max())
        assert float((on[name] - off[name] - COEF * aux[name]).abs().max()) <= 1e-6 * scale, name
        assert float(aux[name].abs().max()) > 1e-4 * scale, f"{name}: the auxiliary loss must reach the router"


def test_sft_trains_on_the_aux_loss_only_when_asked(model):
    batch = collate(rows(3, 0), 0)
    plain = gradients(
        model, lambda: (-token_logprobs(model, batch)[0].sum() / int((batch["labels"][:, 1:] != -100).sum())).backward()
    )
    off = gradients(model, lambda: accumulate_gradients(model, [batch], aux_coef=0.0))
    on = gradients(model, lambda: accumulate_gradients(model, [batch], aux_coef=COEF))
    assert all(torch.equal(plain[n], off[n]) for n in plain)  # off: exactly the token loss
    assert_moved_by_the_aux_gradient(on, off, aux_gradient(model, batch))


def test_dpo_trains_on_the_aux_loss_only_when_asked(model):
    chosen, rejected = rows(2, 1), rows(2, 2)
    pairs = [PreferencePair(c, r, c.source, i) for i, (c, r) in enumerate(zip(chosen, rejected, strict=True))]
    d = DpoSection(loss_type="simpo")
    totals = StepTotals(2, 10, 1)

    def step(coef):
        ctx = StepContext(TrainSection(), aux_coef=coef)
        return lambda: dpo_loss(model, pairs, None, d, totals, ctx, 0)[0].backward()

    off, on = gradients(model, step(0.0)), gradients(model, step(COEF))
    with pytest.MonkeyPatch.context() as patch:  # the forward without router logits at all
        patch.setattr(dpo_module, "has_router_aux_loss", lambda model: False)
        plain = gradients(model, step(0.0))
    assert all(torch.equal(plain[n], off[n]) for n in plain)  # off: exactly the preference loss
    both = collate(chosen + rejected, 0)
    assert_moved_by_the_aux_gradient(on, off, aux_gradient(model, {k: v for k, v in both.items() if k != "weights"}))


def test_grpo_trains_on_the_aux_loss_only_when_asked(model):
    batch = collate(rows(4, 3), 0)
    g = GrpoSection(rewards=[{"function": "exact_match"}], loss_type="dapo")
    totals = BatchTotals(int((batch["labels"][:, 1:] != -100).sum()), 4, 1)

    def step(coef):
        ctx = StepContext(TrainSection(), aux_coef=coef)
        return lambda: backward_pass(model, [batch], ([None], [None]), g, totals, ctx)

    off, on = gradients(model, step(0.0)), gradients(model, step(COEF))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_module, "has_router_aux_loss", lambda model: False)
        plain = gradients(model, step(0.0))
    assert all(torch.equal(plain[n], off[n]) for n in plain)  # off: exactly the GRPO loss
    assert_moved_by_the_aux_gradient(on, off, aux_gradient(model, batch))


def test_the_coefficient_is_the_number_the_familys_own_or_refused(model, tmp_path):
    assert router_aux_coefficient(model, 0) == 0.0
    assert router_aux_coefficient(model, 0.25) == 0.25
    assert router_aux_coefficient(model, "model") == model.config.router_aux_loss_coef == 0.001
    path = save_tiny_model(tmp_path / "glm", tiny_config("glm4_moe", 300), seed=0)
    glm = load_model(LoadOptions(str(path)))
    assert router_aux_coefficient(glm, 0) == 0.0
    with pytest.raises(ConfigError, match="glm4_moe defines no router auxiliary"):
        router_aux_coefficient(glm, "model")


def test_the_cli_refuses_it_for_a_family_without_one_before_loading(tmp_path):
    """From the checkpoint's config.json (through transformers' config class, as the model will have it), in one
    sentence, exit 2, before any weight is read: --dry-run reads none and is refused the same way."""
    import subprocess
    import sys

    path = save_tiny_model(tmp_path / "glm", tiny_config("glm4_moe", 300), seed=0)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        f"model: {{name_or_path: {path}}}\ndata: {{train_files: [{tmp_path / 'rows.jsonl'}]}}\n"
        f"train: {{router_aux_loss_coef: model}}\noutput: {{dir: {tmp_path / 'out'}}}\n"
    )
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    cmd = [sys.executable, "-m", "moe_qlora", "train", "--config", str(config), "--dry-run"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "glm4_moe defines no router auxiliary" in " ".join(proc.stderr.split()) and "Traceback" not in proc.stderr
    ok = subprocess.run([*cmd, "--set", "train.router_aux_loss_coef=0"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
