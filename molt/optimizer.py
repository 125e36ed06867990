"""The trainer's optimizer: AdamW over the stored (master) parameters, optionally without weight decay
on norms, biases and embeddings, and its learning-rate schedule over the training steps."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """train.learning_rate and the AdamW and schedule fields, for one trained model."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    no_weight_decay_on: tuple[str, ...] = ()  # any of norms, biases, embeddings
    schedule: str = "constant"  # constant | linear | cosine
    num_steps: int = 1
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


def classify_parameter(module: nn.Module, name: str, parameter: nn.Parameter) -> str | None:
    """'embeddings', 'norms' or 'biases' for a parameter of `module` (its direct owner), else None."""
    if isinstance(module, nn.Embedding):
        return "embeddings"
    if "norm" in type(module).__name__.lower():  # LayerNorm, RMSNorm, Qwen3RMSNorm, ...
        return "norms"
    if name == "bias":
        return "biases"
    return None


def split_weight_decay(model: nn.Module, exempt: tuple[str, ...]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, exempt) trainable parameters, each once (a tied LM head shares the embedding's)."""
    decayed, exempted, seen = [], [], set()
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen or not parameter.requires_grad:
                continue
            seen.add(id(parameter))
            (exempted if classify_parameter(module, name, parameter) in exempt else decayed).append(parameter)
    return decayed, exempted


def build_optimizer(model: nn.Module, settings: OptimizerSettings) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW (its state in the parameters' dtype: the master dtype) and the LR schedule."""
    decayed, exempted = split_weight_decay(model, settings.no_weight_decay_on)
    groups = [{"params": decayed, "weight_decay": settings.weight_decay}]
    if exempted:
        groups.append({"params": exempted, "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, eps=settings.eps)
    return optimizer, LambdaLR(optimizer, lambda completed: lr_factor(completed + 1, settings))


def lr_factor(step: int, settings: OptimizerSettings) -> float:
    """The learning rate of training step `step` (1-based) as a share of the peak.

    With e = step - 1 steps done before it, W = warmup_steps, N = num_steps and m = min_lr_ratio:
    warmup, e < W: (e + 1) / W. After it, with progress p = (e - W) / (N - W) in [0, 1): constant 1;
    linear m + (1 - m)(1 - p); cosine m + (1 - m)(1 + cos(pi p)) / 2. So the first step after warmup
    runs at the peak and the decay would reach m x the peak one step after the last. (Loshchilov
    and Hutter 2017, "SGDR", arXiv:1608.03983, for the cosine shape.)
    """
    done, warmup, floor = step - 1, settings.warmup_steps, settings.min_lr_ratio
    if done < warmup:
        return (done + 1) / warmup
    if settings.schedule == "constant":
        return 1.0
    progress = min(1.0, (done - warmup) / max(1, settings.num_steps - warmup))
    if settings.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    if settings.schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr schedule {settings.schedule!r}: use constant, linear or cosine")
