"""What the trainer needs to know about a vision-language model beyond a causal LM: its auto class,
where its decoder blocks and its vision tower are, and how the processor's image tensors enter its
forward. Keyed by the config's model_type; a text model passes through unchanged.

Supported: Idefics3 (SmolVLM v1). A Llama-style text tower under `model.model.text_model`, a
SigLIP-style vision tower under `model.model.vision_model`, a connector that pixel-shuffles and
projects its patches, and an LM head `lm_head`. Its forward flattens batch x images into one list of
tiles and scatters their features into the `<image>` positions in row-major order, so the tiles of a
whole micro-batch, padded or packed, go in as one leading batch of 1.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

# model_type -> (path of the text tower under the model, path of the vision tower)
VISION_LANGUAGE_MODELS = {"idefics3": ("model.text_model", "model.vision_model")}


def is_vision_language(config: PretrainedConfig) -> bool:
    """A config with a vision tower (`vision_config`), whether or not Molt supports it."""
    return getattr(config, "vision_config", None) is not None


def check_supported(config: PretrainedConfig) -> None:
    if is_vision_language(config) and config.model_type not in VISION_LANGUAGE_MODELS:
        raise ValueError(f"model_type {config.model_type!r} is a vision-language model Molt's trainer does not know; "
                         f"supported: {', '.join(sorted(VISION_LANGUAGE_MODELS))} (molt/models/vision_language.py says how "
                         f"to add one: where its text tower is and how its image tensors enter the forward)")


def auto_model_class(config: PretrainedConfig) -> type:
    """AutoModelForImageTextToText for a vision-language config, else AutoModelForCausalLM."""
    check_supported(config)
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def text_backbone(model: nn.Module) -> nn.Module:
    """The decoder stack (with `.layers`, `.embed_tokens`, `.norm`): `model.model` of a causal LM,
    the text tower of a vision-language model."""
    check_supported(model.config)
    if not is_vision_language(model.config):
        return model.model
    return model.get_submodule(VISION_LANGUAGE_MODELS[model.config.model_type][0])


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder of a vision-language model; None for a text model."""
    check_supported(model.config)
    if not is_vision_language(model.config):
        return None
    return model.get_submodule(VISION_LANGUAGE_MODELS[model.config.model_type][1])


def format_image_inputs(config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The forward's keyword arguments for a micro-batch's image tensors, concatenated over its images
    along dim 0 in the order the model reads their placeholders (molt.trainer.batch.MicroBatch.image_inputs).

    Idefics3: `pixel_values` [1, tiles, 3, H, W] and `pixel_attention_mask` [1, tiles, H, W]."""
    if config.model_type == "idefics3":
        return {name: tensors[name].unsqueeze(0) for name in ("pixel_values", "pixel_attention_mask")
                if name in tensors}
    check_supported(config)
    raise ValueError(f"{config.model_type!r} is a text model; its micro-batches cannot carry images "
                     f"({sorted(tensors)}): point model_path at a vision-language model")
