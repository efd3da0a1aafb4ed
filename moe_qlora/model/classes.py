"""Which transformers class trains a config on text: its causal LM, or, for a multimodal MoE whose text model is
a MoE causal LM (Mistral-4, Qwen3-VL-MoE), the image-text-to-text class transformers uses for it, run on text
alone. Loading, planning, the tiny models and PEFT's skeletons all build models through here."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

TEXT_AUTO_CLASSES = (AutoModelForCausalLM, AutoModelForImageTextToText)


def text_generation_class(config):
    """The class for `config` (None if transformers has neither a causal LM nor an image-text-to-text one)."""
    for auto in TEXT_AUTO_CLASSES:
        try:
            return auto._model_mapping[type(config)]
        except KeyError:
            continue
    return None


def text_model_from_config(config, **kwargs):
    """`from_config` through the first auto class that knows `config` (AutoModelForCausalLM first: it also
    builds the text model of a multimodal config it lists for compatibility)."""
    known = [auto for auto in TEXT_AUTO_CLASSES if type(config) in auto._model_mapping]
    return (known or [AutoModelForCausalLM])[0].from_config(config, **kwargs)
