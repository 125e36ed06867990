"""The trainer's optimizer: AdamW over the stored (master) parameters, optionally without weight decay
on norms, biases and embeddings and with a learning rate of its own for some modules, and its
learning-rate schedule over the training steps."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from molt.config import MoltConfig


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
    # (parameter-name prefix, factor on lr): a module's own learning rate (train.lr_multipliers), e.g. a
    # vision tower that learns from scratch; the longest matching prefix wins; the schedule scales all alike.
    lr_multipliers: tuple[tuple[str, float], ...] = ()


def optimizer_settings(cfg: MoltConfig, *, lr: float | None = None) -> OptimizerSettings:
    """The train section's AdamW and schedule settings (lr: the critic's own peak, else train.learning_rate)."""
    train = cfg.train
    return OptimizerSettings(lr=train.learning_rate if lr is None else lr, betas=tuple(train.adam_betas),
                             eps=train.adam_eps, weight_decay=train.weight_decay,
                             no_weight_decay_on=tuple(train.no_weight_decay_on), schedule=train.lr_schedule,
                             num_steps=train.num_steps, warmup_steps=train.warmup_steps,
                             min_lr_ratio=train.min_lr_ratio,
                             # The critic (its own lr) has other parameter names: the multipliers are the actor's.
                             lr_multipliers=tuple(train.lr_multipliers.items()) if lr is None else ())


def classify_parameter(module: nn.Module, name: str, parameter: nn.Parameter) -> str | None:
    """'embeddings', 'norms' or 'biases' for a parameter of `module` (its direct owner), else None."""
    if isinstance(module, nn.Embedding):
        return "embeddings"
    if "norm" in type(module).__name__.lower():  # LayerNorm, RMSNorm, Qwen3RMSNorm, ...
        return "norms"
    if name == "bias":
        return "biases"
    return None


def group_parameters(model: nn.Module, settings: OptimizerSettings) -> list[dict]:
    """AdamW's parameter groups: trainable parameters, each once (a tied LM head shares the
    embedding's), by learning-rate factor and whether they decay; the decayed group at factor 1 first."""
    factors = sorted(settings.lr_multipliers, key=lambda item: -len(item[0]))
    matched: set[str] = set()
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {(1.0, True): []}
    seen = set()
    for module_name, module in model.named_modules():
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen or not parameter.requires_grad:
                continue
            seen.add(id(parameter))
            full_name = f"{module_name}.{name}" if module_name else name
            prefix, factor = next(((p, f) for p, f in factors if full_name.startswith(p)), ("", 1.0))
            matched.add(prefix)
            decays = classify_parameter(module, name, parameter) not in settings.no_weight_decay_on
            groups.setdefault((factor, decays), []).append(parameter)
    unmatched = [prefix for prefix, _ in settings.lr_multipliers if prefix not in matched]
    if unmatched:
        names = [name for name, _ in model.named_parameters()]
        raise ValueError(f"train.lr_multipliers: no trainable parameter name starts with {unmatched}; names look like "
                         f"{names[:2]} ... {names[-1:]}")
    return [{"params": params, "lr": settings.lr * factor, "weight_decay": settings.weight_decay if decays else 0.0}
            for (factor, decays), params in groups.items() if params or (factor, decays) == (1.0, True)]


def build_optimizer(model: nn.Module, settings: OptimizerSettings) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW (its state in the parameters' dtype: the master dtype) and the LR schedule."""
    optimizer = torch.optim.AdamW(group_parameters(model, settings), lr=settings.lr, betas=settings.betas,
                                  eps=settings.eps)
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
