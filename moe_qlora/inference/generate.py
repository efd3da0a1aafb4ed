"""`moe-qlora generate`: the 4-bit model with a run's adapter, as trained (NF4 experts, expert LoRA, the same
MoE kernels), streaming tokens to the terminal. `--no-adapter` gives the base model to compare.

The LoRA layout comes from the adapter's adapter_config.json (rank, alpha, linear targets, expert and router
targets), so the adapter loads into exactly the modules it was trained in (model.peft_adapter.load_adapter refuses
anything else by name).

The prompt is rendered as the run's rows were (Rendering): inside the prefix and suffix its prompt rows shared (the
demo's end in a newline), or through the chat template after its system turn when it trained mostly on messages;
the run records which in the adapter's moe_qlora.json (train.prompt_format). --chat and --raw choose instead.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from transformers import GenerationConfig, TextStreamer

from moe_qlora.config.load import validate_section
from moe_qlora.config.sections import ConfigError, LoraSection, ModelSection
from moe_qlora.model.adapter_file import AdapterReadError, read_checked_adapter
from moe_qlora.model.adapters import adapters_disabled
from moe_qlora.moe.experts import generation_kernels


@dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


def policy_sections_for(
    adapter_dir: Path, *, device: str, kernels: str, doing: str = "generate with"
) -> tuple[ModelSection, LoraSection]:
    """The model and lora sections that rebuild the adapter's model (base from adapter_config.json, its LoRA
    layout) and load the adapter into it (lora.init_from). The adapter is read and checked first (readable,
    finite, naming its base), before minutes of loading the base: an adapter that cannot be used for `doing`
    is said in one sentence."""
    config_path = adapter_dir / "adapter_config.json"
    _, config = read_checked_adapter(adapter_dir, doing)
    for key in ("base_model_name_or_path", "r", "lora_alpha"):
        if key not in config:
            raise AdapterReadError(f"{config_path}: no {key!r} (PEFT writes it; this file is not a LoRA adapter's)")
    parameters = config.get("target_parameters") or []
    targets = config.get("target_modules") or []
    model = {
        "name_or_path": config["base_model_name_or_path"],
        "device": device,
        "kernels": kernels,
        **trained_quantization(adapter_dir),
    }
    from moe_qlora.model.build import CHAT_TEMPLATE_FILE

    if (adapter_dir / CHAT_TEMPLATE_FILE).is_file():  # the run's model.chat_template
        model["chat_template"] = str(adapter_dir / CHAT_TEMPLATE_FILE)
    lora = {
        "rank": config["r"],
        "alpha": config["lora_alpha"],
        "dropout": 0.0,
        "experts": any(not p.endswith("weight") for p in parameters),
        "router": any(p.endswith("weight") for p in parameters),
        "target_modules": sorted(targets) if isinstance(targets, list) else [targets],
        "init_from": str(adapter_dir),
    }
    source = str(config_path)
    return (
        validate_section(ModelSection, "model", model, source=source),
        validate_section(LoraSection, "lora", lora, source=source),
    )


def trained_quantization(adapter_dir: Path) -> dict[str, bool | str]:
    """model.*_double_quant and model.expert_format as the adapter was trained (moe_qlora.json); {} (the
    defaults) for adapters from elsewhere, which do not say. A record without expert_format was written before
    experts could be kept in MXFP4: its experts were NF4."""
    from moe_qlora.model.peft_roundtrip import TRAINED_ON

    path = adapter_dir / TRAINED_ON
    if not path.exists():
        return {}
    try:
        recorded = dict(json.loads(path.read_text())["base_quantization"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AdapterReadError(f"{path}: not readable ({exc})") from None
    return {"expert_format": "nf4", **recorded}


def load_for_generation(
    adapter_dir: str | Path,
    console: Console,
    *,
    device: str = "auto",
    kernels: str = "auto",
    doing: str = "generate with",
):
    """(model with the adapter loaded, tokenizer); `doing`: what the caller does with it, said when refused."""
    from moe_qlora.model.build import build_policy, load_tokenizer

    adapter_dir = Path(adapter_dir)
    model_cfg, lora_cfg = policy_sections_for(adapter_dir, device=device, kernels=kernels, doing=doing)
    model_path, tokenizer = load_tokenizer(model_cfg)
    model, _, _ = build_policy(model_cfg, lora_cfg, model_path, console)
    model.eval()
    return model, tokenizer


@dataclass(frozen=True)
class Rendering:
    """How a typed prompt becomes tokens. mode: `raw` (as typed), `prompt` (inside the run's prompt prefix and
    suffix, as its prompt rows were), `chat` (a user turn after the run's system turn, through the chat template
    with the generation prompt, as its messages rows were). `source`: why this one, said to the user."""

    mode: str = "raw"
    prefix: str = ""
    suffix: str = ""
    system: str | None = None
    source: str = "as typed"

    def text(self, prompt: str) -> str:
        """The prompt inside the prefix and suffix, each added unless the prompt already has it (a suffix in part:
        a prompt ending in the first lines of the suffix gets the rest)."""
        if self.mode != "prompt":
            return prompt
        head = "" if prompt.startswith(self.prefix) else self.prefix
        kept = max(k for k in range(len(self.suffix) + 1) if prompt.endswith(self.suffix[:k]))
        return head + prompt + self.suffix[kept:]

    def messages(self, prompt: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, {"role": "user", "content": prompt}]

    def ids(self, tokenizer, prompt: str) -> torch.Tensor:
        """(1, L) token ids, tokenized as training tokenized its rows (data.examples)."""
        if self.mode != "chat":
            return tokenizer(self.text(prompt), return_tensors="pt").input_ids
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "--chat: the base model's tokenizer has no chat template; leave --chat out (the prompt "
                "as the run trained) or give --raw"
            )
        ids = tokenizer.apply_chat_template(
            self.messages(prompt), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
        return torch.tensor([ids])

    def stop_ids(self, tokenizer) -> list[int]:
        """Ids that end the answer beside EOS. In chat: the added token that closes an assistant turn in the
        template (Qwen's <|im_end|>, the builtin's <|end|>), which a model trained on messages emits, not EOS."""
        if self.mode != "chat":
            return []
        mark = "\x00answer\x00"  # no template writes it, so the text after it is what closes the turn
        turn = [*self.messages("?"), {"role": "assistant", "content": mark}]
        closing = tokenizer.apply_chat_template(turn, tokenize=False).split(mark, 1)[-1]
        ids = tokenizer(closing, add_special_tokens=False).input_ids
        return ids[:1] if ids and ids[0] in tokenizer.get_added_vocab().values() else []

    def describe(self, prompt: str) -> str:
        """One line for the user: what the model is given, and where that rendering came from."""
        if self.mode == "chat":
            return f"prompt: the chat template around {self.messages(prompt)}, {self.source}"
        return f"prompt: {self.text(prompt)!r}, {self.source}"


def rendering_for(adapter_dir: str | Path, *, chat: bool = False, raw: bool = False) -> Rendering:
    """The rendering asked for (--chat, --raw), else the one the adapter's run trained with (moe_qlora.json's
    prompt_format: its most common row kind), else the prompt as typed for adapters that do not record it."""
    from moe_qlora.export.prompt_format import read_prompt_format
    from moe_qlora.model.peft_roundtrip import TRAINED_ON

    if chat and raw:
        raise ConfigError("give --chat or --raw, not both")
    if raw:
        return Rendering(source="as typed (--raw)")
    trained = read_prompt_format(adapter_dir)
    system = trained.system if trained else None
    if chat:
        return Rendering("chat", system=system, source="--chat" + (" with the run's system turn" if system else ""))
    if trained is None:
        return Rendering(
            source=f"as typed: {Path(adapter_dir) / TRAINED_ON} does not record how the run rendered "
            "its prompts (--chat: the chat template)"
        )
    rows = f"{trained.rows.get(trained.kind, 0)} of its {sum(trained.rows.values())} sampled rows"
    if trained.kind == "chat":
        return Rendering("chat", system=system, source=f"as the run's messages rows were ({rows}; --raw: as typed)")
    if trained.kind == "text":
        return Rendering(source=f"as typed: the run trained on text rows ({rows}; --chat: the chat template)")
    return Rendering(
        "prompt",
        trained.prefix,
        trained.suffix,
        source=f"as the run's prompt rows were ({rows}; --raw: as typed, --chat: the chat template)",
    )


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompt: str,
    sampling: Sampling,
    *,
    rendering: Rendering = Rendering(),
    adapter: bool = True,
    stream: bool = True,
) -> str:
    """The completion of `prompt`, rendered as `rendering` says (printed as it comes when `stream`)."""
    torch.manual_seed(sampling.seed)
    ids = rendering.ids(tokenizer, prompt).to(next(model.parameters()).device)
    greedy = sampling.temperature == 0
    gen = GenerationConfig(
        do_sample=not greedy,
        temperature=None if greedy else sampling.temperature,
        top_p=None if greedy else sampling.top_p,
        top_k=None if greedy else sampling.top_k,
        max_new_tokens=sampling.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id, *rendering.stop_ids(tokenizer)],
        use_cache=True,
    )
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    off = adapters_disabled(model) if not adapter else contextlib.nullcontext()
    with off, generation_kernels(model):
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen, streamer=streamer
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
